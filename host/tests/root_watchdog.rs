//! The root tests' FUSE watchdog: a read through a FUSE mount whose daemon
//! no longer answers blocks in the kernel, where no signal reaches it; the
//! watchdog aborts the connection after its time, so the read fails and
//! the test ends instead of hanging CI. Needs root.
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
