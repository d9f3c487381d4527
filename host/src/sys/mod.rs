//! The only place with side effects on the node: mounts, loop devices,
//! filesystems, NBD and RBD clients, discovery's looks. One narrow trait
//! per mechanism, gathered in [`Sys`]; what a node lacks is a
//! [`missing::Missing`] chosen at start-up, never a default body. [`linux`]
//! implements the first three with syscalls
//! (nix, rustix) on paths resolved beneath the agent's roots ([`beneath`])
//! and, where no syscall exists, the system's mkfs/wipefs/shred/blkid with a
//! deadline; [`fake`] is a stateful stand-in with error injection for tests
//! without root.

pub mod beneath;
mod block;
pub mod clear_dir;
pub mod export_file;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
#[cfg(feature = "testing")]
pub mod faults;
pub mod fusectl;
pub mod gluster_dirs;
pub mod gluster_mount;
pub mod inspect;
pub mod keyring;
pub mod krbd;
pub mod launch;
pub mod linux;
pub mod loop_index;
pub mod loopdev;
pub mod memory;
pub mod missing;
pub mod mount_helper;
pub mod mountinfo;
pub mod nbd;
pub mod nfs_mount;
pub mod pins;
mod probe;
pub mod rbd_export;
pub mod rbd_fuse;
pub mod rbd_images;
pub mod recordings;
pub mod tool;

pub use beneath::Roots;

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
    #[error(transparent)]
    Ceph(#[from] rbd_export::RbdError),
}

impl SysError {
    /// The path was not there (as opposed to there but unusable).
    pub fn is_not_found(&self) -> bool {
        match self {
            SysError::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            SysError::Errno { errno, .. } => *errno == nix::errno::Errno::ENOENT,
            _ => false,
        }
    }
}

/// `map_err` helpers naming the operation and the path.
pub(crate) fn errno<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl Fn(nix::errno::Errno) -> SysError + 'a {
    move |errno| SysError::Errno { op, path: path.to_path_buf(), errno }
}

pub(crate) fn io<'a>(op: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> SysError + 'a {
    move |source| SysError::Io { op, path: path.to_path_buf(), source }
}

/// A file's identity: the device its filesystem is on and its inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

/// What [`Devices::loop_attach_or_reuse`] did.
#[derive(Debug)]
pub enum LoopAttach {
    /// A device already over the file, kept for the new user.
    Reused(PathBuf),
    /// A device attached now; with the file as attached, open (when the
    /// node opened it for the attach), so that what it holds is read from
    /// it and not from whatever its path leads to later.
    Attached { device: PathBuf, backing: Option<std::fs::File> },
}

/// A procfs file, in one or two reads: proc files report no size, so
/// std's read would grow its buffer from 32 bytes, a syscall per doubling.
pub(crate) fn read_proc(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::with_capacity(64 << 10);
    std::fs::File::open(path)?.read_to_string(&mut text)?;
    Ok(text)
}

/// What is at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Block,
    /// A symlink (never followed), FIFO, socket or character device.
    Other,
}

/// A loop device and the file behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDevice {
    pub device: PathBuf,
    /// The backing file's path as the kernel reports it (for people).
    pub backing_file: PathBuf,
    /// The backing file's identity (for comparisons).
    pub backing: Option<FileId>,
    /// Who attached it: an agent's [`Devices::loop_tag`], or anything else.
    pub tag: String,
    /// The device's numbers (major, minor).
    pub number: (u32, u32),
}

/// A loop device as its status tells it: [`LoopDevice`] without the
/// backing file's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopStatus {
    pub device: PathBuf,
    /// The backing file's identity; none when the status is unreadable.
    pub backing: Option<FileId>,
    /// Who attached it: an agent's [`Devices::loop_tag`], or anything else.
    pub tag: String,
    /// The device's numbers (major, minor).
    pub number: (u32, u32),
}

