//! The kubelet tier: pods on volagent volumes through a real kubelet
//! 1.20.2 and containerd, on two nodes of a cluster in a box (see
//! volagent_test_support::kubelet_cluster), checked from the pod's side: its phase, its
//! container's output and its Events. Needs root, the binaries from
//! scripts/kube-assets and what scripts/node-assets installs; fails (never
//! skips) without them.

use std::time::Duration;
use volagent_test_support::kube_objects;
use volagent_test_support::kubelet_cluster::*;
use volagent_test_support::wait_until;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const LOCAL_PV: (&str, &str) = (volagent_test_artifacts::LOCAL_PV, "local-pv");
const SHARED_FILE: (&str, &str) = (volagent_test_artifacts::SHARED_FILE, "shared-file");
const NBD: (&str, &str) = (volagent_test_artifacts::NBD, "nbd");

/// Nothing of `volume` is left on `node`: no mount below its kubelet root,
/// no loop device of the scratch dir, no record. The API server deletes a
/// finished (Succeeded) pod at once, before kubelet has torn its volumes
/// down, so this waits a while for the teardown first.
fn assert_nothing_left(c: &Cluster, node: &str, volume: &str) {
    let root = c.node(node).kubelet_root();
    let mounts = || -> Vec<std::path::PathBuf> {
        c.mounts_below(&root)
            .into_iter()
            .filter(|m| {
                m.strip_prefix(&root).is_ok_and(|rel| rel.to_string_lossy().contains("volagent"))
            })
            .collect()
    };
    let start = std::time::Instant::now();
    while (!mounts().is_empty() || !c.scratch.loops_left().is_empty() || c.record(volume).is_some())
        && start.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(mounts().is_empty(), "volume mounts left on {node}: {:?}", mounts());
    assert!(
        c.scratch.loops_left().is_empty(),
        "loop devices left: {:?}\n{}",
        c.scratch.loops(),
        tail(&c.node(node).agent_log())
    );
    assert!(c.record(volume).is_none(), "the record of {volume} is left: {:?}", c.record(volume));
}

/// PVC → PV (`volagent/local-pv`) → a pod writes and goes; a new pod on the
/// same node reads the data back; after the last pod nothing is left.
#[test]
fn a_pod_writes_a_local_volume_and_the_next_pod_reads_it() {
    let c = Cluster::start(VOLAGENT, &[("node-a", &[])], &[LOCAL_PV]);
    let image = c.image("data.img", 64);
    c.create_volume("data", "local-pv", "ReadWriteOnce", &[("path", &image), ("node", "node-a")]);

    c.create_pod(pod(
        "writer",
        "node-a",
        "date +%s%N > /data/note && cat /data/note > /dev/termination-log",
        &[("data", claim("data"))],
    ));
    let done = c.wait_pod("writer", "Succeeded", |p| phase(p) == "Succeeded");
    let written = output(done.as_ref()).expect("the writer's output");
    assert!(written.trim().len() > 10, "the writer wrote a timestamp: {written:?}");
    c.delete_pod("writer");
    assert_nothing_left(&c, "node-a", "data");

    c.create_pod(pod_with(
        "reader",
        "node-a",
        &serve("cat /data/note > /dev/termination-log"),
        &[("data", claim("data"))],
        Some("test -s /data/note"),
        "Never",
    ));
    c.wait_pod("reader", "Ready", is_ready);
    // While it runs, the node's operator sees the volume and its pod.
    let status = c.status("node-a", false);
    assert!(
        status.contains("data") && status.contains("reader"),
        "volagent status lists the volume and its pod:\n{status}"
    );
    let ops = c.operation_lines("node-a");
    assert!(
        ops.iter().any(|l| l["op"] == "mount"
            && l["outcome"] == "ok"
            && l["volume"] == "data"
            && l["pod"] == "default/reader"),
        "one operation line per mount: {ops:?}"
    );
    c.delete_pod("reader");
    let reader_said = {
        // The reader's output is only in its status while it exists; it was
        // Ready only once it could read the note, so compare through a
        // last one-shot pod instead.
        c.create_pod(pod(
            "check",
            "node-a",
            "cat /data/note > /dev/termination-log",
            &[("data", claim("data"))],
        ));
        let p = c.wait_pod("check", "Succeeded", |p| phase(p) == "Succeeded");
        output(p.as_ref()).expect("output")
    };
    assert_eq!(reader_said.trim(), written.trim(), "the next pod reads what the first wrote");
    c.delete_pod("check");
    assert_nothing_left(&c, "node-a", "data");
}

