//! The agent as the tests run it: [`AgentBuilder`], the one place that
//! spells out `volagent agent`'s command line, and [`Node`], standalone
//! agents (one per simulated node) on a scratch dir, called through the
//! installed `volagent-flex` driver.

use crate::driver::run_driver;
use crate::scratch::RootScratch;
use serde_json::Value;
use std::ffi::{OsStr, OsString};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// `volagent agent` for one node: its dirs, flags and environment; spawned
/// with its stderr in a log (appended across restarts) or discarded, and
/// waited for until its socket answers.
#[derive(Clone, Debug)]
pub struct AgentBuilder {
    bin: PathBuf,
    node: String,
    json_log: bool,
    socket: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
    runtime_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    ledger: Option<(PathBuf, bool)>,
    plugin_dir: Option<PathBuf>,
    kubelet_root: Option<PathBuf>,
    discovery_dir: Option<PathBuf>,
    volume_plugin_dir: Option<PathBuf>,
    flex_driver: Option<OsString>,
    trusted_policies: Option<PathBuf>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    log: Option<PathBuf>,
    ready: Option<PathBuf>,
    within: Duration,
}

impl AgentBuilder {
    /// The agent of node `node` run from `bin` (a test passes
    /// `env!("CARGO_BIN_EXE_volagent")`), with no dirs set yet.
    pub fn new(bin: impl Into<PathBuf>, node: &str) -> AgentBuilder {
        AgentBuilder {
            bin: bin.into(),
            node: node.to_string(),
            json_log: false,
            socket: None,
            kubeconfig: None,
            runtime_dir: None,
            state_dir: None,
            ledger: None,
            plugin_dir: None,
            kubelet_root: None,
            discovery_dir: None,
            volume_plugin_dir: None,
            flex_driver: None,
            trusted_policies: None,
            args: Vec::new(),
            env: Vec::new(),
            log: None,
            ready: None,
            within: Duration::from_secs(60),
        }
    }

    /// Every dir below `dir` as the tests lay them out (`run`, `state`,
    /// `plugins`, `kubelet`, `disks`, `vpd`), the test build of the
    /// Flexvolume driver, and the allow-list `trusted-policies` there,
    /// listing every test guest that loads (written unless it is there).
    pub fn under(self, dir: &Path) -> AgentBuilder {
        self.trusting_test_guests(dir.join("trusted-policies"))
            .runtime_dir(dir.join("run"))
            .state_dir(dir.join("state"))
            .plugin_dir(dir.join("plugins"))
            .kubelet_root(dir.join("kubelet"))
            .discovery_dir(dir.join("disks"))
            .volume_plugin_dir(dir.join("vpd"))
            .flex_driver(volagent_test_artifacts::FLEX_DRIVER)
    }

    /// JSON log lines (a global flag: before the subcommand).
    pub fn json_log(mut self) -> AgentBuilder {
        self.json_log = true;
        self
    }

    pub fn socket(mut self, path: PathBuf) -> AgentBuilder {
        self.socket = Some(path);
        self
    }

    pub fn kubeconfig(mut self, path: PathBuf) -> AgentBuilder {
        self.kubeconfig = Some(path);
        self
    }

    pub fn runtime_dir(mut self, dir: PathBuf) -> AgentBuilder {
        self.runtime_dir = Some(dir);
        self
    }

    pub fn state_dir(mut self, dir: PathBuf) -> AgentBuilder {
        self.state_dir = Some(dir);
        self
    }

    /// The embedded ledger's file, `shared` by several agents or not.
    pub fn ledger(mut self, path: PathBuf, shared: bool) -> AgentBuilder {
        self.ledger = Some((path, shared));
        self
    }

    pub fn plugin_dir(mut self, dir: PathBuf) -> AgentBuilder {
        self.plugin_dir = Some(dir);
        self
    }

    pub fn kubelet_root(mut self, dir: PathBuf) -> AgentBuilder {
        self.kubelet_root = Some(dir);
        self
    }

    pub fn discovery_dir(mut self, dir: PathBuf) -> AgentBuilder {
        self.discovery_dir = Some(dir);
        self
    }

    pub fn volume_plugin_dir(mut self, dir: PathBuf) -> AgentBuilder {
        self.volume_plugin_dir = Some(dir);
        self
    }

    pub fn flex_driver(mut self, path: impl Into<OsString>) -> AgentBuilder {
        self.flex_driver = Some(path.into());
        self
    }

    /// The allow-list of policies it may load.
    pub fn trusted_policies(mut self, path: PathBuf) -> AgentBuilder {
        self.trusted_policies = Some(path);
        self
    }