impl From<LoopDevice> for LoopStatus {
    fn from(l: LoopDevice) -> LoopStatus {
        LoopStatus { device: l.device, backing: l.backing, tag: l.tag, number: l.number }
    }
}

impl LoopDevice {
    /// Whether this device is over a userspace NBD client's `file` (which
    /// lies in the agent's own state dir), by the path the kernel reports:
    /// the whole path while the client's mount is reachable, or only
    /// "/<file name>" once it is not (a dead client's mount, lazily
    /// unmounted) — then only a device this agent tagged, or whose tag the
    /// dead mount makes unreadable. The file itself is never stat'ed: that
    /// would hang on a client that no longer answers.
    pub fn is_over_client_file(&self, file: &Path, tag: &str) -> bool {
        if self.backing_file == file {
            return true;
        }
        let detached =
            file.file_name().is_some_and(|name| self.backing_file == Path::new("/").join(name));
        detached && (self.tag == tag || self.tag.is_empty())
    }

    /// The FUSE mount this device's file is on, among `fuse`
    /// ([`mountinfo::fuse_mounts_by_device`]): a client's dir, whatever
    /// path the kernel reports for the file.
    pub fn fuse_mount<'a>(
        &self,
        fuse: &'a std::collections::BTreeMap<u64, PathBuf>,
    ) -> Option<&'a Path> {
        self.backing.and_then(|id| fuse.get(&id.dev)).map(PathBuf::as_path)
    }
}

/// How a block device's data is destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wipe {
    Signatures,
    Discard,
    Zero,
    Shred(u32),
}

