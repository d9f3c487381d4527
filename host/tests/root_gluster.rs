//! gluster volumes end to end against the run's single-node GlusterFS
//! (scripts/gluster-env, which scripts/test starts for the run), as
//! kubelet drives them: the installed `volagent-flex` driver, the real
//! agents of two simulated nodes serving the built gluster policy, and
//! Debian's FUSE client started by `mount.glusterfs`. Pods on both nodes
//! see each other's writes; a wrong server or volume fails with the end of
//! the client's log in the error and leaves nothing mounted or running.
//! Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use volagent_test_support::agent::Node;
use volagent_test_support::driver::{assert_failure, assert_success, kubelet_options};
use volagent_test_support::wait_until;
use volagent_test_support::{driver, scratch};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// The run's gluster dir; its volume v0 is served from this host.
fn gluster_host() -> String {
    let dir = PathBuf::from(std::env::var("VOLAGENT_GLUSTER_DIR").expect(
        "VOLAGENT_GLUSTER_DIR: the single-node GlusterFS of this run (scripts/gluster-env start makes it; scripts/test sets it)",
    ));
    assert!(dir.join("ready").exists(), "no GlusterFS ready in {}", dir.display());
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string()
}

fn gluster_node() -> Node {
    let mut node = Node::start_with(VOLAGENT, &[(volagent_test_artifacts::GLUSTER, "gluster")]);
    node.spawn_agent("node-b");
    node
}

fn driver(node: &Node, name: &str, args: &[&str]) -> (i32, Value) {
    driver::run_driver(Command::new(node.driver_of(name, "gluster")).args(args))
}

fn gluster_options(
    volume: &str,
    pod: &str,
    uid: &str,
    servers: &str,
    gluster_volume: &str,
) -> Value {
    let mut o = kubelet_options(volume, pod, uid, "", "");
    let m = o.as_object_mut().unwrap();
    m.remove("path");
    m.insert("servers".into(), servers.into());
    m.insert("volume".into(), gluster_volume.into());
    m.insert("accessMode".into(), "ReadWriteMany".into());
    o
}

/// glusterfs client processes whose mount point lies under `dir`.
fn clients_under(dir: &Path) -> Vec<i32> {
    scratch::processes_under(dir, |a| a.first().is_some_and(|p| p.ends_with("glusterfs")))
}

#[test]
fn pods_on_two_nodes_share_a_gluster_volume_and_see_each_others_writes() {
    let host = gluster_host();
    let node = gluster_node();
    // The first server does not exist: the client falls back to the backup.
    let servers = format!("gluster-absent.invalid,{host}");
    let unique = format!("shared-{}", std::process::id());
    let dir_a = node.mount_dir_of("node-a", "gluster", "uid-a", "pv-g");
    let dir_b = node.mount_dir_of("node-b", "gluster", "uid-b", "pv-g");
    assert_success(&driver(
        &node,
        "node-a",
        &["mount", &dir_a, &gluster_options("pv-g", "pod-a", "uid-a", &servers, "v0").to_string()],
    ));
    assert_success(&driver(
        &node,
        "node-b",
        &["mount", &dir_b, &gluster_options("pv-g", "pod-b", "uid-b", &servers, "v0").to_string()],
    ));
    let staging = node.scratch.path("node-a/kubelet/plugins/volagent/gluster/mounts/pv-g");
    let table = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap();
    let line = table
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(staging.to_str().unwrap()))
        .expect("node-a's staging mount");
    assert!(line.contains("fuse.glusterfs"), "{line}");

    std::fs::create_dir_all(format!("{dir_a}/{unique}")).unwrap();
    std::fs::write(format!("{dir_a}/{unique}/from-a"), b"written on node-a").unwrap();
    std::fs::write(format!("{dir_b}/{unique}/from-b"), b"written on node-b").unwrap();
    assert_eq!(std::fs::read(format!("{dir_b}/{unique}/from-a")).unwrap(), b"written on node-a");
    assert_eq!(std::fs::read(format!("{dir_a}/{unique}/from-b")).unwrap(), b"written on node-b");
    // The client logs where the volume's state dir is, as the plan says.
    let log = node.scratch.path("node-a/state/volumes/pv-g/glusterfs.log");
    assert!(log.exists(), "{}", log.display());

    std::fs::remove_dir_all(format!("{dir_a}/{unique}")).unwrap();
    assert_success(&driver(&node, "node-a", &["unmount", &dir_a]));
    assert_success(&driver(&node, "node-b", &["unmount", &dir_b]));
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    wait_until(Duration::from_secs(20), "the FUSE clients to end", || {
        clients_under(&node.scratch.path("")).is_empty()
    });
}

#[test]
fn a_wrong_server_or_volume_fails_quoting_the_clients_log_and_leaves_nothing() {
    let host = gluster_host();
    let node = gluster_node();
    let dir_a = node.mount_dir_of("node-a", "gluster", "uid-a", "pv-bad");
    let r = driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_a,
            &gluster_options("pv-bad", "pod-a", "uid-a", "gluster-absent.invalid", "v0")
                .to_string(),
        ],
    );
    assert_failure(&r, "mount.glusterfs");
    assert_failure(&r, "the client's log ends:");
    assert_failure(&r, "DNS resolution failed on host gluster-absent.invalid");
    let r = driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_a,
            &gluster_options("pv-bad", "pod-a", "uid-a", &host, "no-such-volume").to_string(),
        ],
    );
    assert_failure(&r, "the client's log ends:");
    assert_failure(&r, "failed to fetch volume file (key:/no-such-volume)");
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    wait_until(Duration::from_secs(20), "no client to be left", || {
        clients_under(&node.scratch.path("")).is_empty()
    });
    // A source that is not host:/volume never reaches the helper.
    let r = driver(
        &node,
        "node-a",
        &["mount", &dir_a, &gluster_options("pv-bad", "pod-a", "uid-a", "-oX", "v0").to_string()],
    );
    assert_eq!(r.1["status"], "Failure", "{}", r.1);
}
