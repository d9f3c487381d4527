//! What a userspace data path needs to be started again after its process
//! died, kept by the agent: the open file the process served (a client's
//! FUSE connection, a helper's export) and the arguments it was started
//! with.
//!
//! The agent takes a copy of the file from the running process
//! (`pidfd_getfd`), so the same open file outlives the process: a FUSE
//! connection is not aborted while the agent holds it, and the requests the
//! dead client took stay queued for a successor. The arguments are the ones
//! the agent recorded when it started the process, in a root-only file
//! beside its pid file ([`Recorded`]), never read back from the process, so
//! an agent that restarted keeps what the last one started. A process is
//! only believed to be the one its pid file names if it shares the agent's
//! pid namespace and the file it holds is the one recorded (the FUSE device;
//! the export's device and inode); it is alive while its pidfd says so.
//! Both gone at once (a node's reboot) leaves nothing to hand over.
#![allow(unsafe_code)]

use crate::sys::{SysError, errno};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How the agent started a process: written when it starts it, read to
/// start a successor.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Recorded {
    /// Its arguments after the program.
    pub args: Vec<String>,
    /// The export a helper serves on standard input: (device, inode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<(u64, u64)>,
}

impl Recorded {
    pub fn write(&self, path: &Path) -> Result<(), SysError> {
        let text = serde_json::to_vec(self).unwrap_or_default();
        super::files::write_private(path, &text)
    }

    pub fn read(path: &Path) -> Option<Recorded> {
        let text = std::fs::read(path).ok()?;
        if text.len() > 64 * 1024 {
            return None;
        }
        serde_json::from_slice(&text).ok()
    }
}

/// Which file of the process is kept.
#[derive(Debug, Clone, Copy)]
pub enum Served {
    /// Its FUSE connection (`/dev/fuse`, char 10:229).
    Fuse,
    /// Its standard input, the export (device, inode).
    Export(u64, u64),
    /// No file: the process opens what it serves itself (a librbd helper
    /// connects to its cluster), so only its pid is watched.
    Process,
}

/// One process's open file, how it was started, and the process serving it
/// now.
#[derive(Debug)]
pub struct Kept {
    pub file: Option<OwnedFd>,
    pub recorded: Recorded,
    /// A pidfd of the process serving it: readable once it ended.
    process: OwnedFd,
}

impl Kept {
    /// A copy of what process `pid` serves, which must be `served`.
    pub fn from_process(pid: Pid, served: Served, recorded: Recorded) -> Result<Kept, SysError> {
        let path = PathBuf::from(format!("/proc/{pid}"));
        let refused = |what: String| SysError::Refused { path: path.clone(), what };
        let process = pidfd_open(pid)?;
        // Another pid namespace is another pod's process that took a freed
        // pid, not the mounter's or this agent's child.
        let ns = |p: &str| std::fs::read_link(format!("{p}/ns/pid")).ok();
        if ns(&format!("/proc/{pid}")).is_none() || ns(&format!("/proc/{pid}")) != ns("/proc/self")
        {
            return Err(refused("not in this agent's pid namespace".into()));
        }
        let fd = match served {
            Served::Fuse => Some(
                fd_to(pid, "/dev/fuse")
                    .ok_or_else(|| refused("has no FUSE connection open".into()))?,
            ),
            Served::Export(..) => Some(0),
            Served::Process => None,
        };
        let file = match fd {
            Some(fd) => {
                let file = pidfd_getfd(&process, fd, &path)?;
                let st = nix::sys::stat::fstat(&file).map_err(errno("stat the file of", &path))?;
                let is = match served {
                    Served::Fuse => {
                        st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFCHR
                            && st.st_rdev == nix::sys::stat::makedev(10, 229)
                    }
                    Served::Export(dev, ino) => st.st_dev == dev && st.st_ino == ino,
                    Served::Process => true,
                };
                if !is {
                    return Err(refused(format!(
                        "its descriptor {fd} is not what it was started with"
                    )));
                }
                Some(file)
            }
            None => None,
        };
        let kept = Kept { file, recorded, process };
        // Still alive: the pid was that process's all along.
        if !kept.alive() {
            return Err(refused("ended while it was looked at".into()));
        }
        Ok(kept)
    }

    /// `process` (a pidfd) serves it now: a successor.
    pub fn serving(&mut self, process: OwnedFd) {
        self.process = process;
    }

    /// Whether the process serving it runs.
    pub fn alive(&self) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut fds = [PollFd::new(self.process.as_fd(), PollFlags::POLLIN)];
        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
    }

    /// A copy of the file for a successor (none when none is kept).
    pub fn file_for_successor(&self, key: &str) -> Result<Option<std::fs::File>, SysError> {
        let Some(file) = &self.file else { return Ok(None) };
        file.try_clone()
            .map(|f| Some(std::fs::File::from(f)))
            .map_err(crate::sys::io("copy the kept file of", Path::new(key)))
    }

    /// Whether a FUSE connection is still up (not aborted or unmounted);
    /// true when no file is kept.
    pub fn connection_up(&self) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let Some(file) = &self.file else { return true };
        let mut fds = [PollFd::new(file.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(_) => !fds[0].revents().is_some_and(|r| r.contains(PollFlags::POLLERR)),
            Err(_) => false,
        }
    }
}

/// What [`Keeper::ended`] hands a successor.
pub struct Successor {
    pub recorded: Recorded,
    pub file: Result<Option<std::fs::File>, SysError>,
    pub up: bool,
}