/// Waits until the pod's container waits with `reason` (e.g. ContainerCreating).
fn assert_waiting(c: &Cluster, pod: &str, reason: &str) {
    let p = c.pod(pod);
    assert_eq!(
        waiting_reason(p.as_ref()).as_deref(),
        Some(reason),
        "{pod} waits\n{}",
        c.diagnose(pod, p.as_ref())
    );
}

/// Two pods on one node share a ReadWriteOnce volume; a pod on the other
/// node stays ContainerCreating with an Event naming a holder, and starts
/// once the holders are gone.
#[test]
fn a_read_write_once_volume_is_shared_on_its_node_and_waited_for_elsewhere() {
    let c = Cluster::start(VOLAGENT, &[("node-a", &[]), ("node-b", &[])], &[SHARED_FILE]);
    let image = c.image("shared.img", 64);
    c.create_volume("shared", "shared-file", "ReadWriteOnce", &[("path", &image)]);
    let vol = || [("data", claim("shared"))];
    c.create_pod(pod_with(
        "p1",
        "node-a",
        &serve("echo p1 > /data/from-p1"),
        &vol(),
        Some("test -f /data/from-p1"),
        "Never",
    ));
    c.create_pod(pod_with(
        "p2",
        "node-a",
        &serve("true"),
        &vol(),
        Some("test -f /data/from-p1"),
        "Never",
    ));
    c.wait_pod("p1", "Ready", is_ready);
    c.wait_pod("p2", "Ready (it sees what p1 wrote)", is_ready);

    c.create_pod(pod_with(
        "p3",
        "node-b",
        &serve("true"),
        &vol(),
        Some("test -f /data/from-p1"),
        "Never",
    ));
    let said = c.wait_event(
        "p3",
        "VolumeFenced",
        &["volume shared (ReadWriteOnce) is in use by pod default/p", "on node node-a"],
    );
    assert!(said.starts_with("volagent on node-b"), "{said}");
    std::thread::sleep(Duration::from_secs(2));
    assert_waiting(&c, "p3", "ContainerCreating");
    let rec = c.record("shared").expect("record");
    let mut holders: Vec<_> =
        rec.spec.consumers.iter().map(|h| (h.node.as_str(), h.pod.as_str())).collect();
    holders.sort();
    assert_eq!(
        holders,
        [("node-a", "p1"), ("node-a", "p2")],
        "the record names the holders, not the waiting pod"
    );

    c.delete_pod("p1");
    c.delete_pod("p2");
    c.wait_pod("p3", "Ready once the holders are gone (and seeing their data)", is_ready);
    let rec = c.record("shared").expect("record");
    assert_eq!(rec.spec.consumers.iter().map(|h| h.node.as_str()).collect::<Vec<_>>(), ["node-b"]);
    c.delete_pod("p3");
    assert_nothing_left(&c, "node-b", "shared");
}

/// The holder's node dies. While it is merely NotReady the waiting pod on
/// the other node is refused, with the reason; once the node is deleted the
/// pod takes the volume over, after the guest's fence step detached what
/// the dead node left attached.
#[test]
fn a_deleted_nodes_volume_is_taken_over_only_once_it_is_gone_and_fenced() {
    take_over_from_a_dead_node(Gone::Deleted);
}

