//! The CSI drivers under the kubelet tier: a real kubelet 1.20.2 finds the
//! agent's registration sockets (no registrar sidecar), lists the drivers
//! in its CSINode, and mounts a CSI PV of `local-pv.csi.volagent.io` for a
//! pod through NodeStage and NodePublish; a backend dropped in while the
//! agent runs becomes a driver a new pod uses; a block-mode claim is a
//! device in the container; a PV's mount options reach its mount. Needs
//! root and the kubelet tier's assets; fails (never skips) without them.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use kube::api::{Api, PostParams};
use std::time::{Duration, Instant};
use volagent_test_support::kubelet_cluster::*;
use volagent_test_support::{Deadline, wait_until_or};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// The CSIDriver objects of deploy/csidrivers.yaml, as shipped.
fn shipped_csi_drivers() -> Vec<CSIDriver> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/csidrivers.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

/// The drivers kubelet lists in node `node`'s CSINode.
fn csinode_drivers(c: &Cluster, node: &str) -> Vec<String> {
    let api: Api<CSINode> = Api::all(c.client());
    c.rt.block_on(api.get_opt(node))
        .unwrap()
        .map(|n| n.spec.drivers.into_iter().map(|d| d.name).collect())
        .unwrap_or_default()
}

fn wait_driver(c: &Cluster, node: &str, driver: &str) {
    wait_until_or(
        Deadline::within(Duration::from_secs(60)).polling(Duration::from_millis(250)),
        &format!("kubelet to register {driver}"),
        || csinode_drivers(c, node).iter().any(|d| d == driver),
        || {
            format!(
                "CSINode lists {:?}\nkubelet: {}\nagent: {}",
                csinode_drivers(c, node),
                tail_matching(c.node(node).kubelet().log(), "csi", 30),
                tail(&c.node(node).agent_log())
            )
        },
    );
}

/// No mount of the volume left below the node's kubelet root.
fn assert_unmounted(c: &Cluster, node: &str, volume: &str) {
    let root = c.node(node).kubelet_root();
    let left = || -> Vec<std::path::PathBuf> {
        c.mounts_below(&root).into_iter().filter(|m| m.to_string_lossy().contains(volume)).collect()
    };
    let start = Instant::now();
    while (!left().is_empty() || !c.scratch.loops_left().is_empty() || c.record(volume).is_some())
        && start.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(left().is_empty(), "mounts of {volume} left: {:?}", left());
    assert!(c.scratch.loops_left().is_empty(), "loop devices left: {:?}", c.scratch.loops());
    assert!(c.record(volume).is_none(), "the record of {volume} is left");
}

#[test]
fn a_csi_volume_serves_pods_and_a_dropped_in_backend_becomes_a_driver() {
    let c = Cluster::start(
        VOLAGENT,
        &[("node-a", &[])],
        &[(volagent_test_artifacts::LOCAL_PV, "local-pv")],
    );
    let drivers: Api<CSIDriver> = Api::all(c.client());
    let shipped = shipped_csi_drivers();
    assert!(shipped.iter().any(|d| d.metadata.name.as_deref() == Some("local-pv.csi.volagent.io")));
    for d in &shipped {
        let spec = &d.spec;
        assert_eq!(
            (spec.attach_required, spec.pod_info_on_mount),
            (Some(false), Some(true)),
            "{:?}",
            d.metadata.name
        );
        c.rt.block_on(drivers.create(&PostParams::default(), d)).unwrap();
    }
    wait_driver(&c, "node-a", "local-pv.csi.volagent.io");
    let csinode: CSINode = c.rt.block_on(Api::all(c.client()).get("node-a")).unwrap();
    let entry = csinode.spec.drivers.iter().find(|d| d.name == "local-pv.csi.volagent.io").unwrap();
    assert_eq!(entry.node_id, "node-a");
    assert_eq!(
        entry.topology_keys.as_deref(),
        Some(&["topology.volagent.io/node".to_string()][..])
    );

    let image = c.image("csi.img", 64);
    c.create_csi_volume(
        "csi-data",
        "local-pv.csi.volagent.io",
        "ReadWriteOnce",
        &[("path", &image), ("node", "node-a")],
    );
    c.create_pod(pod(
        "writer",
        "node-a",
        "date +%s%N > /data/note && cat /data/note > /dev/termination-log",
        &[("data", claim("csi-data"))],
    ));
    let done = c.wait_pod("writer", "Succeeded", |p| phase(p) == "Succeeded");
    let written = output(done.as_ref()).expect("the writer's output");
    assert!(written.trim().len() > 10, "{written:?}");
    let ops: Vec<String> = std::fs::read_to_string(c.node("node-a").agent_log())
        .unwrap()
        .lines()
        .filter(|l| l.contains("csi call done"))
        .map(String::from)
        .collect();
    assert!(
        ops.iter().any(|l| l.contains("csi_stage"))
            && ops.iter().any(|l| l.contains("csi_publish")),
        "kubelet staged and published through CSI: {ops:?}"
    );
    c.delete_pod("writer");
    assert_unmounted(&c, "node-a", "csi-data");

    c.create_pod(pod(
        "reader",
        "node-a",
        "cat /data/note > /dev/termination-log",
        &[("data", claim("csi-data"))],
    ));
    let read = c.wait_pod("reader", "Succeeded", |p| phase(p) == "Succeeded");
    assert_eq!(
        output(read.as_ref()).unwrap().trim(),
        written.trim(),
        "the next pod reads what the first wrote"
    );
    c.delete_pod("reader");
    assert_unmounted(&c, "node-a", "csi-data");

    // A backend dropped in while the agent runs: kubelet registers its
    // driver, and a pod uses it — no restart of anything.
    assert!(!csinode_drivers(&c, "node-a").iter().any(|d| d == "shared-file.csi.volagent.io"));
    let plugins = c.node("node-a").plugin_dir();
    std::fs::copy(volagent_test_artifacts::SHARED_FILE, plugins.join(".shared-file.wasm")).unwrap();
    std::fs::rename(plugins.join(".shared-file.wasm"), plugins.join("shared-file.wasm")).unwrap();
    wait_driver(&c, "node-a", "shared-file.csi.volagent.io");
    let mut extra = shipped[0].clone();
    extra.metadata = kube::api::ObjectMeta {
        name: Some("shared-file.csi.volagent.io".into()),
        ..Default::default()
    };
    c.rt.block_on(drivers.create(&PostParams::default(), &extra)).unwrap();
    let image = c.image("shared.img", 64);
    c.create_csi_volume(
        "csi-shared",
        "shared-file.csi.volagent.io",
        "ReadWriteOnce",
        &[("path", &image)],
    );
    c.create_pod(pod(
        "newcomer",
        "node-a",
        "echo hello > /data/x && cat /data/x > /dev/termination-log",
        &[("data", claim("csi-shared"))],
    ));
    let p = c.wait_pod("newcomer", "Succeeded", |p| phase(p) == "Succeeded");
    assert_eq!(output(p.as_ref()).unwrap().trim(), "hello");
    c.delete_pod("newcomer");
    assert_unmounted(&c, "node-a", "csi-shared");
}

