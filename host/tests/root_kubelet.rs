//! The kubelet tier: pods on volagent volumes through a real kubelet
//! 1.20.2 and containerd, on two nodes of a cluster in a box (see
//! support/kubelet_cluster.rs), checked from the pod's side: its phase, its
//! container's output and its Events. Needs root, the binaries from
//! scripts/kube-assets and what scripts/node-assets installs; fails (never
//! skips) without them.

mod common;
mod kube_common;
#[path = "support/kubelet_cluster.rs"]
mod kubelet_cluster;

use kubelet_cluster::*;
use std::time::Duration;

const LOCAL_PV: (&str, &str) = (volagent_test_artifacts::LOCAL_PV, "local-pv");
const SHARED_FILE: (&str, &str) = (volagent_test_artifacts::SHARED_FILE, "shared-file");

/// Nothing of `volume` is left on `node`: no mount below its kubelet root,
/// no loop device of the scratch dir, no record.
fn assert_nothing_left(c: &Cluster, node: &str, volume: &str) {
    let root = c.node(node).kubelet_root();
    let mounts: Vec<_> = c
        .mounts_below(&root)
        .into_iter()
        .filter(|m| m.strip_prefix(&root).is_ok_and(|rel| rel.to_string_lossy().contains("volagent")))
        .collect();
    assert!(mounts.is_empty(), "volume mounts left on {node}: {mounts:?}");
    // The kernel may clear an auto-clearing loop device a moment after its
    // last user goes.
    let start = std::time::Instant::now();
    while !c.scratch.loops().is_empty() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(c.scratch.loops().is_empty(), "loop devices left: {:?}\n{}", c.scratch.loops(), tail(&c.node(node).agent_log()));
    assert!(c.record(volume).is_none(), "the record of {volume} is left: {:?}", c.record(volume));
}

/// PVC → PV (`volagent/local-pv`) → a pod writes and goes; a new pod on the
/// same node reads the data back; after the last pod nothing is left.
#[test]
fn a_pod_writes_a_local_volume_and_the_next_pod_reads_it() {
    let c = Cluster::start(&[("node-a", &[])], &[LOCAL_PV]);
    let image = c.image("data.img", 64);
    c.create_volume("data", "local-pv", "ReadWriteOnce", &[("path", &image), ("node", "node-a")]);

    c.create_pod(pod("writer", "node-a", "date +%s%N > /data/note && cat /data/note > /dev/termination-log", &[("data", claim("data"))]));
    let done = c.wait_pod("writer", "Succeeded", |p| phase(p) == "Succeeded");
    let written = output(done.as_ref()).expect("the writer's output");
    assert!(written.trim().len() > 10, "the writer wrote a timestamp: {written:?}");
    c.delete_pod("writer");
    assert_nothing_left(&c, "node-a", "data");

    c.create_pod(pod_with("reader", "node-a", &serve("cat /data/note > /dev/termination-log"), &[("data", claim("data"))], Some("test -s /data/note"), "Never"));
    c.wait_pod("reader", "Ready", is_ready);
    // While it runs, the node's operator sees the volume and its pod.
    let status = c.status("node-a", false);
    assert!(status.contains("data") && status.contains("reader"), "volagent status lists the volume and its pod:\n{status}");
    let ops = c.operation_lines("node-a");
    assert!(
        ops.iter().any(|l| l["op"] == "mount" && l["outcome"] == "ok" && l["volume"] == "data" && l["pod"] == "default/reader"),
        "one operation line per mount: {ops:?}"
    );
    c.delete_pod("reader");
    let reader_said = {
        // The reader's output is only in its status while it exists; it was
        // Ready only once it could read the note, so compare through a
        // last one-shot pod instead.
        c.create_pod(pod("check", "node-a", "cat /data/note > /dev/termination-log", &[("data", claim("data"))]));
        let p = c.wait_pod("check", "Succeeded", |p| phase(p) == "Succeeded");
        output(p.as_ref()).expect("output")
    };
    assert_eq!(reader_said.trim(), written.trim(), "the next pod reads what the first wrote");
    c.delete_pod("check");
    assert_nothing_left(&c, "node-a", "data");
}
