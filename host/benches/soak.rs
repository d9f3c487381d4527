//! The soak run (not in CI): one standalone agent, for hours, under random
//! mounts and unmounts of its local volumes through the installed driver,
//! hot reloads of its plugin, and restarts (SIGTERM or SIGKILL); its
//! memory, file descriptors and threads sampled all along. At the end,
//! every volume is unmounted, the ledger read back (no holder may be
//! left), and a summary printed: what was done, what failed, and whether
//! each agent's resources stayed flat.
//! Needs root. Run: `scripts/soak 2h` (see there for the knobs).

use std::time::{Duration, Instant};
use volagent_test_support::agent::Node;
use volagent_test_support::driver;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One agent process's resources at one moment.
#[derive(Clone, Copy)]
struct Sample {
    at: Duration,
    rss_kib: u64,
    fds: u64,
    threads: u64,
}

fn sample(pid: i32, at: Duration) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some(Sample { at, rss_kib: field("VmRSS:")?, fds, threads: field("Threads:")? })
}

/// The mean of `f` over the first and the last quarter of `samples`.
fn quarters(samples: &[Sample], f: impl Fn(&Sample) -> u64) -> (f64, f64) {
    let q = (samples.len() / 4).max(1);
    let mean = |s: &[Sample]| s.iter().map(&f).sum::<u64>() as f64 / s.len() as f64;
    (mean(&samples[..q]), mean(&samples[samples.len() - q..]))
}

