//! The root tests' FUSE watchdog: a read through a FUSE mount whose daemon
//! no longer answers blocks in the kernel, where no signal reaches it; the
//! watchdog aborts the connection after its time, so the read fails and
//! the test ends instead of hanging CI. And a root test that nextest ends
//! for running past its limit (SIGTERM) still detaches its loop devices.
//! Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use volagent_test_support::scratch::RootScratch;
use volagent_test_support::wait_until;

#[test]
fn a_read_hung_on_a_stopped_nbd_server_is_failed_by_the_watchdog() {
    let scratch = RootScratch::enter_with_watchdog(Duration::from_secs(4));
    let image = scratch.image("disk.img", 16);
    let socket = scratch.path("nbd.sock");
    let mut server = Command::new("qemu-nbd")
        .args(["-f", "raw", "-k"])
        .arg(&socket)
        .arg(&image)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    wait_until(Duration::from_secs(10), "qemu-nbd to listen", || socket.exists());
    let dir = scratch.path("fuse");
    std::fs::create_dir_all(&dir).unwrap();
    let pid_file = scratch.path("nbdfuse.pid");
    let mut client = Command::new("nbdfuse")
        .arg("-P")
        .arg(&pid_file)
        .arg(dir.join("disk"))
        .arg(format!("nbd+unix:///?socket={}", socket.display()))
        .spawn()
        .unwrap();
    // Both within the same 10 s.
    wait_until(Duration::from_secs(10).saturating_sub(start.elapsed()), "nbdfuse to serve", || {
        pid_file.exists()
    });
    // The server stops answering: a read through the client hangs.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id() as i32),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let began = Instant::now();
    // O_DIRECT: the read goes to the daemon, not the page cache.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECT)
        .open(dir.join("disk"))
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let read = f.read(&mut buf);
    let waited = began.elapsed();
    assert!(read.is_err(), "the hung read failed: {read:?}");
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(30),
        "it failed at the watchdog, after {waited:?}"
    );
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id() as i32),
        nix::sys::signal::Signal::SIGCONT,
    );
    let _ = server.kill();
    let _ = server.wait();
    let _ = client.wait();
}

/// What the inner test prints once its loop device is attached.
const HOLDING: &str = "holding ";

/// nextest ends a test that runs past its limit with SIGTERM, and SIGKILL
/// after a grace period. Mounts go with the test's namespace; its loop
/// devices would stay attached on the machine, over files gone with them.
#[test]
fn a_root_test_ended_by_sigterm_detaches_its_loop_devices() {
    assert!(nix::unistd::geteuid().is_root(), "needs root: loop devices");
    let mut inner = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "--nocapture", "holds_a_loop_device_until_ended"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(inner.stdout.take().unwrap());
    // The harness prints its own lines first.
    let mut line = String::new();
    let device = loop {
        line.clear();
        let n = std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(n > 0, "the inner test ended before it held a loop device");
        if let Some(device) = line.trim().strip_prefix(HOLDING) {
            break device.to_string();
        }
    };
    let backing = format!("/sys/block/{}/loop/backing_file", device.trim_start_matches("/dev/"));
    let file = std::fs::read_to_string(&backing).unwrap();
    let _left =
        LeftAttached { device: device.clone(), backing: backing.clone(), file: file.clone() };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(inner.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status =
        wait_until(Duration::from_secs(20), "the inner test to exit", || inner.try_wait().unwrap());
    assert_eq!(status.code(), Some(143), "it exits as SIGTERM would have it");
    // Detached, or (opened meanwhile by udev's probe) detaching at its close.
    wait_until(Duration::from_secs(3), "the loop device to be detached", || {
        std::fs::read_to_string(&backing).map_or(true, |now| now != file)
    });
}

/// Detaches the inner test's device if it is still attached when the
/// outer test ends, failed: this test must not leak what it checks for.
struct LeftAttached {
    device: String,
    backing: String,
    file: String,
}

impl Drop for LeftAttached {
    fn drop(&mut self) {
        if std::fs::read_to_string(&self.backing).is_ok_and(|now| now == self.file) {
            let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
        }
    }
}

#[test]
#[ignore = "run by a_root_test_ended_by_sigterm_detaches_its_loop_devices, which ends it"]
fn holds_a_loop_device_until_ended() {
    let scratch = RootScratch::enter();
    let image = scratch.image("held.img", 4);
    let out = Command::new("losetup").args(["--find", "--show"]).arg(&image).output().unwrap();
    assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
    println!("{HOLDING}{}", String::from_utf8_lossy(&out.stdout).trim());
    // Ended by the outer test long before this; run alone, it fails.
    std::thread::sleep(Duration::from_secs(60));
    panic!("not ended within 60 s");
}
