//! Shared by the tests against a real kube-apiserver: the CRDs installed,
//! Nodes and PVs as a cluster would have them.
#![allow(dead_code)]

use k8s_openapi::api::core::v1::{FlexPersistentVolumeSource, Node, NodeCondition, NodeSpec, NodeStatus, PersistentVolume, PersistentVolumeSpec, Taint};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use std::time::{Duration, Instant};

/// Apply volagent's CRDs and wait until each is Established.
pub async fn install_crds(client: &kube::Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (_, yaml) in volagent::kube::crds::all() {
        let crd: CustomResourceDefinition = serde_norway::from_str(&yaml).expect("generated CRD parses");
        let name = crd.metadata.name.clone().expect("named");
        api.patch(&name, &PatchParams::apply("volagent-tests").force(), &Patch::Apply(&crd)).await.expect("apply CRD");
        let start = Instant::now();
        loop {
            let c = api.get(&name).await.expect("get CRD");
            let established = c.status.and_then(|s| s.conditions).unwrap_or_default().iter().any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "CRD {name} not Established");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A Node object with the Ready condition set as given.
pub async fn create_node(client: &kube::Client, name: &str, ready: bool) {
    let api: Api<Node> = Api::all(client.clone());
    let node = Node { metadata: ObjectMeta { name: Some(name.into()), ..Default::default() }, ..Default::default() };
    api.create(&PostParams::default(), &node).await.expect("create node");
    set_ready(client, name, ready).await;
}

pub async fn set_ready(client: &kube::Client, name: &str, ready: bool) {
    let api: Api<Node> = Api::all(client.clone());
    let status = NodeStatus {
        conditions: Some(vec![NodeCondition { type_: "Ready".into(), status: if ready { "True" } else { "False" }.into(), ..Default::default() }]),
        ..Default::default()
    };
    let patch = serde_json::json!({ "status": status });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.expect("node status");
}

pub async fn taint_out_of_service(client: &kube::Client, name: &str) {
    let api: Api<Node> = Api::all(client.clone());
    let spec = NodeSpec {
        taints: Some(vec![Taint { key: "node.kubernetes.io/out-of-service".into(), value: Some("nodeshutdown".into()), effect: "NoExecute".into(), ..Default::default() }]),
        ..Default::default()
    };
    api.patch(name, &PatchParams::default(), &Patch::Merge(&serde_json::json!({ "spec": spec }))).await.expect("taint");
}

pub async fn delete_node(client: &kube::Client, name: &str) {
    let api: Api<Node> = Api::all(client.clone());
    api.delete(name, &Default::default()).await.expect("delete node");
}

/// A PV of a Flexvolume driver `volagent/<backend>` with one access mode.
pub async fn create_pv(client: &kube::Client, name: &str, backend: &str, mode: &str, options: &[(&str, &str)]) {
    let api: Api<PersistentVolume> = Api::all(client.clone());
    let pv = PersistentVolume {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        spec: Some(PersistentVolumeSpec {
            access_modes: Some(vec![mode.into()]),
            capacity: Some([("storage".to_string(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("64Mi".into()))].into()),
            flex_volume: Some(FlexPersistentVolumeSource {
                driver: format!("volagent/{backend}"),
                fs_type: Some("ext4".into()),
                options: Some(options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    api.create(&PostParams::default(), &pv).await.expect("create PV");
}
