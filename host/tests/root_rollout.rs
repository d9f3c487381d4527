//! Rolling a policy out like code, on a standalone agent: its calls are
//! recorded (never a secret's value), the recording becomes a suite and
//! replays the same on the policy that made it; a candidate that denies
//! one access mode is caught by replay and, dropped beside the serving
//! version, by the shadow, which changes nothing a pod sees; then it is
//! promoted and rolled back by renames the agent's watch takes. Needs
//! root (loop devices and mounts).

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command, Output};
use std::time::Duration;
use volagent_test_support::agent::{AgentBuilder, kill, write_allow_list};
use volagent_test_support::driver::{assert_failure, assert_success, kubelet_options, run_driver};
use volagent_test_support::scratch::RootScratch;
use volagent_test_support::wait_until;

const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");
const WAIT: Duration = Duration::from_secs(30);
/// A scenario the strict candidate passes and local-pv as shipped fails.
const STRICT_SCENARIO: &str = r#"backend: local-pv
scenarios:
  - name: ReadOnlyMany is refused
    call: fence
    input:
      volume: { name: v, backend: local-pv, access_mode: ReadOnlyMany, fs_type: ext4, options: { path: /mnt/disks/a.img, node: node-a }, secret_keys: [] }
      requester: { node: node-a, pod_namespace: default, pod: p, pod_uid: u, mount_dir: /x, read_only: true }
    expect: { decision: { Deny: "*refuses ReadOnlyMany*" } }
"#;

/// The secret a volume is mounted with: no recording may hold it.
const SECRET: &str = "hunter2-do-not-record";

struct Node {
    agent: Child,
    scratch: RootScratch,
}

impl Drop for Node {
    fn drop(&mut self) {
        kill(&mut self.agent);
    }
}

impl Node {
    /// An agent serving local-pv; recording into `recordings/` when `record`.
    fn start(record: bool) -> Node {
        Node::start_as(record, false)
    }

    /// An agent that trusts local-pv as shipped (listed) and what the key
    /// `keys/admin.pub` signed, made here with minisign (`keys/other` is a
    /// key it does not know).
    fn start_trusting_little() -> Node {
        Node::start_as(false, true)
    }

    fn start_as(record: bool, little: bool) -> Node {
        let scratch = RootScratch::enter();
        for d in ["plugins", "disks", "keys"] {
            std::fs::create_dir_all(scratch.path(d)).expect("dir");
        }
        std::fs::copy(volagent_test_artifacts::LOCAL_PV, scratch.path("plugins/local-pv.wasm"))
            .expect("plugin");
        let mut agent = AgentBuilder::new(VOLAGENT, "node-a");
        if little {
            write_allow_list(
                &scratch.path("trusted-policies"),
                &[("local-pv", volagent_test_artifacts::LOCAL_PV)],
            );
            for key in ["admin", "other"] {
                let out = Command::new("minisign")
                    .args(["-G", "-W", "-p"])
                    .arg(scratch.path(&format!("keys/{key}.pub")))
                    .arg("-s")
                    .arg(scratch.path(&format!("keys/{key}.sec")))
                    .output()
                    .expect("minisign (scripts/setup installs it)");
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            }
            agent = agent.arg("--policy-key").arg(scratch.path("keys/admin.pub"));
        }
        agent = agent.under(&scratch.path(""));
        if record {
            agent = agent.arg("--record").arg(scratch.path("recordings"));
        }
        let agent = agent.within(WAIT).spawn();
        Node { agent, scratch }
    }

