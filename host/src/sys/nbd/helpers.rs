//! The agent's helper NBD servers: `volagent nbd serve` (this binary) on
//! `<base>/<key>.sock`, serving a local file the agent opened beneath its
//! roots (handed over on standard input) or an RBD image through librbd.
//! A helper outlives the agent, since a client ends when its server does:
//! it is started by the launcher (the node's mounter, in a cluster), and
//! the next agent finds it by its pid file. A helper that ends before it
//! is stopped is started again ([`ExportHelpers::heal`]; [`super::keeper`]):
//! one serving a local file on the same open file; an rbd helper with its
//! arguments and the keyring kept beside them, taking over the image's
//! exclusive lock from its dead predecessor. librbd runs without its
//! write-back cache ([`crate::sys::rbd_export`]), so a write the dead one
//! acknowledged is on the cluster, and one it had not is sent again by the
//! client.

use super::files::{Layout, last_lines, remove_keyring};
use super::keeper::{Keeper, Kept, Recorded, Served, Successor};
use crate::sys::launch::{Launch, Launcher, Program};
use crate::sys::rbd_export::RbdTarget;
use crate::sys::{ExportHelpers, KernelNbd, SysError, io};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Helpers {
    files: Layout,
    /// The helper server: this agent's own binary (its name).
    program: PathBuf,
    /// Where helpers are started: here, or in the node's mounter.
    launcher: Arc<dyn Launcher>,
    /// How long a helper may take to listen, and to end once stopped.
    pub ready_timeout: Duration,
    pub stop_timeout: Duration,
    /// The node's kernel NBD: one way an rbd helper's export is reached.
    kernel: Arc<dyn KernelNbd>,
    /// Each running helper's arguments (and a local file helper's export),
    /// to start it again.
    keeper: Keeper,
}

