//! A cluster in a box for the kubelet tier: a real etcd + kube-apiserver,
//! kube-controller-manager, the volagent controller, and per node a
//! containerd, a kubelet and a volagent agent (host processes), all in the
//! test's private mount and network namespaces. volagent runs as it ships
//! ([`crate::shipped`]): `deploy/`'s RBAC and admission webhook, the
//! controller as its ServiceAccount, each agent on a token bound to a pod
//! of the agents' ServiceAccount that kubelet runs on its node. Pods are seen the way their owners see them: phase,
//! container state and output (the termination message), and Events.
//!
//! Teardown, also after a failed assertion: agents, kubelets, containerds
//! and the control plane are killed, then everything they left running
//! (shims, containers), then the scratch dir's mounts and loop devices go.

use crate::agent::{AgentBuilder, kill};
use crate::scratch::RootScratch;
use crate::shipped;
use crate::wait::{Deadline, wait_until, wait_until_or};
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;
use volagent::kube::crds::Attachment;
use volagent_kube_env::node::{self, Containerd, ControllerManager, Kubelet, NodeAssets};
use volagent_kube_env::{KubeEnv, Namespaces};

/// How long a pod may take to reach what a test waits for: kubelet retries
/// a failed mount with a backoff that doubles up to two minutes.
pub const POD_WAIT: Duration = Duration::from_secs(150);

/// One node: its containerd, kubelet and agent.
pub struct NodeBox {
    pub name: String,
    pub dir: PathBuf,
    pub containerd: Option<Containerd>,
    pub kubelet: Option<Kubelet>,
    pub agent: Option<Child>,
    pub agent_args: Vec<String>,
}

impl NodeBox {
    pub fn kubelet(&self) -> &Kubelet {
        self.kubelet.as_ref().expect("the node's kubelet")
    }
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet")
    }
    pub fn plugin_dir(&self) -> PathBuf {
        self.dir.join("plugins")
    }
    pub fn socket(&self) -> PathBuf {
        self.dir.join("run/agent.sock")
    }
    pub fn agent_log(&self) -> PathBuf {
        self.dir.join("agent.log")
    }
}

pub struct Cluster {
    /// The agent's (and controller's) binary.
    pub bin: PathBuf,
    pub nodes: Vec<NodeBox>,
    pub kcm: Option<ControllerManager>,
    pub env: Option<KubeEnv>,
    pub rt: tokio::runtime::Runtime,
    pub ns: Arc<Namespaces>,
    pub assets: NodeAssets,
    pub scratch: RootScratch,
    /// The volagent controller (and its admission webhook, on loopback).
    pub controller: Option<Child>,
    pub webhook_port: u16,
    /// Arguments the controller starts with besides the usual ones.
    pub controller_args: Vec<String>,
}

/// Node names and the extra agent arguments of each.
pub type NodeSpec<'a> = (&'a str, &'a [&'a str]);

impl Cluster {
    /// Starts the control plane and `nodes`, each agent serving the
    /// backends in `backends` (file, name), and waits until every node is
    /// Ready and every agent answers; agents and the controller run from
    /// `bin`.
    pub fn start(bin: &str, nodes: &[NodeSpec], backends: &[(&str, &str)]) -> Cluster {
        Cluster::start_with(bin, nodes, backends, &[])
    }