    /// The allow-list `list`, listing every test guest that loads (written
    /// unless it is there).
    pub fn trusting_test_guests(self, list: PathBuf) -> AgentBuilder {
        if !list.exists() {
            write_allow_list(&list, volagent_test_artifacts::LOADABLE);
        }
        self.trusted_policies(list)
    }

    /// Neither a volume plugin dir nor a Flexvolume driver: a CSI-only agent.
    pub fn no_driver_install(mut self) -> AgentBuilder {
        self.volume_plugin_dir = None;
        self.flex_driver = None;
        self.arg("--no-driver-install")
    }

    /// Further flags, after the dirs.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> AgentBuilder {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, args: I) -> AgentBuilder {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> AgentBuilder {
        self.env.push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Its stderr appended to `path` (else discarded).
    pub fn log(mut self, path: PathBuf) -> AgentBuilder {
        self.log = Some(path);
        self
    }

    /// Wait for `socket` to answer instead of the agent's own (e.g. a CSI
    /// driver's).
    pub fn ready_when(mut self, socket: PathBuf) -> AgentBuilder {
        self.ready = Some(socket);
        self
    }

    /// How long it may take to come up (60 s unless told).
    pub fn within(mut self, within: Duration) -> AgentBuilder {
        self.within = within;
        self
    }

    /// The socket it serves its clients on: `--socket`, else the runtime
    /// dir's `agent.sock`.
    pub fn socket_path(&self) -> PathBuf {
        match (&self.socket, &self.runtime_dir) {
            (Some(s), _) => s.clone(),
            (None, Some(run)) => run.join("agent.sock"),
            (None, None) => PathBuf::from("/run/volagent/agent.sock"),
        }
    }

    /// Its arguments, after the program's name: for a caller that wraps the
    /// agent in another command.
    pub fn argv(&self) -> Vec<OsString> {
        let mut out: Vec<OsString> = Vec::new();
        if self.json_log {
            out.extend(["--log-format", "json"].map(OsString::from));
        }
        out.extend(["agent", "--node-name"].map(OsString::from));
        out.push(self.node.clone().into());
        let flags: [(&str, Option<&OsStr>); 11] = [
            ("--socket", self.socket.as_deref().map(Path::as_os_str)),
            ("--kubeconfig", self.kubeconfig.as_deref().map(Path::as_os_str)),
            ("--state-dir", self.state_dir.as_deref().map(Path::as_os_str)),
            ("--runtime-dir", self.runtime_dir.as_deref().map(Path::as_os_str)),
            ("--ledger", self.ledger.as_ref().map(|(p, _)| p.as_os_str())),
            ("--plugin-dir", self.plugin_dir.as_deref().map(Path::as_os_str)),
            ("--kubelet-root", self.kubelet_root.as_deref().map(Path::as_os_str)),
            ("--discovery-dir", self.discovery_dir.as_deref().map(Path::as_os_str)),
            ("--volume-plugin-dir", self.volume_plugin_dir.as_deref().map(Path::as_os_str)),
            ("--flex-driver", self.flex_driver.as_deref()),
            ("--trusted-policies", self.trusted_policies.as_deref().map(Path::as_os_str)),
        ];
        for (name, value) in flags {
            if let Some(v) = value {
                out.push(name.into());
                out.push(v.to_owned());
            }
        }
        if self.ledger.as_ref().is_some_and(|(_, shared)| *shared) {
            out.push("--ledger-shared".into());
        }
        out.extend(self.args.iter().cloned());
        out
    }

    /// The command, its environment set; stdio left to the caller.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(self.argv()).envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// Starts the agent and waits until its socket answers.
    pub fn spawn(&self) -> Child {
        let stderr = match &self.log {
            Some(log) => Stdio::from(append(log)),
            None => Stdio::null(),
        };
        let child =
            self.command().stdout(Stdio::null()).stderr(stderr).spawn().expect("start the agent");
        self.wait_ready();
        child
    }

    /// Waits until the agent's socket (or [`ready_when`](Self::ready_when)'s)
    /// answers; on timeout says the end of its log.
    pub fn wait_ready(&self) {
        let socket = self.ready.clone().unwrap_or_else(|| self.socket_path());
        crate::wait_until_or(
            self.within,
            &format!("the agent of {} to come up", self.node),
            || UnixStream::connect(&socket).is_ok(),
            || self.log.as_deref().map(volagent_kube_env::log_tail).unwrap_or_default(),
        );
    }
}