impl Helpers {
    /// Helpers keeping their files in `base`; `kernel` is the node's kernel
    /// NBD (or its absence), for [`ExportHelpers::rbd_available`].
    pub fn new(base: PathBuf, kernel: Arc<dyn KernelNbd>) -> Helpers {
        Helpers {
            files: Layout::new(base),
            program: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("volagent")),
            launcher: Arc::new(crate::sys::launch::Local::default()),
            ready_timeout: Duration::from_secs(20),
            stop_timeout: Duration::from_secs(5),
            kernel,
            keeper: Keeper::default(),
        }
    }

    /// Helpers started by `launcher`.
    pub fn with_launcher(self, launcher: Arc<dyn Launcher>) -> Helpers {
        Helpers { launcher, ..self }
    }

    /// `<this binary> nbd serve` on `key`'s socket, its log as stderr.
    fn command(&self, key: &str, read_only: bool) -> Result<Launch, SysError> {
        let base = self.files.base();
        std::fs::create_dir_all(base).map_err(io("mkdir", base))?;
        let log_path = self.files.server_log_file(key);
        let log = std::fs::File::create(&log_path).map_err(io("create", &log_path))?;
        let socket = self.files.socket(key);
        let mut launch =
            Launch::new(Program::Volagent, &socket).args(["nbd", "serve", "--unix"]).arg(&socket);
        if read_only {
            launch = launch.arg("--read-only");
        }
        launch.stderr = Some(log);
        Ok(launch)
    }

    /// Start helper `key` and return once its socket accepts (it opens
    /// its export before it listens).
    fn start(&self, key: &str, launch: Launch) -> Result<bool, SysError> {
        let socket = self.files.socket(key);
        let log_path = self.files.server_log_file(key);
        let mut child = self.launcher.spawn(launch).inspect_err(|_| {
            let _ = std::fs::remove_file(&log_path);
        })?;
        let pid_file = self.files.server_pid_file(key);
        std::fs::write(&pid_file, child.pid().to_string()).map_err(io("write", &pid_file))?;
        let deadline = Instant::now() + self.ready_timeout;
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                let _ = std::fs::remove_file(&pid_file);
                let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(SysError::Command {
                    program: "volagent nbd serve",
                    path: socket,
                    message: format!("{status}: {}", last_lines(&tail, 5)),
                });
            }
            if Instant::now() >= deadline {
                child.kill();
                let _ = std::fs::remove_file(&pid_file);
                return Err(SysError::Timeout {
                    program: "volagent nbd serve",
                    path: socket,
                    secs: self.ready_timeout.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        child.keep();
        Ok(true)
    }

    /// Keep running helper `key` (a local file helper's export), if an
    /// agent recorded how it started it and it is not kept yet.
    fn keep(&self, key: &str) {
        if self.keeper.holds(key) {
            return;
        }
        let Some(recorded) = Recorded::read(&self.files.server_args_file(key)) else { return };
        let served = match recorded.export {
            Some((dev, ino)) => Served::Export(dev, ino),
            None if recorded.args.iter().any(|a| a == "--export-rbd") => Served::Process,
            None => return,
        };
        let Some(pid) = self.running(key) else { return };
        match Kept::from_process(pid, served, recorded) {
            Ok(kept) => self.keeper.put(key, kept),
            Err(e) => self.keeper.warn_once(
                key,
                format_args!(
                    "its export is not kept, so its death would fail the volume's I/O: {e}"
                ),
            ),
        }
    }

    /// Start helper `key` again if its process ended (on its kept export,
    /// or, an rbd helper, taking the image over from its dead
    /// predecessors); true when it did. The caller holds the keeper's
    /// restart lock.
    fn restart(&self, key: &str) -> Result<bool, SysError> {
        let Some(Successor { recorded, file, .. }) = self.keeper.ended(key) else {
            return Ok(false);
        };
        // One started meanwhile (a serve) is the helper now: watched instead.
        if let Some(pid) = self.running(key) {
            let process = super::keeper::pidfd_open(pid)?;
            self.keeper.with(key, |k| k.serving(process));
            return Ok(false);
        }
        let file = file?;
        let log = super::files::append_to(&self.files.server_log_file(key))?;
        let mut launch =
            Launch::new(Program::Volagent, &self.files.socket(key)).args(&recorded.args);
        if file.is_none() {
            // An rbd helper. The Ceph clients of its dead predecessors are
            // kept on disk before a successor starts — an agent that dies
            // meanwhile still hands them on — and their client file goes,
            // so that only a successor's is read there.
            let mut dead = self.dead_clients(key);
            if let Some(client) = self.client_of(key)
                && !dead.contains(&client)
            {
                dead.push(client);
                self.write_dead_clients(key, &dead)?;
            }
            let client_file = self.files.client_file(key);
            match std::fs::remove_file(&client_file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io("remove", &client_file)(e));
                }
                _ => {}
            }
            for (_, address) in &dead {
                launch = launch.args(["--ceph-break-lock-of", address]);
            }
        }
        launch.stdin = file;
        launch.stderr = Some(log);
        self.start(key, launch)?;
        let pid = self.running(key).ok_or_else(|| SysError::Command {
            program: "volagent nbd serve",
            path: self.files.socket(key),
            message: "ended as soon as it listened".into(),
        })?;
        let process = super::keeper::pidfd_open(pid)?;
        self.keeper.with(key, |k| k.serving(process));
        Ok(true)
    }

    /// The Ceph clients of helper `key`'s dead predecessors that the
    /// records may still name: (global id, address).
    fn dead_clients(&self, key: &str) -> Vec<(u64, String)> {
        let text = std::fs::read_to_string(self.files.replaces_file(key)).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let (id, address) = l.trim().split_once(' ')?;
                Some((id.parse().ok()?, address.to_string()))
            })
            .take(1024)
            .collect()
    }

    fn write_dead_clients(&self, key: &str, dead: &[(u64, String)]) -> Result<(), SysError> {
        let file = self.files.replaces_file(key);
        if dead.is_empty() {
            return match std::fs::remove_file(&file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("remove", &file)(e)),
                _ => Ok(()),
            };
        }
        let text: String = dead.iter().map(|(id, address)| format!("{id} {address}\n")).collect();
        // Whole or not at all: written beside it, then renamed over it.
        let next = file.with_extension("replaces.next");
        super::files::write_private(&next, text.as_bytes())?;
        std::fs::rename(&next, &file).map_err(io("rename", &next))
    }

    /// Who helper `key` is to its Ceph cluster: global id, address.
    fn client_of(&self, key: &str) -> Option<(u64, String)> {
        let text = std::fs::read_to_string(self.files.client_file(key)).ok()?;
        let (id, address) = text.trim().split_once(' ')?;
        Some((id.parse().ok()?, address.to_string()))
    }

    /// The helper's pid, when it runs ("<this binary> nbd serve").
    fn running(&self, key: &str) -> Option<nix::unistd::Pid> {
        let pid: i32 =
            std::fs::read_to_string(self.files.server_pid_file(key)).ok()?.trim().parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let ours = self.program.file_name().map(|n| n.as_encoded_bytes());
        let argv0 = Path::new(std::str::from_utf8(args.first()?).ok()?)
            .file_name()
            .map(|n| n.as_encoded_bytes());
        (argv0 == ours && args.get(1) == Some(&&b"nbd"[..]) && args.get(2) == Some(&&b"serve"[..]))
            .then(|| nix::unistd::Pid::from_raw(pid))
    }
}

