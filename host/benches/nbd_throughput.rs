//! volagent's NBD server against qemu-nbd and nbdkit serving the same file
//! in the same run: sequential read and write with nbdcopy (1 GiB, the
//! connections each server allows), 4 KiB random read and write with fio's
//! nbd engine (queue depth 32). With root, also the added latency of the
//! userspace attach path (the export through the agent's FUSE client on a
//! loop device, and through nbdfuse, the reference) against a plain loop
//! device on the same file (fio, 4 KiB, depth 1, and 1 MiB, depth 8; direct).
//! Run: `cargo bench -p volagent --bench nbd_throughput`; `NBD_BENCH_ROUNDS`
//! sets the rounds (median reported), `NBD_BENCH_SECS` fio's run time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use volagent::nbd::{Exports, Listener, Server};
use volagent::sys::export_file::FileExport;
use volagent_test_support::bench::{env_or, median, run};
use volagent_test_support::scratch;
use volagent_test_support::{Deadline, wait_until};

const SIZE: u64 = 1 << 30;

fn wait_for_socket(socket: &Path) {
    let deadline = Deadline::within(Duration::from_secs(10)).polling(Duration::from_millis(10));
    wait_until(deadline, &format!("{} to accept", socket.display()), || {
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    });
}

enum Peer {
    Ours(#[allow(dead_code)] Server),
    Process(Child),
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Peer::Process(child) = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Target {
    name: &'static str,
    uri: String,
    _peer: Peer,
}

fn start_servers(dir: &Path, image: &Path) -> Vec<Target> {
    let exports = Exports::default();
    exports.insert("", Arc::new(FileExport::open(image, false).expect("export")));
    let ours = dir.join("volagent.sock");
    let server =
        Server::start(Listener::unix(&ours).expect("listener"), exports, 64, None).expect("server");
    let qemu = dir.join("qemu.sock");
    // Shared by up to 8 clients, so that nbdcopy may open several connections.
    let q = Command::new("qemu-nbd")
        .args(["-f", "raw", "-t", "-e", "8", "--cache=writeback", "-k"])
        .arg(&qemu)
        .arg(image)
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-nbd (scripts/setup installs it)");
    let kit = dir.join("nbdkit.sock");
    let k = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(&kit)
        .arg("file")
        .arg(image)
        // It logs the readiness probes' connections as broken handshakes.
        .stderr(Stdio::null())
        .spawn()
        .expect("nbdkit (scripts/setup installs it)");
    wait_for_socket(&qemu);
    wait_for_socket(&kit);
    let uri = |s: &Path| format!("nbd+unix:///?socket={}", s.display());
    vec![
        Target { name: "volagent", uri: uri(&ours), _peer: Peer::Ours(server) },
        Target { name: "qemu-nbd", uri: uri(&qemu), _peer: Peer::Process(q) },
        Target { name: "nbdkit", uri: uri(&kit), _peer: Peer::Process(k) },
    ]
}

/// MiB/s of one nbdcopy.
fn nbdcopy(from: &str, to: &str) -> f64 {
    let start = Instant::now();
    run(Command::new("nbdcopy").arg(from).arg(to));
    (SIZE >> 20) as f64 / start.elapsed().as_secs_f64()
}

struct FioResult {
    iops: f64,
    mib_s: f64,
    mean_latency_us: f64,
}

fn fio(args: &[&str], rw: &str, secs: u64) -> FioResult {
    let out = run(Command::new("fio")
        .args(["--name=bench", "--output-format=json", "--time_based", "--group_reporting"])
        .arg(format!("--runtime={secs}"))
        .arg(format!("--rw={rw}"))
        .args(args));
    // fio may print notes before the JSON.
    let json = out.find('{').map(|i| &out[i..]).unwrap_or(&out);
    let json: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("fio json: {e}: {out}"));
    let side = if rw.contains("write") { "write" } else { "read" };
    let job = &json["jobs"][0][side];
    FioResult {
        iops: job["iops"].as_f64().unwrap_or(0.0),
        mib_s: job["bw"].as_f64().unwrap_or(0.0) / 1024.0,
        mean_latency_us: job["clat_ns"]["mean"].as_f64().unwrap_or(0.0) / 1000.0,
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    let rounds = env_or("NBD_BENCH_ROUNDS", 3).max(1) as usize;
    let secs = env_or("NBD_BENCH_SECS", 4).max(1);
    let dir = tempfile::Builder::new()
        .prefix("volagent-nbd-bench")
        .tempdir_in("/var/tmp")
        .expect("tempdir");
    let image = dir.path().join("disk.img");
    let source = dir.path().join("source.img");
    run(Command::new("dd")
        .args(["if=/dev/urandom", "bs=1M", "count=1024", "status=none"])
        .arg(format!("of={}", source.display())));
    std::fs::copy(&source, &image).expect("image");
    let targets = start_servers(dir.path(), &image);

    // name -> (seq read, seq write, rand read, rand write) samples
    let mut samples: Vec<[Vec<f64>; 4]> = targets.iter().map(|_| Default::default()).collect();
    for _ in 0..rounds {
        for (t, s) in targets.iter().zip(samples.iter_mut()) {
            s[0].push(nbdcopy(&t.uri, "null:"));
            s[1].push(nbdcopy(&source.display().to_string(), &t.uri));
            let engine = [
                "--ioengine=nbd",
                &format!("--uri={}", t.uri),
                "--bs=4k",
                "--iodepth=32",
                "--size=1g",
            ]
            .map(String::from);
            let engine: Vec<&str> = engine.iter().map(String::as_str).collect();
            s[2].push(fio(&engine, "randread", secs).iops);
            s[3].push(fio(&engine, "randwrite", secs).iops);
        }
    }
    let medians: Vec<[f64; 4]> = samples.into_iter().map(|s| s.map(median)).collect();
    println!("NBD server throughput, 1 GiB file in the page cache, median of {rounds} rounds");
    println!(
        "{:<10} {:>14} {:>14} {:>16} {:>16}",
        "server", "seq read MiB/s", "seq write MiB/s", "4k randread IOPS", "4k randwrite IOPS"
    );
    for (t, m) in targets.iter().zip(&medians) {
        println!("{:<10} {:>14.0} {:>15.0} {:>16.0} {:>17.0}", t.name, m[0], m[1], m[2], m[3]);
    }
    let ours = medians[0];
    for (t, m) in targets.iter().zip(&medians).skip(1) {
        println!(
            "volagent / {:<8}: seq read {:.2}x, seq write {:.2}x, randread {:.2}x, randwrite {:.2}x",
            t.name,
            ours[0] / m[0],
            ours[1] / m[1],
            ours[2] / m[2],
            ours[3] / m[3]
        );
    }
    drop(targets);

    if nix::unistd::geteuid().is_root() {
        attach_latency(&image, secs);
    } else {
        println!("userspace attach latency: skipped (needs root for loop devices and FUSE)");
    }
}

/// fio on a loop device over `file`, and on loop devices over the same
/// file served by volagent's NBD server through the agent's own FUSE
/// client (`volagent nbd fuse`, the attach path) and through nbdfuse (the
/// reference it replaced).
fn attach_latency(image: &Path, secs: u64) {
    let scratch = scratch::RootScratch::enter();
    let exports = Exports::default();
    exports.insert("", Arc::new(FileExport::open(image, false).expect("export")));
    let socket = scratch.path("nbd.sock");
    let _server = Server::start(Listener::unix(&socket).expect("listener"), exports, 8, None)
        .expect("server");
    // Each takes its pid file, then the file, then what follows it.
    let client = |name: &str, cmd: &mut Command, after: &[&str]| {
        let dir = scratch.path(name);
        std::fs::create_dir_all(&dir).expect("fuse dir");
        let pidfile = scratch.path(&format!("{name}.pid"));
        let child = cmd
            .arg(&pidfile)
            .arg(dir.join("nbd"))
            .args(after)
            .spawn()
            .unwrap_or_else(|e| panic!("{name} (scripts/setup installs it): {e}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pidfile.exists() {
            assert!(Instant::now() < deadline, "{name} never became ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        (child, dir)
    };
    let server = format!("unix:{}", socket.display());
    let ours = client(
        "volagent",
        Command::new(env!("CARGO_BIN_EXE_volagent")).args([
            "nbd",
            "fuse",
            "--server",
            &server,
            "--pid-file",
        ]),
        &[],
    );
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    let nbdfuse = client("nbdfuse", Command::new("nbdfuse").arg("-P"), &[&uri]);
    let attach = |file: &Path| -> PathBuf {
        PathBuf::from(run(Command::new("losetup").args(["--find", "--show"]).arg(file)).trim())
    };
    let plain = attach(image);
    let via_ours = attach(&ours.1.join("nbd"));
    let via_nbdfuse = attach(&nbdfuse.1.join("nbd"));
    let measure = |dev: &Path, rw: &str, bs: &str, depth: &str| {
        let args = [
            format!("--filename={}", dev.display()),
            "--ioengine=libaio".into(),
            "--direct=1".into(),
            format!("--bs={bs}"),
            format!("--iodepth={depth}"),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fio(&args, rw, secs)
    };
    println!(
        "userspace attach path (volagent nbd fuse + loop; nbdfuse + loop as the reference) vs a plain loop device on the same file"
    );
    for (what, rw, bs, depth) in [
        ("4k randread, depth 1", "randread", "4k", "1"),
        ("4k randwrite, depth 1", "randwrite", "4k", "1"),
        ("1M read, depth 8", "read", "1M", "8"),
    ] {
        let p = measure(&plain, rw, bs, depth);
        let o = measure(&via_ours, rw, bs, depth);
        let n = measure(&via_nbdfuse, rw, bs, depth);
        if bs == "1M" {
            println!(
                "{what:<22}: plain {:>7.0} MiB/s, ours {:>7.0} MiB/s ({:.2}x plain), nbdfuse {:>7.0} MiB/s (ours {:.2}x nbdfuse)",
                p.mib_s,
                o.mib_s,
                o.mib_s / p.mib_s,
                n.mib_s,
                o.mib_s / n.mib_s
            );
        } else {
            println!(
                "{what:<22}: plain {:>6.1} µs, ours {:>6.1} µs (+{:.1} µs), nbdfuse {:>6.1} µs (+{:.1} µs; ours {:.2}x nbdfuse's latency)",
                p.mean_latency_us,
                o.mean_latency_us,
                o.mean_latency_us - p.mean_latency_us,
                n.mean_latency_us,
                n.mean_latency_us - p.mean_latency_us,
                o.mean_latency_us / n.mean_latency_us
            );
        }
    }
    for dev in [&plain, &via_ours, &via_nbdfuse] {
        run(Command::new("losetup").arg("-d").arg(dev));
    }
    for (mut child, dir) in [ours, nbdfuse] {
        run(Command::new("umount").arg(&dir));
        let _ = child.wait();
    }
}
