//! Agents of two nodes against a real etcd + kube-apiserver: fencing through
//! Attachment records, node facts and PVs from the API, with real loop
//! devices and mounts on this machine (both "nodes" are this machine, each
//! agent with its own kubelet root, runtime and state dirs). Needs root.

use kube::api::Api;
use serde_json::Value;
use std::process::Command;
use volagent_test_support::api_cluster::Cluster;
use volagent_test_support::driver::{assert_failure, assert_success, kubelet_options, run_driver};
use volagent_test_support::{kube_objects, scratch};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const SHARED_FILE: (&str, &str) = (volagent_test_artifacts::SHARED_FILE, "shared-file");

/// What this tier's tests ask of the cluster beyond [`Cluster`]'s own.
trait SharedFileCluster {
    fn mount_dir(&self, node: &str, uid: &str, volume: &str) -> String;
    fn driver(&self, node: &str) -> std::path::PathBuf;
    fn mount(&self, node: &str, pod: &str, volume: &str, image: &str) -> (String, (i32, Value));
    fn unmount(&self, node: &str, dir: &str) -> (i32, Value);
    fn image(&self, name: &str) -> String;
    fn cleanup_list(&self, node: &str) -> Option<volagent::kube::crds::NodeCleanup>;
    fn mounts_under(&self, node: &str) -> usize;
}

impl SharedFileCluster for Cluster {
    fn mount_dir(&self, node: &str, uid: &str, volume: &str) -> String {
        let d = self
            .scratch
            .path(&format!("{node}/kubelet/pods/{uid}/volumes/volagent~shared-file/{volume}"));
        std::fs::create_dir_all(&d).expect("kubelet makes the pod's dir");
        d.display().to_string()
    }

    fn driver(&self, node: &str) -> std::path::PathBuf {
        self.scratch.path(&format!("{node}/vpd/volagent~shared-file/shared-file"))
    }

    fn mount(&self, node: &str, pod: &str, volume: &str, image: &str) -> (String, (i32, Value)) {
        let uid = self.pod_uid(pod, volume);
        let dir = self.mount_dir(node, &uid, volume);
        let mut opts = kubelet_options(volume, pod, &uid, "ext4", image);
        // Options a request may carry are not the volume: the PV's mode must win.
        opts["accessMode"] = Value::from("ReadWriteMany");
        let r =
            run_driver(Command::new(self.driver(node)).args(["mount", &dir, &opts.to_string()]));
        (dir, r)
    }

    fn unmount(&self, node: &str, dir: &str) -> (i32, Value) {
        run_driver(Command::new(self.driver(node)).args(["unmount", dir]))
    }

    fn image(&self, name: &str) -> String {
        let p = self.scratch.image(&format!("disks/{name}"), 64);
        let ok =
            Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&p).status().expect("mkfs").success();
        assert!(ok, "mkfs.ext4 {}", p.display());
        p.display().to_string()
    }

    fn cleanup_list(&self, node: &str) -> Option<volagent::kube::crds::NodeCleanup> {
        let api: Api<volagent::kube::crds::NodeCleanup> = Api::all(self.client());
        self.rt.block_on(api.get_opt(node)).expect("read the cleanup list")
    }

    fn mounts_under(&self, node: &str) -> usize {
        let root = self.scratch.path(node);
        self.scratch.mounts().iter().filter(|m| m.starts_with(&root)).count()
    }
}

/// Two agents race for one ReadWriteOnce volume, 100 rounds: exactly one
/// wins each round and the loser's error names the winner's pod and node.
#[test]
fn two_nodes_race_for_a_read_write_once_volume() {
    let c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[SHARED_FILE]);
    let image = c.image("race.img");
    c.rt.block_on(kube_objects::create_pv(
        &c.client(),
        "pv-race",
        "shared-file",
        "ReadWriteOnce",
        &[("path", &image)],
    ));
    let mut wins = [0usize; 2];
    for round in 0..100 {
        let (pa, pb) = (format!("a{round}"), format!("b{round}"));
        c.pod_uid(&pa, "pv-race");
        c.pod_uid(&pb, "pv-race");
        let ((da, ra), (db, rb)) = std::thread::scope(|s| {
            let a = s.spawn(|| c.mount("node-a", &pa, "pv-race", &image));
            let b = s.spawn(|| c.mount("node-b", &pb, "pv-race", &image));
            (a.join().expect("a"), b.join().expect("b"))
        });
        let (winner, dir, loser_reply, holder) = match (ra.0, rb.0) {
            (0, 1) => ("node-a", da, rb, format!("pod default/{pa} on node node-a")),
            (1, 0) => ("node-b", db, ra, format!("pod default/{pb} on node node-b")),
            other => panic!(
                "round {round}: exactly one node must win, got exit codes {other:?}: {} / {}",
                ra.1, rb.1
            ),
        };
        assert_failure(&loser_reply, &holder);
        wins[usize::from(winner == "node-b")] += 1;
        let rec = c.record("pv-race").expect("the winner's record");
        assert_eq!(rec.spec.consumers.len(), 1, "round {round}: one consumer recorded");
        assert_eq!(rec.spec.consumers[0].node, winner);
        assert_success(&c.unmount(winner, &dir));
        assert!(
            c.record("pv-race").is_none(),
            "round {round}: the record goes with its last consumer"
        );
    }
    assert!(
        c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty(),
        "nothing left mounted or attached"
    );
    eprintln!("wins: node-a {}, node-b {}", wins[0], wins[1]);

    // Each denial is an Event on the losing pod, naming the holder.
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(c.client(), "default");
    c.wait("an Event per denial", || {
        let list = c.rt.block_on(events.list(&Default::default())).expect("list events").items;
        let fenced: Vec<_> =
            list.iter().filter(|e| e.reason.as_deref() == Some("VolumeFenced")).collect();
        fenced.len() == 100
            && fenced.iter().all(|e| {
                e.type_.as_deref() == Some("Warning")
                    && e.involved_object.kind.as_deref() == Some("Pod")
                    && e.message.as_deref().is_some_and(|m| m.contains("is in use by pod default/"))
            })
    });
}

