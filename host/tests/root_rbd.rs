//! rbd volumes end to end against the run's single-node Ceph, as kubelet
//! drives them: the installed `volagent-flex` driver, the real agent
//! serving the built rbd policy, the Ceph user's key from the volume's
//! Secret as kubelet passes it. On this node (no nbd.ko, no rbd.ko) the
//! image is reached through the agent's helper NBD server on librbd, a
//! userspace NBD client and a loop device — or, where the volume asks for
//! it, through rbd-fuse and a loop device. (The kernel rbd driver's path
//! runs in the VM tier, vm_krbd.rs.) What a pod wrote is read back
//! from the image with `rbd export`, not through volagent. Fencing asks
//! the cluster who watches the image. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use volagent_test_support::agent::Node;
use volagent_test_support::ceph::{Image, ceph_dir, rbd, volagent_key, watchers};
use volagent_test_support::driver::{assert_failure, assert_success, rbd_options};
use volagent_test_support::nbd::{NBD_WAIT, clients_under, read_back, servers_under};
use volagent_test_support::wait_until;
use volagent_test_support::{agent, driver};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn rbd_node() -> Node {
    Node::start_with(VOLAGENT, &[(volagent_test_artifacts::RBD, "rbd")])
}

fn driver(node: &Node, name: &str, args: &[&str]) -> (i32, Value) {
    driver::run_driver(Command::new(node.driver_of(name, "rbd")).args(args))
}

fn state(node: &Node, name: &str) -> PathBuf {
    node.scratch.path(&format!("{name}/state"))
}

/// Files under the agent's NBD dir (helper sockets, pid files, keyrings…).
fn nbd_files(node: &Node, name: &str) -> Vec<PathBuf> {
    std::fs::read_dir(state(node, name).join("nbd"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

fn assert_nothing_left(node: &Node, image: &Image) {
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    let st = state(node, "node-a");
    wait_until(NBD_WAIT, "the NBD client and helper to end", || {
        clients_under(&st).is_empty() && servers_under(&st).is_empty()
    });
    assert!(nbd_files(node, "node-a").is_empty(), "{:?}", nbd_files(node, "node-a"));
    // The helper closed the image as it exited: its watch goes at once (a
    // killed helper's would linger for the 30 s watch timeout).
    let start = std::time::Instant::now();
    while !watchers(image).is_empty() && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(watchers(image).is_empty(), "{:?}", watchers(image));
}

/// The contents of /data in the image's ext4, read from the cluster.
fn data_in(image: &Image, scratch: &Path) -> Vec<u8> {
    let copy = scratch.join(format!("{}.raw", image.name));
    rbd(&image.dir, &["export", "--no-progress", &image.spec(), &copy.display().to_string()]);
    let data = read_back(&copy, "ext4");
    std::fs::remove_file(&copy).unwrap();
    data
}

#[test]
fn an_rbd_image_mounts_with_the_secrets_key_and_what_pods_write_is_in_the_image() {
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let node = rbd_node();
    let image = Image::create(&dir, 64);

    let dir_a = node.mount_dir_of("node-a", "rbd", "uid-a", "pv1");
    let r = driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_a,
            &rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(&key), "ReadWriteOnce")
                .to_string(),
        ],
    );
    assert_success(&r);
    let device = r.1["device"].as_str().unwrap_or_default().to_string();
    assert!(device.starts_with("/dev/loop"), "{}", r.1);
    // The helper serves the image as client.volagent; its key is kept for
    // a successor in one keyring file, root's alone, and in no other file.
    assert_eq!(watchers(&image).len(), 1, "one client: the agent's helper");
    let files = nbd_files(&node, "node-a");
    let keyrings: Vec<&PathBuf> =
        files.iter().filter(|f| f.extension().is_some_and(|e| e == "keyring")).collect();
    assert_eq!(keyrings.len(), 1, "{files:?}");
    let meta = std::fs::metadata(keyrings[0]).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((meta.mode() & 0o777, meta.uid()), (0o600, 0), "{}", keyrings[0].display());
    for f in files.iter().filter(|f| f.extension().is_none_or(|e| e != "keyring")) {
        if f.is_file() {
            let text = std::fs::read(f).unwrap_or_default();
            assert!(
                !String::from_utf8_lossy(&text).contains(&key),
                "{} holds the key",
                f.display()
            );
        }
    }
    let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
    assert!(!log.contains(&key), "the agent logged the key");
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 13 % 251) as u8).collect();
    std::fs::write(format!("{dir_a}/data"), &payload).unwrap();

    // A second pod on the node: the image's one watcher is this node's own
    // helper, so the exclusive volume is shared on the node, not fenced.
    let dir_b = node.mount_dir_of("node-a", "rbd", "uid-b", "pv1");
    assert_success(&driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_b,
            &rbd_options("pv1", "pod-b", "uid-b", &image.name, Some(&key), "ReadWriteOnce")
                .to_string(),
        ],
    ));
    assert_eq!(std::fs::read(format!("{dir_b}/data")).unwrap(), payload);
    assert_eq!(watchers(&image).len(), 1, "still one client");
    assert_success(&driver(&node, "node-a", &["unmount", &dir_b]));
    assert_success(&driver(&node, "node-a", &["unmount", &dir_a]));
    assert_nothing_left(&node, &image);
    assert_eq!(data_in(&image, &node.scratch.path("")), payload);
}

