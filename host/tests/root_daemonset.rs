//! The DaemonSet tier: `deploy/` applied with `kubectl apply -k` to a
//! one-node cluster in a box (real kubelet 1.20.2, containerd, scheduler and
//! controller manager; see volagent_test_support::daemonset_cluster), the agent running
//! as the DaemonSet's privileged pod from the image `scripts/build-image`
//! makes, the controller as its two-replica Deployment. Workload pods get
//! their volumes from the agent in the pod. Needs root, scripts/kube-assets,
//! scripts/node-assets and scripts/build-image; fails (never skips) without
//! them.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use volagent::kube::crds::Attachment;
use volagent_test_support::daemonset_cluster::*;
use volagent_test_support::kubelet_cluster::{
    claim, create_volume, events_about, is_ready, pod_with, restarts, serve,
};

/// Where kubelet mounts volume `pv` of pod `uid` (and where the agent, in
/// its container, binds it).
fn volume_dir(uid: &str, pv: &str) -> PathBuf {
    Path::new(NODE_PATHS[0].1).join(format!("pods/{uid}/volumes/volagent~local-pv/{pv}"))
}

/// A local-pv PV and claim over a new 64 MiB file in the node's /mnt/disks.
fn local_volume(c: &DsCluster, pv: &str) {
    let disk = c.disk(&format!("{pv}.img"), 64);
    create_volume(
        &c.rt,
        &c.client(),
        pv,
        "local-pv",
        "ReadWriteOnce",
        &[("path", &disk), ("node", &c.node)],
        c.kcm.as_ref().expect("kcm").log(),
    );
}

fn record(c: &DsCluster, volume: &str) -> Option<Attachment> {
    let api: Api<Attachment> = Api::all(c.client());
    c.rt.block_on(api.get_opt(volume)).expect("read the record")
}

fn lease_holder(c: &DsCluster) -> Option<String> {
    let api: Api<Lease> = Api::namespaced(c.client(), CONTROLLER_NS);
    c.rt.block_on(api.get_opt("volagent-controller"))
        .expect("read the lease")?
        .spec?
        .holder_identity
}

fn name(p: &k8s_openapi::api::core::v1::Pod) -> String {
    p.metadata.name.clone().expect("a name")
}

/// The "start-up reconciliation done" lines of agent pod `pod`, one per
/// container it ran, oldest first.
fn reconciliations(c: &DsCluster, pod: &k8s_openapi::api::core::v1::Pod) -> Vec<Value> {
    c.json_lines_of(pod)
        .into_iter()
        .filter(|l| {
            l["message"].as_str().is_some_and(|m| m.contains("start-up reconciliation done"))
        })
        .collect()
}

/// What agent pod `pod` unmounted.
fn unmounts(c: &DsCluster, pod: &k8s_openapi::api::core::v1::Pod) -> Vec<Value> {
    c.json_lines_of(pod).into_iter().filter(|l| l["op"] == "unmount").collect()
}