/// A holder's node is gone — deleted, or tainted out-of-service — so its
/// volume is taken over, but only after the guest's fence steps ran here;
/// a holder on a live node (even NotReady) is never taken over. (The
/// controller leaves a deleted node's records for an hour here, so that
/// node-a, not the controller, deals with them.)
#[test]
fn only_gone_nodes_are_taken_over_and_only_after_fencing() {
    use volagent::sys::Devices;
    let mut c = Cluster::start_with(
        VOLAGENT,
        &["node-a", "node-b", "node-c"],
        &[SHARED_FILE],
        &["--gone-node-grace", "1h"],
    );
    // The gone node's view: it mapped files in the shared discovery dir.
    let roots = volagent::sys::Roots::open(&[c.scratch.path("disks")]).expect("roots");
    let loops = volagent::sys::linux::Linux::new(roots, "volagent:gone-node");
    for (volume, how) in [("pv-deleted", "deleted"), ("pv-tainted", "out-of-service")] {
        let image = c.image(&format!("{volume}.img"));
        c.rt.block_on(kube_objects::create_pv(
            &c.client(),
            volume,
            "shared-file",
            "ReadWriteOnce",
            &[("path", &image)],
        ));
        let holder = if how == "deleted" { "node-b" } else { "node-c" };
        let (h, a) = (format!("h-{volume}"), format!("a-{volume}"));
        let (dir, r) = c.mount(holder, &h, volume, &image);
        assert_success(&r);

        // NotReady is not gone: denied, and the reason says why.
        c.rt.block_on(kube_objects::set_ready(&c.client(), holder, false));
        let (_, r) = c.mount("node-a", &a, volume, &image);
        assert_failure(
            &r,
            "is NotReady, but a volume is only taken over from a deleted node or one tainted",
        );

        // The holder's machine dies: its agent and mounts are gone, but a
        // read-only mapping of the file is left behind. Without the fence
        // step node-a would reuse that device.
        c.kill_agent(holder);
        for m in c.scratch.mounts().into_iter().rev() {
            nix::mount::umount2(&m, nix::mount::MntFlags::empty()).expect("unmount");
        }
        let _ = dir;
        for d in c.scratch.loops() {
            loops.loop_detach(&d).expect("detach");
        }
        let leftover = loops
            .loop_attach(std::path::Path::new(&image), true)
            .expect("a leftover read-only mapping");
        match how {
            "deleted" => c.rt.block_on(kube_objects::delete_node(&c.client(), holder)),
            _ => c.rt.block_on(kube_objects::taint_out_of_service(&c.client(), holder)),
        }

        let (adir, r) = c.mount("node-a", &a, volume, &image);
        assert_success(&r);
        let device = r.1["device"].as_str().expect("the device").to_string();
        let name = device.trim_start_matches("/dev/");
        let ro = std::fs::read_to_string(format!("/sys/block/{name}/ro")).expect("sysfs ro");
        assert_eq!(
            ro.trim(),
            "0",
            "{how}: node-a got a fresh read-write device, not the leftover {}",
            leftover.display()
        );
        let rec = c.record(volume).expect("record");
        let nodes: Vec<&str> = rec.spec.consumers.iter().map(|x| x.node.as_str()).collect();
        assert_eq!(nodes, ["node-a"], "{how}: the gone holder was removed from the record");
        std::fs::write(format!("{adir}/proof"), b"taken over").expect("node-a writes");
        assert_success(&c.unmount("node-a", &adir));
    }
    assert!(
        c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty(),
        "nothing left mounted or attached"
    );
}

