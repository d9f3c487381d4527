//! Agents of several simulated nodes against a real etcd + kube-apiserver
//! (both "nodes" are this machine, each agent with its own kubelet root,
//! runtime and state dirs), and the controller, set up as they ship
//! ([`crate::shipped`]): `deploy/`'s RBAC and admission webhook, the
//! controller as its ServiceAccount, each agent on a token of the agents'
//! ServiceAccount bound to a pod on its node. The API-server tier's tests
//! add what their backend needs in `impl Cluster` blocks of their own.
#![allow(dead_code)]

use crate::common::RootScratch;
use crate::shipped;
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
    /// The API server's URL agents started from now on use, when not its
    /// own (e.g. a proxy in front of it).
    pub agent_server: Option<String>,
    /// The controller's admission webhook port (on loopback).
    pub webhook_port: u16,
    /// Arguments the controller starts with besides the usual ones.
    pub controller_args: Vec<String>,
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
        Cluster::start_with(nodes, plugins, &[])
    }

    /// [`Self::start`], the controller started with `controller_args` too.
    pub fn start_with(
        nodes: &[&str],
        plugins: &[(&str, &str)],
        controller_args: &[&str],
    ) -> Cluster {
        // The mount namespace is per thread: unshare on the test thread, and
        // run the async parts on it too (a current-thread runtime).
        let scratch = RootScratch::enter();
        let rt =
            tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let env =
            rt.block_on(KubeEnv::start()).expect("a real kube-apiserver (scripts/kube-assets)");
        let client = {
            let _in_runtime = rt.enter();
            env.client()
        };
        let webhook_port = volagent_kube_env::free_ports(1).expect("a free port")[0];
        rt.block_on(shipped::install(&client, &shipped::webhook_url(webhook_port)))
            .expect("deploy/'s RBAC and webhook");
        for n in nodes {
            rt.block_on(crate::kube_common::create_node(&client, n, true));
        }
        std::fs::create_dir_all(scratch.path("plugins")).expect("dir");
        std::fs::create_dir_all(scratch.path("disks")).expect("dir");
        for (file, name) in plugins {
            std::fs::copy(file, scratch.path(&format!("plugins/{name}.wasm"))).expect("plugin");
        }
        let mut c = Cluster {
            agents: Vec::new(),
            env,
            rt,
            scratch,
            pods: Default::default(),
            agent_server: None,
            webhook_port,
            controller_args: controller_args.iter().map(|a| a.to_string()).collect(),
        };
        c.spawn_controller();
        for n in nodes {
            c.spawn_agent(n);
        }
        c
    }

    /// A client acting as node `node`'s agent (its pod-bound token).
    pub fn agent_client(&self, node: &str) -> kube::Client {
        let _in_runtime = self.rt.enter();
        self.rt
            .block_on(shipped::agent_client(&self.env, node, "busybox", &self.scratch.path("")))
            .expect("an agent's client")
    }

    /// A client acting as the controller's ServiceAccount.
    pub fn controller_client(&self) -> kube::Client {
        let _in_runtime = self.rt.enter();
        let path = self.scratch.path("controller.kubeconfig");
        self.rt
            .block_on(async {
                shipped::client_from(&shipped::controller_kubeconfig(&self.env, &path).await?).await
            })
            .expect("the controller's client")
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
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.scratch.path(&format!("{node}.log")))
            .expect("agent log");
        let kubeconfig = self.scratch.path(&format!("{node}.kubeconfig"));
        {
            let _in_runtime = self.rt.enter();
            self.rt
                .block_on(shipped::agent_kubeconfig(&self.env, node, "busybox", &kubeconfig))
                .expect("the agent's kubeconfig");
        }
        if let Some(server) = &self.agent_server {
            let text = std::fs::read_to_string(&kubeconfig).expect("kubeconfig");
            assert!(text.contains(self.env.url()), "the kubeconfig names the API server");
            std::fs::write(&kubeconfig, text.replace(self.env.url(), server))
                .expect("the agent's kubeconfig");
        }
        let child = Command::new(env!("CARGO_BIN_EXE_volagent"))
            .args(["agent", "--node-name", node])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--runtime-dir")
            .arg(at("run"))
            .arg("--state-dir")
            .arg(at("state"))
            .arg("--plugin-dir")
            .arg(self.scratch.path("plugins"))
            .arg("--kubelet-root")
            .arg(at("kubelet"))
            .arg("--discovery-dir")
            .arg(self.scratch.path("disks"))
            .arg("--volume-plugin-dir")
            .arg(at("vpd"))
            .arg("--flex-driver")
            .arg(volagent_test_artifacts::FLEX_DRIVER)
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the agent");
        self.agents.push((node.to_string(), child));
        let start = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the agent of {node} did not come up"
            );
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

    /// The controller as its ServiceAccount, leading once the Lease names
    /// it, with its admission webhook answering; started by [`Self::start`].
    pub fn spawn_controller(&mut self) {
        let kubeconfig = self.scratch.path("controller.kubeconfig");
        {
            let _in_runtime = self.rt.enter();
            self.rt
                .block_on(shipped::controller_kubeconfig(&self.env, &kubeconfig))
                .expect("the controller's kubeconfig");
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.scratch.path("controller.log"))
            .expect("controller log");
        let child = Command::new(env!("CARGO_BIN_EXE_volagent"))
            .args(shipped::controller_args(&kubeconfig, self.webhook_port))
            .args(["--scan-interval", "1h", "--cluster-interval", "1s", "--local-interval", "2s"])
            .args(&self.controller_args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the controller");
        self.agents.push(("controller".into(), child));
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
            Api::namespaced(self.client(), shipped::CONTROLLER_NAMESPACE);
        self.wait("the controller to take the lease", || {
            self.rt
                .block_on(leases.get_opt("volagent-controller"))
                .ok()
                .flatten()
                .and_then(|l| l.spec?.holder_identity)
                .as_deref()
                == Some("test-controller")
        });
        let probe = self.agent_client("volagent-webhook-probe");
        self.rt
            .block_on(shipped::wait_webhook(&probe, "volagent-webhook-probe"))
            .expect("the admission webhook");
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
        let uid =
            self.rt.block_on(crate::kube_common::create_pod(&self.client(), pod, &[volume], &[]));
        self.pods.lock().expect("pods").insert(pod.to_string(), uid.clone());
        uid
    }

    pub fn record(&self, volume: &str) -> Option<Attachment> {
        let api: Api<Attachment> = Api::all(self.client());
        self.rt.block_on(api.get_opt(volume)).expect("read the record")
    }
}
