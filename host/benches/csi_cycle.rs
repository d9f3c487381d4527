//! NodeStage + NodePublish, then NodeUnpublish + NodeUnstage, of a
//! pre-formatted local-pv volume over the agent's CSI socket, as kubelet
//! makes them, against the kernel's own work for the same cycle measured
//! in the same run (the pod's dir made, loop attach, mount, bind; two
//! unmounts, loop detach, the pod's dir removed, as bare syscalls: CSI
//! leaves the pod's dir to the driver). The difference is the agent's
//! overhead: gRPC, policy calls, ledger and stash commits, the filesystem
//! probe, the checks. Needs root.
//! Run: `cargo bench -p volagent --bench csi_cycle`; `CSI_CYCLE_CYCLES`
//! sets the number of cycles, `CSI_CYCLE_OTHER_LOOPS` a number of other
//! volumes each agent stages meanwhile, as on a node with that many, and `CSI_CYCLE_FOREIGN_LOOPS` a number of loop devices
//! someone else attached (losetup): an attach or detach must not look at
//! every loop device there is. The agents load the four shipped backends;
//! each one's resident memory is printed idle before the cycles and after
//! them (`CSI_CYCLE_CYCLES=1000` for the figure after a thousand), beside
//! its cycle's figures: the allocator's settings trade one for the other
//! (`MIMALLOC_*` variables, passed on to the agents, override the agent's
//! own).
//! `CSI_CYCLE_COMPARE=<volagent binary>[:<another>…]` runs those builds
//! too, as further agents in the same run, their cycles interleaved with
//! the first's and the kernel's (the VM's speed drifts by tens of per cent
//! between runs; a change worth tens of µs shows only within one run).
//! Each agent's background threads (its epoch ticker, its ledger's
//! flushes) wake the VM's CPUs, so agents running side by side slow each
//! other: compare them with each other, not with a run of one.
//! `CSI_CYCLE_AGENT=<volagent binary>` runs that build instead of this
//! tree's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use volagent::csi::proto::csi::node_client::NodeClient;
use volagent::csi::proto::csi::volume_capability::{
    AccessMode, AccessType, MountVolume, access_mode::Mode,
};
use volagent::csi::proto::csi::*;
use volagent::stats::{Summary, summarize};
use volagent_test_support::agent::AgentBuilder;
use volagent_test_support::kernel_cycle::Kernel;
use volagent_test_support::scratch;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const CYCLES: usize = 200;

