//! NBD volumes through the kernel's nbd driver, which this machine's kernel
//! lacks. The tests in `in_the_vm` run inside a VM whose kernel has it: the
//! test at the top boots Debian's kernel under qemu (scripts/vm-assets)
//! with this machine's root, read-only under a tmpfs overlay, as its root,
//! loads nbd, and runs this very binary there once per inner test. The inner
//! tests are the same as the userspace path's (root_nbd.rs): the installed
//! `volagent-flex` driver, the real agent and nbd policy, real servers —
//! but the device is `/dev/nbdN`, connected by nbd-client over netlink.
//! Outside the VM the inner tests are ignored; they fail, not pass, when
//! run without the kernel's nbd driver.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use volagent_test_support::vm;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// The inner tests, by name (each runs in its own process in the VM).
const IN_THE_VM: &[&str] = &[
    "an_export_is_mounted_through_a_kernel_nbd_device_and_detached_whole",
    "the_agents_own_export_outlives_the_agent_on_the_kernel_device",
    "a_killed_helper_is_started_again_and_the_device_reconnected_to_it_while_a_workload_writes",
    "without_fuse_resend_a_userspace_client_stopped_with_sigterm_is_replaced_without_an_error",
    "without_fuse_resend_requests_a_killed_client_took_fail_instead_of_waiting_forever",
    "a_mount_cut_short_after_the_connect_leaves_no_device_connected",
    "start_up_reconciliation_disconnects_a_connection_no_record_names",
    "a_server_that_stops_answering_fails_io_instead_of_hanging",
    "an_unreachable_server_is_refused_and_connects_no_device",
];

#[test]
fn every_test_for_the_vm_is_run_by_it() {
    vm::assert_every_test_is_run("in_the_vm", IN_THE_VM);
}

#[test]
fn the_kernel_attach_path_works_in_a_vm_whose_kernel_has_nbd() {
    let dir = vm::work_dir();
    vm::run_tests(dir.path(), 2048, "", "in_the_vm", IN_THE_VM, "dmesg | tail -n 40");
}

