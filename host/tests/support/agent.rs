//! A standalone agent (or several, one per simulated node) as the root
//! tests run it: the real `volagent agent` binary, its dirs in a scratch
//! dir, called through the installed `volagent-flex` driver.
#![allow(dead_code)]

use crate::common::RootScratch;
use crate::driver_common::run_driver;
use serde_json::Value;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A scratch "cluster" on this machine: agents (one per node name) that
/// share the plugin dir, the local disks dir and the embedded ledger, each
/// with its own socket, kubelet root and volume plugin dir.
pub struct Node {
    pub scratch: RootScratch,
    pub agents: Vec<(String, Child)>,
    pub socket: PathBuf,
    /// Agents keep their own ledger in their state dir, unshared, as a
    /// standalone node's agent does (see [`Node::start_alone`]).
    pub private_ledger: bool,
}

impl Node {
    pub fn start() -> Node {
        Node::start_with(&[])
    }

    /// Also serving these test guests (file, backend name).
    pub fn start_with(extra: &[(&str, &str)]) -> Node {
        Node::start_as(extra, false)
    }

    /// One node whose agent keeps its own ledger (in its state dir, not
    /// shared): the default of a standalone agent.
    pub fn start_alone() -> Node {
        Node::start_as(&[], true)
    }

    /// [`start_alone`](Self::start_alone) for a run of hours: the scratch
    /// dir's watchdog (which aborts hung FUSE mounts and kills what runs
    /// under the dir) waits `watchdog` instead of a test's few minutes.
    pub fn start_alone_for(watchdog: std::time::Duration) -> Node {
        Node::start_in(RootScratch::enter_with_watchdog(watchdog), &[], true)
    }

    fn start_as(extra: &[(&str, &str)], private_ledger: bool) -> Node {
        Node::start_in(RootScratch::enter(), extra, private_ledger)
    }

    fn start_in(scratch: RootScratch, extra: &[(&str, &str)], private_ledger: bool) -> Node {
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
        let mut node = Node { scratch, agents: Vec::new(), socket, private_ledger };
        node.spawn_agent("node-a");
        node
    }

    pub fn spawn_agent(&mut self, name: &str) {
        self.spawn_agent_with(name, None);
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
        let socket = at("agent.sock");
        let ledger: &[&str] = if self.private_ledger { &[] } else { &["--ledger-shared"] };
        let child = Command::new(env!("CARGO_BIN_EXE_volagent"))
            .args(["agent", "--node-name", name])
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(at("state"))
            .arg("--runtime-dir")
            .arg(at("run"))
            .arg("--ledger")
            .arg(self.ledger_path(name))
            .args(ledger)
            .arg("--plugin-dir")
            .arg(s.path("plugins"))
            .arg("--kubelet-root")
            .arg(at("kubelet"))
            .arg("--discovery-dir")
            .arg(s.path("disks"))
            .arg("--volume-plugin-dir")
            .arg(at("vpd"))
            .arg("--flex-driver")
            .arg(volagent_test_artifacts::FLEX_DRIVER)
            .args(extra)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(self.log_file(name))
            .spawn()
            .expect("start the agent");
        self.agents.push((name.to_string(), child));
        let start = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the agent of {name} did not come up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
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

    fn log_file(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(name))
            .expect("agent log")
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
            let mut child = self.agents.remove(i).1;
            let _ = child.kill();
            let _ = child.wait();
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

pub fn stop(child: &mut Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_agent();
    }
}
