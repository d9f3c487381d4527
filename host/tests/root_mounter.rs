//! The node's mounter (`volagent mounter`), with a standalone agent that
//! starts the processes its volumes need there (`--mounter`): they are the
//! mounter's children, not the agent's, so the agent and everything it
//! started can be killed — what a container runtime does to a replaced
//! pod — while a workload writes and fsyncs on, and the next agent adopts
//! them. The mounter serves root only and starts only what a launch may
//! name. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use volagent::sys::launch::wire;
use volagent_test_support::agent::Node;
use volagent_test_support::ceph::{Image, ceph_dir, volagent_key};
use volagent_test_support::driver::{assert_success, kubelet_options, rbd_options};
use volagent_test_support::nbd::*;
use volagent_test_support::wait_until;
use volagent_test_support::workload::{Writer, every_record_in_place, kill_all};

const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// A mounter on `socket`, ready.
fn start_mounter(socket: &Path, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    let child = Command::new(VOLAGENT)
        .args(["mounter", "--socket"])
        .arg(socket)
        .stderr(log)
        .spawn()
        .unwrap();
    wait_until(Duration::from_secs(10), "the mounter to answer", || {
        Command::new(VOLAGENT)
            .args(["mounter", "--check", "--socket"])
            .arg(socket)
            .output()
            .is_ok_and(|o| o.status.success())
    });
    child
}

fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // "pid (comm) state ppid ...": comm may hold spaces, not ')'.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split(' ').nth(1).unwrap().parse().unwrap()
}

/// `pid` and every process below it.
fn tree_of(pid: i32) -> Vec<i32> {
    let parents: Vec<(i32, i32)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
        .filter_map(|p: i32| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            let after = &stat[stat.rfind(')')? + 2..];
            Some((p, after.split(' ').nth(1)?.parse().ok()?))
        })
        .collect();
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(parents.iter().filter(|(_, parent)| *parent == p).map(|(c, _)| *c));
        i += 1;
    }
    tree
}

/// A node whose agent starts the processes its volumes need in a mounter
/// (and serves `backend` too, from `wasm`); the mounter and its socket.
fn node_with_mounter(wasm: &str, backend: &str) -> (Node, Child, PathBuf) {
    let mut node = Node::start_with(VOLAGENT, &[(wasm, backend)]);
    let socket = node.scratch.path("run/mounter.sock");
    let mounter = start_mounter(&socket, &node.scratch.path("mounter.log"));
    node.stop_agent();
    node.spawn_agent_env("node-a", &[], &["--mounter", socket.to_str().unwrap()]);
    (node, mounter, socket)
}

