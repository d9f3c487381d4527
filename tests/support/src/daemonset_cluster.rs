//! A one-node cluster in a box for the DaemonSet tier: etcd, kube-apiserver,
//! kube-controller-manager (with the workload and service-account
//! controllers), kube-scheduler, containerd and kubelet, all in the test's
//! private mount and network namespaces, and `deploy/` applied with
//! `kubectl apply -k` — the agent runs as the DaemonSet's pod, from the
//! image `scripts/build-image` makes, and the controller as its Deployment.
//!
//! The node looks like a real one from inside its namespace: the paths the
//! manifests name (`/var/lib/kubelet`, kubelet's default volume-plugin-dir,
//! `/var/lib/volagent`, `/run/volagent`, `/mnt/disks`) are the test's
//! scratch dirs bound there, the node has an address of its own
//! ([`NODE_IP`]), and the API server is at the `kubernetes` Service's
//! address, so the manifests apply unchanged but for the image's name.
//! The mount points are created on the host when missing (empty dirs).
//!
//! Teardown, also after a failed assertion: the daemons, then everything
//! they left running (shims, containers), then every mount below the
//! scratch dir and the node paths, and the loop devices over the test's
//! image files.

use crate::kubelet_cluster::{events_about, tail, tail_matching};
use crate::scratch::RootScratch;
use crate::wait::{Deadline, wait_until_or};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use volagent_kube_env::node::{
    self, Containerd, ControllerManager, Kubelet, Layout, NodeAssets, Scheduler,
};
use volagent_kube_env::{KubeEnv, Namespaces, Options};

/// The node's address (on the namespace's loopback): its InternalIP, the
/// agent pod's `status.hostIP`, where the agent serves `/metrics`.
pub const NODE_IP: &str = "10.245.0.1";
pub const SYSTEM: &str = "volagent-system";
/// The controller's namespace (its pods, Lease and webhook Service).
pub const CONTROLLER_NS: &str = "volagent-controller";
pub const AGENT_LABEL: &str = "app.kubernetes.io/name=volagent-agent";
pub const MOUNTER_LABEL: &str = "app.kubernetes.io/name=volagent-mounter";
pub const CONTROLLER_LABEL: &str = "app.kubernetes.io/name=volagent-controller";
/// How long pods may take: the agent's image is imported and started, the
/// DaemonSet controller retries until the service account's token exists,
/// and kubelet retries a failed mount with a doubling backoff.
pub const WAIT: Duration = Duration::from_secs(180);

/// The manifests' node paths, each bound from `<scratch>/<dir>`.
pub const NODE_PATHS: [(&str, &str); 5] = [
    ("kubelet", "/var/lib/kubelet"),
    ("volume-plugins", "/usr/libexec/kubernetes/kubelet-plugins/volume/exec"),
    ("state", "/var/lib/volagent"),
    ("run", "/run/volagent"),
    ("disks", "/mnt/disks"),
];

pub struct DsCluster {
    /// The node's name. Tests running at once name their nodes apart: they
    /// share the kernel's loop devices, and an agent takes a loop device
    /// tagged with its node's name (and state dir) for its own.
    pub node: String,
    pub scheduler: Option<Scheduler>,
    pub kcm: Option<ControllerManager>,
    pub kubelet: Option<Kubelet>,
    pub containerd: Option<Containerd>,
    pub env: Option<KubeEnv>,
    pub rt: tokio::runtime::Runtime,
    pub ns: Arc<Namespaces>,
    pub assets: NodeAssets,
    /// The agent image's name, as its archive's manifest says.
    pub image: String,
    pub scratch: RootScratch,
    /// The host's network namespace, where the run's Ceph and GlusterFS
    /// listen ([`DsCluster::reach_host_ports`]).
    pub host_net: std::fs::File,
}

