//! Hot reload of backends in a running agent: drop a `.wasm` in and kubelet
//! can use its new driver within seconds; a bad file never takes a working
//! backend down; a backend with attached volumes is not removed under them;
//! bursts of file events are coalesced. Needs root (mounts).

use serde_json::Value;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use volagent_test_support::agent::{AgentBuilder, kill};
use volagent_test_support::driver::{assert_success, kubelet_options, run_driver};
use volagent_test_support::scratch::RootScratch;
use volagent_test_support::wait_until;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");
/// How long the agent and each reload may take.
const WAIT: Duration = Duration::from_secs(30);

struct Node {
    agent: Child,
    metrics: std::net::SocketAddr,
    scratch: RootScratch,
}

impl Drop for Node {
    fn drop(&mut self) {
        kill(&mut self.agent);
    }
}

fn free_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr")
}

impl Node {
    fn start() -> Node {
        let scratch = RootScratch::enter();
        for d in ["plugins", "disks"] {
            std::fs::create_dir_all(scratch.path(d)).expect("dir");
        }
        std::fs::copy(volagent_test_artifacts::LOCAL_PV, scratch.path("plugins/local-pv.wasm"))
            .expect("plugin");
        let metrics = free_port();
        let agent = AgentBuilder::new(VOLAGENT, "node-a")
            .under(&scratch.path(""))
            .args(["--metrics-addr", &metrics.to_string()])
            .within(WAIT)
            .spawn();
        Node { agent, metrics, scratch }
    }

    fn socket(&self) -> PathBuf {
        self.scratch.path("run/agent.sock")
    }

    fn wait(&self, what: &str, done: impl FnMut() -> bool) {
        wait_until(WAIT, what, done);
    }

    /// `volagent plugin status --json`: (exit code, answer).
    fn status(&self) -> (i32, Value) {
        let out = Command::new(VOLAGENT)
            .args(["plugin", "status", "--json", "--socket"])
            .arg(self.socket())
            .output()
            .expect("plugin status");
        let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("status JSON ({e}): {}", String::from_utf8_lossy(&out.stdout))
        });
        (out.status.code().unwrap_or(-1), v)
    }

    fn reloads(&self) -> u64 {
        self.counter("volagent_plugin_reloads_total")
    }

    /// The agent's counter `name`, from its metrics endpoint.
    fn counter(&self, name: &str) -> u64 {
        let mut s = std::net::TcpStream::connect(self.metrics).expect("metrics endpoint");
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .expect("request");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("response");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no counter {name} in {text}"))
    }

    /// The sha256 of the version of `backend` that serves.
    fn serving(&self, backend: &str) -> Option<String> {
        let (_, status) = self.status();
        status["backends"].as_array()?.iter().find(|b| b["name"] == backend)?["sha256"]
            .as_str()
            .map(str::to_string)
    }

    fn driver(&self, backend: &str) -> PathBuf {
        self.scratch.path(&format!("vpd/volagent~{backend}/{backend}"))
    }

    fn mount(&self, backend: &str, pod: &str, volume: &str, image: &str) -> (String, (i32, Value)) {
        let dir = self
            .scratch
            .path(&format!("kubelet/pods/uid-{pod}/volumes/volagent~{backend}/{volume}"));
        std::fs::create_dir_all(&dir).expect("pod dir");
        let dir = dir.display().to_string();
        let opts = kubelet_options(volume, pod, &format!("uid-{pod}"), "ext4", image);
        let r =
            run_driver(Command::new(self.driver(backend)).args(["mount", &dir, &opts.to_string()]));
        (dir, r)
    }

    fn unmount(&self, backend: &str, dir: &str) -> (i32, Value) {
        run_driver(Command::new(self.driver(backend)).args(["unmount", dir]))
    }

    /// Install `bytes` as `plugins/<name>` the way installers do: a dot-file, renamed.
    fn install(&self, name: &str, bytes: &[u8]) {
        let tmp = self.scratch.path(&format!("plugins/.{name}"));
        std::fs::write(&tmp, bytes).expect("write");
        std::fs::rename(&tmp, self.scratch.path(&format!("plugins/{name}"))).expect("rename");
    }

    /// List `bytes` for `backend` in the agent's allow-list.
    fn trust(&self, backend: &str, bytes: &[u8]) {
        use sha2::Digest;
        let line = format!("{backend} {}\n", hex::encode(sha2::Sha256::digest(bytes)));
        let list = self.scratch.path("trusted-policies");
        let mut text = std::fs::read_to_string(&list).expect("the allow-list");
        text.push_str(&line);
        std::fs::write(&list, text).expect("the allow-list");
    }
}