/// Every path argument below lies beneath one of the agent's roots and is
/// resolved there without following symlinks (block device paths under
/// `/dev` excepted); anything else is refused.
pub trait Mounts: Send + Sync {
    fn mount_table(&self) -> Result<Vec<MountInfo>, SysError>;
    /// Whether `target` is a mount point (what `mount_table` would list at
    /// exactly that path), when that can be told without reading the
    /// table; none when only the table can tell.
    fn is_mount_point(&self, target: &Path) -> Result<Option<bool>, SysError>;
    /// The device numbers of the filesystem mounted at `target`, when
    /// `target` is a mount point (for a block filesystem: its device).
    fn device_of_mount(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError>;
    /// Mount `source` (a device under /dev or a network source) at `target`,
    /// `nosuid,nodev`; `options` is the comma-joined filesystem option string.
    fn mount(
        &self,
        source: &str,
        target: &Path,
        fs_type: &str,
        options: &str,
        read_only: bool,
    ) -> Result<(), SysError>;
    /// Bind the dir `source` at `target`, `nosuid,nodev` (and `noexec`
    /// when `source` is), read-only when asked, with no moment in between.
    fn bind(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), SysError>;
    /// Bind the block device `device` (a node under /dev) onto the file
    /// `target`, `nosuid` (not `nodev`: the device is the point), read-only
    /// when asked.
    fn bind_device(&self, device: &Path, target: &Path, read_only: bool) -> Result<(), SysError>;
    /// The device number of the block device node bound at `target`, when
    /// a block device node is mounted there.
    fn published_device(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError>;
    /// The device number of the block device node `device`.
    fn device_number(&self, device: &Path) -> Result<Option<(u32, u32)>, SysError>;
    /// Create the empty file `file`; true when it did not exist.
    fn ensure_file(&self, file: &Path) -> Result<bool, SysError>;
    /// Remove `file` if it is an empty regular file; a missing one is fine.
    fn remove_file(&self, file: &Path) -> Result<(), SysError>;
    /// Unmount `target` (never following it if it is a symlink); with
    /// `force`, also when busy or unreachable (lazy).
    fn unmount(&self, target: &Path, force: bool) -> Result<(), SysError>;
    /// Create `dir` and missing parents; true when it did not exist.
    fn ensure_dir(&self, dir: &Path) -> Result<bool, SysError>;
    /// Remove an empty `dir`; a missing one is fine.
    fn remove_dir(&self, dir: &Path) -> Result<(), SysError>;
    /// Space and inodes of the filesystem `path` is on.
    fn usage(&self, path: &Path) -> Result<Usage, SysError>;
}

/// What a filesystem holds and has free (statvfs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub bytes_total: u64,
    /// Free to unprivileged users (what a pod can still write).
    pub bytes_available: u64,
    pub bytes_used: u64,
    pub inodes_total: u64,
    pub inodes_free: u64,
    pub inodes_used: u64,
    pub read_only: bool,
}

pub trait Devices: Send + Sync {
    /// The tag loop devices attached through this carry.
    fn loop_tag(&self) -> &str;
    /// Attach the regular file `file` to a free loop device, tagged
    /// [`loop_tag`](Self::loop_tag), and return the device.
    fn loop_attach(&self, file: &Path, read_only: bool) -> Result<PathBuf, SysError>;
    fn loop_devices(&self) -> Result<Vec<LoopDevice>, SysError>;
    /// [`loop_devices`](Self::loop_devices) without the backing files'
    /// paths, which the node reads for each device at a cost: for lookups
    /// by identity or tag.
    fn loop_statuses(&self) -> Result<Vec<LoopStatus>, SysError> {
        Ok(self.loop_devices()?.into_iter().map(LoopStatus::from).collect())
    }
    /// The attached loop devices over the file `backing`, and those
    /// numbered in `numbers`: [`loop_statuses`](Self::loop_statuses)
    /// filtered, here; the node keeps an index instead.
    fn loops_over(
        &self,
        backing: Option<FileId>,
        numbers: &[(u32, u32)],
    ) -> Result<Vec<LoopStatus>, SysError> {
        let wanted = |l: &LoopStatus| {
            (backing.is_some() && l.backing == backing) || numbers.contains(&l.number)
        };
        Ok(self.loop_statuses()?.into_iter().filter(wanted).collect())
    }
    /// Detach the loop device `device` (`/dev/loopN` only). The kernel
    /// defers it while something still holds the device (a filesystem on it
    /// lazily unmounted while in use): the device then goes when its last
    /// user closes it.
    fn loop_detach(&self, device: &Path) -> Result<(), SysError>;
    /// Keep `device`, found over the file `backing`, for a new user: a
    /// deferred detach of it is cancelled, so that it does not vanish under
    /// the new user when the old one lets go. False when the device is no
    /// longer over that file (detached or taken meanwhile).
    fn loop_keep(&self, device: &Path, backing: FileId) -> Result<bool, SysError>;
    /// The identity of `file`; none when nothing is there.
    fn file_id(&self, file: &Path) -> Result<Option<FileId>, SysError>;
    /// The loop device over `file` (by identity: a file reached by another
    /// path, or swapped for another under the same name, is told apart),
    /// kept for a new user — one whose detach the kernel deferred is taken
    /// back (see [`loop_keep`](Self::loop_keep)); else `file` attached as
    /// [`loop_attach`](Self::loop_attach) does. Here by path, a lookup
    /// each; the node itself resolves `file` once, so the file looked up is
    /// the file attached.
    fn loop_attach_or_reuse(&self, file: &Path, read_only: bool) -> Result<LoopAttach, SysError> {
        if let Some(id) = self.file_id(file)? {
            for l in self.loop_statuses()?.into_iter().filter(|l| l.backing == Some(id)) {
                if self.loop_keep(&l.device, id)? {
                    return Ok(LoopAttach::Reused(l.device));
                }
            }
        }
        Ok(LoopAttach::Attached { device: self.loop_attach(file, read_only)?, backing: None })
    }
    /// What is at `path`, without opening it or following it; none when
    /// nothing is there.
    fn kind_of(&self, path: &Path) -> Result<Option<Kind>, SysError>;
    /// [`kind_of`](Self::kind_of) from the kernel's caches alone, so that
    /// it cannot wait on a hung filesystem: none when answering would need
    /// the filesystem (the caller then asks `kind_of` where it may block).
    fn kind_of_cached(&self, path: &Path) -> Option<Result<Option<Kind>, SysError>>;
    /// The block device at `path` (beneath a root, not a symlink; or a
    /// device node under /dev a PV names with its identity), as its node
    /// under /dev: the path the tools and the mount table use.
    fn block_device(&self, path: &Path) -> Result<PathBuf, SysError>;
    /// The regular file `file` (beneath a root, not a symlink), open for
    /// reading and, with `write`, writing.
    fn open_file(&self, file: &Path, write: bool) -> Result<std::fs::File, SysError>;
}

/// `device` arguments are block devices under /dev.
pub trait Filesystems: Send + Sync {
    /// The filesystem (or other signature, e.g. a partition table or a RAID
    /// member's superblock at the device's end) on `device`; none only
    /// when a full probe finds nothing.
    fn probe(&self, device: &Path) -> Result<Option<String>, SysError>;
    /// [`probe`](Self::probe) of a loop device just attached to `file`
    /// (offset 0, whole file), nothing written through it since: it holds
    /// exactly the file's bytes, which may be read instead — from
    /// `backing`, the file as attached, when given.
    fn probe_attached(
        &self,
        device: &Path,
        _file: &Path,
        _backing: Option<&std::fs::File>,
    ) -> Result<Option<String>, SysError> {
        self.probe(device)
    }
    /// Make a filesystem; refused when anything holds the device (mounted,
    /// or opened exclusively).
    fn mkfs(&self, device: &Path, fs_type: &str) -> Result<(), SysError>;
    /// Grow the `fs_type` filesystem on `device`, mounted at `mount_point`,
    /// to the device's size (a loop device first takes its file's size);
    /// the device's size in bytes after.
    fn grow_filesystem(
        &self,
        device: &Path,
        mount_point: &Path,
        fs_type: &str,
    ) -> Result<u64, SysError>;
    /// Destroy the device's data; refused like [`mkfs`](Self::mkfs).
    fn wipe(&self, device: &Path, method: Wipe) -> Result<(), SysError>;
    /// Remove everything inside the dir `dir` (beneath a root, not a
    /// symlink), keeping `dir`; how many entries went.
    fn clear_dir(&self, dir: &Path) -> Result<u64, SysError>;
}

/// What an entry found by [`Inspect::entry`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InspectedEntry {
    /// A block device node, and its numbers.
    Block {
        rdev: u64,
    },
    /// A symlink (not followed).
    Link,
    File {
        bytes: u64,
    },
    Dir,
    /// A FIFO, socket or character device.
    Other,
}