/// The same when the dead node is kept but tainted out-of-service.
#[test]
fn an_out_of_service_nodes_volume_is_taken_over_only_after_fencing() {
    take_over_from_a_dead_node(Gone::OutOfService);
}

/// How a dead node is declared gone.
#[derive(Debug, PartialEq)]
enum Gone {
    Deleted,
    OutOfService,
}

fn take_over_from_a_dead_node(gone: Gone) {
    use volagent::sys::Devices as _;
    // The controller leaves a deleted node's records for an hour, so that
    // node-b, not the controller, deals with them (both nodes are this
    // machine: had the controller moved them, node-b could find the dead
    // node's leftover mapping with no holder to fence).
    let mut c = Cluster::start_with(
        VOLAGENT,
        &[("node-a", &[]), ("node-b", &[])],
        &[SHARED_FILE],
        &["--gone-node-grace", "1h"],
    );
    let image = c.image("tk.img", 64);
    c.create_volume("tk", "shared-file", "ReadWriteOnce", &[("path", &image)]);
    c.create_pod(pod_with(
        "h",
        "node-a",
        &serve("echo h > /data/from-h"),
        &[("data", claim("tk"))],
        Some("test -f /data/from-h"),
        "Never",
    ));
    c.wait_pod("h", "Ready", is_ready);

    // node-a's machine stops: its processes, its mounts, its loop devices,
    // but a read-only mapping of the image is left behind (a device a
    // crashed node could leave). Without the fence step node-b would reuse it.
    c.crash_node("node-a");
    let root = c.node("node-a").dir.clone();
    for m in c.mounts_below(&root).into_iter().rev() {
        nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH)
            .expect("unmount the dead node's mount");
    }
    let linux = volagent::sys::linux::Linux::unrooted();
    for d in c.scratch.loops() {
        linux.loop_detach(&d).expect("detach");
    }
    let roots = volagent::sys::Roots::open(&[c.scratch.path("disks")]).expect("roots");
    let stale = volagent::sys::linux::Linux::new(roots, "volagent:dead-node");
    let leftover = stale
        .loop_attach(std::path::Path::new(&image), true)
        .expect("a leftover read-only mapping");

    // NotReady (the node controller's verdict) is not gone.
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(c.client());
    let start = std::time::Instant::now();
    while c
        .rt
        .block_on(nodes.get("node-a"))
        .ok()
        .and_then(|n| n.status?.conditions)
        .is_some_and(|cs| cs.iter().any(|x| x.type_ == "Ready" && x.status == "True"))
    {
        assert!(start.elapsed() < Duration::from_secs(60), "node-a never became NotReady");
        std::thread::sleep(Duration::from_millis(250));
    }
    c.create_pod(pod_with(
        "w",
        "node-b",
        &serve("true"),
        &[("data", claim("tk"))],
        Some("test -f /data/from-h && echo w > /data/from-w"),
        "Never",
    ));
    c.wait_event(
        "w",
        "VolumeFenced",
        &[
            "is in use by pod default/h on node node-a",
            "node node-a is NotReady, but a volume is only taken over from a deleted node",
        ],
    );
    assert_waiting(&c, "w", "ContainerCreating");
    assert!(
        c.scratch.loops().contains(&leftover),
        "nothing was fenced while node-a was only NotReady"
    );

    match gone {
        Gone::Deleted => {
            c.rt.block_on(nodes.delete("node-a", &Default::default())).expect("delete node-a");
        }
        Gone::OutOfService => {
            c.rt.block_on(kube_objects::taint_out_of_service(&c.client(), "node-a"));
        }
    }
    c.wait_pod("w", "Ready after the take-over (it writes, so its device is read-write)", is_ready);
    // The leftover's device is gone, or is node-b's new read-write one.
    let name = leftover.file_name().expect("a device name").to_string_lossy().into_owned();
    let read_write =
        std::fs::read_to_string(format!("/sys/block/{name}/ro")).is_ok_and(|ro| ro.trim() == "0");
    assert!(
        !c.scratch.loops().contains(&leftover) || read_write,
        "{gone:?}: the fence step detached the leftover read-only mapping {}",
        leftover.display()
    );
    let rec = c.record("tk").expect("record");
    assert_eq!(
        rec.spec.consumers.iter().map(|h| (h.node.as_str(), h.pod.as_str())).collect::<Vec<_>>(),
        [("node-b", "w")],
        "the dead holder is gone from the record"
    );
    c.delete_pod("w");
    assert_nothing_left(&c, "node-b", "tk");
}