impl DsCluster {
    /// Starts the box with one node, `node`, applies `deploy/` with the
    /// image overridden, and waits until the agent pod and both controller
    /// pods are Ready.
    pub fn start(node: &str) -> DsCluster {
        let scratch = RootScratch::enter();
        let assets = node::node_assets()
            .expect("the kubelet tier's assets (scripts/kube-assets, scripts/node-assets)");
        let archive = node::agent_image().unwrap_or_else(|e| panic!("{e:#}"));
        let image = image_name(&archive);
        node::become_subreaper().expect("subreaper");
        let host_net =
            std::fs::File::open("/proc/thread-self/ns/net").expect("the host's network namespace");
        let ns = node::enter_node_namespaces().expect("private namespaces for the node");
        bind_node_paths(&scratch);
        let rt =
            tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let env = rt
            .block_on(KubeEnv::start_with(Options {
                namespaces: Some(ns.clone()),
                in_cluster: true,
            }))
            .expect("a real kube-apiserver (scripts/kube-assets)");
        let mut ip = std::process::Command::new("ip");
        ip.args(["addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"]);
        node::run_in(ip, Some(&ns), "ip addr add").expect("the node's address");
        let containerd =
            Containerd::start(&scratch.path("containerd"), 1, &assets.image, Some(ns.clone()))
                .expect("containerd");
        containerd.import(&archive).expect("import the agent image");
        let layout = Layout {
            root_dir: NODE_PATHS[0].1.into(),
            plugin_dir: NODE_PATHS[1].1.into(),
            node_ip: NODE_IP.into(),
        };
        let kubelet =
            Kubelet::start_with(&env, node, &scratch.path("node"), &containerd, &assets, layout)
                .expect("kubelet");
        let kcm = ControllerManager::start_for_workloads(
            &env,
            &scratch.path(""),
            &assets,
            Some(ns.clone()),
        )
        .expect("kube-controller-manager");
        let scheduler = Scheduler::start(&env, &scratch.path(""), &assets, Some(ns.clone()))
            .expect("kube-scheduler");
        let c = DsCluster {
            node: node.into(),
            scheduler: Some(scheduler),
            kcm: Some(kcm),
            kubelet: Some(kubelet),
            containerd: Some(containerd),
            env: Some(env),
            rt,
            ns,
            assets,
            image,
            scratch,
            host_net,
        };
        c.rt.block_on(node::wait_node_ready(
            &c.client(),
            node,
            Duration::from_secs(90),
            c.kubelet(),
        ))
        .expect("node Ready");
        c.apply_deploy();
        c.wait_ready(MOUNTER_LABEL, 1);
        c.wait_ready(AGENT_LABEL, 1);
        c.wait_ready(CONTROLLER_LABEL, 2);
        c
    }