#[test]
fn a_volume_that_asks_for_rbd_fuse_is_mounted_through_it_and_shared_on_its_node() {
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let node = rbd_node();
    let image = Image::create(&dir, 64);
    let options = |pod: &str, uid: &str| {
        let mut o = rbd_options("pv1", pod, uid, &image.name, Some(&key), "ReadWriteOnce");
        o["attach"] = "fuse".into();
        o.to_string()
    };
    let dir_a = node.mount_dir_of("node-a", "rbd", "uid-a", "pv1");
    // A wrong key: rbd-fuse cannot connect; the error says so, quotes no
    // key, and leaves nothing behind.
    let wrong = "AQDNBwRrNnY7HRAANmjdyj4ec54XJkuAJ1eaPg==";
    // (ReadWriteMany: an exclusive volume would be denied before, as its
    // watchers cannot be listed with that key.)
    let mut bad = rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(wrong), "ReadWriteMany");
    bad["attach"] = "fuse".into();
    let r = driver(&node, "node-a", &["mount", &dir_a, &bad.to_string()]);
    assert_failure(&r, "rbd-fuse");
    assert!(!r.1.to_string().contains(wrong), "{}", r.1);
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    assert!(clients_under(&state(&node, "node-a")).is_empty());
    assert!(nbd_files(&node, "node-a").is_empty(), "{:?}", nbd_files(&node, "node-a"));

    let r = driver(&node, "node-a", &["mount", &dir_a, &options("pod-a", "uid-a")]);
    assert_success(&r);
    let device = r.1["device"].as_str().unwrap_or_default().to_string();
    assert!(device.starts_with("/dev/loop"), "{}", r.1);
    // The loop device is over rbd-fuse's file of the image; no helper runs.
    let backing = std::fs::read_to_string(format!(
        "/sys/block/{}/loop/backing_file",
        device.trim_start_matches("/dev/")
    ))
    .unwrap();
    assert!(backing.trim().ends_with(&format!("/{}", image.name)), "{backing}");
    let st = state(&node, "node-a");
    assert_eq!(clients_under(&st).len(), 1, "one rbd-fuse");
    assert!(servers_under(&st).is_empty(), "no helper server on the rbd-fuse path");
    assert_eq!(watchers(&image).len(), 1, "one client: rbd-fuse's");
    let files = nbd_files(&node, "node-a");
    assert!(
        !files.iter().any(|f| f.extension().is_some_and(|e| e == "keyring")),
        "the keyring went once rbd-fuse connected: {files:?}"
    );
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 253) as u8).collect();
    std::fs::write(format!("{dir_a}/data"), &payload).unwrap();

    // A second pod on the node: rbd-fuse's client is known as this node's
    // (the watcher it added), so the exclusive volume is shared here.
    let dir_b = node.mount_dir_of("node-a", "rbd", "uid-b", "pv1");
    assert_success(&driver(&node, "node-a", &["mount", &dir_b, &options("pod-b", "uid-b")]));
    assert_eq!(std::fs::read(format!("{dir_b}/data")).unwrap(), payload);
    assert_success(&driver(&node, "node-a", &["unmount", &dir_b]));
    assert_success(&driver(&node, "node-a", &["unmount", &dir_a]));
    assert_nothing_left(&node, &image);
    assert_eq!(data_in(&image, &node.scratch.path("")), payload);
}