/// A backend dropped into a running agent's plugin dir serves a new pod,
/// with neither kubelet nor the agent restarted; a broken replacement
/// leaves the running pod untouched, and its volume still comes down.
#[test]
fn a_backend_dropped_in_serves_new_pods_and_a_broken_one_harms_none() {
    let c = Cluster::start(VOLAGENT, &[("node-a", &[])], &[SHARED_FILE]);
    let (kubelet_pid, agent_pid) =
        (c.node("node-a").kubelet().pid(), c.node("node-a").agent.as_ref().map(|a| a.id()));
    let image = c.image("hot.img", 64);
    c.create_volume("hot", "local-pv", "ReadWriteOnce", &[("path", &image), ("node", "node-a")]);
    c.create_pod(pod_with(
        "hot",
        "node-a",
        &serve("true"),
        &[("data", claim("hot"))],
        Some("date > /data/tick"),
        "Never",
    ));
    // kubelet finds no plugin for it (it says so in its log; the pod's
    // Event only comes when its two-minute wait runs out).
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(c.node("node-a").kubelet().log())
        .unwrap_or_default()
        .contains("no volume plugin matched")
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "kubelet never looked for the volume's plugin\n{}",
            c.diagnose("hot", c.pod("hot").as_ref())
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_waiting(&c, "hot", "ContainerCreating");

    let plugins = c.node("node-a").plugin_dir();
    let drop_in = |bytes: &[u8]| {
        let tmp = plugins.join(".local-pv.wasm.new");
        std::fs::write(&tmp, bytes).expect("write");
        std::fs::rename(&tmp, plugins.join("local-pv.wasm")).expect("rename into place");
    };
    drop_in(&std::fs::read(volagent_test_artifacts::LOCAL_PV).expect("local-pv.wasm"));
    c.wait_pod("hot", "Ready (served by the backend dropped in)", is_ready);

    drop_in(b"\0asm\x01\0\0\0 this is not a component");
    let start = std::time::Instant::now();
    while !std::fs::read_to_string(c.node("node-a").agent_log()).unwrap_or_default().lines().any(
        |l| {
            l.contains("local-pv")
                && (l.contains("\"WARN\"") || l.contains("\"ERROR\""))
                && l.contains("load")
        },
    ) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the agent never noticed the broken backend\n{}",
            tail(&c.node("node-a").agent_log())
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The running pod keeps its volume: its probe writes every second.
    std::thread::sleep(Duration::from_secs(4));
    let p = c.pod("hot");
    assert!(
        is_ready(p.as_ref()) && restarts(p.as_ref()) == 0,
        "the running pod is untouched\n{}",
        c.diagnose("hot", p.as_ref())
    );
    c.delete_pod("hot");
    assert_nothing_left(&c, "node-a", "hot");
    assert_eq!(c.node("node-a").kubelet().pid(), kubelet_pid, "kubelet was not restarted");
    assert_eq!(
        c.node("node-a").agent.as_ref().map(|a| a.id()),
        agent_pid,
        "the agent was not restarted"
    );
}

