//! Discovery of local volumes: one scan of a discovery dir holding 1,000
//! mount points (small tmpfs mounts, in a private mount namespace), as the
//! agent makes it (the mount table read and parsed, every entry examined,
//! every filesystem sized), against the bare floor measured in the same
//! run: listing the dir and one statvfs per entry. Target: ≤ 200 ms a scan.
//! Needs root. Run: `cargo bench -p volagent --bench local_discovery`;
//! `LOCAL_DISCOVERY_VOLUMES` sets the number of volumes.

use std::time::{Duration, Instant};
use volagent::local::{LocalClass, discovery};
use volagent_test_support::scratch;

const SCANS: usize = 20;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo's bench harness protocol
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("local_discovery needs root: mounts");
        std::process::exit(1);
    }
    let volumes: usize =
        std::env::var("LOCAL_DISCOVERY_VOLUMES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let scratch = scratch::RootScratch::enter();
    let dir = scratch.path("disks");
    std::fs::create_dir_all(&dir).expect("dir");
    let made = Instant::now();
    for i in 0..volumes {
        let vol = dir.join(format!("vol{i:04}"));
        std::fs::create_dir(&vol).expect("dir");
        nix::mount::mount(
            Some("tmpfs"),
            &vol,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=16m"),
        )
        .expect("tmpfs");
    }
    eprintln!("{volumes} tmpfs mount points made in {:?}", made.elapsed());
    let classes = vec![LocalClass { name: "bench".into(), dirs: vec![dir.clone()] }];

    let mut ours = Vec::new();
    let mut floor = Vec::new();
    for _ in 0..SCANS {
        let t = Instant::now();
        let text = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let table = volagent::sys::mountinfo::parse(&text).expect("parse");
        let scan = discovery::scan(&volagent::sys::inspect::Node, &classes, &table);
        ours.push(t.elapsed());
        assert_eq!(scan.volumes.len(), volumes, "{:?}", scan.skipped.first());

        let t = Instant::now();
        let mut n = 0;
        for e in std::fs::read_dir(&dir).expect("list").flatten() {
            nix::sys::statvfs::statvfs(&e.path()).expect("statvfs");
            n += 1;
        }
        floor.push(t.elapsed());
        assert_eq!(n, volumes);
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (ours, floor) = (median(&mut ours), median(&mut floor));
    println!(
        "local_discovery: {volumes} volumes, median of {SCANS} scans: {:.1} ms a scan ({:.1} µs a volume); \
         bare listing + statvfs {:.1} ms; ratio {:.2}; target ≤ 200 ms",
        ours.as_secs_f64() * 1e3,
        ours.as_secs_f64() * 1e6 / volumes as f64,
        floor.as_secs_f64() * 1e3,
        ours.as_secs_f64() / floor.as_secs_f64().max(1e-9)
    );
    // Unmount before the scratch goes (its drop detaches what is left too).
    for i in 0..volumes {
        let _ =
            nix::mount::umount2(&dir.join(format!("vol{i:04}")), nix::mount::MntFlags::MNT_DETACH);
    }
}
