//! Time from a backend file's rename into the plugin dir of a running agent
//! to the first successful call on the new version: for a new backend, its
//! freshly installed driver's `init`; for an update and a rollback, `init`
//! once the agent reports the file's sha256. New backends and updates are
//! versions the agent has not seen (compiled on the way); a rollback goes
//! back to one it loaded before (kept compiled). The agent passes at most
//! once a second, so rounds are spaced by more than that.
//! Run: `cargo bench -p volagent --bench hot_reload` (no root needed).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use volagent::socket::protocol::{self, Request, Response};
use volagent::stats::summarize;
use volagent_test_support::agent::AgentBuilder;
use volagent_test_support::policy::with_custom_section;
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
    let shared_file = std::fs::read(volagent_test_artifacts::SHARED_FILE).expect("guest");
    let local_pv = std::fs::read(volagent_test_artifacts::LOCAL_PV).expect("guest");
    // Every round's versions are new to the agent (a custom section of
    // their own), and listed ahead: a change to the list would start a
    // pass of its own, and the round would time two.
    let versions = |bytes: &[u8], what: &str| -> Vec<Vec<u8>> {
        (0..ROUNDS).map(|round| with_custom_section(bytes, &format!("{what}-{round}"))).collect()
    };
    let (added_versions, updates) =
        (versions(&shared_file, "added"), versions(&local_pv, "updated"));
    volagent_test_support::agent::write_allow_list(
        &at("trusted-policies"),
        volagent_test_artifacts::LOADABLE,
    );
    let mut list = std::fs::read_to_string(at("trusted-policies")).expect("allow-list");
    for (backend, bytes) in std::iter::repeat("shared-file")
        .zip(&added_versions)
        .chain(std::iter::repeat("local-pv").zip(&updates))
    {
        list.push_str(&format!("{backend} {}\n", sha256(bytes)));
    }
    std::fs::write(at("trusted-policies"), list).expect("allow-list");
    let mut agent =
        AgentBuilder::new(VOLAGENT, "bench").under(dir.path()).args(["--allow-uid", &uid]).spawn();
    let socket = at("run/agent.sock");
    let local_pv_driver = at("vpd/volagent~local-pv/local-pv");
    let serves = |bytes: &[u8]| {
        let sha = sha256(bytes);
        wait(|| {
            serving_sha(&socket, "local-pv").as_deref() == Some(sha.as_str())
                && init_ok(&local_pv_driver)
        });
    };

    let (mut added, mut updated, mut rolled_back) = (Vec::new(), Vec::new(), Vec::new());
    for (new_backend, update) in added_versions.iter().zip(&updates) {
        // A new backend appears.
        let t = Instant::now();
        install(&at("plugins"), "shared-file.wasm", new_backend);
        let driver = at("vpd/volagent~shared-file/shared-file");
        wait(|| driver.exists() && init_ok(&driver));
        added.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(1100));

        // An existing backend is updated to a version new to the agent.
        let t = Instant::now();
        install(&at("plugins"), "local-pv.wasm", update);
        serves(update);
        updated.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(1100));

        // And rolled back to the version that served before the update (the
        // first, each round), which the agent loaded then.
        let t = Instant::now();
        install(&at("plugins"), "local-pv.wasm", &local_pv);
        serves(&local_pv);
        rolled_back.push(t.elapsed());

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
    println!(
        "hot reload, {ROUNDS} rounds: rename into the plugin dir -> first successful call on the new version"
    );
    for (what, times) in [
        ("new backend, new version (driver installed, init answers)", &mut added),
        ("updated backend, new version (its sha serving, init answers)", &mut updated),
        ("rolled back to a version loaded before (sha serving, init)", &mut rolled_back),
    ] {
        let s = summarize(times);
        println!("{what:<62} p50 {:>7.1} ms   max {:>7.1} ms", s.p50 / 1e3, s.max / 1e3);
    }
    println!(
        "target <= 100 ms (a rename into place is whole: the pass waits 20 ms for the rest of a batch, then compiles a new version; the last 4 loaded are kept compiled)"
    );
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
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