    /// [`Self::start`], the controller started with `controller_args` too.
    pub fn start_with(
        bin: &str,
        nodes: &[NodeSpec],
        backends: &[(&str, &str)],
        controller_args: &[&str],
    ) -> Cluster {
        let scratch = RootScratch::enter();
        let assets = node::node_assets()
            .expect("the kubelet tier's assets (scripts/kube-assets, scripts/node-assets)");
        node::become_subreaper().expect("subreaper");
        let ns = node::enter_node_namespaces().expect("private namespaces for the nodes");
        let rt =
            tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let env = rt
            .block_on(KubeEnv::start_in(Some(ns.clone())))
            .expect("a real kube-apiserver (scripts/kube-assets)");
        let kcm = ControllerManager::start(&env, &scratch.path(""), &assets, Some(ns.clone()))
            .expect("kube-controller-manager");
        std::fs::create_dir_all(scratch.path("disks")).expect("dir");
        let webhook_port = volagent_kube_env::free_ports(1).expect("a free port")[0];
        let mut c = Cluster {
            bin: bin.into(),
            nodes: Vec::new(),
            kcm: Some(kcm),
            env: Some(env),
            rt,
            ns,
            assets,
            scratch,
            controller: None,
            webhook_port,
            controller_args: controller_args.iter().map(|a| a.to_string()).collect(),
        };
        let client = c.client();
        c.rt.block_on(shipped::install(&client, &shipped::webhook_url(webhook_port)))
            .expect("deploy/'s RBAC and webhook");
        c.start_controller();
        for (i, (name, extra)) in nodes.iter().enumerate() {
            let dir = c.scratch.path(name);
            std::fs::create_dir_all(dir.join("plugins")).expect("dir");
            for (file, backend) in backends {
                std::fs::copy(file, dir.join(format!("plugins/{backend}.wasm"))).expect("plugin");
            }
            let containerd = Containerd::start(
                &dir.join("containerd"),
                i as u8 + 1,
                &c.assets.image,
                Some(c.ns.clone()),
            )
            .expect("containerd");
            let kubelet =
                Kubelet::start(c.env(), name, &dir, &containerd, &c.assets).expect("kubelet");
            c.nodes.push(NodeBox {
                name: name.to_string(),
                dir,
                containerd: Some(containerd),
                kubelet: Some(kubelet),
                agent: None,
                agent_args: extra.iter().map(|s| s.to_string()).collect(),
            });
            c.start_agent(name, &[]);
        }
        for n in &c.nodes {
            c.rt.block_on(node::wait_node_ready(
                &client,
                &n.name,
                Duration::from_secs(90),
                n.kubelet(),
            ))
            .expect("node Ready");
        }
        c
    }

    pub fn env(&self) -> &KubeEnv {
        self.env.as_ref().expect("the API server")
    }

    /// An admin client (made inside the runtime, which its I/O needs).
    pub fn client(&self) -> kube::Client {
        let _in_runtime = self.rt.enter();
        self.env().client()
    }

    pub fn node(&self, name: &str) -> &NodeBox {
        self.nodes.iter().find(|n| n.name == name).unwrap_or_else(|| panic!("no node {name}"))
    }