/// The agent dies (SIGKILL) in the middle of a mount kubelet asked for:
/// kubelet's retry succeeds once the agent is back, with one mount of the
/// volume, one bind into the pod and one record.
#[test]
fn an_agent_killed_while_kubelet_mounts_serves_kubelets_retry() {
    let mut c = Cluster::start(VOLAGENT, &[("node-a", &[])], &[LOCAL_PV]);
    let image = c.image("kill.img", 64);
    c.create_volume("kill", "local-pv", "ReadWriteOnce", &[("path", &image), ("node", "node-a")]);
    // After the device is attached, before it is formatted and mounted.
    c.kill_agent("node-a");
    c.start_agent("node-a", &[(volagent::sys::faults::KILL_AFTER_STEP_ENV, "1")]);
    c.create_pod(pod_with(
        "k",
        "node-a",
        &serve("true"),
        &[("data", claim("kill"))],
        Some("date > /data/tick"),
        "Never",
    ));
    c.wait_agent_exit("node-a", POD_WAIT);
    c.wait_event("k", "FailedMount", &["kill"]);
    assert_waiting(&c, "k", "ContainerCreating");

    c.start_agent("node-a", &[]);
    c.wait_pod("k", "Ready after kubelet's retry", is_ready);
    let root = c.node("node-a").kubelet_root();
    let mounts: Vec<_> =
        c.mounts_below(&root).into_iter().filter(|m| m.ends_with("kill")).collect();
    assert_eq!(mounts.len(), 2, "one staging mount and one bind into the pod: {mounts:?}");
    assert!(
        mounts.iter().any(|m| m.to_string_lossy().contains("/volumes/volagent~local-pv/")),
        "{mounts:?}"
    );
    assert_eq!(c.scratch.loops().len(), 1, "one loop device: {:?}", c.scratch.loops());
    let rec = c.record("kill").expect("record");
    assert_eq!(
        rec.spec.consumers.len(),
        1,
        "one record with one consumer: {:?}",
        rec.spec.consumers
    );
    c.delete_pod("k");
    assert_nothing_left(&c, "node-a", "kill");
}

/// Pod-authored inline volumes get what the trust-boundary rules say:
/// refused where an admin did not enable them; where enabled, each is its
/// pod's own fresh volume, and one naming another pod's file or a path
/// outside the discovery dirs is refused.
#[test]
fn inline_volumes_get_what_the_trust_rules_say() {
    let c = Cluster::start(
        VOLAGENT,
        &[("node-a", &[]), ("node-b", &["--allow-inline-volumes", "local-pv"])],
        &[LOCAL_PV],
    );
    let (img_a, img_b) = (c.image("inline-a.img", 64), c.image("inline-b.img", 64));

    c.create_pod(pod_with(
        "i1",
        "node-a",
        &serve("true"),
        &[("data", inline("local-pv", &[("path", &img_a), ("node", "node-a")]))],
        None,
        "Never",
    ));
    c.wait_event(
        "i1",
        "VolumeRefused",
        &["inline volumes of backend local-pv are not enabled on this node"],
    );
    assert_waiting(&c, "i1", "ContainerCreating");

    // Its own, fresh filesystem: nothing but lost+found before it writes.
    let fresh = "test \"$(ls -A /data)\" = lost+found && echo mine > /data/mine";
    let uid = c.create_pod(pod_with(
        "i2",
        "node-b",
        &serve(fresh),
        &[("data", inline("local-pv", &[("path", &img_b), ("node", "node-b")]))],
        Some("test -f /data/mine"),
        "Never",
    ));
    c.wait_pod("i2", "Ready", is_ready);
    let rec = c
        .record(&format!("inline-{uid}-data"))
        .expect("the inline volume's record is keyed by the pod's UID");
    assert_eq!(rec.spec.access_mode, volagent::kube::crds::AccessMode::ReadWriteOncePod);

    c.create_pod(pod_with(
        "i3",
        "node-b",
        &serve("true"),
        &[("data", inline("local-pv", &[("path", &img_b), ("node", "node-b")]))],
        None,
        "Never",
    ));
    c.wait_event("i3", "VolumeMountFailed", &["one device serves one volume"]);
    c.create_pod(pod_with(
        "i4",
        "node-b",
        &serve("true"),
        &[("data", inline("local-pv", &[("path", "/etc"), ("node", "node-b")]))],
        None,
        "Never",
    ));
    c.wait_event(
        "i4",
        "VolumeMountFailed",
        &["lookup-path /etc: outside the dirs this backend may ask about"],
    );
    for p in ["i1", "i3", "i4"] {
        assert_waiting(&c, p, "ContainerCreating");
    }
    for p in ["i1", "i2", "i3", "i4"] {
        c.delete_pod(p);
    }
    assert_nothing_left(&c, "node-b", &format!("inline-{uid}-data"));
    assert!(c.records().is_empty(), "no record left: {:?}", c.records());
}

