//! Local volumes under the kubelet tier: a real kubelet 1.20.2 and
//! containerd on two nodes, kube-scheduler and kube-controller-manager, the
//! agents discovering a file image each, and the volagent controller making
//! their PVs. A StatefulSet-like pair of pods, each with its claim on a
//! `WaitForFirstConsumer` class, is placed by the scheduler on the nodes
//! that have the volumes, writes, and is deleted with its claims; the
//! volumes come back wiped as new PVs. Needs root and the kubelet tier's
//! assets; fails (never skips) without them.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use serde_json::json;
use std::time::{Duration, Instant};
use volagent_test_support::kubelet_cluster::*;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const CLASS: &str = "local-wffc";

fn pv_phase(pv: &PersistentVolume) -> String {
    pv.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default()
}

/// Claim `claim` (32 MiB of `class`) and pod `pod`, placed by the
/// scheduler, which writes `marker` to it and says it back.
fn claim_and_pod(c: &Cluster, claim: &str, pod_name: &str, class: &str, marker: &str) {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": { "name": claim },
        "spec": { "accessModes": ["ReadWriteOnce"], "storageClassName": class,
                  "resources": { "requests": { "storage": "32Mi" } } }
    }))
    .unwrap();
    c.rt.block_on(claims.create(&PostParams::default(), &pvc)).unwrap();
    let script =
        format!("echo {marker} > /data/marker && sync && cat /data/marker > /dev/termination-log");
    let volume = json!({ "persistentVolumeClaim": { "claimName": claim } });
    let mut pod = pod(pod_name, "", &script, &[("data", volume)]);
    pod["spec"].as_object_mut().unwrap().remove("nodeName");
    c.create_pod(pod);
}

/// Once pod `pod` of [`claim_and_pod`] ran and said its marker: the node it
/// ran on and its claim's PV.
fn ran(c: &Cluster, claim: &str, pod: &str, marker: &str) -> (String, PersistentVolume) {
    let p = c
        .wait_pod(pod, "Succeeded", |p| phase(p) == "Succeeded" || phase(p) == "Failed")
        .expect("the pod");
    assert_eq!(phase(Some(&p)), "Succeeded", "{}", c.diagnose(pod, Some(&p)));
    assert_eq!(output(Some(&p)).as_deref().map(str::trim), Some(marker));
    let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");
    let claim = c.rt.block_on(claims.get(claim)).unwrap();
    let pvs: Api<PersistentVolume> = Api::all(c.client());
    (node, c.rt.block_on(pvs.get(&claim.spec.unwrap().volume_name.unwrap())).unwrap())
}

/// Two nodes whose agents serve local-pv, and kube-scheduler.
fn two_nodes_and_a_scheduler() -> (Cluster, volagent_kube_env::node::Scheduler) {
    let c = Cluster::start(
        VOLAGENT,
        &[("node-a", &[]), ("node-b", &[])],
        &[(volagent_test_artifacts::LOCAL_PV, "local-pv")],
    );
    let scheduler = volagent_kube_env::node::Scheduler::start(
        c.env(),
        &c.scratch.path(""),
        &c.assets,
        Some(c.ns.clone()),
    )
    .expect("kube-scheduler");
    (c, scheduler)
}

