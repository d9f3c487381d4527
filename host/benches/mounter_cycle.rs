//! What the node's mounter costs an attach and a detach: a userspace NBD
//! volume — a local file behind the agent's helper server, reached through
//! its FUSE client and a loop device — mounted and unmounted through the
//! installed Flexvolume driver, by an agent that starts the helper and the
//! client itself and by one that has a mounter start them (a socket round
//! trip per process, its descriptors passed along), in alternating blocks
//! of the same run. Needs root.
//! Run: `cargo bench -p volagent --bench mounter_cycle`;
//! `MOUNTER_CYCLE_CYCLES` sets the cycles per mode (default 40).

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use volagent::stats::{Summary, summarize};
use volagent_test_support::agent::Node;
use volagent_test_support::driver::{assert_success, run_driver};
use volagent_test_support::nbd::nbd_options;

const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");
const CYCLES: usize = 40;
/// Modes alternate this many times, so that drift in the VM's speed
/// reaches both alike.
const BLOCKS: usize = 4;

fn cycles() -> usize {
    std::env::var("MOUNTER_CYCLE_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(CYCLES)
}

fn start_mounter(socket: &Path, log: &Path) -> Child {
    let child = Command::new(VOLAGENT)
        .args(["mounter", "--socket"])
        .arg(socket)
        .stderr(std::fs::File::create(log).expect("mounter log"))
        .spawn()
        .expect("start the mounter");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !Command::new(VOLAGENT)
        .args(["mounter", "--check", "--socket"])
        .arg(socket)
        .output()
        .is_ok_and(|o| o.status.success())
    {
        assert!(Instant::now() < deadline, "the mounter did not answer");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("mounter_cycle needs root: loop devices, FUSE and mounts");
        std::process::exit(1);
    }
    let mut node = Node::start_with(VOLAGENT, &[(volagent_test_artifacts::NBD, "nbd")]);
    let socket = node.scratch.path("run/mounter.sock");
    let mut mounter = start_mounter(&socket, &node.scratch.path("mounter.log"));
    let mut options = nbd_options("pv1", "pod-a", "uid-a", "ext4", "unused");
    options.as_object_mut().expect("object").remove("server");
    options["file"] = node.image("own.img", 64).into();
    let options = options.to_string();
    let dir = node.mount_dir_of("node-a", "nbd", "uid-a", "pv1");
    let flex = node.driver_of("node-a", "nbd");
    let cycle = |mount: &mut Vec<Duration>, unmount: &mut Vec<Duration>| {
        let t = Instant::now();
        assert_success(&run_driver(Command::new(&flex).args(["mount", &dir, &options])));
        mount.push(t.elapsed());
        let t = Instant::now();
        assert_success(&run_driver(Command::new(&flex).args(["unmount", &dir])));
        unmount.push(t.elapsed());
    };
    // The first mount formats the file.
    cycle(&mut Vec::new(), &mut Vec::new());
    let per_block = cycles().div_ceil(BLOCKS);
    let mut samples = [(Vec::new(), Vec::new()), (Vec::new(), Vec::new())];
    for _ in 0..BLOCKS {
        for (mode, (mount, unmount)) in samples.iter_mut().enumerate() {
            node.stop_agent();
            let extra: &[&str] =
                if mode == 1 { &["--mounter", socket.to_str().expect("utf-8")] } else { &[] };
            node.spawn_agent_env("node-a", &[], extra);
            for _ in 0..per_block {
                cycle(mount, unmount);
            }
        }
    }
    node.stop_agent();
    let _ = mounter.kill();
    let _ = mounter.wait();
    let [mut local, mut remote] = samples;
    let (lm, lu) = (summarize(&mut local.0), summarize(&mut local.1));
    let (rm, ru) = (summarize(&mut remote.0), summarize(&mut remote.1));
    let row = |name: &str, s: &Summary| {
        println!("{name:<44} p50 {:>8.2} ms   p99 {:>8.2} ms", s.p50 / 1e3, s.p99 / 1e3);
    };
    println!(
        "a userspace NBD volume (local file, helper + FUSE client + loop) through the Flexvolume driver, {} cycles per mode",
        per_block * BLOCKS
    );
    row("agent starts them: mount", &lm);
    row("agent starts them: unmount", &lu);
    row("the mounter starts them: mount", &rm);
    row("the mounter starts them: unmount", &ru);
    println!(
        "the mounter's cost (p50): {:+.2} ms per mount ({:.2}x), {:+.2} ms per unmount ({:.2}x)",
        (rm.p50 - lm.p50) / 1e3,
        rm.p50 / lm.p50,
        (ru.p50 - lu.p50) / 1e3,
        ru.p50 / lu.p50
    );
}
