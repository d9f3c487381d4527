//! Userspace NBD clients for nodes without the kernel's nbd driver:
//! `volagent nbd fuse` (this binary, [`super::fuse_file`]) exposes an export
//! as the file `<base>/<key>/<key>` (a FUSE mount at `<base>/<key>`), which
//! the executor attaches to a loop device. rbd-fuse
//! clients ([`crate::sys::rbd_fuse`]) are FUSE clients too, kept the same
//! way: listed, watched and stopped here.
//!
//! The agent keeps each running client's FUSE connection and arguments
//! ([`super::keeper`]): a client that dies — killed, or its mounter's pod
//! gone — is started again on the same connection ([`FuseClients::heal`]), and
//! the workload sees a pause, not an error.
//!
//! A client is started by the launcher ([`crate::sys::launch`]): in a
//! cluster the node's mounter, so it lives in the mounter's pod and outlives
//! the agent's; standalone, this process, in a process group of its own, so
//! it outlives the agent's process. Either way the next agent adopts it by
//! its pid file. Stopping one unmounts it, waits
//! for the process, and if it does not end — a client hung on a server
//! that does not answer — aborts its FUSE connection (fusectl) and kills it.

use super::files::Layout;
use super::keeper::{Keeper, Kept, Recorded, Served, Successor};
use crate::sys::fusectl::AbortSwitch;
use crate::sys::launch::{Launch, Launcher, Program, Spawned};
use crate::sys::{FuseClients, SysError, errno, io};
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How errors name the client.
const CLIENT: &str = "volagent nbd fuse";
/// The mount type of this binary's clients (rbd-fuse's is not kept).
const MOUNT_TYPE: &str = "fuse.volagent-nbd";

#[derive(Debug)]
pub struct Clients {
    files: Layout,
    /// Where clients are started: here, or in the node's mounter.
    launcher: Arc<dyn Launcher>,
    /// How long a client may take to connect, and to end once unmounted.
    pub ready_timeout: Duration,
    pub stop_timeout: Duration,
    /// Liveness checks under way, by client: when each started, and
    /// whether it came back.
    checks: std::sync::Mutex<
        std::collections::BTreeMap<
            String,
            (Instant, std::sync::Arc<std::sync::atomic::AtomicBool>),
        >,
    >,
    /// Each running client's connection and arguments, to start it again.
    keeper: Keeper,
}

impl Clients {
    pub fn new(base: PathBuf) -> Clients {
        Clients {
            files: Layout::new(base),
            launcher: Arc::new(crate::sys::launch::Local::default()),
            ready_timeout: Duration::from_secs(20),
            stop_timeout: Duration::from_secs(5),
            checks: Default::default(),
            keeper: Keeper::default(),
        }
    }

    /// Clients started by `launcher`.
    pub fn with_launcher(self, launcher: Arc<dyn Launcher>) -> Clients {
        Clients { launcher, ..self }
    }

    pub(crate) fn launcher(&self) -> &Arc<dyn Launcher> {
        &self.launcher
    }

    /// Where the clients keep their files.
    pub fn files(&self) -> &Layout {
        &self.files
    }

    /// The FUSE mount at the client's dir: its connection number (the
    /// mount's minor device number, as fusectl names it).
    pub(crate) fn mounted(&self, key: &str) -> Result<Option<u32>, SysError> {
        Ok(self.mount(key)?.map(|(conn, _)| conn))
    }

    /// [`mounted`](Self::mounted), and the mount's type.
    fn mount(&self, key: &str) -> Result<Option<(u32, String)>, SysError> {
        let dir = self.files.dir(key);
        let table = crate::sys::mountinfo::own()?;
        Ok(table
            .iter()
            .rev()
            .find(|m| m.mount_point == dir && m.fs_type.starts_with("fuse"))
            .map(|m| (m.device.1, m.fs_type.clone())))
    }

