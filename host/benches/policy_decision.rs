//! Policy decision latency: fresh instance + fence, then fresh instance +
//! attach plan (as the agent makes them), through the wasm runtime; the same
//! policy logic called natively in-process; and through a process exec per
//! call (the Flexvolume model). Prints p50/p99 and the ratios, plus the
//! compile time of every backend. Run: `cargo bench -p volagent --bench policy_decision`.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use volagent::policy as host;
use volagent::stats::summarize;
use volagent_guest_sdk as sdk;
use volagent_guest_sdk::Policy;

const CALLS: usize = 5000;
const EXEC_CALLS: usize = 300;
const COMPILES: usize = 5;
const IMAGE: &str = "/mnt/disks/vol1.img";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--exec-child") {
        exec_child(&args[2]);
        return;
    }
    println!(
        "policy decision = fence + attach plan, a fresh instance per call, host checks included (local-pv, one holder on this node)"
    );
    let runtime = host::Runtime::new(host::Limits::default()).expect("runtime");
    let plugin = host::Plugin::load_file(&runtime, Path::new(volagent_test_artifacts::LOCAL_PV))
        .expect("load local-pv");

    let wasm = wasm_decision(&plugin);
    let native = native_decision();
    let exec = exec_decision();
    let row = |name: &str, s: &mut Vec<Duration>| {
        let volagent::stats::Summary { p50, p99, mean, .. } = summarize(s);
        println!(
            "{name:<34} {:>7} calls  p50 {p50:>9.1} µs  p99 {p99:>9.1} µs  mean {mean:>9.1} µs",
            s.len()
        );
        (p50, p99)
    };
    let (mut wasm, mut native, mut exec) = (wasm, native, exec);
    let (w50, w99) = row("wasm (fresh instance per call)", &mut wasm);
    let (n50, n99) = row("native in-process", &mut native);
    let (e50, e99) = row("exec per call", &mut exec);
    println!("ratio wasm / native:  p50 {:.1}x  p99 {:.1}x   (target ≤ 10x)", w50 / n50, w99 / n99);
    println!("ratio exec / wasm:    p50 {:.1}x  p99 {:.1}x   (target ≥ 20x)", e50 / w50, e99 / w99);
    println!("wasm p99 {w99:.1} µs (target ≤ 50 µs)");

    tail(&plugin);
    contract_versions(&runtime);
    observed(&runtime);

    println!("compile + check per backend (Cranelift, median of {COMPILES}):");
    for (name, path) in volagent_test_artifacts::BACKENDS {
        let mut times: Vec<Duration> = (0..COMPILES)
            .map(|_| {
                let start = Instant::now();
                host::Plugin::load_file(&runtime, Path::new(path)).expect("load");
                start.elapsed()
            })
            .collect();
        times.sort();
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        println!(
            "  {name:<10} {:>7} bytes  {:>7.1} ms",
            size,
            times[COMPILES / 2].as_secs_f64() * 1e3
        );
    }
}

fn wasm_decision(plugin: &host::Plugin) -> Vec<Duration> {
    wasm_decision_n(plugin, CALLS)
}

fn wasm_decision_n(plugin: &host::Plugin, calls: usize) -> Vec<Duration> {
    time(calls, decision(plugin))
}