fn image(node: &Node, name: &str) -> String {
    node.scratch.image(&format!("disks/{name}"), 64).display().to_string()
}

#[test]
fn a_backend_dropped_in_serves_a_mount_within_two_seconds() {
    let node = Node::start();
    // Pre-formatted: the time measured is the reload's, not mkfs's.
    let img = image(&node, "new.img");
    assert!(Command::new("mkfs.ext4").args(["-F", "-q", &img]).status().expect("mkfs").success());
    assert!(!node.driver("shared-file").exists());
    let bytes = std::fs::read(volagent_test_artifacts::SHARED_FILE).expect("guest");
    let start = Instant::now();
    node.install("shared-file.wasm", &bytes);
    let (dir, r) = loop {
        if node.driver("shared-file").exists() {
            let (dir, r) = node.mount("shared-file", "p1", "pv-new", &img);
            if r.0 == 0 {
                break (dir, r);
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "no successful mount through the new driver within 2 s (driver installed: {})",
            node.driver("shared-file").exists()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = start.elapsed();
    assert_success(&r);
    eprintln!("rename to first successful mount: {took:?}");
    assert_success(&node.unmount("shared-file", &dir));
    assert!(
        node.scratch.path("vpd/volagent~shared-file/volagent.json").exists(),
        "the driver's config is installed beside it"
    );
}

#[test]
fn a_broken_update_is_reported_and_the_last_good_version_serves_on() {
    let node = Node::start();
    let good = std::fs::read(volagent_test_artifacts::LOCAL_PV).expect("guest");
    let garbage = b"\0asm this is not a component".to_vec();
    // Listed, so that the load's own checks refuse it, not trust.
    node.trust("local-pv", &garbage);
    node.install("local-pv.wasm", &garbage);
    node.wait("local-pv to be reported degraded", || {
        let (code, v) = node.status();
        code == 1
            && v["problems"].as_array().is_some_and(|p| {
                p.iter().any(|p| p["state"] == "degraded" && p["backend"] == "local-pv")
            })
    });
    let (_, v) = node.status();
    let problem = &v["problems"][0];
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&garbage))
    };
    assert_eq!(problem["sha256"], sha.as_str(), "the bad file's sha256 is reported");
    assert!(
        problem["file"].as_str().is_some_and(|f| f.ends_with("plugins/local-pv.wasm")),
        "{problem}"
    );
    assert!(!problem["reason"].as_str().unwrap_or_default().is_empty(), "{problem}");
    assert_eq!(v["backends"][0]["name"], "local-pv", "the old version still serves: {v}");

    // It really serves: a mount through the driver works.
    let img = image(&node, "keep.img");
    let (dir, r) = node.mount("local-pv", "p1", "pv-keep", &img);
    assert_success(&r);
    assert_success(&node.unmount("local-pv", &dir));

    // A good file clears it.
    node.install("local-pv.wasm", &good);
    node.wait("the degraded state to clear", || node.status().0 == 0);

    // A new backend whose own scenarios, shipped beside it, fail is not
    // loaded; fixing the scenarios file does not count until the component
    // itself changes, so ship both again.
    std::fs::write(
        node.scratch.path("plugins/shared-file.scenarios.yaml"),
        "backend: shared-file\nscenarios:\n  - name: names itself\n    call: info\n    expect: { info: { name: not-shared-file } }\n",
    )
    .expect("scenarios");
    let shared = std::fs::read(volagent_test_artifacts::SHARED_FILE).expect("guest");
    node.install("shared-file.wasm", &shared);
    node.wait("the new backend to be rejected by its scenarios", || {
        node.status().1["problems"].as_array().is_some_and(|p| {
            p.iter().any(|p| {
                p["backend"] == "shared-file"
                    && p["reason"].as_str().is_some_and(|r| r.contains("scenario \"names itself\""))
            })
        })
    });
    assert!(!node.driver("shared-file").exists(), "a rejected backend gets no driver");
    std::fs::write(
        node.scratch.path("plugins/shared-file.scenarios.yaml"),
        "backend: shared-file\nscenarios:\n  - name: names itself\n    call: info\n    expect: { info: { name: shared-file } }\n",
    )
    .expect("scenarios");
    std::fs::remove_file(node.scratch.path("plugins/shared-file.wasm")).expect("remove");
    node.wait("the rejected file to be forgotten", || node.status().0 == 0);
    node.install("shared-file.wasm", &shared);
    node.wait("the new backend with passing scenarios", || node.driver("shared-file").exists());
    assert_eq!(node.status().0, 0);
}