impl ExportHelpers for Helpers {
    fn serve(&self, key: &str, file: std::fs::File, read_only: bool) -> Result<bool, SysError> {
        let _restarting = self.keeper.restart_lock();
        if self.restart(key)? || self.running(key).is_some() {
            return Ok(false);
        }
        let mut launch = self.command(key, read_only)?.args(["--export-stdin", ""]);
        // How a successor is started on the same file, for this agent and
        // the next.
        let meta = file.metadata().map_err(io("stat the export of", &self.files.socket(key)))?;
        let args: Option<Vec<String>> =
            launch.args.iter().map(|a| a.to_str().map(String::from)).collect();
        let args_file = self.files.server_args_file(key);
        if let Some(args) = args {
            use std::os::unix::fs::MetadataExt;
            Recorded { args, export: Some((meta.dev(), meta.ino())) }.write(&args_file)?;
        }
        launch.stdin = Some(file);
        let started = self.start(key, launch).inspect_err(|_| {
            let _ = std::fs::remove_file(&args_file);
        })?;
        self.keep(key);
        Ok(started)
    }

    fn serve_rbd(&self, key: &str, target: &RbdTarget, read_only: bool) -> Result<bool, SysError> {
        // A helper that died and is kept is started again as the heal
        // round would (taking its image over), not afresh.
        let _restarting = self.keeper.restart_lock();
        if self.restart(key)? || self.running(key).is_some() {
            return Ok(false);
        }
        let client = &target.client;
        let mut launch = self
            .command(key, read_only)?
            .arg("--export-rbd")
            .arg(format!("={}/{}", target.pool, target.image))
            .args(["--ceph-user", &client.user]);
        if let Some(monitors) = &client.monitors {
            launch = launch.args(["--ceph-monitors", monitors]);
        }
        if let Some(conf) = &client.conf {
            launch = launch.arg("--ceph-conf").arg(conf);
        }
        let client_file = self.files.client_file(key);
        let _ = std::fs::remove_file(&client_file);
        launch = launch.arg("--ceph-client-file").arg(&client_file);
        let written = self.files.write_keyring(key, &target.client)?;
        if let Some(keyring) = written.as_ref().or(client.keyring.as_ref()) {
            launch = launch.arg("--ceph-keyring").arg(keyring);
        }
        // How a successor is started: the same arguments, the keyring
        // kept (root-only, beside them) until the helper is stopped. The
        // key itself is never in them.
        let args: Option<Vec<String>> =
            launch.args.iter().map(|a| a.to_str().map(String::from)).collect();
        let args_file = self.files.server_args_file(key);
        if let Some(args) = args {
            Recorded { args, export: None }.write(&args_file).inspect_err(|_| {
                let _ = std::fs::remove_file(self.files.keyring_file(key));
            })?;
        }
        let started = self.start(key, launch).inspect_err(|_| {
            let _ = std::fs::remove_file(&args_file);
            remove_keyring(written);
        })?;
        self.keep(key);
        Ok(started)
    }

    /// librbd is loaded on the first ask, not at start-up: an agent that
    /// never serves an image never maps Ceph's libraries.
    fn rbd_available(&self) -> bool {
        crate::sys::rbd_export::libraries_available()
            && (self.kernel.available() || Path::new("/dev/fuse").exists())
    }

    fn server_address(&self, key: &str) -> String {
        format!("unix:{}", self.files.socket(key).display())
    }