    fn node_mut(&mut self, name: &str) -> &mut NodeBox {
        self.nodes.iter_mut().find(|n| n.name == name).unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Restarts the controller with the nodes' policies loaded (node-a's
    /// plugin dir): the provisioning controller.
    pub fn start_provisioning_controller(&mut self) {
        if let Some(mut old) = self.controller.take() {
            let _ = old.kill();
            let _ = old.wait();
        }
        let plugins = self.node("node-a").plugin_dir().display().to_string();
        self.controller_args = vec!["--plugin-dir".into(), plugins];
        self.start_controller();
    }

    /// Starts the volagent controller as its ServiceAccount, in the box's
    /// namespaces (the API server calls its webhook there), and waits until
    /// its webhook answers.
    pub fn start_controller(&mut self) {
        let kubeconfig = self.scratch.path("controller.kubeconfig");
        {
            let _in_runtime = self.rt.enter();
            self.rt
                .block_on(shipped::controller_kubeconfig(self.env(), &kubeconfig))
                .expect("the controller's kubeconfig");
        }
        let mut cmd = Command::new(&self.bin);
        cmd.args(shipped::controller_args(&kubeconfig, self.webhook_port))
            .args(["--local-interval", "2s"])
            .args(&self.controller_args);
        let child = volagent_kube_env::spawn_in(
            cmd,
            &self.scratch.path("controller.log"),
            true,
            Some(&self.ns),
        )
        .expect("start the controller");
        self.controller = Some(child);
        let probe = {
            let _in_runtime = self.rt.enter();
            self.rt
                .block_on(shipped::agent_client(
                    self.env(),
                    "volagent-webhook-probe",
                    node::IMAGE,
                    &self.scratch.path(""),
                ))
                .expect("a probe agent's client")
        };
        self.rt
            .block_on(shipped::wait_webhook(&probe, "volagent-webhook-probe"))
            .unwrap_or_else(|e| panic!("{e}\n{}", tail(&self.scratch.path("controller.log"))));
    }

    /// Starts `node`'s agent (its extra arguments, then `env`) and waits
    /// until its socket answers.
    pub fn start_agent(&mut self, name: &str, env: &[(&str, &str)]) {
        let kubeconfig = self.scratch.path(&format!("{name}.kubeconfig"));
        {
            let _in_runtime = self.rt.enter();
            self.rt
                .block_on(shipped::agent_kubeconfig(self.env(), name, node::IMAGE, &kubeconfig))
                .expect("the agent's kubeconfig");
        }
        let (disks, ns, bin) = (self.scratch.path("disks"), self.ns.clone(), self.bin.clone());
        let n = self.node_mut(name);
        let agent = env
            .iter()
            .fold(AgentBuilder::new(bin, name), |a, (k, v)| a.env(k, v))
            .json_log()
            .under(&n.dir)
            .kubeconfig(kubeconfig)
            .discovery_dir(disks)
            .volume_plugin_dir(n.dir.join("volume-plugins"))
            .args(&n.agent_args)
            .log(n.agent_log());
        let child = volagent_kube_env::spawn_in(agent.command(), &n.agent_log(), true, Some(&ns))
            .expect("start the agent");
        n.agent = Some(child);
        agent.wait_ready();
    }

    /// The agent arguments `name`'s agent starts with from now on.
    pub fn set_agent_args(&mut self, name: &str, args: &[&str]) {
        self.node_mut(name).agent_args = args.iter().map(|s| s.to_string()).collect();
    }

    /// Kills `node`'s agent with SIGKILL.
    pub fn kill_agent(&mut self, name: &str) {
        if let Some(mut child) = self.node_mut(name).agent.take() {
            kill(&mut child);
        }
    }

    /// Waits until the agent of `name` has exited by itself.
    pub fn wait_agent_exit(&mut self, name: &str, within: Duration) {
        let deadline = Deadline::within(within).polling(Duration::from_millis(50));
        wait_until(deadline, &format!("the agent of {name} to exit"), || {
            let n = self.node_mut(name);
            let child = n.agent.as_mut().expect("the agent was started");
            let exited = child.try_wait().expect("agent status").is_some();
            if exited {
                n.agent = None;
            }
            exited
        });
    }

    /// The node's machine stops: kubelet, agent, containerd and every
    /// container of it are killed. Its mounts stay (the test decides).
    pub fn crash_node(&mut self, name: &str) {
        self.kill_agent(name);
        let n = self.node_mut(name);
        if let Some(k) = n.kubelet.take() {
            k.stop();
        }
        if let Some(c) = n.containerd.take() {
            c.crash();
        }
    }

    // --- the API -----------------------------------------------------------

    pub fn create_pod(&self, pod: Value) -> String {
        let pod: Pod = serde_json::from_value(pod).expect("a pod");
        let api: Api<Pod> = Api::namespaced(self.client(), "default");
        let created =
            self.rt.block_on(api.create(&PostParams::default(), &pod)).expect("create pod");
        created.metadata.uid.expect("a UID")
    }

    pub fn pod(&self, name: &str) -> Option<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client(), "default");
        self.rt.block_on(api.get_opt(name)).expect("read pod")
    }

    /// Deletes a pod and waits until kubelet has torn it down and it is
    /// gone from the API (kubelet removes it once its volumes are unmounted).
    pub fn delete_pod(&self, name: &str) {
        let api: Api<Pod> = Api::namespaced(self.client(), "default");
        let _ = self.rt.block_on(api.delete(name, &DeleteParams::default()));
        self.wait_pod(name, "gone", |p| p.is_none());
    }

    /// Polls pod `name` until `done` holds; on timeout fails with what the
    /// pod, its Events, the kubelets and the agents said.
    pub fn wait_pod(
        &self,
        name: &str,
        what: &str,
        mut done: impl FnMut(Option<&Pod>) -> bool,
    ) -> Option<Pod> {
        wait_until_or(
            Deadline::within(POD_WAIT).polling(Duration::from_millis(250)),
            &format!("pod {name} to be {what}"),
            || {
                let pod = self.pod(name);
                done(pod.as_ref()).then_some(pod)
            },
            || self.diagnose(name, self.pod(name).as_ref()),
        )
    }

    /// What the pod, its Events and the nodes' logs say, for a failure.
    pub fn diagnose(&self, name: &str, pod: Option<&Pod>) -> String {
        let mut out = format!(
            "status: {}\nevents:\n",
            pod.and_then(|p| p.status.as_ref())
                .map(|s| serde_json::to_string_pretty(s).unwrap_or_default())
                .unwrap_or_else(|| "(no pod)".into())
        );
        for (reason, message) in self.events_of(name) {
            out += &format!("  {reason}: {message}\n");
        }
        for n in &self.nodes {
            if let Some(k) = &n.kubelet {
                out += &tail_matching(k.log(), name, 15);
            }
            out += &tail(&n.agent_log());
        }
        out
    }

    /// (reason, message) of every Event about pod `name`.
    pub fn events_of(&self, name: &str) -> Vec<(String, String)> {
        events_about(&self.rt, &self.client(), "default", name)
    }

    /// Waits for an Event about pod `name` with `reason` whose message has
    /// every one of `words`; its message.
    pub fn wait_event(&self, name: &str, reason: &str, words: &[&str]) -> String {
        wait_until_or(
            Deadline::within(POD_WAIT).polling(Duration::from_millis(250)),
            &format!("a {reason} Event about {name} saying {words:?}"),
            || {
                self.events_of(name)
                    .into_iter()
                    .find(|(r, m)| r == reason && words.iter().all(|w| m.contains(w)))
                    .map(|(_, m)| m)
            },
            || self.diagnose(name, self.pod(name).as_ref()),
        )
    }

    /// The Attachment record of `volume`, if any.
    pub fn record(&self, volume: &str) -> Option<Attachment> {
        let api: Api<Attachment> = Api::all(self.client());
        self.rt.block_on(api.get_opt(volume)).expect("read the record")
    }

    pub fn records(&self) -> Vec<Attachment> {
        let api: Api<Attachment> = Api::all(self.client());
        self.rt.block_on(api.list(&Default::default())).expect("list records").items
    }

    /// A PV of driver `volagent/<backend>` and a claim for it (named
    /// `<pv>-claim`) that kube-controller-manager binds.
    pub fn create_volume(&self, pv: &str, backend: &str, mode: &str, options: &[(&str, &str)]) {
        create_volume(
            &self.rt,
            &self.client(),
            pv,
            backend,
            mode,
            options,
            self.kcm.as_ref().expect("kcm").log(),
        );
    }

    /// A CSI PV of `driver` (handle: its name) and a bound claim `<pv>-claim`.
    pub fn create_csi_volume(
        &self,
        pv: &str,
        driver: &str,
        mode: &str,
        attributes: &[(&str, &str)],
    ) {
        create_csi_volume(
            &self.rt,
            &self.client(),
            pv,
            driver,
            mode,
            attributes,
            self.kcm.as_ref().expect("kcm").log(),
        );
    }

    /// A CSI PV of `driver` in `volumeMode: Block`, and its claim, bound.
    pub fn create_csi_block_volume(
        &self,
        pv: &str,
        driver: &str,
        mode: &str,
        attributes: &[(&str, &str)],
    ) {
        let attrs: serde_json::Map<String, Value> =
            attributes.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect();
        let source = json!({ "csi": { "driver": driver, "volumeHandle": pv, "volumeAttributes": attrs }, "volumeMode": "Block" });
        create_pv_and_claim(
            &self.rt,
            &self.client(),
            pv,
            mode,
            source,
            self.kcm.as_ref().expect("kcm").log(),
        );
    }

    /// A CSI PV of `driver` whose `mountOptions` are `options`, and its claim.
    pub fn create_csi_volume_with_options(
        &self,
        pv: &str,
        driver: &str,
        mode: &str,
        attributes: &[(&str, &str)],
        options: &[&str],
    ) {
        let attrs: serde_json::Map<String, Value> =
            attributes.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect();
        let source = json!({ "csi": { "driver": driver, "volumeHandle": pv, "fsType": "ext4", "volumeAttributes": attrs }, "mountOptions": options });
        create_pv_and_claim(
            &self.rt,
            &self.client(),
            pv,
            mode,
            source,
            self.kcm.as_ref().expect("kcm").log(),
        );
    }

    /// A sparse image file of `mib` MiB in the discovery dir; its path.
    pub fn image(&self, name: &str, mib: u64) -> String {
        self.scratch.image(&format!("disks/{name}"), mib).display().to_string()
    }

    /// Mounts whose mount point is below `dir`.
    pub fn mounts_below(&self, dir: &Path) -> Vec<PathBuf> {
        self.scratch.mounts().into_iter().filter(|m| m.starts_with(dir)).collect()
    }

    /// Runs `volagent status` against `node`'s agent; its stdout.
    pub fn status(&self, node: &str, json: bool) -> String {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("status").arg("--socket").arg(self.node(node).socket());
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("run volagent status");
        assert!(out.status.success(), "volagent status: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// Copies every log of the box to `$TMPDIR/volagent-kubelet-tier/<test>/`
    /// (the scratch dir goes away), and says where.
    fn keep_logs(&self) {
        let test = std::thread::current().name().unwrap_or("test").replace("::", "-");
        let dest = std::env::temp_dir().join("volagent-kubelet-tier").join(test);
        let _ = std::fs::create_dir_all(&dest);
        let mut logs: Vec<PathBuf> = vec![
            self.scratch.path("kube-controller-manager.log"),
            self.scratch.path("controller.log"),
        ];
        if let Some(env) = &self.env {
            logs.push(env.dir().join("kube-apiserver.log"));
        }
        for n in &self.nodes {
            for f in ["kubelet.log", "agent.log", "containerd/containerd.log"] {
                logs.push(n.dir.join(f));
            }
        }
        for log in logs {
            let name = log
                .strip_prefix(self.scratch.path(""))
                .unwrap_or(&log)
                .to_string_lossy()
                .replace('/', "-");
            let _ = std::fs::copy(&log, dest.join(name.trim_start_matches('-')));
        }
        eprintln!("kubelet tier: logs kept in {}", dest.display());
    }

    /// The agent's JSON log lines of `node` that are operation lines.
    pub fn operation_lines(&self, node: &str) -> Vec<Value> {
        std::fs::read_to_string(self.node(node).agent_log())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["op"].is_string() && v["outcome"].is_string())
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.keep_logs();
        }
        if let Some(mut c) = self.controller.take() {
            kill(&mut c);
        }
        for n in &mut self.nodes {
            if let Some(mut a) = n.agent.take() {
                kill(&mut a);
            }
            if let Some(k) = n.kubelet.take() {
                k.stop();
            }
            if let Some(c) = n.containerd.take() {
                c.stop();
            }
        }
        self.kcm = None;
        self.env = None;
        // Shims and containers (this process inherited them) and their
        // cgroups, then the scratch dir's mounts and loop devices (also
        // RootScratch's drop).
        node::teardown(&self.scratch.path(""));
    }
}

