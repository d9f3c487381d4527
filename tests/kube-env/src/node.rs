//! Test support for the kubelet and DaemonSet tiers: containerd, kubelet,
//! kube-controller-manager and kube-scheduler as child processes, next to a
//! [`KubeEnv`], and kubectl.
//!
//! Each node is a kubelet with its own name, ports, root dir and volume
//! plugin dir, and its own containerd: a kubelet kills every running pod
//! its runtime lists that is not one of its own, so two kubelets cannot
//! share a runtime. Pods get a network from containerd's CNI (a bridge per
//! node), so nodes become Ready; the test is expected to run all of it in a
//! private network and mount namespace ([`Namespaces`]). Pods route
//! through their node's bridge, so they reach an in-cluster env's API
//! server at the `kubernetes` Service's address.
//!
//! Teardown: the processes die with the test process (parent-death signal),
//! and [`teardown`] also ends what containerd started (shims and
//! containers, which the test process inherits as a subreaper), their
//! cgroups and the mounts below the test's dir.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::{
    KubeEnv, Namespaces, arg, assets_dir, cache_dir, free_ports, kill, lock, log_tail, spawn_in,
};

/// The image `scripts/node-assets` builds: busybox, also the pod sandbox.
pub const IMAGE: &str = "volagent.test/busybox:1";

/// What a node needs besides the API server's binaries.
pub struct NodeAssets {
    pub kubelet: PathBuf,
    pub controller_manager: PathBuf,
    pub scheduler: PathBuf,
    /// kubectl, whose `apply -k` is kustomize.
    pub kubectl: PathBuf,
    /// The docker-archive of [`IMAGE`].
    pub image: PathBuf,
}

/// Finds the kubelet tier's binaries and image, or says which script makes
/// them. Fails (never skips) when they are missing.
pub fn node_assets() -> anyhow::Result<NodeAssets> {
    let dir = assets_dir()?;
    let (kubelet, controller_manager) = (dir.join("kubelet"), dir.join("kube-controller-manager"));
    let (scheduler, kubectl) = (dir.join("kube-scheduler"), dir.join("kubectl"));
    for b in [&kubelet, &controller_manager, &scheduler, &kubectl] {
        if !b.is_file() {
            bail!("{} is missing: run scripts/kube-assets (it builds it)", b.display());
        }
    }
    let images = match std::env::var_os("VOLAGENT_NODE_ASSETS").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => {
            cache_dir().context("neither VOLAGENT_NODE_ASSETS nor HOME is set")?.join("node-assets")
        }
    };
    let image = images.join("busybox.tar");
    if !image.is_file() {
        bail!(
            "{} is missing: run scripts/node-assets (it installs containerd and runc and makes the image)",
            image.display()
        );
    }
    for tool in ["containerd", "ctr", "runc"] {
        if !on_path(tool) {
            bail!("{tool} is not installed: run scripts/node-assets");
        }
    }
    Ok(NodeAssets { kubelet, controller_manager, scheduler, kubectl, image })
}

/// The agent's image archive for the DaemonSet tier: `$VOLAGENT_IMAGE`, or
/// where `scripts/build-image` writes it by default. Fails (never skips)
/// when it is missing.
pub fn agent_image() -> anyhow::Result<PathBuf> {
    let path = match std::env::var_os("VOLAGENT_IMAGE").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => cache_dir()
            .context("neither VOLAGENT_IMAGE nor HOME is set")?
            .join("image/volagent.tar"),
    };
    if !path.is_file() {
        bail!("{} is missing: run scripts/build-image (scripts/test does)", path.display());
    }
    Ok(path)
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// A child process with a log, restartable with the same command line.
struct Daemon {
    what: String,
    bin: PathBuf,
    args: Vec<std::ffi::OsString>,
    log: PathBuf,
    child: Mutex<Option<Child>>,
    namespaces: Option<Arc<Namespaces>>,
}

impl Daemon {
    fn new(
        what: &str,
        bin: &Path,
        args: Vec<std::ffi::OsString>,
        log: PathBuf,
        namespaces: Option<Arc<Namespaces>>,
    ) -> Daemon {
        Daemon {
            what: what.into(),
            bin: bin.into(),
            args,
            log,
            child: Mutex::new(None),
            namespaces,
        }
    }