/// Read-only looks for local volume discovery, at any path (discovery
/// dirs, and the devices an admin's links lead to): nothing is opened for
/// writing, nothing resolved beneath the roots.
pub trait Inspect: Send + Sync {
    /// The entries of `dir`, sorted.
    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, SysError>;
    /// What is at `path`, not following it.
    fn entry(&self, path: &Path) -> Result<InspectedEntry, SysError>;
    /// Where the symlink `link` leads, every link on the way followed.
    fn resolve(&self, link: &Path) -> Result<PathBuf, SysError>;
    /// The size in bytes of the filesystem `path` is on (statvfs).
    fn filesystem_size(&self, path: &Path) -> Result<u64, SysError>;
    /// The node under /dev of block device `rdev` (checked: not a link, the
    /// same numbers) and its size in bytes; `what` names the path that led
    /// to it in errors.
    fn block_node(&self, rdev: u64, what: &Path) -> Result<(PathBuf, u64), SysError>;
    /// What names block device `rdev` whatever its number: the disk's WWID
    /// or serial, a loop device's backing file, else its numbers ("wwid:…",
    /// "serial:…", "loop:…", "dev:<major>:<minor>").
    fn identity(&self, rdev: u64) -> String;
}

/// The kernel's nbd devices, by a key the caller derives from the export.
pub trait KernelNbd: Send + Sync {
    /// Whether this node's kernel has the nbd driver.
    fn available(&self) -> bool;
    /// Connect the export `export` at `server` ("unix:/path" or
    /// "host:port") to a free kernel nbd device for `key`; the device, and
    /// whether it was connected now (false: it was already).
    fn connect(
        &self,
        key: &str,
        server: &str,
        export: &str,
        connections: u8,
        read_only: bool,
    ) -> Result<(PathBuf, bool), SysError>;
    /// The kernel nbd device connected for `key`, if any.
    fn device(&self, key: &str) -> Option<PathBuf>;
    /// Disconnect `key`'s kernel nbd device; none is fine.
    fn disconnect(&self, key: &str) -> Result<(), SysError>;
    /// Every export this node has a kernel connection record of, and its
    /// device while connected.
    fn connections(&self) -> Vec<(String, Option<PathBuf>)>;
    /// Hand `key`'s device new connections to `server`'s `export` (its
    /// helper, started again) in place of those that died; false when
    /// `key` has no device.
    fn reconnect(&self, _key: &str, _server: &str, _export: &str) -> Result<bool, SysError> {
        Ok(false)
    }
    /// Have `key`'s device, when `server` is the agent's own helper, wait
    /// for that helper to be started again rather than fail at once.
    fn wait_for_its_helper(&self, _key: &str, _server: &str) {}
}

