//! A mount/unmount cycle of a pre-formatted local-pv volume through the
//! installed driver and the agent, as kubelet makes it, against the kernel's
//! own work for the same cycle measured in the same run (loop attach, mount,
//! bind, two unmounts, loop detach, as bare syscalls). The difference is the
//! agent's overhead: driver exec, socket, policy calls, ledger and stash
//! commits, the filesystem probe. Needs root.
//! Run: `cargo bench -p volagent --bench mount_cycle`. `MOUNT_CYCLE_CYCLES`
//! sets the number of cycles; `MOUNT_CYCLE_FLEX_DRIVER` runs another build
//! of the driver than the statically linked one that ships, and
//! `MOUNT_CYCLE_AGENT` another build of the agent than this tree's (to
//! compare a change with the build before it on the same machine).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use volagent::stats::{Summary, summarize};
use volagent_test_support::agent::AgentBuilder;
use volagent_test_support::kernel_cycle::Kernel;
use volagent_test_support::scratch;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const CYCLES: usize = 200;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("mount_cycle needs root: loop devices and mounts");
        std::process::exit(1);
    }
    let scratch = scratch::RootScratch::enter();
    for d in ["plugins", "disks", "kubelet", "vpd", "state"] {
        std::fs::create_dir_all(scratch.path(d)).expect("dir");
    }
    // As on a node: the runtime dir (socket, stash) on a tmpfs, the
    // ledger on disk.
    std::fs::create_dir_all(scratch.path("run")).expect("dir");
    nix::mount::mount(
        Some("tmpfs"),
        &scratch.path("run"),
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .expect("tmpfs for the runtime dir");
    std::fs::copy(volagent_test_artifacts::LOCAL_PV, scratch.path("plugins/local-pv.wasm"))
        .expect("plugin");
    let image = scratch.image("disks/vol.img", 64);
    let mkfs = Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&image).status().expect("mkfs");
    assert!(mkfs.success());

    let mut kernel = Kernel::new(&scratch, &image);
    let agent = AgentUnderTest::start(&scratch, &image);
    let init = agent.init_latency();
    println!("driver exec + socket round trip (init): p50 {:.2} ms", init.p50 / 1e3);
    // Interleaved, alternating which goes first: the loop device's flushes
    // reach the node's disk, whose latency drifts with whatever else writes
    // to it (other builds on a shared VM), so both sides must see the same
    // disk. Measured in two separate runs, the drift alone moved the
    // difference by milliseconds.
    let (mut up, mut down, mut k_up, mut k_down) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..cycles() {
        if i % 2 == 0 {
            kernel.cycle(&mut k_up, &mut k_down);
            agent.cycle(&mut up, &mut down);
        } else {
            agent.cycle(&mut up, &mut down);
            kernel.cycle(&mut k_up, &mut k_down);
        }
    }
    drop(agent);
    let (mount, unmount) = (summarize(&mut up), summarize(&mut down));
    let kernel = (summarize(&mut k_up), summarize(&mut k_down));
    let row = |name: &str, s: &Summary| {
        println!("{name:<44} p50 {:>8.2} ms   p99 {:>8.2} ms", s.p50 / 1e3, s.p99 / 1e3);
    };
    println!(
        "mount/unmount cycle of a pre-formatted 64 MiB ext4 local-pv volume, {} cycles",
        cycles()
    );
    row("driver + agent: mount", &mount);
    row("driver + agent: unmount", &unmount);
    row("kernel alone: attach + mount + bind", &kernel.0);
    row("kernel alone: unmount x2 + detach", &kernel.1);
    println!(
        "agent overhead per mount (p50, total minus kernel): {:.2} ms (target <= 2 ms); per unmount: {:.2} ms",
        (mount.p50 - kernel.0.p50) / 1e3,
        (unmount.p50 - kernel.1.p50) / 1e3
    );
}

/// Cycles to run; `MOUNT_CYCLE_CYCLES` overrides for quick looks.
fn cycles() -> usize {
    std::env::var("MOUNT_CYCLE_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(CYCLES)
}

/// The agent, and kubelet's calls of the installed driver.
struct AgentUnderTest {
    agent: Child,
    driver: PathBuf,
    dir: PathBuf,
    options: String,
}

impl AgentUnderTest {
    fn start(scratch: &scratch::RootScratch, image: &Path) -> AgentUnderTest {
        let binary = std::env::var("MOUNT_CYCLE_AGENT").unwrap_or(VOLAGENT.to_string());
        let agent = AgentBuilder::new(&binary, "node-a")
            .under(&scratch.path(""))
            .socket(scratch.path("run/agent.sock"))
            .flex_driver(
                std::env::var_os("MOUNT_CYCLE_FLEX_DRIVER")
                    .unwrap_or(volagent_test_artifacts::FLEX_DRIVER.into()),
            )
            .spawn();
        let options = serde_json::json!({
            "kubernetes.io/fsType": "ext4", "kubernetes.io/readwrite": "rw",
            "kubernetes.io/pvOrVolumeName": "pv1", "kubernetes.io/pod.name": "p",
            "kubernetes.io/pod.namespace": "default", "kubernetes.io/pod.uid": "uid-1",
            "path": image.display().to_string(), "node": "node-a",
        })
        .to_string();
        AgentUnderTest {
            agent,
            driver: scratch.path("vpd/volagent~local-pv/local-pv"),
            dir: scratch.path("kubelet/pods/uid-1/volumes/volagent~local-pv/pv1"),
            options,
        }
    }

    fn call(&self, args: &[&str]) {
        let out = Command::new(&self.driver).args(args).output().expect("driver");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    }

    fn init_latency(&self) -> Summary {
        let mut init: Vec<Duration> = (0..cycles())
            .map(|_| {
                let t = Instant::now();
                self.call(&["init"]);
                t.elapsed()
            })
            .collect();
        summarize(&mut init)
    }

    fn cycle(&self, up: &mut Vec<Duration>, down: &mut Vec<Duration>) {
        let d = self.dir.display().to_string();
        std::fs::create_dir_all(&self.dir).expect("kubelet makes the dir");
        let t = Instant::now();
        self.call(&["mount", &d, &self.options]);
        up.push(t.elapsed());
        let t = Instant::now();
        self.call(&["unmount", &d]);
        down.push(t.elapsed());
    }
}

impl Drop for AgentUnderTest {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.agent.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.agent.wait();
    }
}