#[test]
fn a_backend_with_an_attached_volume_is_removed_only_after_its_unmount() {
    let node = Node::start();
    let img = image(&node, "busy.img");
    let (dir, r) = node.mount("local-pv", "p1", "pv-busy", &img);
    assert_success(&r);
    std::fs::remove_file(node.scratch.path("plugins/local-pv.wasm"))
        .expect("remove the backend's file");
    node.wait("the removal to be reported pending", || {
        node.status().1["problems"].as_array().is_some_and(|p| {
            p.iter().any(|p| p["state"] == "removal-pending" && p["backend"] == "local-pv")
        })
    });
    assert!(node.driver("local-pv").exists(), "the driver stays while the volume is attached");
    assert_success(&node.unmount("local-pv", &dir));
    node.wait("the backend's driver dir to go", || {
        !Path::new(&node.scratch.path("vpd/volagent~local-pv")).exists()
    });
    let (code, v) = node.status();
    assert_eq!(
        (code, v["backends"].as_array().map(Vec::len)),
        (0, Some(0)),
        "the backend is gone too: {v}"
    );
}

#[test]
fn bursts_of_file_events_are_coalesced_and_dot_files_ignored() {
    let node = Node::start();
    std::thread::sleep(Duration::from_millis(1500));
    let before = node.reloads();
    let tmp = node.scratch.path("plugins/.in-progress.wasm");
    for i in 0..100 {
        std::fs::write(&tmp, format!("partial {i}")).expect("write a dot-file");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(node.reloads(), before, "dot-files cause no reload");

    let bytes = std::fs::read(volagent_test_artifacts::LOCAL_PV).expect("guest");
    let file = node.scratch.path("plugins/local-pv.wasm");
    let start = Instant::now();
    for _ in 0..100 {
        std::fs::write(&file, &bytes).expect("rewrite");
    }
    assert!(start.elapsed() < Duration::from_secs(1), "100 events within one second");
    std::thread::sleep(Duration::from_millis(3000));
    let passes = node.reloads() - before;
    assert!((1..=2).contains(&passes), "100 events in a second caused {passes} reloads");
    assert_eq!(node.status().0, 0, "and the backend serves, not degraded");
}

#[test]
fn a_version_compiled_before_serves_again_without_a_compile() {
    let node = Node::start();
    let sha = |b: &[u8]| {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(b))
    };
    let first = std::fs::read(volagent_test_artifacts::LOCAL_PV).expect("guest");
    let second = volagent_test_support::policy::with_custom_section(&first, "second");
    node.trust("local-pv", &second);
    node.wait("the first version to serve", || node.serving("local-pv") == Some(sha(&first)));
    let compiled = node.counter("volagent_plugin_compiles_total");
    assert!(compiled >= 1, "the first version was compiled at start-up");

    node.install("local-pv.wasm", &second);
    node.wait("the second version to serve", || node.serving("local-pv") == Some(sha(&second)));
    assert_eq!(node.counter("volagent_plugin_compiles_total"), compiled + 1, "a new version");

    // Rolled back, then forward again: both were compiled already.
    node.install("local-pv.wasm", &first);
    node.wait("the first version to serve again", || node.serving("local-pv") == Some(sha(&first)));
    node.install("local-pv.wasm", &second);
    node.wait("the second version to serve again", || {
        node.serving("local-pv") == Some(sha(&second))
    });
    assert_eq!(
        node.counter("volagent_plugin_compiles_total"),
        compiled + 1,
        "versions compiled before are not compiled again"
    );
    // And the version served from memory serves: a mount works.
    let img = image(&node, "again.img");
    let (dir, r) = node.mount("local-pv", "p1", "pv-again", &img);
    assert_success(&r);
    assert_success(&node.unmount("local-pv", &dir));
}