/// Userspace clients, by a key the caller derives from the export, each a
/// FUSE mount exposing its export as a file: `volagent nbd fuse`, started here, and
/// rbd-fuse's, started by [`RbdFuse`] — both listed, watched and stopped
/// here.
pub trait FuseClients: Send + Sync {
    /// The file NBD client `key` exposes its export as (running or not).
    fn file(&self, key: &str) -> PathBuf;
    /// The file rbd-fuse client `key` exposes `image` as (running or not).
    fn rbd_fuse_file(&self, key: &str, image: &str) -> PathBuf;
    /// Start userspace client `key` for `server`'s `export`, and return
    /// once it serves [`file`](Self::file); true when it was started,
    /// false when it was running already.
    fn connect(
        &self,
        key: &str,
        server: &str,
        export: &str,
        connections: u8,
        read_only: bool,
    ) -> Result<bool, SysError>;
    /// Stop client `key` and remove what it left; none running is fine.
    fn disconnect(&self, key: &str) -> Result<(), SysError>;
    /// Every client (or helper server, or kernel connection) this node has
    /// a trace of, and whether its client runs.
    fn clients(&self) -> Result<Vec<(String, bool)>, SysError>;
    /// Whether client `key`'s process runs.
    fn running(&self, key: &str) -> Result<bool, SysError> {
        Ok(self.clients()?.into_iter().any(|(k, running)| k == key && running))
    }
    /// Check that each running client's server still answers (a flush
    /// through it); abort the clients whose check has not come back within
    /// `after`, so that I/O through them fails instead of hanging. Call it
    /// periodically; returns the keys aborted.
    fn abort_hung(&self, after: std::time::Duration) -> Vec<String>;
    /// Start again, on its kept connection, each client that ended while
    /// its volume is mounted, and keep the connections of running clients
    /// not kept yet; abort a connection no client could be started on for
    /// `give_up_after`. Call it periodically; returns the keys started
    /// again.
    fn heal(&self, give_up_after: std::time::Duration) -> Vec<String> {
        let _ = give_up_after;
        Vec::new()
    }
}