/// One decision as the agent's mount makes it: fence, then the (full,
/// first-consumer) attach plan, each call on a fresh instance, each answer
/// checked.
fn decision(plugin: &host::Plugin) -> impl FnMut() + '_ {
    let mut facts = host::RecordedQueries::default();
    facts.paths.insert(IMAGE.into(), host::PathKind::RegularFile);
    facts.nodes.push(host::NodeFacts {
        name: "node-a".into(),
        exists: true,
        ready: true,
        out_of_service: false,
    });
    let facts = Arc::new(facts);
    let volume = host::Volume {
        name: "pv1".into(),
        backend: "local-pv".into(),
        access_mode: host::AccessMode::ReadWriteOnce,
        fs_type: "ext4".into(),
        mode: host::VolumeMode::Filesystem,
        mount_flags: vec![],
        options: vec![
            host::KeyValue { key: "path".into(), value: IMAGE.into() },
            host::KeyValue { key: "node".into(), value: "node-a".into() },
        ],
        secret_keys: vec![],
    };
    let consumer = |pod: &str| host::Consumer {
        node: "node-a".into(),
        pod_namespace: "default".into(),
        pod: pod.into(),
        pod_uid: format!("uid-{pod}"),
        mount_dir: format!("/var/lib/kubelet/pods/uid-{pod}/volumes/volagent~local-pv/pv1"),
        read_only: false,
        mount_group: None,
    };
    let holders =
        vec![host::Holder { consumer: consumer("a"), since: "2026-11-01T10:00:00Z".into() }];
    let requester = consumer("b");
    let paths = host::NodePaths {
        kubelet_root: "/var/lib/kubelet".into(),
        staging_dir: "/var/lib/kubelet/plugins/volagent/local-pv/mounts/pv1".into(),
        state_dir: "/var/lib/volagent/volumes/pv1".into(),
        discovery_dirs: vec!["/mnt/disks".into()],
    };
    let nodes = facts.nodes.clone();
    move || {
        let d = plugin.fence(facts.clone(), &volume, &requester, &holders, &nodes).expect("fence");
        assert_eq!(d, host::Decision::Grant);
        assert_eq!(
            plugin.attach(facts.clone(), &volume, &requester, &[], &paths).expect("attach").len(),
            4
        );
    }
}

/// Where the slow decisions' time goes: each decision's time split by
/// whether both its calls found an instance made ahead, back to back (the
/// prewarmer races the calls for the 2 cores) and paced as mounts come
/// (the prewarmer has made the next instances by the next decision).
fn tail(plugin: &host::Plugin) {
    println!("where the tail goes (the decision's time by whether its instances were made ahead):");
    for (name, pace) in
        [("back to back", Duration::ZERO), ("paced, one per 2 ms", Duration::from_millis(2))]
    {
        let mut decide = decision(plugin);
        for _ in 0..CALLS / 10 {
            decide();
        }
        let (mut ready, mut made) = (Vec::new(), Vec::new());
        let mut by_thread = [Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..CALLS / 2 {
            if !pace.is_zero() {
                std::thread::sleep(pace);
            }
            let before = plugin.instances_taken_ready();
            let usage = thread_usage();
            let start = Instant::now();
            decide();
            let took = start.elapsed();
            let (faults, switched) = thread_usage().since(&usage);
            match plugin.instances_taken_ready() - before {
                2 => ready.push(took),
                _ => made.push(took),
            }
            by_thread[if switched {
                2
            } else if faults > 0 {
                1
            } else {
                0
            }]
            .push(took);
        }
        let mut all: Vec<Duration> = ready.iter().chain(&made).copied().collect();
        let s = summarize(&mut all);
        println!(
            "  {name:<22} p50 {:>7.1} µs  p99 {:>7.1} µs  p99/p50 {:.2} (target p99 <= 25 µs, p99/p50 <= 1.5)",
            s.p50,
            s.p99,
            s.p99 / s.p50
        );
        let [quiet, faulted, switched] = by_thread;
        for (what, v) in [
            ("both made ahead", ready),
            ("one or both made by the call", made),
            ("the thread neither faulted nor was switched out", quiet),
            ("it took a page fault (and was not switched)", faulted),
            ("it was switched out (a wait or preempted)", switched),
        ] {
            part(what, v);
        }
    }
}

/// A part of a section's decisions: how many, and their p50 and p99.
fn part(what: &str, mut v: Vec<Duration>) {
    if v.is_empty() {
        println!("    {what:<48} none");
        return;
    }
    let n = v.len();
    let s = summarize(&mut v);
    println!("    {what:<48} {n:>5} decisions  p50 {:>7.1} µs  p99 {:>7.1} µs", s.p50, s.p99);
}

/// The calling thread's page faults and context switches so far.
struct ThreadUsage {
    faults: i64,
    switches: i64,
}

fn thread_usage() -> ThreadUsage {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_THREAD).expect("getrusage");
    ThreadUsage {
        faults: u.minor_page_faults() + u.major_page_faults(),
        switches: u.voluntary_context_switches() + u.involuntary_context_switches(),
    }
}

impl ThreadUsage {
    /// Faults taken since `before`, and whether the thread left the CPU.
    fn since(&self, before: &ThreadUsage) -> (i64, bool) {
        (self.faults - before.faults, self.switches > before.switches)
    }
}

