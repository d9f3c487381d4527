//! An RBD image as a block device on a node without rbd.ko or nbd.ko, two
//! ways, on the same image of a real Ceph in the same run: volagent's NBD
//! server in front of librbd, reached through the agent's own FUSE client
//! (`volagent nbd fuse`) on a loop device (its userspace attach path), against `rbd-fuse` on a loop device (the
//! fallback Ceph itself ships); and the agent's path again with librbd's
//! write-back cache on, which the agent turns off (a write acknowledged
//! from the cache would be lost with a killed helper), to show what that
//! costs. fio, direct I/O on each loop device (and
//! the loop devices' own I/O to their files direct too, past the page cache):
//! sequential read and write (1 MiB, depth 8), 4 KiB random read and write
//! (depth 32). Ceph is single-node with a memstore OSD, so the figures
//! measure the paths, not disks.
//! Needs root and a cluster: `scripts/ceph-env start`, then
//! `VOLAGENT_CEPH_DIR=/var/tmp/volagent-ceph cargo bench -p volagent --bench rbd_throughput`;
//! `RBD_BENCH_ROUNDS` sets the rounds (median reported), `RBD_BENCH_SECS`
//! fio's run time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use volagent::nbd::{Exports, Listener, Server};
use volagent::sys::rbd_export::{CephClient, RbdExport, RbdTarget};
use volagent_test_support::bench::{env_or, median, run};
use volagent_test_support::scratch;
use volagent_test_support::{Deadline, wait_until};

const IMAGE_MIB: u64 = 512;

fn wait_for(what: &str, ready: impl FnMut() -> bool) {
    let deadline = Deadline::within(Duration::from_secs(30)).polling(Duration::from_millis(10));
    wait_until(deadline, what, ready);
}

/// A FUSE daemon, unmounted and stopped on drop.
struct Fuse {
    child: Child,
    dir: PathBuf,
}

impl Drop for Fuse {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3").arg("-u").arg(&self.dir).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fio(device: &Path, rw: &str, bs: &str, depth: &str, secs: u64) -> (f64, f64) {
    let out = run(Command::new("fio")
        .args([
            "--name=bench",
            "--output-format=json",
            "--time_based",
            "--group_reporting",
            "--ioengine=libaio",
            "--direct=1",
        ])
        .arg(format!("--filename={}", device.display()))
        .arg(format!("--runtime={secs}"))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={bs}"))
        .arg(format!("--iodepth={depth}")));
    let json = out.find('{').map(|i| &out[i..]).unwrap_or(&out);
    let json: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("fio json: {e}: {out}"));
    let side = if rw.contains("write") { "write" } else { "read" };
    let job = &json["jobs"][0][side];
    (job["iops"].as_f64().unwrap_or(0.0), job["bw"].as_f64().unwrap_or(0.0) / 1024.0)
}

/// A loop device over `file` with direct I/O to it: reads reach the FUSE
/// daemon (and Ceph) instead of the file's page cache.
fn losetup(file: &Path) -> PathBuf {
    let device = PathBuf::from(
        run(Command::new("losetup").args(["--find", "--show", "--direct-io=on"]).arg(file)).trim(),
    );
    let name = device.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
    assert_eq!(
        dio.trim(),
        "1",
        "{} over {} without direct I/O would measure the page cache",
        device.display(),
        file.display()
    );
    device
}