/// The agent's helper NBD servers, by key: processes that outlive the
/// agent, serving a local file or an RBD image for an NBD client (kernel
/// or userspace) to reach; and who each Ceph client of this node is.
pub trait ExportHelpers: Send + Sync {
    /// Serve `file` (opened by the caller beneath its roots) as the default
    /// export of a helper server `key`, at
    /// [`server_address`](Self::server_address); true when it was
    /// started, false when it was running already (`file` is then unused).
    fn serve(&self, key: &str, file: std::fs::File, read_only: bool) -> Result<bool, SysError>;
    /// Serve the RBD image `target` through librbd as the default export
    /// of helper server `key`, like [`serve`](Self::serve). A key in
    /// `target` reaches the helper in a 0600 keyring file beneath the
    /// state dir, kept while the helper serves: a successor started after
    /// its death connects with it.
    fn serve_rbd(
        &self,
        key: &str,
        target: &rbd_export::RbdTarget,
        read_only: bool,
    ) -> Result<bool, SysError>;
    /// Whether an rbd helper can serve on this node: librbd loads, and the
    /// node has a way to reach an export (the nbd driver or FUSE).
    fn rbd_available(&self) -> bool;
    /// Where helper server `key` listens: "unix:/path".
    fn server_address(&self, key: &str) -> String;
    /// Stop helper server `key`; none running is fine.
    fn stop_serving(&self, key: &str) -> Result<(), SysError>;
    /// Record who client `key` (a helper, or an rbd-fuse client) is to its
    /// storage cluster (for [`storage_clients`](Self::storage_clients)).
    fn set_storage_client(&self, key: &str, id: u64, address: &str) -> Result<(), SysError>;
    /// The Ceph client of each running rbd helper or rbd-fuse client: key,
    /// global id, address.
    fn storage_clients(&self) -> Vec<(String, u64, String)>;
    /// Start again each helper that ended before it was stopped — one
    /// serving a local file on the same open file, an rbd helper with the
    /// same arguments and key — and keep the files of running ones not
    /// kept yet. Call it periodically, before [`FuseClients::heal`];
    /// returns the keys started again.
    fn heal(&self) -> Vec<String> {
        Vec::new()
    }
    /// Whether helper `key`, if it ended, would be started again by
    /// [`heal`](Self::heal).
    fn restartable(&self, key: &str) -> bool {
        let _ = key;
        false
    }
    /// The Ceph clients of dead rbd helpers whose running successors the
    /// records may not name yet. Kept (on disk) until
    /// [`clients_replaced`](Self::clients_replaced).
    fn replaced_clients(&self) -> Vec<ReplacedClient> {
        Vec::new()
    }
    /// The records name helper `key`'s successor in place of client `old`.
    fn clients_replaced(&self, key: &str, old: &(u64, String)) {
        let _ = (key, old);
    }
}

/// A dead rbd helper's Ceph client and its successor's: (global id,
/// address) each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplacedClient {
    pub key: String,
    pub old: (u64, String),
    pub new: (u64, String),
}

/// rbd-fuse: an RBD image exposed as a file through FUSE.
pub trait RbdFuse: Send + Sync {
    /// Whether rbd-fuse is installed.
    fn available(&self) -> bool;
    /// Start rbd-fuse as client `key` for the RBD image `target`, and
    /// return once it serves [`FuseClients::rbd_fuse_file`]; true when
    /// started, false when running already. A key in `target` reaches it
    /// as with [`ExportHelpers::serve_rbd`]. Stopped by
    /// [`FuseClients::disconnect`].
    fn connect(
        &self,
        key: &str,
        target: &rbd_export::RbdTarget,
        read_only: bool,
    ) -> Result<bool, SysError>;
}

/// What the agent asks of a Ceph cluster, and does to it, itself.
pub trait Storage: Send + Sync {
    /// The clients watching image `pool/image`.
    fn rbd_watchers(
        &self,
        client: &rbd_export::CephClient,
        pool: &str,
        image: &str,
    ) -> Result<Vec<rbd_export::ImageWatcher>, SysError>;
    /// Fence the client at `address` out of the cluster.
    fn blocklist(&self, client: &rbd_export::CephClient, address: &str) -> Result<(), SysError>;
    /// Break the exclusive lock the client at `address` holds on image
    /// `pool/image`, if it does; whether it did.
    fn break_lock(
        &self,
        client: &rbd_export::CephClient,
        pool: &str,
        image: &str,
        address: &str,
    ) -> Result<bool, SysError>;
}