    /// `kubectl apply -k` of an overlay whose base is `deploy/` and which
    /// only renames the image, as a user with their own registry would.
    fn apply_deploy(&self) {
        let deploy = std::fs::canonicalize(crate::workspace().join("deploy")).expect("deploy/");
        let base = std::fs::read_to_string(deploy.join("kustomization.yaml"))
            .expect("deploy/kustomization.yaml");
        // The base already renames `volagent`; the overlay renames its result.
        let base_name = base
            .lines()
            .find_map(|l| l.trim().strip_prefix("newName:"))
            .expect("deploy/kustomization.yaml sets images[].newName")
            .trim();
        let (name, tag) = self.image.rsplit_once(':').expect("the image has a tag");
        let overlay = self.scratch.path("overlay");
        std::fs::create_dir_all(&overlay).expect("dir");
        // kubectl's kustomize takes a base by relative path only.
        let up = "../".repeat(overlay.components().count() - 1);
        let kustomization = format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nbases:\n  - {up}{}\nimages:\n  - name: {base_name}\n    newName: {name}\n    newTag: \"{tag}\"\n",
            deploy.strip_prefix("/").expect("an absolute path").display()
        );
        std::fs::write(overlay.join("kustomization.yaml"), kustomization)
            .expect("write the overlay");
        let out = self.kubectl(&["apply", "-k", &overlay.display().to_string()]);
        for ds in ["volagent-agent", "volagent-mounter"] {
            assert!(
                out.contains(&format!("daemonset.apps/{ds} created")),
                "kubectl apply -k created the DaemonSet {ds}:\n{out}"
            );
        }
    }

    /// The host's TCP ports that processes named one of `programs` listen
    /// on (the run's Ceph: ceph-mon, ceph-osd; GlusterFS: glusterd,
    /// glusterfsd), reached from the node at the same address while the
    /// result lives. Call it from the test's thread.
    pub fn reach_host_ports(&self, programs: &[&str]) -> crate::host_ports::Forwarded {
        let ports = crate::host_ports::listening(&self.host_net, programs)
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert!(!ports.is_empty(), "nothing named {programs:?} listens on the host");
        crate::host_ports::forward(&self.host_net, self.ns.net(), &ports)
            .unwrap_or_else(|e| panic!("forwarding {ports:?} into the node: {e:#}"))
    }

    pub fn kubectl(&self, args: &[&str]) -> String {
        node::kubectl(self.env(), &self.assets, Some(&self.ns), args)
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    pub fn env(&self) -> &KubeEnv {
        self.env.as_ref().expect("the API server")
    }

    pub fn kubelet(&self) -> &Kubelet {
        self.kubelet.as_ref().expect("the kubelet")
    }

    pub fn containerd(&self) -> &Containerd {
        self.containerd.as_ref().expect("containerd")
    }

    /// An admin client (made inside the runtime, which its I/O needs).
    pub fn client(&self) -> kube::Client {
        let _in_runtime = self.rt.enter();
        self.env().client()
    }

    // --- pods ------------------------------------------------------------------

    pub fn pods(&self, namespace: &str, label: &str) -> Vec<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client(), namespace);
        self.rt.block_on(api.list(&ListParams::default().labels(label))).expect("list pods").items
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client(), namespace);
        self.rt.block_on(api.get_opt(name)).expect("read pod")
    }

    pub fn create_pod(&self, pod: Value) -> String {
        let pod: Pod = serde_json::from_value(pod).expect("a pod");
        let api: Api<Pod> = Api::namespaced(self.client(), "default");
        let created =
            self.rt.block_on(api.create(&PostParams::default(), &pod)).expect("create pod");
        created.metadata.uid.expect("a UID")
    }

    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let api: Api<Pod> = Api::namespaced(self.client(), namespace);
        self.rt
            .block_on(api.delete(name, &DeleteParams::default()))
            .unwrap_or_else(|e| panic!("delete pod {namespace}/{name}: {e}"));
    }

    /// The one Ready pod with `label` in the system namespace that is not
    /// being deleted, once there is exactly one.
    pub fn agent_pod(&self) -> Pod {
        self.wait_ready(AGENT_LABEL, 1).remove(0)
    }

    /// Waits until `count` pods with `label` (in the controller's namespace
    /// or the agents') are Ready and none other is left; them.
    pub fn wait_ready(&self, label: &str, count: usize) -> Vec<Pod> {
        self.wait(&format!("{count} Ready pods {label}"), || {
            let namespace = if label == CONTROLLER_LABEL { CONTROLLER_NS } else { SYSTEM };
            let pods = self.pods(namespace, label);
            let ready: Vec<Pod> = pods
                .iter()
                .filter(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && crate::kubelet_cluster::is_ready(Some(p))
                })
                .cloned()
                .collect();
            (ready.len() == count && pods.len() == count).then_some(ready)
        })
    }

    /// Polls `check` until it gives a value; on timeout fails with what the
    /// pods, their Events and the node's logs say.
    pub fn wait<T>(&self, what: &str, check: impl FnMut() -> Option<T>) -> T {
        let deadline = Deadline::within(WAIT).polling(Duration::from_millis(250));
        wait_until_or(deadline, what, check, || self.diagnose())
    }

    /// The state of every pod, their Events and the logs' tails.
    pub fn diagnose(&self) -> String {
        let mut out = String::new();
        for namespace in [SYSTEM, CONTROLLER_NS, "default"] {
            let api: Api<Pod> = Api::namespaced(self.client(), namespace);
            let pods = self
                .rt
                .block_on(api.list(&ListParams::default()))
                .map(|l| l.items)
                .unwrap_or_default();
            for p in pods {
                let name = p.metadata.name.clone().unwrap_or_default();
                out += &format!(
                    "pod {namespace}/{name}: {}\n",
                    p.status
                        .as_ref()
                        .map(|s| serde_json::to_string(s).unwrap_or_default())
                        .unwrap_or_default()
                );
                for (reason, message) in events_about(&self.rt, &self.client(), namespace, &name) {
                    out += &format!("  {reason}: {message}\n");
                }
                out += &tail_matching(self.kubelet().log(), &name, 10);
            }
        }
        for (reason, message) in events_about(&self.rt, &self.client(), SYSTEM, "volagent-agent") {
            out += &format!("daemonset: {reason}: {message}\n");
        }
        for log in self.agent_logs() {
            out += &tail(&log);
        }
        for log in container_logs("volagent-system_volagent-mounter-", "mounter") {
            out += &tail(&log);
        }
        // The userspace clients' and helpers' own logs.
        let nbd = Path::new(NODE_PATHS[2].1).join("nbd");
        for entry in std::fs::read_dir(&nbd).into_iter().flatten().flatten() {
            if entry.path().extension().is_some_and(|e| e == "log") {
                out += &tail(&entry.path());
            }
        }
        out + &tail(self.kcm.as_ref().expect("kcm").log())
    }

    // --- what the node sees ------------------------------------------------------

    /// The CRI log files of the agent's containers (every pod, every
    /// restart), oldest pod first.
    pub fn agent_logs(&self) -> Vec<PathBuf> {
        container_logs("volagent-system_volagent-agent-", "agent")
    }

    /// The JSON objects the agent's containers logged (stdout and stderr,
    /// as kubelet keeps them: `<time> <stream> <F|P> <line>`); lines that
    /// are not JSON make the test fail. kubelet keeps the logs of a pod's
    /// current and previous container, and removes them with the pod.
    pub fn agent_json_lines(&self) -> Vec<Value> {
        json_lines(&self.agent_logs())
    }

    /// Like [`Self::agent_json_lines`], of agent pod `pod` only.
    pub fn json_lines_of(&self, pod: &Pod) -> Vec<Value> {
        let (name, uid) = (
            pod.metadata.name.as_deref().unwrap_or_default(),
            pod.metadata.uid.as_deref().unwrap_or_default(),
        );
        json_lines(&container_logs(&format!("{SYSTEM}_{name}_{uid}"), "agent"))
    }

    /// The operation lines the agent's containers logged.
    pub fn operation_lines(&self) -> Vec<Value> {
        self.agent_json_lines()
            .into_iter()
            .filter(|v| v["op"].is_string() && v["outcome"].is_string())
            .collect()
    }

    /// A GET to the agent's metrics port through the node's address: (status
    /// code, body).
    pub fn agent_http(&self, path: &str) -> (u16, String) {
        http_get(&format!("{NODE_IP}:9479"), path)
    }

    /// Mounts whose mount point is below `dir` (in the node's namespace).
    pub fn mounts_below(&self, dir: &Path) -> Vec<PathBuf> {
        let text = std::fs::read_to_string("/proc/thread-self/mountinfo").expect("mountinfo");
        volagent::sys::mountinfo::parse(&text)
            .expect("parse mountinfo")
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| p.starts_with(dir))
            .collect()
    }

    /// A sparse image file of `mib` MiB in the node's `/mnt/disks`; its
    /// path as the node (and the agent's container) sees it.
    pub fn disk(&self, name: &str, mib: u64) -> String {
        self.scratch.image(&format!("disks/{name}"), mib);
        format!("/mnt/disks/{name}")
    }

    /// The process of the container `container` of pod `pod`, from
    /// containerd's task list: its pid.
    pub fn container_pid(&self, pod: &Pod, container: &str) -> i32 {
        let id = container_id(pod, container);
        let tasks = self.containerd().ctr(&["tasks", "ls"]).expect("ctr tasks ls");
        tasks
            .lines()
            .find(|l| l.starts_with(&id))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|pid| pid.parse().ok())
            .unwrap_or_else(|| panic!("no task for container {id}:\n{tasks}"))
    }

    fn keep_logs(&self) {
        let test = std::thread::current().name().unwrap_or("test").replace("::", "-");
        let dest = std::env::temp_dir().join("volagent-daemonset-tier").join(test);
        let _ = std::fs::remove_dir_all(&dest);
        let _ = std::fs::create_dir_all(&dest);
        let mut logs = vec![
            self.scratch.path("kube-controller-manager.log"),
            self.scratch.path("kube-scheduler.log"),
            self.scratch.path("node/kubelet.log"),
            self.scratch.path("containerd/containerd.log"),
        ];
        if let Some(env) = &self.env {
            logs.push(env.dir().join("kube-apiserver.log"));
        }
        logs.extend(container_logs("", ""));
        for (i, log) in logs.iter().enumerate() {
            let name =
                log.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let parent = log
                .parent()
                .and_then(|p| p.parent())
                .and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let _ = std::fs::copy(log, dest.join(format!("{i:02}-{parent}-{name}")));
        }
        eprintln!("daemonset tier: logs kept in {}", dest.display());
    }
}

