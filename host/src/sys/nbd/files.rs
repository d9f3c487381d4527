//! Where the userspace clients (`volagent nbd fuse`, rbd-fuse) and the helper servers
//! keep their files: beneath one dir of the agent's state, each named
//! after its client's key, so that the next agent finds what the last one
//! left — clients and helpers outlive the agent.

use crate::sys::{SysError, io};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Layout {
    base: PathBuf,
}

impl Layout {
    pub fn new(base: PathBuf) -> Layout {
        Layout { base }
    }

    /// The dir they all live in.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// Client `key`'s FUSE mount point.
    pub fn dir(&self, key: &str) -> PathBuf {
        self.base.join(key)
    }

    /// The file client `key` exposes its export as.
    pub fn file(&self, key: &str) -> PathBuf {
        // Named after the client: once its mount is gone (a dead client,
        // lazily unmounted), the kernel reports a loop device's file as
        // "/<key>", which still says whose it is.
        self.dir(key).join(key)
    }

    pub fn pid_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.pid"))
    }

    pub fn log_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.log"))
    }

    /// How client `key` was started (its successor's arguments).
    pub fn args_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.args"))
    }

    /// How helper server `key` was started.
    pub fn server_args_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.server.args"))
    }

    /// Where helper server `key` listens.
    pub fn socket(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.sock"))
    }

    pub fn server_pid_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.server.pid"))
    }

    pub fn server_log_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.server.log"))
    }

    /// Who an rbd helper or rbd-fuse client is to the Ceph cluster
    /// ("<global id> <address>").
    pub fn client_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.client"))
    }

    /// The Ceph clients (global ids, one per line) of dead rbd helpers
    /// whose successor the attachment records do not name yet: kept on
    /// disk, so that an agent that restarts meanwhile still puts them
    /// right.
    pub fn replaces_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.client.replaces"))
    }

    /// The keyring a Ceph client reads at connect: removed after
    /// (rbd-fuse), or kept until its helper is stopped, for a successor.
    pub fn keyring_file(&self, key: &str) -> PathBuf {
        self.base.join(format!("{key}.keyring"))
    }

    /// Client `key`'s pid, when its process runs (and is a client: this
    /// binary's `nbd fuse`, rbd-fuse, or the nbdfuse an older agent
    /// started; not a process that took over a stale pid).
    pub fn client_pid(&self, key: &str) -> Option<nix::unistd::Pid> {
        let pid: i32 = std::fs::read_to_string(self.pid_file(key)).ok()?.trim().parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let name = Path::new(std::str::from_utf8(args.first()?).ok()?).file_name()?;
        let ours = std::env::current_exe().ok();
        let is_client = name == "nbdfuse"
            || name == "rbd-fuse"
            || (ours.as_deref().and_then(Path::file_name) == Some(name)
                && args.get(1..3) == Some(&[&b"nbd"[..], &b"fuse"[..]][..]));
        is_client.then(|| nix::unistd::Pid::from_raw(pid))
    }

    /// Every key a file here is named after: clients, helper servers and
    /// kernel connection records alike.
    pub fn keys(&self) -> Result<std::collections::BTreeSet<String>, SysError> {
        let entries = match std::fs::read_dir(&self.base) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Default::default()),
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
        Ok(keys)
    }

    /// The key of `client`, in a keyring file only root can read, for a
    /// process to read at connect: never on a command line.
    pub fn write_keyring(
        &self,
        key: &str,
        client: &crate::sys::rbd_export::CephClient,
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
}

/// `path` opened for appending (made if missing): a successor's log goes
/// on after its predecessor's.
pub fn append_to(path: &Path) -> Result<std::fs::File, SysError> {
    std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(io("open", path))
}

/// Remove a keyring [`Layout::write_keyring`] wrote, once read.
pub fn remove_keyring(file: Option<PathBuf>) {
    if let Some(file) = file
        && let Err(e) = std::fs::remove_file(&file)
    {
        tracing::error!(file = %file.display(), "cannot remove a keyring after use: {e}");
    }
}

/// Create `file` readable by its owner alone, with `bytes`.
pub(crate) fn write_private(file: &Path, bytes: &[u8]) -> Result<(), SysError> {
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

/// Whether `program` is an executable file in a directory of `$PATH`.
pub fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// The last `n` lines of a log.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim().lines().rev().take(n).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join("; ")
}