#[test]
fn an_exclusive_mount_is_denied_while_a_client_volagent_does_not_know_writes_to_the_image() {
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let node = rbd_node();
    let image = Image::create(&dir, 64);
    // A writer outside volagent's view: a librbd client on the image.
    let socket = node.scratch.path("outsider.sock");
    let mut outsider = Command::new(VOLAGENT)
        .args(["nbd", "serve", "--unix"])
        .arg(&socket)
        .args(["--export-rbd", &format!("={}", image.spec())])
        .arg("--ceph-conf")
        .arg(dir.join("ceph.conf"))
        .arg("--ceph-keyring")
        .arg(dir.join("keyring"))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_until(NBD_WAIT, "the outside client to open the image", || socket.exists());
    let outside = watchers(&image);
    assert_eq!(outside.len(), 1);

    let dir_a = node.mount_dir_of("node-a", "rbd", "uid-a", "pv1");
    let r = driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_a,
            &rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(&key), "ReadWriteOnce")
                .to_string(),
        ],
    );
    assert_failure(&r, &format!("image rbd/{} is in use by watcher {}", image.name, outside[0]));
    assert_failure(&r, "on a node volagent does not know");
    assert!(
        node.scratch.loops_left().is_empty() && servers_under(&state(&node, "node-a")).is_empty(),
        "a denied mount starts nothing"
    );

    // Once the other client is gone, the volume mounts.
    agent::stop(&mut outsider);
    assert_success(&driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_a,
            &rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(&key), "ReadWriteOnce")
                .to_string(),
        ],
    ));
    // A second node is denied the exclusive volume while node-a has it.
    let mut node = node;
    node.spawn_agent("node-b");
    let dir_b = node.mount_dir_of("node-b", "rbd", "uid-b", "pv1");
    let r = driver(
        &node,
        "node-b",
        &[
            "mount",
            &dir_b,
            &rbd_options("pv1", "pod-b", "uid-b", &image.name, Some(&key), "ReadWriteOnce")
                .to_string(),
        ],
    );
    assert_eq!(r.1["status"], "Failure", "{}", r.1);
    assert_eq!(watchers(&image).len(), 1, "node-b started no client");
    assert_success(&driver(&node, "node-a", &["unmount", &dir_a]));
    assert_nothing_left(&node, &image);
}

#[test]
fn a_missing_or_wrong_secret_is_a_clear_error_that_never_quotes_the_key_and_leaves_nothing() {
    let dir = ceph_dir();
    let node = rbd_node();
    let image = Image::create(&dir, 64);
    let dir_a = node.mount_dir_of("node-a", "rbd", "uid-a", "pv1");

    // No Secret: the policy says which key it wanted.
    let mut no_secret = rbd_options("pv1", "pod-a", "uid-a", &image.name, None, "ReadWriteOnce");
    no_secret["secretKey"] = "key".into();
    assert_failure(
        &driver(&node, "node-a", &["mount", &dir_a, &no_secret.to_string()]),
        "secretKey \"key\" is not a key of the volume's secret",
    );

    // A well-formed key the cluster does not accept: the cluster refuses it,
    // and the error names the image.
    let right = volagent_key(&dir);
    let wrong = format!("AQB{}", &right[3..].chars().rev().collect::<String>());
    let wrong = wrong.as_str();
    let refused = driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_a,
            &rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(wrong), "ReadWriteOnce")
                .to_string(),
        ],
    );
    assert_failure(&refused, &format!("rbd/{}", image.name));
    assert_failure(&refused, "connect to the cluster");
    // Not a Ceph key at all (it would add lines to a keyring file).
    let malformed = driver(
        &node,
        "node-a",
        &[
            "mount",
            &dir_a,
            &rbd_options(
                "pv1",
                "pod-a",
                "uid-a",
                &image.name,
                Some("AQB=\n[client.admin]"),
                "ReadWriteMany",
            )
            .to_string(),
        ],
    );
    assert_failure(&malformed, "does not hold a Ceph key");
    for r in [&refused, &malformed] {
        assert!(
            !r.1.to_string().contains(wrong) && !r.1.to_string().contains("client.admin"),
            "{}",
            r.1
        );
    }
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    assert!(nbd_files(&node, "node-a").is_empty(), "{:?}", nbd_files(&node, "node-a"));
    assert!(watchers(&image).is_empty());
}