/// Volume pv1 of pod-a, mounted through `backend`'s driver with `options`,
/// its processes (found by `processes`) started by the mounter: the agent
/// and every process below it are killed — what a container runtime does
/// to a replaced pod — while a workload writes and fsyncs; the workload
/// sees no error, and the next agent adopts the volume. The unmount stops
/// the processes, the mounter reaps them, and the file holds every record.
/// `daemon`: the program daemonizes (glusterfs), so its parent is not the
/// mounter; it must still never be below the agent.
fn outlives_its_agent(
    backend: &str,
    program: &str,
    wasm: &str,
    options: impl FnOnce(&Node) -> serde_json::Value,
    processes: impl Fn(&Path) -> Vec<i32>,
    daemon: bool,
    pinned: Option<&str>,
) {
    let (mut node, mut mounter, socket) = node_with_mounter(wasm, backend);
    let options = options(&node);
    let dir = node.mount_dir_of("node-a", backend, "uid-a", "pv1");
    let flex = node.driver_of("node-a", backend);
    let driver =
        |args: &[&str]| volagent_test_support::driver::run_driver(Command::new(&flex).args(args));
    assert_success(&driver(&["mount", &dir, &options.to_string()]));
    let serving = processes(&node.scratch.path(""));
    assert!(!serving.is_empty(), "the volume's processes run");
    let said = std::fs::read_to_string(node.scratch.path("mounter.log")).unwrap();
    assert!(said.contains(&format!("program=\"{program}\"")), "the mounter ran {program}: {said}");
    let mounter_pid = mounter.id() as i32;
    if !daemon {
        for pid in &serving {
            assert_eq!(parent_of(*pid), mounter_pid, "process {pid} is the mounter's child");
        }
    }

    let mut writer = Writer::start(&dir);
    writer.logs = vec![node.log_path("node-a"), node.scratch.path("mounter.log")];
    writer.goes_on(20, "before");
    // What a container runtime does to the agent's pod: kill it and
    // everything it started.
    let agent = node.pid_of("node-a");
    let tree = tree_of(agent);
    assert!(
        serving.iter().all(|p| !tree.contains(p)),
        "no process of the volume is below the agent: {tree:?}"
    );
    for pid in &tree {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    node.kill_agent_of("node-a");
    writer.goes_on(50, "with no agent");
    node.spawn_agent_env("node-a", &[], &["--mounter", socket.to_str().unwrap()]);
    writer.goes_on(20, "after the next agent started");
    // What no successor could take over pins the mounter: status says so.
    let status = Command::new(VOLAGENT)
        .args(["status", "--json", "--socket"])
        .arg(&node.socket)
        .output()
        .unwrap();
    let said: serde_json::Value = serde_json::from_slice(&status.stdout)
        .unwrap_or_else(|e| panic!("status --json ({e}): {status:?}"));
    assert_eq!(said["volumes"][0]["volume"], "pv1", "{said}");
    assert_eq!(said["volumes"][0]["pinned_by"].as_str(), pinned, "{said}");
    let file = writer.file.clone();
    let (written, errors, longest) = writer.finish();
    assert_eq!(errors, Vec::<String>::new(), "no write or fsync failed");
    eprintln!("{backend}: {written} records written and fsynced; the longest took {longest:?}");
    assert_eq!(processes(&node.scratch.path("")), serving, "the same processes, adopted");
    every_record_in_place(&file, written);

    assert_success(&driver(&["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    wait_until(NBD_WAIT, "the volume's processes to end, reaped", || {
        serving.iter().all(|p| !Path::new(&format!("/proc/{p}")).exists())
    });
    let status = Command::new(VOLAGENT)
        .args(["mounter", "--check", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&status.stdout).contains(", 0 processes running"),
        "{status:?}"
    );
    node.stop_agent();
    let _ = mounter.kill();
    let _ = mounter.wait();
}

/// A local file behind the agent's helper NBD server, reached through its
/// userspace client (this node has no nbd.ko).
#[test]
fn a_local_file_over_the_userspace_nbd_path_outlives_its_agent() {
    outlives_its_agent(
        "nbd",
        "volagent",
        volagent_test_artifacts::NBD,
        |node| {
            let mut options = nbd_options("pv1", "pod-a", "uid-a", "ext4", "unused");
            options.as_object_mut().unwrap().remove("server");
            options["file"] = node.image("own.img", 64).into();
            options
        },
        client_and_helper,
        false,
        None,
    );
}

/// A local file behind the helper, through the userspace client, both in
/// the mounter, under a workload that writes and fsyncs without pause:
/// (1) the client alone is killed: the agent starts another on the same
/// FUSE connection it kept; then the helper alone: the agent starts another
/// on the export it kept, and the client connects again; (2) the mounter and everything it started are
/// killed — what the runtime does when the mounter's pod dies — and a new
/// mounter comes up seconds later, as kubelet would restart it: the agent
/// starts the helper again on the export it kept, then the client on the
/// connection. The workload sees pauses, never an error, and every record
/// is in the file.
#[test]
fn a_local_files_client_and_helper_are_started_again_when_they_or_the_mounter_die() {
    let (mut node, mounter, socket) = node_with_mounter(volagent_test_artifacts::NBD, "nbd");
    let mut options = nbd_options("pv1", "pod-a", "uid-a", "ext4", "unused");
    options.as_object_mut().unwrap().remove("server");
    options["file"] = node.image("own.img", 64).into();
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let flex = node.driver_of("node-a", "nbd");
    let driver =
        |args: &[&str]| volagent_test_support::driver::run_driver(Command::new(&flex).args(args));
    assert_success(&driver(&["mount", &dir, &options.to_string()]));
    let root = node.scratch.path("");
    let (client, helper) = (clients_under(&root), servers_under(&root));
    assert_eq!((client.len(), helper.len()), (1, 1), "one client, one helper");

    let mut writer = Writer::start(&dir);
    writer.logs = vec![node.log_path("node-a"), node.scratch.path("mounter.log")];
    writer.goes_on(20, "before");

    kill_all(&client);
    wait_until(NBD_WAIT, "another client", || {
        let now = clients_under(&root);
        now.len() == 1 && now != client
    });
    writer.goes_on(50, "after the client was killed");
    let stall_client = std::mem::take(&mut writer.stats.lock().unwrap().2);

    // The helper alone: the agent starts another on the export it kept,
    // and the client connects to it again.
    helper_killed(&root, &helper);
    writer.goes_on(50, "after the helper was killed");
    let stall_helper = std::mem::take(&mut writer.stats.lock().unwrap().2);

    let mut mounter = mounter_killed(mounter, &socket, &node, &root);
    for pid in clients_under(&root).into_iter().chain(servers_under(&root)) {
        assert_eq!(parent_of(pid), mounter.id() as i32, "process {pid} is the new mounter's");
    }
    writer.goes_on(50, "after the mounter was killed and came back");
    let stall_killed = std::mem::take(&mut writer.stats.lock().unwrap().2);

    // (3) The mounter is stopped (SIGTERM, its pod replaced): it has its
    // client answer what it holds and end, starts nothing more, and ends.
    let client = clients_under(&root);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(mounter.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let draining = Instant::now();
    let ended = mounter.wait().unwrap();
    let drained = draining.elapsed();
    assert!(ended.success(), "the mounter drained and ended: {ended:?}");
    assert!(drained < Duration::from_secs(5), "its client ended at once: {drained:?}");
    assert!(clients_under(&root).iter().all(|p| !client.contains(p)), "its client ended");
    let said = std::fs::read_to_string(node.scratch.path("mounter.log")).unwrap();
    assert!(said.contains("SIGTERM"), "{said}");
    std::thread::sleep(Duration::from_secs(1));
    let mut mounter = start_mounter(&socket, &node.scratch.path("mounter.log"));
    wait_until(NBD_WAIT, "a client in the next mounter", || {
        clients_under(&root).first().is_some_and(|p| parent_of(*p) == mounter.id() as i32)
    });
    writer.goes_on(50, "after the mounter was replaced");

    let file = writer.file.clone();
    let (written, errors, longest) = writer.finish();
    assert_eq!(errors, Vec::<String>::new(), "no write or fsync failed");
    eprintln!(
        "{written} records written and fsynced; the longest wait: {stall_client:?} when the client was killed, {stall_helper:?} when the helper was, {stall_killed:?} when the mounter was killed (down 3 s), {longest:?} when it was replaced (down 1 s)"
    );
    every_record_in_place(&file, written);

    assert_success(&driver(&["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    wait_until(NBD_WAIT, "the volume's processes to end", || {
        clients_under(&root).is_empty() && servers_under(&root).is_empty()
    });
    node.stop_agent();
    let _ = mounter.kill();
    let _ = mounter.wait();
}

/// Helper `helper` (its pids) SIGKILLed; once the agent started another.
fn helper_killed(root: &Path, helper: &[i32]) {
    kill_all(helper);
    wait_until(NBD_WAIT, "another helper", || {
        let now = servers_under(root);
        now.len() == 1 && now != helper
    });
}

/// The mounter and everything it started SIGKILLed — what the runtime does
/// when the mounter's pod dies — and a new mounter up 3 s later, as
/// kubelet would restart it (requests wait in the kernel meanwhile; the
/// agent keeps the connection); once the agent started a new helper and
/// client in it. The new mounter.
fn mounter_killed(mut mounter: Child, socket: &Path, node: &Node, root: &Path) -> Child {
    let (client, helper) = (clients_under(root), servers_under(root));
    kill_all(&tree_of(mounter.id() as i32));
    let _ = mounter.wait();
    std::thread::sleep(Duration::from_secs(3));
    let mounter = start_mounter(socket, &node.scratch.path("mounter.log"));
    wait_until(NBD_WAIT, "a new helper and client", || {
        let (c, h) = (clients_under(root), servers_under(root));
        c.len() == 1 && h.len() == 1 && c != client && h != helper
    });
    mounter
}

/// A client of the agent's helper and the helper itself.
fn client_and_helper(root: &Path) -> Vec<i32> {
    let mut p = clients_under(root);
    p.extend(servers_under(root));
    p
}

/// An RBD image on the run's Ceph, attached as `attach` asks (none: the
/// default path), its processes started as `program` and found by
/// `processes`.
fn rbd_outlives_its_agent(
    attach: Option<&str>,
    program: &str,
    processes: fn(&Path) -> Vec<i32>,
    pinned: Option<&str>,
) {
    let ceph = ceph_dir();
    let key = volagent_key(&ceph);
    let image = Image::create(&ceph, 64);
    outlives_its_agent(
        "rbd",
        program,
        volagent_test_artifacts::RBD,
        |_| {
            let mut o =
                rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(&key), "ReadWriteOnce");
            if let Some(attach) = attach {
                o["attach"] = attach.into();
            }
            o
        },
        processes,
        false,
        pinned,
    );
}

/// An RBD image through librbd behind the agent's helper NBD server and
/// its userspace client: nothing pins the mounter, since the agent can
/// start both again.
#[test]
fn an_rbd_image_through_librbd_outlives_its_agent() {
    rbd_outlives_its_agent(None, "volagent", client_and_helper, None);
}

/// The volume's record's storage clients on node-a, as status shows them
/// ("<id> <address>").
fn recorded_clients(node: &Node) -> Vec<String> {
    let status = Command::new(VOLAGENT)
        .args(["status", "--json", "--socket"])
        .arg(&node.socket)
        .output()
        .unwrap();
    let said: serde_json::Value = serde_json::from_slice(&status.stdout)
        .unwrap_or_else(|e| panic!("status --json ({e}): {status:?}"));
    said["volumes"][0]["storage_clients"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| format!("{} {}", c["id"], c["address"].as_str().unwrap_or_default()))
        .collect()
}

/// An RBD image through librbd behind the helper and its userspace client,
/// both in the mounter, under a workload that writes and fsyncs without
/// pause: (1) the helper alone is SIGKILLed, holding the image's exclusive
/// lock: the agent starts another with the arguments and keyring it kept,
/// which takes the dead one's lock over, and the volume's record names the
/// new Ceph client (what fencing would blocklist); (2) the mounter and
/// everything it started are killed and a new mounter comes up: the helper
/// and the client are started again in it. The workload sees pauses, never
/// an error, and every record is in the file — no write the dead helper
/// acknowledged was lost (librbd runs without its write-back cache).
#[test]
fn an_rbd_images_helper_is_started_again_when_it_or_the_mounter_die() {
    let ceph = ceph_dir();
    let key = volagent_key(&ceph);
    let image = Image::create(&ceph, 64);
    let (mut node, mounter, socket) = node_with_mounter(volagent_test_artifacts::RBD, "rbd");
    let options = rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(&key), "ReadWriteOnce");
    let dir = node.mount_dir_of("node-a", "rbd", "uid-a", "pv1");
    let flex = node.driver_of("node-a", "rbd");
    let driver =
        |args: &[&str]| volagent_test_support::driver::run_driver(Command::new(&flex).args(args));
    assert_success(&driver(&["mount", &dir, &options.to_string()]));
    let root = node.scratch.path("");
    let helper = servers_under(&root);
    assert_eq!((clients_under(&root).len(), helper.len()), (1, 1), "one client, one helper");
    let first = recorded_clients(&node);
    assert_eq!(first.len(), 1, "the record names the helper's Ceph client: {first:?}");
    let keyrings = Command::new("find")
        .arg(&root)
        .args(["-name", "*.keyring", "-perm", "600", "-user", "root"])
        .output()
        .unwrap();
    assert!(!keyrings.stdout.is_empty(), "the keyring is kept, root's alone: {keyrings:?}");

    let mut writer = Writer::start(&dir);
    writer.logs = vec![node.log_path("node-a"), node.scratch.path("mounter.log")];
    // The helper's and the client's logs too.
    let nbd = node.scratch.path("node-a/state/nbd");
    writer.logs.extend(
        std::fs::read_dir(&nbd)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "log")),
    );
    writer.goes_on(20, "before");
    let lockers = volagent_test_support::ceph::lockers(&image);
    assert!(
        first[0].ends_with(&format!(" {}", lockers[0])),
        "{first:?} holds the lock: {lockers:?}"
    );

    helper_killed(&root, &helper);
    writer.goes_on(50, "after the helper was killed");
    let stall_helper = std::mem::take(&mut writer.stats.lock().unwrap().2);
    wait_until(NBD_WAIT, "the record to name the new helper's client", || {
        let now = recorded_clients(&node);
        now.len() == 1 && now != first
    });
    let second = recorded_clients(&node);
    let lockers = volagent_test_support::ceph::lockers(&image);
    assert!(
        second[0].ends_with(&format!(" {}", lockers[0])),
        "the new helper ({second:?}) holds the lock: {lockers:?}"
    );
    let said = std::fs::read_to_string(node.log_path("node-a")).unwrap();
    assert!(said.contains("restarted helper's Ceph client"), "{said}");

    let mut mounter = mounter_killed(mounter, &socket, &node, &root);
    writer.goes_on(50, "after the mounter was killed and came back");
    let stall_killed = std::mem::take(&mut writer.stats.lock().unwrap().2);
    wait_until(NBD_WAIT, "the record to name the third helper's client", || {
        let now = recorded_clients(&node);
        now.len() == 1 && now != second
    });

    let file = writer.file.clone();
    let (written, errors, _) = writer.finish();
    assert_eq!(errors, Vec::<String>::new(), "no write or fsync failed");
    eprintln!(
        "{written} records written and fsynced; the longest wait: {stall_helper:?} when the helper was killed, {stall_killed:?} when the mounter was killed (down 3 s)"
    );
    every_record_in_place(&file, written);

    assert_success(&driver(&["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    wait_until(NBD_WAIT, "the volume's processes to end", || {
        clients_under(&root).is_empty() && servers_under(&root).is_empty()
    });
    let keyrings = Command::new("find").arg(&root).args(["-name", "*.keyring"]).output().unwrap();
    assert!(
        keyrings.status.success() && keyrings.stdout.is_empty(),
        "the kept keyring went with the helper: {keyrings:?}"
    );
    node.stop_agent();
    let _ = mounter.kill();
    let _ = mounter.wait();
}

/// A librbd helper whose Ceph client was blocklisted — the controller
/// fenced this node and gave the image to another — is not started again
/// when it dies: its successor, a new client no one fenced, would be a
/// second writer. The successor refuses, saying why, and the volume's I/O
/// fails; it still unmounts and leaves nothing.
#[test]
fn a_fenced_librbd_helper_is_not_started_again() {
    let ceph = ceph_dir();
    let key = volagent_key(&ceph);
    let image = Image::create(&ceph, 64);
    let (mut node, mut mounter, _) = node_with_mounter(volagent_test_artifacts::RBD, "rbd");
    let options = rbd_options("pv1", "pod-a", "uid-a", &image.name, Some(&key), "ReadWriteOnce");
    let dir = node.mount_dir_of("node-a", "rbd", "uid-a", "pv1");
    let flex = node.driver_of("node-a", "rbd");
    let driver =
        |args: &[&str]| volagent_test_support::driver::run_driver(Command::new(&flex).args(args));
    assert_success(&driver(&["mount", &dir, &options.to_string()]));
    let root = node.scratch.path("");
    let helper = servers_under(&root);
    let mut writer = Writer::start(&dir);
    writer.logs = vec![node.log_path("node-a"), node.scratch.path("mounter.log")];
    writer.goes_on(20, "before");
    let client = recorded_clients(&node);
    let address = client[0].split_once(' ').unwrap().1.to_string();
    let ceph_cmd = |args: &[&str]| {
        let out =
            Command::new("ceph").arg("-c").arg(ceph.join("ceph.conf")).args(args).output().unwrap();
        assert!(out.status.success(), "ceph {args:?}: {out:?}");
    };
    ceph_cmd(&["osd", "blocklist", "add", &address]);
    kill_all(&helper);
    let logs = || -> String {
        std::fs::read_dir(node.scratch.path("node-a/state/nbd"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".server.log"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .collect()
    };
    volagent_test_support::wait_until_or(
        NBD_WAIT,
        "the successor to refuse",
        || logs().contains("this node was fenced").then_some(()),
        || {
            let agent = std::fs::read_to_string(node.log_path("node-a")).unwrap_or_default();
            let tail: Vec<&str> = agent.lines().rev().take(15).collect();
            format!("server logs:\n{}\nagent:\n{}", logs(), tail.join("\n"))
        },
    );
    // The refusing successor ends (slowly on a loaded machine: librbd
    // shuts down), and none is started after it.
    volagent_test_support::wait_until(NBD_WAIT, "the refusing successor to end", || {
        servers_under(&root).is_empty()
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(servers_under(&root).is_empty(), "no helper serves the fenced image");
    assert!(
        !volagent_test_support::ceph::lockers(&image).iter().any(|l| *l != address),
        "no other client took the lock"
    );
    wait_until(Duration::from_secs(60), "the workload's I/O to fail", || {
        !writer.stats.lock().unwrap().1.is_empty()
    });
    let (_, errors, _) = writer.finish();
    eprintln!("the fenced volume's I/O failed: {errors:?}");
    assert_success(&driver(&["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    wait_until(NBD_WAIT, "the volume's processes to end", || {
        clients_under(&root).is_empty() && servers_under(&root).is_empty()
    });
    ceph_cmd(&["osd", "blocklist", "rm", &address]);
    node.stop_agent();
    let _ = mounter.kill();
    let _ = mounter.wait();
}

/// An RBD image through rbd-fuse.
#[test]
fn an_rbd_image_through_rbd_fuse_outlives_its_agent() {
    rbd_outlives_its_agent(
        Some("fuse"),
        "rbd-fuse",
        clients_under,
        Some(volagent::sys::pins::RBD_FUSE),
    );
}

/// A GlusterFS volume: mount.glusterfs runs in the mounter, and the FUSE
/// client it leaves (a daemon, so not the mounter's child) serves on.
#[test]
fn a_gluster_volume_outlives_its_agent() {
    let dir = PathBuf::from(std::env::var("VOLAGENT_GLUSTER_DIR").expect(
        "VOLAGENT_GLUSTER_DIR: the single-node GlusterFS of this run (scripts/gluster-env start makes it; scripts/test sets it)",
    ));
    assert!(dir.join("ready").exists(), "no GlusterFS ready in {}", dir.display());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    outlives_its_agent(
        "gluster",
        "mount.glusterfs",
        volagent_test_artifacts::GLUSTER,
        |_| {
            let mut o = kubelet_options("pv1", "pod-a", "uid-a", "", "");
            let m = o.as_object_mut().unwrap();
            m.remove("path");
            m.insert("servers".into(), host.clone().into());
            m.insert("volume".into(), "v0".into());
            m.insert("accessMode".into(), "ReadWriteMany".into());
            o
        },
        |root| {
            volagent_test_support::scratch::processes_under(root, |a| {
                a.first().is_some_and(|p| p.ends_with("glusterfs"))
            })
        },
        true,
        Some(volagent::sys::pins::GLUSTERFS),
    );
}

/// An agent told of a mounter that does not answer fails the mount with an
/// error naming the mounter's socket, and leaves nothing behind: no mount,
/// loop device, process or file of the export.
#[test]
fn a_mounter_that_does_not_answer_fails_the_mount_and_leaves_nothing() {
    let mut node = nbd_node(VOLAGENT);
    let socket = node.scratch.path("run/absent.sock");
    node.stop_agent();
    node.spawn_agent_env("node-a", &[], &["--mounter", socket.to_str().unwrap()]);
    let state = node.scratch.path("node-a/state");
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let mut options = nbd_options("pv1", "pod-a", "uid-a", "ext4", "unused");
    options.as_object_mut().unwrap().remove("server");
    options["file"] = node.image("own.img", 64).into();
    let r = driver(&node, &["mount", &dir, &options.to_string()]);
    volagent_test_support::driver::assert_failure(&r, "connect to the mounter at");
    volagent_test_support::driver::assert_failure(&r, "absent.sock");
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    assert!(clients_under(&state).is_empty() && servers_under(&state).is_empty());
    let left: Vec<PathBuf> = std::fs::read_dir(state.join("nbd"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
    node.stop_agent();
}

/// Send `body` to the mounter on `socket`; its reply.
fn ask(socket: &Path, body: &str) -> wire::Reply {
    let mut s = UnixStream::connect(socket).unwrap();
    wire::send(&mut s, body.as_bytes(), &[]).unwrap();
    let (reply, _) = wire::receive(&mut s).unwrap();
    serde_json::from_slice(&reply).unwrap()
}

fn error_of(reply: wire::Reply) -> String {
    match reply {
        wire::Reply::Error { message } => message,
        other => panic!("not an error: {other:?}"),
    }
}

/// Root only, even on a socket anyone may open; only the programs and
/// subcommands a launch may name; a request of a later protocol that this
/// mounter does not know, and pids it did not start, get errors that say
/// so — and the mounter goes on serving.
#[test]
fn the_mounter_serves_root_only_and_starts_only_what_a_launch_may_name() {
    let scratch = volagent_test_support::scratch::RootScratch::enter();
    let socket = scratch.path("mounter.sock");
    let mut mounter = start_mounter(&socket, &scratch.path("mounter.log"));
    assert_eq!(
        std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777,
        0o600,
        "the socket is root's only"
    );

    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let nobody = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups", VOLAGENT])
        .args(["mounter", "--check", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!nobody.status.success());
    let said = String::from_utf8_lossy(&nobody.stderr);
    assert!(said.contains("uid 65534 may not use the mounter"), "{said}");

    let spawn = |program: &str, args: &str| {
        format!(r#"{{"protocol":1,"op":"spawn","program":"{program}","args":{args},"path":"/x"}}"#)
    };
    for (body, says) in [
        (spawn("volagent", r#"["agent"]"#), "volagent agent is not a subcommand"),
        (spawn("/bin/sh", r#"["-c","id"]"#), "unknown variant"),
        (
            spawn("volagent", r#"["nbd","serve"]"#)
                .replace("\"path\"", "\"env\":[[\"LD_PRELOAD\",\"/x.so\"]],\"path\""),
            "LD_PRELOAD",
        ),
        (r#"{"protocol":2,"op":"hand-over","pid":1}"#.to_string(), "protocol 2 is newer"),
        (
            r#"{"protocol":1,"op":"kill","pid":1}"#.to_string(),
            "pid 1 is not a process this mounter started",
        ),
        (
            r#"{"protocol":1,"op":"status","pid":1}"#.to_string(),
            "pid 1 is not a process this mounter started",
        ),
        (r#"{"protocol":0,"op":"hello"}"#.to_string(), "protocol 0"),
    ] {
        let message = error_of(ask(&socket, &body));
        assert!(message.contains(says), "{body}: {message}");
    }
    // Descriptors that the request does not name are refused (and closed).
    let mut s = UnixStream::connect(&socket).unwrap();
    let devnull = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::AsRawFd;
    wire::send(&mut s, spawn("rbd-fuse", "[]").as_bytes(), &[devnull.as_raw_fd()]).unwrap();
    let (reply, _) = wire::receive(&mut s).unwrap();
    let message = error_of(serde_json::from_slice(&reply).unwrap());
    assert!(message.contains("1 descriptors came with a request naming 0 streams"), "{message}");

    // A run to its end, and one past its deadline.
    let run = |args: &str, deadline_ms: u64| {
        format!(
            r#"{{"protocol":1,"op":"run","program":"volagent","args":{args},"path":"/x","deadline_ms":{deadline_ms}}}"#
        )
    };
    match ask(&socket, &run(r#"["nbd","serve","--bogus"]"#, 10_000)) {
        wire::Reply::Ran { output } => {
            assert!(!output.exit.success);
            assert!(output.stderr.contains("--bogus"), "{output:?}");
        }
        other => panic!("{other:?}"),
    }
    // A server runs until stopped: killed at the run's deadline, and said so.
    let disk = scratch.image("disk.img", 1);
    let serve = format!(
        r#"["nbd","serve","--unix","{}","--export","={}"]"#,
        scratch.path("run.sock").display(),
        disk.display()
    );
    let started = std::time::Instant::now();
    assert_eq!(ask(&socket, &run(&serve, 500)), wire::Reply::TimedOut { secs: 0 });
    assert!(started.elapsed() < Duration::from_secs(5), "killed at its deadline");
    let servers = servers_under(&scratch.path(""));
    assert!(servers.is_empty(), "the run's server is gone: {servers:?}");
    assert!(matches!(ask(&socket, r#"{"protocol":1,"op":"hello"}"#), wire::Reply::Hello { .. }));
    let _ = mounter.kill();
    let _ = mounter.wait();
}