/// A pod on `node` running `script` in busybox, with `volumes` (name →
/// Kubernetes volume source) mounted at /data/<name> ... see [`pod_with`].
pub fn pod(name: &str, node: &str, script: &str, volumes: &[(&str, Value)]) -> Value {
    pod_with(name, node, script, volumes, None, "Never")
}

/// A pod whose container runs `script` (its output is what it writes to
/// /dev/termination-log), with each volume at `/data` (one volume) or
/// `/data/<name>`; `ready` is an exec readiness probe. It tolerates every
/// taint, so nothing but the test removes it.
pub fn pod_with(
    name: &str,
    node: &str,
    script: &str,
    volumes: &[(&str, Value)],
    ready: Option<&str>,
    restart: &str,
) -> Value {
    let mounts: Vec<Value> = volumes
        .iter()
        .map(|(v, _)| json!({ "name": v, "mountPath": if volumes.len() == 1 { "/data".to_string() } else { format!("/data/{v}") } }))
        .collect();
    let vols: Vec<Value> = volumes
        .iter()
        .map(|(v, src)| {
            let mut o = src.clone();
            o["name"] = Value::from(*v);
            o
        })
        .collect();
    let mut container = json!({
        "name": "c",
        "image": volagent_kube_env::node::IMAGE,
        "command": ["sh", "-c", script],
        "volumeMounts": mounts,
    });
    if let Some(probe) = ready {
        container["readinessProbe"] = json!({ "exec": { "command": ["sh", "-c", probe] }, "periodSeconds": 1, "failureThreshold": 1 });
    }
    json!({
        "metadata": { "name": name },
        "spec": {
            "nodeName": node,
            "restartPolicy": restart,
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 2,
            "tolerations": [{ "operator": "Exists" }],
            "containers": [container],
            "volumes": vols,
        }
    })
}