    /// `plugins/<name>` signed with `keys/<key>.sec`, beside it.
    fn sign(&self, name: &str, key: &str) {
        let out = Command::new("minisign")
            .args(["-S", "-s", &self.path(&format!("keys/{key}.sec")), "-m"])
            .arg(self.path(&format!("plugins/{name}")))
            .output()
            .expect("minisign");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    /// The problem reported for the scratch dir's file `name`, once it says `says`.
    fn problem_saying(&self, name: &str, state: &str, says: &[&str]) -> Value {
        let file = format!("/{name}");
        let mut found = Value::Null;
        wait_until(WAIT, &format!("{name} reported {state}, saying {says:?}"), || {
            let status = self.status();
            found = status["problems"]
                .as_array()
                .and_then(|p| {
                    p.iter().find(|p| {
                        p["state"] == state
                            && p["file"].as_str().is_some_and(|f| f.ends_with(&file))
                            && says.iter().all(|w| p["reason"].as_str().unwrap_or("").contains(w))
                    })
                })
                .cloned()
                .unwrap_or(Value::Null);
            !found.is_null()
        });
        found
    }

    /// Copy `from` to `plugins/<name>` the way installers do.
    fn install(&self, from: &str, name: &str) {
        let tmp = self.path("plugins/.tmp");
        std::fs::copy(from, &tmp).expect("copy");
        std::fs::rename(&tmp, self.path(&format!("plugins/{name}"))).expect("rename");
    }

    fn path(&self, rel: &str) -> String {
        self.scratch.path(rel).display().to_string()
    }

    /// `volagent ARGS`, trusting what the agent trusts.
    fn volagent_trusting(&self, args: &[&str]) -> Output {
        let list = self.path("trusted-policies");
        let key = self.path("keys/admin.pub");
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--trusted-policies", &list]);
        if std::path::Path::new(&key).exists() {
            all.extend(["--policy-key", &key]);
        }
        volagent(&all)
    }

    fn status(&self) -> Value {
        let out = Command::new(VOLAGENT)
            .args(["plugin", "status", "--json", "--socket", &self.path("run/agent.sock")])
            .output()
            .expect("plugin status");
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("status JSON ({e}): {}", String::from_utf8_lossy(&out.stdout))
        })
    }

    /// The sha256 of the local-pv version serving.
    fn serving_sha(&self) -> String {
        let status = self.status();
        let local = status["backends"]
            .as_array()
            .and_then(|b| b.iter().find(|b| b["name"] == "local-pv"))
            .cloned()
            .unwrap_or(Value::Null);
        local["sha256"].as_str().unwrap_or_default().to_string()
    }

    /// Mount `volume` (a fresh image file) for `pod` through the driver,
    /// with `mode` and a secret.
    fn mount(&self, pod: &str, volume: &str, mode: &str) -> (String, (i32, Value)) {
        let img = self.scratch.image(&format!("disks/{volume}.img"), 64).display().to_string();
        // Formatted ahead: a read-only volume is not formatted on attach.
        let mkfs = Command::new("mkfs.ext4").args(["-F", "-q", &img]).status().expect("mkfs");
        assert!(mkfs.success());
        let dir = self.path(&format!("kubelet/pods/uid-{pod}/volumes/volagent~local-pv/{volume}"));
        std::fs::create_dir_all(&dir).expect("pod dir");
        let mut opts = kubelet_options(volume, pod, &format!("uid-{pod}"), "ext4", &img);
        opts["accessMode"] = mode.into();
        if mode == "ReadOnlyMany" {
            opts["kubernetes.io/readwrite"] = "ro".into();
        }
        use base64::Engine;
        opts["kubernetes.io/secret/password"] =
            base64::engine::general_purpose::STANDARD.encode(SECRET).into();
        let driver = self.path("vpd/volagent~local-pv/local-pv");
        (dir.clone(), run_driver(Command::new(driver).args(["mount", &dir, &opts.to_string()])))
    }

    fn unmount(&self, dir: &str) {
        let driver = self.path("vpd/volagent~local-pv/local-pv");
        assert_success(&run_driver(Command::new(driver).args(["unmount", dir])));
    }
}