/// Kept files, by key.
#[derive(Debug, Default)]
pub struct Keeper {
    kept: Mutex<BTreeMap<String, Kept>>,
    /// Keys whose successor has failed to start, since when: said once,
    /// not at every retry (the mounter may be down for a while).
    failing: Mutex<BTreeMap<String, Instant>>,
    /// Held while a successor starts and while a key is let go: one
    /// successor at a time, and none for a volume being detached.
    restarting: Mutex<()>,
    /// Keys whose process could not be kept: said once.
    warned: Mutex<std::collections::BTreeSet<String>>,
}

impl Keeper {
    pub fn holds(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    pub fn put(&self, key: &str, kept: Kept) {
        self.lock().insert(key.to_string(), kept);
    }

    /// Run `f` on `key`'s, if kept.
    pub fn with<T>(&self, key: &str, f: impl FnOnce(&mut Kept) -> T) -> Option<T> {
        self.lock().get_mut(key).map(f)
    }

    /// What a successor of `key`'s process needs once that process ended:
    /// how it was started, a copy of its file, and whether that file is
    /// still up (a FUSE connection not aborted). None while the process
    /// runs, or when nothing is kept.
    pub fn ended(&self, key: &str) -> Option<Successor> {
        self.lock().get(key).filter(|k| !k.alive()).map(|k| Successor {
            recorded: k.recorded.clone(),
            file: k.file_for_successor(key),
            up: k.connection_up(),
        })
    }

    /// One successor at a time.
    pub fn restart_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.restarting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Let `key`'s go: the volume is being detached, or it cannot be served
    /// again. Waits for a successor being started.
    pub fn forget(&self, key: &str) {
        let _restarting = self.restart_lock();
        self.forget_locked(key);
    }

    /// [`forget`](Self::forget), the restart lock held by the caller.
    pub fn forget_locked(&self, key: &str) {
        self.lock().remove(key);
        self.failing.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
        self.warned.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    }

    /// Warn of `key` once (until it is forgotten).
    pub fn warn_once(&self, key: &str, message: std::fmt::Arguments) {
        if self.warned.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string()) {
            tracing::warn!(key, "{message}");
        }
    }

    pub fn keys(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Say how starting `key`'s successor went: a success always, a
    /// failure the first time only. Returns how long it has been failing.
    pub fn report(&self, key: &str, what: &str, started: &Result<(), SysError>) -> Duration {
        let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        match started {
            Ok(()) => {
                failing.remove(key);
                tracing::info!(key, "{what} that ended was started again");
                Duration::ZERO
            }
            Err(e) => {
                let since = *failing.entry(key.to_string()).or_insert_with(|| {
                    tracing::warn!(key, "{what} ended; starting it again (retried quietly): {e}");
                    Instant::now()
                });
                since.elapsed()
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Kept>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The lowest descriptor of process `pid` open on the file `target` names
/// (`/dev/fuse`…).
pub fn fd_to(pid: Pid, target: &str) -> Option<RawFd> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    dir.flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == target))
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .min()
}

/// A pidfd of process `pid` (Linux 5.3).
pub fn pidfd_open(pid: Pid) -> Result<OwnedFd, SysError> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new
    // descriptor or -1; nothing is borrowed.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        let path = PathBuf::from(format!("/proc/{pid}"));
        return Err(errno("open a pidfd for", &path)(nix::errno::Errno::last()));
    }
    // SAFETY: pidfd_open's new descriptor, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A copy of descriptor `fd` of the process `pidfd` names: the same open
/// file (`pidfd_getfd`, Linux 5.6; the caller may ptrace it).
fn pidfd_getfd(pidfd: &OwnedFd, fd: RawFd, path: &Path) -> Result<OwnedFd, SysError> {
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that
    // process and flags, and returns a new descriptor or -1.
    let got = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(errno("take a copy of a descriptor of", path)(nix::errno::Errno::last()));
    }
    // SAFETY: pidfd_getfd's new descriptor (close-on-exec), owned by
    // nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_export_is_kept_only_when_it_is_the_one_recorded() {
        let export = std::fs::File::open("/proc/self/status").unwrap();
        let st = nix::sys::stat::fstat(&export).unwrap();
        let mut child =
            std::process::Command::new("sleep").arg("30").stdin(export).spawn().unwrap();
        let pid = Pid::from_raw(child.id() as i32);
        let recorded = Recorded { args: vec!["30".into()], export: None };
        let kept = Kept::from_process(pid, Served::Export(st.st_dev, st.st_ino), recorded.clone());
        let other = Kept::from_process(pid, Served::Export(st.st_dev, st.st_ino + 1), recorded);
        let fuse = Kept::from_process(pid, Served::Fuse, Recorded { args: vec![], export: None });
        let process =
            Kept::from_process(pid, Served::Process, Recorded { args: vec![], export: None })
                .unwrap();
        assert!(process.file.is_none() && process.alive() && process.connection_up());
        let kept = kept.unwrap();
        assert!(kept.alive());
        assert!(matches!(other, Err(SysError::Refused { .. })), "{other:?}");
        assert!(matches!(fuse, Err(SysError::Refused { .. })), "{fuse:?}");
        let _ = child.kill();
        let _ = child.wait();
        assert!(!kept.alive(), "its pidfd says it ended");
        assert!(!process.alive(), "a process kept without a file is watched all the same");
        assert!(process.file_for_successor("k").unwrap().is_none());
        let fd = kept.file.as_ref().unwrap().as_raw_fd();
        let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
        assert!(link.ends_with("status"), "{link:?}");
    }

    #[test]
    fn a_recording_reads_back_and_a_bad_one_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.args");
        let r = Recorded { args: vec!["nbd".into(), "serve".into()], export: Some((1, 2)) };
        r.write(&path).unwrap();
        assert_eq!(Recorded::read(&path), Some(r));
        std::fs::write(&path, b"{").unwrap();
        assert_eq!(Recorded::read(&path), None);
    }
}