/// The kernel's rbd driver (krbd).
pub trait KernelRbd: Send + Sync {
    /// Whether the node's kernel has it.
    fn available(&self) -> bool;
    /// Map `pool/image`, or find it mapped; the mapping, and whether this
    /// call made it.
    fn map(
        &self,
        client: &rbd_export::CephClient,
        pool: &str,
        image: &str,
        read_only: bool,
    ) -> Result<(krbd::KernelMapping, bool), SysError>;
    fn mappings(&self) -> Result<Vec<krbd::KernelMapping>, SysError>;
    /// Unmap mapping `id`; `force` fails its outstanding I/O instead of
    /// waiting (the cluster is gone). Unmapped already is fine.
    fn unmap(&self, id: u32, force: bool) -> Result<(), SysError>;

    /// The mappings of `pool/image` made with `monitors` (as
    /// [`krbd::kernel_monitors`] gives them).
    fn mappings_of(
        &self,
        monitors: &str,
        pool: &str,
        image: &str,
    ) -> Result<Vec<krbd::KernelMapping>, SysError> {
        Ok(self
            .mappings()?
            .into_iter()
            .filter(|m| m.monitors == monitors && m.pool == pool && m.image == image)
            .collect())
    }
}

/// Make the calling thread (and the programs it starts) yield the disks
/// and CPUs to everything else: the idle I/O class and nice 19. For long
/// wipes, which must not slow the node's other volumes. Best effort: the
/// scheduler may ignore I/O classes (none, mq-deadline).
pub fn lower_thread_priority() {
    let tid = rustix::thread::gettid();
    // No safe binding of ioprio_set: util-linux's ionice sets it for a
    // thread id as for a process.
    match std::process::Command::new("ionice")
        .args(["-c", "3", "-p", &tid.as_raw_nonzero().to_string()])
        .output()
    {
        Ok(o) if o.status.success() => {}
        Ok(o) => tracing::debug!("ionice: {}", String::from_utf8_lossy(&o.stderr).trim()),
        Err(e) => tracing::debug!("ionice: {e}"),
    }
    // On Linux, a thread's nice value is its own.
    if let Err(e) = rustix::process::setpriority_process(Some(tid), 19) {
        tracing::debug!("setpriority: {e}");
    }
}

/// Make the calling thread yield the CPUs to everything else (nice 19):
/// for work no caller waits for (the shadow's calls, the recorder), which
/// must not slow the calls that are waited for on a node of few cores.
pub fn yield_cpu() {
    let tid = rustix::thread::gettid();
    // On Linux, a thread's nice value is its own.
    if let Err(e) = rustix::process::setpriority_process(Some(tid), 19) {
        tracing::debug!("setpriority: {e}");
    }
}

/// The size in bytes of block device `device` (read-only).
pub fn block_size(device: &Path) -> Result<u64, SysError> {
    block::size_of(device)
}

/// The node's effects, passed to whoever needs them.
#[derive(Clone)]
pub struct Sys {
    pub mounts: Arc<dyn Mounts>,
    pub devices: Arc<dyn Devices>,
    pub filesystems: Arc<dyn Filesystems>,
    pub kernel_nbd: Arc<dyn KernelNbd>,
    pub fuse_clients: Arc<dyn FuseClients>,
    pub export_helpers: Arc<dyn ExportHelpers>,
    pub rbd_fuse: Arc<dyn RbdFuse>,
    pub storage: Arc<dyn Storage>,
    pub krbd: Arc<dyn KernelRbd>,
    pub inspect: Arc<dyn Inspect>,
    /// Told as each step of a plan ends; none but in the chaos tier.
    #[cfg(feature = "testing")]
    pub step_hook: Option<Arc<dyn faults::StepHook>>,
}