fn volagent(args: &[&str]) -> Output {
    let out = Command::new(VOLAGENT).args(args).output().expect("volagent");
    eprintln!(
        "volagent {}: {}\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sha256(path: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(std::fs::read(path).expect("read")))
}

/// The recordings written whole (not the dot-files of a write under way).
fn files_under(dir: &str) -> Vec<PathBuf> {
    let written = |p: &PathBuf| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or(".");
        !name.starts_with('.') && name.ends_with(".json")
    };
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(written).collect())
        .unwrap_or_default()
}

#[test]
fn a_recording_replays_the_same_on_its_policy_and_catches_a_candidate_that_denies_an_access_mode() {
    let node = Node::start(true);
    let mut dirs = Vec::new();
    for (pod, volume, mode) in [
        ("p1", "pv-rwo", "ReadWriteOnce"),
        ("p2", "pv-rox", "ReadOnlyMany"),
        ("p3", "pv-rwx", "ReadWriteMany"),
    ] {
        let (dir, r) = node.mount(pod, volume, mode);
        assert_success(&r);
        dirs.push(dir);
    }
    for dir in &dirs {
        node.unmount(dir);
    }
    // Each mount is a fence and an attach, each unmount a detach.
    let recorded = node.path("recordings/local-pv");
    wait_until(WAIT, "nine recorded calls", || files_under(&recorded).len() >= 9);
    for file in files_under(&recorded) {
        let text = std::fs::read_to_string(&file).expect("recording");
        assert!(!text.contains(SECRET), "{} holds the secret's value", file.display());
        assert!(text.contains("\"password\""), "the secret's key is recorded by name");
        let mode = std::fs::metadata(&file).expect("stat");
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777, 0o600);
    }
    let status = node.status();
    assert_eq!(status["recording"], serde_json::json!(["local-pv"]), "{status}");

    // The recording as a suite: the policy that made it passes it.
    let suites = node.path("suites");
    let out = volagent(&["plugin", "record", &node.path("recordings"), "--out", &suites]);
    assert!(out.status.success());
    assert!(stdout(&out).contains("local-pv: "), "{}", stdout(&out));
    let suite = format!("{suites}/local-pv.scenarios.yaml");
    let out = volagent(&["plugin", "test", volagent_test_artifacts::LOCAL_PV, &suite]);
    assert!(out.status.success(), "the recorded suite passes on the policy that made it");

    // Replayed on the same version: nothing differs.
    let out = volagent(&[
        "plugin",
        "replay",
        volagent_test_artifacts::LOCAL_PV,
        &node.path("recordings"),
    ]);
    assert!(out.status.success());
    assert!(
        stdout(&out).contains(" 0 otherwise") && stdout(&out).contains("PASS"),
        "{}",
        stdout(&out)
    );

    // A candidate that denies ReadOnlyMany: one fence became a refusal.
    let strict = volagent_test_artifacts::LOCAL_PV_STRICT;
    let out = volagent(&["plugin", "replay", strict, &node.path("recordings")]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(text.contains("became-refused: 1\n"), "{text}");
    assert!(text.contains("fence pv-rox for default/p2 on node-a"), "{text}");
    assert!(text.contains("refuses ReadOnlyMany"), "{text}");
    assert!(text.contains("FAIL: differences not allowed: became-refused (1)"), "{text}");
    // The suite made from the recording catches it as well.
    let out = volagent(&["plugin", "replay", strict, &suite]);
    assert_eq!(out.status.code(), Some(1));
    // Expected differences may be allowed.
    let out = volagent(&[
        "plugin",
        "replay",
        strict,
        &node.path("recordings"),
        "--allow",
        "became-refused,steps",
    ]);
    assert!(out.status.success(), "{}", stdout(&out));

    // Switched off at run time: mounts are no longer recorded.
    let socket = node.path("run/agent.sock");
    let out = volagent(&["plugin", "recording", "local-pv", "off", "--socket", &socket]);
    assert!(out.status.success());
    let before = files_under(&recorded).len();
    let (dir, r) = node.mount("p4", "pv-quiet", "ReadWriteOnce");
    assert_success(&r);
    node.unmount(&dir);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(files_under(&recorded).len(), before, "nothing recorded while switched off");
    assert!(node.status().get("recording").is_none_or(|r| r.as_array().is_some_and(Vec::is_empty)));
}

