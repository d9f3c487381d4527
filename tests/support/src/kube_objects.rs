//! Shared by the tests against a real kube-apiserver: CRDs Established,
//! Nodes and PVs as a cluster would have them.

use crate::wait::{Deadline, wait_until_async};
use k8s_openapi::api::core::v1::{
    FlexPersistentVolumeSource, Node, NodeCondition, NodeSpec, NodeStatus, PersistentVolume,
    PersistentVolumeSpec, Taint,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use std::time::Duration;

/// Wait until CRD `name` is Established (30 s at most).
pub async fn wait_established(client: &kube::Client, name: &str) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let deadline = Deadline::within(Duration::from_secs(30)).polling(Duration::from_millis(50));
    wait_until_async(deadline, &format!("CRD {name} to be Established"), || async {
        let c = api.get(name).await.expect("get CRD");
        c.status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
    })
    .await;
}

/// A Node object with the Ready condition set as given.
pub async fn create_node(client: &kube::Client, name: &str, ready: bool) {
    let api: Api<Node> = Api::all(client.clone());
    let labels = [("kubernetes.io/hostname".to_string(), name.to_string())].into();
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels),
            ..Default::default()
        },
        ..Default::default()
    };
    api.create(&PostParams::default(), &node).await.expect("create node");
    set_ready(client, name, ready).await;
}

pub async fn set_ready(client: &kube::Client, name: &str, ready: bool) {
    let api: Api<Node> = Api::all(client.clone());
    let status = NodeStatus {
        conditions: Some(vec![NodeCondition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let patch = serde_json::json!({ "status": status });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("node status");
}

pub async fn taint_out_of_service(client: &kube::Client, name: &str) {
    let api: Api<Node> = Api::all(client.clone());
    let spec = NodeSpec {
        taints: Some(vec![Taint {
            key: "node.kubernetes.io/out-of-service".into(),
            value: Some("nodeshutdown".into()),
            effect: "NoExecute".into(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    api.patch(name, &PatchParams::default(), &Patch::Merge(&serde_json::json!({ "spec": spec })))
        .await
        .expect("taint");
}

pub async fn delete_node(client: &kube::Client, name: &str) {
    let api: Api<Node> = Api::all(client.clone());
    api.delete(name, &Default::default()).await.expect("delete node");
}

/// The claim `create_pv` binds its PV to, in namespace `default`.
pub fn claim_of(pv: &str) -> String {
    format!("claim-{pv}")
}

/// A PV of a Flexvolume driver `volagent/<backend>` with one access mode,
/// bound to the claim [`claim_of`] it in `default` (made here too), as the
/// PV controller would bind them.
pub async fn create_pv(
    client: &kube::Client,
    name: &str,
    backend: &str,
    mode: &str,
    options: &[(&str, &str)],
) {
    create_pv_with(client, name, backend, mode, options, None).await;
}

/// [`create_pv`] with node affinity to `node` (by `kubernetes.io/hostname`).
pub async fn create_pv_with(
    client: &kube::Client,
    name: &str,
    backend: &str,
    mode: &str,
    options: &[(&str, &str)],
    node: Option<&str>,
) {
    use k8s_openapi::api::core::v1::{
        NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference,
        PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeNodeAffinity,
    };
    let claim = claim_of(name);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let pvc = PersistentVolumeClaim {
        metadata: ObjectMeta { name: Some(claim.clone()), ..Default::default() },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![mode.into()]),
            volume_name: Some(name.into()),
            resources: Some(k8s_openapi::api::core::v1::VolumeResourceRequirements {
                requests: Some(
                    [(
                        "storage".to_string(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity("64Mi".into()),
                    )]
                    .into(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let created = claims.create(&PostParams::default(), &pvc).await.expect("create PVC");
    let affinity = node.map(|n| VolumeNodeAffinity {
        required: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: "kubernetes.io/hostname".into(),
                    operator: "In".into(),
                    values: Some(vec![n.into()]),
                }]),
                match_fields: None,
            }],
        }),
    });
    let api: Api<PersistentVolume> = Api::all(client.clone());
    let pv = PersistentVolume {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        spec: Some(PersistentVolumeSpec {
            claim_ref: Some(ObjectReference {
                namespace: Some("default".into()),
                name: Some(claim),
                uid: created.metadata.uid.clone(),
                ..Default::default()
            }),
            node_affinity: affinity,
            access_modes: Some(vec![mode.into()]),
            capacity: Some(
                [(
                    "storage".to_string(),
                    k8s_openapi::apimachinery::pkg::api::resource::Quantity("64Mi".into()),
                )]
                .into(),
            ),
            flex_volume: Some(FlexPersistentVolumeSource {
                driver: format!("volagent/{backend}"),
                fs_type: Some("ext4".into()),
                options: Some(
                    options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    api.create(&PostParams::default(), &pv).await.expect("create PV");
}

/// An inline Flexvolume volume of a pod: its name, backend and options.
pub type Inline<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

/// A pod in `default` that uses the claims of `pvs` and the inline volumes
/// `inline`; its UID.
pub async fn create_pod(
    client: &kube::Client,
    name: &str,
    pvs: &[&str],
    inline: &[Inline<'_>],
) -> String {
    use k8s_openapi::api::core::v1::{
        Container, FlexVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodSpec, Volume,
    };
    let mut volumes: Vec<Volume> = pvs
        .iter()
        .map(|pv| Volume {
            name: format!("v-{pv}"),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim_of(pv),
                read_only: None,
            }),
            ..Default::default()
        })
        .collect();
    for (volume, backend, options) in inline {
        volumes.push(Volume {
            name: volume.to_string(),
            flex_volume: Some(FlexVolumeSource {
                driver: format!("volagent/{backend}"),
                options: Some(
                    options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let pod = Pod {
        metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "c".into(),
                image: Some("busybox".into()),
                ..Default::default()
            }],
            volumes: Some(volumes),
            automount_service_account_token: Some(false),
            ..Default::default()
        }),
        ..Default::default()
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let created = api.create(&PostParams::default(), &pod).await.expect("create pod");
    created.metadata.uid.expect("the API server gives a UID")
}
