//! Running children in a test thread's namespaces.
//!
//! Namespaces made with `unshare` belong to the thread that made them, but
//! children are forked by the long-lived spawner thread (for the
//! parent-death signal). So the test captures its namespaces once and each
//! child joins them between fork and exec.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::Command;

use anyhow::Context as _;

/// Handles on a thread's mount and network namespaces.
pub struct Namespaces {
    mnt: File,
    net: File,
}

impl Namespaces {
    /// The calling thread's namespaces.
    pub fn of_current_thread() -> anyhow::Result<Namespaces> {
        let open = |kind: &str| {
            let path = format!("/proc/thread-self/ns/{kind}");
            File::open(&path).with_context(|| format!("opening {path}"))
        };
        Ok(Namespaces { mnt: open("mnt")?, net: open("net")? })
    }

    /// The network namespace: a thread may join it (`setns`) to make
    /// sockets there.
    pub fn net(&self) -> &File {
        &self.net
    }

    /// Makes `cmd`'s child join these namespaces before it execs, then
    /// return to the working directory `cmd` set (joining a mount namespace
    /// moves a process to its root).
    #[allow(unsafe_code)]
    pub fn enter_on_exec(&self, cmd: &mut Command) {
        let (mnt, net) = (self.mnt.as_raw_fd(), self.net.as_raw_fd());
        let cwd = cmd
            .get_current_dir()
            .map(Path::as_os_str)
            .and_then(|d| CString::new(d.as_bytes()).ok());
        // SAFETY: runs in the forked child before exec and makes only
        // async-signal-safe system calls (setns, chdir) on values prepared
        // before the fork; nothing allocates or locks.
        unsafe {
            cmd.pre_exec(move || {
                for (fd, kind) in [(net, libc_ns::NET), (mnt, libc_ns::MNT)] {
                    if nix::libc::setns(fd, kind) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if let Some(dir) = &cwd
                    && nix::libc::chdir(dir.as_ptr()) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

mod libc_ns {
    pub const NET: i32 = nix::libc::CLONE_NEWNET;
    pub const MNT: i32 = nix::libc::CLONE_NEWNS;
}