/// The controller's scan moves a vanished node's records into its cleanup
/// list; its agent, started again, tears the mounts down through the
/// backend's cleanup plan and empties the list. A Node deletion is acted on
/// at once by a running controller.
#[test]
fn vanished_nodes_are_cleaned_up_through_their_cleanup_lists() {
    let mut c = Cluster::start(VOLAGENT, &["node-a", "node-b", "node-c"], &[SHARED_FILE]);
    let image = c.image("stale.img");
    c.rt.block_on(kube_objects::create_pv(
        &c.client(),
        "pv-stale",
        "shared-file",
        "ReadWriteMany",
        &[("path", &image)],
    ));
    let (_, r) = c.mount("node-b", "b1", "pv-stale", &image);
    assert_success(&r);
    let (_, r) = c.mount("node-a", "a1", "pv-stale", &image);
    assert_success(&r);
    assert_eq!(c.mounts_under("node-b"), 2, "staging and pod mounts on node-b");

    // node-b drops out of the cluster while its mounts stay: the running
    // controller moves its records at once.
    c.kill_agent("node-b");
    c.rt.block_on(kube_objects::delete_node(&c.client(), "node-b"));
    c.wait("node-b's records to move", || {
        c.cleanup_list("node-b").is_some_and(|l| l.spec.entries.len() == 1)
    });
    let list = c.cleanup_list("node-b").expect("node-b's cleanup list");
    assert_eq!(list.spec.entries[0].volume, "pv-stale");
    let rec = c.record("pv-stale").expect("record");
    assert_eq!(
        rec.spec.consumers.iter().map(|x| x.node.as_str()).collect::<Vec<_>>(),
        ["node-a"],
        "node-a keeps its consumer"
    );
    // The periodic scan, as the controller's ServiceAccount: nothing moves twice.
    assert_eq!(
        c.rt.block_on(volagent::kube::controller::scan(&c.controller_client())).expect("scan"),
        0,
        "nothing moves twice"
    );

    // node-b comes back: its agent works the list off when it starts (it
    // may only empty it), and the controller deletes the emptied list.
    c.spawn_agent("node-b");
    c.wait("node-b's cleanup list to go", || c.cleanup_list("node-b").is_none());
    assert_eq!(c.mounts_under("node-b"), 0, "node-b's mounts were torn down");
    assert_eq!(c.mounts_under("node-a"), 2, "node-a's are untouched");
    let log = std::fs::read_to_string(c.scratch.path("node-b.log")).expect("node-b's log");
    assert!(!log.contains("cleanup list:"), "node-b worked its list off without an error: {log}");

    // Another Node deletion, acted on at once.
    let (_, r) = c.mount("node-c", "c1", "pv-stale", &image);
    assert_success(&r);
    c.kill_agent("node-c");
    c.rt.block_on(kube_objects::delete_node(&c.client(), "node-c"));
    c.wait("node-c's records to move", || {
        c.cleanup_list("node-c").is_some_and(|l| l.spec.entries.len() == 1)
    });
    let rec = c.record("pv-stale").expect("record");
    assert!(
        rec.spec.consumers.iter().all(|x| x.node == "node-a"),
        "only node-a is left: {:?}",
        rec.spec.consumers
    );
}

/// Deleting a StorageCluster makes every node force-clean its volumes; the
/// controller's finalizer goes once no record names the cluster.
#[test]
fn deleting_a_storage_cluster_cleans_every_node_and_releases_it() {
    use volagent::kube::crds::{StorageCluster, StorageClusterSpec};
    let c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[SHARED_FILE]);
    let clusters: Api<StorageCluster> = Api::all(c.client());
    let sc = StorageCluster::new(
        "sc1",
        StorageClusterSpec {
            backend: "shared-file".into(),
            endpoints: vec![],
            secret_ref: None,
            controller_credentials: None,
            parameters: Default::default(),
        },
    );
    c.rt.block_on(clusters.create(&Default::default(), &sc)).expect("create the StorageCluster");
    c.wait("the finalizer", || {
        c.rt.block_on(clusters.get("sc1"))
            .ok()
            .and_then(|s| s.metadata.finalizers)
            .is_some_and(|f| f.iter().any(|f| f == volagent::kube::crds::CLEANUP_FINALIZER))
    });
    let (one, two) = (c.image("sc-one.img"), c.image("sc-two.img"));
    for (pv, image) in [("pv-sc-1", &one), ("pv-sc-2", &two)] {
        c.rt.block_on(kube_objects::create_pv(
            &c.client(),
            pv,
            "shared-file",
            "ReadWriteMany",
            &[("path", image), ("storageCluster", "sc1")],
        ));
    }
    for (node, pod) in [("node-a", "a"), ("node-b", "b")] {
        for (pv, image) in [("pv-sc-1", &one), ("pv-sc-2", &two)] {
            let pod = format!("{pod}-{pv}");
            let uid = c.pod_uid(&pod, pv);
            let opts = kubelet_options(pv, &pod, &uid, "ext4", image);
            let dir = c.mount_dir(node, &uid, pv);
            assert_success(&run_driver(Command::new(c.driver(node)).args([
                "mount",
                &dir,
                &opts.to_string(),
            ])));
        }
    }
    assert_eq!(c.scratch.mounts().len(), 8);
    assert_eq!(c.record("pv-sc-1").expect("record").spec.storage_cluster.as_deref(), Some("sc1"));

    c.rt.block_on(clusters.delete("sc1", &Default::default())).expect("delete the StorageCluster");
    c.wait("the StorageCluster to go", || {
        c.rt.block_on(clusters.get_opt("sc1")).expect("get").is_none()
    });
    assert!(
        c.scratch.mounts().is_empty(),
        "every node's mounts are gone: {:?}",
        c.scratch.mounts()
    );
    assert!(c.scratch.loops_left().is_empty(), "and their devices");
    assert!(c.record("pv-sc-1").is_none() && c.record("pv-sc-2").is_none(), "and the records");
}