    /// Keep running client `key`'s connection, if this agent recorded how
    /// it started it and it is not kept yet. `kind`: its mount's type, when
    /// the caller has read it (rbd-fuse's is not kept).
    fn keep(&self, key: &str, kind: Option<&str>) {
        if self.keeper.holds(key) {
            return;
        }
        let Some(recorded) = Recorded::read(&self.files.args_file(key)) else { return };
        let ours = match kind {
            Some(kind) => kind == MOUNT_TYPE,
            None => matches!(self.mount(key), Ok(Some((_, kind))) if kind == MOUNT_TYPE),
        };
        let Some(pid) = self.running(key).filter(|_| ours) else { return };
        match Kept::from_process(pid, Served::Fuse, recorded) {
            Ok(kept) => self.keeper.put(key, kept),
            Err(e) => self.keeper.warn_once(
                key,
                format_args!(
                    "its connection is not kept, so its death would fail the volume's I/O: {e}"
                ),
            ),
        }
    }

    /// Start client `key` again on its kept connection if its process
    /// ended; true when it did. The caller holds the keeper's restart lock.
    /// A connection that is no longer up is let go (an error).
    fn take_over(&self, key: &str) -> Result<bool, SysError> {
        let dir = self.files.dir(key);
        let Some(Successor { recorded, file, up }) = self.keeper.ended(key) else {
            return Ok(false);
        };
        if !up {
            self.keeper.forget_locked(key);
            return Err(SysError::Command {
                program: CLIENT,
                path: dir,
                message: "its FUSE connection was aborted; nothing to hand over".into(),
            });
        }
        // Without its server a successor would only wait and fail.
        let server = recorded.args.windows(2).find(|w| w[0] == "--server").map(|w| w[1].clone());
        if let Some(socket) = server.as_deref().and_then(|s| s.strip_prefix("unix:"))
            && std::os::unix::net::UnixStream::connect(socket).is_err()
        {
            return Err(SysError::Command {
                program: CLIENT,
                path: dir,
                message: format!("its server {socket} does not answer yet"),
            });
        }
        let _ = std::fs::remove_file(self.files.pid_file(key));
        let log = super::files::append_to(&self.files.log_file(key))?;
        let mut launch = Launch::new(Program::Volagent, &dir)
            .args(&recorded.args)
            .arg("--connection-stdin")
            .log_to(log)?;
        launch.stdin = file?;
        let child = self.launcher.spawn(launch)?;
        let pid = nix::unistd::Pid::from_raw(child.pid() as i32);
        self.await_pid_file(key, child)?;
        let process = super::keeper::pidfd_open(pid)?;
        self.keeper.with(key, |k| k.serving(process));
        Ok(true)
    }

    /// Start again each client that died on its kept connection; keep
    /// those not kept yet (an agent that restarted adopts them); let go of
    /// connections no longer mounted, and of those that could not be served
    /// again for `give_up_after` (their connection aborted: I/O fails, as
    /// it would have without a keeper). Returns the keys started again.
    fn restart_ended(&self, give_up_after: Duration) -> Vec<String> {
        let mut healed = Vec::new();
        // The mount table once, not once per client.
        let Ok(table) = crate::sys::mountinfo::own() else { return healed };
        let fuse_mounts: std::collections::HashMap<&std::path::Path, &str> = table
            .iter()
            .filter(|m| m.fs_type.starts_with("fuse"))
            .map(|m| (m.mount_point.as_path(), m.fs_type.as_str()))
            .collect();
        let keys: std::collections::BTreeSet<String> =
            self.files.keys().unwrap_or_default().into_iter().chain(self.keeper.keys()).collect();
        for key in keys {
            // Not while the client is being stopped.
            let _restarting = self.keeper.restart_lock();
            let Some(kind) = fuse_mounts.get(self.files.dir(&key).as_path()) else {
                self.keeper.forget_locked(&key);
                continue;
            };
            if !self.keeper.holds(&key) {
                self.keep(&key, Some(kind));
                continue;
            }
            let started = match self.take_over(&key) {
                Ok(false) => continue,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            };
            if started.is_ok() {
                healed.push(key.clone());
            }
            let failing = self.keeper.report(&key, "the client", &started);
            if failing > give_up_after {
                tracing::error!(client = %key, secs = give_up_after.as_secs(), "no client could be started again on this connection; aborting it so that its I/O fails instead of hanging");
                if let Ok(Some(switch)) = self.switch(&key) {
                    switch.pull();
                }
                self.keeper.forget_locked(&key);
            }
        }
        healed
    }

