//! A node with hundreds of volumes: N local-pv volumes (default 500)
//! mounted through the installed Flexvolume driver by C concurrent
//! kubelet-style calls (default 100: each call a driver process, as
//! kubelet makes them), the agent restarted with all of them mounted, then
//! all unmounted; then the same N staged and published, unpublished and
//! unstaged over the CSI socket, C calls at a time. Prints per phase the
//! calls' p50, p99 and max and how many failed; the agent's resident
//! memory and threads at the peak; what was left mounted or attached;
//! and how long the restarted agent took to serve again.
//! Needs root. Run: `cargo bench -p volagent --bench node_scale`;
//! `NODE_SCALE_VOLUMES`, `NODE_SCALE_CONCURRENCY` change N and C, and
//! `NODE_SCALE_FORMAT=1` leaves the volumes blank, to be formatted by
//! their first mount (by default they are copies of one ext4 filesystem,
//! so that what is timed is the agent and the mounts, not mkfs).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use volagent::csi::proto::csi::node_client::NodeClient;
use volagent::csi::proto::csi::volume_capability::{
    AccessMode, AccessType, MountVolume, access_mode::Mode,
};
use volagent::csi::proto::csi::*;
use volagent::stats::summarize;
use volagent_test_support::agent::Node;
use volagent_test_support::driver::kubelet_options;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The peak of a process's resident memory (KiB) and threads, sampled
/// every 50 ms until stopped.
struct Peak {
    stop: Arc<AtomicBool>,
    rss_kib: Arc<AtomicU64>,
    threads: Arc<AtomicU64>,
    sampler: Option<std::thread::JoinHandle<()>>,
}

impl Peak {
    fn watch(pid: i32) -> Peak {
        let (stop, rss_kib, threads) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let sampler = {
            let (stop, rss_kib, threads) = (stop.clone(), rss_kib.clone(), threads.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some((rss, n)) = status(pid) {
                        rss_kib.fetch_max(rss, Ordering::Relaxed);
                        threads.fetch_max(n, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        Peak { stop, rss_kib, threads, sampler: Some(sampler) }
    }

    /// (RSS in MiB, threads) at the peak.
    fn end(mut self) -> (f64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self.sampler.take() {
            let _ = s.join();
        }
        (self.rss_kib.load(Ordering::Relaxed) as f64 / 1024.0, self.threads.load(Ordering::Relaxed))
    }
}

/// A process's resident memory (KiB) and threads now.
fn status(pid: i32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    Some((field("VmRSS:")?, field("Threads:")?))
}

/// `n` calls made by `c` threads at a time: each call's time and whether
/// it failed (its message).
fn concurrently(
    n: usize,
    c: usize,
    call: impl Fn(usize) -> Result<(), String> + Sync,
) -> (Vec<Duration>, Vec<String>) {
    let next = AtomicUsize::new(0);
    let times = std::sync::Mutex::new(Vec::with_capacity(n));
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..c.min(n) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let t = Instant::now();
                    let r = call(i);
                    let took = t.elapsed();
                    times.lock().expect("times").push(took);
                    if let Err(e) = r {
                        failures.lock().expect("failures").push(format!("volume {i}: {e}"));
                    }
                }
            });
        }
    });
    (times.into_inner().expect("times"), failures.into_inner().expect("failures"))
}

fn report(phase: &str, (mut times, failures): (Vec<Duration>, Vec<String>)) {
    let s = summarize(&mut times);
    println!(
        "{phase:<32} p50 {:>7.1} ms   p99 {:>7.1} ms   max {:>7.1} ms   failed {} (goal: p99 <= 500 ms, none failed)",
        s.p50 / 1e3,
        s.p99 / 1e3,
        s.max / 1e3,
        failures.len()
    );
    for f in failures.iter().take(5) {
        println!("    {f}");
    }
}

fn left(node: &Node, what: &str) {
    let (mounts, loops) = (node.scratch.mounts().len(), node.scratch.loops_left().len());
    println!("    {what}: {mounts} mounts and {loops} loop devices left (goal: none)");
}