/// The API server goes away during a mount and during an unmount: each
/// fails clearly, nothing is left half done, and kubelet's retries succeed
/// once it is back, with the record right.
#[test]
fn an_api_outage_fails_operations_clearly_and_loses_nothing() {
    let c = Cluster::start(VOLAGENT, &["node-a"], &[SHARED_FILE]);
    let image = c.image("outage.img");
    c.rt.block_on(kube_objects::create_pv(
        &c.client(),
        "pv-out",
        "shared-file",
        "ReadWriteOnce",
        &[("path", &image)],
    ));

    c.pod_uid("a1", "pv-out");
    c.env.stop_apiserver();
    let (dir, r) = c.mount("node-a", "a1", "pv-out", &image);
    assert_failure(&r, "pv-out");
    assert!(
        c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty(),
        "a failed mount leaves nothing"
    );
    c.rt.block_on(c.env.start_apiserver()).expect("API server back");
    let (_, r) = c.mount("node-a", "a1", "pv-out", &image);
    assert_success(&r);

    c.env.stop_apiserver();
    assert_failure(&c.unmount("node-a", &dir), "Kubernetes API");
    c.rt.block_on(c.env.start_apiserver()).expect("API server back");
    assert_eq!(
        c.record("pv-out")
            .expect("the record is kept until the unmount is through")
            .spec
            .consumers
            .len(),
        1
    );
    assert_success(&c.unmount("node-a", &dir));
    assert!(c.record("pv-out").is_none(), "the retried unmount released the record");
    assert!(c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty());
}

/// With a cluster, a volume is what its PV says: options a request carries
/// (a path, an access mode, a node) are ignored; the PV's node affinity
/// holds; a pod gets a PV only through a claim it uses and with its own
/// UID; an inline volume named like a PV is refused where inline volumes
/// are not enabled.
#[test]
fn with_a_cluster_a_volume_is_what_its_pv_says() {
    let c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[SHARED_FILE]);
    let (image, other) = (c.image("trust.img"), c.image("other.img"));
    c.rt.block_on(kube_objects::create_pv_with(
        &c.client(),
        "pv-trust",
        "shared-file",
        "ReadWriteOnce",
        &[("path", &image)],
        Some("node-a"),
    ));
    let drive = |node: &str, uid: &str, opts: &Value| {
        let dir = c.mount_dir(node, uid, "pv-trust");
        (
            dir.clone(),
            run_driver(Command::new(c.driver(node)).args(["mount", &dir, &opts.to_string()])),
        )
    };

    let uid = c.pod_uid("p1", "pv-trust");
    let mut written = kubelet_options("pv-trust", "p1", &uid, "ext4", &other);
    written["accessMode"] = Value::from("ReadWriteMany");
    written["node"] = Value::from("node-b");
    let (dir, r) = drive("node-a", &uid, &written);
    assert_success(&r);
    let rec = c.record("pv-trust").expect("record");
    assert_eq!(
        rec.spec.source.as_ref().and_then(|s| s.options.as_ref()?.get("path").cloned()),
        Some(image.clone()),
        "the PV's path"
    );
    assert_eq!(
        rec.spec.access_mode,
        volagent::kube::crds::AccessMode::ReadWriteOnce,
        "the PV's mode"
    );
    let loops = volagent::sys::Devices::loop_devices(&volagent::sys::linux::Linux::unrooted())
        .expect("loops");
    assert!(
        loops.iter().any(|l| l.backing_file == std::path::Path::new(&image)),
        "the PV's image is attached"
    );
    assert!(
        !loops.iter().any(|l| l.backing_file == std::path::Path::new(&other)),
        "the written one is not"
    );

    // The PV's node affinity holds (even for a pod of its claim).
    let uid2 = c.pod_uid("p2", "pv-trust");
    let (_, r) = drive("node-b", &uid2, &kubelet_options("pv-trust", "p2", &uid2, "ext4", &image));
    assert_failure(&r, "PersistentVolume pv-trust's node affinity does not select node node-b");
    // A pod that does not use the claim.
    let uid3 = c.rt.block_on(kube_objects::create_pod(&c.client(), "p3", &[], &[]));
    let (_, r) = drive("node-a", &uid3, &kubelet_options("pv-trust", "p3", &uid3, "ext4", &image));
    assert_failure(&r, "pod default/p3 uses no claim bound to PersistentVolume pv-trust");
    // A request with another pod's UID.
    let (_, r) = drive(
        "node-a",
        "bogus-uid",
        &kubelet_options("pv-trust", "p2", "bogus-uid", "ext4", &image),
    );
    assert_failure(&r, "not bogus-uid as the request says");
    // An inline volume named like the PV, pointing elsewhere.
    let inline: kube_objects::Inline = ("pv-trust", "shared-file", &[("path", other.as_str())]);
    let uid4 = c.rt.block_on(kube_objects::create_pod(&c.client(), "p4", &[], &[inline]));
    let (_, r) = drive("node-a", &uid4, &kubelet_options("pv-trust", "p4", &uid4, "ext4", &other));
    assert_failure(&r, "inline volumes of backend shared-file are not enabled on this node");
    assert_eq!(c.record("pv-trust").expect("record").spec.consumers.len(), 1, "only p1 holds it");

    assert_success(&c.unmount("node-a", &dir));
    assert!(c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty());
}