#[derive(Default)]
struct Counts {
    mounts: u64,
    unmounts: u64,
    reloads: u64,
    restarts: u64,
    kills: u64,
    /// Failures a running agent answered with, by message.
    failures: std::collections::BTreeMap<String, u64>,
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("soak needs root: loop devices and mounts");
        std::process::exit(1);
    }
    let secs = knob("SOAK_SECS", 3600);
    let volumes = knob("SOAK_VOLUMES", 20) as usize;
    let sample_every = Duration::from_secs(knob("SOAK_SAMPLE_SECS", 10));
    let restart_every = Duration::from_secs(knob("SOAK_RESTART_SECS", 900));
    let seed = knob(
        "SOAK_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1),
    );
    println!(
        "soak: {secs} s, {volumes} volumes, seed {seed}, samples every {sample_every:?}, a restart about every {restart_every:?}"
    );
    let mut rng = fastrand::Rng::with_seed(seed);

    let mut node = Node::start_alone_for(VOLAGENT, Duration::from_secs(secs + 3600));
    let vols: Vec<(String, String)> = (0..volumes)
        .map(|i| {
            let name = format!("pv-s{i}");
            let image = node.image(&format!("s{i}.img"), 32);
            let dir = node.mount_dir(&format!("uid-s{i}"), &name);
            let opts = driver::kubelet_options(
                &name,
                &format!("pod-s{i}"),
                &format!("uid-s{i}"),
                "ext4",
                &image,
            )
            .to_string();
            (dir, opts)
        })
        .collect();
    let mut mounted = vec![false; volumes];
    let mut counts = Counts::default();
    // Samples of each agent process, in the order they ran.
    let mut lifetimes: Vec<Vec<Sample>> = vec![Vec::new()];
    let start = Instant::now();
    let (mut next_sample, mut next_restart) = (Duration::ZERO, restart_every);
    let plugin = node.scratch.path("plugins/local-pv.wasm");

    while start.elapsed() < Duration::from_secs(secs) {
        let now = start.elapsed();
        if now >= next_sample {
            if let Some(s) = sample(node.pid_of("node-a"), now) {
                lifetimes.last_mut().expect("a lifetime").push(s);
            }
            next_sample = now + sample_every;
        }
        if now >= next_restart {
            if rng.bool() {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(node.pid_of("node-a")),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .expect("kill");
                counts.kills += 1;
            }
            node.stop_agent_of("node-a");
            node.spawn_agent("node-a");
            counts.restarts += 1;
            lifetimes.push(Vec::new());
            next_restart = now + restart_every;
            continue;
        }
        match rng.u8(0..100) {
            // A reload: the same policy written again (a new file, renamed in).
            0 => {
                let fresh = plugin.with_extension("tmp");
                std::fs::copy(volagent_test_artifacts::LOCAL_PV, &fresh).expect("copy the plugin");
                std::fs::rename(&fresh, &plugin).expect("rename the plugin in");
                counts.reloads += 1;
            }
            _ => {
                let i = rng.usize(..volumes);
                let (dir, opts) = &vols[i];
                let args: Vec<&str> =
                    if mounted[i] { vec!["unmount", dir] } else { vec!["mount", dir, opts] };
                let (code, reply) =
                    driver::run_driver(std::process::Command::new(node.driver_path()).args(&args));
                if code == 0 && reply["status"] == "Success" {
                    mounted[i] = !mounted[i];
                    if mounted[i] {
                        counts.mounts += 1;
                    } else {
                        counts.unmounts += 1;
                    }
                } else {
                    let message = reply["message"].as_str().unwrap_or_default().to_string();
                    *counts.failures.entry(message).or_insert(0) += 1;
                }
            }
        }
    }

    for (i, (dir, _)) in vols.iter().enumerate() {
        if mounted[i] {
            let (code, reply) = driver::run_driver(
                std::process::Command::new(node.driver_path()).args(["unmount", dir]),
            );
            if code != 0 {
                *counts
                    .failures
                    .entry(format!("final unmount: {}", reply["message"]))
                    .or_insert(0) += 1;
            }
        }
    }
    let (left_mounts, left_loops) = (node.scratch.mounts().len(), node.scratch.loops().len());
    // The ledger, read back once the agent has stopped: every unmount
    // removed its holder, whatever the kills cut short.
    node.stop_agent_of("node-a");
    let left_holders: Vec<String> =
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(async {
            use volagent::ledger::Ledger;
            let ledger = volagent::ledger::embedded::EmbeddedLedger::open(
                &node.ledger_path("node-a"),
                false,
            )
            .expect("open the ledger");
            let records = ledger.list_by_node("node-a").await.expect("read the ledger");
            records
                .into_iter()
                .flat_map(|(r, _)| {
                    r.holders
                        .into_iter()
                        .map(move |h| format!("{} {}", r.volume, h.consumer.mount_dir))
                })
                .collect()
        });

    println!(
        "ran {:?}: {} mounts, {} unmounts, {} reloads, {} restarts ({} by SIGKILL)",
        start.elapsed(),
        counts.mounts,
        counts.unmounts,
        counts.reloads,
        counts.restarts,
        counts.kills
    );
    println!(
        "left after the last unmounts: {left_mounts} mounts, {left_loops} loop devices, {} holders in the ledger",
        left_holders.len()
    );
    for holder in &left_holders {
        println!("still held: {holder}");
    }
    if counts.failures.is_empty() {
        println!("failures: none");
    }
    for (message, n) in &counts.failures {
        println!("failure x{n}: {message}");
    }
    println!("{:>8} {:>10} {:>6} {:>8}", "time s", "RSS KiB", "fds", "threads");
    for (life, samples) in lifetimes.iter().enumerate() {
        println!("agent #{}", life + 1);
        for s in samples {
            println!("{:>8} {:>10} {:>6} {:>8}", s.at.as_secs(), s.rss_kib, s.fds, s.threads);
        }
    }
    let mut flat = true;
    for (life, samples) in lifetimes.iter().enumerate().filter(|(_, s)| s.len() >= 8) {
        let (r0, r1) = quarters(samples, |s| s.rss_kib);
        let (f0, f1) = quarters(samples, |s| s.fds);
        let (t0, t1) = quarters(samples, |s| s.threads);
        // Flat: the last quarter's mean within 10% (and a few units) of the first's.
        let grew = |a: f64, b: f64, slack: f64| b > a * 1.1 + slack;
        let verdict = if grew(r0, r1, 1024.0) || grew(f0, f1, 4.0) || grew(t0, t1, 4.0) {
            "GREW"
        } else {
            "flat"
        };
        flat &= verdict == "flat";
        println!(
            "agent #{}: RSS {r0:.0} -> {r1:.0} KiB, fds {f0:.1} -> {f1:.1}, threads {t0:.1} -> {t1:.1} (first -> last quarter): {verdict}",
            life + 1
        );
    }
    let clean = counts.failures.is_empty()
        && left_mounts == 0
        && left_loops == 0
        && left_holders.is_empty();
    println!("soak: {}", if clean && flat { "PASSED" } else { "FAILED" });
    if !(clean && flat) {
        std::process::exit(1);
    }
}