#[test]
fn a_candidate_in_the_shadow_is_counted_without_effect_then_promoted_and_rolled_back() {
    let node = Node::start(false);
    let plugins = node.path("plugins");
    let original = sha256(&format!("{plugins}/local-pv.wasm"));
    let strict = sha256(volagent_test_artifacts::LOCAL_PV_STRICT);
    // The candidate ships a scenario of its own, which the version serving
    // fails: it goes with the candidate, and comes back with it.
    std::fs::write(format!("{plugins}/local-pv.candidate.scenarios.yaml"), STRICT_SCENARIO)
        .expect("scenarios");
    std::fs::copy(volagent_test_artifacts::LOCAL_PV_STRICT, format!("{plugins}/.tmp"))
        .expect("copy");
    std::fs::rename(format!("{plugins}/.tmp"), format!("{plugins}/local-pv.candidate.wasm"))
        .expect("rename");
    wait_until(WAIT, "the candidate in the shadow", || {
        node.status()["shadows"][0]["sha256"].as_str() == Some(&strict)
    });
    assert_eq!(node.serving_sha(), original, "a candidate does not serve");

    // The serving version answers; the candidate's refusal is only counted.
    let (rwo, r) = node.mount("p1", "pv-rwo", "ReadWriteOnce");
    assert_success(&r);
    let (rox, r) = node.mount("p2", "pv-rox", "ReadOnlyMany");
    assert_success(&r);
    wait_until(WAIT, "the refusal counted", || {
        node.status()["shadows"][0]["differences"]["became-refused"] == 1
    });
    let status = node.status();
    let shadow = &status["shadows"][0];
    assert_eq!(shadow["differences"].as_object().map(|d| d.len()), Some(1), "{shadow}");
    assert!(shadow["compared"].as_u64() >= Some(4), "{shadow}");
    assert!(
        shadow["examples"][0]["call"]
            .as_str()
            .is_some_and(|c| c.starts_with("fence pv-rox for default/p2")),
        "{shadow}"
    );
    let text = stdout(&volagent(&["plugin", "status", "--socket", &node.path("run/agent.sock")]));
    assert!(text.contains("shadow of local-pv") && text.contains("became-refused: 1"), "{text}");
    node.unmount(&rwo);
    node.unmount(&rox);

    // Promoted: it serves, and the old version is kept for a rollback.
    let out = node.volagent_trusting(&["plugin", "promote", "local-pv", "--dir", &plugins]);
    assert!(out.status.success());
    assert_eq!(sha256(&format!("{plugins}/local-pv.previous.wasm")), original);
    assert!(!std::path::Path::new(&format!("{plugins}/local-pv.candidate.wasm")).exists());
    let scenarios = |name: &str| std::fs::read_to_string(format!("{plugins}/{name}")).ok();
    assert_eq!(scenarios("local-pv.scenarios.yaml").as_deref(), Some(STRICT_SCENARIO));
    wait_until(WAIT, "the promoted version to serve", || node.serving_sha() == strict);
    wait_until(WAIT, "the shadow to end", || {
        node.status()["shadows"].as_array().is_none_or(Vec::is_empty)
    });
    let (_, r) = node.mount("p3", "pv-rox2", "ReadOnlyMany");
    assert_failure(&r, "refuses ReadOnlyMany");

    // Rolled back: the old version serves again, the new one is kept.
    let out = node.volagent_trusting(&["plugin", "rollback", "local-pv", "--dir", &plugins]);
    assert!(out.status.success());
    assert_eq!(sha256(&format!("{plugins}/local-pv.previous.wasm")), strict);
    // Its scenario went with it: the old version, which fails it, serves.
    assert_eq!(scenarios("local-pv.scenarios.yaml"), None);
    assert_eq!(scenarios("local-pv.previous.scenarios.yaml").as_deref(), Some(STRICT_SCENARIO));
    wait_until(WAIT, "the old version to serve again", || node.serving_sha() == original);
    let (dir, r) = node.mount("p3", "pv-rox2", "ReadOnlyMany");
    assert_success(&r);
    node.unmount(&dir);

    // A candidate that is not one (another backend under the name) is
    // refused, and nothing runs in the shadow.
    std::fs::copy(volagent_test_artifacts::SHARED_FILE, format!("{plugins}/.tmp")).expect("copy");
    std::fs::rename(format!("{plugins}/.tmp"), format!("{plugins}/local-pv.candidate.wasm"))
        .expect("rename");
    wait_until(WAIT, "the wrong candidate refused", || {
        node.status()["problems"].as_array().is_some_and(|p| {
            p.iter().any(|p| {
                p["state"] == "candidate-rejected"
                    && p["reason"].as_str().is_some_and(|r| r.contains("it is backend shared-file"))
            })
        })
    });
    assert!(node.status()["shadows"].as_array().is_none_or(Vec::is_empty));
    let out = node.volagent_trusting(&["plugin", "promote", "local-pv", "--dir", &plugins]);
    assert!(!out.status.success(), "a wrong candidate is not promoted");
    assert_eq!(sha256(&format!("{plugins}/local-pv.wasm")), original, "and nothing moved");
}