/// Where an admin enables inline volumes for a backend, each is its pod's
/// own (keyed by the pod's UID): two pods naming "data" get two volumes,
/// and never one the other's filesystem.
#[test]
fn inline_volumes_where_allowed_are_each_pods_own() {
    let mut c = Cluster::start(VOLAGENT, &[], &[SHARED_FILE]);
    c.rt.block_on(kube_objects::create_node(&c.client(), "node-a", true));
    c.spawn_agent_with("node-a", &["--allow-inline-volumes", "shared-file"]);
    let (shared, own) = (c.image("inline.img"), c.image("own.img"));
    let mount = |pod: &str, path: &str| {
        let inline: kube_objects::Inline = ("data", "shared-file", &[("path", path)]);
        let uid = c.rt.block_on(kube_objects::create_pod(&c.client(), pod, &[], &[inline]));
        let dir = c.mount_dir("node-a", &uid, "data");
        let opts = kubelet_options("data", pod, &uid, "ext4", path);
        (
            uid,
            dir.clone(),
            run_driver(Command::new(c.driver("node-a")).args(["mount", &dir, &opts.to_string()])),
        )
    };
    let (uid1, dir1, r) = mount("q1", &shared);
    assert_success(&r);
    let rec = c.record(&format!("inline-{uid1}-data")).expect("keyed by the pod's UID");
    assert_eq!(rec.spec.access_mode, volagent::kube::crds::AccessMode::ReadWriteOncePod);
    let (_, _, r) = mount("q2", &shared);
    assert_failure(&r, "one device serves one volume");
    let (uid3, dir3, r) = mount("q3", &own);
    assert_success(&r);
    assert!(c.record(&format!("inline-{uid3}-data")).is_some());
    assert!(c.record("data").is_none(), "no volume goes by the name alone");
    assert_success(&c.unmount("node-a", &dir1));
    assert_success(&c.unmount("node-a", &dir3));
    assert!(c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty());
}