impl Sys {
    /// The real node, acting beneath `roots`; loop devices it attaches
    /// carry `tag`; userspace NBD clients and helper servers live in
    /// `nbd_dir` (beneath the agent's state dir).
    pub fn linux(roots: Roots, tag: &str, nbd_dir: PathBuf) -> Sys {
        Sys::linux_with(
            roots,
            tag,
            nbd_dir,
            nbd::kernel::DEFAULT_REQUEST_TIMEOUT,
            Arc::new(launch::Local::default()),
        )
    }

    /// [`linux`](Self::linux), the kernel failing an NBD request (and its
    /// connection) that takes longer than `nbd_request_timeout`, and the
    /// processes volumes need started by `launcher`. What the
    /// node lacks (the nbd or rbd module, rbd-fuse) is found here, once,
    /// and passed in as [`missing::Missing`].
    pub fn linux_with(
        roots: Roots,
        tag: &str,
        nbd_dir: PathBuf,
        nbd_request_timeout: std::time::Duration,
        launcher: Arc<dyn launch::Launcher>,
    ) -> Sys {
        let node = Arc::new(linux::Linux::new(roots, tag).with_launcher(launcher.clone()));
        let mut devices = nbd::kernel::NbdDevices::new(nbd_dir.clone());
        devices.request_timeout = nbd_request_timeout;
        devices.dead_conn_timeout = nbd_request_timeout;
        let kernel_nbd: Arc<dyn KernelNbd> = if devices.available() {
            Arc::new(devices)
        } else {
            Arc::new(nbd::kernel::Unloaded {
                records: devices,
                missing: missing::Missing::new(
                    "kernel NBD",
                    "the nbd module is not loaded on this node (no /sys/module/nbd, or no /dev/nbd* devices)",
                ),
            })
        };
        let fuse_clients =
            Arc::new(nbd::fuse::Clients::new(nbd_dir.clone()).with_launcher(launcher.clone()));
        let rbd_fuse: Arc<dyn RbdFuse> = if rbd_fuse::RbdFuseClients::installed() {
            Arc::new(rbd_fuse::RbdFuseClients::new(fuse_clients.clone()))
        } else {
            Arc::new(missing::Missing::new(
                "rbd-fuse",
                "rbd-fuse is not installed on this node (not on PATH)",
            ))
        };
        let krbd = krbd::Krbd::new(nbd_dir.clone());
        let krbd: Arc<dyn KernelRbd> = if krbd.available() {
            Arc::new(krbd)
        } else {
            Arc::new(missing::Missing::new(
                "kernel RBD",
                "the rbd module is not loaded on this node and modprobe cannot load it",
            ))
        };
        Sys {
            mounts: node.clone(),
            devices: node.clone(),
            filesystems: node,
            export_helpers: Arc::new(
                nbd::helpers::Helpers::new(nbd_dir, kernel_nbd.clone()).with_launcher(launcher),
            ),
            kernel_nbd,
            fuse_clients,
            rbd_fuse,
            storage: Arc::new(rbd_export::LibCeph),
            krbd,
            inspect: Arc::new(inspect::Node),
            #[cfg(feature = "testing")]
            step_hook: None,
        }
    }

    #[cfg(feature = "testing")]
    /// This node with the chaos tier's fault layer over its mounts, devices,
    /// filesystems and storage cluster, following the rules in `file` ([`faults`]).
    pub fn with_faults(self, file: PathBuf) -> Sys {
        let rules = faults::Rules::new(file);
        Sys {
            mounts: Arc::new(faults::Faulty::new(self.mounts, rules.clone())),
            devices: Arc::new(faults::Faulty::new(self.devices, rules.clone())),
            filesystems: Arc::new(faults::Faulty::new(self.filesystems, rules.clone())),
            storage: Arc::new(faults::Faulty::new(self.storage, rules.clone())),
            inspect: Arc::new(faults::Faulty::new(self.inspect, rules)),
            ..self
        }
    }

    /// This node with `hook` told of every plan step's end.
    #[cfg(feature = "testing")]
    pub fn with_step_hook(self, hook: Arc<dyn faults::StepHook>) -> Sys {
        Sys { step_hook: Some(hook), ..self }
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
}
