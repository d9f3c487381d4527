//! Userspace NBD clients for nodes without the kernel's nbd driver:
//! `nbdfuse` exposes an export as the file `<base>/<key>/<key>` (a FUSE mount
//! at `<base>/<key>`), which the executor attaches to a loop device.
//!
//! For a local file the agent exports itself, a helper `volagent nbd
//! serve` (this binary) serves it on `<base>/<key>.sock`, handed the file
//! the agent opened beneath its roots on standard input; it too outlives
//! the agent, since a client ends when its server does.
//!
//! A client runs in its own process group, so it outlives an agent restart (the
//! next agent adopts it by its pid file). Stopping one unmounts it, waits
//! for the process, and if it does not end — a client hung on a server
//! that does not answer — aborts its FUSE connection (fusectl) and kills it.

use super::fusectl::AbortSwitch;
use super::rbd_export::RbdTarget;
use super::{Mounts, NbdClients, SysError, errno, io};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct NbdFuse {
    /// Where the clients' mounts, pid files and logs live (beneath the state dir).
    base: PathBuf,
    program: PathBuf,
    /// The helper server: this agent's own binary.
    server_program: PathBuf,
    /// How long a client may take to connect, and to end once unmounted.
    pub ready_timeout: Duration,
    pub stop_timeout: Duration,
    /// The kernel path, where the node has the nbd driver.
    pub kernel: super::nbd_kernel::KernelNbd,
    /// Liveness checks under way, by client: when each started, and
    /// whether it came back.
    checks: std::sync::Mutex<
        std::collections::BTreeMap<
            String,
            (Instant, std::sync::Arc<std::sync::atomic::AtomicBool>),
        >,
    >,
}