#[test]
fn an_unlisted_or_unsigned_policy_is_refused_while_the_trusted_one_serves() {
    let node = Node::start_trusting_little();
    let plugins = node.path("plugins");
    let original = sha256(&format!("{plugins}/local-pv.wasm"));
    let strict_file = volagent_test_artifacts::LOCAL_PV_STRICT;
    let strict = sha256(strict_file);
    wait_until(WAIT, "local-pv to serve", || node.serving_sha() == original);

    // Neither listed nor signed: refused before it runs, the old serves.
    node.install(strict_file, "local-pv.wasm");
    let p =
        node.problem_saying("plugins/local-pv.wasm", "untrusted", &["not trusted", "no signature"]);
    assert_eq!(p["sha256"], strict.as_str(), "{p}");
    assert!(p["reason"].as_str().is_some_and(|r| r.contains(&strict)), "{p}");
    assert_eq!(node.serving_sha(), original);
    let (dir, r) = node.mount("p1", "pv-rox", "ReadOnlyMany");
    assert_success(&r);
    node.unmount(&dir);

    // Signed with a key the agent was not given: refused the same.
    node.sign("local-pv.wasm", "other");
    node.problem_saying("plugins/local-pv.wasm", "untrusted", &["verifies with none", "admin.pub"]);
    assert_eq!(node.serving_sha(), original);

    // Signed with the admin's key: it serves (the signature's arrival is
    // the change; the file is the same).
    node.sign("local-pv.wasm", "admin");
    wait_until(WAIT, "the signed version to serve", || node.serving_sha() == strict);
    let (_, r) = node.mount("p2", "pv-rox2", "ReadOnlyMany");
    assert_failure(&r, "refuses ReadOnlyMany");

    // Back to the listed version; a new backend is listed by a line added
    // to the allow-list, without touching its file.
    std::fs::remove_file(format!("{plugins}/local-pv.wasm.minisig")).expect("rm");
    node.install(volagent_test_artifacts::LOCAL_PV, "local-pv.wasm");
    wait_until(WAIT, "the listed version to serve again", || node.serving_sha() == original);
    node.install(volagent_test_artifacts::CORE_ONLY, "core-only.wasm");
    node.problem_saying("plugins/core-only.wasm", "untrusted", &["not trusted", "1 entries"]);
    let list = node.path("trusted-policies");
    write_allow_list(
        std::path::Path::new(&list),
        &[
            ("local-pv", volagent_test_artifacts::LOCAL_PV),
            ("core-only", volagent_test_artifacts::CORE_ONLY),
        ],
    );
    wait_until(WAIT, "the newly listed backend to serve", || {
        node.status()["backends"]
            .as_array()
            .is_some_and(|b| b.iter().any(|b| b["name"] == "core-only"))
    });
    // Listed for one backend, a file that is another is refused.
    let mut text = std::fs::read_to_string(&list).expect("list");
    text.push_str(&format!("nbd {}\n", sha256(volagent_test_artifacts::SHARED_FILE)));
    std::fs::write(&list, text).expect("list");
    node.install(volagent_test_artifacts::SHARED_FILE, "nbd.wasm");
    node.problem_saying(
        "plugins/nbd.wasm",
        "untrusted",
        &["listed for nbd", "backend shared-file"],
    );

    // An untrusted candidate never runs in the shadow, and is not promoted.
    node.install(strict_file, "local-pv.candidate.wasm");
    node.problem_saying("plugins/local-pv.candidate.wasm", "candidate-rejected", &["not trusted"]);
    assert!(node.status()["shadows"].as_array().is_none_or(Vec::is_empty));
    let out = node.volagent_trusting(&["plugin", "promote", "local-pv", "--dir", &plugins]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not trusted"), "says why");
    assert_eq!(sha256(&format!("{plugins}/local-pv.wasm")), original, "and nothing moved");
    // Signed, it runs in the shadow and is promoted with its signature,
    // which moves with it.
    node.sign("local-pv.candidate.wasm", "admin");
    wait_until(WAIT, "the signed candidate in the shadow", || {
        node.status()["shadows"][0]["sha256"].as_str() == Some(&strict)
    });
    let out = node.volagent_trusting(&["plugin", "promote", "local-pv", "--dir", &plugins]);
    assert!(out.status.success());
    let verify = |file: &str| {
        Command::new("minisign")
            .args(["-V", "-q", "-p", &node.path("keys/admin.pub"), "-m"])
            .arg(format!("{plugins}/{file}"))
            .status()
            .expect("minisign")
            .success()
    };
    assert!(verify("local-pv.wasm"), "the signature moved with the version it signs");
    let kept = format!("{plugins}/local-pv.previous.wasm");
    assert_eq!(sha256(&kept), original);
    assert!(!std::path::Path::new(&format!("{kept}.minisig")).exists(), "the kept one was listed");
    wait_until(WAIT, "the promoted version to serve", || node.serving_sha() == strict);

    // A malformed allow-list trusts nothing and says so: a listed version
    // is refused, a signed one serves on.
    std::fs::write(&list, "local-pv nonsense\n").expect("list");
    node.problem_saying("trusted-policies", "allow-list-invalid", &["line 1", "not a sha256"]);
    std::fs::remove_file(format!("{plugins}/local-pv.wasm.minisig")).expect("rm");
    node.install(volagent_test_artifacts::LOCAL_PV, "local-pv.wasm");
    node.problem_saying("plugins/local-pv.wasm", "untrusted", &["line 1"]);
    assert_eq!(node.serving_sha(), strict);
    // Mended, and the strict version revoked: the listed one serves, and
    // the strict one is refused though its signature verifies.
    write_allow_list(
        std::path::Path::new(&list),
        &[("local-pv", volagent_test_artifacts::LOCAL_PV)],
    );
    let mut text = std::fs::read_to_string(&list).expect("list");
    text.push_str(&format!("!{strict}  # refuses ReadOnlyMany\n"));
    std::fs::write(&list, text).expect("list");
    wait_until(WAIT, "the listed version to serve", || node.serving_sha() == original);
    node.install(strict_file, "local-pv.candidate.wasm");
    node.sign("local-pv.candidate.wasm", "admin");
    node.problem_saying("plugins/local-pv.candidate.wasm", "candidate-rejected", &["revoked"]);
}