/// A pod whose container runs `script` with the claim of block PV `pv` as
/// the device `/dev/xvda`.
pub fn block_pod(name: &str, node: &str, script: &str, pv: &str) -> Value {
    let mut p = pod(name, node, script, &[]);
    p["spec"]["containers"][0]["volumeDevices"] =
        json!([{ "name": "blk", "devicePath": "/dev/xvda" }]);
    p["spec"]["volumes"] =
        json!([{ "name": "blk", "persistentVolumeClaim": { "claimName": format!("{pv}-claim") } }]);
    p
}

/// A volume source: the claim of PV `pv` (see [`Cluster::create_volume`]).
pub fn claim(pv: &str) -> Value {
    json!({ "persistentVolumeClaim": { "claimName": format!("{pv}-claim") } })
}

/// A pod-authored (inline) Flexvolume volume source.
pub fn inline(backend: &str, options: &[(&str, &str)]) -> Value {
    let opts: serde_json::Map<String, Value> =
        options.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect();
    json!({ "flexVolume": { "driver": format!("volagent/{backend}"), "fsType": "ext4", "options": opts } })
}

/// A long-running container script: `setup`, then sleep until told to stop.
pub fn serve(setup: &str) -> String {
    format!("trap 'exit 0' TERM; {setup}; while true; do sleep 1; done")
}