impl NbdFuse {
    pub fn new(base: PathBuf) -> NbdFuse {
        NbdFuse {
            kernel: super::nbd_kernel::KernelNbd::new(base.clone()),
            base,
            program: PathBuf::from("nbdfuse"),
            server_program: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("volagent")),
            ready_timeout: Duration::from_secs(20),
            stop_timeout: Duration::from_secs(5),
            checks: Default::default(),
        }
    }

    /// Where the clients live.
    pub fn base(&self) -> &Path {
        &self.base
    }

    fn dir(&self, key: &str) -> PathBuf {
        self.base.join(key)
    }

    fn pid_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.pid"))
    }

    fn log_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.log"))
    }

    fn socket(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.sock"))
    }

    fn server_pid_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.server.pid"))
    }

    fn server_log_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.server.log"))
    }

    /// Who an rbd helper is to the Ceph cluster ("<global id> <address>").
    fn client_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.client"))
    }

    /// The keyring an rbd helper reads at connect; removed after.
    fn keyring_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.keyring"))
    }

    /// `<this binary> nbd serve` on `key`'s socket, its log as stderr.
    fn helper_command(&self, key: &str, read_only: bool) -> Result<Command, SysError> {
        std::fs::create_dir_all(&self.base).map_err(io("mkdir", &self.base))?;
        let log_path = self.server_log_file(key);
        let log = std::fs::File::create(&log_path).map_err(io("create", &log_path))?;
        let mut cmd = Command::new(&self.server_program);
        cmd.args(["nbd", "serve", "--unix"]).arg(self.socket(key));
        if read_only {
            cmd.arg("--read-only");
        }
        cmd.stdout(Stdio::null()).stderr(log).process_group(0);
        Ok(cmd)
    }

    /// Start helper `key` and return once its socket accepts (it opens
    /// its export before it listens).
    fn start_helper(&self, key: &str, mut cmd: Command) -> Result<bool, SysError> {
        let socket = self.socket(key);
        let log_path = self.server_log_file(key);
        let mut child = cmd.spawn().map_err(io("run the nbd server helper for", &socket))?;
        let pid_file = self.server_pid_file(key);
        std::fs::write(&pid_file, child.id().to_string()).map_err(io("write", &pid_file))?;
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
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_file(&pid_file);
                return Err(SysError::Timeout {
                    program: "volagent nbd serve",
                    path: socket,
                    secs: self.ready_timeout.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::spawn(move || drop(child.wait()));
        Ok(true)
    }

    /// The helper server's pid, when it runs ("<this binary> nbd serve").
    fn server_running(&self, key: &str) -> Option<nix::unistd::Pid> {
        let pid: i32 =
            std::fs::read_to_string(self.server_pid_file(key)).ok()?.trim().parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let ours = self.server_program.file_name().map(|n| n.as_encoded_bytes());
        let argv0 = Path::new(std::str::from_utf8(args.first()?).ok()?)
            .file_name()
            .map(|n| n.as_encoded_bytes());
        (argv0 == ours && args.get(1) == Some(&&b"nbd"[..]) && args.get(2) == Some(&&b"serve"[..]))
            .then(|| nix::unistd::Pid::from_raw(pid))
    }

    /// The client's pid, when its process runs (and is nbdfuse or
    /// rbd-fuse, not a process that took over a stale pid).
    fn running(&self, key: &str) -> Option<nix::unistd::Pid> {
        let pid: i32 = std::fs::read_to_string(self.pid_file(key)).ok()?.trim().parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let argv0 = cmdline.split(|b| *b == 0).next()?;
        Path::new(std::str::from_utf8(argv0).ok()?)
            .file_name()
            .is_some_and(|n| n == "nbdfuse" || n == "rbd-fuse")
            .then(|| nix::unistd::Pid::from_raw(pid))
    }

    /// The FUSE mount at the client's dir: its connection number (the
    /// mount's minor device number, as fusectl names it).
    fn mounted(&self, key: &str) -> Result<Option<u32>, SysError> {
        let dir = self.dir(key);
        let table = super::linux::Linux::unrooted().mount_table()?;
        Ok(table
            .iter()
            .rev()
            .find(|m| m.mount_point == dir && m.fs_type.starts_with("fuse"))
            .map(|m| m.device.1))
    }

    fn log_tail(&self, key: &str) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(self.log_file(key)) {
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
    fn clear_stale_mount(&self, key: &str) -> Result<(), SysError> {
        if self.mounted(key)?.is_some() {
            let dir = self.dir(key);
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
    fn await_mount(
        &self,
        key: &str,
        mut child: std::process::Child,
        program: &'static str,
    ) -> Result<(), SysError> {
        let (dir, pid_file) = (self.dir(key), self.pid_file(key));
        std::fs::write(&pid_file, child.id().to_string()).map_err(io("write", &pid_file))?;
        let deadline = Instant::now() + self.ready_timeout;
        while self.mounted(key)?.is_none() {
            let failed = match child.try_wait() {
                Ok(Some(status)) => Some(SysError::Command {
                    program,
                    path: dir.clone(),
                    message: format!("{status}: {}", self.log_tail(key)),
                }),
                _ if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
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
                for f in [pid_file, self.log_file(key)] {
                    let _ = std::fs::remove_file(f);
                }
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::spawn(move || drop(child.wait()));
        Ok(())
    }

    /// Wait (up to the ready timeout) for client `key`, process `pid`, to
    /// serve `file`; on failure stop it and say why.
    fn await_file(&self, key: &str, pid: nix::unistd::Pid, file: &Path) -> Result<(), SysError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let probe = file.to_path_buf();
        // The first request through a FUSE mount waits for the daemon:
        // asked from a thread, so a daemon that never answers costs only it.
        std::thread::spawn(move || drop(tx.send(std::fs::metadata(&probe).map(|m| m.len()))));
        let failed = match rx.recv_timeout(self.ready_timeout) {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => SysError::Command {
                program: "rbd-fuse",
                path: file.to_path_buf(),
                message: format!("{e}: {}", self.log_tail(key)),
            },
            Err(_) => SysError::Timeout {
                program: "rbd-fuse",
                path: file.to_path_buf(),
                secs: self.ready_timeout.as_secs(),
            },
        };
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.clear_stale_mount(key);
        for f in [self.pid_file(key), self.log_file(key)] {
            let _ = std::fs::remove_file(f);
        }
        let _ = std::fs::remove_dir(self.dir(key));
        Err(failed)
    }

    /// The key of `client`, in a keyring file only root can read, for a
    /// process to read at connect: never on a command line.
    fn write_keyring(
        &self,
        key: &str,
        client: &super::rbd_export::CephClient,
    ) -> Result<Option<PathBuf>, SysError> {
        let Some(secret) = &client.key else { return Ok(None) };
        std::fs::create_dir_all(&self.base).map_err(io("mkdir", &self.base))?;
        let file = self.keyring_file(key);
        let key_text = secret
            .ceph_key("key")
            .map_err(|what| SysError::Refused { path: file.clone(), what })?;
        write_private(&file, format!("[client.{}]\n\tkey = {key_text}\n", client.user).as_bytes())?;
        Ok(Some(file))
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
}

/// Whether `program` is an executable file in a directory of `$PATH`.
fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// The last `n` lines of a log.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim().lines().rev().take(n).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join("; ")
}

/// Remove a keyring [`NbdFuse::write_keyring`] wrote, once read.
fn remove_keyring(file: Option<PathBuf>) {
    if let Some(file) = file
        && let Err(e) = std::fs::remove_file(&file)
    {
        tracing::error!(file = %file.display(), "cannot remove a keyring after use: {e}");
    }
}

/// Create `file` readable by its owner alone, with `bytes`.
fn write_private(file: &Path, bytes: &[u8]) -> Result<(), SysError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(file);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(file)
        .map_err(io("create", file))?;
    f.write_all(bytes).map_err(io("write", file))
}

/// `server` ("unix:/path" or "host:port") and `export` as an NBD URI.
pub fn uri(server: &str, export: &str) -> String {
    let export = percent_encode(export);
    match server.strip_prefix("unix:") {
        Some(socket) => format!("nbd+unix:///{export}?socket={}", percent_encode(socket)),
        None => format!("nbd://{server}/{export}"),
    }
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl NbdClients for NbdFuse {
    fn kernel_driver(&self) -> bool {
        self.kernel.available()
    }

    fn kernel_connect(
        &self,
        key: &str,
        server: &str,
        export: &str,
        connections: u8,
        read_only: bool,
    ) -> Result<(PathBuf, bool), SysError> {
        self.kernel.connect(key, server, export, connections, read_only)
    }

    fn kernel_device(&self, key: &str) -> Option<PathBuf> {
        self.kernel.device(key)
    }

    fn kernel_disconnect(&self, key: &str) -> Result<(), SysError> {
        self.kernel.disconnect(key)
    }

    fn kernel_connections(&self) -> Vec<(String, Option<PathBuf>)> {
        self.kernel.connected()
    }

    fn file(&self, key: &str) -> PathBuf {
        // Named after the client: once its mount is gone (a dead client,
        // lazily unmounted), the kernel reports a loop device's file as
        // "/<key>", which still says whose it is.
        self.dir(key).join(key)
    }

    fn connect(
        &self,
        key: &str,
        uri: &str,
        connections: u8,
        read_only: bool,
    ) -> Result<bool, SysError> {
        let dir = self.dir(key);
        if self.mounted(key)?.is_some() && self.running(key).is_some() {
            return Ok(false);
        }
        self.clear_stale_mount(key)?;
        std::fs::create_dir_all(&dir).map_err(io("mkdir", &dir))?;
        let pid_file = self.pid_file(key);
        match std::fs::remove_file(&pid_file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("remove", &pid_file)(e));
            }
            _ => {}
        }
        let log =
            std::fs::File::create(self.log_file(key)).map_err(io("create", &self.log_file(key)))?;
        let mut cmd = Command::new(&self.program);
        cmd.arg("-P").arg(&pid_file).arg("-C").arg(connections.to_string());
        if read_only {
            cmd.arg("-r");
        }
        cmd.arg(self.file(key)).arg(uri);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io("dup", &self.log_file(key)))?)
            .stderr(log);
        // Its own process group: signals to the agent's (Ctrl-C, a
        // supervisor stopping it) do not reach it.
        cmd.process_group(0);
        let mut child = cmd.spawn().map_err(io("run nbdfuse for", &dir))?;
        let deadline = Instant::now() + self.ready_timeout;
        loop {
            if pid_file.exists() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                let _ = std::fs::remove_dir(&dir);
                return Err(SysError::Command {
                    program: "nbdfuse",
                    path: dir,
                    message: format!("{status}: {}", self.log_tail(key)),
                });
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                let _ = self.clear_stale_mount(key);
                let _ = std::fs::remove_dir(&dir);
                return Err(SysError::Timeout {
                    program: "nbdfuse",
                    path: dir,
                    secs: self.ready_timeout.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Reap it when it ends, while this agent runs.
        std::thread::spawn(move || drop(child.wait()));
        Ok(true)
    }

    fn disconnect(&self, key: &str) -> Result<(), SysError> {
        let dir = self.dir(key);
        let pid = self.running(key);
        if self.mounted(key)?.is_some() {
            // Opened while the mount is here: once it is detached, the
            // connection may end and its number go to another client
            // before the switch is pulled.
            let switch = self.switch(key)?;
            if let Err(e) = nix::mount::umount2(&dir, nix::mount::MntFlags::empty()) {
                // Still held (a loop device not yet released): unmount
                // lazily; the client ends when the last user lets go.
                tracing::debug!(dir = %dir.display(), "nbdfuse unmount: {e}; detaching lazily");
                nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH)
                    .map_err(errno("unmount nbdfuse", &dir))?;
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
        for f in [self.pid_file(key), self.log_file(key), self.client_file(key)] {
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

    fn serve(&self, key: &str, file: std::fs::File, read_only: bool) -> Result<bool, SysError> {
        if self.server_running(key).is_some() {
            return Ok(false);
        }
        let mut cmd = self.helper_command(key, read_only)?;
        cmd.args(["--export-stdin", ""]).stdin(file);
        self.start_helper(key, cmd)
    }

    fn serve_rbd(&self, key: &str, target: &RbdTarget, read_only: bool) -> Result<bool, SysError> {
        if self.server_running(key).is_some() {
            return Ok(false);
        }
        let mut cmd = self.helper_command(key, read_only)?;
        let client = &target.client;
        cmd.arg("--export-rbd")
            .arg(format!("={}/{}", target.pool, target.image))
            .args(["--ceph-user", &client.user]);
        if let Some(monitors) = &client.monitors {
            cmd.args(["--ceph-monitors", monitors]);
        }
        if let Some(conf) = &client.conf {
            cmd.arg("--ceph-conf").arg(conf);
        }
        let client_file = self.client_file(key);
        let _ = std::fs::remove_file(&client_file);
        cmd.arg("--ceph-client-file").arg(&client_file).stdin(Stdio::null());
        let written = self.write_keyring(key, &target.client)?;
        if let Some(keyring) = written.as_ref().or(client.keyring.as_ref()) {
            cmd.arg("--ceph-keyring").arg(keyring);
        }
        let started = self.start_helper(key, cmd);
        // Read at connect; the helper serves only once it has connected.
        remove_keyring(written);
        started
    }

    fn rbd_helper_available(&self) -> bool {
        super::rbd_export::libraries_available() && (self.kernel.available() || on_path("nbdfuse"))
    }

    fn rbd_fuse_available(&self) -> bool {
        on_path("rbd-fuse")
    }

    fn connect_rbd_fuse(
        &self,
        key: &str,
        target: &RbdTarget,
        read_only: bool,
    ) -> Result<bool, SysError> {
        let dir = self.dir(key);
        if self.mounted(key)?.is_some() && self.running(key).is_some() {
            return Ok(false);
        }
        self.clear_stale_mount(key)?;
        std::fs::create_dir_all(&dir).map_err(io("mkdir", &dir))?;
        let client = &target.client;
        // rbd-fuse takes the user, keyring and monitors as Ceph arguments in
        // the environment; the key itself only in a 0600 keyring file that
        // is removed once it has connected.
        let written = self.write_keyring(key, client)?;
        let mut ceph_args = format!("--id {}", client.user);
        if let Some(keyring) = written.as_ref().or(client.keyring.as_ref()) {
            ceph_args.push_str(&format!(" --keyring {}", keyring.display()));
        }
        if let Some(monitors) = &client.monitors {
            ceph_args.push_str(&format!(" --mon-host {monitors}"));
        }
        // Connecting gives up with the client's own deadline, not librados' 300 s.
        ceph_args
            .push_str(&format!(" --client-mount-timeout {}", self.ready_timeout.as_secs().max(1)));
        let log_path = self.log_file(key);
        let log = std::fs::File::create(&log_path).map_err(io("create", &log_path))?;
        let mut cmd = Command::new("rbd-fuse");
        cmd.arg("-f").arg("-c").arg(client.conf.as_deref().unwrap_or(Path::new("/dev/null")));
        cmd.args(["-p", &target.pool, "-r", &target.image]);
        if read_only {
            cmd.args(["-o", "ro"]);
        }
        cmd.arg(&dir).env("CEPH_ARGS", ceph_args);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io("dup", &log_path))?)
            .stderr(log)
            .process_group(0);
        let file = self.rbd_fuse_file(key, &target.image);
        let ready = cmd.spawn().map_err(io("run rbd-fuse for", &dir)).and_then(|child| {
            // It mounts first and connects to the cluster after, when the
            // kernel's first request comes: the image's file is there
            // once it has connected (and read the keyring).
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            self.await_mount(key, child, "rbd-fuse")?;
            self.await_file(key, pid, &file)
        });
        remove_keyring(written);
        ready?;
        Ok(true)
    }

    fn set_storage_client(&self, key: &str, id: u64, address: &str) -> Result<(), SysError> {
        let file = self.client_file(key);
        std::fs::write(&file, format!("{id} {address}\n")).map_err(io("write", &file))
    }

    fn storage_clients(&self) -> Vec<(String, u64, String)> {
        let Ok(clients) = self.clients() else { return Vec::new() };
        clients
            .into_iter()
            .filter(|(key, running)| *running || self.server_running(key).is_some())
            .filter_map(|(key, _)| {
                let text = std::fs::read_to_string(self.client_file(&key)).ok()?;
                let (id, address) = text.trim().split_once(' ')?;
                Some((key, id.parse().ok()?, address.to_string()))
            })
            .collect()
    }

    fn server_address(&self, key: &str) -> String {
        format!("unix:{}", self.socket(key).display())
    }

    fn stop_serving(&self, key: &str) -> Result<(), SysError> {
        if let Some(pid) = self.server_running(key) {
            // SIGTERM: it closes its connections and removes its socket, and
            // closes an RBD image (flushing it, dropping its watch and lock):
            // give it longer than a client before killing it.
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + self.stop_timeout * 3;
            while self.server_running(key) == Some(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if self.server_running(key) == Some(pid) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
        for f in [
            self.server_pid_file(key),
            self.server_log_file(key),
            self.socket(key),
            self.client_file(key),
            self.keyring_file(key),
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

    fn clients(&self) -> Result<Vec<(String, bool)>, SysError> {
        let entries = match std::fs::read_dir(&self.base) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("list", &self.base)(e)),
        };
        let mut keys = std::collections::BTreeSet::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // export-<hash>, and its .pid, .log, .sock, .server.pid, .server.log
            let key = name.split('.').next().unwrap_or_default();
            if key.starts_with("export-") && key.len() > "export-".len() {
                keys.insert(key.to_string());
            }
        }
        Ok(keys
            .into_iter()
            .map(|k| {
                let running = self.running(&k).is_some();
                (k, running)
            })
            .collect())
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
    use super::*;

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

    #[test]
    fn uris_encode_what_they_must() {
        assert_eq!(uri("unix:/run/nbd.sock", "disk0"), "nbd+unix:///disk0?socket=/run/nbd.sock");
        assert_eq!(uri("unix:/run/a b.sock", "x?y"), "nbd+unix:///x%3Fy?socket=/run/a%20b.sock");
        assert_eq!(uri("10.0.0.5:10809", ""), "nbd://10.0.0.5:10809/");
    }
}
