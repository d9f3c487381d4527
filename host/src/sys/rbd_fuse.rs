//! rbd-fuse: an RBD image exposed as a file through FUSE
//! (`<base>/<key>/<image>`), which the executor attaches to a loop device.
//! Its clients live beside nbdfuse's ([`super::nbd::fuse`]), which lists,
//! watches and stops them; this starts them.

use super::launch::{Launch, Program};
use super::nbd::files::remove_keyring;
use super::nbd::fuse::Clients;
use super::rbd_export::RbdTarget;
use super::{FuseClients, RbdFuse, SysError, io};
use std::path::Path;
use std::sync::Arc;

/// rbd-fuse, where the node has it installed.
pub struct RbdFuseClients {
    clients: Arc<Clients>,
}

impl RbdFuseClients {
    /// Whether rbd-fuse is installed: on `$PATH`.
    pub fn installed() -> bool {
        super::nbd::files::on_path("rbd-fuse")
    }

    /// rbd-fuse clients kept among `clients`.
    pub fn new(clients: Arc<Clients>) -> RbdFuseClients {
        RbdFuseClients { clients }
    }

    /// Wait (up to the ready timeout) for client `key`, process `pid`, to
    /// serve `file`; on failure stop it and say why.
    fn await_file(&self, key: &str, pid: nix::unistd::Pid, file: &Path) -> Result<(), SysError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let probe = file.to_path_buf();
        // The first request through a FUSE mount waits for the daemon:
        // asked from a thread, so a daemon that never answers costs only it.
        std::thread::spawn(move || drop(tx.send(std::fs::metadata(&probe).map(|m| m.len()))));
        let failed = match rx.recv_timeout(self.clients.ready_timeout) {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => SysError::Command {
                program: "rbd-fuse",
                path: file.to_path_buf(),
                message: format!("{e}: {}", self.clients.log_tail(key)),
            },
            Err(_) => SysError::Timeout {
                program: "rbd-fuse",
                path: file.to_path_buf(),
                secs: self.clients.ready_timeout.as_secs(),
            },
        };
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.clients.clear_stale_mount(key);
        for f in [self.clients.files().pid_file(key), self.clients.files().log_file(key)] {
            let _ = std::fs::remove_file(f);
        }
        let _ = std::fs::remove_dir(self.clients.files().dir(key));
        Err(failed)
    }
}

impl RbdFuse for RbdFuseClients {
    fn available(&self) -> bool {
        Self::installed()
    }

    fn connect(&self, key: &str, target: &RbdTarget, read_only: bool) -> Result<bool, SysError> {
        let dir = self.clients.files().dir(key);
        if self.clients.mounted(key)?.is_some() && self.clients.running(key).is_some() {
            return Ok(false);
        }
        self.clients.clear_stale_mount(key)?;
        std::fs::create_dir_all(&dir).map_err(io("mkdir", &dir))?;
        let client = &target.client;
        // rbd-fuse takes the user, keyring and monitors as Ceph arguments in
        // the environment; the key itself only in a 0600 keyring file that
        // is removed once it has connected.
        let written = self.clients.files().write_keyring(key, client)?;
        let mut ceph_args = format!("--id {}", client.user);
        if let Some(keyring) = written.as_ref().or(client.keyring.as_ref()) {
            ceph_args.push_str(&format!(" --keyring {}", keyring.display()));
        }
        if let Some(monitors) = &client.monitors {
            ceph_args.push_str(&format!(" --mon-host {monitors}"));
        }
        // Connecting gives up with the client's own deadline, not librados' 300 s.
        ceph_args.push_str(&format!(
            " --client-mount-timeout {}",
            self.clients.ready_timeout.as_secs().max(1)
        ));
        let log_path = self.clients.files().log_file(key);
        let log = std::fs::File::create(&log_path).map_err(io("create", &log_path))?;
        let mut launch = Launch::new(Program::RbdFuse, &dir)
            .arg("-f")
            .arg("-c")
            .arg(client.conf.as_deref().unwrap_or(Path::new("/dev/null")))
            .args(["-p", &target.pool, "-r", &target.image]);
        if read_only {
            launch = launch.args(["-o", "ro"]);
        }
        let mut launch = launch.arg(&dir).log_to(log)?;
        launch.env.push(("CEPH_ARGS".into(), ceph_args));
        let file = self.clients.rbd_fuse_file(key, &target.image);
        let spawned = self.clients.launcher().spawn(launch).inspect_err(|_| {
            let _ = std::fs::remove_file(&log_path);
            let _ = std::fs::remove_dir(&dir);
        });
        let ready = spawned.and_then(|child| {
            // It mounts first and connects to the cluster after, when the
            // kernel's first request comes: the image's file is there
            // once it has connected (and read the keyring).
            let pid = nix::unistd::Pid::from_raw(child.pid() as i32);
            self.clients.await_mount(key, child, "rbd-fuse")?;
            self.await_file(key, pid, &file)
        });
        remove_keyring(written);
        ready?;
        Ok(true)
    }
}
