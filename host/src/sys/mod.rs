//! The only place with side effects on the node: mounts, loop devices and
//! filesystems. Narrow traits; [`linux`] implements them with syscalls
//! (nix) and, where no syscall exists, the system's mkfs/wipefs/blkdiscard/
//! shred/blkid with a deadline; [`fake`] is a stateful stand-in with error
//! injection for tests without root.

pub mod fake;
pub mod linux;
mod loopdev;
pub mod mountinfo;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use mountinfo::MountInfo;

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("{op} {}: {source}", path.display())]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{op} {}: {errno}", path.display())]
    Errno { op: &'static str, path: PathBuf, errno: nix::errno::Errno },
    #[error("{program} {}: {message}", path.display())]
    Command { program: &'static str, path: PathBuf, message: String },
    #[error("{program} {}: no answer within {secs} s, killed", path.display())]
    Timeout { program: &'static str, path: PathBuf, secs: u64 },
    #[error("mount table: {0}")]
    MountTable(#[from] mountinfo::ParseError),
    #[error("{}: {what}", path.display())]
    Refused { path: PathBuf, what: String },
}

/// `map_err` helpers naming the operation and the path.
pub(crate) fn errno<'a>(op: &'static str, path: &'a Path) -> impl Fn(nix::errno::Errno) -> SysError + 'a {
    move |errno| SysError::Errno { op, path: path.to_path_buf(), errno }
}

pub(crate) fn io<'a>(op: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> SysError + 'a {
    move |source| SysError::Io { op, path: path.to_path_buf(), source }
}

/// A loop device and the file behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDevice {
    pub device: PathBuf,
    pub backing_file: PathBuf,
}

/// How a block device's data is destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wipe {
    Signatures,
    Discard,
    Zero,
    Shred(u32),
}

pub trait Mounts: Send + Sync {
    fn mount_table(&self) -> Result<Vec<MountInfo>, SysError>;
    /// Whether `target` is a mount point (what `mount_table` would list at
    /// exactly that path), when that can be told without reading the
    /// table; none when only the table can tell.
    fn is_mount_point(&self, _target: &Path) -> Result<Option<bool>, SysError> {
        Ok(None)
    }
    /// Mount `source` (a device or network source) at `target`; `options`
    /// is the comma-joined filesystem option string.
    fn mount(&self, source: &str, target: &Path, fs_type: &str, options: &str, read_only: bool) -> Result<(), SysError>;
    fn bind(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), SysError>;
    /// Unmount `target`; with `force`, also when busy or unreachable (lazy).
    fn unmount(&self, target: &Path, force: bool) -> Result<(), SysError>;
    /// Create `dir` and missing parents; true when it did not exist.
    fn ensure_dir(&self, dir: &Path) -> Result<bool, SysError>;
    /// Remove an empty `dir`; a missing one is fine.
    fn remove_dir(&self, dir: &Path) -> Result<(), SysError>;
}

pub trait Devices: Send + Sync {
    /// Attach `file` to a free loop device and return the device.
    fn loop_attach(&self, file: &Path, read_only: bool) -> Result<PathBuf, SysError>;
    fn loop_devices(&self) -> Result<Vec<LoopDevice>, SysError>;
    fn loop_detach(&self, device: &Path) -> Result<(), SysError>;
}

pub trait Filesystems: Send + Sync {
    /// The filesystem (or other signature, e.g. a partition table) on
    /// `device`; none when it is blank.
    fn probe(&self, device: &Path) -> Result<Option<String>, SysError>;
    /// [`probe`](Self::probe) of a loop device just attached to `file`
    /// (offset 0, whole file), nothing written through it since: it holds
    /// exactly the file's bytes, which may be read instead.
    fn probe_attached(&self, device: &Path, _file: &Path) -> Result<Option<String>, SysError> {
        self.probe(device)
    }
    fn mkfs(&self, device: &Path, fs_type: &str) -> Result<(), SysError>;
    fn wipe(&self, device: &Path, method: Wipe) -> Result<(), SysError>;
}

/// The node's effects, passed to whoever needs them.
#[derive(Clone)]
pub struct Sys {
    pub mounts: Arc<dyn Mounts>,
    pub devices: Arc<dyn Devices>,
    pub filesystems: Arc<dyn Filesystems>,
}

impl Sys {
    /// The real node.
    pub fn linux() -> Sys {
        let node = Arc::new(linux::Linux::default());
        Sys { mounts: node.clone(), devices: node.clone(), filesystems: node }
    }

    /// The mount at exactly `target`, if any (the last one wins, as in the kernel).
    pub fn mount_at(&self, target: &Path) -> Result<Option<MountInfo>, SysError> {
        // The whole table is read and parsed only for a mount point: that
        // takes 50 µs and more (it grows with the node's mounts), and
        // every mount and unmount step asks about paths that mostly are not.
        if self.mounts.is_mount_point(target)? == Some(false) {
            return Ok(None);
        }
        Ok(self.mounts.mount_table()?.into_iter().rev().find(|m| m.mount_point == target))
    }

    /// Whether something is mounted at exactly `target`.
    pub fn is_mounted(&self, target: &Path) -> Result<bool, SysError> {
        match self.mounts.is_mount_point(target)? {
            Some(known) => Ok(known),
            None => Ok(self.mounts.mount_table()?.iter().any(|m| m.mount_point == target)),
        }
    }

    /// Loop devices backed by `file`.
    pub fn loops_of(&self, file: &Path) -> Result<Vec<PathBuf>, SysError> {
        Ok(self
            .devices
            .loop_devices()?
            .into_iter()
            .filter(|l| l.backing_file == file)
            .map(|l| l.device)
            .collect())
    }
}