/// A TCP proxy in front of the API server that holds each chunk it passes
/// on for `delay_ms` (0: none): a slow API server, to the agents behind it.
struct SlowProxy {
    url: String,
    delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl SlowProxy {
    fn start(upstream: &str) -> SlowProxy {
        use std::sync::atomic::Ordering;
        let target = upstream.trim_start_matches("https://").to_string();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let url = format!("https://{}", listener.local_addr().expect("addr"));
        let delay_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let delay = delay_ms.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                // The API server down: the client's connection is closed, as
                // a dead server's would be.
                let Ok(server) = std::net::TcpStream::connect(&target) else { continue };
                for (mut from, mut to) in [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ]
                .into_iter()
                .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
                {
                    let delay = delay.clone();
                    std::thread::spawn(move || {
                        use std::io::{Read, Write};
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                break;
                            }
                            std::thread::sleep(std::time::Duration::from_millis(
                                delay.load(Ordering::SeqCst),
                            ));
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        SlowProxy { url, delay_ms }
    }
}

/// Three agents race for one ReadWriteOnce volume round after round while
/// the API server is killed mid-race and started again, or made slow (a
/// proxy holding each chunk 20–80 ms), at random (seed printed; replay with
/// `VOLAGENT_CHAOS_SEED`). Each contender retries as kubelet does until it
/// wins or is told who holds the volume: there is never more than one
/// winner and, once the API server answers, always one; the record names
/// exactly the winner and goes with its unmount (none is lost or left
/// orphaned); every agent serves on.
#[test]
fn races_for_a_volume_survive_the_api_server_dying_and_crawling() {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
    const ROUNDS: usize = 12;
    let mut rng = fastrand::Rng::with_seed(scratch::chaos_seed(
        "races_for_a_volume_survive_the_api_server_dying_and_crawling",
    ));

    let mut c = Cluster::start(VOLAGENT, &NODES, &[SHARED_FILE]);
    let proxy = SlowProxy::start(c.env.url());
    c.agent_server = Some(proxy.url.clone());
    for n in NODES {
        c.kill_agent(n);
        c.spawn_agent(n);
    }
    let image = c.image("chaos.img");
    c.rt.block_on(kube_objects::create_pv(
        &c.client(),
        "pv-chaos",
        "shared-file",
        "ReadWriteOnce",
        &[("path", &image)],
    ));

    let (mut kills, mut slow) = (0, 0);
    let retries = std::sync::atomic::AtomicUsize::new(0);
    for round in 0..ROUNDS {
        let pods: Vec<String> = NODES.iter().map(|n| format!("{n}-{round}")).collect();
        for p in &pods {
            c.pod_uid(p, "pv-chaos");
        }
        let chaos = rng.u8(0..3);
        if chaos == 2 {
            slow += 1;
            proxy.delay_ms.store(rng.u64(20..80), Ordering::SeqCst);
        }
        let outcomes: Vec<(String, Option<String>)> = std::thread::scope(|s| {
            let contenders: Vec<_> = NODES
                .iter()
                .zip(&pods)
                .map(|(node, pod)| {
                    let (c, image, retries) = (&c, &image, &retries);
                    s.spawn(move || {
                        let (start, mut backoff) = (Instant::now(), Duration::from_millis(100));
                        loop {
                            let (dir, r) = c.mount(node, pod, "pv-chaos", image);
                            let message = r.1["message"].as_str().unwrap_or_default().to_string();
                            if r.0 == 0 {
                                return (node.to_string(), Some(dir));
                            }
                            if message.contains("is in use by pod") {
                                return (node.to_string(), None);
                            }
                            assert!(
                                start.elapsed() < Duration::from_secs(120),
                                "round {round}: {node} got no answer: {message}"
                            );
                            retries.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(backoff);
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                        }
                    })
                })
                .collect();
            if chaos == 1 {
                kills += 1;
                std::thread::sleep(Duration::from_millis(rng.u64(0..60)));
                c.env.stop_apiserver();
                std::thread::sleep(Duration::from_millis(rng.u64(300..2000)));
                c.rt.block_on(c.env.start_apiserver()).expect("the API server starts again");
            }
            contenders.into_iter().map(|t| t.join().expect("contender")).collect()
        });
        proxy.delay_ms.store(0, Ordering::SeqCst);
        let winners: Vec<&(String, Option<String>)> =
            outcomes.iter().filter(|(_, won)| won.is_some()).collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round} (chaos {chaos}): exactly one winner: {outcomes:?}"
        );
        let (winner, dir) = (&winners[0].0, winners[0].1.as_deref().expect("won"));
        let record = c.record("pv-chaos").expect("the winner's record");
        let holders: Vec<&str> = record.spec.consumers.iter().map(|h| h.node.as_str()).collect();
        assert_eq!(holders, [winner.as_str()], "round {round}: the record names the winner alone");
        let (start, mut backoff) = (Instant::now(), Duration::from_millis(100));
        while c.unmount(winner, dir).0 != 0 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "round {round}: {winner} cannot unmount"
            );
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
        assert!(
            c.record("pv-chaos").is_none(),
            "round {round}: the record goes with its last consumer"
        );
    }
    eprintln!(
        "{ROUNDS} rounds: {kills} with the API server killed mid-race, {slow} with it slow; {} mounts retried",
        retries.load(Ordering::SeqCst)
    );
    assert!(
        c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty(),
        "nothing left mounted or attached"
    );
    for (node, agent) in &mut c.agents {
        assert!(agent.try_wait().expect("agent status").is_none(), "{node}'s agent serves on");
    }
}