    pub(crate) fn log_tail(&self, key: &str) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(self.files.log_file(key)) {
            let _ = f.by_ref().take(64 * 1024).read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().rev().take(5).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("; ")
    }

    /// The abort switch of the FUSE connection mounted at client `key`'s
    /// dir, if one is: confirmed to be that mount's after it was opened
    /// (between reading the mount table and opening it, the connection may
    /// have ended and its number gone to another client).
    fn switch(&self, key: &str) -> Result<Option<AbortSwitch>, SysError> {
        let Some(conn) = self.mounted(key)? else { return Ok(None) };
        match AbortSwitch::open(conn) {
            Ok(switch) if self.mounted(key)? == Some(conn) => Ok(Some(switch)),
            Ok(_) => Ok(None),
            Err(e) => {
                tracing::warn!(
                    conn,
                    client = key,
                    "cannot open the FUSE connection's abort switch: {e}"
                );
                Ok(None)
            }
        }
    }

    /// A FUSE mount left at client `key`'s dir by a client that is gone
    /// only fails (ENOTCONN): abort and detach it.
    pub(crate) fn clear_stale_mount(&self, key: &str) -> Result<(), SysError> {
        if self.mounted(key)?.is_some() {
            let dir = self.files.dir(key);
            if let Some(switch) = self.switch(key)? {
                switch.pull();
            }
            nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH)
                .map_err(errno("unmount a stale FUSE client", &dir))?;
        }
        Ok(())
    }

    /// Wait for `child`, client `key`, to mount its dir; on failure or
    /// timeout, stop it and say why (its log's last lines).
    pub(crate) fn await_mount(
        &self,
        key: &str,
        mut child: Box<dyn Spawned>,
        program: &'static str,
    ) -> Result<(), SysError> {
        let (dir, pid_file) = (self.files.dir(key), self.files.pid_file(key));
        std::fs::write(&pid_file, child.pid().to_string()).map_err(io("write", &pid_file))?;
        let deadline = Instant::now() + self.ready_timeout;
        while self.mounted(key)?.is_none() {
            let failed = match child.try_wait() {
                Ok(Some(status)) => Some(SysError::Command {
                    program,
                    path: dir.clone(),
                    message: format!("{status}: {}", self.log_tail(key)),
                }),
                _ if Instant::now() >= deadline => {
                    child.kill();
                    let _ = self.clear_stale_mount(key);
                    Some(SysError::Timeout {
                        program,
                        path: dir.clone(),
                        secs: self.ready_timeout.as_secs(),
                    })
                }
                _ => None,
            };
            if let Some(e) = failed {
                // The error carries the log's last lines.
                for f in [pid_file, self.files.log_file(key)] {
                    let _ = std::fs::remove_file(f);
                }
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        child.keep();
        Ok(())
    }

    /// Wait for `child`, client `key`, to write its pid file (once it
    /// serves); on failure or timeout, stop it and say why.
    fn await_pid_file(&self, key: &str, mut child: Box<dyn Spawned>) -> Result<(), SysError> {
        let (dir, pid_file) = (self.files.dir(key), self.files.pid_file(key));
        let deadline = Instant::now() + self.ready_timeout;
        while !pid_file.exists() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(SysError::Command {
                    program: CLIENT,
                    path: dir,
                    message: format!("{status}: {}", self.log_tail(key)),
                });
            }
            if Instant::now() >= deadline {
                child.kill();
                return Err(SysError::Timeout {
                    program: CLIENT,
                    path: dir,
                    secs: self.ready_timeout.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        child.keep();
        Ok(())
    }

    fn wait_gone(&self, pid: nix::unistd::Pid, key: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.running(key) == Some(pid) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Whether client `key`'s process runs (ours or rbd-fuse).
    pub(crate) fn running(&self, key: &str) -> Option<nix::unistd::Pid> {
        self.files.client_pid(key)
    }
}

/// Clients expose their export as `<base>/<key>/<key>`.
impl FuseClients for Clients {
    fn file(&self, key: &str) -> PathBuf {
        self.files.file(key)
    }

    fn rbd_fuse_file(&self, key: &str, image: &str) -> PathBuf {
        self.files.file(key).with_file_name(image)
    }

    fn connect(
        &self,
        key: &str,
        server: &str,
        export: &str,
        connections: u8,
        read_only: bool,
    ) -> Result<bool, SysError> {
        let dir = self.files.dir(key);
        if self.mounted(key)?.is_some() {
            if self.running(key).is_some() {
                return Ok(false);
            }
            // Died, its connection kept: started again on it, nothing lost.
            if self.keeper.holds(key) {
                let _restarting = self.keeper.restart_lock();
                match self.take_over(key) {
                    Ok(_) => return Ok(false),
                    // Let go: its connection is down, cleared below.
                    Err(_) if !self.keeper.holds(key) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        self.clear_stale_mount(key)?;
        std::fs::create_dir_all(&dir).map_err(io("mkdir", &dir))?;
        let pid_file = self.files.pid_file(key);
        match std::fs::remove_file(&pid_file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("remove", &pid_file)(e));
            }
            _ => {}
        }
        let log = std::fs::File::create(self.files.log_file(key))
            .map_err(io("create", &self.files.log_file(key)))?;
        let mut launch = Launch::new(Program::Volagent, &dir)
            .args(["nbd", "fuse", "--server", server, "--export", export, "--pid-file"])
            .arg(&pid_file)
            .arg("--connections")
            .arg(connections.clamp(1, 16).to_string());
        if read_only {
            launch = launch.arg("--read-only");
        }
        // The agent's own helper for this export (librbd's image, a local
        // file) may grow it; other servers are asked the size once.
        let own_helper = server == format!("unix:{}", self.files.socket(key).display());
        if own_helper {
            launch = launch.arg("--follow-size");
        }
        // Writes the agent's helper acknowledged are in its file or on the
        // cluster (its librbd has no write-back cache): a request whose
        // connection broke may be sent again to the helper started after
        // it, which the agent records how to start. (A remote server's
        // cache may have lost them: the request fails.)
        if own_helper && Recorded::read(&self.files.server_args_file(key)).is_some() {
            launch = launch.arg("--reconnect");
        }
        let launch = launch.arg(self.file(key));
        // How a successor is started, for this agent and the next.
        let args: Option<Vec<String>> =
            launch.args.iter().map(|a| a.to_str().map(String::from)).collect();
        let args_file = self.files.args_file(key);
        match args {
            Some(args) => Recorded { args, export: None }.write(&args_file)?,
            None => {
                let _ = std::fs::remove_file(&args_file);
            }
        }
        let launch = launch.log_to(log)?;
        let child = self.launcher.spawn(launch).inspect_err(|_| {
            let _ = std::fs::remove_file(&args_file);
            let _ = std::fs::remove_file(self.files.log_file(key));
            let _ = std::fs::remove_dir(&dir);
        })?;
        self.await_pid_file(key, child).inspect_err(|_| {
            let _ = self.clear_stale_mount(key);
            let _ = std::fs::remove_file(&args_file);
            let _ = std::fs::remove_dir(&dir);
        })?;
        self.keep(key, None);
        Ok(true)
    }

    fn disconnect(&self, key: &str) -> Result<(), SysError> {
        // Waits for a successor being started; none is started or kept
        // after, without its recording.
        {
            let _restarting = self.keeper.restart_lock();
            let _ = std::fs::remove_file(self.files.args_file(key));
            self.keeper.forget_locked(key);
        }
        let dir = self.files.dir(key);
        let pid = self.running(key);
        if self.mounted(key)?.is_some() {
            // Opened while the mount is here: once it is detached, the
            // connection may end and its number go to another client
            // before the switch is pulled.
            let switch = self.switch(key)?;
            if let Err(e) = nix::mount::umount2(&dir, nix::mount::MntFlags::empty()) {
                // Still held (a loop device not yet released): unmount
                // lazily; the client ends when the last user lets go.
                tracing::debug!(dir = %dir.display(), "NBD client unmount: {e}; detaching lazily");
                nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH)
                    .map_err(errno("unmount the NBD client", &dir))?;
            }
            if let Some(pid) = pid
                && !self.wait_gone(pid, key, self.stop_timeout)
            {
                if let Some(switch) = switch {
                    switch.pull();
                }
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                self.wait_gone(pid, key, self.stop_timeout);
            }
        } else if let Some(pid) = pid {
            // Running but not mounted: not serving anything.
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            self.wait_gone(pid, key, self.stop_timeout);
        }
        for f in [
            self.files.pid_file(key),
            self.files.log_file(key),
            self.files.client_file(key),
            self.files.args_file(key),
        ] {
            match std::fs::remove_file(&f) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(file = %f.display(), "left in place: {e}");
                }
                _ => {}
            }
        }
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("remove", &dir)(e)),
            _ => Ok(()),
        }
    }
    /// One pid file and its process, not every client's.
    fn running(&self, key: &str) -> Result<bool, SysError> {
        Ok(Clients::running(self, key).is_some())
    }

    fn clients(&self) -> Result<Vec<(String, bool)>, SysError> {
        Ok(self
            .files
            .keys()?
            .into_iter()
            .map(|k| {
                let running = self.running(&k).is_some();
                (k, running)
            })
            .collect())
    }

    fn heal(&self, give_up_after: Duration) -> Vec<String> {
        self.restart_ended(give_up_after)
    }

    fn abort_hung(&self, after: Duration) -> Vec<String> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let mut aborted = Vec::new();
        let Ok(clients) = self.clients() else { return aborted };
        let mut checks = self.checks.lock().unwrap_or_else(|e| e.into_inner());
        checks.retain(|k, _| clients.iter().any(|(c, running)| c == k && *running));
        for (key, running) in clients {
            if !running {
                continue;
            }
            // A check under way: wait for it, or give up on the client.
            if let Some((started, done)) = checks.get(&key)
                && !done.load(Ordering::SeqCst)
            {
                if started.elapsed() < after {
                    continue;
                }
                tracing::error!(client = %key, secs = after.as_secs(), "the NBD server behind this client has not answered a flush; aborting the client so that its I/O fails instead of hanging");
                if let Ok(Some(switch)) = self.switch(&key) {
                    switch.pull();
                }
                // Not to be started again on the aborted connection.
                self.keeper.forget(&key);
                if let Some(pid) = self.running(&key) {
                    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                }
                checks.remove(&key);
                aborted.push(key);
                continue;
            }
            // A new check: a flush through the client reaches its server. The
            // thread may block until an abort fails it.
            let done = std::sync::Arc::new(AtomicBool::new(false));
            let (file, flag) = (self.file(&key), done.clone());
            let spawned = std::thread::Builder::new().name("nbd-check".into()).spawn(move || {
                if let Ok(f) = std::fs::OpenOptions::new().read(true).open(&file) {
                    let _ = f.sync_all();
                }
                flag.store(true, Ordering::SeqCst);
            });
            if spawned.is_ok() {
                checks.insert(key, (Instant::now(), done));
            }
        }
        aborted
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn a_device_is_over_a_client_file_by_its_whole_path_or_its_detached_name() {
        let file = Path::new("/state/nbd/export-ab/export-ab");
        let device = |backing: &str, tag: &str| crate::sys::LoopDevice {
            device: "/dev/loop3".into(),
            backing_file: backing.into(),
            backing: None,
            tag: tag.into(),
            number: (7, 3),
        };
        assert!(
            device("/state/nbd/export-ab/export-ab", "someone").is_over_client_file(file, "us")
        );
        assert!(device("/export-ab", "us").is_over_client_file(file, "us"));
        assert!(
            device("/export-ab", "").is_over_client_file(file, "us"),
            "a dead mount hides the tag"
        );
        assert!(!device("/export-ab", "another agent").is_over_client_file(file, "us"));
        assert!(!device("/export-cd", "us").is_over_client_file(file, "us"));
    }
}
