//! The single-node Ceph of a test run (scripts/ceph-env starts it and
//! scripts/test exports VOLAGENT_CEPH_DIR): its dir, the `rbd` tool on it,
//! images removed on drop, and the test user's key.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The test cluster's dir (ceph.conf, keyrings), from the environment,
/// once the cluster has taken a write (see [`probe`]).
pub fn ceph_dir() -> PathBuf {
    let dir = PathBuf::from(std::env::var("VOLAGENT_CEPH_DIR").expect(
        "VOLAGENT_CEPH_DIR: the single-node Ceph of this run (scripts/ceph-env start makes it; scripts/test sets it)",
    ));
    assert!(dir.join("ready").exists(), "no Ceph ready in {}", dir.display());
    static PROBED: OnceLock<Result<(), String>> = OnceLock::new();
    if let Err(why) = PROBED.get_or_init(|| probe(&dir)) {
        panic!("{why}");
    }
    dir
}

/// Whether the cluster in `dir` takes a write within seconds: an object
/// made and removed in pool `rbd`, tried twice. A cluster that stopped
/// answering once made every test after it wait for it without end, each
/// holding one of the run's test slots. The first test to find it so
/// leaves the diagnosis in `dir/broken`, so the tests after it fail at
/// once.
fn probe(dir: &Path) -> Result<(), String> {
    let broken = dir.join("broken");
    if let Ok(why) = std::fs::read_to_string(&broken) {
        return Err(why);
    }
    // One ceph command's limit, as scripts/ceph-env takes it (an emulated
    // CPU sets more).
    let step: u64 =
        std::env::var("VOLAGENT_CEPH_TIMEOUT").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let rados = |op: &str, object: &str| {
        // The client's own limits first; `timeout` in case it ignores them.
        let out = Command::new("timeout")
            .arg((2 * step).to_string())
            .args(["rados", "-c"])
            .arg(dir.join("ceph.conf"))
            .args(["--client_mount_timeout", &step.to_string()])
            .args(["--rados_mon_op_timeout", &step.to_string()])
            .args(["--rados_osd_op_timeout", &step.to_string(), "-p", "rbd", op, object])
            .output()
            .expect("timeout (coreutils), rados (ceph-common)");
        if out.status.success() {
            return Ok(());
        }
        Err(format!(
            "rados {op} {object}: {}, {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    };
    let mut failed = Vec::new();
    for _ in 0..2 {
        let object = format!("probe-{}-{}", std::process::id(), rand_suffix());
        match rados("create", &object).and_then(|()| rados("rm", &object)) {
            Ok(()) => return Ok(()),
            Err(why) => failed.push(why),
        }
    }
    let why = format!(
        "the run's Ceph in {} took no write ({}); the tests after this one fail at once\n{}",
        dir.display(),
        failed.join("; "),
        cluster_state(dir)
    );
    let _ = std::fs::write(&broken, &why);
    Err(why)
}

/// What a failed probe prints: whether the daemons still run, and the
/// last lines each logged.
fn cluster_state(dir: &Path) -> String {
    let mut state = String::new();
    for pid_file in std::fs::read_dir(dir.join("run")).into_iter().flatten().flatten() {
        let name = pid_file.file_name().to_string_lossy().into_owned();
        let Some(daemon) = name.strip_suffix(".pid") else { continue };
        let pid = std::fs::read_to_string(pid_file.path()).unwrap_or_default();
        let alive = Path::new("/proc").join(pid.trim()).exists();
        state +=
            &format!("{daemon}: pid {}, {}\n", pid.trim(), if alive { "running" } else { "gone" });
        // What the daemon itself says: its state, and any request it holds.
        let socket = dir.join("run").join(format!("ceph-{daemon}.asok"));
        // (A monitor that answers at all is enough to know.)
        let commands: &[&str] = if daemon.starts_with("osd.") {
            &["status", "dump_ops_in_flight"]
        } else {
            &["version"]
        };
        for command in commands {
            let out = Command::new("timeout")
                .args(["10", "ceph", "--admin-daemon"])
                .arg(&socket)
                .arg(command)
                .output();
            let Ok(out) = out else { continue };
            let said = if out.status.success() { out.stdout } else { out.stderr };
            state += &format!(
                "{daemon} {command} ({}): {}\n",
                out.status,
                String::from_utf8_lossy(&said).trim()
            );
        }
    }
    for log in std::fs::read_dir(dir.join("log")).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(log.path()).unwrap_or_default();
        // Without the monitor's debug chatter (a map every 5 s).
        let lines: Vec<&str> = text.lines().filter(|l| !l.contains("[DBG]")).collect();
        if lines.is_empty() {
            continue;
        }
        state += &format!("--- {} (last lines)\n", log.path().display());
        for line in &lines[lines.len().saturating_sub(25)..] {
            state += line;
            state.push('\n');
        }
    }
    state
}

pub fn rbd(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new("rbd")
        .arg("-c")
        .arg(dir.join("ceph.conf"))
        .args(args)
        .output()
        .expect("rbd (ceph-common)");
    assert!(out.status.success(), "rbd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// An image of `mib` MiB in pool `rbd`, removed on drop.
pub struct Image {
    pub dir: PathBuf,
    pub name: String,
}

impl Image {
    pub fn create(dir: &Path, mib: u64) -> Image {
        let name = format!("test-{}-{}", std::process::id(), rand_suffix());
        rbd(dir, &["create", "--size", &format!("{mib}M"), &format!("rbd/{name}")]);
        Image { dir: dir.to_path_buf(), name }
    }

    pub fn spec(&self) -> String {
        format!("rbd/{}", self.name)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = Command::new("rbd")
            .arg("-c")
            .arg(self.dir.join("ceph.conf"))
            .args(["rm", "--no-progress", &self.spec()])
            .output();
    }
}

pub fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    h.finish()
}

/// The key of client.volagent, a node's user (mon 'allow r', osd 'profile
/// rbd pool=rbd': it may not blocklist).
pub fn volagent_key(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("volagent.key")).unwrap().trim().to_string()
}

/// The key of client.volagent-controller, the controller's user (also
/// mon 'allow command "osd blocklist"').
pub fn controller_key(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("volagent-controller.key")).unwrap().trim().to_string()
}

/// The clients watching `image` ("client.<id>" each).
pub fn watchers(image: &Image) -> Vec<String> {
    let out = rbd(&image.dir, &["status", "--format", "json", &image.spec()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["watchers"].as_array().unwrap().iter().map(|w| format!("client.{}", w["client"])).collect()
}

/// The addresses of the clients holding a lock on `image`.
pub fn lockers(image: &Image) -> Vec<String> {
    let out = rbd(&image.dir, &["lock", "ls", "--format", "json", &image.spec()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["address"].as_str().map(String::from))
        .collect()
}