/// A candidate in the shadow of a backend's serving policy, on an agent
/// running as deploy/'s ServiceAccount in its (stand-in) pod: a call it
/// answers otherwise is told as a Warning Event on the agent's pod, and
/// the volume is served as the serving policy decided.
#[test]
fn a_shadow_difference_is_told_as_an_event_on_the_agents_pod() {
    use volagent_test_support::shipped;
    let mut c =
        Cluster::start(VOLAGENT, &["node-a"], &[(volagent_test_artifacts::LOCAL_PV, "local-pv")]);
    c.kill_agent("node-a");
    let candidate = c.scratch.path("plugins/local-pv.candidate.wasm");
    std::fs::copy(volagent_test_artifacts::LOCAL_PV_STRICT, &candidate).expect("candidate");
    let pod = "volagent-agent-node-a";
    let pods: Api<k8s_openapi::api::core::v1::Pod> =
        Api::namespaced(c.client(), shipped::AGENT_NAMESPACE);
    let uid = c.rt.block_on(pods.get(pod)).expect("the agent's pod").metadata.uid.expect("uid");
    c.spawn_agent_env(
        "node-a",
        &[],
        &[
            ("POD_NAMESPACE", shipped::AGENT_NAMESPACE),
            ("POD_NAME", pod),
            ("POD_UID", &uid),
            ("CONTAINER_NAME", "agent"),
        ],
    );
    let image = c.image("rox.img");
    c.rt.block_on(kube_objects::create_pv_with(
        &c.client(),
        "pv-rox",
        "local-pv",
        "ReadOnlyMany",
        &[("path", &image), ("node", "node-a")],
        Some("node-a"),
    ));
    let uid1 = c.pod_uid("p1", "pv-rox");
    let dir =
        c.scratch.path(&format!("node-a/kubelet/pods/{uid1}/volumes/volagent~local-pv/pv-rox"));
    std::fs::create_dir_all(&dir).expect("pod dir");
    let dir = dir.display().to_string();
    let mut opts = kubelet_options("pv-rox", "p1", &uid1, "ext4", &image);
    opts["kubernetes.io/readwrite"] = Value::from("ro");
    let driver = c.scratch.path("node-a/vpd/volagent~local-pv/local-pv");
    // The driver is installed once the agent has loaded the backend.
    c.wait("the local-pv driver", || driver.exists());
    let r = run_driver(Command::new(&driver).args(["mount", &dir, &opts.to_string()]));
    assert_success(&r);
    let told = || {
        volagent_test_support::kubelet_cluster::events_about(
            &c.rt,
            &c.client(),
            shipped::AGENT_NAMESPACE,
            pod,
        )
        .into_iter()
        .find(|(reason, _)| reason == "PolicyShadowDifference")
    };
    c.wait("a PolicyShadowDifference Event on the agent's pod", || told().is_some());
    let (_, message) = told().expect("the Event");
    assert!(message.contains("local-pv.candidate.wasm"), "{message}");
    assert!(message.contains("fence pv-rox for default/p1 on node-a: became-refused"), "{message}");
    assert!(message.contains("refuses ReadOnlyMany"), "{message}");
    assert_success(&run_driver(Command::new(&driver).args(["unmount", &dir])));
    assert!(c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty());
}

