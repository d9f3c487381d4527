//! NBD volumes end to end on a node without nbd.ko, as kubelet drives them:
//! the installed `volagent-flex` driver, the real agent serving the built
//! nbd policy, and real servers — qemu-nbd on a Unix socket, nbdkit on
//! loopback TCP, volagent's own `nbd serve` — each reached through the
//! userspace attach path (nbdfuse, a loop device), formatted and mounted.
//! What a pod wrote is read back from the server's file with debugfs/xfs_db,
//! not through volagent. Unmount leaves no loop device, FUSE mount, client
//! process or directory behind. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use volagent_test_support::agent::Node;
use volagent_test_support::driver::{assert_failure, assert_success};
use volagent_test_support::nbd::*;
use volagent_test_support::scratch;
use volagent_test_support::{wait_until, wait_until_or};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn round_trip(peer: Peer, fs: &str) {
    let node = nbd_node(VOLAGENT);
    // mkfs.xfs wants 300 MB at least; the file is sparse.
    let image = node.scratch.image("export.img", if fs == "xfs" { 320 } else { 64 });
    let (server, address) = serve(&node, peer, &image);
    let state = node.scratch.path("node-a/state");

    let dir_a = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let r = driver(
        &node,
        &["mount", &dir_a, &nbd_options("pv1", "pod-a", "uid-a", fs, &address).to_string()],
    );
    assert_success(&r);
    let device = r.1["device"].as_str().unwrap_or_default().to_string();
    assert!(device.starts_with("/dev/loop"), "{}", r.1);
    // The loop device is over the client's file, under the agent's state dir.
    let backing = std::fs::read_to_string(format!(
        "/sys/block/{}/loop/backing_file",
        device.trim_start_matches("/dev/")
    ))
    .unwrap();
    assert!(Path::new(backing.trim()).starts_with(state.join("nbd")), "{backing}");
    assert_eq!(clients_under(&state).len(), 1, "one nbdfuse client");
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(format!("{dir_a}/data"), &payload).unwrap();

    // A second pod on the node shares the staged mount: no second client.
    let dir_b = node.mount_dir_of("node-a", "nbd", "uid-b", "pv1");
    assert_success(&driver(
        &node,
        &["mount", &dir_b, &nbd_options("pv1", "pod-b", "uid-b", fs, &address).to_string()],
    ));
    assert_eq!(clients_under(&state).len(), 1);
    assert_eq!(std::fs::read(format!("{dir_b}/data")).unwrap(), payload);
    assert_success(&driver(&node, &["unmount", &dir_b]));
    assert_success(&driver(&node, &["unmount", &dir_a]));

    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    wait_until(NBD_WAIT, "the nbdfuse client to end", || clients_under(&state).is_empty());
    let left: Vec<PathBuf> = std::fs::read_dir(state.join("nbd"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "the client left {left:?}");
    // The data is in the server's file, as the filesystem wrote it.
    drop(server);
    assert_eq!(read_back(&image, fs), payload);
}

#[test]
fn a_qemu_nbd_export_over_a_unix_socket_mounts_as_ext4() {
    round_trip(Peer::QemuNbd, "ext4");
}

#[test]
fn an_nbdkit_export_over_loopback_tcp_mounts_as_xfs() {
    round_trip(Peer::Nbdkit, "xfs");
}

#[test]
fn volagents_own_server_mounts_as_ext4() {
    round_trip(Peer::Volagent, "ext4");
}

#[test]
fn an_unreachable_server_or_a_kernel_only_volume_is_refused_and_leaves_nothing() {
    let node = nbd_node(VOLAGENT);
    let state = node.scratch.path("node-a/state");
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let nowhere = format!("unix:{}", node.scratch.path("nobody.sock").display());
    let r = driver(
        &node,
        &["mount", &dir, &nbd_options("pv1", "pod-a", "uid-a", "ext4", &nowhere).to_string()],
    );
    assert_failure(&r, "volagent nbd fuse");
    let mut kernel = nbd_options("pv1", "pod-a", "uid-a", "ext4", &nowhere);
    kernel["attach"] = "kernel".into();
    assert_failure(&driver(&node, &["mount", &dir, &kernel.to_string()]), "kernel's nbd driver");
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    assert!(clients_under(&state).is_empty());
}

/// pod-a's ext4 volume pv1 on a fresh qemu-nbd export, mounted through
/// the driver: the server, its address, the agent's state dir, the pod's
/// mount dir and the device.
struct Mounted {
    server: Server,
    address: String,
    state: PathBuf,
    dir: String,
    device: String,
}

fn mount_on_qemu_nbd(node: &Node) -> Mounted {
    let image = node.scratch.image("export.img", 64);
    let (server, address) = serve(node, Peer::QemuNbd, &image);
    let state = node.scratch.path("node-a/state");
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let r = driver(
        node,
        &["mount", &dir, &nbd_options("pv1", "pod-a", "uid-a", "ext4", &address).to_string()],
    );
    assert_success(&r);
    let device = r.1["device"].as_str().unwrap_or_default().to_string();
    Mounted { server, address, state, dir, device }
}

#[test]
fn clients_outlive_an_agent_restart_and_the_next_agent_detaches_them() {
    let mut node = nbd_node(VOLAGENT);
    let Mounted { server: _server, state, dir, .. } = mount_on_qemu_nbd(&node);
    let before = clients_under(&state);
    node.stop_agent();
    // The pod's volume works with no agent running.
    std::fs::write(format!("{dir}/during"), b"agent down").unwrap();
    nix::unistd::sync();
    node.spawn_agent_env("node-a", &[], &[]);
    assert_eq!(clients_under(&state), before, "the same client, adopted");
    assert_eq!(std::fs::read(format!("{dir}/during")).unwrap(), b"agent down");
    assert_success(&driver(&node, &["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    wait_until(NBD_WAIT, "the nbdfuse client to end", || clients_under(&state).is_empty());
}

#[test]
fn a_server_that_stops_answering_is_aborted_and_unmount_still_completes() {
    let mut node = nbd_node(VOLAGENT);
    node.stop_agent();
    node.spawn_agent_env("node-a", &[], &["--nbd-hung-after", "2s"]);
    let Mounted { server, address, state, dir, .. } = mount_on_qemu_nbd(&node);
    std::fs::write(format!("{dir}/before"), b"flushed").unwrap();
    nix::unistd::sync();
    // The server hangs: alive, connected, silent.
    let server_pid = nix::unistd::Pid::from_raw(server.0.id() as i32);
    nix::sys::signal::kill(server_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    std::fs::write(format!("{dir}/after"), vec![1u8; 1 << 20]).unwrap();
    let start = Instant::now();
    let first = driver(&node, &["unmount", &dir]);
    // The watchdog aborts the client within a few seconds; the unmount
    // (which flushes through it) then fails fast instead of hanging.
    assert!(start.elapsed() < Duration::from_secs(60), "unmount took {:?}", start.elapsed());
    if first.1["status"] != "Success" {
        assert_success(&driver(&node, &["unmount", &dir]));
    }
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    wait_until(NBD_WAIT, "the aborted client to be gone", || clients_under(&state).is_empty());
    // The aborted client's mount is gone, so the kernel names a device
    // still over its file "/<key>": none may be left.
    let key = volagent::exec::nbd_key(&volagent::policy::NbdSpec {
        server: address.clone(),
        export_name: "disk0".into(),
        local_file: None,
        attach: volagent::policy::NbdAttach::Userspace,
        connections: 4,
    });
    let stale: Vec<_> = {
        use volagent::sys::Devices;
        volagent::sys::linux::Linux::unrooted()
            .loop_devices()
            .unwrap()
            .into_iter()
            .filter(|l| l.backing_file == Path::new("/").join(&key))
            .collect()
    };
    assert!(stale.is_empty(), "loop devices left over the aborted client's file: {stale:?}");
    let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
    assert!(log.contains("has not answered a flush"), "the agent says why it aborted the client");
    nix::sys::signal::kill(server_pid, nix::sys::signal::Signal::SIGCONT).unwrap();
}

/// Write and fsync a new file in `dir` on a thread; what it came to, or
/// None if it has not come back within `within` (hung).
fn write_and_sync(dir: &str, name: &str, within: Duration) -> Option<std::io::Result<()>> {
    let path = format!("{dir}/{name}");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let done = std::fs::File::create(&path).and_then(|mut f| {
            std::io::Write::write_all(&mut f, &[7u8; 65536])?;
            f.sync_all()
        });
        let _ = tx.send(done);
    });
    rx.recv_timeout(within).ok()
}

/// A userspace client of a remote server (qemu-nbd) that is killed is
/// started again on the FUSE connection the agent kept: the volume goes on.
/// When the server is gone too, no client can be: after --nbd-hung-after the
/// agent lets the connection go and aborts it, so I/O fails instead of
/// hanging, and the unmount completes.
#[test]
fn a_killed_client_is_started_again_and_one_that_cannot_be_is_aborted_after_the_hung_timeout() {
    let mut node = nbd_node(VOLAGENT);
    node.stop_agent();
    node.spawn_agent_env("node-a", &[], &["--nbd-hung-after", "2s"]);
    let Mounted { mut server, state, dir, .. } = mount_on_qemu_nbd(&node);
    let first = clients_under(&state);
    assert_eq!(first.len(), 1);
    for pid in &first {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    wait_until(NBD_WAIT, "another client", || {
        let now = clients_under(&state);
        now.len() == 1 && now != first
    });
    let wrote = write_and_sync(&dir, "after-client", Duration::from_secs(30));
    assert!(matches!(wrote, Some(Ok(()))), "the volume serves on: {wrote:?}");

    // The server and the client gone: nothing to start a client on.
    let _ = server.0.kill();
    let _ = server.0.wait();
    for pid in clients_under(&state) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let wrote = write_and_sync(&dir, "after-server", Duration::from_secs(60));
    assert!(matches!(wrote, Some(Err(_))), "I/O fails, not hangs: {wrote:?}");
    let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
    assert!(log.contains("no client could be started again"), "the agent says why: {log}");
    let unmounted = driver(&node, &["unmount", &dir]);
    if unmounted.1["status"] != "Success" {
        assert_success(&driver(&node, &["unmount", &dir]));
    }
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
}

#[test]
fn start_up_reconciliation_removes_clients_nothing_uses() {
    let mut node = nbd_node(VOLAGENT);
    let Mounted { server: _server, state, dir, device, .. } = mount_on_qemu_nbd(&node);
    let (_, mut agent) = node.agents.remove(0);
    agent.kill().unwrap();
    // Gone only once it has left the kernel: a thread waiting on I/O
    // through the client takes the kill when that I/O ends.
    agent.wait().unwrap();
    // While no agent runs, someone tears the mounts and the device down by
    // hand: the client is left serving nothing.
    let staging = node.scratch.path("node-a/kubelet/plugins/volagent/nbd/mounts/pv1");
    for m in [Path::new(&dir), staging.as_path()] {
        assert!(Command::new("umount").arg(m).status().unwrap().success());
    }
    assert!(Command::new("losetup").arg("-d").arg(&device).status().unwrap().success());
    assert_eq!(clients_under(&state).len(), 1);
    node.spawn_agent_env("node-a", &[], &[]);
    wait_until_or(
        NBD_WAIT,
        "the unused client to be stopped",
        || clients_under(&state).is_empty(),
        || std::fs::read_to_string(node.log_path("node-a")).unwrap_or_default(),
    );
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    assert!(std::fs::read_dir(state.join("nbd")).map(|d| d.count()).unwrap_or(0) == 0);
}

/// Volume pv1 of pod-a as a local file the agent serves itself.
fn file_options(file: &str) -> serde_json::Value {
    let mut options = nbd_options("pv1", "pod-a", "uid-a", "ext4", "unused");
    options.as_object_mut().unwrap().remove("server");
    options["file"] = file.into();
    options
}

#[test]
fn the_agent_serves_a_local_file_itself_across_a_restart() {
    let mut node = nbd_node(VOLAGENT);
    let image = node.image("own.img", 64);
    let state = node.scratch.path("node-a/state");
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let options = file_options(&image);
    let r = driver(&node, &["mount", &dir, &options.to_string()]);
    assert_success(&r);
    let servers = servers_under(&state);
    assert_eq!(servers.len(), 1, "one helper server");
    assert_eq!(clients_under(&state).len(), 1, "one client of it");
    std::fs::write(format!("{dir}/data"), b"through the agent's own export").unwrap();

    // Both outlive the agent; the next one uses them.
    node.stop_agent();
    std::fs::write(format!("{dir}/during"), b"agent down").unwrap();
    nix::unistd::sync();
    node.spawn_agent_env("node-a", &[], &[]);
    assert_eq!(servers_under(&state), servers, "the same helper server, adopted");
    assert_eq!(std::fs::read(format!("{dir}/during")).unwrap(), b"agent down");
    assert_success(&driver(&node, &["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    wait_until(NBD_WAIT, "the client and the helper server to end", || {
        clients_under(&state).is_empty() && servers_under(&state).is_empty()
    });
    let left: Vec<PathBuf> = std::fs::read_dir(state.join("nbd"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(read_back(Path::new(&image), "ext4"), b"through the agent's own export");
}

#[test]
fn a_helper_servers_socket_is_0600_and_serves_no_other_uid() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let node = nbd_node(VOLAGENT);
    let image = node.image("own.img", 64);
    let state = node.scratch.path("node-a/state");
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let options = file_options(&image);
    assert_success(&driver(&node, &["mount", &dir, &options.to_string()]));
    let sockets: Vec<PathBuf> = std::fs::read_dir(state.join("nbd"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sock"))
        .collect();
    let [socket] = &sockets[..] else { panic!("one helper socket: {sockets:?}") };
    let meta = std::fs::symlink_metadata(socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600, "{}", socket.display());

    // Let another uid reach the socket's dir: the socket's mode still stops it.
    let mut up = socket.parent().unwrap();
    while up.starts_with(node.scratch.path("")) {
        let mode = std::fs::metadata(up).unwrap().permissions().mode();
        std::fs::set_permissions(up, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
        up = up.parent().unwrap();
    }
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    let as_nobody = || {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "nbdinfo"])
            .arg(&uri)
            .output()
            .unwrap()
    };
    let out = as_nobody();
    assert!(!out.status.success(), "uid 65534 was served");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"), "{out:?}");
    // Widened by someone else, the socket lets it connect; the helper
    // checks the peer's uid and closes it.
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = as_nobody();
    assert!(!out.status.success(), "uid 65534 was served through a widened socket");
    let log = socket.with_extension("server.log");
    wait_until_or(
        NBD_WAIT,
        "the helper to log the refusal",
        || std::fs::read_to_string(&log).unwrap_or_default().contains("uid=65534"),
        || std::fs::read_to_string(&log).unwrap_or_default(),
    );
    assert!(std::fs::read_to_string(&log).unwrap().contains("refused an NBD client"));
    // Root is served as before: the volume works on.
    std::fs::write(format!("{dir}/data"), b"after the refusals").unwrap();
    assert_success(&driver(&node, &["unmount", &dir]));
    wait_until(NBD_WAIT, "the client and the helper server to end", || {
        clients_under(&state).is_empty() && servers_under(&state).is_empty()
    });
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
    assert_eq!(read_back(Path::new(&image), "ext4"), b"after the refusals");
}

#[test]
fn a_local_file_outside_the_discovery_dirs_is_refused() {
    let node = nbd_node(VOLAGENT);
    let outside = node.scratch.image("outside.img", 16);
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let options = file_options(&outside.display().to_string());
    assert_failure(
        &driver(&node, &["mount", &dir, &options.to_string()]),
        "outside the dirs this backend may use",
    );
    assert!(servers_under(&node.scratch.path("node-a/state")).is_empty());
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// A FUSE mount of a memory disk served by nbdkit through nbdfuse at
/// `<dir>/disk`: the client and its connection's number.
fn memory_disk(dir: &Path) -> (std::process::Child, u32) {
    use std::os::unix::fs::MetadataExt;
    std::fs::create_dir_all(dir).unwrap();
    let pid_file = dir.with_extension("pid");
    let _ = std::fs::remove_file(&pid_file);
    let mut child = Command::new("nbdfuse")
        .arg("-P")
        .arg(&pid_file)
        .arg(dir.join("disk"))
        .args(["--command", "nbdkit", "-s", "--exit-with-parent", "memory", "1M"])
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !pid_file.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "nbdfuse ended before it mounted {}",
            dir.display()
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "nbdfuse did not mount {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let dev = std::fs::metadata(dir).unwrap().dev();
    (child, nix::sys::stat::minor(dev) as u32)
}

fn unmount_disk(dir: &Path, mut child: std::process::Child) {
    nix::mount::umount2(dir, nix::mount::MntFlags::empty()).unwrap();
    child.wait().unwrap();
}

/// Whether the disk at `<dir>/disk` answers a read.
fn reads(dir: &Path) -> bool {
    use std::io::Read;
    let mut buf = [0u8; 4096];
    std::fs::File::open(dir.join("disk")).and_then(|mut f| f.read_exact(&mut buf)).is_ok()
}

/// The kernel gives a FUSE connection's number to the next FUSE mount as
/// soon as the old connection is gone. The agent opens a connection's
/// abort switch while its client's mount is known to be there; pulled
/// after that client ended and another client took the number, it must
/// leave the other client serving (aborting by number would kill it).
#[test]
fn an_abort_switch_outliving_its_connection_spares_the_client_that_took_its_number() {
    use volagent::sys::fusectl::AbortSwitch;
    let scratch = scratch::RootScratch::enter();
    // Other tests mount too: the number is not always the next one handed out.
    for attempt in 1..=20 {
        let (first_dir, second_dir) =
            (scratch.path(&format!("first-{attempt}")), scratch.path(&format!("second-{attempt}")));
        let (first, conn) = memory_disk(&first_dir);
        let switch = AbortSwitch::open(conn).unwrap();
        assert!(reads(&first_dir));
        unmount_disk(&first_dir, first);
        let (second, taken) = memory_disk(&second_dir);
        if taken != conn {
            unmount_disk(&second_dir, second);
            continue;
        }
        switch.pull();
        assert!(
            reads(&second_dir),
            "the switch of connection {conn}, ended, aborted the client that took its number"
        );
        // The control: its own switch does abort it.
        AbortSwitch::open(taken).unwrap().pull();
        assert!(!reads(&second_dir), "a pulled switch aborts its own connection");
        unmount_disk(&second_dir, second);
        return;
    }
    panic!("in 20 tries the kernel never gave a FUSE connection's number to the next FUSE mount");
}

/// Faults injected at the sys seam into an NBD volume's device steps: the
/// loop device over the client's file cannot be attached (EIO) once the
/// nbdfuse client is up, or detached (EBUSY) on unmount. A failed mount
/// rolls back to nothing — no mount, loop device or client process; once
/// the fault is gone, kubelet's retry of either succeeds, and the volume
/// ends unmounted clean with what the pod wrote in the server's file.
#[test]
fn faults_at_an_nbd_volumes_attach_and_detach_roll_back_and_retries_succeed() {
    let mut node = nbd_node(VOLAGENT);
    let rules = node.restart_with_faults(&[]);
    let image = node.scratch.image("export.img", 64);
    let (_server, address) = serve(&node, Peer::QemuNbd, &image);
    let state = node.scratch.path("node-a/state");
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let options = nbd_options("pv1", "pod-a", "uid-a", "ext4", &address).to_string();
    let said = |r: &(i32, serde_json::Value), what: &str| {
        let message = r.1["message"].as_str().unwrap_or_default();
        assert!(
            r.1["status"] == "Failure"
                && message.contains(what)
                && message.contains("injected fault"),
            "{what}: {}",
            r.1
        );
    };

    std::fs::write(&rules, "attach-device EIO\n").unwrap();
    let r = driver(&node, &["mount", &dir, &options]);
    said(&r, "EIO");
    assert!(node.scratch.mounts().is_empty(), "rolled back: {:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "rolled back: {:?}", node.scratch.loops());
    wait_until(NBD_WAIT, "the rolled back nbdfuse client to end", || {
        clients_under(&state).is_empty()
    });
    std::fs::remove_file(&rules).unwrap();
    assert_success(&driver(&node, &["mount", &dir, &options]));
    std::fs::write(format!("{dir}/data"), b"after the fault").unwrap();
    assert_eq!(clients_under(&state).len(), 1);

    std::fs::write(&rules, "detach-device EBUSY\n").unwrap();
    let r = driver(&node, &["unmount", &dir]);
    said(&r, "EBUSY");
    std::fs::remove_file(&rules).unwrap();
    assert_success(&driver(&node, &["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    wait_until(NBD_WAIT, "the nbdfuse client to end", || clients_under(&state).is_empty());
    assert_eq!(read_back(&image, "ext4"), b"after the fault");
}