    fn start(&self) -> anyhow::Result<()> {
        let mut slot = lock(&self.child);
        if slot.is_none() {
            let mut cmd = Command::new(&self.bin);
            cmd.args(&self.args).current_dir("/");
            let child = spawn_in(cmd, &self.log, true, self.namespaces.as_deref())
                .with_context(|| format!("starting {} ({})", self.what, self.bin.display()))?;
            *slot = Some(child);
        }
        Ok(())
    }

    fn stop(&self) {
        if let Some(mut child) = lock(&self.child).take() {
            kill(&mut child);
        }
    }

    fn pid(&self) -> Option<u32> {
        lock(&self.child).as_ref().map(Child::id)
    }

    /// An error naming the daemon with its log's tail if it has exited.
    fn check(&self) -> anyhow::Result<()> {
        if let Some(child) = lock(&self.child).as_mut()
            && let Some(status) = child.try_wait()?
        {
            bail!("{} exited ({status})\n{}", self.what, log_tail(&self.log));
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A containerd with its own root, state, socket and CNI bridge.
pub struct Containerd {
    daemon: Daemon,
    socket: PathBuf,
}

impl Containerd {
    /// Starts containerd with everything under `dir`, pods on the bridge
    /// `vabr<index>` with addresses from 10.244.<index>.0/24, and imports
    /// the test image.
    pub fn start(
        dir: &Path,
        index: u8,
        image: &Path,
        namespaces: Option<Arc<Namespaces>>,
    ) -> anyhow::Result<Containerd> {
        let cni = dir.join("cni");
        fs::create_dir_all(&cni).with_context(|| format!("creating {}", cni.display()))?;
        let conflist = serde_json::json!({
            "cniVersion": "0.4.0",
            "name": format!("volagent-test-{index}"),
            "plugins": [{
                "type": "bridge",
                "bridge": format!("vabr{index}"),
                "isGateway": true,
                "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": format!("10.244.{index}.0/24") }]],
                    // Through the bridge to the node, where the API server's
                    // Service address is.
                    "routes": [{ "dst": "0.0.0.0/0" }],
                    "dataDir": dir.join("ipam"),
                },
            }],
        });
        fs::write(cni.join("10-bridge.conflist"), serde_json::to_vec_pretty(&conflist)?)?;
        let socket = dir.join("containerd.sock");
        let d = |p: &str| dir.join(p).display().to_string();
        // Only what differs from containerd's defaults; plugins a test never
        // uses are off so they cannot fail the start.
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  # runc may not lower oom_score_adj here; without this sandboxes fail.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
"#,
            root = d("root"),
            state = d("state"),
            socket = socket.display(),
            cni = cni.display(),
        );
        let config_path = dir.join("config.toml");
        fs::write(&config_path, config)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let daemon = Daemon::new(
            &format!("containerd {}", dir.display()),
            Path::new("containerd"),
            vec![arg("--config=", &config_path), "--log-level=warn".into()],
            dir.join("containerd.log"),
            namespaces,
        );
        daemon.start()?;
        let c = Containerd { daemon, socket };
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.ctr(&["version"]).is_err() {
            c.daemon.check()?;
            if Instant::now() > deadline {
                bail!("containerd did not answer within 30 s\n{}", log_tail(&c.daemon.log));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        c.import(image)?;
        Ok(c)
    }

    /// Imports the image archive `image` (docker-archive or OCI) for the
    /// CRI plugin; its output names the images.
    pub fn import(&self, image: &Path) -> anyhow::Result<String> {
        self.ctr(&["images", "import", &image.display().to_string()])
            .with_context(|| format!("importing {}", image.display()))
    }

    /// `unix://<socket>`, for kubelet.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Runs `ctr` against this containerd in the `k8s.io` namespace (the
    /// CRI plugin's); its output on success.
    pub fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(&self.socket).args(["--namespace", "k8s.io"]).args(args);
        run_in(cmd, self.daemon.namespaces.as_deref(), &format!("ctr {}", args.join(" ")))
    }

    /// Kills containerd (`SIGKILL`); its shims and containers live on.
    pub fn stop(&self) {
        self.daemon.stop();
    }

    /// The machine stops: containerd, its shims and every container they
    /// run are killed (`SIGKILL`).
    pub fn crash(&self) {
        self.daemon.stop();
        // A shim names its containerd's socket on its command line.
        let needle = self.socket.as_os_str().as_encoded_bytes().to_vec();
        let shims: Vec<i32> = processes()
            .into_iter()
            .filter(|(pid, _, _)| {
                fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
            })
            .map(|(pid, _, _)| pid)
            .collect();
        kill_trees(&shims, Duration::from_secs(10));
    }
}