/// A policy version rolled out to two nodes through a `BackendPolicy`: the
/// agents trust the digests it names (their allow-list lists only the
/// shipped local-pv), put the candidate from their policy store in the
/// shadow, report it per node in the status (node A's shadow counting the
/// ReadOnlyMany mount it would refuse), serve it when the mode says Serve,
/// and roll back when it says Shadow again. Node A's agent cannot write
/// node B's entry.
#[test]
fn a_backend_policy_rolls_a_candidate_out_to_two_nodes() {
    use volagent::kube::crds::{BackendPolicy, BackendPolicySpec, RolloutMode};
    let sha = |f: &str| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(std::fs::read(f).expect("policy")))
    };
    let (original, strict) =
        (sha(volagent_test_artifacts::LOCAL_PV), sha(volagent_test_artifacts::LOCAL_PV_STRICT));
    let nodes = ["node-a", "node-b"];
    let mut c =
        Cluster::start(VOLAGENT, &nodes, &[(volagent_test_artifacts::LOCAL_PV, "local-pv")]);
    let store = c.scratch.path("store");
    std::fs::create_dir_all(&store).expect("store");
    std::fs::copy(
        volagent_test_artifacts::LOCAL_PV_STRICT,
        store.join("local-pv-0.1.0-strict.wasm"),
    )
    .expect("store");
    for node in nodes {
        c.kill_agent(node);
        c.own_plugin_dir(node);
        volagent_test_support::agent::write_allow_list(
            &c.scratch.path(&format!("{node}/trusted-policies")),
            &[("local-pv", volagent_test_artifacts::LOCAL_PV)],
        );
        c.spawn_agent_with(node, &["--policy-store", &store.display().to_string()]);
    }
    let api: Api<BackendPolicy> = Api::all(c.client());
    let mut object = BackendPolicy::new(
        "local-pv",
        BackendPolicySpec {
            backend: "local-pv".into(),
            serving: original.clone(),
            candidate: Some(strict.clone()),
            mode: RolloutMode::Shadow,
        },
    );
    c.rt.block_on(api.create(&Default::default(), &object)).expect("the BackendPolicy");
    let entries = |c: &Cluster| {
        c.rt.block_on(api.get("local-pv"))
            .ok()
            .and_then(|o| o.status)
            .map(|s| s.nodes)
            .unwrap_or_default()
    };
    let all_applied = |c: &Cluster, serving: &str, candidate: Option<&str>| {
        let e = entries(c);
        e.len() == 2
            && e.iter().all(|e| {
                e.state == "Applied"
                    && e.serving.as_deref() == Some(serving)
                    && e.candidate.as_deref() == candidate
            })
    };
    c.wait("both nodes to run the candidate in the shadow", || {
        all_applied(&c, &original, Some(&strict))
    });
    for node in nodes {
        let file = c.scratch.path(&format!("{node}/plugins/local-pv.candidate.wasm"));
        assert_eq!(sha(&file.display().to_string()), strict, "{node}'s candidate");
    }

    // The shadow on node A counts the mount it would refuse; the status
    // says so for node A alone.
    let image = c.image("rox.img");
    c.rt.block_on(kube_objects::create_pv_with(
        &c.client(),
        "pv-rox",
        "local-pv",
        "ReadOnlyMany",
        &[("path", &image), ("node", "node-a")],
        Some("node-a"),
    ));
    let uid = c.pod_uid("p1", "pv-rox");
    let dir =
        c.scratch.path(&format!("node-a/kubelet/pods/{uid}/volumes/volagent~local-pv/pv-rox"));
    std::fs::create_dir_all(&dir).expect("pod dir");
    let dir = dir.display().to_string();
    let mut opts = kubelet_options("pv-rox", "p1", &uid, "ext4", &image);
    opts["kubernetes.io/readwrite"] = Value::from("ro");
    let driver = c.scratch.path("node-a/vpd/volagent~local-pv/local-pv");
    assert_success(&run_driver(Command::new(&driver).args(["mount", &dir, &opts.to_string()])));
    c.wait("node A's entry to count the difference", || {
        entries(&c).iter().any(|e| e.node == "node-a" && e.differences >= 1 && e.compared >= 1)
    });
    assert!(entries(&c).iter().any(|e| e.node == "node-b" && e.differences == 0));
    assert_success(&run_driver(Command::new(&driver).args(["unmount", &dir])));

    // Node A's agent may not write node B's entry.
    let as_a: Api<BackendPolicy> = Api::all(c.agent_client("node-a"));
    let forged = serde_json::json!({
        "apiVersion": "volagent.io/v1alpha1", "kind": "BackendPolicy", "metadata": { "name": "local-pv" },
        "status": { "nodes": [{ "node": "node-b", "state": "Applied", "serving": strict, "updatedAt": "2026-01-01T00:00:00Z" }] },
    });
    let params = kube::api::PatchParams::apply("volagent-agent-node-b").force();
    let refused =
        c.rt.block_on(as_a.patch_status("local-pv", &params, &kube::api::Patch::Apply(&forged)));
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.message.contains("only its own node's entry")),
        "{refused:?}"
    );

    // Serve: the candidate serves on both nodes, the old version is kept.
    object = c.rt.block_on(api.get("local-pv")).expect("the object");
    object.spec.mode = RolloutMode::Serve;
    c.rt.block_on(api.replace("local-pv", &Default::default(), &object)).expect("Serve");
    c.wait("both nodes to serve the candidate", || all_applied(&c, &strict, None));
    for node in nodes {
        let kept = c.scratch.path(&format!("{node}/plugins/local-pv.previous.wasm"));
        assert_eq!(sha(&kept.display().to_string()), original, "{node} keeps the old version");
    }
    let (_, r) = {
        let uid = c.pod_uid("p2", "pv-rox");
        let dir =
            c.scratch.path(&format!("node-a/kubelet/pods/{uid}/volumes/volagent~local-pv/pv-rox"));
        std::fs::create_dir_all(&dir).expect("pod dir");
        let mut opts = kubelet_options("pv-rox", "p2", &uid, "ext4", &image);
        opts["kubernetes.io/readwrite"] = Value::from("ro");
        let dir = dir.display().to_string();
        (dir.clone(), run_driver(Command::new(&driver).args(["mount", &dir, &opts.to_string()])))
    };
    assert_failure(&r, "refuses ReadOnlyMany");

    // Back to Shadow: both roll back, the candidate in the shadow again.
    object = c.rt.block_on(api.get("local-pv")).expect("the object");
    object.spec.mode = RolloutMode::Shadow;
    c.rt.block_on(api.replace("local-pv", &Default::default(), &object)).expect("Shadow");
    c.wait("both nodes to serve the old version again", || {
        all_applied(&c, &original, Some(&strict))
    });
    assert!(c.scratch.mounts().is_empty() && c.scratch.loops_left().is_empty());
}
