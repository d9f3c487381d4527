//! Time from a backend file's rename into the plugin dir of a running agent
//! to the first successful call on the new version: for a new backend, its
//! freshly installed driver's `init`; for an update, `init` once the agent
//! reports the new file's sha256. The agent passes at most once a second,
//! so rounds are spaced by more than that.
//! Run: `cargo bench -p volagent --bench hot_reload` (no root needed).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use volagent::socket::protocol::{self, Request, Response};
use volagent::stats::summarize;
use volagent_test_support::agent::AgentBuilder;
use volagent_test_support::{Deadline, wait_until};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const ROUNDS: usize = 10;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    let dir = tempfile::tempdir().expect("scratch dir");
    let at = |p: &str| dir.path().join(p);
    std::fs::create_dir_all(at("plugins")).expect("dir");
    std::fs::copy(volagent_test_artifacts::LOCAL_PV, at("plugins/local-pv.wasm")).expect("plugin");
    let uid = nix::unistd::geteuid().as_raw().to_string();
    let new_backend = std::fs::read(volagent_test_artifacts::SHARED_FILE).expect("guest");
    let local_pv = std::fs::read(volagent_test_artifacts::LOCAL_PV).expect("guest");
    // Every round's version is listed ahead: a change to the list would
    // start a pass of its own, and the round would time two.
    let updates: Vec<Vec<u8>> = (0..ROUNDS)
        .map(|round| with_custom_section(&local_pv, &format!("bench-round-{round}")))
        .collect();
    volagent_test_support::agent::write_allow_list(
        &at("trusted-policies"),
        volagent_test_artifacts::LOADABLE,
    );
    let mut list = std::fs::read_to_string(at("trusted-policies")).expect("allow-list");
    for bytes in &updates {
        use sha2::Digest;
        list.push_str(&format!("local-pv {}\n", hex::encode(sha2::Sha256::digest(bytes))));
    }
    std::fs::write(at("trusted-policies"), list).expect("allow-list");
    let mut agent =
        AgentBuilder::new(VOLAGENT, "bench").under(dir.path()).args(["--allow-uid", &uid]).spawn();
    let socket = at("run/agent.sock");

    let (mut added, mut updated) = (Vec::new(), Vec::new());
    for bytes in &updates {
        // A new backend appears.
        let t = Instant::now();
        install(&at("plugins"), "shared-file.wasm", &new_backend);
        let driver = at("vpd/volagent~shared-file/shared-file");
        wait(|| driver.exists() && init_ok(&driver));
        added.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(1100));

        // An existing backend is updated: the same policy with a different
        // sha256 (a custom section appended).
        let sha = {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(bytes))
        };
        let t = Instant::now();
        install(&at("plugins"), "local-pv.wasm", bytes);
        let driver = at("vpd/volagent~local-pv/local-pv");
        wait(|| {
            serving_sha(&socket, "local-pv").as_deref() == Some(sha.as_str()) && init_ok(&driver)
        });
        updated.push(t.elapsed());

        // Removed again; the next round starts more than a second after
        // that pass, as a rename on a quiet node would.
        std::fs::remove_file(at("plugins/shared-file.wasm")).expect("remove");
        let gone = at("vpd/volagent~shared-file");
        wait(|| !gone.exists());
        std::thread::sleep(Duration::from_millis(1100));
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = agent.wait();
    let (a, u) = (summarize(&mut added), summarize(&mut updated));
    println!(
        "hot reload, {ROUNDS} rounds: rename into the plugin dir -> first successful call on the new version"
    );
    println!(
        "new backend (driver installed, init answers)   p50 {:>7.1} ms   max {:>7.1} ms",
        a.p50 / 1e3,
        a.max / 1e3
    );
    println!(
        "updated backend (new sha serving, init answers) p50 {:>7.1} ms   max {:>7.1} ms",
        u.p50 / 1e3,
        u.max / 1e3
    );
    println!(
        "target <= 100 ms (a rename into place is whole: the pass waits 20 ms for the rest of a batch, then compiles)"
    );
}

fn install(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}"));
    std::fs::write(&tmp, bytes).expect("write");
    std::fs::rename(&tmp, dir.join(name)).expect("rename");
}

/// Waits for the new version; polled often, as its time is what is measured.
fn wait(done: impl FnMut() -> bool) {
    let deadline = Deadline::within(Duration::from_secs(10)).polling(Duration::from_millis(5));
    wait_until(deadline, "the new version to answer", done);
}

fn init_ok(driver: &PathBuf) -> bool {
    Command::new(driver).arg("init").output().is_ok_and(|o| o.status.success())
}

fn serving_sha(socket: &Path, backend: &str) -> Option<String> {
    let mut s = UnixStream::connect(socket).ok()?;
    match protocol::exchange(&mut s, Request::Status).ok()? {
        Response::Status { backends, .. } => {
            backends.into_iter().find(|b| b.name == backend).map(|b| b.sha256)
        }
        _ => None,
    }
}

/// `bytes` with a custom section (id 0) named `name` appended: still a
/// valid component, with another sha256.
fn with_custom_section(bytes: &[u8], name: &str) -> Vec<u8> {
    let mut payload = Vec::new();
    leb128(&mut payload, name.len() as u64);
    payload.extend_from_slice(name.as_bytes());
    let mut out = bytes.to_vec();
    out.push(0);
    leb128(&mut out, payload.len() as u64);
    out.extend_from_slice(&payload);
    out
}

fn leb128(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}