/// Runs `cmd` to completion in `namespaces`; its stdout, or an error with
/// its output.
pub fn run_in(cmd: Command, namespaces: Option<&Namespaces>, what: &str) -> anyhow::Result<String> {
    let out = tempfile::NamedTempFile::new().context("a temporary file for output")?;
    let mut child = spawn_in(cmd, out.path(), false, namespaces)?;
    let status = child.wait()?;
    let text = fs::read_to_string(out.path()).unwrap_or_default();
    if !status.success() {
        bail!("{what} failed ({status}): {}", text.trim());
    }
    Ok(text)
}

/// Where a kubelet keeps things and the address its Node reports.
pub struct Layout {
    pub root_dir: PathBuf,
    pub plugin_dir: PathBuf,
    /// `--node-ip`. kubelet ignores a loopback one (the Node then has no
    /// address and pods no `status.hostIP`); a real one must be an address
    /// of the kubelet's network namespace.
    pub node_ip: String,
}

impl Layout {
    /// Everything under `dir`, node IP 127.0.0.1: for many nodes in one
    /// namespace.
    pub fn under(dir: &Path) -> Layout {
        Layout {
            root_dir: dir.join("kubelet"),
            plugin_dir: dir.join("volume-plugins"),
            node_ip: "127.0.0.1".into(),
        }
    }
}

/// One node's kubelet.
pub struct Kubelet {
    pub name: String,
    daemon: Daemon,
    root_dir: PathBuf,
    plugin_dir: PathBuf,
}

impl Kubelet {
    /// Starts a kubelet named `name` with its root dir, volume plugin dir,
    /// config and logs under `dir`, on `containerd`. It registers its Node
    /// itself; wait for that with [`wait_node_ready`].
    pub fn start(
        env: &KubeEnv,
        name: &str,
        dir: &Path,
        containerd: &Containerd,
        assets: &NodeAssets,
    ) -> anyhow::Result<Kubelet> {
        Kubelet::start_with(env, name, dir, containerd, assets, Layout::under(dir))
    }

    /// Like [`Self::start`], with the root dir, plugin dir and node IP of
    /// `layout` (config, certificates and logs still under `dir`).
    pub fn start_with(
        env: &KubeEnv,
        name: &str,
        dir: &Path,
        containerd: &Containerd,
        assets: &NodeAssets,
        layout: Layout,
    ) -> anyhow::Result<Kubelet> {
        let Layout { root_dir, plugin_dir, node_ip } = layout;
        for d in [dir, &root_dir, &plugin_dir] {
            fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let ports = free_ports(2)?;
        let config = serde_json::json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": ports[0],
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": ports[1],
            "authentication": { "anonymous": { "enabled": true }, "webhook": { "enabled": false } },
            "authorization": { "mode": "AlwaysAllow" },
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": false,
            "enforceNodeAllocatable": [],
            "failSwapOn": false,
            "volumePluginDir": plugin_dir,
            // Tests must not see pods evicted or the only image collected
            // because the machine's disk is fuller than a node's would be.
            "evictionHard": { "memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%", "imagefs.available": "1%" },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "makeIPTablesUtilChains": false,
            "nodeStatusUpdateFrequency": "2s",
            "nodeStatusReportFrequency": "10s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "20s",
            "serializeImagePulls": false,
        });
        let config_path = dir.join("kubelet-config.json");
        fs::write(&config_path, serde_json::to_vec_pretty(&config)?)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let args = vec![
            arg("--config=", &config_path),
            arg("--kubeconfig=", env.kubeconfig_path()),
            "--container-runtime=remote".into(),
            format!("--container-runtime-endpoint={}", containerd.endpoint()).into(),
            arg("--root-dir=", &root_dir),
            arg("--cert-dir=", &dir.join("pki")),
            format!("--hostname-override={name}").into(),
            format!("--node-ip={node_ip}").into(),
            format!("--pod-infra-container-image={IMAGE}").into(),
            "--v=2".into(),
        ];
        let daemon = Daemon::new(
            &format!("kubelet {name}"),
            &assets.kubelet,
            args,
            dir.join("kubelet.log"),
            containerd.daemon.namespaces.clone(),
        );
        daemon.start()?;
        Ok(Kubelet { name: name.into(), daemon, root_dir, plugin_dir })
    }

    pub fn root_dir(&self) -> &Path {
        &self.root_dir
    }

    pub fn plugin_dir(&self) -> &Path {
        &self.plugin_dir
    }

    pub fn log(&self) -> &Path {
        &self.daemon.log
    }

    pub fn pid(&self) -> Option<u32> {
        self.daemon.pid()
    }

    /// Kills the kubelet (`SIGKILL`); its pods keep running.
    pub fn stop(&self) {
        self.daemon.stop();
    }

    /// An error with the log's tail if the kubelet has exited.
    pub fn check(&self) -> anyhow::Result<()> {
        self.daemon.check()
    }
}