impl Drop for DsCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.keep_logs();
        }
        if let Some(k) = self.kubelet.take() {
            k.stop();
        }
        if let Some(c) = self.containerd.take() {
            c.stop();
        }
        self.scheduler = None;
        self.kcm = None;
        self.env = None;
        node::teardown(&self.scratch.path(""));
        for (_, path) in NODE_PATHS {
            node::unmount_below(Path::new(path));
        }
        // Loop devices the node's agent left (a test that failed with a
        // volume attached): over files under the node's paths, which are
        // not the scratch dir's, and tagged for this node's agent, whose
        // next run would otherwise find them.
        use volagent::sys::Devices;
        let linux = volagent::sys::linux::Linux::unrooted();
        let tag = volagent::ops::loop_tag(&self.node, Path::new(NODE_PATHS[2].1));
        // A device over a FUSE file whose client died has no readable
        // status (ENOTCONN), so no tag: known by its file's path instead.
        let state = Path::new(NODE_PATHS[2].1);
        let dead_client_file = |f: &Path| {
            f.starts_with(state)
                || (f.parent() == Some(Path::new("/"))
                    && f.file_name().is_some_and(|n| n.to_string_lossy().starts_with("export-")))
        };
        for l in linux
            .loop_devices()
            .unwrap_or_default()
            .into_iter()
            .filter(|l| l.tag == tag || (l.tag.is_empty() && dead_client_file(&l.backing_file)))
        {
            let _ = linux.loop_detach(&l.device);
        }
    }
}