/// PVC → PV (`volagent/nbd`) → an export of qemu-nbd, reached by the agent
/// through nbdfuse on a loop device (this node has no nbd.ko): a pod writes,
/// the next pod reads it back, and the last one leaves no client behind.
#[test]
fn a_pod_writes_an_nbd_volume_and_the_next_pod_reads_it() {
    let c = Cluster::start(VOLAGENT, &[("node-a", &[])], &[NBD]);
    let image = c.image("export.img", 64);
    let socket = c.scratch.path("qemu.sock");
    let mut server = std::process::Command::new("qemu-nbd")
        .args(["-f", "raw", "-t", "-e", "8", "-x", "disk0", "-k"])
        .arg(&socket)
        .arg(&image)
        .spawn()
        .expect("qemu-nbd (scripts/setup installs it)");
    wait_until(Duration::from_secs(20), "qemu-nbd to listen", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let server_option = format!("unix:{}", socket.display());
    c.create_volume(
        "export",
        "nbd",
        "ReadWriteOnce",
        &[
            ("server", &server_option),
            ("export", "disk0"),
            ("attach", "userspace"),
            ("connections", "2"),
        ],
    );

    c.create_pod(pod(
        "writer",
        "node-a",
        "date +%s%N > /data/note && cat /data/note > /dev/termination-log",
        &[("data", claim("export"))],
    ));
    let done = c.wait_pod("writer", "Succeeded", |p| phase(p) == "Succeeded");
    let written = output(done.as_ref()).expect("the writer's output");
    c.delete_pod("writer");
    assert_nothing_left(&c, "node-a", "export");

    c.create_pod(pod(
        "reader",
        "node-a",
        "cat /data/note > /dev/termination-log",
        &[("data", claim("export"))],
    ));
    let p = c.wait_pod("reader", "Succeeded", |p| phase(p) == "Succeeded");
    assert_eq!(
        output(p.as_ref()).expect("output").trim(),
        written.trim(),
        "the next pod reads what the first wrote"
    );
    c.delete_pod("reader");
    assert_nothing_left(&c, "node-a", "export");
    let clients =
        std::fs::read_dir(c.node("node-a").dir.join("state/nbd")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(clients, 0, "the nbdfuse client and its files are gone");
    let _ = server.kill();
    let _ = server.wait();
}

/// A policy version rolled out to both nodes through a `BackendPolicy`,
/// seen by kubelet's pods: in the shadow, node A's ReadOnlyMany mount
/// succeeds and its entry counts the refusal the candidate would have
/// made; served (mode Serve), node B's ReadOnlyMany pod cannot mount; rolled
/// back (mode Shadow again), kubelet's retry mounts it.
#[test]
fn a_backend_policy_rolls_a_candidate_out_to_both_nodes_under_kubelet() {
    use volagent::kube::crds::{BackendPolicy, BackendPolicySpec, RolloutMode};
    let sha = |f: &str| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(std::fs::read(f).expect("policy")))
    };
    let (original, strict) =
        (sha(volagent_test_artifacts::LOCAL_PV), sha(volagent_test_artifacts::LOCAL_PV_STRICT));
    let store = tempfile::tempdir_in("/var/tmp").expect("a policy store");
    std::fs::copy(volagent_test_artifacts::LOCAL_PV_STRICT, store.path().join("strict.wasm"))
        .expect("store");
    let store_dir = store.path().display().to_string();
    let extra: &[&str] = &["--policy-store", &store_dir];
    let c = Cluster::start(VOLAGENT, &[("node-a", extra), ("node-b", extra)], &[LOCAL_PV]);
    for node in ["a", "b"] {
        // Formatted ahead: a read-only volume is not formatted on attach.
        let image = c.image(&format!("rox-{node}.img"), 64);
        let mkfs = std::process::Command::new("mkfs.ext4").args(["-F", "-q", &image]).status();
        assert!(mkfs.expect("mkfs").success());
        let on = format!("node-{node}");
        c.create_volume(
            &format!("rox-{node}"),
            "local-pv",
            "ReadOnlyMany",
            &[("path", &image), ("node", &on)],
        );
    }
    let read_only = |pv: &str| serde_json::json!({ "persistentVolumeClaim": { "claimName": format!("{pv}-claim"), "readOnly": true } });
    let api: kube::Api<BackendPolicy> = kube::Api::all(c.client());
    let object = BackendPolicy::new(
        "local-pv",
        BackendPolicySpec {
            backend: "local-pv".into(),
            serving: original.clone(),
            candidate: Some(strict.clone()),
            mode: RolloutMode::Shadow,
        },
    );
    c.rt.block_on(api.create(&Default::default(), &object)).expect("the BackendPolicy");
    let entries = || {
        c.rt.block_on(api.get("local-pv"))
            .ok()
            .and_then(|o| o.status)
            .map(|s| s.nodes)
            .unwrap_or_default()
    };
    let both = |serving: &str, candidate: Option<&str>| {
        let e = entries();
        e.len() == 2
            && e.iter().all(|e| {
                e.state == "Applied"
                    && e.serving.as_deref() == Some(serving)
                    && e.candidate.as_deref() == candidate
            })
    };
    let wait = |what: &str, done: &dyn Fn() -> bool| wait_until(POD_WAIT, what, done);
    wait("both nodes to run the candidate in the shadow", &|| both(&original, Some(&strict)));

    c.create_pod(pod_with(
        "ra",
        "node-a",
        &serve("true"),
        &[("data", read_only("rox-a"))],
        None,
        "Never",
    ));
    c.wait_pod("ra", "Ready: the serving version allows it", is_ready);
    wait("node A's entry to count the candidate's refusal", &|| {
        entries().iter().any(|e| e.node == "node-a" && e.differences >= 1)
    });

    let mode = |m: RolloutMode| {
        let mut o = c.rt.block_on(api.get("local-pv")).expect("the object");
        o.spec.mode = m;
        c.rt.block_on(api.replace("local-pv", &Default::default(), &o)).expect("the new mode");
    };
    mode(RolloutMode::Serve);
    wait("both nodes to serve the candidate", &|| both(&strict, None));
    c.create_pod(pod_with(
        "rb",
        "node-b",
        &serve("true"),
        &[("data", read_only("rox-b"))],
        None,
        "Never",
    ));
    c.wait_event("rb", "FailedMount", &["refuses ReadOnlyMany"]);

    mode(RolloutMode::Shadow);
    wait("both nodes to serve the old version again", &|| both(&original, Some(&strict)));
    c.wait_pod("rb", "Ready once rolled back (kubelet retries)", is_ready);
    c.delete_pod("ra");
    c.delete_pod("rb");
    assert_nothing_left(&c, "node-a", "rox-a");
    assert_nothing_left(&c, "node-b", "rox-b");
}