fn driver_result(r: (i32, serde_json::Value)) -> Result<(), String> {
    match (r.0, r.1["status"].as_str()) {
        (0, Some("Success")) => Ok(()),
        _ => Err(r.1.to_string()),
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("node_scale needs root: loop devices and mounts");
        std::process::exit(1);
    }
    let (n, c) =
        (knob("NODE_SCALE_VOLUMES", 500).max(1), knob("NODE_SCALE_CONCURRENCY", 100).max(1));
    let format = std::env::var("NODE_SCALE_FORMAT").is_ok_and(|v| v == "1");
    let mut node = Node::start_alone(VOLAGENT);
    let template = node.image("template.img", 16);
    if !format {
        let ok = std::process::Command::new("mkfs.ext4")
            .args(["-F", "-q", &template])
            .status()
            .expect("mkfs")
            .success();
        assert!(ok, "mkfs.ext4 {template}");
    }
    let images: Vec<String> = (0..n)
        .map(|i| {
            let image = node.image(&format!("v{i}.img"), 16);
            if !format {
                // Over the file made: the scratch dir knows it by identity.
                let ok = std::process::Command::new("cp")
                    .args(["--sparse=always", &template, &image])
                    .status()
                    .expect("cp")
                    .success();
                assert!(ok, "cp {template} {image}");
            }
            image
        })
        .collect();
    println!(
        "node scale: {n} local-pv volumes of 16 MiB ({}), {c} concurrent calls, one standalone agent",
        if format { "formatted by their first mount" } else { "copies of one ext4 filesystem" }
    );

    // Flexvolume: each call a driver process, as kubelet makes them.
    let dirs: Vec<String> =
        (0..n).map(|i| node.mount_dir(&format!("uid-{i}"), &format!("pv{i}"))).collect();
    let options = |i: usize| {
        kubelet_options(
            &format!("pv{i}"),
            &format!("pod-{i}"),
            &format!("uid-{i}"),
            "ext4",
            &images[i],
        )
    };
    let peak = Peak::watch(node.pid_of("node-a"));
    let mounted = concurrently(n, c, |i| driver_result(node.mount(&dirs[i], &options(i))));
    let (rss, threads) = peak.end();
    report("Flexvolume mount", mounted);
    println!(
        "    agent at the peak: {rss:.1} MiB resident (goal <= 60 MiB), {threads} threads; {} mounts, {} loop devices",
        node.scratch.mounts().len(),
        node.scratch.loops().len()
    );

    // Restarted with everything mounted: serving again once a call on a
    // mounted volume is answered (the agent reconciles what it finds).
    node.stop_agent_of("node-a");
    let t = Instant::now();
    node.spawn_agent("node-a");
    let served = loop {
        let answer = driver_result(node.mount(&dirs[0], &options(0)));
        if answer.is_ok() {
            break t.elapsed();
        }
        if t.elapsed() > Duration::from_secs(120) {
            panic!("the restarted agent did not serve within 120 s: {answer:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    println!(
        "agent restarted with {n} volumes mounted: serving after {:.2} s (goal <= 2 s)",
        served.as_secs_f64()
    );

    let peak = Peak::watch(node.pid_of("node-a"));
    let unmounted = concurrently(n, c, |i| driver_result(node.driver(&["unmount", &dirs[i]])));
    let (rss, threads) = peak.end();
    report("Flexvolume unmount", unmounted);
    println!("    agent at the peak: {rss:.1} MiB resident, {threads} threads");
    left(&node, "after the unmounts");

    // CSI, on the same agent: NodeStage + NodePublish, then back.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let kubelet = node.scratch.path("node-a/kubelet");
    let socket = volagent::csi::drivers::socket_path(&kubelet, "local-pv");
    let client =
        NodeClient::new(rt.block_on(volagent::csi::client::connect(socket)).expect("connect"));
    let staging =
        |i: usize| kubelet.join(format!("plugins/kubernetes.io/csi/pv/pv{i}/globalmount"));
    let target =
        |i: usize| kubelet.join(format!("pods/uid-{i}/volumes/kubernetes.io~csi/pv{i}/mount"));
    for i in 0..n {
        std::fs::create_dir_all(staging(i)).expect("kubelet makes the staging dir");
        std::fs::create_dir_all(target(i).parent().expect("parent")).expect("pod dir");
    }
    let capability = VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    };
    let up = |i: usize| -> Result<(), String> {
        let mut client = client.clone();
        let (staging, target) = (path(staging(i)), path(target(i)));
        rt.block_on(async {
            client
                .node_stage_volume(NodeStageVolumeRequest {
                    volume_id: format!("pv{i}"),
                    staging_target_path: staging.clone(),
                    volume_capability: Some(capability.clone()),
                    volume_context: HashMap::from([
                        ("path".to_string(), images[i].clone()),
                        ("node".to_string(), "node-a".to_string()),
                    ]),
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string())?;
            client
                .node_publish_volume(NodePublishVolumeRequest {
                    volume_id: format!("pv{i}"),
                    staging_target_path: staging,
                    target_path: target,
                    volume_capability: Some(capability.clone()),
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string())?;
            Ok(())
        })
    };
    let down = |i: usize| -> Result<(), String> {
        let mut client = client.clone();
        let (staging, target) = (path(staging(i)), path(target(i)));
        rt.block_on(async {
            client
                .node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: format!("pv{i}"),
                    target_path: target,
                })
                .await
                .map_err(|e| e.to_string())?;
            client
                .node_unstage_volume(NodeUnstageVolumeRequest {
                    volume_id: format!("pv{i}"),
                    staging_target_path: staging,
                })
                .await
                .map_err(|e| e.to_string())?;
            Ok(())
        })
    };
    let peak = Peak::watch(node.pid_of("node-a"));
    let staged = concurrently(n, c, up);
    let (rss, threads) = peak.end();
    report("CSI stage + publish", staged);
    println!(
        "    agent at the peak: {rss:.1} MiB resident (goal <= 60 MiB), {threads} threads; {} mounts, {} loop devices",
        node.scratch.mounts().len(),
        node.scratch.loops().len()
    );
    let peak = Peak::watch(node.pid_of("node-a"));
    let unstaged = concurrently(n, c, down);
    let (rss, threads) = peak.end();
    report("CSI unpublish + unstage", unstaged);
    println!("    agent at the peak: {rss:.1} MiB resident, {threads} threads");
    left(&node, "after the unstages");
    drop(client);
    drop(rt);
}

fn path(p: PathBuf) -> String {
    p.display().to_string()
}
