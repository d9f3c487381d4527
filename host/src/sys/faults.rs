//! Faults injected at the seam, for the chaos tier: a layer over the real
//! node that makes chosen operations fail (an errno) or hang, while a
//! rules file says so. The agent installs it only when
//! [`FAULTS_FILE_ENV`] names that file; every call then reads it (a few
//! hundred bytes), so a test adds and removes faults while the agent runs.
//!
//! Rules, one per line: `<operation> <fault>`, the operation one of
//! [`OPERATIONS`], the fault an errno name (`EIO`, `ENOSPC`, `EBUSY`, …) or
//! `hang` (block until the rule is removed, at most [`MAX_HANG`], then
//! carry on with the real operation).

use super::rbd_export::{CephClient, ImageWatcher};
use super::{
    Devices, FileId, Filesystems, Kind, LoopDevice, MountInfo, Mounts, Storage, SysError, Usage,
    Wipe,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Names the rules file; unset, no fault layer exists.
pub const FAULTS_FILE_ENV: &str = "VOLAGENT_TEST_FAULTS_FILE";
/// The longest a `hang` lasts.
pub const MAX_HANG: Duration = Duration::from_secs(120);
/// The operations faults can be injected into, each named after the step
/// kind it serves.
pub const OPERATIONS: &[&str] = &[
    "attach-device",
    "detach-device",
    "format",
    "mount",
    "bind-mount",
    "publish-block",
    "unmount",
    "wipe",
    "clear-directory",
    "grow-filesystem",
    "blocklist-client",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Errno(nix::errno::Errno),
    Hang,
}

/// The rules file.
#[derive(Debug, Clone)]
pub struct Rules {
    file: PathBuf,
}

impl Rules {
    pub fn new(file: PathBuf) -> Rules {
        Rules { file }
    }

    /// The fault of `op` now, if any. A missing or unreadable file is no
    /// rule; a line that does not parse is ignored.
    fn fault(&self, op: &str) -> Option<Fault> {
        let text = super::beneath::read_file(&self.file, 64 << 10).ok()?;
        let text = String::from_utf8_lossy(&text);
        text.lines().find_map(|line| {
            let (name, fault) = line.trim().split_once(char::is_whitespace)?;
            if name != op {
                return None;
            }
            match fault.trim() {
                "hang" => Some(Fault::Hang),
                errno => errno_named(errno).map(Fault::Errno),
            }
        })
    }

    /// Fail or hang `op` on `path` as the rules say.
    fn check(&self, op: &'static str, path: &Path) -> Result<(), SysError> {
        match self.fault(op) {
            None => Ok(()),
            Some(Fault::Errno(errno)) => {
                tracing::warn!(op, path = %path.display(), "injected fault: {errno}");
                Err(SysError::Errno { op: injected(op), path: path.to_path_buf(), errno })
            }
            Some(Fault::Hang) => {
                tracing::warn!(op, path = %path.display(), "injected fault: hanging");
                let start = Instant::now();
                while self.fault(op) == Some(Fault::Hang) && start.elapsed() < MAX_HANG {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Ok(())
            }
        }
    }
}

/// The operation's name in an injected error (static, as errors name theirs).
fn injected(op: &str) -> &'static str {
    match op {
        "attach-device" => "attach-device (injected fault)",
        "detach-device" => "detach-device (injected fault)",
        "format" => "format (injected fault)",
        "mount" => "mount (injected fault)",
        "bind-mount" => "bind-mount (injected fault)",
        "publish-block" => "publish-block (injected fault)",
        "unmount" => "unmount (injected fault)",
        "wipe" => "wipe (injected fault)",
        "clear-directory" => "clear-directory (injected fault)",
        "blocklist-client" => "blocklist-client (injected fault)",
        _ => "grow-filesystem (injected fault)",
    }
}

fn errno_named(name: &str) -> Option<nix::errno::Errno> {
    use nix::errno::Errno;
    Some(match name {
        "EIO" => Errno::EIO,
        "ENOSPC" => Errno::ENOSPC,
        "EBUSY" => Errno::EBUSY,
        "EEXIST" => Errno::EEXIST,
        "ENXIO" => Errno::ENXIO,
        "EPERM" => Errno::EPERM,
        "EROFS" => Errno::EROFS,
        "ENOMEM" => Errno::ENOMEM,
        "ETIMEDOUT" => Errno::ETIMEDOUT,
        _ => return None,
    })
}

/// The fault layer over a node's mounts, devices, filesystems and storage cluster.
pub struct Faulty<T: ?Sized> {
    inner: Arc<T>,
    rules: Rules,
}

impl<T: ?Sized> Faulty<T> {
    pub fn new(inner: Arc<T>, rules: Rules) -> Faulty<T> {
        Faulty { inner, rules }
    }
}

impl<T: Mounts + ?Sized> Mounts for Faulty<T> {
    fn mount_table(&self) -> Result<Vec<MountInfo>, SysError> {
        self.inner.mount_table()
    }
    fn is_mount_point(&self, target: &Path) -> Result<Option<bool>, SysError> {
        self.inner.is_mount_point(target)
    }
    fn device_of_mount(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError> {
        self.inner.device_of_mount(target)
    }
    fn mount(
        &self,
        source: &str,
        target: &Path,
        fs_type: &str,
        options: &str,
        read_only: bool,
    ) -> Result<(), SysError> {
        self.rules.check("mount", target)?;
        self.inner.mount(source, target, fs_type, options, read_only)
    }
    fn bind(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), SysError> {
        self.rules.check("bind-mount", target)?;
        self.inner.bind(source, target, read_only)
    }
    fn bind_device(&self, device: &Path, target: &Path, read_only: bool) -> Result<(), SysError> {
        self.rules.check("publish-block", target)?;
        self.inner.bind_device(device, target, read_only)
    }
    fn published_device(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError> {
        self.inner.published_device(target)
    }
    fn device_number(&self, device: &Path) -> Result<Option<(u32, u32)>, SysError> {
        self.inner.device_number(device)
    }
    fn ensure_file(&self, file: &Path) -> Result<bool, SysError> {
        self.inner.ensure_file(file)
    }
    fn remove_file(&self, file: &Path) -> Result<(), SysError> {
        self.inner.remove_file(file)
    }
    fn unmount(&self, target: &Path, force: bool) -> Result<(), SysError> {
        self.rules.check("unmount", target)?;
        self.inner.unmount(target, force)
    }
    fn ensure_dir(&self, dir: &Path) -> Result<bool, SysError> {
        self.inner.ensure_dir(dir)
    }
    fn remove_dir(&self, dir: &Path) -> Result<(), SysError> {
        self.inner.remove_dir(dir)
    }
    fn usage(&self, path: &Path) -> Result<Usage, SysError> {
        self.inner.usage(path)
    }
}

impl<T: Devices + ?Sized> Devices for Faulty<T> {
    fn loop_tag(&self) -> &str {
        self.inner.loop_tag()
    }
    fn loop_attach(&self, file: &Path, read_only: bool) -> Result<PathBuf, SysError> {
        self.rules.check("attach-device", file)?;
        self.inner.loop_attach(file, read_only)
    }
    fn loop_devices(&self) -> Result<Vec<LoopDevice>, SysError> {
        self.inner.loop_devices()
    }
    fn loop_statuses(&self) -> Result<Vec<super::LoopStatus>, SysError> {
        self.inner.loop_statuses()
    }
    fn loops_over(
        &self,
        backing: Option<super::FileId>,
        numbers: &[(u32, u32)],
    ) -> Result<Vec<super::LoopStatus>, SysError> {
        self.inner.loops_over(backing, numbers)
    }
    fn loop_detach(&self, device: &Path) -> Result<(), SysError> {
        self.rules.check("detach-device", device)?;
        self.inner.loop_detach(device)
    }
    fn loop_keep(&self, device: &Path, backing: FileId) -> Result<bool, SysError> {
        self.inner.loop_keep(device, backing)
    }
    fn file_id(&self, file: &Path) -> Result<Option<FileId>, SysError> {
        self.inner.file_id(file)
    }
    fn kind_of(&self, path: &Path) -> Result<Option<Kind>, SysError> {
        self.inner.kind_of(path)
    }
    fn kind_of_cached(&self, path: &Path) -> Option<Result<Option<Kind>, SysError>> {
        self.inner.kind_of_cached(path)
    }
    fn block_device(&self, path: &Path) -> Result<PathBuf, SysError> {
        self.inner.block_device(path)
    }
    fn open_file(&self, file: &Path, write: bool) -> Result<std::fs::File, SysError> {
        self.inner.open_file(file, write)
    }
}

impl<T: Filesystems + ?Sized> Filesystems for Faulty<T> {
    fn probe(&self, device: &Path) -> Result<Option<String>, SysError> {
        self.inner.probe(device)
    }
    fn probe_attached(
        &self,
        device: &Path,
        file: &Path,
        backing: Option<&std::fs::File>,
    ) -> Result<Option<String>, SysError> {
        self.inner.probe_attached(device, file, backing)
    }
    fn mkfs(&self, device: &Path, fs_type: &str) -> Result<(), SysError> {
        self.rules.check("format", device)?;
        self.inner.mkfs(device, fs_type)
    }
    fn grow_filesystem(
        &self,
        device: &Path,
        mount_point: &Path,
        fs_type: &str,
    ) -> Result<u64, SysError> {
        self.rules.check("grow-filesystem", mount_point)?;
        self.inner.grow_filesystem(device, mount_point, fs_type)
    }
    fn wipe(&self, device: &Path, method: Wipe) -> Result<(), SysError> {
        self.rules.check("wipe", device)?;
        self.inner.wipe(device, method)
    }
    fn clear_dir(&self, dir: &Path) -> Result<u64, SysError> {
        self.rules.check("clear-directory", dir)?;
        self.inner.clear_dir(dir)
    }
}

impl<T: Storage + ?Sized> Storage for Faulty<T> {
    fn rbd_watchers(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
    ) -> Result<Vec<ImageWatcher>, SysError> {
        self.inner.rbd_watchers(client, pool, image)
    }
    fn blocklist(&self, client: &CephClient, address: &str) -> Result<(), SysError> {
        self.rules.check("blocklist-client", Path::new(address))?;
        self.inner.blocklist(client, address)
    }

    fn break_lock(
        &self,
        client: &CephClient,
        pool: &str,
        image: &str,
        address: &str,
    ) -> Result<bool, SysError> {
        self.inner.break_lock(client, pool, image, address)
    }
}

impl<T: super::Inspect + ?Sized> super::Inspect for Faulty<T> {
    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, SysError> {
        self.inner.list_dir(dir)
    }
    fn entry(&self, path: &Path) -> Result<super::InspectedEntry, SysError> {
        self.inner.entry(path)
    }
    fn resolve(&self, link: &Path) -> Result<PathBuf, SysError> {
        self.inner.resolve(link)
    }
    fn filesystem_size(&self, path: &Path) -> Result<u64, SysError> {
        self.inner.filesystem_size(path)
    }
    fn block_node(&self, rdev: u64, what: &Path) -> Result<(PathBuf, u64), SysError> {
        self.inner.block_node(rdev, what)
    }
    fn identity(&self, rdev: u64) -> String {
        self.inner.identity(rdev)
    }
}

/// Told as each step of a plan ends: how the chaos tier stops or stalls an
/// agent at a chosen point of an operation, as a node failure or a mount of
/// an unreachable filesystem would.
pub trait StepHook: Send + Sync {
    /// Step `number` (1-based) of a plan has just succeeded.
    fn after_step(&self, number: usize);
}

/// Crash-test hook: the agent kills itself with SIGKILL right after this
/// many steps of a plan.
pub const KILL_AFTER_STEP_ENV: &str = "VOLAGENT_TEST_KILL_AFTER_STEP";
/// Hang-test hook, `<step>:<ms>`: stall that long after that step of the
/// first plan that has it.
pub const STALL_AFTER_STEP_ENV: &str = "VOLAGENT_TEST_STALL_AFTER_STEP";

/// The step hooks the environment asks for ([`KILL_AFTER_STEP_ENV`],
/// [`STALL_AFTER_STEP_ENV`]).
#[derive(Debug, Default)]
pub struct CrashHooks {
    kill_after: Option<usize>,
    stall_after: Option<(usize, u64)>,
    /// Only the first plan that reaches the step stalls.
    stalled: std::sync::atomic::AtomicBool,
}

impl CrashHooks {
    /// The hooks the environment names, if it names any.
    pub fn from_env() -> Option<CrashHooks> {
        let kill_after = std::env::var(KILL_AFTER_STEP_ENV).ok().and_then(|v| v.parse().ok());
        let stall_after = std::env::var(STALL_AFTER_STEP_ENV).ok().and_then(|v| {
            v.split_once(':').and_then(|(s, ms)| Some((s.parse().ok()?, ms.parse().ok()?)))
        });
        (kill_after.is_some() || stall_after.is_some()).then(|| CrashHooks {
            kill_after,
            stall_after,
            stalled: Default::default(),
        })
    }
}

impl StepHook for CrashHooks {
    fn after_step(&self, number: usize) {
        if let Some((_, ms)) = self.stall_after.filter(|(after, _)| *after == number)
            && !self.stalled.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            tracing::warn!("{STALL_AFTER_STEP_ENV}: stalling {ms} ms after step {number}");
            std::thread::sleep(Duration::from_millis(ms));
        }
        if self.kill_after == Some(number) {
            tracing::warn!("{KILL_AFTER_STEP_ENV}: killing this process after step {number}");
            let _ =
                nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_are_read_on_every_call_and_bad_lines_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("faults");
        let rules = Rules::new(file.clone());
        assert_eq!(rules.fault("mount"), None, "no file, no fault");
        std::fs::write(&file, "mount EIO\nformat ENOSPC\nunmount hang\nwipe EWHAT\nnonsense\n")
            .unwrap();
        assert_eq!(rules.fault("mount"), Some(Fault::Errno(nix::errno::Errno::EIO)));
        assert_eq!(rules.fault("format"), Some(Fault::Errno(nix::errno::Errno::ENOSPC)));
        assert_eq!(rules.fault("unmount"), Some(Fault::Hang));
        assert_eq!(rules.fault("wipe"), None, "an unknown errno is no rule");
        assert_eq!(rules.fault("bind-mount"), None);
        let e = rules.check("mount", Path::new("/k/x")).unwrap_err().to_string();
        assert!(e.contains("mount (injected fault) /k/x") && e.contains("EIO"), "{e}");
        std::fs::remove_file(&file).unwrap();
        assert!(rules.check("mount", Path::new("/k/x")).is_ok(), "gone with the file");
        for op in OPERATIONS {
            assert!(injected(op).starts_with(op), "{op}");
        }
    }
}
