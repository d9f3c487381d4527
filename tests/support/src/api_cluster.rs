//! Agents of several simulated nodes against a real etcd + kube-apiserver
//! (both "nodes" are this machine, each agent with its own kubelet root,
//! runtime and state dirs), and the controller, set up as they ship
//! ([`crate::shipped`]): `deploy/`'s RBAC and admission webhook, the
//! controller as its ServiceAccount, each agent on a token of the agents'
//! ServiceAccount bound to a pod on its node. The API-server tier's tests
//! add what their backend needs as extension traits of their own (the type
//! is foreign to them).

use crate::agent::{AgentBuilder, kill};
use crate::scratch::RootScratch;
use crate::shipped;
use crate::wait::{Deadline, wait_until};
use kube::api::Api;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use volagent::kube::crds::Attachment;
use volagent_kube_env::KubeEnv;

pub struct Cluster {
    /// The agent's (and controller's) binary.
    pub bin: PathBuf,
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
    /// Nodes whose agent has a plugin dir of its own (else the shared one).
    plugin_dirs: std::collections::HashMap<String, PathBuf>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, mut c) in self.agents.drain(..) {
            kill(&mut c);
        }
    }
}

impl Cluster {
    /// The API server with the CRDs, `nodes` Ready, and an agent on each
    /// serving the guests `plugins` (file, backend name); agents and the
    /// controller run from `bin`.
    pub fn start(bin: &str, nodes: &[&str], plugins: &[(&str, &str)]) -> Cluster {
        Cluster::start_with(bin, nodes, plugins, &[])
    }

    /// [`Self::start`], the controller started with `controller_args` too.
    pub fn start_with(
        bin: &str,
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
            rt.block_on(crate::kube_objects::create_node(&client, n, true));
        }
        std::fs::create_dir_all(scratch.path("plugins")).expect("dir");
        std::fs::create_dir_all(scratch.path("disks")).expect("dir");
        for (file, name) in plugins {
            std::fs::copy(file, scratch.path(&format!("plugins/{name}.wasm"))).expect("plugin");
        }
        let mut c = Cluster {
            bin: bin.into(),
            agents: Vec::new(),
            env,
            rt,
            scratch,
            pods: Default::default(),
            agent_server: None,
            webhook_port,
            controller_args: controller_args.iter().map(|a| a.to_string()).collect(),
            plugin_dirs: Default::default(),
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

    /// From its next start, `node`'s agent has a plugin dir of its own, as
    /// each node of a DaemonSet has: `<node>/plugins`, a copy of the shared
    /// one's policies.
    pub fn own_plugin_dir(&mut self, node: &str) -> PathBuf {
        let dir = self.scratch.path(&format!("{node}/plugins"));
        std::fs::create_dir_all(&dir).expect("dir");
        for e in std::fs::read_dir(self.scratch.path("plugins")).expect("the shared plugin dir") {
            let path = e.expect("entry").path();
            if path.extension().is_some_and(|x| x == "wasm") {
                std::fs::copy(&path, dir.join(path.file_name().expect("a name"))).expect("copy");
            }
        }
        self.plugin_dirs.insert(node.to_string(), dir.clone());
        dir
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
        let agent = env
            .iter()
            .fold(AgentBuilder::new(&self.bin, node), |a, (k, v)| a.env(k, v))
            .under(&self.scratch.path(node))
            .kubeconfig(kubeconfig)
            .plugin_dir(
                self.plugin_dirs.get(node).cloned().unwrap_or_else(|| self.scratch.path("plugins")),
            )
            .discovery_dir(self.scratch.path("disks"))
            .args(extra)
            .log(self.scratch.path(&format!("{node}.log")));
        self.agents.push((node.to_string(), agent.spawn()));
    }

    pub fn kill_agent(&mut self, node: &str) {
        if let Some(i) = self.agents.iter().position(|(n, _)| n == node) {
            kill(&mut self.agents.remove(i).1);
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
        let child = Command::new(&self.bin)
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

    /// Waits up to a minute, asking every 100 ms (the API server, mostly).
    /// kube-controller-manager with the PV binder and the protection
    /// controllers only, as any cluster runs them: what binds provisioned
    /// PVs to their claims. Stopped when dropped.
    pub fn pv_binder(&self) -> volagent_kube_env::node::ControllerManager {
        let assets = volagent_kube_env::node::node_assets()
            .expect("kube-controller-manager (scripts/node-assets)");
        volagent_kube_env::node::ControllerManager::start_with(
            &self.env,
            &self.scratch.path(""),
            &assets,
            "persistentvolume-binder,pv-protection,pvc-protection",
        )
        .expect("kube-controller-manager")
    }

    pub fn wait(&self, what: &str, done: impl FnMut() -> bool) {
        let deadline =
            Deadline::within(Duration::from_secs(60)).polling(Duration::from_millis(100));
        wait_until(deadline, what, done);
    }

    /// The UID of pod `pod` that uses the claim of PV `volume`, made on
    /// first use (from the test's thread: it needs the API).
    pub fn pod_uid(&self, pod: &str, volume: &str) -> String {
        if let Some(uid) = self.pods.lock().expect("pods").get(pod) {
            return uid.clone();
        }
        let uid =
            self.rt.block_on(crate::kube_objects::create_pod(&self.client(), pod, &[volume], &[]));
        self.pods.lock().expect("pods").insert(pod.to_string(), uid.clone());
        uid
    }

    pub fn record(&self, volume: &str) -> Option<Attachment> {
        let api: Api<Attachment> = Api::all(self.client());
        self.rt.block_on(api.get_opt(volume)).expect("read the record")
    }
}