/// The controllers volumes depend on: PV/PVC binding and protection (the
/// API server puts the protection finalizers on), attach/detach, node
/// lifecycle (NotReady after 8 s of silence) and pod GC.
const VOLUME_CONTROLLERS: &str =
    "persistentvolume-binder,pv-protection,pvc-protection,attachdetach,nodelifecycle,podgc";

/// kube-controller-manager with [`VOLUME_CONTROLLERS`] (and more, see
/// [`ControllerManager::start_for_workloads`]).
pub struct ControllerManager {
    daemon: Daemon,
}

impl ControllerManager {
    pub fn start(
        env: &KubeEnv,
        dir: &Path,
        assets: &NodeAssets,
        namespaces: Option<Arc<Namespaces>>,
    ) -> anyhow::Result<ControllerManager> {
        ControllerManager::launch(env, dir, assets, namespaces, VOLUME_CONTROLLERS, Vec::new())
    }

    /// Only `controllers` (kube-controller-manager's `--controllers`), e.g.
    /// the PV binder and PV protection for a test of PVs without kubelets.
    pub fn start_with(
        env: &KubeEnv,
        dir: &Path,
        assets: &NodeAssets,
        controllers: &str,
    ) -> anyhow::Result<ControllerManager> {
        ControllerManager::launch(env, dir, assets, None, controllers, Vec::new())
    }

    /// Also runs what workloads need — DaemonSets, Deployments and their
    /// ReplicaSets, owner-reference garbage collection, and service
    /// accounts with their token Secrets (signed with the env's key, with
    /// its CA) — for an in-cluster env ([`crate::Options::in_cluster`]).
    pub fn start_for_workloads(
        env: &KubeEnv,
        dir: &Path,
        assets: &NodeAssets,
        namespaces: Option<Arc<Namespaces>>,
    ) -> anyhow::Result<ControllerManager> {
        // endpoint: Services (an admission webhook's) reach their pods;
        // root-ca-cert-publisher: the kube-root-ca.crt ConfigMap a projected
        // service-account volume takes the cluster's CA from.
        let controllers = format!(
            "{VOLUME_CONTROLLERS},daemonset,deployment,replicaset,garbagecollector,serviceaccount,serviceaccount-token,endpoint,root-ca-cert-publisher"
        );
        let extra = vec![
            arg("--service-account-private-key-file=", env.service_account_key()),
            arg("--root-ca-file=", &env.ca_file()),
        ];
        ControllerManager::launch(env, dir, assets, namespaces, &controllers, extra)
    }