/// The agent pod is the DaemonSet's (privileged, host network, the
/// manifests' probes passing); it installs its drivers into the node's
/// volume-plugin-dir; a workload pod on a PVC gets its volume from it and
/// writes through the mount the agent made in its container. /healthz,
/// /readyz and /metrics answer on the node's address, the agent logs JSON
/// to /var/log/pods. The controller Deployment runs two replicas, non-root
/// on a read-only root filesystem; one leads, and the other takes over when
/// the leader's pod is deleted.
#[test]
fn the_daemonset_agent_serves_a_workload_and_the_controller_leads() {
    let c = DsCluster::start("node-serve");

    let agent = c.agent_pod();
    let spec = agent.spec.as_ref().expect("spec");
    assert_eq!(spec.host_network, Some(true), "the agent pod is on the host network");
    assert_eq!(spec.node_name.as_deref(), Some(c.node.as_str()));
    assert!(
        c.kubectl(&[
            "-n",
            SYSTEM,
            "get",
            "daemonset",
            "volagent-agent",
            "-o",
            "jsonpath={.spec.template.spec.containers[0].image}"
        ])
        .contains(&c.image),
        "the overlay set the image"
    );
    let driver = Path::new(NODE_PATHS[1].1).join("volagent~local-pv/local-pv");
    assert!(driver.is_file(), "the agent pod installed {} on the node", driver.display());
    for path in ["/healthz", "/readyz"] {
        let (code, body) = c.agent_http(path);
        assert_eq!(code, 200, "GET {path} on the node's address: {body}");
    }

    local_volume(&c, "data");
    let uid = c.create_pod(pod_with(
        "app",
        &c.node,
        &serve("echo written-by-app > /data/greeting"),
        &[("data", claim("data"))],
        Some("test -s /data/greeting"),
        "Never",
    ));
    c.wait("app Ready", || is_ready(c.pod("default", "app").as_ref()).then_some(()));
    // The mount the agent made inside its container is the one the
    // workload's container writes through: the node sees the file there.
    let dir = volume_dir(&uid, "data");
    assert!(!c.mounts_below(&dir).is_empty(), "{} is a mount on the node", dir.display());
    assert_eq!(
        std::fs::read_to_string(dir.join("greeting")).expect("the file the app wrote").trim(),
        "written-by-app"
    );
    assert!(
        record(&c, "data").is_some(),
        "the agent in the pod recorded the attachment in the cluster"
    );

    // Logs: JSON, from the pod's CRI log, with the mount's operation line.
    let ops = c.operation_lines();
    assert!(
        ops.iter().any(|l| l["op"] == "mount" && l["outcome"] == "ok" && l["volume"] == "data"),
        "the agent pod's log has the mount of data:\n{ops:#?}"
    );
    let (code, metrics) = c.agent_http("/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains(
            r#"volagent_operations_total{operation="mount",backend="local-pv",result="ok"} 1"#
        ),
        "/metrics counts the mount:\n{metrics}"
    );

    // The controller: two Ready replicas, one holding the lease, each
    // running as 65532 on a read-only root.
    let controllers = c.wait_ready(CONTROLLER_LABEL, 2);
    let names: Vec<String> = controllers.iter().map(name).collect();
    let leader =
        c.wait("a controller holding the lease", || lease_holder(&c).filter(|h| names.contains(h)));
    // The webhook every agent write went through: its configuration holds
    // the CA the controller made, and the Secret it keeps it in is there.
    let hooks: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(c.client());
    let hook =
        c.rt.block_on(hooks.get("volagent-node-restriction")).expect("the webhook's configuration");
    let bundle = hook
        .webhooks
        .unwrap_or_default()
        .first()
        .and_then(|w| w.client_config.ca_bundle.clone())
        .expect("a caBundle");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(c.client(), CONTROLLER_NS);
    let tls = c.rt.block_on(secrets.get("volagent-admission-tls")).expect("the webhook's Secret");
    assert_eq!(
        tls.data.unwrap_or_default().get("ca.crt").map(|b| b.0.clone()),
        Some(bundle.0),
        "the caBundle is the controller's CA"
    );
    for p in &controllers {
        let pid = c.container_pid(p, "controller");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .expect("the controller's status");
        let uids = status.lines().find(|l| l.starts_with("Uid:")).expect("a Uid line");
        assert!(
            uids.split_whitespace().skip(1).all(|u| u == "65532"),
            "{} runs as 65532: {uids}",
            name(p)
        );
        let root = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .expect("the controller's mounts");
        let root = root.lines().find(|l| l.split(' ').nth(4) == Some("/")).expect("a root mount");
        assert!(
            root.split(' ').nth(5).is_some_and(|o| o.split(',').any(|o| o == "ro")),
            "{}'s root is read-only: {root}",
            name(p)
        );
    }
    c.delete_pod(CONTROLLER_NS, &leader);
    let next = c.wait("another controller leading", || lease_holder(&c).filter(|h| *h != leader));
    let current: Vec<String> = c.pods(CONTROLLER_NS, CONTROLLER_LABEL).iter().map(name).collect();
    assert!(
        current.contains(&next),
        "the lease passed to a running replica: {next}, replicas {current:?}"
    );

    c.delete_pod("default", "app");
    c.wait("app gone", || c.pod("default", "app").is_none().then_some(()));
    assert!(c.mounts_below(&dir).is_empty(), "nothing is left mounted at {}", dir.display());
    c.wait("the record gone", || record(&c, "data").is_none().then_some(()));
    c.wait("no loop device left", || c.scratch.loops_left().is_empty().then_some(()));
}