#[test]
fn a_pair_of_pods_lands_on_the_volumes_nodes_and_the_volumes_come_back_wiped() {
    let (mut c, _scheduler) = two_nodes_and_a_scheduler();
    let sc = StorageClass {
        metadata: ObjectMeta { name: Some(CLASS.into()), ..Default::default() },
        provisioner: "kubernetes.io/no-provisioner".into(),
        reclaim_policy: Some("Delete".into()),
        volume_binding_mode: Some("WaitForFirstConsumer".into()),
        parameters: Some([("wipe".to_string(), "zero".to_string())].into()),
        ..Default::default()
    };
    let client = c.client();
    c.rt.block_on(Api::<StorageClass>::all(client.clone()).create(&PostParams::default(), &sc))
        .unwrap();
    // One file image on each node, found by its agent.
    let mut images = Vec::new();
    for node in ["node-a", "node-b"] {
        let dir = c.scratch.path(&format!("local-{node}"));
        std::fs::create_dir_all(&dir).unwrap();
        images.push(c.scratch.image(&format!("local-{node}/disk.img"), 64));
        let class = format!("{CLASS}={}", dir.display());
        c.set_agent_args(node, &["--local-class", &class, "--local-scan-interval", "1s"]);
        c.kill_agent(node);
        c.start_agent(node, &[]);
    }
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let local = || {
        c.rt.block_on(
            pvs.list(&ListParams::default().labels(volagent::kube::local_pvs::NODE_LABEL)),
        )
        .unwrap()
        .items
    };
    let wait = |what: &str, secs: u64, done: &mut dyn FnMut() -> bool| {
        let start = Instant::now();
        while !done() {
            let pvs_now: Vec<_> = local()
                .iter()
                .map(|p| {
                    (
                        p.metadata.name.clone(),
                        pv_phase(p),
                        p.metadata.finalizers.clone(),
                        p.metadata.deletion_timestamp.is_some(),
                    )
                })
                .collect();
            let claims_now =
                c.rt.block_on(
                    Api::<PersistentVolumeClaim>::namespaced(client.clone(), "default")
                        .list(&Default::default()),
                )
                .map(|l| {
                    l.items
                        .into_iter()
                        .map(|p| {
                            (
                                p.metadata.name,
                                p.metadata.finalizers,
                                p.metadata.deletion_timestamp.is_some(),
                                p.status.and_then(|s| s.phase),
                            )
                        })
                        .collect::<Vec<_>>()
                });
            assert!(
                start.elapsed() < Duration::from_secs(secs),
                "timed out waiting for {what}\nPVs: {pvs_now:?}\nclaims: {claims_now:?}\nkube-controller-manager: {}\ncontroller: {}\nnode-a: {}\nnode-b: {}",
                tail_matching(c.kcm.as_ref().unwrap().log(), "protection", 30),
                tail(&c.scratch.path("controller.log")),
                tail(&c.node("node-a").agent_log()),
                tail(&c.node("node-b").agent_log())
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    wait("a local PV on each node", 90, &mut || {
        local().iter().filter(|p| pv_phase(p) == "Available").count() == 2
    });
    let first: Vec<(String, String)> = local()
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap(), p.metadata.uid.clone().unwrap()))
        .collect();

    // The pair: claims data-web-0 and data-web-1, pods placed by the scheduler.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    for i in 0..2 {
        let marker = format!("volagent-local-marker-web-{i}");
        claim_and_pod(&c, &format!("data-web-{i}"), &format!("web-{i}"), CLASS, &marker);
    }
    let mut placed = Vec::new();
    for i in 0..2 {
        let marker = format!("volagent-local-marker-web-{i}");
        let (node, pv) = ran(&c, &format!("data-web-{i}"), &format!("web-{i}"), &marker);
        let pv_node = pv.metadata.labels.unwrap()[volagent::kube::local_pvs::NODE_LABEL].clone();
        assert_eq!(node, pv_node, "web-{i} runs where its volume is");
        placed.push(node);
    }
    placed.sort();
    assert_eq!(placed, ["node-a", "node-b"], "one pod on each node: each has one volume");
    for (i, img) in images.iter().enumerate() {
        let bytes = std::fs::read(img).unwrap();
        let marker = b"volagent-local-marker-web-";
        assert!(
            bytes.windows(marker.len()).any(|w| w == marker),
            "image {i} holds a pod's marker before the release"
        );
    }

    // Deleted with their claims: the volumes are wiped and offered again.
    for i in 0..2 {
        c.delete_pod(&format!("web-{i}"));
        c.rt.block_on(claims.delete(&format!("data-web-{i}"), &DeleteParams::default())).unwrap();
    }
    wait("both volumes back as new PVs", 180, &mut || {
        let now = local();
        now.len() == 2
            && now.iter().all(|p| {
                pv_phase(p) == "Available"
                    && !first.iter().any(|(_, uid)| p.metadata.uid.as_ref() == Some(uid))
            })
    });
    for img in &images {
        let bytes = std::fs::read(img).unwrap();
        let marker = b"volagent-local-marker-web-";
        assert!(!bytes.windows(marker.len()).any(|w| w == marker), "{} was zeroed", img.display());
    }
    let names: Vec<String> = local().iter().map(|p| p.metadata.name.clone().unwrap()).collect();
    for (name, _) in &first {
        assert!(names.contains(name), "the same volume, the same PV name: {names:?}");
    }
}