    fn launch(
        env: &KubeEnv,
        dir: &Path,
        assets: &NodeAssets,
        namespaces: Option<Arc<Namespaces>>,
        controllers: &str,
        extra: Vec<std::ffi::OsString>,
    ) -> anyhow::Result<ControllerManager> {
        let mut args = vec![
            arg("--kubeconfig=", env.kubeconfig_path()),
            format!("--controllers={controllers}").into(),
            "--leader-elect=false".into(),
            "--port=0".into(),
            "--secure-port=0".into(),
            "--use-service-account-credentials=false".into(),
            "--node-monitor-period=1s".into(),
            "--node-monitor-grace-period=8s".into(),
            "--pvclaimbinder-sync-period=2s".into(),
            "--v=2".into(),
        ];
        args.extend(extra);
        let daemon = Daemon::new(
            "kube-controller-manager",
            &assets.controller_manager,
            args,
            dir.join("kube-controller-manager.log"),
            namespaces,
        );
        daemon.start()?;
        Ok(ControllerManager { daemon })
    }

    pub fn check(&self) -> anyhow::Result<()> {
        self.daemon.check()
    }

    pub fn log(&self) -> &Path {
        &self.daemon.log
    }
}

/// kube-scheduler: places the pods of DaemonSets and Deployments.
pub struct Scheduler {
    daemon: Daemon,
}

impl Scheduler {
    pub fn start(
        env: &KubeEnv,
        dir: &Path,
        assets: &NodeAssets,
        namespaces: Option<Arc<Namespaces>>,
    ) -> anyhow::Result<Scheduler> {
        let args = vec![
            arg("--kubeconfig=", env.kubeconfig_path()),
            "--leader-elect=false".into(),
            "--port=0".into(),
            "--secure-port=0".into(),
            "--v=2".into(),
            // Places claims of local classes by the capacity published.
            "--feature-gates=CSIStorageCapacity=true".into(),
        ];
        let daemon = Daemon::new(
            "kube-scheduler",
            &assets.scheduler,
            args,
            dir.join("kube-scheduler.log"),
            namespaces,
        );
        daemon.start()?;
        Ok(Scheduler { daemon })
    }

    pub fn check(&self) -> anyhow::Result<()> {
        self.daemon.check()
    }

    pub fn log(&self) -> &Path {
        &self.daemon.log
    }
}

/// Runs kubectl as the env's admin, in `namespaces`; its stdout.
pub fn kubectl(
    env: &KubeEnv,
    assets: &NodeAssets,
    namespaces: Option<&Namespaces>,
    args: &[&str],
) -> anyhow::Result<String> {
    let mut cmd = Command::new(&assets.kubectl);
    cmd.arg(arg("--kubeconfig=", env.kubeconfig_path())).args(args);
    run_in(cmd, namespaces, &format!("kubectl {}", args.join(" ")))
}

/// Makes the test process inherit the processes its children leave behind
/// (containerd's shims and containers), so [`kill_descendants`] finds them.
pub fn become_subreaper() -> anyhow::Result<()> {
    nix::sys::prctl::set_child_subreaper(true).context("PR_SET_CHILD_SUBREAPER")
}

/// Kills every process descended from this one (`SIGKILL`) and reaps them,
/// until none is left or `within` has passed; the names of those killed.
pub fn kill_descendants(within: Duration) -> Vec<String> {
    kill_trees(&[], within)
}

/// Ends a box from [`enter_node_namespaces`] (call on its thread): kills
/// every process it left, removes the cgroups of containers that were
/// killed rather than deleted (runc's state under the namespace's
/// `/run/containerd` names them), and detaches every mount below `dir`.
pub fn teardown(dir: &Path) {
    kill_descendants(Duration::from_secs(20));
    remove_container_cgroups();
    unmount_below(dir);
}

/// Removes `/sys/fs/cgroup/<hierarchy>/k8s.io/<id>` of each container runc
/// still has state for; they are empty once their processes are reaped.
fn remove_container_cgroups() {
    let Ok(ids) = fs::read_dir("/run/containerd/runc/k8s.io") else { return };
    let ids: Vec<std::ffi::OsString> = ids.flatten().map(|e| e.file_name()).collect();
    let Ok(hierarchies) = fs::read_dir("/sys/fs/cgroup") else { return };
    for h in hierarchies.flatten() {
        for id in &ids {
            let _ = fs::remove_dir(h.path().join("k8s.io").join(id));
        }
    }
}