fn cycles() -> usize {
    std::env::var("CSI_CYCLE_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(CYCLES)
}

fn other_loops() -> usize {
    std::env::var("CSI_CYCLE_OTHER_LOOPS").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn foreign_loops() -> usize {
    std::env::var("CSI_CYCLE_FOREIGN_LOOPS").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A process's resident memory, in MiB: all, anonymous, file-backed.
fn rss(pid: u32) -> (f64, f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(f64::NAN, |kib| kib / 1024.0)
    };
    (field("VmRSS:"), field("RssAnon:"), field("RssFile:"))
}

/// Other builds of the agent to run beside this one.
fn compare() -> Vec<PathBuf> {
    std::env::var_os("CSI_CYCLE_COMPARE")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default()
}

/// One agent's samples.
#[derive(Default)]
struct Samples {
    up: Vec<Duration>,
    down: Vec<Duration>,
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("csi_cycle needs root: loop devices and mounts");
        std::process::exit(1);
    }
    let scratch = scratch::RootScratch::enter();
    for d in ["disks", "disks/others", "others"] {
        std::fs::create_dir_all(scratch.path(d)).expect("dir");
    }
    let image = scratch.image("disks/vol.img", 64);
    assert!(
        Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&image).status().expect("mkfs").success()
    );

    // Someone else's, over files of their own: detached with the scratch dir.
    for i in 0..foreign_loops() {
        let file = scratch.image(&format!("others/foreign-{i}.img"), 1);
        let out =
            Command::new("losetup").args(["-f", "--show"]).arg(&file).output().expect("losetup");
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut kernel = Kernel::csi(&scratch, &image);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let this = std::env::var_os("CSI_CYCLE_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(VOLAGENT));
    let mut agents = vec![rt.block_on(AgentUnderTest::start(&scratch, "a", &this, &image))];
    for (i, other) in compare().iter().enumerate() {
        // Each its own volume (a copy of the same filesystem) and dirs.
        let name = format!("other-{i}");
        let copy = scratch.path(&format!("disks/{name}.img"));
        std::fs::copy(&image, &copy).expect("copy of the volume");
        agents.push(rt.block_on(AgentUnderTest::start(&scratch, &name, other, &copy)));
    }
    let mut idle = Vec::new();
    let mut others = Vec::new();
    for a in &mut agents {
        let rpc = rt.block_on(a.rpc_latency());
        println!(
            "{}: gRPC round trip (NodeGetCapabilities): p50 {:.2} ms",
            a.binary.display(),
            rpc.p50 / 1e3
        );
        idle.push(rss(a.agent.id()));
        // Each agent its own, over files of its own.
        others.push(rt.block_on(a.stage_others(&scratch, other_loops())));
    }
    // Interleaved, in a new order every cycle: the disk's latency drifts
    // with whatever else writes to it, so all must see the same disk, and
    // none may keep following the same one (what ran just before warms or
    // cools what runs next).
    let mut samples: Vec<Samples> = (0..agents.len()).map(|_| Samples::default()).collect();
    let mut k = Samples::default();
    let mut order: Vec<usize> = (0..=agents.len()).collect();
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    for _ in 0..cycles() {
        rng.shuffle(&mut order);
        for &turn in &order {
            match turn {
                0 => kernel.cycle(&mut k.up, &mut k.down),
                n => {
                    let s = &mut samples[n - 1];
                    rt.block_on(agents[n - 1].cycle(&mut s.up, &mut s.down));
                }
            }
        }
    }
    let binaries: Vec<PathBuf> = agents.iter().map(|a| a.binary.clone()).collect();
    // Settled: a purge the allocator delays has had its time.
    std::thread::sleep(Duration::from_secs(2));
    let after: Vec<_> = agents.iter().map(|a| rss(a.agent.id())).collect();
    for (a, staged) in agents.iter_mut().zip(others) {
        rt.block_on(a.unstage_others(staged));
    }
    drop(agents);
    let kernel = (summarize(&mut k.up), summarize(&mut k.down));
    let row = |name: &str, s: &Summary| {
        println!("{name:<48} p50 {:>8.2} ms   p99 {:>8.2} ms", s.p50 / 1e3, s.p99 / 1e3);
    };
    println!(
        "CSI cycle of a pre-formatted 64 MiB ext4 local-pv volume, {} cycles, {} other volumes staged, {} loop devices of someone else's attached",
        cycles(),
        other_loops(),
        foreign_loops()
    );
    row("kernel alone: mkdir + attach + mount + bind", &kernel.0);
    row("kernel alone: unmount x2 + detach + rmdir", &kernel.1);
    for (i, (binary, s)) in binaries.iter().zip(samples.iter_mut()).enumerate() {
        let (stage, unstage) = (summarize(&mut s.up), summarize(&mut s.down));
        if binaries.len() > 1 {
            println!("{}:", binary.display());
        }
        row("agent: NodeStage + NodePublish", &stage);
        row("agent: NodeUnpublish + NodeUnstage", &unstage);
        println!(
            "agent overhead per stage + publish (p50, total minus kernel): {:.2} ms (target <= 1 ms); per unpublish + unstage: {:.2} ms",
            (stage.p50 - kernel.0.p50) / 1e3,
            (unstage.p50 - kernel.1.p50) / 1e3
        );
        let mib = |(all, anon, file): (f64, f64, f64)| {
            format!("{all:.1} MiB ({anon:.1} anonymous, {file:.1} file)")
        };
        println!(
            "agent RSS, four backends loaded: idle {} (target <= 30 MiB); after the cycles {} (target <= 45 MiB after 1000)",
            mib(idle[i]),
            mib(after[i])
        );
    }
}

struct AgentUnderTest {
    name: String,
    binary: PathBuf,
    agent: Child,
    client: NodeClient<tonic::transport::Channel>,
    image: String,
    staging: PathBuf,
    target: PathBuf,
}

impl AgentUnderTest {
    /// The agent `binary` with dirs of its own under `name`.
    async fn start(
        scratch: &scratch::RootScratch,
        name: &str,
        binary: &Path,
        image: &Path,
    ) -> AgentUnderTest {
        let dir = |d: &str| {
            let p = scratch.path(&format!("{name}/{d}"));
            std::fs::create_dir_all(&p).expect("dir");
            p
        };
        let kubelet = dir("kubelet");
        // As on a node: the runtime dir (socket, stash) on a tmpfs.
        nix::mount::mount(
            Some("tmpfs"),
            &dir("run"),
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .expect("tmpfs for the runtime dir");
        for (backend, file) in &volagent_test_artifacts::BACKENDS[..4] {
            std::fs::copy(file, dir("plugins").join(format!("{backend}.wasm"))).expect("plugin");
        }
        let socket = volagent::csi::drivers::socket_path(&kubelet, "local-pv");
        let agent = AgentBuilder::new(binary, "node-a")
            .state_dir(dir("state"))
            .runtime_dir(dir("run"))
            .plugin_dir(dir("plugins"))
            .trusting_test_guests(scratch.path(&format!("{name}/trusted-policies")))
            .kubelet_root(kubelet.clone())
            .discovery_dir(scratch.path("disks"))
            .no_driver_install()
            .ready_when(socket.clone())
            .spawn();
        let client =
            NodeClient::new(volagent::csi::client::connect(socket).await.expect("connect"));
        let staging = kubelet.join("plugins/kubernetes.io/csi/pv/pv1/globalmount");
        let target = kubelet.join("pods/uid-1/volumes/kubernetes.io~csi/pv1/mount");
        std::fs::create_dir_all(target.parent().expect("parent")).expect("dir");
        AgentUnderTest {
            name: name.to_string(),
            binary: binary.to_path_buf(),
            agent,
            client,
            image: image.display().to_string(),
            staging,
            target,
        }
    }

    /// The floor every call pays: a round trip on the socket through
    /// HTTP/2 and the service, doing nothing.
    async fn rpc_latency(&mut self) -> Summary {
        let mut times = Vec::new();
        for _ in 0..cycles() {
            let t = Instant::now();
            self.client
                .node_get_capabilities(NodeGetCapabilitiesRequest {})
                .await
                .expect("capabilities");
            times.push(t.elapsed());
        }
        summarize(&mut times)
    }

    async fn cycle(&mut self, up: &mut Vec<Duration>, down: &mut Vec<Duration>) {
        let capability = Some(VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: "ext4".into(),
                ..Default::default()
            })),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        });
        let (staging, target) =
            (self.staging.display().to_string(), self.target.display().to_string());
        std::fs::create_dir_all(&self.staging).expect("kubelet makes the staging dir");
        let stage = NodeStageVolumeRequest {
            volume_id: "pv1".into(),
            staging_target_path: staging.clone(),
            volume_capability: capability.clone(),
            volume_context: HashMap::from([
                ("path".to_string(), self.image.clone()),
                ("node".to_string(), "node-a".to_string()),
            ]),
            ..Default::default()
        };
        let publish = NodePublishVolumeRequest {
            volume_id: "pv1".into(),
            staging_target_path: staging.clone(),
            target_path: target.clone(),
            volume_capability: capability,
            ..Default::default()
        };
        let t = Instant::now();
        self.client.node_stage_volume(stage).await.expect("stage");
        self.client.node_publish_volume(publish).await.expect("publish");
        up.push(t.elapsed());
        let t = Instant::now();
        self.client
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: "pv1".into(),
                target_path: target,
            })
            .await
            .expect("unpublish");
        self.client
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: "pv1".into(),
                staging_target_path: staging,
            })
            .await
            .expect("unstage");
        down.push(t.elapsed());
    }

    /// `n` other volumes staged (their staging paths): a filesystem of
    /// 4 MiB each, copies of one, in a dir of the discovery dir (which
    /// discovery skips).
    async fn stage_others(&mut self, scratch: &scratch::RootScratch, n: usize) -> Vec<String> {
        if n == 0 {
            return Vec::new();
        }
        let template = scratch.image(&format!("disks/others/{}-template.img", self.name), 4);
        assert!(
            Command::new("mkfs.ext4")
                .args(["-F", "-q"])
                .arg(&template)
                .status()
                .expect("mkfs")
                .success()
        );
        let kubelet = self.staging.ancestors().nth(6).expect("kubelet root").to_path_buf();
        let mut staged = Vec::new();
        for i in 0..n {
            let file = scratch.path(&format!("disks/others/{}-{i}.img", self.name));
            assert!(
                Command::new("cp")
                    .arg("--sparse=always")
                    .arg(&template)
                    .arg(&file)
                    .status()
                    .expect("cp")
                    .success()
            );
            let staging =
                kubelet.join(format!("plugins/kubernetes.io/csi/pv/other-{i}/globalmount"));
            std::fs::create_dir_all(&staging).expect("staging dir");
            let staging = staging.display().to_string();
            self.client
                .node_stage_volume(NodeStageVolumeRequest {
                    volume_id: format!("other-{i}"),
                    staging_target_path: staging.clone(),
                    volume_capability: Some(VolumeCapability {
                        access_type: Some(AccessType::Mount(MountVolume {
                            fs_type: "ext4".into(),
                            ..Default::default()
                        })),
                        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
                    }),
                    volume_context: HashMap::from([
                        ("path".to_string(), file.display().to_string()),
                        ("node".to_string(), "node-a".to_string()),
                    ]),
                    ..Default::default()
                })
                .await
                .expect("stage another volume");
            staged.push(staging);
        }
        staged
    }

    async fn unstage_others(&mut self, staged: Vec<String>) {
        for (i, staging) in staged.into_iter().enumerate() {
            self.client
                .node_unstage_volume(NodeUnstageVolumeRequest {
                    volume_id: format!("other-{i}"),
                    staging_target_path: staging,
                })
                .await
                .expect("unstage another volume");
        }
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