/// The allow-list `path`, listing `guests` (backend, file), as an admin
/// writes one: `<backend> <sha256>` per line.
pub fn write_allow_list(path: &Path, guests: &[(&str, &str)]) {
    use sha2::Digest;
    let text: String = guests
        .iter()
        .map(|(backend, file)| {
            let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{file}: {e}"));
            format!("{backend} {}\n", hex::encode(sha2::Sha256::digest(bytes)))
        })
        .collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("the allow-list's dir");
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// `path` opened for appending, made if missing.
fn append(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Stops `child` as a node would: SIGTERM, then waits for it.
pub fn stop(child: &mut Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
}

/// Kills `child` with SIGKILL, as a crash would, and reaps it.
pub fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// A scratch "cluster" on this machine: agents (one per node name) that
/// share the plugin dir, the local disks dir and the embedded ledger, each
/// with its own socket, kubelet root and volume plugin dir.
pub struct Node {
    /// The agent's binary.
    pub bin: PathBuf,
    pub scratch: RootScratch,
    pub agents: Vec<(String, Child)>,
    pub socket: PathBuf,
    /// Agents keep their own ledger in their state dir, unshared, as a
    /// standalone node's agent does (see [`Node::start_alone`]).
    pub private_ledger: bool,
    /// Flags every start of an agent gets, restarts too.
    pub agent_args: Vec<String>,
}

impl Node {
    /// Node `node-a`, its agent run from `bin`.
    pub fn start(bin: &str) -> Node {
        Node::start_with(bin, &[])
    }

    /// Also serving these test guests (file, backend name).
    pub fn start_with(bin: &str, extra: &[(&str, &str)]) -> Node {
        Node::start_as(bin, extra, false)
    }

    /// One node whose agent keeps its own ledger (in its state dir, not
    /// shared): the default of a standalone agent.
    pub fn start_alone(bin: &str) -> Node {
        Node::start_as(bin, &[], true)
    }

    /// [`start_alone`](Self::start_alone) for a run of hours: the scratch
    /// dir's watchdog (which aborts hung FUSE mounts and kills what runs
    /// under the dir) waits `watchdog` instead of a test's few minutes.
    pub fn start_alone_for(bin: &str, watchdog: Duration) -> Node {
        Node::start_in(bin, RootScratch::enter_with_watchdog(watchdog), &[], true)
    }

    /// [`start_alone`](Self::start_alone), its agent recording every
    /// policy call (`--record`) into [`recordings`](Self::recordings).
    pub fn start_alone_recording(bin: &str) -> Node {
        let scratch = RootScratch::enter();
        let args = vec!["--record".to_string(), scratch.path("recordings").display().to_string()];
        Node::start_with_args(bin, scratch, &[], true, args)
    }

    /// Where [`start_alone_recording`](Self::start_alone_recording)'s agent records.
    pub fn recordings(&self) -> PathBuf {
        self.scratch.path("recordings")
    }

    fn start_as(bin: &str, extra: &[(&str, &str)], private_ledger: bool) -> Node {
        Node::start_in(bin, RootScratch::enter(), extra, private_ledger)
    }

    fn start_in(
        bin: &str,
        scratch: RootScratch,
        extra: &[(&str, &str)],
        private_ledger: bool,
    ) -> Node {
        Node::start_with_args(bin, scratch, extra, private_ledger, Vec::new())
    }

    fn start_with_args(
        bin: &str,
        scratch: RootScratch,
        extra: &[(&str, &str)],
        private_ledger: bool,
        agent_args: Vec<String>,
    ) -> Node {
        for d in ["plugins", "disks"] {
            std::fs::create_dir_all(scratch.path(d)).expect("dir");
        }
        std::fs::copy(volagent_test_artifacts::LOCAL_PV, scratch.path("plugins/local-pv.wasm"))
            .expect("plugin");
        std::fs::copy(
            volagent_test_artifacts::SHARED_FILE,
            scratch.path("plugins/shared-file.wasm"),
        )
        .expect("plugin");
        for (file, name) in extra {
            std::fs::copy(file, scratch.path(&format!("plugins/{name}.wasm"))).expect("plugin");
        }
        let socket = scratch.path("node-a/agent.sock");
        let mut node = Node {
            bin: bin.into(),
            scratch,
            agents: Vec::new(),
            socket,
            private_ledger,
            agent_args,
        };
        node.spawn_agent("node-a");
        node
    }

    pub fn spawn_agent(&mut self, name: &str) {
        self.spawn_agent_with(name, None);
    }

    /// List `file` (a policy of `backend` no built guest is, e.g. a
    /// fixture) in the allow-list of every agent started so far; their
    /// watch takes the change.
    pub fn trust(&self, backend: &str, file: &Path) {
        use sha2::Digest;
        let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let line = format!("{backend} {}\n", hex::encode(sha2::Sha256::digest(bytes)));
        for (name, _) in &self.agents {
            let list = self.scratch.path(&format!("{name}/trusted-policies"));
            let mut text = std::fs::read_to_string(&list).expect("the allow-list");
            text.push_str(&line);
            std::fs::write(&list, text).expect("the allow-list");
        }
    }

    /// Start an agent that kills itself (SIGKILL) after `kill_after` steps of a plan.
    pub fn spawn_agent_with(&mut self, name: &str, kill_after: Option<usize>) {
        let env: Vec<(&str, String)> = kill_after
            .map(|n| (volagent::sys::faults::KILL_AFTER_STEP_ENV, n.to_string()))
            .into_iter()
            .collect();
        self.spawn_agent_env(name, &env, &[]);
    }

    pub fn spawn_agent_env(&mut self, name: &str, env: &[(&str, String)], extra: &[&str]) {
        let s = &self.scratch;
        let at = |p: &str| s.path(&format!("{name}/{p}"));
        let agent = env
            .iter()
            .fold(AgentBuilder::new(&self.bin, name), |a, (k, v)| a.env(k, v))
            .under(&s.path(name))
            .socket(at("agent.sock"))
            .ledger(self.ledger_path(name), !self.private_ledger)
            .plugin_dir(s.path("plugins"))
            .discovery_dir(s.path("disks"))
            .args(&self.agent_args)
            .args(extra)
            .log(self.log_path(name));
        self.agents.push((name.to_string(), agent.spawn()));
    }

    /// The ledger file `name`'s agent uses.
    pub fn ledger_path(&self, name: &str) -> PathBuf {
        match self.private_ledger {
            true => self.scratch.path(&format!("{name}/state/ledger.redb")),
            false => self.scratch.path("ledger.redb"),
        }
    }

    /// Where an agent's log goes (appended across restarts).
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.scratch.path(&format!("{name}.log"))
    }

    /// The pid of `name`'s agent.
    pub fn pid_of(&self, name: &str) -> i32 {
        self.agents
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.id() as i32)
            .expect("the agent runs")
    }

    pub fn stop_agent(&mut self) {
        for (_, mut child) in self.agents.drain(..) {
            stop(&mut child);
        }
    }

    /// Start node-a's agent again with faults injected at its sys seam, by
    /// the rules in the returned file (none while it does not exist).
    pub fn restart_with_faults(&mut self, extra: &[&str]) -> PathBuf {
        let rules = self.scratch.path("faults");
        self.stop_agent_of("node-a");
        self.spawn_agent_env(
            "node-a",
            &[(volagent::sys::faults::FAULTS_FILE_ENV, rules.display().to_string())],
            extra,
        );
        rules
    }

    /// Kill `name`'s agent with SIGKILL, as a crash would.
    pub fn kill_agent_of(&mut self, name: &str) {
        if let Some(i) = self.agents.iter().position(|(n, _)| n == name) {
            kill(&mut self.agents.remove(i).1);
        }
    }

    pub fn stop_agent_of(&mut self, name: &str) {
        if let Some(i) = self.agents.iter().position(|(n, _)| n == name) {
            stop(&mut self.agents.remove(i).1);
        }
    }

    pub fn driver_path(&self) -> PathBuf {
        self.driver_of("node-a", "local-pv")
    }

    pub fn driver_of(&self, node: &str, backend: &str) -> PathBuf {
        self.scratch.path(&format!("{node}/vpd/volagent~{backend}/{backend}"))
    }

    /// Run the installed driver as kubelet does; its stdout must be exactly
    /// one JSON object and its stderr empty.
    pub fn driver(&self, args: &[&str]) -> (i32, Value) {
        run_driver(Command::new(self.driver_path()).args(args))
    }

    pub fn image(&self, name: &str, mib: u64) -> String {
        self.scratch.image(&format!("disks/{name}"), mib).display().to_string()
    }

    pub fn mount_dir(&self, pod_uid: &str, volume: &str) -> String {
        self.mount_dir_of("node-a", "local-pv", pod_uid, volume)
    }

    pub fn mount_dir_of(&self, node: &str, backend: &str, pod_uid: &str, volume: &str) -> String {
        let d = self
            .scratch
            .path(&format!("{node}/kubelet/pods/{pod_uid}/volumes/volagent~{backend}/{volume}"));
        std::fs::create_dir_all(&d).expect("kubelet makes the pod's volume dir");
        d.display().to_string()
    }

    pub fn mount(&self, dir: &str, options: &Value) -> (i32, Value) {
        self.driver(&["mount", dir, &options.to_string()])
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_agent();
    }
}
