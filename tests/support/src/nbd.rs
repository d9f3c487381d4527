//! What the NBD root tests share: real servers (qemu-nbd, nbdkit,
//! volagent's own) for an export, the nbd driver's options, and how to
//! find the client and helper processes and read a volume's data back.
#![allow(clippy::unwrap_used)]

use crate::agent::Node;
use crate::driver::{self, kubelet_options};
use crate::wait_until;
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A server process, stopped on drop.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How long a server or client may take to come or go.
pub const NBD_WAIT: Duration = Duration::from_secs(20);

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub enum Peer {
    QemuNbd,
    Nbdkit,
    Volagent,
}

/// Serve `image` as export "disk0"; the `server` option that reaches it.
pub fn serve(node: &Node, peer: Peer, image: &Path) -> (Server, String) {
    match peer {
        Peer::QemuNbd => {
            let socket = node.scratch.path("qemu.sock");
            let child = Command::new("qemu-nbd")
                .args(["-f", "raw", "-t", "-e", "8", "-x", "disk0", "-k"])
                .arg(&socket)
                .arg(image)
                .stderr(Stdio::null())
                .spawn()
                .expect("qemu-nbd (scripts/setup installs it)");
            wait_until(NBD_WAIT, "qemu-nbd", || {
                std::os::unix::net::UnixStream::connect(&socket).is_ok()
            });
            (Server(child), format!("unix:{}", socket.display()))
        }
        Peer::Nbdkit => {
            let port = free_port();
            let child = Command::new("nbdkit")
                .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "-e", "disk0", "file"])
                .arg(image)
                .stderr(Stdio::null())
                .spawn()
                .expect("nbdkit (scripts/setup installs it)");
            wait_until(NBD_WAIT, "nbdkit", || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            });
            (Server(child), format!("127.0.0.1:{port}"))
        }
        Peer::Volagent => {
            let socket = node.scratch.path("volagent-nbd.sock");
            let child = Command::new(&node.bin)
                .args(["nbd", "serve", "--unix"])
                .arg(&socket)
                .arg(format!("--export=disk0={}", image.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("volagent nbd serve");
            wait_until(NBD_WAIT, "volagent nbd serve", || {
                std::os::unix::net::UnixStream::connect(&socket).is_ok()
            });
            (Server(child), format!("unix:{}", socket.display()))
        }
    }
}

pub fn nbd_options(volume: &str, pod: &str, uid: &str, fs: &str, server: &str) -> Value {
    let mut o = kubelet_options(volume, pod, uid, fs, "");
    let o2 = o.as_object_mut().unwrap();
    o2.remove("path");
    o2.insert("server".into(), server.into());
    o2.insert("export".into(), "disk0".into());
    o2.insert("attach".into(), "userspace".into());
    o
}

/// A node whose agent (run from `bin`) serves the nbd backend too.
pub fn nbd_node(bin: &str) -> Node {
    Node::start_with(bin, &[(volagent_test_artifacts::NBD, "nbd")])
}

pub fn driver(node: &Node, args: &[&str]) -> (i32, Value) {
    driver::run_driver(Command::new(node.driver_of("node-a", "nbd")).args(args))
}

/// Userspace NBD client processes (ours, nbdfuse, rbd-fuse) whose mount lies under `dir`.
pub fn clients_under(dir: &Path) -> Vec<i32> {
    crate::scratch::processes_under(dir, |a| {
        a.first().is_some_and(|p| p.ends_with("nbdfuse") || p.ends_with("rbd-fuse"))
            || a.get(1..3).is_some_and(|s| s[0] == "nbd" && s[1] == "fuse")
    })
}

/// The contents of `/data` in the ext4 or xfs filesystem on `image`, read
/// straight from the file.
pub fn read_back(image: &Path, fs: &str) -> Vec<u8> {
    let out = match fs {
        "ext4" => Command::new("debugfs")
            .args(["-R", "cat /data"])
            .arg(image)
            .stderr(Stdio::null())
            .output()
            .unwrap(),
        _ => {
            // xfs_db cannot cat a file: mount the file read-only instead.
            let dir = image.with_extension("mnt");
            std::fs::create_dir_all(&dir).unwrap();
            assert!(
                Command::new("mount")
                    .args(["-o", "ro,loop,norecovery"])
                    .arg(image)
                    .arg(&dir)
                    .status()
                    .unwrap()
                    .success()
            );
            let data = std::fs::read(dir.join("data")).unwrap();
            assert!(Command::new("umount").arg("-d").arg(&dir).status().unwrap().success());
            return data;
        }
    };
    out.stdout
}

/// Helper `volagent nbd serve` processes whose socket lies under `dir`.
pub fn servers_under(dir: &Path) -> Vec<i32> {
    crate::scratch::processes_under(dir, |a| a.get(1..3).is_some_and(|c| c == ["nbd", "serve"]))
}