pub fn phase(p: Option<&Pod>) -> String {
    p.and_then(|p| p.status.as_ref()).and_then(|s| s.phase.clone()).unwrap_or_default()
}

pub fn is_ready(p: Option<&Pod>) -> bool {
    p.and_then(|p| p.status.as_ref())
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The reason the container waits (e.g. ContainerCreating), if it does.
pub fn waiting_reason(p: Option<&Pod>) -> Option<String> {
    p?.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .waiting
        .as_ref()?
        .reason
        .clone()
}

/// The container's output (its termination message) once it has exited.
pub fn output(p: Option<&Pod>) -> Option<String> {
    let t = p?
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .terminated
        .clone()?;
    Some(t.message.unwrap_or_default())
}

pub fn restarts(p: Option<&Pod>) -> i32 {
    p.and_then(|p| p.status.as_ref())
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map_or(0, |c| c.restart_count)
}

pub fn tail(log: &Path) -> String {
    volagent_kube_env::log_tail(log)
}

/// The last `n` lines of `log` that mention `what`.
pub fn tail_matching(log: &Path, what: &str, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(what)).collect();
    format!(
        "--- {} lines of {} about {what} ---\n{}\n",
        lines.len().min(n),
        log.display(),
        lines[lines.len().saturating_sub(n)..].join("\n")
    )
}

