//! volagent's NBD server in front of librbd, against a real single-node
//! Ceph (scripts/ceph-env, which scripts/test starts for the run): what a
//! client writes through the server is in the RBD image bit for bit, as
//! `rbd export` reads it back, and the other way round; read-only exports
//! refuse writes; a missing image or a wrong key fails clearly, naming it.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use volagent_test_support::ceph;
use volagent_test_support::ceph::{Image, ceph_dir, rbd};
use volagent_test_support::wait_until;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// A keyring file for client.volagent, in `scratch`.
fn volagent_keyring(dir: &Path, scratch: &Path) -> PathBuf {
    let key = ceph::volagent_key(dir);
    let keyring = scratch.join("volagent.keyring");
    std::fs::write(&keyring, format!("[client.volagent]\n\tkey = {key}\n")).unwrap();
    keyring
}

/// `volagent nbd serve` of an RBD image, stopped on drop.
struct Server {
    child: Child,
    socket: PathBuf,
}

impl Drop for Server {
    /// SIGTERM: the server closes the image (and its watch) before it
    /// exits, so the image can be removed at once.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return; // reaped: its pid may be another process's now
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Serve `image` as client.volagent, with `keyring` (by default, the
/// user's real key).
fn serve(
    dir: &Path,
    scratch: &Path,
    image: &Image,
    keyring: Option<&Path>,
    extra: &[&str],
) -> Result<Server, String> {
    let keyring = keyring.map_or_else(|| volagent_keyring(dir, scratch), Path::to_path_buf);
    let socket = scratch.join("rbd.sock");
    let child = Command::new(VOLAGENT)
        .args(["nbd", "serve", "--unix"])
        .arg(&socket)
        .arg(format!("--export-rbd=disk0={}", image.spec()))
        .arg("--ceph-conf")
        .arg(dir.join("ceph.conf"))
        .args(["--ceph-user", "volagent", "--ceph-keyring"])
        .arg(keyring)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Stopped on drop from here on, also when the wait below fails.
    let mut server = Server { child, socket };
    // Up (None), or exited (its status): a refused start is what some tests want.
    let exited = wait_until(Duration::from_secs(60), "volagent nbd serve to come up", || {
        if std::os::unix::net::UnixStream::connect(&server.socket).is_ok() {
            return Some(None);
        }
        server.child.try_wait().unwrap().map(Some)
    });
    if let Some(status) = exited {
        let mut err = String::new();
        std::io::Read::read_to_string(server.child.stderr.as_mut().unwrap(), &mut err).unwrap();
        return Err(format!("{status}: {err}"));
    }
    Ok(server)
}

fn uri(server: &Server) -> String {
    format!("nbd+unix:///disk0?socket={}", server.socket.display())
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

#[test]
fn what_a_client_writes_through_the_server_is_in_the_image_and_back() {
    let dir = ceph_dir();
    let scratch = tempfile::tempdir().unwrap();
    let image = Image::create(&dir, 16);
    let server = serve(&dir, scratch.path(), &image, None, &[]).unwrap();
    let size = run(Command::new("nbdinfo").arg("--size").arg(uri(&server)));
    assert_eq!(String::from_utf8_lossy(&size.stdout).trim(), (16u64 << 20).to_string());

    let data: Vec<u8> =
        (0..16u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let input = scratch.path().join("in");
    std::fs::write(&input, &data).unwrap();
    run(Command::new("nbdcopy").args(["--connections", "4"]).arg(&input).arg(uri(&server)));
    drop(server);
    let exported = scratch.path().join("exported");
    rbd(&dir, &["export", "--no-progress", &image.spec(), exported.to_str().unwrap()]);
    assert!(
        std::fs::read(&exported).unwrap() == data,
        "rbd export reads what was written through the server"
    );

    // And the other way round: what rbd writes, a client reads.
    let other: Vec<u8> = data.iter().map(|b| b ^ 0x5a).collect();
    let input2 = scratch.path().join("in2");
    std::fs::write(&input2, &other).unwrap();
    rbd(
        &dir,
        &["import", "--no-progress", input2.to_str().unwrap(), &format!("{}-2", image.spec())],
    );
    let image2 = Image { dir: dir.clone(), name: format!("{}-2", image.name) };
    let server = serve(&dir, scratch.path(), &image2, None, &[]).unwrap();
    let output = scratch.path().join("out");
    run(Command::new("nbdcopy").arg(uri(&server)).arg(&output));
    assert!(std::fs::read(&output).unwrap() == other);
}

#[test]
fn a_read_only_export_refuses_writes() {
    let dir = ceph_dir();
    let scratch = tempfile::tempdir().unwrap();
    let image = Image::create(&dir, 4);
    let server = serve(&dir, scratch.path(), &image, None, &["--read-only"]).unwrap();
    let input = scratch.path().join("in");
    std::fs::write(&input, vec![1u8; 4 << 20]).unwrap();
    let out = Command::new("nbdcopy").arg(&input).arg(uri(&server)).output().unwrap();
    assert!(!out.status.success(), "a write to a read-only export must fail");
    let info = run(Command::new("nbdinfo").arg(uri(&server)));
    assert!(
        String::from_utf8_lossy(&info.stdout).contains("is_read_only: true"),
        "{}",
        String::from_utf8_lossy(&info.stdout)
    );
}

#[test]
fn a_missing_image_or_a_wrong_key_fails_naming_it() {
    let dir = ceph_dir();
    let scratch = tempfile::tempdir().unwrap();
    let missing = Image { dir: dir.clone(), name: "no-such-image".into() };
    let err = serve(&dir, scratch.path(), &missing, None, &[])
        .err()
        .expect("no server for a missing image");
    assert!(err.contains("rbd/no-such-image") && err.contains("open the image"), "{err}");

    let image = Image::create(&dir, 4);
    let bad = scratch.path().join("bad.keyring");
    std::fs::write(&bad, "[client.volagent]\n\tkey = AQBh6J5kAAAAABAAkNIs4GpyXcfA7ZV5VyHz3Q==\n")
        .unwrap();
    let err = serve(&dir, scratch.path(), &image, Some(&bad), &[])
        .err()
        .expect("no server with a wrong key");
    assert!(err.contains(&image.spec()) && err.contains("connect to the cluster"), "{err}");
}

/// The controller's image steps (librbd) share one connection per Ceph
/// cluster and user: after a create, a snapshot and a grow one connection
/// is kept; a wrong key makes none; a Ceph error (a pool that is not
/// there) drops the kept one, and the next step connects again. Prints
/// what a step costs with and without a connection at hand.
#[test]
fn the_controllers_image_steps_share_one_connection_and_drop_it_after_a_ceph_error() {
    use volagent::secret::Secret;
    use volagent::sys::rbd_export::CephClient;
    use volagent::sys::rbd_images::{ImageError, LibRbdImages, RbdImages};
    let dir = ceph_dir();
    let client = |key: String| CephClient {
        conf: Some(dir.join("ceph.conf")),
        monitors: None,
        user: "volagent-controller".into(),
        keyring: None,
        key: Some(Secret::new(key.into_bytes())),
    };
    let controller = client(ceph::controller_key(&dir));
    let images = LibRbdImages::default();
    let name = format!("conn-{}", ceph::rand_suffix());
    let cold = Instant::now();
    assert!(images.create(&controller, "rbd", &name, 8 << 20, None, 1).unwrap());
    let cold = cold.elapsed();
    let warm = Instant::now();
    assert_eq!(images.size(&controller, "rbd", &name).unwrap(), Some(8 << 20));
    let warm = warm.elapsed();
    images.snapshot(&controller, "rbd", &name, "s1").unwrap();
    images.remove_snapshot(&controller, "rbd", &name, "s1").unwrap();
    assert_eq!(images.grow(&controller, "rbd", &name, 16 << 20).unwrap(), 16 << 20);
    assert_eq!(images.connections(), 1, "one connection for every step");
    println!("an image step with a new connection: {cold:?}; with the kept one: {warm:?}");

    // A wrong key connects to nothing, and keeps nothing.
    let wrong = client("AQBsD0dnAAAAABAAAAAAAAAAAAAAAAAAAAAAAA==".into());
    assert!(images.size(&wrong, "rbd", &name).is_err());
    assert_eq!(images.connections(), 1);

    // A Ceph error drops the connection; the next step makes a new one.
    match images.size(&controller, "no-such-pool", &name) {
        Err(ImageError::Ceph(e)) => assert!(e.to_string().contains("no-such-pool"), "{e}"),
        other => panic!("a missing pool: {other:?}"),
    }
    assert_eq!(images.connections(), 0, "dropped after the error");
    assert!(images.remove(&controller, "rbd", &name).unwrap());
    assert_eq!(images.connections(), 1);
    assert_eq!(images.size(&controller, "rbd", &name).unwrap(), None);
}