/// The same decision by the local-pv policy as built for each contract the
/// host serves: today's (1.0) and the 0.5 and 0.4 builds kept as fixtures,
/// served through their adapters. Interleaved in rounds, so that the
/// machine's drift falls on all three alike.
fn contract_versions(runtime: &Arc<host::Runtime>) {
    let fixtures = volagent_test_support::workspace().join("tests/fixtures");
    let builds = [
        (
            "contract 1.0 (today's build)",
            Path::new(volagent_test_artifacts::LOCAL_PV).to_path_buf(),
        ),
        ("contract 0.5 (adapter)", fixtures.join("contract-0.5/local-pv.wasm")),
        ("contract 0.4 (adapter)", fixtures.join("contract-0.4/local-pv.wasm")),
    ];
    let plugins: Vec<_> = builds
        .iter()
        .map(|(name, path)| {
            let plugin = host::Plugin::load_file(runtime, path).expect("load a local-pv build");
            (name, plugin, Vec::new())
        })
        .collect();
    let mut plugins = plugins;
    const ROUNDS: usize = 10;
    for _ in 0..ROUNDS {
        for (_, plugin, samples) in &mut plugins {
            samples.extend(wasm_decision_n(plugin, CALLS / ROUNDS));
        }
    }
    println!("the same decision by each contract's build of local-pv (interleaved):");
    let mut first = None;
    for (name, _, samples) in &mut plugins {
        let volagent::stats::Summary { p50, p99, .. } = summarize(samples);
        let base = *first.get_or_insert(p50);
        println!(
            "  {name:<30} p50 {p50:>7.1} µs  p99 {p99:>7.1} µs  p50 / 1.0's {:.2}x",
            p50 / base
        );
    }
}