/// A block-mode PVC of a CSI PV: the container gets the volume as a device
/// (`/dev/xvda`), writes through it, and a later pod reads it back; the
/// bytes are in the volume's file. A PV's `mountOptions` reach the mount
/// (the policy passes them on; the host checks each). (ReadWriteOncePod
/// needs kubelet 1.22 or later; this tier's kubelet is 1.20.)
#[test]
fn a_block_volume_is_a_device_in_the_container_and_mount_options_reach_the_mount() {
    let c = Cluster::start(
        VOLAGENT,
        &[("node-a", &[])],
        &[(volagent_test_artifacts::LOCAL_PV, "local-pv")],
    );
    let drivers: Api<CSIDriver> = Api::all(c.client());
    for d in shipped_csi_drivers() {
        c.rt.block_on(drivers.create(&PostParams::default(), &d)).unwrap();
    }
    wait_driver(&c, "node-a", "local-pv.csi.volagent.io");

    let image = c.image("blk.img", 64);
    c.create_csi_block_volume(
        "csi-blk",
        "local-pv.csi.volagent.io",
        "ReadWriteOnce",
        &[("path", &image), ("node", "node-a")],
    );
    let write = "printf 'raw-from-a-pod' | dd of=/dev/xvda bs=4096 seek=1 conv=notrunc,fsync 2>/dev/null && test -b /dev/xvda && echo ok > /dev/termination-log";
    c.create_pod(block_pod("blk-writer", "node-a", write, "csi-blk"));
    let done = c.wait_pod("blk-writer", "Succeeded", |p| phase(p) == "Succeeded");
    assert_eq!(output(done.as_ref()).expect("the writer's output").trim(), "ok");
    c.delete_pod("blk-writer");
    let read =
        "dd if=/dev/xvda bs=4096 skip=1 count=1 2>/dev/null | head -c 14 > /dev/termination-log";
    c.create_pod(block_pod("blk-reader", "node-a", read, "csi-blk"));
    let done = c.wait_pod("blk-reader", "Succeeded", |p| phase(p) == "Succeeded");
    assert_eq!(output(done.as_ref()).expect("the reader's output"), "raw-from-a-pod");
    c.delete_pod("blk-reader");
    let bytes = std::fs::read(&image).unwrap();
    assert_eq!(&bytes[4096..4096 + 14], b"raw-from-a-pod", "the bytes are in the volume's file");
    // kubelet tears a deleted pod's volumes down after the pod is gone.
    let log = c.node("node-a").agent_log();
    wait_until_or(
        Deadline::within(Duration::from_secs(60)).polling(Duration::from_millis(250)),
        "kubelet to unstage the block volume",
        || {
            let ops = std::fs::read_to_string(&log).unwrap_or_default();
            ops.lines()
                .any(|l| {
                    l.contains("csi call done")
                        && l.contains("csi_unstage")
                        && l.contains("csi-blk")
                })
                .then_some(())
        },
        || tail(&log),
    );

    let image = c.image("opts.img", 64);
    c.create_csi_volume_with_options(
        "csi-opts",
        "local-pv.csi.volagent.io",
        "ReadWriteOnce",
        &[("path", &image), ("node", "node-a")],
        &["noatime"],
    );
    c.create_pod(pod(
        "opts",
        "node-a",
        "grep ' /data ' /proc/mounts > /dev/termination-log",
        &[("data", claim("csi-opts"))],
    ));
    let done = c.wait_pod("opts", "Succeeded", |p| phase(p) == "Succeeded");
    let line = output(done.as_ref()).expect("the mount line");
    assert!(line.contains("noatime"), "the PV's mount option is on the mount: {line}");
    c.delete_pod("opts");
    assert_unmounted(&c, "node-a", "csi-opts");
}
