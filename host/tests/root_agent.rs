//! The agent and the Flexvolume driver as kubelet runs them: the real
//! `volagent agent` binary serving the built local-pv component, called
//! through the installed `volagent-flex` driver with kubelet's exact argv
//! and options JSON, on real loop devices and mounts. Needs root.

use serde_json::Value;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};
use volagent_test_support::agent::Node;
use volagent_test_support::driver::{assert_failure, assert_success, kubelet_options, run_driver};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

#[test]
fn init_handshakes_and_other_calls_are_not_supported() {
    let node = Node::start(VOLAGENT);
    let (code, v) = node.driver(&["init"]);
    assert_eq!(code, 0);
    assert_eq!(v["status"], "Success");
    assert_eq!(v["capabilities"], serde_json::json!({"attach": false}));
    for args in [
        &["getvolumename", "{}"][..],
        &["attach", "{}", "node-a"],
        &["isattached", "{}", "node-a"],
        &["expandfs", "{}", "/dev/x", "/x", "2", "1"],
        &["frobnicate"],
    ] {
        let (code, v) = node.driver(args);
        assert_eq!((code, v), (0, serde_json::json!({"status": "Not supported"})), "{args:?}");
    }
}

fn round_trip(fs: &str, mib: u64) {
    let node = Node::start(VOLAGENT);
    let image = node.image("vol1.img", mib);
    let dir_a = node.mount_dir("uid-a", "pv1");
    assert_success(&node.mount(&dir_a, &kubelet_options("pv1", "pod-a", "uid-a", fs, &image)));
    std::fs::write(format!("{dir_a}/data"), b"written through kubelet's mount").expect("write");
    assert_success(&node.driver(&["unmount", &dir_a]));
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    // kubelet retries unmount when it did not see the answer: still success.
    assert_success(&node.driver(&["unmount", &dir_a]));

    let dir_b = node.mount_dir("uid-b", "pv1");
    let r = node.mount(&dir_b, &kubelet_options("pv1", "pod-b", "uid-b", fs, &image));
    assert_success(&r);
    assert!(r.1["device"].as_str().is_some_and(|d| d.starts_with("/dev/loop")), "{}", r.1);
    assert_eq!(
        std::fs::read(format!("{dir_b}/data")).expect("read back"),
        b"written through kubelet's mount"
    );
    assert_success(&node.driver(&["unmount", &dir_b]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

#[test]
fn ext4_volume_mount_write_unmount_mount_read() {
    round_trip("ext4", 64);
}

#[test]
fn xfs_volume_mount_write_unmount_mount_read() {
    round_trip("xfs", 320);
}

#[test]
fn a_second_pod_on_the_node_shares_the_volume_and_the_old_uid_spelling_works() {
    let node = Node::start(VOLAGENT);
    let image = node.image("vol1.img", 64);
    let (a, b) = (node.mount_dir("uid-a", "pv1"), node.mount_dir("uid-b", "pv1"));
    assert_success(&node.mount(&a, &kubelet_options("pv1", "pod-a", "uid-a", "ext4", &image)));
    let mut old = kubelet_options("pv1", "pod-b", "uid-b", "ext4", &image);
    let uid = old.as_object_mut().and_then(|o| o.remove("kubernetes.io/pod.uid")).expect("uid");
    old["kubernetes.io/pod.UID"] = uid;
    assert_success(&node.mount(&b, &old));
    assert_eq!((node.scratch.loops().len(), node.scratch.mounts().len()), (1, 3));
    assert_success(&node.driver(&["unmount", &a]));
    assert_eq!((node.scratch.loops().len(), node.scratch.mounts().len()), (1, 2));
    assert_success(&node.driver(&["unmount", &b]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let node = Node::start(VOLAGENT);
    let image = node.image("vol1.img", 64);
    let dir = node.mount_dir("uid-a", "pv1");
    let ok = kubelet_options("pv1", "pod-a", "uid-a", "ext4", &image);
    let outside = "/etc/volagent-test";
    assert_failure(&node.mount(outside, &ok), "is not under the kubelet root");
    assert_failure(&node.mount(&format!("{dir}/../../../../../../../etc"), &ok), "contains \"..\"");
    assert_failure(
        &node.driver(&["mount", &dir, "{not json"]),
        "mount options are not a JSON object",
    );
    assert_failure(&node.driver(&["mount", &dir]), "mount needs <mount-dir> <json-options>");
    let mut no_name = ok.clone();
    no_name.as_object_mut().map(|o| o.remove("kubernetes.io/pvOrVolumeName"));
    assert_failure(&node.mount(&dir, &no_name), "pvOrVolumeName is missing");
    let mut elsewhere = ok.clone();
    elsewhere["path"] = Value::from("/var/lib/secret.img");
    assert_failure(
        &node.mount(&dir, &elsewhere),
        "lookup-path /var/lib/secret.img: outside the dirs this backend may ask about",
    );
    let mut other_node = ok.clone();
    other_node["node"] = Value::from("node-b");
    assert_failure(&node.mount(&dir, &other_node), "lives on node node-b");
    // An unknown backend: a driver installed for a backend the agent lacks.
    let nope = node.scratch.path("node-a/vpd/volagent~nope");
    std::fs::create_dir_all(&nope).expect("dir");
    std::fs::copy(node.driver_path(), nope.join("nope")).expect("copy driver");
    std::fs::write(
        nope.join("volagent.json"),
        serde_json::json!({"socket": node.socket, "backend": "nope"}).to_string(),
    )
    .expect("config");
    let nope_dir = node
        .scratch
        .path("node-a/kubelet/pods/uid-a/volumes/volagent~nope/pv1")
        .display()
        .to_string();
    let r = run_driver(Command::new(nope.join("nope")).args(["mount", &nope_dir, &ok.to_string()]));
    assert_failure(&r, "backend \"nope\" is not loaded on this node");
    assert!(
        node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty(),
        "nothing changed"
    );
    // And the node still works.
    assert_success(&node.mount(&dir, &ok));
    assert_success(&node.driver(&["unmount", &dir]));
}

#[test]
fn malformed_and_oversized_frames_get_clear_errors() {
    let node = Node::start(VOLAGENT);
    let ask = |bytes: &[u8]| -> Value {
        let mut s = UnixStream::connect(&node.socket).expect("connect");
        s.write_all(bytes).expect("send");
        let frame: Value =
            volagent::socket::protocol::read_frame(&mut s).expect("a response frame");
        frame["response"].clone()
    };
    let big = ((1u32 << 20) + 1).to_be_bytes();
    let r = ask(&big);
    assert_eq!(r["failed"]["kind"], "bad_request", "{r}");
    assert!(r["failed"]["message"].as_str().unwrap_or_default().contains("over the limit"), "{r}");
    let mut junk = 7u32.to_be_bytes().to_vec();
    junk.extend_from_slice(b"{oops}!");
    let r = ask(&junk);
    assert_eq!(r["failed"]["kind"], "bad_request", "{r}");
    let body = br#"{"version":9,"request":"status"}"#;
    let mut v9 = (body.len() as u32).to_be_bytes().to_vec();
    v9.extend_from_slice(body);
    let r = ask(&v9);
    assert!(
        r["failed"]["message"].as_str().unwrap_or_default().contains("protocol version 9"),
        "{r}"
    );
    // Status names the node and its backends.
    let mut s = UnixStream::connect(&node.socket).expect("connect");
    let status =
        volagent::socket::protocol::exchange(&mut s, volagent::socket::protocol::Request::Status)
            .expect("status");
    let volagent::socket::protocol::Response::Status { node: name, backends, .. } = status else {
        panic!("{status:?}")
    };
    assert_eq!(name, "node-a");
    let mut names: Vec<String> = backends.into_iter().map(|b| b.name).collect();
    names.sort();
    assert_eq!(names, ["local-pv", "shared-file"]);
    // The agent goes on serving.
    assert_eq!(node.driver(&["init"]).0, 0);
}

#[test]
fn a_non_root_caller_is_refused() {
    let node = Node::start(VOLAGENT);
    // kubelet runs drivers as root; anyone else is kept out by the socket's
    // 0600 mode and, behind it, the peer credential check.
    let r = run_driver(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(node.driver_path())
            .arg("init"),
    );
    assert_failure(&r, "volagent agent is not reachable at");
    assert_failure(&r, "Permission denied");
}

#[test]
fn with_the_agent_down_init_succeeds_and_operations_fail_naming_the_socket() {
    let mut node = Node::start(VOLAGENT);
    node.stop_agent();
    // kubelet probes a driver as soon as it is installed, before the agent
    // serves; a failed init would make it drop the driver.
    let (code, v) = node.driver(&["init"]);
    assert_eq!(
        (code, v["status"].as_str(), v["capabilities"]["attach"].as_bool()),
        (0, Some("Success"), Some(false)),
        "{v}"
    );
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("not reachable at {}", node.socket.display()))),
        "init says the agent is not there yet: {v}"
    );
    let dir = node.mount_dir("uid-a", "pv1");
    assert_failure(
        &node.driver(&["mount", &dir, r#"{"kubernetes.io/fsType":"ext4"}"#]),
        &format!("volagent agent is not reachable at {}", node.socket.display()),
    );
    assert_failure(&node.driver(&["unmount", &dir]), "is the volagent DaemonSet running");
}

#[test]
fn fifty_volumes_mount_and_unmount_concurrently() {
    let node = Node::start(VOLAGENT);
    let volumes: Vec<(String, String)> = (0..50)
        .map(|i| {
            (
                node.image(&format!("v{i}.img"), 16),
                node.mount_dir(&format!("uid-{i}"), &format!("pv{i}")),
            )
        })
        .collect();
    std::thread::scope(|s| {
        for (i, (image, dir)) in volumes.iter().enumerate() {
            let node = &node;
            s.spawn(move || {
                let opts = kubelet_options(
                    &format!("pv{i}"),
                    &format!("pod-{i}"),
                    &format!("uid-{i}"),
                    "ext4",
                    image,
                );
                assert_success(&node.mount(dir, &opts));
            });
        }
    });
    assert_eq!((node.scratch.loops().len(), node.scratch.mounts().len()), (50, 100));
    std::thread::scope(|s| {
        for (_, dir) in &volumes {
            let node = &node;
            s.spawn(move || assert_success(&node.driver(&["unmount", dir])));
        }
    });
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
}

#[test]
fn fencing_across_nodes_follows_the_access_mode() {
    let mut node = Node::start(VOLAGENT);
    node.spawn_agent("node-b");
    let image = node.image("shared.img", 64);
    let opts = |pod: &str, mode: &str| {
        let mut o = kubelet_options("pv-shared", pod, &format!("uid-{pod}"), "ext4", &image);
        o["accessMode"] = Value::from(mode);
        o
    };
    let mount = |on: &str, pod: &str, mode: &str| {
        let dir = node.mount_dir_of(on, "shared-file", &format!("uid-{pod}"), "pv-shared");
        (
            dir.clone(),
            run_driver(Command::new(node.driver_of(on, "shared-file")).args([
                "mount",
                &dir,
                &opts(pod, mode).to_string(),
            ])),
        )
    };
    let unmount = |on: &str, dir: &str| {
        run_driver(Command::new(node.driver_of(on, "shared-file")).args(["unmount", dir]))
    };

    // ReadWriteOnce: node-a holds it; node-b is denied, naming the holder.
    let (a1, r) = mount("node-a", "a1", "ReadWriteOnce");
    assert_success(&r);
    let (_, r) = mount("node-b", "b1", "ReadWriteOnce");
    assert_failure(
        &r,
        "volume pv-shared (ReadWriteOnce) is in use by pod default/a1 on node node-a",
    );
    assert_eq!(node.scratch.loops().len(), 1, "node-b attached nothing");
    // ReadWriteOnce is per node: a second pod on node-a is granted.
    let (a2, r) = mount("node-a", "a2", "ReadWriteOnce");
    assert_success(&r);
    assert_success(&unmount("node-a", &a1));
    assert_success(&unmount("node-a", &a2));
    assert!(node.scratch.loops_left().is_empty() && node.scratch.mounts().is_empty());

    // With the volume released, node-b may have it.
    let (b1, r) = mount("node-b", "b1", "ReadWriteOnce");
    assert_success(&r);
    assert_success(&unmount("node-b", &b1));

    // ReadWriteMany grants both nodes.
    let (a3, r) = mount("node-a", "a3", "ReadWriteMany");
    assert_success(&r);
    let (b3, r) = mount("node-b", "b3", "ReadWriteMany");
    assert_success(&r);
    // Both "nodes" are one machine here, whose loop devices are shared.
    assert_eq!((node.scratch.loops().len(), node.scratch.mounts().len()), (1, 4));
    assert_success(&unmount("node-a", &a3));
    assert_success(&unmount("node-b", &b3));
    assert!(node.scratch.loops_left().is_empty() && node.scratch.mounts().is_empty());
}

fn driver(node: &Node, on: &str, args: &[&str]) -> (i32, Value) {
    run_driver(Command::new(node.driver_of(on, "shared-file")).args(args))
}

/// The agent dies (SIGKILL) after each step of the mount plan and of the
/// unmount plan in turn; restarted, it must leave no device, mount or record
/// behind, and the volume must mount again.
#[test]
fn kill_9_between_any_two_steps_leaves_nothing_behind() {
    let mut node = Node::start(VOLAGENT);
    let image = node.image("crash.img", 64);
    let opts = |pod: &str| {
        kubelet_options("pv-crash", pod, &format!("uid-{pod}"), "ext4", &image).to_string()
    };
    let clean = |node: &Node, when: &str| {
        assert!(
            node.scratch.mounts().is_empty(),
            "{when}: mounts left: {:?}",
            node.scratch.mounts()
        );
        assert!(
            node.scratch.loops_left().is_empty(),
            "{when}: loop devices left: {:?}",
            node.scratch.loops()
        );
    };
    let restart = |node: &mut Node, kill_after: Option<usize>| {
        node.stop_agent_of("node-a");
        node.spawn_agent_with("node-a", kill_after);
    };
    // A ReadWriteOnce probe from another node: denied while any holder is
    // recorded, so its success proves the record is gone.
    let no_record = |node: &Node, when: &str| {
        let dir = node.mount_dir_of("node-b", "shared-file", "uid-probe", "pv-crash");
        let r = driver(node, "node-b", &["mount", &dir, &opts("probe")]);
        assert!(r.0 == 0, "{when}: a record was left behind: {}", r.1);
        assert_success(&driver(node, "node-b", &["unmount", &dir]));
    };
    node.spawn_agent("node-b");

    // The first mount plan: attach, format, mount staging, bind (4 steps).
    for k in 1..=4 {
        restart(&mut node, Some(k));
        let dir = node.mount_dir_of("node-a", "shared-file", &format!("uid-m{k}"), "pv-crash");
        let r = driver(&node, "node-a", &["mount", &dir, &opts(&format!("m{k}"))]);
        assert_failure(&r, "volagent agent at");
        restart(&mut node, None);
        if k < 4 {
            clean(&node, &format!("mount killed after step {k}"));
            no_record(&node, &format!("mount killed after step {k}"));
        }
        // kubelet retries: the mount works (or, if it had completed, stays).
        assert_success(&driver(&node, "node-a", &["mount", &dir, &opts(&format!("m{k}"))]));
        assert_success(&driver(&node, "node-a", &["unmount", &dir]));
        clean(&node, &format!("after the retried mount {k}"));
    }

    // The last unmount plan: unmount pod dir, unmount staging, detach (3 steps).
    for k in 1..=3 {
        let dir = node.mount_dir_of("node-a", "shared-file", &format!("uid-u{k}"), "pv-crash");
        assert_success(&driver(&node, "node-a", &["mount", &dir, &opts(&format!("u{k}"))]));
        restart(&mut node, Some(k));
        let r = driver(&node, "node-a", &["unmount", &dir]);
        assert_failure(&r, "volagent agent at");
        restart(&mut node, None);
        clean(&node, &format!("unmount killed after step {k}"));
        no_record(&node, &format!("unmount killed after step {k}"));
        // kubelet retries the unmount: success, nothing to do.
        assert_success(&driver(&node, "node-a", &["unmount", &dir]));
    }
}

/// A reboot: the agent dies, the kernel forgets every mount and loop device,
/// and the runtime dir (a tmpfs on a node) is empty again. The durable
/// ledger still names node-a's pod; the restarted agent must release it, so
/// another node may take the ReadWriteOnce volume, and mount it again itself.
#[test]
fn after_a_reboot_the_ledger_forgets_what_the_node_no_longer_has() {
    let mut node = Node::start(VOLAGENT);
    node.spawn_agent("node-b");
    let image = node.image("reboot.img", 64);
    let opts = |pod: &str| {
        kubelet_options("pv-reboot", pod, &format!("uid-{pod}"), "ext4", &image).to_string()
    };
    let dir = node.mount_dir_of("node-a", "shared-file", "uid-a1", "pv-reboot");
    assert_success(&driver(&node, "node-a", &["mount", &dir, &opts("a1")]));
    let probe = node.mount_dir_of("node-b", "shared-file", "uid-b1", "pv-reboot");
    assert_failure(
        &driver(&node, "node-b", &["mount", &probe, &opts("b1")]),
        "in use by pod default/a1 on node node-a",
    );

    // The "reboot" of node-a.
    let pid =
        node.agents.iter().find(|(n, _)| n == "node-a").map(|(_, c)| c.id()).expect("node-a runs");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    node.stop_agent_of("node-a");
    for m in node.scratch.mounts().into_iter().rev() {
        nix::mount::umount2(&m, nix::mount::MntFlags::empty()).expect("the reboot unmounts");
    }
    for d in node.scratch.loops() {
        use volagent::sys::Devices;
        volagent::sys::linux::Linux::unrooted().loop_detach(&d).expect("the reboot detaches");
    }
    std::fs::remove_dir_all(node.scratch.path("node-a/run"))
        .expect("the tmpfs is empty after a reboot");
    node.spawn_agent("node-a");

    assert_success(&driver(&node, "node-b", &["mount", &probe, &opts("b1")]));
    assert_success(&driver(&node, "node-b", &["unmount", &probe]));
    assert_success(&driver(&node, "node-a", &["mount", &dir, &opts("a1")]));
    assert_success(&driver(&node, "node-a", &["unmount", &dir]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// A step that hangs: the request fails at the plan deadline with a clear
/// message, the volume stays locked (a second operation is told one is in
/// progress) until the step ends, and kubelet's retry then succeeds. The
/// hanging step keeps its worker (a local volume's steps run on it): the
/// agent's other workers answer and serve the other volumes meanwhile.
#[test]
fn a_hanging_step_times_out_and_keeps_the_volume_locked() {
    let (node, image, a) = a_mount_stalled_for(Duration::from_secs(6), "pv-slow");
    // Answered at the 1 s deadline: the stall has 5 s to run.
    let answered = Instant::now();
    let other = node.image("other.img", 64);
    let b = node.mount_dir("uid-b", "pv-slow");
    let r = node.mount(&b, &kubelet_options("pv-slow", "pod-b", "uid-b", "ext4", &image));
    assert_failure(&r, "volume pv-slow: an operation is in progress on this node; retry");
    // Another volume mounts and unmounts while the first one's step hangs.
    let c = node.mount_dir("uid-c", "pv-other");
    assert_success(&node.mount(&c, &kubelet_options("pv-other", "pod-c", "uid-c", "ext4", &other)));
    assert_success(&node.driver(&["unmount", &c]));
    assert!(
        answered.elapsed() < Duration::from_secs(5),
        "served only after the hang: {:?}",
        answered.elapsed()
    );
    // kubelet retries until the stalled mount has finished.
    let start = Instant::now();
    loop {
        let r = node.mount(&a, &kubelet_options("pv-slow", "pod-a", "uid-a", "ext4", &image));
        if r.0 == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the retried mount never succeeded: {}",
            r.1
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!((node.scratch.loops().len(), node.scratch.mounts().len()), (1, 2));
    assert_success(&node.driver(&["unmount", &a]));
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// An agent whose first plan stalls `stall` after its first step (under
/// a plan deadline of 1 s), and the mount of `volume` (its image, its
/// dir) that stalled and was answered at the deadline.
fn a_mount_stalled_for(stall: Duration, volume: &str) -> (Node, String, String) {
    let mut node = Node::start(VOLAGENT);
    node.stop_agent();
    let hook = (volagent::sys::faults::STALL_AFTER_STEP_ENV, format!("1:{}", stall.as_millis()));
    node.spawn_agent_env("node-a", &[hook], &["--plan-deadline-secs", "1"]);
    let image = node.image(&format!("{volume}.img"), 64);
    let dir = node.mount_dir("uid-a", volume);
    let r = node.mount(&dir, &kubelet_options(volume, "pod-a", "uid-a", "ext4", &image));
    assert_eq!(r.1["status"], "Failure", "{}", r.1);
    assert!(
        r.1["message"].as_str().unwrap_or_default().contains("still running after 1s"),
        "{}",
        r.1
    );
    (node, image, dir)
}

/// SIGTERM while a step hangs: the agent exits within its grace, leaving
/// the hung thread behind, and the next start undoes the cut mount.
#[test]
fn the_agent_exits_while_a_step_hangs_and_its_next_start_cleans_up() {
    let (mut node, _, _) = a_mount_stalled_for(Duration::from_secs(120), "pv-stuck");
    assert_eq!(node.scratch.loops().len(), 1, "the hung plan attached its device");
    let stopping = Instant::now();
    node.stop_agent();
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "the exit waited for the hung step: {:?}",
        stopping.elapsed()
    );
    node.spawn_agent("node-a");
    assert!(
        node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty(),
        "{:?} {:?}",
        node.scratch.mounts(),
        node.scratch.loops()
    );
}

/// Mounts and devices under volagent's dirs that no record explains (left
/// by hand, or by a tool outside the agent) are removed at start-up — the
/// staging mount by its backend's cleanup plan — and nothing else is touched.
#[test]
fn orphans_under_volagents_dirs_are_cleaned_at_start_up() {
    use volagent::sys::{Devices, Mounts};
    let mut node = Node::start(VOLAGENT);
    let image = node.image("orphan.img", 64);
    assert!(Command::new("mkfs.ext4").args(["-F", "-q", &image]).status().expect("mkfs").success());
    node.stop_agent();
    // As node-a's agent would have attached and mounted them (its tag, its
    // roots), with every record of it lost.
    let roots = volagent::sys::Roots::open(&[
        node.scratch.path("node-a/kubelet"),
        node.scratch.path("disks"),
    ])
    .expect("roots");
    let linux = volagent::sys::linux::Linux::new(
        roots,
        &volagent::ops::loop_tag("node-a", &node.scratch.path("node-a/state")),
    );
    let device = linux.loop_attach(std::path::Path::new(&image), false).expect("attach");
    let staging = node.scratch.path("node-a/kubelet/plugins/volagent/local-pv/mounts/pv-orphan");
    std::fs::create_dir_all(&staging).expect("dir");
    linux.mount(&device.display().to_string(), &staging, "ext4", "", false).expect("mount");
    // Not ours: a mount elsewhere under the kubelet root stays.
    let other = node.scratch.path("node-a/kubelet/elsewhere");
    std::fs::create_dir_all(&other).expect("dir");
    nix::mount::mount(
        Some("tmpfs"),
        &other,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .expect("tmpfs");

    node.spawn_agent("node-a");
    assert_eq!(node.scratch.mounts(), vec![other.clone()], "only the orphan staging mount is gone");
    assert!(node.scratch.loops_left().is_empty(), "and its loop device");
    nix::mount::umount2(&other, nix::mount::MntFlags::empty()).expect("unmount");
}
