//! Agents of several simulated nodes against a real etcd + kube-apiserver
//! (both "nodes" are this machine, each agent with its own kubelet root,
//! runtime and state dirs), and the controller when a test starts it. The
//! API-server tier's tests add what their backend needs in `impl Cluster`
//! blocks of their own.
#![allow(dead_code)]

use crate::common::RootScratch;
use kube::api::Api;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use volagent::kube::crds::Attachment;
use volagent_kube_env::KubeEnv;

pub struct Cluster {
    // Dropped in this order: agents, then the API server, then the scratch
    // dir (unmounting and detaching what is left).
    pub agents: Vec<(String, Child)>,
    pub env: KubeEnv,
    pub rt: tokio::runtime::Runtime,
    pub scratch: RootScratch,
    /// Pods made so far, by name: their UIDs.
    pods: std::sync::Mutex<std::collections::BTreeMap<String, String>>,
    /// The kubeconfig agents started from now on use, when not the API
    /// server's own (e.g. one that reaches it through a proxy).
    pub agent_kubeconfig: Option<std::path::PathBuf>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, mut c) in self.agents.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Cluster {
    /// The API server with the CRDs, `nodes` Ready, and an agent on each
    /// serving the guests `plugins` (file, backend name).
    pub fn start(nodes: &[&str], plugins: &[(&str, &str)]) -> Cluster {
        // The mount namespace is per thread: unshare on the test thread, and
        // run the async parts on it too (a current-thread runtime).
        let scratch = RootScratch::enter();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let env = rt.block_on(KubeEnv::start()).expect("a real kube-apiserver (scripts/kube-assets)");
        let client = {
            let _in_runtime = rt.enter();
            env.client()
        };
        rt.block_on(crate::kube_common::install_crds(&client));
        for n in nodes {
            rt.block_on(crate::kube_common::create_node(&client, n, true));
        }
        std::fs::create_dir_all(scratch.path("plugins")).expect("dir");
        std::fs::create_dir_all(scratch.path("disks")).expect("dir");
        for (file, name) in plugins {
            std::fs::copy(file, scratch.path(&format!("plugins/{name}.wasm"))).expect("plugin");
        }
        let mut c = Cluster { agents: Vec::new(), env, rt, scratch, pods: Default::default(), agent_kubeconfig: None };
        for n in nodes {
            c.spawn_agent(n);
        }
        c
    }

    /// An admin client (made inside the runtime, which its I/O needs).
    pub fn client(&self) -> kube::Client {
        let _in_runtime = self.rt.enter();
        self.env.client()
    }

    pub fn spawn_agent(&mut self, node: &str) {
        self.spawn_agent_with(node, &[]);
    }

    /// Start `node`'s agent with `extra` arguments; its log is `<node>.log`
    /// in the scratch dir.
    pub fn spawn_agent_with(&mut self, node: &str, extra: &[&str]) {
        self.spawn_agent_env(node, extra, &[]);
    }

    /// [`spawn_agent_with`](Self::spawn_agent_with) with `env` set (test hooks).
    pub fn spawn_agent_env(&mut self, node: &str, extra: &[&str], env: &[(&str, &str)]) {
        let at = |p: &str| self.scratch.path(&format!("{node}/{p}"));
        let socket = at("run/agent.sock");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.scratch.path(&format!("{node}.log"))).expect("agent log");
        let child = Command::new(env!("CARGO_BIN_EXE_volagent"))
            .args(["agent", "--node-name", node])
            .arg("--kubeconfig").arg(self.agent_kubeconfig.as_deref().unwrap_or(self.env.kubeconfig_path()))
            .arg("--runtime-dir").arg(at("run"))
            .arg("--state-dir").arg(at("state"))
            .arg("--plugin-dir").arg(self.scratch.path("plugins"))
            .arg("--kubelet-root").arg(at("kubelet"))
            .arg("--discovery-dir").arg(self.scratch.path("disks"))
            .arg("--volume-plugin-dir").arg(at("vpd"))
            .arg("--flex-driver").arg(volagent_test_artifacts::FLEX_DRIVER)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the agent");
        self.agents.push((node.to_string(), child));
        let start = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(start.elapsed() < Duration::from_secs(60), "the agent of {node} did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill_agent(&mut self, node: &str) {
        if let Some(i) = self.agents.iter().position(|(n, _)| n == node) {
            let (_, mut c) = self.agents.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The controller, leading once the Lease names it.
    pub fn spawn_controller(&mut self) {
        let child = Command::new(env!("CARGO_BIN_EXE_volagent"))
            .args(["controller", "--scan-interval", "1h", "--lease-duration", "3s", "--cluster-interval", "1s", "--namespace", "default", "--identity", "test-controller"])
            .arg("--kubeconfig").arg(self.env.kubeconfig_path())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.scratch.path("controller.log")).expect("controller log"))
            .spawn()
            .expect("start the controller");
        self.agents.push(("controller".into(), child));
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(self.client(), "default");
        self.wait("the controller to take the lease", || {
            self.rt.block_on(leases.get_opt("volagent-controller")).ok().flatten().and_then(|l| l.spec?.holder_identity).as_deref() == Some("test-controller")
        });
    }

    pub fn wait(&self, what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The UID of pod `pod` that uses the claim of PV `volume`, made on
    /// first use (from the test's thread: it needs the API).
    pub fn pod_uid(&self, pod: &str, volume: &str) -> String {
        if let Some(uid) = self.pods.lock().expect("pods").get(pod) {
            return uid.clone();
        }
        let uid = self.rt.block_on(crate::kube_common::create_pod(&self.client(), pod, &[volume], &[]));
        self.pods.lock().expect("pods").insert(pod.to_string(), uid.clone());
        uid
    }

    pub fn record(&self, volume: &str) -> Option<Attachment> {
        let api: Api<Attachment> = Api::all(self.client());
        self.rt.block_on(api.get_opt(volume)).expect("read the record")
    }
}