/// The JSON objects in CRI log files; a line that is not JSON fails the test.
fn json_lines(logs: &[PathBuf]) -> Vec<Value> {
    let mut lines = Vec::new();
    for log in logs {
        for l in std::fs::read_to_string(log).unwrap_or_default().lines() {
            let text = l
                .splitn(4, ' ')
                .nth(3)
                .unwrap_or_else(|| panic!("a CRI log line in {}: {l:?}", log.display()));
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| {
                panic!("the agent logs JSON, not {text:?} ({e}) in {}", log.display())
            });
            lines.push(v);
        }
    }
    lines
}

/// The CRI log files kubelet keeps in `/var/log/pods` of containers named
/// `container` (any when empty) in pods whose log dir starts with `prefix`
/// (`<namespace>_<pod>_<uid>`), oldest pod first, each pod's by restart.
pub fn container_logs(prefix: &str, container: &str) -> Vec<PathBuf> {
    let mut logs = Vec::new();
    let Ok(dirs) = std::fs::read_dir("/var/log/pods") else { return logs };
    let mut dirs: Vec<_> =
        dirs.flatten().filter(|d| d.file_name().to_string_lossy().starts_with(prefix)).collect();
    dirs.sort_by_key(|d| d.metadata().and_then(|m| m.modified()).ok());
    for d in dirs {
        let containers: Vec<PathBuf> = std::fs::read_dir(d.path())
            .map(|f| f.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        for c in containers.into_iter().filter(|c| container.is_empty() || c.ends_with(container)) {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&c)
                .map(|f| f.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            files.sort();
            logs.extend(files);
        }
    }
    logs
}

/// The first name in the archive's manifest.json.
fn image_name(archive: &Path) -> String {
    let out = std::process::Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg("./manifest.json")
        .output()
        .expect("run tar");
    assert!(
        out.status.success(),
        "no manifest.json in {}: {}",
        archive.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let manifest: Value = serde_json::from_slice(&out.stdout).expect("manifest.json is JSON");
    manifest[0]["RepoTags"][0].as_str().expect("the archive names its image").to_string()
}

/// Binds `<scratch>/<dir>` onto each of [`NODE_PATHS`] in the calling
/// thread's (private) mount namespace, as shared mounts, as a node's are
/// (systemd makes `/` shared): containerd refuses Bidirectional propagation
/// from a mount that is not shared, HostToContainer from one that is
/// neither shared nor a slave.
fn bind_node_paths(scratch: &RootScratch) {
    use nix::mount::{MsFlags, mount};
    for (dir, path) in NODE_PATHS {
        let from = scratch.path(dir);
        std::fs::create_dir_all(&from).expect("dir");
        std::fs::create_dir_all(path)
            .unwrap_or_else(|e| panic!("create the mount point {path}: {e}"));
        mount(Some(&from), path, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .unwrap_or_else(|e| panic!("bind {} onto {path}: {e}", from.display()));
        mount(None::<&str>, path, None::<&str>, MsFlags::MS_SHARED, None::<&str>)
            .unwrap_or_else(|e| panic!("make {path} shared: {e}"));
    }
    // The manifests mount the host's modules (read-only, for modprobe); a
    // machine without any has no /lib/modules.
    std::fs::create_dir_all("/lib/modules").expect("create /lib/modules");
}

/// The containerd ID of `container` in `pod` (from `containerd://<id>`).
pub fn container_id(pod: &Pod, container: &str) -> String {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .expect("container statuses");
    let s = statuses
        .iter()
        .find(|s| s.name == container)
        .unwrap_or_else(|| panic!("no container {container}"));
    s.container_id
        .as_deref()
        .and_then(|id| id.strip_prefix("containerd://"))
        .expect("a containerd ID")
        .to_string()
}

/// A plain HTTP/1.0 GET to `addr`: (status code, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let mut conn =
        std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    conn.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("send");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).expect("read the answer");
    let code = answer.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (code, body)
}