/// A workload keeps reading and writing its volume while the agent pod is
/// deleted and recreated (the manifests' OnDelete way) and while the agent
/// is killed (kubelet restarts the container): each new agent adopts the
/// mount at start-up instead of tearing it down. A workload deleted while
/// no agent runs on the node is cleaned up when the agent comes back.
#[test]
fn a_workload_keeps_its_volume_while_the_agent_pod_is_replaced() {
    let c = DsCluster::start("node-life");
    local_volume(&c, "data");
    // One line every 200 ms; Ready while the last write is under 3 s old.
    let writer = "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); echo $i >> /data/log || exit 1; tail -n1 /data/log >/dev/null || exit 1; sleep 0.2; done";
    let fresh = "test $(( $(date +%s) - $(stat -c %Y /data/log) )) -lt 3";
    let uid = c.create_pod(pod_with(
        "app",
        &c.node,
        writer,
        &[("data", claim("data"))],
        Some(fresh),
        "Never",
    ));
    c.wait("app Ready", || is_ready(c.pod("default", "app").as_ref()).then_some(()));
    let dir = volume_dir(&uid, "data");
    let lines = || std::fs::read_to_string(dir.join("log")).map(|s| s.lines().count()).unwrap_or(0);
    let still_writing = |when: &str| {
        let before = lines();
        c.wait(&format!("app writing {when}"), || (lines() >= before + 5).then_some(()));
        let app = c.pod("default", "app");
        assert!(
            is_ready(app.as_ref()) && restarts(app.as_ref()) == 0,
            "app runs on, never restarted, {when}"
        );
        assert!(!c.mounts_below(&dir).is_empty(), "{} stays mounted {when}", dir.display());
    };
    still_writing("before");

    // 1. Deleted; the DaemonSet controller makes a new agent pod.
    let first = c.agent_pod();
    assert_eq!(reconciliations(&c, &first).len(), 1);
    c.delete_pod(SYSTEM, &name(&first));
    let second = c.wait("a new agent pod Ready", || {
        let p = c.agent_pod();
        (p.metadata.uid != first.metadata.uid).then_some(p)
    });
    still_writing("after the agent pod was replaced");
    let adopted =
        c.wait("the new agent's reconciliation", || reconciliations(&c, &second).first().cloned());
    assert_eq!(
        (adopted["kept"].as_u64(), adopted["rolled_back"].as_u64(), adopted["orphans"].as_u64()),
        (Some(1), Some(0), Some(0)),
        "the new agent adopted the mount: {adopted}"
    );

    // 2. Killed: kubelet restarts the container in the same pod.
    let id = container_id(&second, "agent");
    c.containerd()
        .ctr(&["tasks", "kill", "--signal", "SIGKILL", &id])
        .expect("kill the agent's container");
    c.wait("the agent restarted and Ready", || {
        let p = c.pod(SYSTEM, &name(&second));
        (restarts(p.as_ref()) >= 1 && is_ready(p.as_ref())).then_some(())
    });
    still_writing("after the agent was killed");
    let adopted = c.wait("the restarted agent's reconciliation", || {
        reconciliations(&c, &second).get(1).cloned()
    });
    assert_eq!(
        adopted["kept"].as_u64(),
        Some(1),
        "the restarted agent adopted the mount: {adopted}"
    );
    assert_eq!(
        unmounts(&c, &second),
        Vec::<Value>::new(),
        "no agent unmounted anything while the workload ran"
    );

    // 3. No agent on the node (the DaemonSet selects no node) while the
    // workload is deleted: kubelet cannot unmount, so the volume stays.
    let daemonsets: Api<DaemonSet> = Api::namespaced(c.client(), SYSTEM);
    let select = |selector: Value| {
        let patch = json!({ "spec": { "template": { "spec": { "nodeSelector": selector } } } });
        c.rt.block_on(daemonsets.patch(
            "volagent-agent",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        ))
        .expect("patch the DaemonSet");
    };
    select(json!({ "volagent.test/agent": "off" }));
    c.wait("no agent pod", || c.pods(SYSTEM, AGENT_LABEL).is_empty().then_some(()));
    c.delete_pod("default", "app");
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        c.pod("default", "app").is_some(),
        "without an agent the workload's volume cannot be torn down, so its pod stays"
    );
    assert!(!c.mounts_below(&dir).is_empty(), "the volume stays mounted while no agent runs");

    select(Value::Null);
    c.agent_pod();
    c.wait("app gone", || c.pod("default", "app").is_none().then_some(()));
    assert!(c.mounts_below(&dir).is_empty(), "nothing is left mounted at {}", dir.display());
    c.wait("the record gone", || record(&c, "data").is_none().then_some(()));
    c.wait("no loop device left", || c.scratch.loops_left().is_empty().then_some(()));
}