mod in_the_vm {
    use serde_json::Value;
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};
    use volagent_test_support::agent::Node;
    use volagent_test_support::driver::{assert_failure, assert_success};
    use volagent_test_support::nbd::*;
    use volagent_test_support::wait_until;

    const WHY: &str = "needs the kernel's nbd driver: runs inside the VM (the_kernel_attach_path_works_in_a_vm_whose_kernel_has_nbd)";

    /// A test's node; on drop, even after a failure, every nbd device
    /// still connected is disconnected.
    type VmNode = super::vm::Guarded<Node>;

    fn release(node: &mut Node) {
        node.stop_agent();
        for name in connected_devices() {
            let _ = std::process::Command::new("nbd-client")
                .arg("-d")
                .arg(format!("/dev/{name}"))
                .status();
        }
    }

    /// The node for a test: the kernel must have nbd, or the test fails.
    fn node() -> VmNode {
        assert!(Path::new("/sys/module/nbd").exists() && Path::new("/dev/nbd0").exists(), "{WHY}");
        VmNode::new(nbd_node(super::VOLAGENT), release)
    }

    /// The driver's options for an export, the attach path left to the
    /// host (auto: the kernel's, where it has nbd).
    fn options(volume: &str, pod: &str, uid: &str, server: &str) -> Value {
        let mut o = nbd_options(volume, pod, uid, "ext4", server);
        o.as_object_mut().unwrap().remove("attach");
        o
    }

    /// Whether the kernel reports a connection on `/dev/nbdN`.
    fn connected(device: &str) -> bool {
        Path::new("/sys/block").join(device.trim_start_matches("/dev/")).join("pid").exists()
    }

    /// Every nbd device with a connection.
    fn connected_devices() -> Vec<String> {
        let mut found: Vec<String> = std::fs::read_dir("/sys/block")
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("nbd") && connected(n))
            .collect();
        found.sort();
        found
    }

    fn left_in(dir: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
    }

    /// Mount pod `uid`'s pv1 on `server`; the device.
    fn mount(node: &Node, uid: &str, server: &str) -> (String, String) {
        let dir = node.mount_dir_of("node-a", "nbd", uid, "pv1");
        let r = driver(
            node,
            &["mount", &dir, &options("pv1", &format!("pod-{uid}"), uid, server).to_string()],
        );
        assert_success(&r);
        let device = r.1["device"].as_str().unwrap_or_default().to_string();
        (dir, device)
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn an_export_is_mounted_through_a_kernel_nbd_device_and_detached_whole() {
        let node = node();
        let image = node.scratch.image("export.img", 64);
        let (server, address) = serve(&node, Peer::QemuNbd, &image);
        let state = node.scratch.path("node-a/state");
        let (dir_a, device) = mount(&node, "uid-a", &address);
        assert!(device.starts_with("/dev/nbd"), "auto chose the kernel's device: {device}");
        assert!(connected(&device), "{device} is connected");
        assert!(
            clients_under(&state).is_empty() && node.scratch.loops_left().is_empty(),
            "no userspace client, no loop device"
        );
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(format!("{dir_a}/data"), &payload).unwrap();

        // A second pod shares the staged mount, on the same device.
        let (dir_b, _) = mount(&node, "uid-b", &address);
        assert_eq!(connected_devices().len(), 1, "one connection for the export");
        assert_eq!(std::fs::read(format!("{dir_b}/data")).unwrap(), payload);
        assert_success(&driver(&node, &["unmount", &dir_b]));
        assert!(connected(&device), "still used by pod a");
        assert_success(&driver(&node, &["unmount", &dir_a]));

        assert!(!connected(&device), "{device} was disconnected");
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
        assert!(
            left_in(&state.join("nbd")).is_empty(),
            "left behind: {:?}",
            left_in(&state.join("nbd"))
        );
        drop(server);
        assert_eq!(read_back(&image, "ext4"), payload, "the data is in the server's file");
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn the_agents_own_export_outlives_the_agent_on_the_kernel_device() {
        let mut node = node();
        let image = node.image("own.img", 64);
        let state = node.scratch.path("node-a/state");
        let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
        let mut o = options("pv1", "pod-a", "uid-a", "unused");
        o.as_object_mut().unwrap().remove("server");
        o["file"] = image.clone().into();
        let r = driver(&node, &["mount", &dir, &o.to_string()]);
        assert_success(&r);
        let device = r.1["device"].as_str().unwrap_or_default().to_string();
        assert!(device.starts_with("/dev/nbd") && connected(&device), "{}", r.1);
        let servers = servers_under(&state);
        assert_eq!(servers.len(), 1, "one helper server");
        std::fs::write(format!("{dir}/data"), b"through the kernel and the agent's own export")
            .unwrap();

        // The kernel holds the connection, the helper serves it: no agent needed.
        node.stop_agent();
        std::fs::write(format!("{dir}/during"), b"agent down").unwrap();
        nix::unistd::sync();
        node.spawn_agent_env("node-a", &[], &[]);
        assert!(connected(&device), "kept by the next agent's start-up reconciliation");
        assert_eq!(servers_under(&state), servers, "the same helper server");
        assert_eq!(std::fs::read(format!("{dir}/during")).unwrap(), b"agent down");
        assert_success(&driver(&node, &["unmount", &dir]));
        assert!(!connected(&device));
        wait_until(NBD_WAIT, "the helper server to end", || servers_under(&state).is_empty());
        assert!(node.scratch.mounts().is_empty());
        assert!(
            left_in(&state.join("nbd")).is_empty(),
            "left behind: {:?}",
            left_in(&state.join("nbd"))
        );
        assert_eq!(
            read_back(Path::new(&image), "ext4"),
            b"through the kernel and the agent's own export"
        );
    }

    /// The agent's helper is SIGKILLed under a workload that appends and
    /// fsyncs: the device's requests wait (the dead-connection timeout the
    /// agent set), the agent starts the helper again on the export it kept
    /// and hands the device the new helper's sockets (NBD_CMD_RECONFIGURE).
    /// The workload sees a delay, never an error, and every record is on
    /// the device.
    #[test]
    #[ignore = "runs inside the VM"]
    fn a_killed_helper_is_started_again_and_the_device_reconnected_to_it_while_a_workload_writes() {
        use volagent_test_support::workload::{Writer, every_record_in_place, kill_all};
        let mut node = node();
        // A request the killed helper had taken waits for this long before
        // the kernel sends it again: it bounds the stall a kill costs.
        node.stop_agent();
        node.spawn_agent_env("node-a", &[], &["--nbd-hung-after", "8s"]);
        let image = node.image("own.img", 64);
        let state = node.scratch.path("node-a/state");
        let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
        let mut o = options("pv1", "pod-a", "uid-a", "unused");
        o.as_object_mut().unwrap().remove("server");
        o["file"] = image.into();
        let r = driver(&node, &["mount", &dir, &o.to_string()]);
        assert_success(&r);
        let device = r.1["device"].as_str().unwrap_or_default().to_string();
        assert!(device.starts_with("/dev/nbd") && connected(&device), "{}", r.1);
        let helper = servers_under(&state);
        assert_eq!(helper.len(), 1, "one helper server");

        let mut writer = Writer::start(&dir);
        writer.logs = vec![node.log_path("node-a")];
        writer.goes_on(20, "before");
        std::mem::take(&mut writer.stats.lock().unwrap().2);
        kill_all(&helper);
        wait_until(NBD_WAIT, "another helper", || {
            let now = servers_under(&state);
            now.len() == 1 && now != helper
        });
        writer.goes_on(30, "after the helper was killed");
        let file = writer.file.clone();
        let (written, errors, stall) = writer.finish();
        assert!(errors.is_empty(), "the workload saw errors: {errors:?}");
        println!(
            "the helper killed under the kernel device: the longest write + fsync took {stall:?}"
        );
        let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
        assert!(
            log.contains("was reconnected to its helper"),
            "the agent says what it did:\n{log}"
        );
        assert!(connected(&device), "{device} is still connected");

        // What the workload wrote is on the device, not only in the cache.
        nix::unistd::sync();
        std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
        every_record_in_place(&file, written);
        assert_success(&driver(&node, &["unmount", &dir]));
        assert!(!connected(&device), "{device} was disconnected");
        wait_until(NBD_WAIT, "the helper server to end", || servers_under(&state).is_empty());
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
        assert!(
            left_in(&state.join("nbd")).is_empty(),
            "left behind: {:?}",
            left_in(&state.join("nbd"))
        );
    }

    /// On this VM's kernel, which must be one without FUSE_NOTIFY_RESEND
    /// (before 6.9): a node, the kernel's release, the agent's state dir,
    /// and volume pv1 mounted from a local file behind the agent's helper
    /// through its userspace client and a loop device.
    fn own_export_over_fuse_without_resend() -> (VmNode, String, PathBuf, String) {
        let release = nix::sys::utsname::uname().unwrap().release().to_string_lossy().into_owned();
        let mut numbers = release.split(['.', '-']).map(|n| n.parse::<u32>().unwrap_or(0));
        let (major, minor) = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
        assert!((major, minor) < (6, 9), "this test is for a kernel without resend, not {release}");
        let node = node();
        let state = node.scratch.path("node-a/state");
        let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
        let mut o = options("pv1", "pod-a", "uid-a", "unused");
        o.as_object_mut().unwrap().remove("server");
        o["file"] = node.image("own.img", 64).into();
        o["attach"] = "userspace".into();
        let r = driver(&node, &["mount", &dir, &o.to_string()]);
        assert_success(&r);
        assert!(r.1["device"].as_str().is_some_and(|d| d.starts_with("/dev/loop")), "{}", r.1);
        assert_eq!(clients_under(&state).len(), 1, "one userspace client");
        (node, release, state, dir)
    }

    /// This VM's kernel (Debian's 6.1) has no FUSE_NOTIFY_RESEND: what a
    /// userspace client had taken when it died is never queued again. A
    /// client sent SIGTERM — what the mounter does to each when its pod is
    /// replaced — answers what it took and takes nothing more, so its
    /// successor, started by the agent on the connection it kept, serves
    /// every request left: the workload sees a pause, no error.
    #[test]
    #[ignore = "runs inside the VM"]
    fn without_fuse_resend_a_userspace_client_stopped_with_sigterm_is_replaced_without_an_error() {
        use volagent_test_support::workload::{Writer, every_record_in_place};
        let (node, release, state, dir) = own_export_over_fuse_without_resend();
        let client = clients_under(&state);

        let mut writer = Writer::start(&dir);
        writer.logs = vec![node.log_path("node-a")];
        writer.goes_on(20, "before");
        std::mem::take(&mut writer.stats.lock().unwrap().2);
        for pid in &client {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGTERM,
            )
            .unwrap();
        }
        wait_until(NBD_WAIT, "another client", || {
            let now = clients_under(&state);
            now.len() == 1 && now != client
        });
        writer.goes_on(30, "after the client was replaced");
        let file = writer.file.clone();
        let (written, errors, stall) = writer.finish();
        assert!(errors.is_empty(), "the workload saw errors: {errors:?}");
        println!(
            "a client replaced (SIGTERM) on {release}: the longest write + fsync took {stall:?}"
        );
        nix::unistd::sync();
        std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
        every_record_in_place(&file, written);
        assert_success(&driver(&node, &["unmount", &dir]));
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
        assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops_left());
        wait_until(NBD_WAIT, "the client and helper to end", || {
            clients_under(&state).is_empty() && servers_under(&state).is_empty()
        });
    }

    /// Linux 6.1 cannot queue again what a dead client took
    /// (`FUSE_NOTIFY_RESEND` came with 6.9). A client SIGKILLed while it
    /// holds requests — its helper stopped (SIGSTOP), so they wait on it —
    /// leaves them to no one; its successor, started on the connection the
    /// agent kept, sees them waiting while it is idle, and aborts the
    /// connection: the workload's I/O fails within seconds instead of
    /// waiting forever, and the volume still unmounts and leaves nothing.
    #[test]
    #[ignore = "runs inside the VM"]
    fn without_fuse_resend_requests_a_killed_client_took_fail_instead_of_waiting_forever() {
        use volagent_test_support::workload::{Writer, kill_all};
        let (node, release, state, dir) = own_export_over_fuse_without_resend();
        let (client, helper) = (clients_under(&state), servers_under(&state));
        assert_eq!((client.len(), helper.len()), (1, 1), "one client, one helper");

        let mut writer = Writer::start(&dir);
        let logs: Vec<PathBuf> = std::fs::read_dir(state.join("nbd"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
            .collect();
        writer.logs = logs.iter().cloned().chain([node.log_path("node-a")]).collect();
        writer.goes_on(20, "before");
        let signal = |pids: &[i32], s| {
            for pid in pids {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), s).unwrap();
            }
        };
        // The helper stopped: the client's requests wait on it, held.
        signal(&helper, nix::sys::signal::Signal::SIGSTOP);
        let mut last = (writer.written(), Instant::now());
        wait_until(NBD_WAIT, "the workload to wait on the stopped helper", || {
            if writer.written() != last.0 {
                last = (writer.written(), Instant::now());
            }
            last.1.elapsed() > Duration::from_secs(1)
        });
        kill_all(&client);
        signal(&helper, nix::sys::signal::Signal::SIGCONT);
        let killed = Instant::now();
        wait_until(NBD_WAIT, "another client", || {
            let now = clients_under(&state);
            now.len() == 1 && now != client
        });
        wait_until(Duration::from_secs(40), "the workload's I/O to fail", || {
            !writer.stats.lock().unwrap().1.is_empty()
        });
        let failed_after = killed.elapsed();
        let said: String =
            logs.iter().map(|l| std::fs::read_to_string(l).unwrap_or_default()).collect();
        assert!(said.contains("cannot give to a successor"), "the successor said why: {said}");
        let (_, errors, _) = writer.finish();
        println!(
            "a client killed holding requests on {release}: the workload's I/O failed {failed_after:?} after ({errors:?})"
        );
        assert_success(&driver(&node, &["unmount", &dir]));
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
        assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops_left());
        wait_until(NBD_WAIT, "the client and helper to end", || {
            clients_under(&state).is_empty() && servers_under(&state).is_empty()
        });
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn a_mount_cut_short_after_the_connect_leaves_no_device_connected() {
        let mut node = node();
        let image = node.scratch.image("export.img", 64);
        let (_server, address) = serve(&node, Peer::QemuNbd, &image);
        let state = node.scratch.path("node-a/state");
        // The agent dies (SIGKILL) right after the plan's first step: the attach.
        node.stop_agent();
        node.spawn_agent_with("node-a", Some(1));
        let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
        let r = driver(
            &node,
            &["mount", &dir, &options("pv1", "pod-a", "uid-a", &address).to_string()],
        );
        assert_ne!(r.1["status"], "Success", "{}", r.1);
        let left = connected_devices();
        assert_eq!(left.len(), 1, "the crash came after the connect: {left:?}");
        node.stop_agent();
        // The next agent's start-up reconciliation undoes it.
        node.spawn_agent_env("node-a", &[], &[]);
        assert!(connected_devices().is_empty(), "{:?} still connected", connected_devices());
        assert!(
            left_in(&state.join("nbd")).is_empty(),
            "left behind: {:?}",
            left_in(&state.join("nbd"))
        );
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
        // kubelet's retry mounts it.
        assert_success(&driver(
            &node,
            &["mount", &dir, &options("pv1", "pod-a", "uid-a", &address).to_string()],
        ));
        assert_success(&driver(&node, &["unmount", &dir]));
        assert!(connected_devices().is_empty());
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn start_up_reconciliation_disconnects_a_connection_no_record_names() {
        let mut node = node();
        let image = node.scratch.image("export.img", 64);
        let (_server, address) = serve(&node, Peer::QemuNbd, &image);
        let state = node.scratch.path("node-a/state");
        let (_dir, device) = mount(&node, "uid-a", &address);
        node.stop_agent();
        // The agent's stash of what it mounted is lost (its runtime dir is
        // a tmpfs that went), and the mounts went with the pods: only the
        // connection and the record beside it remain.
        for m in node.scratch.mounts().into_iter().rev() {
            nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).unwrap();
        }
        std::fs::remove_dir_all(node.scratch.path("node-a/run")).unwrap();
        assert!(connected(&device));
        node.spawn_agent_env("node-a", &[], &[]);
        assert!(!connected(&device), "the next agent disconnected {device}");
        assert!(
            left_in(&state.join("nbd")).is_empty(),
            "left behind: {:?}",
            left_in(&state.join("nbd"))
        );
        let log = std::fs::read_to_string(node.log_path("node-a")).unwrap();
        assert!(
            log.contains("orphan kernel NBD connection"),
            "the agent says what it removed:\n{log}"
        );
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn a_server_that_stops_answering_fails_io_instead_of_hanging() {
        let mut node = node();
        node.stop_agent();
        node.spawn_agent_env("node-a", &[], &["--nbd-hung-after", "3s"]);
        let image = node.scratch.image("export.img", 64);
        let (server, address) = serve(&node, Peer::QemuNbd, &image);
        let (dir, device) = mount(&node, "uid-a", &address);
        std::fs::write(format!("{dir}/before"), b"flushed").unwrap();
        nix::unistd::sync();
        // The server hangs: alive, connected, silent.
        let server_pid = nix::unistd::Pid::from_raw(server.0.id() as i32);
        nix::sys::signal::kill(server_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
        let start = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        let file = format!("{dir}/after");
        std::thread::spawn(move || {
            let written = std::fs::write(&file, vec![1u8; 1 << 20])
                .and_then(|()| std::fs::File::open(&file)?.sync_all());
            let _ = tx.send(written);
        });
        let written = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the write neither failed nor finished: I/O hangs");
        assert!(written.is_err(), "a write through a silent server cannot succeed");
        println!("the write failed after {:?}: {:?}", start.elapsed(), written);
        drop(server);
        let first = driver(&node, &["unmount", &dir]);
        if first.1["status"] != "Success" {
            assert_success(&driver(&node, &["unmount", &dir]));
        }
        assert!(!connected(&device), "{device} was disconnected");
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn an_unreachable_server_is_refused_and_connects_no_device() {
        let node = node();
        let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
        let nowhere = format!("unix:{}", node.scratch.path("nobody.sock").display());
        let mut o = options("pv1", "pod-a", "uid-a", &nowhere);
        o["attach"] = "kernel".into();
        assert_failure(&driver(&node, &["mount", &dir, &o.to_string()]), "nbd-client");
        assert!(connected_devices().is_empty(), "{:?}", connected_devices());
        assert!(node.scratch.mounts().is_empty());
        assert!(left_in(&node.scratch.path("node-a/state/nbd")).is_empty());
    }
}