/// The same decision while the agent records the backend's calls, and
/// while a candidate (the same policy) runs in its shadow: what a call pays
/// for being seen is the inputs copied and the host's answers written
/// down; the recording and the candidate's call run on threads of their
/// own. Interleaved in rounds with the unobserved backend.
fn observed(runtime: &Arc<host::Runtime>) {
    use volagent::plugin::observe::{Observer, RecordConfig};
    let path = Path::new(volagent_test_artifacts::LOCAL_PV);
    let load = || host::Plugin::load_file(runtime, path).expect("load local-pv");
    let dir = tempfile::tempdir().expect("temp dir");
    let board = Arc::new(volagent::socket::status::Board::default());
    let record = RecordConfig {
        dir: dir.path().to_path_buf(),
        backends: vec![],
        max_files: 2000,
        max_bytes: 64 << 20,
    };
    let recording = Observer::start(Some(record), board.clone(), None).expect("recorder");
    let shadowing = Observer::start(None, board.clone(), None).expect("shadow");
    let candidate =
        host::Plugin::load_candidate(runtime, path, &std::fs::read(path).expect("read"))
            .expect("candidate");
    shadowing.set_shadow("local-pv", Some(Arc::new(candidate)));
    let plain = load();
    let recorded = load();
    recorded.set_tap(recording.tap("local-pv"));
    let shadowed = load();
    shadowed.set_tap(shadowing.tap("local-pv"));
    // What a call itself pays for being seen: its inputs copied and its
    // answers written down, handed to a tap that drops them.
    struct Drops;
    impl volagent::policy::recorded::Tap for Drops {
        fn wants(&self) -> bool {
            true
        }
        fn seen(&self, decided: volagent::policy::recorded::Decided) {
            drop(std::hint::black_box(decided));
        }
    }
    let seen = load();
    seen.set_tap(Arc::new(Drops));
    let mut rows = [
        ("not observed", &plain, Vec::new()),
        ("seen (the call's own cost)", &seen, Vec::new()),
        ("recorded", &recorded, Vec::new()),
        ("candidate in the shadow", &shadowed, Vec::new()),
    ];
    const ROUNDS: usize = 10;
    for _ in 0..ROUNDS {
        for (_, plugin, samples) in &mut rows {
            samples.extend(wasm_decision_n(plugin, CALLS / ROUNDS));
            // Let the recorder and the shadow catch up between rounds, as
            // they do between a node's bursts.
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    println!(
        "the same decision, observed (interleaved; the candidate and the recorder run on threads of their own):"
    );
    let mut first = None;
    for (name, _, samples) in &mut rows {
        let volagent::stats::Summary { p50, p99, .. } = summarize(samples);
        let base = *first.get_or_insert(p50);
        println!(
            "  {name:<30} p50 {p50:>7.1} µs  p99 {p99:>7.1} µs  p50 / unobserved {:.2}x",
            p50 / base
        );
    }
    if let Some(s) = board.shadows_now().first() {
        println!(
            "  the shadow compared {} calls, skipped {} (its queue was full), found {} differences",
            s.compared,
            s.skipped,
            s.differences.values().sum::<u64>()
        );
    }
}

fn native_inputs()
-> (sdk::fake::FakeHost, sdk::Volume, sdk::Consumer, Vec<sdk::Holder>, sdk::NodePaths) {
    let mut host = sdk::fake::FakeHost::default();
    host.paths.insert(IMAGE.into(), sdk::PathKind::RegularFile);
    host.nodes.push(sdk::fake::live_node("node-a"));
    let volume = sdk::Volume {
        name: "pv1".into(),
        backend: "local-pv".into(),
        access_mode: sdk::AccessMode::ReadWriteOnce,
        fs_type: "ext4".into(),
        mode: sdk::VolumeMode::Filesystem,
        mount_flags: vec![],
        options: vec![
            sdk::KeyValue { key: "path".into(), value: IMAGE.into() },
            sdk::KeyValue { key: "node".into(), value: "node-a".into() },
        ],
        secret_keys: vec![],
    };
    let holders = vec![sdk::fake::holder(&sdk::fake::consumer("node-a", "a"))];
    let paths = sdk::NodePaths {
        kubelet_root: "/var/lib/kubelet".into(),
        staging_dir: "/var/lib/kubelet/plugins/volagent/local-pv/mounts/pv1".into(),
        state_dir: "/var/lib/volagent/volumes/pv1".into(),
        discovery_dirs: vec!["/mnt/disks".into()],
    };
    (host, volume, sdk::fake::consumer("node-a", "b"), holders, paths)
}

/// The native decision: the same policy crate, called as plain Rust. Inputs
/// are cloned per call, as the wasm path copies them into the guest.
fn native_once(
    host: &sdk::fake::FakeHost,
    v: &sdk::Volume,
    c: &sdk::Consumer,
    h: &[sdk::Holder],
    p: &sdk::NodePaths,
) -> usize {
    let d =
        policy_local_pv::LocalPv::fence(host, v.clone(), c.clone(), h.to_vec(), host.nodes.clone())
            .expect("fence");
    assert_eq!(d, sdk::Decision::Grant);
    policy_local_pv::LocalPv::attach(host, v.clone(), c.clone(), vec![], p.clone())
        .expect("attach")
        .len()
}

fn native_decision() -> Vec<Duration> {
    let (host, v, c, h, p) = native_inputs();
    time(CALLS, || assert_eq!(std::hint::black_box(native_once(&host, &v, &c, &h, &p)), 4))
}

/// A process per decision, as a Flexvolume driver is run: this bench binary
/// re-executed with the options JSON as an argument, printing its answer.
fn exec_decision() -> Vec<Duration> {
    let me = std::env::current_exe().expect("current exe");
    let options = r#"{"kubernetes.io/pvOrVolumeName":"pv1","kubernetes.io/pod.name":"b","kubernetes.io/fsType":"ext4"}"#;
    time(EXEC_CALLS, || {
        let out = Command::new(&me).args(["--exec-child", options]).output().expect("exec child");
        assert!(out.status.success() && out.stdout.starts_with(b"{\"status\":\"Success\""));
    })
}

fn exec_child(options: &str) {
    let parsed: std::collections::BTreeMap<String, String> = serde_json_from(options);
    let (host, mut v, mut c, h, p) = native_inputs();
    v.name = parsed.get("kubernetes.io/pvOrVolumeName").cloned().unwrap_or_default();
    c.pod = parsed.get("kubernetes.io/pod.name").cloned().unwrap_or_default();
    let steps = native_once(&host, &v, &c, &h, &p);
    println!("{{\"status\":\"Success\",\"steps\":{steps}}}");
}

fn serde_json_from(s: &str) -> std::collections::BTreeMap<String, String> {
    serde_json::from_str(s).expect("options JSON")
}

fn time(n: usize, mut f: impl FnMut()) -> Vec<Duration> {
    for _ in 0..n / 10 + 1 {
        f(); // warm up
    }
    (0..n)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect()
}
