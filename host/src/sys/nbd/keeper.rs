//! What a userspace data path needs to be started again after its process
//! died, kept by the agent: the open file the process served (a client's
//! FUSE connection, a helper's export) and its arguments.
//!
//! The agent takes a copy of the file from the running process
//! (`pidfd_getfd`), so the same open file outlives the process: a FUSE
//! connection is not aborted while the agent holds it, and the requests the
//! dead client took stay queued for a successor. The process's own
//! arguments, read back from `/proc`, say how to start that successor, so
//! an agent that restarted keeps what the last one started, as long as the
//! process still runs when it looks. Both gone at once (a node's reboot)
//! leaves nothing to hand over.
#![allow(unsafe_code)]

use crate::sys::{SysError, errno};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Mutex;

/// One process's open file and arguments (those after its program).
#[derive(Debug)]
pub struct Kept {
    pub file: OwnedFd,
    pub args: Vec<OsString>,
}

impl Kept {
    /// A copy of the file process `pid` has open at `fd`, and its arguments.
    pub fn from_process(pid: Pid, fd: RawFd) -> Result<Kept, SysError> {
        let file = take_fd(pid, fd)?;
        let cmdline = PathBuf::from(format!("/proc/{pid}/cmdline"));
        let raw = std::fs::read(&cmdline).map_err(crate::sys::io("read", &cmdline))?;
        let args = raw
            .split(|b| *b == 0)
            .skip(1)
            .map(|a| std::ffi::OsStr::from_bytes(a).to_os_string())
            .collect::<Vec<_>>();
        // The last NUL ends the last argument, not an empty one after it.
        let args = match args.split_last() {
            Some((last, rest)) if last.is_empty() => rest.to_vec(),
            _ => args,
        };
        Ok(Kept { file, args })
    }

    /// A copy of the file for a successor.
    pub fn file_for_successor(&self, key: &str) -> Result<std::fs::File, SysError> {
        self.file
            .try_clone()
            .map(std::fs::File::from)
            .map_err(crate::sys::io("copy the kept file of", std::path::Path::new(key)))
    }
}

/// Kept files and arguments, by key.
#[derive(Debug, Default)]
pub struct Keeper {
    kept: Mutex<BTreeMap<String, Kept>>,
    /// Keys whose successor failed to start since it last started: said
    /// once, not at every retry (the mounter may be down for a while).
    failing: Mutex<std::collections::BTreeSet<String>>,
}

impl Keeper {
    /// Say how starting `key`'s successor went: a success always, a
    /// failure the first time only.
    pub fn report(&self, key: &str, what: &str, started: Result<(), SysError>) -> bool {
        let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        match started {
            Ok(()) => {
                failing.remove(key);
                tracing::info!(key, "{what} that ended was started again");
                true
            }
            Err(e) => {
                if failing.insert(key.to_string()) {
                    tracing::warn!(key, "{what} ended; starting it again (retried quietly): {e}");
                }
                false
            }
        }
    }

    pub fn holds(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    pub fn put(&self, key: &str, kept: Kept) {
        self.lock().insert(key.to_string(), kept);
    }

    /// Take `key`'s, to start a successor with, and [`put`](Self::put) it
    /// back after.
    pub fn take(&self, key: &str) -> Option<Kept> {
        self.lock().remove(key)
    }

    /// Let `key`'s go: the volume is being detached.
    pub fn forget(&self, key: &str) {
        self.lock().remove(key);
        self.failing.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    }

    pub fn keys(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
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

/// A copy of process `pid`'s descriptor `fd`: the same open file
/// (`pidfd_getfd`, Linux 5.6; the caller may ptrace `pid`).
fn take_fd(pid: Pid, fd: RawFd) -> Result<OwnedFd, SysError> {
    let path = PathBuf::from(format!("/proc/{pid}/fd/{fd}"));
    // SAFETY: pidfd_open takes a pid and flags and returns a new
    // descriptor or -1; nothing is borrowed.
    let pidfd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if pidfd < 0 {
        return Err(errno("open a pidfd for", &path)(nix::errno::Errno::last()));
    }
    // SAFETY: pidfd_open's new descriptor, owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that
    // process and flags, and returns a new descriptor or -1.
    let got = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(errno("take a copy of", &path)(nix::errno::Errno::last()));
    }
    // SAFETY: pidfd_getfd's new descriptor (close-on-exec), owned by
    // nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_file_and_arguments_are_kept_from_proc() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::fs::File::open("/proc/self/status").unwrap())
            .spawn()
            .unwrap();
        let pid = Pid::from_raw(child.id() as i32);
        let kept = Kept::from_process(pid, 0);
        let _ = child.kill();
        let _ = child.wait();
        let kept = kept.unwrap();
        assert_eq!(kept.args, vec![OsString::from("30")]);
        let link = std::fs::read_link(format!("/proc/self/fd/{}", kept.file.as_raw_fd())).unwrap();
        assert!(link.ends_with("status"), "{link:?}");
        assert_eq!(fd_to(Pid::this(), "/nonexistent"), None);
    }
}