/// Kills `roots` and their descendants, or with no roots every descendant
/// of this process, and reaps those that are (or become) its children.
fn kill_trees(roots: &[i32], within: Duration) -> Vec<String> {
    use nix::sys::signal::{Signal, kill as signal};
    use nix::sys::wait::{WaitPidFlag, waitpid};
    use nix::unistd::Pid;
    let me = std::process::id() as i32;
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let table = processes();
        let mut mine = Vec::new();
        for (pid, ppid, comm) in &table {
            if roots.contains(pid) {
                mine.push((*pid, *ppid, comm.clone()));
            }
        }
        let mut frontier = if roots.is_empty() { vec![me] } else { roots.to_vec() };
        while let Some(parent) = frontier.pop() {
            for (pid, ppid, comm) in &table {
                if *ppid == parent {
                    mine.push((*pid, *ppid, comm.clone()));
                    frontier.push(*pid);
                }
            }
        }
        if mine.is_empty() || Instant::now() > deadline {
            return seen;
        }
        for (pid, ppid, comm) in &mine {
            if !seen.contains(comm) {
                seen.push(comm.clone());
            }
            let _ = signal(Pid::from_raw(*pid), Signal::SIGKILL);
            if *ppid == me {
                let _ = waitpid(Pid::from_raw(*pid), Some(WaitPidFlag::WNOHANG));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// (pid, parent pid, command name) of every process.
fn processes() -> Vec<(i32, i32, String)> {
    let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The name is in parentheses and may hold anything; fields follow the last ')'.
            let (head, rest) = stat.rsplit_once(')')?;
            let comm = head.split_once('(')?.1.to_string();
            let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid, comm))
        })
        .collect()
}

/// Waits until Node `name` exists and is Ready.
pub async fn wait_node_ready(
    client: &kube::Client,
    name: &str,
    within: Duration,
    kubelet: &Kubelet,
) -> anyhow::Result<()> {
    let api: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let deadline = Instant::now() + within;
    loop {
        kubelet.check()?;
        if let Ok(Some(node)) = api.get_opt(name).await {
            let ready = node
                .status
                .and_then(|s| s.conditions)
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if ready {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("node {name} not Ready after {within:?}\n{}", log_tail(kubelet.log()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Moves the calling thread into a new mount and network namespace fit for
/// nodes: `/` private (nothing reaches the host), loopback up, and tmpfs on
/// kubelet's fixed log dirs (`/var/log/pods`, `/var/log/containers`) and on
/// `/run/containerd`.
/// Children join them through the returned handles. Needs root.
pub fn enter_node_namespaces() -> anyhow::Result<Arc<Namespaces>> {
    use nix::mount::{MsFlags, mount};
    use nix::sched::{CloneFlags, unshare};
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWNET)
        .context("unshare a mount and network namespace (root needed)")?;
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .context("making / private")?;
    // Forked from this thread, so in its network namespace.
    let status = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .context("running ip (iproute2)")?;
    if !status.success() {
        bail!("ip link set lo up: {status}");
    }
    // containerd's shims put their sockets, and runc its state, under
    // /run/containerd whatever the config says: kept in the namespace, what
    // a killed shim leaves there goes with it.
    for d in ["/var/log/pods", "/var/log/containers", "/run/containerd"] {
        fs::create_dir_all(d).with_context(|| format!("creating {d}"))?;
        mount(Some("tmpfs"), d, Some("tmpfs"), MsFlags::empty(), Some("mode=0755"))
            .with_context(|| format!("tmpfs on {d}"))?;
    }
    Ok(Arc::new(Namespaces::of_current_thread()?))
}

/// Detaches every mount below `dir` in the calling thread's mount
/// namespace (containerd's snapshots and network namespaces, kubelet's
/// binds), deepest first, so the dir can be removed.
pub fn unmount_below(dir: &Path) {
    let Ok(table) = fs::read_to_string("/proc/thread-self/mountinfo") else { return };
    // Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
    let mut points: Vec<PathBuf> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| {
            PathBuf::from(
                p.replace("\\040", " ")
                    .replace("\\011", "\t")
                    .replace("\\012", "\n")
                    .replace("\\134", "\\"),
            )
        })
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in points {
        let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
    }
}
