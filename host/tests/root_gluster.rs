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

/// The run's gluster dir.
fn gluster_dir() -> PathBuf {
    PathBuf::from(std::env::var("VOLAGENT_GLUSTER_DIR").unwrap())
}

/// The quota limit the brick keeps on `path` of v0 (its hard limit).
fn brick_limit(path: &str) -> Option<u64> {
    let dir = gluster_dir().join("bricks/v0").join(path);
    let mut value = [0u8; 16];
    // The brick names the attribute with its quota version.
    let n = rustix::fs::lgetxattr(&dir, "trusted.glusterfs.quota.limit-set.1", &mut value).ok()?;
    assert_eq!(n, 16, "{}", dir.display());
    Some(u64::from_be_bytes(value[..8].try_into().unwrap()))
}

#[test]
fn the_controllers_libgfapi_makes_limits_and_removes_directories_and_follows_no_link() {
    use std::os::unix::fs::PermissionsExt;
    use volagent::sys::gluster_dirs::{DirError, GlusterDirs, GlusterVolume, LibGfapiDirs};
    const MIB: u64 = 1 << 20;
    let host = gluster_host();
    let scratch = volagent_test_support::scratch::RootScratch::enter();
    let dirs = LibGfapiDirs::new();
    // The first server does not exist: the volume file comes from the next.
    let v0 = GlusterVolume {
        servers: vec!["gluster-absent.invalid".into(), format!("{host}:24007")],
        volume: "v0".into(),
    };
    let base = format!("sys-{}", std::process::id());
    let path = format!("{base}/pvc-a");
    let brick = gluster_dir().join("bricks/v0");

    assert!(dirs.create(&v0, &path, 64 * MIB).unwrap(), "made");
    let made = std::fs::metadata(brick.join(&path)).unwrap();
    assert!(made.is_dir());
    assert_eq!(made.permissions().mode() & 0o7777, 0o777, "the volume's own dir: its pods write");
    assert_eq!(std::fs::metadata(brick.join(&base)).unwrap().permissions().mode() & 0o7777, 0o755);
    assert_eq!(brick_limit(&path), Some(64 * MIB));
    let state = dirs.state(&v0, &path).unwrap().unwrap();
    assert_eq!((state.mode, state.quota_bytes), (0o777, Some(64 * MIB)));
    // Idempotent; another limit is a conflict that changes nothing.
    assert!(!dirs.create(&v0, &path, 64 * MIB).unwrap(), "there already");
    let e = dirs.create(&v0, &path, 32 * MIB).unwrap_err();
    assert!(matches!(e, DirError::Conflict(_)) && e.to_string().contains(&path), "{e}");
    let e = dirs.create(&v0, &path, 0).unwrap_err();
    assert!(matches!(e, DirError::Conflict(_)), "{e}");
    assert_eq!(brick_limit(&path), Some(64 * MIB));

    // Raised, never lowered.
    assert_eq!(dirs.raise_quota(&v0, &path, 96 * MIB).unwrap(), Some(96 * MIB));
    assert_eq!(brick_limit(&path), Some(96 * MIB));
    assert_eq!(dirs.raise_quota(&v0, &path, 96 * MIB).unwrap(), Some(96 * MIB));
    let e = dirs.raise_quota(&v0, &path, 64 * MIB).unwrap_err();
    assert!(matches!(e, DirError::Refused(_)) && e.to_string().contains("never lowered"), "{e}");
    assert_eq!(brick_limit(&path), Some(96 * MIB));
    let e = dirs.raise_quota(&v0, &format!("{base}/nothing"), MIB).unwrap_err();
    assert!(matches!(e, DirError::NotFound(_)), "{e}");
    // Without a limit, none is added.
    let open = format!("{base}/pvc-open");
    assert!(dirs.create(&v0, &open, 0).unwrap());
    assert_eq!(dirs.raise_quota(&v0, &open, MIB).unwrap(), None);
    assert_eq!(brick_limit(&open), None);

    // Filled through a client mount: files, a deep tree, and links out of it.
    let mnt = scratch.path("v0");
    std::fs::create_dir_all(&mnt).unwrap();
    let status = Command::new("mount")
        .args(["-t", "glusterfs", &format!("{host}:/v0"), mnt.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let client = mnt.join(&path);
    std::fs::create_dir_all(client.join("a/b/c")).unwrap();
    std::fs::write(client.join("a/b/c/file"), b"data").unwrap();
    std::fs::write(client.join("top"), b"data").unwrap();
    std::fs::write(mnt.join(&open).join("kept"), b"another volume's").unwrap();
    std::os::unix::fs::symlink(mnt.join(&open), client.join("out")).unwrap();
    std::os::unix::fs::symlink("../pvc-open", client.join("a/up")).unwrap();
    // A path through a link is refused, not followed.
    std::os::unix::fs::symlink("pvc-open", mnt.join(&base).join("link")).unwrap();
    let e = dirs.create(&v0, &format!("{base}/link/x"), 0).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert!(!mnt.join(&open).join("x").exists());
    let e = dirs.remove(&v0, &format!("{base}/link/kept")).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert!(mnt.join(&open).join("kept").exists());

    assert!(dirs.remove(&v0, &path).unwrap(), "removed");
    assert!(!brick.join(&path).exists());
    assert_eq!(std::fs::read(mnt.join(&open).join("kept")).unwrap(), b"another volume's");
    assert!(!dirs.remove(&v0, &path).unwrap(), "gone already");
    assert_eq!(dirs.state(&v0, &path).unwrap(), None);
    // A link where a volume's dir was is removed itself, not entered.
    assert!(dirs.remove(&v0, &format!("{base}/link")).unwrap());
    assert!(mnt.join(&open).join("kept").exists());
    assert!(dirs.remove(&v0, &base).unwrap());
    assert!(!brick.join(&base).exists());

    // A volume that does not exist: the connection's error says why.
    let absent = GlusterVolume { servers: vec![host.clone()], volume: "no-such-volume".into() };
    let e = dirs.create(&absent, "x", 0).unwrap_err().to_string();
    assert!(e.contains("gluster volume no-such-volume") && e.contains("connect"), "{e}");
    nix::mount::umount2(&mnt, nix::mount::MntFlags::MNT_DETACH).unwrap();
}