/// Dynamic local volumes under a real kubelet, with no sidecar: a
/// `WaitForFirstConsumer` class whose provisioner is local-pv's driver. Two
/// pods, each with its claim, are placed by kube-scheduler; the controller
/// gives each claim the discovered volume of the node the scheduler chose
/// (asking it to choose again when that node has none left), the pods
/// write through the agents' CSI driver, and once pods and claims are
/// deleted the volumes are wiped, their PVs gone, and nothing is left
/// mounted or attached on the nodes. Prints how long the pair took to run.
#[test]
fn dynamic_local_claims_get_the_chosen_nodes_volumes_and_give_them_back_wiped() {
    use k8s_openapi::api::storage::v1::CSIDriver;
    const DYNAMIC: &str = "local-dynamic";
    let (mut c, _scheduler) = two_nodes_and_a_scheduler();
    let client = c.client();
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/csidrivers.yaml"),
    )
    .unwrap();
    let drivers: Vec<CSIDriver> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let driver = drivers
        .iter()
        .find(|d| d.metadata.name.as_deref() == Some("local-pv.csi.volagent.io"))
        .unwrap();
    c.rt.block_on(Api::<CSIDriver>::all(client.clone()).create(&PostParams::default(), driver))
        .unwrap();
    let sc: StorageClass = serde_json::from_value(json!({
        "metadata": { "name": DYNAMIC },
        "provisioner": "local-pv.csi.volagent.io",
        "parameters": { "wipe": "zero" },
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "WaitForFirstConsumer",
    }))
    .unwrap();
    c.rt.block_on(Api::<StorageClass>::all(client.clone()).create(&PostParams::default(), &sc))
        .unwrap();
    let mut images = Vec::new();
    for node in ["node-a", "node-b"] {
        let dir = c.scratch.path(&format!("dyn-{node}"));
        std::fs::create_dir_all(&dir).unwrap();
        images.push(c.scratch.image(&format!("dyn-{node}/disk.img"), 64));
        let class = format!("{DYNAMIC}={}", dir.display());
        c.set_agent_args(node, &["--local-class", &class, "--local-scan-interval", "1s"]);
        c.kill_agent(node);
        c.start_agent(node, &[]);
    }
    c.start_provisioning_controller();

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let started = Instant::now();
    for i in 0..2 {
        let name = format!("dyn-{i}");
        claim_and_pod(&c, &name, &name, DYNAMIC, &format!("volagent-dynamic-marker-{i}"));
    }
    let mut placed = Vec::new();
    for i in 0..2 {
        let name = format!("dyn-{i}");
        let (node, pv) = ran(&c, &name, &name, &format!("volagent-dynamic-marker-{i}"));
        let csi = pv.spec.unwrap().csi.unwrap();
        assert_eq!(csi.volume_attributes.unwrap()["node"], node, "{name} runs where its volume is");
        placed.push(node);
    }
    println!("two dynamic local claims placed and their pods run in {:?}", started.elapsed());
    placed.sort();
    assert_eq!(placed, ["node-a", "node-b"], "one pod on each node: each has one volume");
    for img in &images {
        let bytes = std::fs::read(img).unwrap();
        let marker = b"volagent-dynamic-marker-";
        assert!(bytes.windows(marker.len()).any(|w| w == marker), "{} written", img.display());
    }

    for i in 0..2 {
        c.delete_pod(&format!("dyn-{i}"));
        c.rt.block_on(claims.delete(&format!("dyn-{i}"), &DeleteParams::default())).unwrap();
    }
    let asked = Instant::now();
    loop {
        let left = c.rt.block_on(pvs.list(&Default::default())).unwrap().items;
        let lists =
            c.rt.block_on(
                Api::<volagent::kube::crds::NodeLocalVolumes>::all(client.clone())
                    .list(&Default::default()),
            )
            .unwrap()
            .items;
        if left.is_empty() && lists.iter().all(|l| l.spec.operations.is_empty()) {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(180),
            "PVs left: {:?}\noperations: {:?}\ncontroller: {}",
            left.iter().map(|p| (p.metadata.name.clone(), p.status.clone())).collect::<Vec<_>>(),
            lists.iter().map(|l| (&l.spec, &l.status)).collect::<Vec<_>>(),
            tail(&c.scratch.path("controller.log"))
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    for img in &images {
        let bytes = std::fs::read(img).unwrap();
        let marker = b"volagent-dynamic-marker-";
        assert!(!bytes.windows(marker.len()).any(|w| w == marker), "{} was zeroed", img.display());
    }
    let attached = c.scratch.loops_left();
    assert!(attached.is_empty(), "no loop device left: {attached:?}");
}