/// (reason, message) of every Event about object `name` in `namespace`.
pub fn events_about(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Vec<(String, String)> {
    let api: Api<Event> = Api::namespaced(client.clone(), namespace);
    let list = rt.block_on(api.list(&Default::default())).expect("list events");
    list.items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect()
}

/// A PV of driver `volagent/<backend>` and a claim for it in `default`
/// (named `<pv>-claim`), and waits until kube-controller-manager (its log:
/// `kcm_log`) has bound them.
pub fn create_volume(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    pv: &str,
    backend: &str,
    mode: &str,
    options: &[(&str, &str)],
    kcm_log: &Path,
) {
    let opts: serde_json::Map<String, Value> =
        options.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect();
    let source = json!({ "flexVolume": { "driver": format!("volagent/{backend}"), "fsType": "ext4", "options": opts } });
    create_pv_and_claim(rt, client, pv, mode, source, kcm_log);
}

/// A CSI PV of `driver` (volume handle: the PV's name) and its bound claim.
pub fn create_csi_volume(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    pv: &str,
    driver: &str,
    mode: &str,
    attributes: &[(&str, &str)],
    kcm_log: &Path,
) {
    let attrs: serde_json::Map<String, Value> =
        attributes.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect();
    let source = json!({ "csi": { "driver": driver, "volumeHandle": pv, "fsType": "ext4", "volumeAttributes": attrs } });
    create_pv_and_claim(rt, client, pv, mode, source, kcm_log);
}

/// A PV with `source` (an object of one volume source) and a claim for it
/// (`<pv>-claim`), waited for until kube-controller-manager binds them.
fn create_pv_and_claim(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    pv: &str,
    mode: &str,
    source: Value,
    kcm_log: &Path,
) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    let mut spec = json!({
        "capacity": { "storage": "64Mi" },
        "accessModes": [mode],
        "storageClassName": "",
    });
    for (k, v) in source.as_object().expect("a volume source") {
        spec[k] = v.clone();
    }
    let volume: PersistentVolume =
        serde_json::from_value(json!({ "metadata": { "name": pv }, "spec": spec })).expect("a PV");
    let mut claim_spec = json!({
        "accessModes": [mode],
        "storageClassName": "",
        "volumeName": pv,
        "resources": { "requests": { "storage": "64Mi" } },
    });
    // A block PV binds only a block claim.
    if let Some(m) = spec.get("volumeMode") {
        claim_spec["volumeMode"] = m.clone();
    }
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": { "name": format!("{pv}-claim") },
        "spec": claim_spec,
    }))
    .expect("a PVC");
    rt.block_on(
        Api::<PersistentVolume>::all(client.clone()).create(&PostParams::default(), &volume),
    )
    .expect("create PV");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    rt.block_on(claims.create(&PostParams::default(), &claim)).expect("create PVC");
    // The PV controller binds them.
    wait_until_or(
        Deadline::within(Duration::from_secs(60)).polling(Duration::from_millis(200)),
        &format!("the claim of {pv} to be Bound"),
        || {
            let c = rt.block_on(claims.get(&format!("{pv}-claim"))).expect("read PVC");
            c.status.and_then(|s| s.phase).as_deref() == Some("Bound")
        },
        || tail(kcm_log),
    );
}