/// Watches `file` grow from a thread: the longest it went without growing,
/// from when [`Growth::window`] was last called.
struct Growth {
    stop: Arc<AtomicBool>,
    longest: Arc<Mutex<Duration>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Growth {
    fn watch(file: PathBuf) -> Growth {
        let stop = Arc::new(AtomicBool::new(false));
        let longest = Arc::new(Mutex::new(Duration::ZERO));
        let (s, l) = (stop.clone(), longest.clone());
        let thread = std::thread::spawn(move || {
            let (mut size, mut since) = (0, Instant::now());
            while !s.load(Ordering::SeqCst) {
                let now = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
                if now != size {
                    size = now;
                    since = Instant::now();
                }
                let mut longest = l.lock().unwrap_or_else(|e| e.into_inner());
                *longest = (*longest).max(since.elapsed());
                drop(longest);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Growth { stop, longest, thread: Some(thread) }
    }

    /// The longest stall since the last call.
    fn window(&self) -> Duration {
        std::mem::take(&mut *self.longest.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Growth {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Processes of the userspace data path on the node: the agent's NBD
/// clients and helper servers (run by the mounter, as the host's pids).
fn data_path_processes() -> Vec<(i32, String)> {
    let state = Path::new(NODE_PATHS[2].1);
    let mut found: Vec<(i32, String)> =
        volagent_test_support::scratch::processes_under(state, |a| {
            a.get(1..3).is_some_and(|s| s[0] == "nbd" && (s[1] == "fuse" || s[1] == "serve"))
        })
        .into_iter()
        .map(|p| (p, std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default()))
        .collect();
    found.sort();
    found
}

/// A workload pod's script: one record per loop (its number) appended to
/// `<volume>/<file>` on each of its volumes and fsynced (dd's conv=fsync);
/// any failure ends the pod, which is never restarted. (A short pause
/// leaves the node's two cores to the readiness probe and the agents.)
fn writer(file: &str) -> (String, String) {
    let script = format!(
        "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); for d in /data/*; do echo $i >> $d/{file} || exit 1; dd if=/dev/null of=$d/{file} conv=notrunc,fsync 2>/dev/null || exit 2; done; sleep 0.02; done"
    );
    let fresh = format!(
        "for d in /data/*; do test $(( $(date +%s) - $(stat -c %Y $d/{file}) )) -lt 3 || exit 1; done"
    );
    (script, fresh)
}

/// `text` is the records 1, 2, … in order, more than `least` of them.
fn records_in_order(text: &str, least: usize, what: &str) {
    let records: Vec<&str> = text.lines().collect();
    assert!(
        records.len() > least,
        "{what}: the workload wrote through it all: {} records",
        records.len()
    );
    for (i, r) in records.iter().enumerate() {
        assert_eq!(*r, (i + 1).to_string(), "{what}: record {} of {}", i + 1, records.len());
    }
}

/// File `name` from the root of the ext4 filesystem in `image`.
fn debugfs_cat(image: &Path, name: &str) -> String {
    let out = std::process::Command::new("debugfs")
        .args(["-R", &format!("cat /{name}")])
        .arg(image)
        .stderr(std::process::Stdio::null())
        .output()
        .expect("debugfs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Userspace volumes keep workloads writing and fsync-ing without one
/// error while the agent's DaemonSet is rolled to a new image tag
/// (RollingUpdate) and while the agent's container is SIGKILLed: their
/// processes are the mounter's (its own DaemonSet), not the agent's, so
/// neither event touches them, and each new agent adopts the volumes. Pod
/// `app` has a local file behind the agent's helper NBD server and an RBD
/// image through librbd behind it (the run's Ceph), each reached through
/// the agent's FUSE client and a loop device (this kernel has no nbd.ko);
/// pod `pinned` has an image through rbd-fuse and a GlusterFS volume
/// (the run's GlusterFS). Those two pin the mounter: an Event on its pod
/// says so, and another once `pinned` is gone. Then the mounter's pod is
/// replaced and its container SIGKILLed: the agent keeps each client's
/// FUSE connection, the local file's export and the librbd helper's
/// arguments and keyring, and starts new helpers and clients in the next
/// mounter. No pod is restarted, and every record each wrote is in its
/// volume afterwards.
#[test]
fn userspace_volumes_serve_on_while_the_agent_and_the_mounter_are_replaced_and_killed() {
    use volagent_test_support::ceph::{Image, ceph_dir, controller_key, rbd, volagent_key};
    use volagent_test_support::{ceph_cluster, shipped};
    let ceph = ceph_dir();
    let gluster = PathBuf::from(std::env::var("VOLAGENT_GLUSTER_DIR").expect(
        "VOLAGENT_GLUSTER_DIR: the single-node GlusterFS of this run (scripts/gluster-env start makes it; scripts/test sets it)",
    ));
    assert!(gluster.join("ready").exists(), "no GlusterFS ready in {}", gluster.display());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();

    // Declared first, so let go last: after the cluster's pods (and the
    // images, made after) are gone, also when the test fails.
    let _storage;
    let c = DsCluster::start("node-roll");
    // The run's Ceph and GlusterFS listen on the host's loopback; the
    // node's pods (and this thread, in the node's namespaces) see them at
    // the same addresses.
    _storage = c.reach_host_ports(&["ceph-mon", "ceph-osd", "glusterd", "glusterfsd"]);
    let (librbd, fuse) = (Image::create(&ceph, 64), Image::create(&ceph, 64));
    let client = c.client();
    ceph_cluster::create_secret_in(&c.rt, &client, SYSTEM, "ceph-volagent", &volagent_key(&ceph));
    ceph_cluster::create_secret_in(
        &c.rt,
        &client,
        shipped::CONTROLLER_NAMESPACE,
        "ceph-fencing",
        &controller_key(&ceph),
    );
    ceph_cluster::create_storage_cluster_in(&c.rt, &client, "ceph", "ceph-volagent");
    let disk = c.disk("roll.img", 64);
    let kcm = c.kcm.as_ref().expect("kcm").log();
    let volume = |pv: &str, backend: &str, mode: &str, options: &[(&str, &str)]| {
        create_volume(&c.rt, &client, pv, backend, mode, options, kcm);
    };
    volume("roll", "nbd", "ReadWriteOnce", &[("file", disk.as_str()), ("attach", "userspace")]);
    volume(
        "roll-rbd",
        "rbd",
        "ReadWriteOnce",
        &[("storageCluster", "ceph"), ("image", &librbd.name)],
    );
    volume(
        "roll-fuse",
        "rbd",
        "ReadWriteOnce",
        &[("storageCluster", "ceph"), ("image", &fuse.name), ("attach", "fuse")],
    );
    volume("roll-gluster", "gluster", "ReadWriteMany", &[("servers", &host), ("volume", "v0")]);
    // Unique: the gluster volume keeps other runs' files.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let log = format!("roll-{}-{}", std::process::id(), nanos.as_nanos());
    let (script, fresh) = writer(&log);
    let mut uids = Vec::new();
    for (pod, volumes) in [("app", ["roll", "roll-rbd"]), ("pinned", ["roll-fuse", "roll-gluster"])]
    {
        let claims: Vec<(&str, Value)> = volumes.iter().map(|v| (*v, claim(v))).collect();
        uids.push(c.create_pod(pod_with(pod, &c.node, &script, &claims, Some(&fresh), "Never")));
    }
    for pod in ["app", "pinned"] {
        c.wait(&format!("{pod} Ready"), || is_ready(c.pod("default", pod).as_ref()).then_some(()));
    }
    let pods = Path::new(NODE_PATHS[0].1).join("pods");
    let file_of = |uid: &str, backend: &str, pv: &str| {
        pods.join(format!("{uid}/volumes/volagent~{backend}/{pv}")).join(&log)
    };
    let app_files = [file_of(&uids[0], "nbd", "roll"), file_of(&uids[0], "rbd", "roll-rbd")];
    let pinned_files =
        [file_of(&uids[1], "rbd", "roll-fuse"), file_of(&uids[1], "gluster", "roll-gluster")];
    let processes = std::cell::RefCell::new(data_path_processes());
    assert_eq!(processes.borrow().len(), 4, "two clients and two helper servers: {processes:?}");
    let mounter = c.wait_ready(MOUNTER_LABEL, 1).remove(0);
    let mounter_pid = c.container_pid(&mounter, "mounter");
    let growth: Vec<Growth> = app_files.iter().map(|f| Growth::watch(f.clone())).collect();
    let stalls = || growth.iter().map(Growth::window).collect::<Vec<_>>();
    let lines = |f: &Path| std::fs::read_to_string(f).map(|s| s.lines().count()).unwrap_or(0);
    let still_writing = |when: &str, pods: &[&str], files: &[&PathBuf]| {
        let before: Vec<usize> = files.iter().map(|f| lines(f)).collect();
        c.wait(&format!("writing {when}"), || {
            files.iter().zip(&before).all(|(f, b)| lines(f) >= b + 20).then_some(())
        });
        // Each container never ended (a failed write or fsync ends it):
        // not its readiness, which an exec probe timing out on a loaded
        // node can flip for a moment.
        for pod in pods {
            let p = c.pod("default", pod);
            let running = p
                .as_ref()
                .and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first().cloned())
                .is_some_and(|s| s.state.and_then(|s| s.running).is_some());
            assert!(running && restarts(p.as_ref()) == 0, "{pod} runs on, never restarted, {when}");
        }
        assert_eq!(
            data_path_processes(),
            *processes.borrow(),
            "the same clients and helpers {when}"
        );
    };
    let all: Vec<&PathBuf> = app_files.iter().chain(&pinned_files).collect();
    let app: Vec<&PathBuf> = app_files.iter().collect();
    // The mounter's processes gone: the agent starts others on what it kept.
    let started_again = |when: &str| {
        let old: Vec<i32> = processes.borrow().iter().map(|(p, _)| *p).collect();
        let new = c.wait(&format!("new clients and helpers {when}"), || {
            let now = data_path_processes();
            (now.len() == 4 && now.iter().all(|(p, _)| !old.contains(p))).then_some(now)
        });
        *processes.borrow_mut() = new;
    };
    still_writing("before", &["app", "pinned"], &all);
    stalls();

    // (a) Rolled: the same image under a new tag; the DaemonSet controller
    // replaces the agent's pod.
    let first = c.agent_pod();
    let (image_name, _) = c.image.rsplit_once(':').expect("a tag");
    let rolled = format!("{image_name}:rolled");
    c.containerd().ctr(&["images", "tag", &c.image, &rolled]).expect("tag the image");
    let daemonsets: Api<DaemonSet> = Api::namespaced(c.client(), SYSTEM);
    let patch = json!({ "spec": { "template": { "spec": { "containers": [
        { "name": "agent", "image": rolled }
    ] } } } });
    c.rt.block_on(daemonsets.patch(
        "volagent-agent",
        &PatchParams::default(),
        &Patch::Strategic(&patch),
    ))
    .expect("roll the agent's DaemonSet");
    let second = c.wait("the rolled agent pod Ready", || {
        let p = c.agent_pod();
        let image = p.spec.as_ref().map(|s| s.containers[0].image.clone().unwrap_or_default());
        (p.metadata.uid != first.metadata.uid && image.as_deref() == Some(rolled.as_str()))
            .then_some(p)
    });
    still_writing("after the agent was rolled", &["app", "pinned"], &all);
    let adopted = c.wait("the rolled agent's reconciliation", || {
        reconciliations(&c, &second).first().cloned()
    });
    assert_eq!(
        adopted["kept"].as_u64(),
        Some(4),
        "the rolled agent adopted the volumes: {adopted}"
    );
    let rolled_stall = stalls();

    // (b) Killed: kubelet restarts the container in the same pod.
    let id = container_id(&second, "agent");
    c.containerd()
        .ctr(&["tasks", "kill", "--signal", "SIGKILL", &id])
        .expect("kill the agent's container");
    c.wait("the agent restarted and Ready", || {
        let p = c.pod(SYSTEM, &name(&second));
        (restarts(p.as_ref()) >= 1 && is_ready(p.as_ref())).then_some(())
    });
    still_writing("after the agent was killed", &["app", "pinned"], &all);
    let adopted = c.wait("the restarted agent's reconciliation", || {
        reconciliations(&c, &second).get(1).cloned()
    });
    assert_eq!(adopted["kept"].as_u64(), Some(4), "the restarted agent adopted them: {adopted}");
    let killed_stall = stalls();
    assert_eq!(
        c.container_pid(&c.wait_ready(MOUNTER_LABEL, 1).remove(0), "mounter"),
        mounter_pid,
        "the mounter was never restarted"
    );

    // What no successor could serve pins the mounter, and its pod says so.
    // The latest of each reason: one was told as each volume was mounted.
    let said = |reason: &str| {
        events_about(&c.rt, &client, SYSTEM, &name(&mounter))
            .into_iter()
            .filter(|(r, _)| r == reason)
            .map(|(_, message)| message)
            .next_back()
    };
    let both = ["rbd/roll-fuse (rbd-fuse)", "gluster/roll-gluster (glusterfs)"];
    let pinned = c.wait("a Warning on the mounter's pod naming both", || {
        said("MounterPinned").filter(|m| both.iter().all(|v| m.contains(v)))
    });
    for (_, message) in events_about(&c.rt, &client, SYSTEM, &name(&mounter)) {
        assert!(!message.contains("roll-rbd") && !message.contains("nbd/roll"), "{message}");
    }
    assert!(!pinned.is_empty());
    // Drained of them; their records, read through their mounts first.
    let pinned_records: Vec<String> =
        pinned_files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect();
    c.delete_pod("default", "pinned");
    c.wait("pinned gone", || c.pod("default", "pinned").is_none().then_some(()));
    for (text, what) in pinned_records.iter().zip(["rbd-fuse", "gluster"]) {
        records_in_order(text, 60, what);
    }
    c.wait("a Normal Event once nothing pins the mounter", || said("MounterFree"));

    // (c) The mounter's pod replaced (deleted; OnDelete's new pod): it has
    // the clients answer what they hold and end; the runtime ends the rest.
    c.delete_pod(SYSTEM, &name(&mounter));
    let mounter = c.wait("a new mounter pod Ready", || {
        let p = c.wait_ready(MOUNTER_LABEL, 1).remove(0);
        (p.metadata.uid != mounter.metadata.uid).then_some(p)
    });
    started_again("after the mounter's pod was replaced");
    still_writing("after the mounter's pod was replaced", &["app"], &app);
    let replaced_stall = stalls();

    // (d) The mounter killed: kubelet restarts its container.
    let id = container_id(&mounter, "mounter");
    c.containerd()
        .ctr(&["tasks", "kill", "--signal", "SIGKILL", &id])
        .expect("kill the mounter's container");
    c.wait("the mounter restarted and Ready", || {
        let p = c.pod(SYSTEM, &name(&mounter));
        (restarts(p.as_ref()) >= 1 && is_ready(p.as_ref())).then_some(())
    });
    started_again("after the mounter was killed");
    still_writing("after the mounter was killed", &["app"], &app);
    let mounter_killed_stall = stalls();
    // The agent, as deploy/'s ServiceAccount, wrote the librbd helper's
    // latest Ceph client into the volume's record: what fencing would
    // blocklist is the client that runs.
    let running_client = || -> Option<(i64, String)> {
        let dir = Path::new(NODE_PATHS[2].1).join("nbd");
        let file = std::fs::read_dir(&dir).ok()?.flatten().map(|e| e.path()).find(|p| {
            p.extension().is_some_and(|e| e == "client")
                && std::fs::read_to_string(p).is_ok_and(|t| !t.is_empty())
        })?;
        let text = std::fs::read_to_string(file).ok()?;
        let (id, address) = text.trim().split_once(' ')?;
        Some((id.parse().ok()?, address.to_string()))
    };
    c.wait("the record to name the running helper's Ceph client", || {
        let now = running_client()?;
        let named = record(&c, "roll-rbd")?
            .spec
            .storage_clients
            .iter()
            .any(|e| e.node == c.node && (e.id, e.address.clone()) == now);
        named.then_some(())
    });
    eprintln!(
        "longest stall of the workload's writes to [local file, librbd]: {rolled_stall:?} while the agent was rolled, {killed_stall:?} while it was killed, {replaced_stall:?} while the mounter's pod was replaced, {mounter_killed_stall:?} while the mounter was killed"
    );
    drop(growth);

    c.delete_pod("default", "app");
    c.wait("app gone", || c.pod("default", "app").is_none().then_some(()));
    for uid in &uids {
        let dir = pods.join(uid);
        assert!(c.mounts_below(&dir).is_empty(), "nothing is left mounted below {}", dir.display());
    }
    c.wait("the clients and the helpers ended", || data_path_processes().is_empty().then_some(()));
    c.wait("no loop device left", || c.scratch.loops_left().is_empty().then_some(()));
    // Every record, in order, straight from each volume's filesystem.
    records_in_order(&debugfs_cat(&c.scratch.path("disks/roll.img"), &log), 60, "the local file");
    let exported = c.scratch.path("roll-rbd.img");
    let out = rbd(&ceph, &["export", "--no-progress", &librbd.spec(), exported.to_str().unwrap()]);
    assert!(out.status.success(), "rbd export: {out:?}");
    records_in_order(&debugfs_cat(&exported, &log), 60, "the librbd image");
}