    fn stop_serving(&self, key: &str) -> Result<(), SysError> {
        // Waits for a successor being started; none is started or kept
        // after, without its recording.
        {
            let _restarting = self.keeper.restart_lock();
            let _ = std::fs::remove_file(self.files.server_args_file(key));
            self.keeper.forget_locked(key);
        }
        if let Some(pid) = self.running(key) {
            // SIGTERM: it closes its connections and removes its socket, and
            // closes an RBD image (flushing it, dropping its watch and lock):
            // give it longer than a client before killing it.
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + self.stop_timeout * 3;
            while self.running(key) == Some(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if self.running(key) == Some(pid) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
        for f in [
            self.files.server_pid_file(key),
            self.files.server_log_file(key),
            self.files.server_args_file(key),
            self.files.socket(key),
            self.files.client_file(key),
            self.files.keyring_file(key),
            self.files.replaces_file(key),
            self.files.replaces_file(key).with_extension("replaces.next"),
        ] {
            match std::fs::remove_file(&f) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io("remove", &f)(e));
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn set_storage_client(&self, key: &str, id: u64, address: &str) -> Result<(), SysError> {
        let file = self.files.client_file(key);
        std::fs::write(&file, format!("{id} {address}\n")).map_err(io("write", &file))
    }

    fn heal(&self) -> Vec<String> {
        let mut healed = Vec::new();
        let keys: std::collections::BTreeSet<String> =
            self.files.keys().unwrap_or_default().into_iter().chain(self.keeper.keys()).collect();
        for key in keys {
            // Not while the helper is being stopped.
            let _restarting = self.keeper.restart_lock();
            if !self.keeper.holds(&key) {
                self.keep(&key);
                continue;
            }
            let started = match self.restart(&key) {
                Ok(false) => continue,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            };
            if started.is_ok() {
                healed.push(key.clone());
            }
            self.keeper.report(&key, "the helper", &started);
        }
        healed
    }

    fn storage_clients(&self) -> Vec<(String, u64, String)> {
        let Ok(keys) = self.files.keys() else { return Vec::new() };
        keys.into_iter()
            .filter(|key| self.files.client_pid(key).is_some() || self.running(key).is_some())
            .filter_map(|key| {
                let (id, address) = self.client_of(&key)?;
                Some((key, id, address))
            })
            .collect()
    }

    fn restartable(&self, key: &str) -> bool {
        self.keeper.holds(key)
    }

    fn replaced_clients(&self) -> Vec<crate::sys::ReplacedClient> {
        let Ok(keys) = self.files.keys() else { return Vec::new() };
        let mut replaced = Vec::new();
        for key in keys {
            let dead = self.dead_clients(&key);
            // Only once a successor runs and has said who it is.
            if dead.is_empty() || self.running(&key).is_none() {
                continue;
            }
            let Some(now) = self.client_of(&key).filter(|c| !dead.contains(c)) else { continue };
            replaced.extend(dead.into_iter().map(|old| crate::sys::ReplacedClient {
                key: key.clone(),
                old,
                new: now.clone(),
            }));
        }
        replaced
    }

    fn clients_replaced(&self, key: &str, old: &(u64, String)) {
        // Under the restart lock: not while a successor adds its own.
        let _restarting = self.keeper.restart_lock();
        let dead: Vec<(u64, String)> =
            self.dead_clients(key).into_iter().filter(|d| d != old).collect();
        if let Err(e) = self.write_dead_clients(key, &dead) {
            tracing::warn!(key, "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_clients_stay_listed_until_the_records_name_the_successor() {
        let dir = tempfile::tempdir().unwrap();
        let helpers = Helpers::new(dir.path().into(), crate::sys::fake::Fake::new());
        let key = "export-0123456789abcdef01234567";
        let (a, b) = ((3, "127.0.0.1:0/3".to_string()), (4, "127.0.0.1:0/4".to_string()));
        helpers.write_dead_clients(key, &[a.clone(), b.clone()]).unwrap();
        assert_eq!(helpers.dead_clients(key), vec![a.clone(), b.clone()]);
        // No successor runs: nothing to hand on yet.
        std::fs::write(dir.path().join(format!("{key}.client")), "7 127.0.0.1:0/55\n").unwrap();
        assert!(helpers.replaced_clients().is_empty());
        helpers.clients_replaced(key, &a);
        assert_eq!(helpers.dead_clients(key), vec![b.clone()]);
        helpers.clients_replaced(key, &b);
        assert!(helpers.dead_clients(key).is_empty());
        assert!(!dir.path().join(format!("{key}.client.replaces")).exists());
    }
}
