//! The chaos tier: the kernel's shared resources raced for, the agent
//! killed at random moments under load and restarted, kubelet's retries.
//! Each random test prints its seed; `VOLAGENT_CHAOS_SEED` replays one.
//! Needs root (loop devices, mounts).

mod common;
#[path = "support/agent.rs"]
mod agent_common;
mod driver_common;

use common::RootScratch;
use std::path::PathBuf;
use volagent::sys::Devices;

/// Loop devices attached while others are detached, all at once, as start-up
/// reconciliation releases devices while kubelet's retries attach new ones:
/// the kernel may hand out a device that is still being released or that
/// another attach binds first; every attach must still succeed.
#[test]
fn loop_attaches_racing_each_other_and_detaches_all_succeed() {
    let scratch = RootScratch::enter();
    std::fs::create_dir_all(scratch.path("disks")).expect("dir");
    let roots = volagent::sys::beneath::Roots::open(&[scratch.path("disks")]).expect("roots");
    let linux = std::sync::Arc::new(volagent::sys::linux::Linux::new(roots, "volagent:chaos"));
    const N: usize = 24;
    let files: Vec<PathBuf> = (0..2 * N).map(|i| scratch.image(&format!("disks/f{i}.img"), 4)).collect();
    let first: Vec<PathBuf> = files[..N].iter().map(|f| linux.loop_attach(f, false).expect("attach")).collect();

    let mut threads = Vec::new();
    for (i, device) in first.into_iter().enumerate() {
        let l = linux.clone();
        threads.push(std::thread::spawn(move || l.loop_detach(&device).map(|_| None).map_err(|e| format!("detach {i}: {e}"))));
        let (l, file) = (linux.clone(), files[N + i].clone());
        threads.push(std::thread::spawn(move || l.loop_attach(&file, false).map(Some).map_err(|e| format!("attach {}: {e}", N + i))));
    }
    let results: Vec<Result<Option<PathBuf>, String>> = threads.into_iter().map(|t| t.join().expect("thread")).collect();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "{failed:?}");
    let attached: Vec<PathBuf> = results.into_iter().filter_map(|r| r.ok().flatten()).collect();
    assert_eq!(attached.len(), N);
    let mut distinct = attached.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), N, "one device per file: {attached:?}");
    // A detached device stays bound until its last opener (udev) closes it.
    settle(&scratch, N);
    for d in attached {
        linux.loop_detach(&d).expect("detach");
    }
    settle(&scratch, 0);
}

/// Wait (a few seconds at most) for `n` loop devices over the scratch dir's files.
#[track_caller]
fn settle(scratch: &RootScratch, n: usize) {
    let start = std::time::Instant::now();
    while scratch.loops().len() != n {
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "{n} loop devices expected: {:?}", scratch.loops());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The device the kernel calls free is held by someone else for a moment
/// (udev probing it, a detach still completing): binding it fails with
/// EBUSY, again and again while it is held. The attach waits it out within
/// its budget instead of failing the mount.
#[test]
fn a_free_loop_device_held_for_a_moment_is_waited_for() {
    use std::os::unix::fs::OpenOptionsExt;
    let scratch = RootScratch::enter();
    std::fs::create_dir_all(scratch.path("disks")).expect("dir");
    let roots = volagent::sys::beneath::Roots::open(&[scratch.path("disks")]).expect("roots");
    let linux = volagent::sys::linux::Linux::new(roots, "volagent:chaos");
    let file = scratch.image("disks/held.img", 4);

    // The device the kernel hands out next (`losetup -f` asks it).
    let out = std::process::Command::new("losetup").arg("-f").output().expect("losetup");
    let free = String::from_utf8(out.stdout).expect("utf-8").trim().to_string();
    assert!(out.status.success() && free.starts_with("/dev/loop"), "{free}");
    // An exclusive open claims the block device: LOOP_CONFIGURE on it fails
    // with EBUSY while it is held.
    let held = std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_EXCL).open(&free).expect("hold the free device");
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
    });
    let device = linux.loop_attach(&file, false).expect("the attach waits for the held device");
    release.join().expect("release");
    assert!(scratch.loops().contains(&device));
    linux.loop_detach(&device).expect("detach");
    settle(&scratch, 0);
}