/// The image behind an NBD server in this process (librbd with `options`
/// over the agent's), its FUSE client, and a loop device on the client's
/// file: the agent's userspace attach path.
fn serve(
    scratch: &scratch::RootScratch,
    name: &str,
    target: &RbdTarget,
    options: &[(&str, &str)],
) -> (PathBuf, Fuse, Server) {
    let exports = Exports::default();
    exports.insert(
        "",
        Arc::new(
            RbdExport::open_with(target, false, options).expect("open the image through librbd"),
        ),
    );
    let socket = scratch.path(&format!("{name}.sock"));
    let server = Server::start(Listener::unix(&socket).expect("listener"), exports, 8, None)
        .expect("server");
    let dir = scratch.path(&format!("{name}-fuse"));
    std::fs::create_dir_all(&dir).expect("client dir");
    let pid = scratch.path(&format!("{name}-fuse.pid"));
    let client = Fuse {
        child: Command::new(env!("CARGO_BIN_EXE_volagent"))
            .args(["nbd", "fuse", "--server"])
            .arg(format!("unix:{}", socket.display()))
            .arg("--pid-file")
            .arg(&pid)
            .arg(dir.join("disk"))
            .spawn()
            .expect("volagent nbd fuse"),
        dir: dir.clone(),
    };
    wait_for("volagent nbd fuse", || pid.exists());
    (losetup(&dir.join("disk")), client, server)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    let Ok(ceph) = std::env::var("VOLAGENT_CEPH_DIR") else {
        println!(
            "rbd_throughput: skipped — set VOLAGENT_CEPH_DIR to a cluster's dir (scripts/ceph-env start prints it)"
        );
        return;
    };
    if !nix::unistd::geteuid().is_root() {
        println!("rbd_throughput: skipped — needs root (loop devices and FUSE)");
        return;
    }
    let ceph = PathBuf::from(ceph);
    let conf = ceph.join("ceph.conf");
    let rounds = env_or("RBD_BENCH_ROUNDS", 3).max(1) as usize;
    let secs = env_or("RBD_BENCH_SECS", 4).max(1);
    let scratch = scratch::RootScratch::enter();
    let image = format!("bench-{}", std::process::id());
    run(Command::new("rbd").arg("-c").arg(&conf).args([
        "create",
        "--size",
        &format!("{IMAGE_MIB}M"),
        &format!("rbd/{image}"),
    ]));

    // volagent: librbd behind the NBD server, its FUSE client, a loop device.
    let target = RbdTarget {
        client: CephClient {
            conf: Some(conf.clone()),
            monitors: None,
            user: "admin".into(),
            keyring: Some(ceph.join("keyring")),
            key: None,
        },
        pool: "rbd".into(),
        image: image.clone(),
    };
    let (ours, client, server) = serve(&scratch, "nbd", &target, &[]);
    let (cached, cached_client, cached_server) =
        serve(&scratch, "cached", &target, &[("rbd_cache", "true")]);

    // rbd-fuse: the image as a file, a loop device.
    let rbd_dir = scratch.path("rbd-fuse");
    std::fs::create_dir_all(&rbd_dir).expect("rbd-fuse dir");
    let rbd_fuse = Fuse {
        child: Command::new("rbd-fuse")
            .arg(&rbd_dir)
            .arg("-c")
            .arg(&conf)
            .args(["-p", "rbd", "-r", &image, "-f"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("rbd-fuse (scripts/ceph-env installs it)"),
        dir: rbd_dir.clone(),
    };
    wait_for("rbd-fuse", || rbd_dir.join(&image).exists());
    let theirs = losetup(&rbd_dir.join(&image));

    let tests = [
        ("seq read, 1M depth 8", "read", "1M", "8"),
        ("seq write, 1M depth 8", "write", "1M", "8"),
        ("4k randread, depth 32", "randread", "4k", "32"),
        ("4k randwrite, depth 32", "randwrite", "4k", "32"),
    ];
    println!(
        "RBD image ({IMAGE_MIB} MiB, single-node Ceph, memstore) as a block device, median of {rounds} rounds"
    );
    println!(
        "{:<24} {:>22} {:>22} {:>8} {:>22} {:>8}",
        "", "volagent nbd + librbd", "rbd-fuse", "ratio", "same, librbd cache on", "ratio"
    );
    for (what, rw, bs, depth) in tests {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let pick = |r: (f64, f64)| if bs == "1M" { r.1 } else { r.0 };
            a.push(pick(fio(&ours, rw, bs, depth, secs)));
            b.push(pick(fio(&theirs, rw, bs, depth, secs)));
            c.push(pick(fio(&cached, rw, bs, depth, secs)));
        }
        let (a, b, c) = (median(a), median(b), median(c));
        let unit = if bs == "1M" { "MiB/s" } else { "IOPS" };
        println!(
            "{what:<24} {a:>16.0} {unit:<5} {b:>16.0} {unit:<5} {:>7.2}x {c:>16.0} {unit:<5} {:>7.2}x",
            a / b,
            a / c
        );
    }

    for dev in [&ours, &theirs, &cached] {
        run(Command::new("losetup").arg("-d").arg(dev));
    }
    drop(rbd_fuse);
    drop((client, cached_client));
    drop((server, cached_server));
    let _ = Command::new("rbd")
        .arg("-c")
        .arg(&conf)
        .args(["rm", "--no-progress", &format!("rbd/{image}")])
        .output();
}
