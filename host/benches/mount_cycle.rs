//! A mount/unmount cycle of a pre-formatted local-pv volume through the
//! installed driver and the agent, as kubelet makes it, against the kernel's
//! own work for the same cycle measured in the same run (loop attach, mount,
//! bind, two unmounts, loop detach, as bare syscalls). The difference is the
//! agent's overhead: driver exec, socket, policy calls, ledger and stash
//! commits, the filesystem probe. Needs root.
//! Run: `cargo bench -p volagent --bench mount_cycle`.

#[path = "../tests/common.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use volagent::stats::{Summary, summarize};
use volagent::sys::{Devices, Mounts, linux::Linux};

const CYCLES: usize = 200;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("mount_cycle needs root: loop devices and mounts");
        std::process::exit(1);
    }
    let scratch = common::RootScratch::enter();
    for d in ["plugins", "disks", "kubelet", "vpd", "state"] {
        std::fs::create_dir_all(scratch.path(d)).expect("dir");
    }
    // As on a node: the runtime dir (socket, stash) on a tmpfs, the
    // ledger on disk.
    std::fs::create_dir_all(scratch.path("run")).expect("dir");
    nix::mount::mount(Some("tmpfs"), &scratch.path("run"), Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>).expect("tmpfs for the runtime dir");
    std::fs::copy(volagent_test_artifacts::LOCAL_PV, scratch.path("plugins/local-pv.wasm")).expect("plugin");
    let image = scratch.image("disks/vol.img", 64);
    let mkfs = Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&image).status().expect("mkfs");
    assert!(mkfs.success());

    let kernel = kernel_cycle(&scratch, &image);
    let (mount, unmount) = agent_cycle(&scratch, &image);
    let row = |name: &str, s: &Summary| println!("{name:<44} p50 {:>8.2} ms   p99 {:>8.2} ms", s.p50 / 1e3, s.p99 / 1e3);
    println!("mount/unmount cycle of a pre-formatted 64 MiB ext4 local-pv volume, {CYCLES} cycles");
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

fn kernel_cycle(scratch: &common::RootScratch, image: &Path) -> (Summary, Summary) {
    let sys = Linux::default();
    let staging = scratch.path("kernel/staging");
    let pod = scratch.path("kernel/pod");
    std::fs::create_dir_all(&staging).expect("dir");
    std::fs::create_dir_all(&pod).expect("dir");
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for _ in 0..CYCLES {
        let t = Instant::now();
        let dev = sys.loop_attach(image, false).expect("attach");
        sys.mount(&dev.display().to_string(), &staging, "ext4", "", false).expect("mount");
        sys.bind(&staging, &pod, false).expect("bind");
        up.push(t.elapsed());
        let t = Instant::now();
        sys.unmount(&pod, false).expect("unmount pod");
        sys.unmount(&staging, false).expect("unmount staging");
        sys.loop_detach(&dev).expect("detach");
        down.push(t.elapsed());
    }
    (summarize(&mut up), summarize(&mut down))
}

fn agent_cycle(scratch: &common::RootScratch, image: &Path) -> (Summary, Summary) {
    let socket = scratch.path("run/agent.sock");
    let mut agent = Command::new(env!("CARGO_BIN_EXE_volagent"))
        .args(["agent", "--node-name", "node-a"])
        .arg("--socket").arg(&socket)
        .arg("--state-dir").arg(scratch.path("state"))
        .arg("--runtime-dir").arg(scratch.path("run"))
        .arg("--plugin-dir").arg(scratch.path("plugins"))
        .arg("--kubelet-root").arg(scratch.path("kubelet"))
        .arg("--discovery-dir").arg(scratch.path("disks"))
        .arg("--volume-plugin-dir").arg(scratch.path("vpd"))
        .arg("--flex-driver").arg(env!("CARGO_BIN_EXE_volagent-flex"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("agent");
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(start.elapsed() < Duration::from_secs(60), "agent did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let driver = scratch.path("vpd/volagent~local-pv/local-pv");
    let dir = scratch.path("kubelet/pods/uid-1/volumes/volagent~local-pv/pv1");
    std::fs::create_dir_all(&dir).expect("pod dir");
    let options = serde_json::json!({
        "kubernetes.io/fsType": "ext4", "kubernetes.io/readwrite": "rw",
        "kubernetes.io/pvOrVolumeName": "pv1", "kubernetes.io/pod.name": "p",
        "kubernetes.io/pod.namespace": "default", "kubernetes.io/pod.uid": "uid-1",
        "path": image.display().to_string(), "node": "node-a",
    })
    .to_string();
    let call = |args: &[&str]| {
        let out = Command::new(&driver).args(args).output().expect("driver");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    };
    let mut init: Vec<Duration> = (0..CYCLES)
        .map(|_| {
            let t = Instant::now();
            call(&["init"]);
            t.elapsed()
        })
        .collect();
    let init = summarize(&mut init);
    println!("driver exec + socket round trip (init): p50 {:.2} ms", init.p50 / 1e3);
    let (mut up, mut down) = (Vec::new(), Vec::new());
    let d = dir.display().to_string();
    for _ in 0..CYCLES {
        std::fs::create_dir_all(&dir).expect("kubelet makes the dir");
        let t = Instant::now();
        call(&["mount", &d, &options]);
        up.push(t.elapsed());
        let t = Instant::now();
        call(&["unmount", &d]);
        down.push(t.elapsed());
    }
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent.id() as i32), nix::sys::signal::Signal::SIGTERM);
    let _ = agent.wait();
    (summarize(&mut up), summarize(&mut down))
}
