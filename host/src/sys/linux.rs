//! The real node: syscalls on handles resolved beneath the agent's roots
//! for mounts and loop devices, and the system's filesystem tools (there is
//! no syscall for mkfs) with a deadline, on devices checked to be free.

use super::beneath::{fd_path, fd_path_in};
use super::tool::{check, run, run_with};
use super::{
    Devices, FileId, Filesystems, LoopAttach, LoopDevice, LoopStatus, MountInfo, Mounts, Roots,
    SysError, Wipe, block, errno, io, loopdev, mountinfo, probe,
};
use nix::fcntl::OFlag;
use nix::mount::{MntFlags, MsFlags};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Deadlines of the external tools: a hung mkfs must not hang a mount.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub probe: Duration,
    pub mkfs: Duration,
    /// Whole-device wipes (shred) take as long as the device is big.
    pub wipe: Duration,
    /// A network filesystem's mount helper (gluster, nfs): the server may not answer.
    pub network_mount: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            probe: Duration::from_secs(10),
            mkfs: Duration::from_secs(300),
            wipe: Duration::from_secs(6 * 3600),
            network_mount: Duration::from_secs(60),
        }
    }
}

#[derive(Debug)]
pub struct Linux {
    pub deadlines: Deadlines,
    roots: Roots,
    tag: String,
    /// Where FUSE clients of mounts (GlusterFS) are started.
    launcher: std::sync::Arc<dyn super::launch::Launcher>,
    /// The node's loop devices by backing file.
    loops: super::loop_index::LoopIndex,
}

impl Linux {
    /// Act beneath `roots`; loop devices attached carry `tag`.
    pub fn new(roots: Roots, tag: &str) -> Linux {
        Linux {
            deadlines: Deadlines::default(),
            roots,
            tag: tag.to_string(),
            launcher: std::sync::Arc::new(super::launch::Local::default()),
            loops: Default::default(),
        }
    }

    /// Whether loop devices are looked up by this node's index rather
    /// than one by one (see [`super::loop_index`]).
    pub fn loops_indexed(&self) -> bool {
        self.loops.in_use()
    }

    /// This node, its mounts' FUSE clients started by `launcher`.
    pub fn with_launcher(self, launcher: std::sync::Arc<dyn super::launch::Launcher>) -> Linux {
        Linux { launcher, ..self }
    }

    /// No roots: only what needs none (the mount table, loop devices by
    /// their /dev path). For tests that look and clean up; the agent's
    /// node is always built with its roots.
    #[cfg(any(test, feature = "testing"))]
    pub fn unrooted() -> Linux {
        Linux::new(Roots::default(), "")
    }

    /// `path` beneath the roots, opened for reading and writing (or only
    /// reading) as what it must be, checked on a handle before the open, so
    /// that a FIFO, socket or device never gets opened by mistake.
    fn open_regular(&self, path: &Path, write: bool) -> Result<File, SysError> {
        Ok(self.open_regular_stat(path, write)?.0)
    }

    /// [`open_regular`](Self::open_regular), with what the check found.
    fn open_regular_stat(
        &self,
        path: &Path,
        write: bool,
    ) -> Result<(File, nix::sys::stat::FileStat), SysError> {
        let handle = self.roots.handle(path)?;
        let meta = nix::sys::stat::fstat(handle.as_fd()).map_err(errno("stat", path))?;
        if meta.st_mode & nix::libc::S_IFMT != nix::libc::S_IFREG {
            return Err(SysError::Refused {
                path: path.to_path_buf(),
                what: "is not a regular file".into(),
            });
        }
        Ok((reopen(&handle, path, write)?, meta))
    }
}

/// Reopen what `handle` (an O_PATH handle) refers to, through its procfs
/// link: the object itself, whatever its name now leads to.
fn reopen(handle: &OwnedFd, path: &Path, write: bool) -> Result<File, SysError> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(write);
    options.open(fd_path(handle)).map_err(io("open", path))
}

/// `mount_setattr(2)`, which rustix does not wrap: set `attr_set` on the
/// (detached) mount `tree`.
#[allow(unsafe_code)]
fn mount_setattr(tree: &OwnedFd, attr_set: u64, target: &Path) -> Result<(), SysError> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    let attr = MountAttr { attr_set, attr_clr: 0, propagation: 0, userns_fd: 0 };
    // SAFETY: an empty NUL-terminated path, a live fd, and a mount_attr of
    // the size passed, all outliving the call.
    let rc = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            nix::libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    nix::errno::Errno::result(rc)
        .map(drop)
        .map_err(errno("set the flags of the bind mount for", target))
}

/// What a file of `mode` is.
fn kind(mode: u32) -> super::Kind {
    match mode & nix::libc::S_IFMT {
        nix::libc::S_IFREG => super::Kind::File,
        nix::libc::S_IFDIR => super::Kind::Dir,
        nix::libc::S_IFBLK => super::Kind::Block,
        _ => super::Kind::Other,
    }
}

fn rustix_errno<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl Fn(rustix::io::Errno) -> SysError + 'a {
    move |e| SysError::Errno {
        op,
        path: path.to_path_buf(),
        errno: nix::errno::Errno::from_raw(e.raw_os_error()),
    }
}

/// Options of the mount itself become flags (mount(8) does the same: the
/// filesystems do not know them); the rest is the filesystem's data.
fn split_options(options: &str) -> (MsFlags, String) {
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for option in options.split(',').filter(|o| !o.is_empty()) {
        match option {
            "noatime" => flags |= MsFlags::MS_NOATIME,
            "nodiratime" => flags |= MsFlags::MS_NODIRATIME,
            "relatime" => flags |= MsFlags::MS_RELATIME,
            "strictatime" => flags |= MsFlags::MS_STRICTATIME,
            "lazytime" => flags |= MsFlags::MS_LAZYTIME,
            "noexec" => flags |= MsFlags::MS_NOEXEC,
            "sync" => flags |= MsFlags::MS_SYNCHRONOUS,
            "dirsync" => flags |= MsFlags::MS_DIRSYNC,
            other => data.push(other),
        }
    }
    (flags, data.join(","))
}

impl Mounts for Linux {
    fn mount_table(&self) -> Result<Vec<MountInfo>, SysError> {
        mountinfo::own()
    }

    /// statx(2)'s `STATX_ATTR_MOUNT_ROOT` on a handle resolved beneath the
    /// roots; paths outside them are left to the mount table.
    fn is_mount_point(&self, target: &Path) -> Result<Option<bool>, SysError> {
        let handle = match self.roots.handle(target) {
            Ok(h) => h,
            Err(SysError::Errno {
                errno: nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR,
                ..
            }) => return Ok(Some(false)),
            // A symlink is not a mount point the table would list there.
            Err(SysError::Refused { .. }) if self.roots.contains(target) => return Ok(Some(false)),
            Err(_) => return Ok(None),
        };
        use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
        match rustix::fs::statx(&handle, c"", AtFlags::EMPTY_PATH, StatxFlags::TYPE) {
            Ok(st) if st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) => {
                Ok(Some(st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)))
            }
            _ => Ok(None),
        }
    }

    fn device_of_mount(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError> {
        use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
        let Ok(handle) = self.roots.handle(target) else { return Ok(None) };
        match rustix::fs::statx(&handle, c"", AtFlags::EMPTY_PATH, StatxFlags::TYPE) {
            Ok(st) if st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT) => {
                Ok(Some((st.stx_dev_major, st.stx_dev_minor)))
            }
            _ => Ok(None),
        }
    }

    fn mount(
        &self,
        source: &str,
        target: &Path,
        fs_type: &str,
        options: &str,
        read_only: bool,
    ) -> Result<(), SysError> {
        let dir = self.roots.open_at(target, OFlag::O_PATH | OFlag::O_DIRECTORY)?;
        if fs_type == "glusterfs" {
            // The helper takes a path: the dir was just resolved beneath the
            // roots (the agent's own staging dir, which nobody else writes).
            drop(dir);
            return super::gluster_mount::mount(
                &*self.launcher,
                source,
                target,
                options,
                read_only,
                self.deadlines.network_mount,
            );
        }
        if super::nfs_mount::FS_TYPES.contains(&fs_type) {
            // As for gluster: the helper takes the path just resolved.
            drop(dir);
            return super::nfs_mount::mount(
                source,
                target,
                fs_type,
                options,
                read_only,
                self.deadlines.network_mount,
            );
        }
        let (mut flags, data) = split_options(options);
        flags |= MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        let data = (!data.is_empty()).then_some(data.as_str());
        nix::mount::mount(Some(source), &fd_path(&dir), Some(fs_type), flags, data)
            .map_err(errno("mount", target))
    }

    /// A clone of `source`'s mount, flagged while still detached, then
    /// moved onto `target`: it never shows with other flags.
    fn bind(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), SysError> {
        use rustix::mount::{MoveMountFlags, OpenTreeFlags};
        let from = self.roots.open_at(source, OFlag::O_PATH | OFlag::O_DIRECTORY)?;
        let to = self.roots.open_at(target, OFlag::O_PATH | OFlag::O_DIRECTORY)?;
        let tree = rustix::mount::open_tree(
            &from,
            c"",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )
        .map_err(rustix_errno("bind-mount from", source))?;
        const RDONLY: u64 = 0x1;
        const NOSUID: u64 = 0x2;
        const NODEV: u64 = 0x4;
        mount_setattr(&tree, NOSUID | NODEV | if read_only { RDONLY } else { 0 }, target)?;
        rustix::mount::move_mount(
            &tree,
            c"",
            &to,
            c"",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(rustix_errno("bind-mount onto", target))
    }

    fn bind_device(&self, device: &Path, target: &Path, read_only: bool) -> Result<(), SysError> {
        use rustix::mount::{MoveMountFlags, OpenTreeFlags};
        // The device is named by the plan's own attach or a verified path
        // under /dev; it is opened without following a symlink at its end
        // and must be a block device.
        let from = nix::fcntl::open(
            device,
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(errno("open device", device))?;
        let st = nix::sys::stat::fstat(&from).map_err(errno("inspect device", device))?;
        if nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT
            != nix::sys::stat::SFlag::S_IFBLK
        {
            return Err(SysError::Refused {
                path: device.to_path_buf(),
                what: "is not a block device".into(),
            });
        }
        let to = self.roots.open_at(target, OFlag::O_PATH | OFlag::O_NOFOLLOW)?;
        let tree = rustix::mount::open_tree(
            &from,
            c"",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )
        .map_err(rustix_errno("bind device", device))?;
        const RDONLY: u64 = 0x1;
        const NOSUID: u64 = 0x2;
        mount_setattr(&tree, NOSUID | if read_only { RDONLY } else { 0 }, target)?;
        rustix::mount::move_mount(
            &tree,
            c"",
            &to,
            c"",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(rustix_errno("bind device onto", target))
    }

    fn published_device(&self, target: &Path) -> Result<Option<(u32, u32)>, SysError> {
        use rustix::fs::{AtFlags, FileType, StatxFlags};
        let handle = self.roots.handle(target)?;
        let st = rustix::fs::statx(&handle, c"", AtFlags::EMPTY_PATH, StatxFlags::TYPE)
            .map_err(rustix_errno("inspect", target))?;
        let block = FileType::from_raw_mode(st.stx_mode.into()) == FileType::BlockDevice;
        Ok(block.then_some((st.stx_rdev_major, st.stx_rdev_minor)))
    }

    fn device_number(&self, device: &Path) -> Result<Option<(u32, u32)>, SysError> {
        use rustix::fs::{AtFlags, FileType, StatxFlags};
        let st =
            rustix::fs::statx(rustix::fs::CWD, device, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::TYPE)
                .map_err(rustix_errno("inspect", device))?;
        let block = FileType::from_raw_mode(st.stx_mode.into()) == FileType::BlockDevice;
        Ok(block.then_some((st.stx_rdev_major, st.stx_rdev_minor)))
    }

    fn ensure_file(&self, file: &Path) -> Result<bool, SysError> {
        self.roots.make_file(file)
    }

    fn remove_file(&self, file: &Path) -> Result<(), SysError> {
        self.roots.remove_empty_file(file)
    }

    /// Through a handle on the parent and the name, never followed: a
    /// handle on the mount itself would keep it busy.
    fn unmount(&self, target: &Path, force: bool) -> Result<(), SysError> {
        let (parent, name) = self.roots.parent(target)?;
        let mut flags = MntFlags::UMOUNT_NOFOLLOW;
        if force {
            flags |= MntFlags::MNT_FORCE | MntFlags::MNT_DETACH;
        }
        nix::mount::umount2(&fd_path_in(&parent, name.as_os_str()), flags)
            .map_err(errno("unmount", target))
    }

    fn ensure_dir(&self, dir: &Path) -> Result<bool, SysError> {
        self.roots.mkdir_all(dir)
    }

    fn remove_dir(&self, dir: &Path) -> Result<(), SysError> {
        self.roots.rmdir(dir)
    }

    fn usage(&self, path: &Path) -> Result<super::Usage, SysError> {
        let handle = self.roots.handle(path)?;
        let st = rustix::fs::fstatvfs(&handle).map_err(rustix_errno("statvfs", path))?;
        let frsize = st.f_frsize;
        Ok(super::Usage {
            bytes_total: st.f_blocks.saturating_mul(frsize),
            bytes_available: st.f_bavail.saturating_mul(frsize),
            bytes_used: st.f_blocks.saturating_sub(st.f_bfree).saturating_mul(frsize),
            inodes_total: st.f_files,
            inodes_free: st.f_ffree,
            inodes_used: st.f_files.saturating_sub(st.f_ffree),
            read_only: st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY),
        })
    }
}

impl Devices for Linux {
    fn loop_tag(&self) -> &str {
        &self.tag
    }

    fn loop_attach(&self, file: &Path, read_only: bool) -> Result<PathBuf, SysError> {
        let (backing, st) = self.open_regular_stat(file, !read_only)?;
        let device = loopdev::attach(backing.as_fd(), file, read_only, &self.tag)?;
        let id = FileId { dev: st.st_dev, ino: st.st_ino };
        self.loops.attached(&device, Some(id), &self.tag);
        Ok(device)
    }

    fn loop_devices(&self) -> Result<Vec<LoopDevice>, SysError> {
        loopdev::list()
    }

    fn loop_statuses(&self) -> Result<Vec<LoopStatus>, SysError> {
        loopdev::statuses()
    }

    /// One resolution of `file` for the lookup, the attach and the probe
    /// after it: the file whose identity is looked up is the file attached,
    /// and the one later read. (Eight syscalls fewer: 0–16 µs of a CSI
    /// stage + publish on a small VM, four runs, the two ways alternating.)
    fn loop_attach_or_reuse(&self, file: &Path, read_only: bool) -> Result<LoopAttach, SysError> {
        let (backing, st) = self.open_regular_stat(file, !read_only)?;
        let id = FileId { dev: st.st_dev, ino: st.st_ino };
        for l in self.loops.find(Some(id), &[])? {
            if loopdev::keep(&l.device, id)? {
                return Ok(LoopAttach::Reused(l.device));
            }
        }
        let device = loopdev::attach(backing.as_fd(), file, read_only, &self.tag)?;
        self.loops.attached(&device, Some(id), &self.tag);
        Ok(LoopAttach::Attached { device, backing: Some(backing) })
    }

    fn loops_over(
        &self,
        backing: Option<FileId>,
        numbers: &[(u32, u32)],
    ) -> Result<Vec<LoopStatus>, SysError> {
        self.loops.find(backing, numbers)
    }

    fn loop_detach(&self, device: &Path) -> Result<(), SysError> {
        loopdev::detach(device)
    }

    fn loop_keep(&self, device: &Path, backing: FileId) -> Result<bool, SysError> {
        loopdev::keep(device, backing)
    }

    fn file_id(&self, file: &Path) -> Result<Option<FileId>, SysError> {
        let handle = match self.roots.handle(file) {
            Ok(h) => h,
            Err(SysError::Errno {
                errno: nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR,
                ..
            }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let st = nix::sys::stat::fstat(handle.as_fd()).map_err(errno("stat", file))?;
        Ok(Some(FileId { dev: st.st_dev, ino: st.st_ino }))
    }

    fn kind_of(&self, path: &Path) -> Result<Option<super::Kind>, SysError> {
        use super::Kind;
        let handle = match self.roots.handle(path) {
            Ok(h) => h,
            Err(SysError::Errno {
                errno: nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR,
                ..
            }) => return Ok(None),
            // A symlink is there, but it is nothing the agent follows.
            Err(SysError::Refused { .. }) if self.roots.contains(path) => {
                return Ok(Some(Kind::Other));
            }
            Err(e) => return Err(e),
        };
        let st = nix::sys::stat::fstat(handle.as_fd()).map_err(errno("stat", path))?;
        Ok(Some(kind(st.st_mode)))
    }

    /// A guest's `lookup-path` mostly asks about a file the agent has just
    /// looked at: answered here, no query thread is woken (two thread
    /// wake-ups, ~100 µs on a small VM, for a few µs of work).
    fn kind_of_cached(&self, path: &Path) -> Option<Result<Option<super::Kind>, SysError>> {
        use super::Kind;
        use rustix::fs::{AtFlags, StatxFlags};
        let handle = match self.roots.handle_cached(path) {
            Ok(Some(h)) => h,
            Ok(None) => return None,
            // A cached negative entry: a local filesystem's say-so (a
            // network one's would need revalidating, and is not answered).
            Err(SysError::Errno {
                errno: nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR,
                ..
            }) => return Some(Ok(None)),
            Err(SysError::Refused { .. }) if self.roots.contains(path) => {
                return Some(Ok(Some(Kind::Other)));
            }
            Err(e) => return Some(Err(e)),
        };
        // The type of an inode never changes, so the cached attributes
        // answer: nothing is asked of the filesystem (a FUSE server).
        match rustix::fs::statx(
            &handle,
            c"",
            AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC,
            StatxFlags::TYPE,
        ) {
            Ok(st) => Some(Ok(Some(kind(u32::from(st.stx_mode))))),
            Err(e) => Some(Err(rustix_errno("stat", path)(e))),
        }
    }

    fn block_device(&self, path: &Path) -> Result<PathBuf, SysError> {
        if path.starts_with("/dev/") && !self.roots.contains(path) {
            // A device node a PV names with its identity (checked by the
            // caller); never a link.
            dev_node(path)?;
            let st = nix::sys::stat::lstat(path).map_err(errno("stat", path))?;
            return block::devnode(st.st_rdev, path);
        }
        let handle = self.roots.handle(path)?;
        let st = nix::sys::stat::fstat(handle.as_fd()).map_err(errno("stat", path))?;
        if st.st_mode & nix::libc::S_IFMT != nix::libc::S_IFBLK {
            return Err(SysError::Refused {
                path: path.to_path_buf(),
                what: "is not a block device".into(),
            });
        }
        block::devnode(st.st_rdev, path)
    }

    fn open_file(&self, file: &Path, write: bool) -> Result<File, SysError> {
        self.open_regular(file, write)
    }
}

/// A device argument: a block device node under /dev, never a symlink.
fn dev_node(device: &Path) -> Result<(), SysError> {
    let meta = std::fs::symlink_metadata(device).map_err(io("stat", device))?;
    if !device.starts_with("/dev/") || !meta.file_type().is_block_device() {
        return Err(SysError::Refused {
            path: device.to_path_buf(),
            what: "is not a block device node under /dev".into(),
        });
    }
    Ok(())
}

impl Linux {
    /// blkid's full probe, which reads every signature it knows, at the
    /// start and at the end of the device.
    fn full_probe(&self, device: &Path) -> Result<Option<String>, SysError> {
        // blkid exits 2 when it finds nothing: a blank device.
        let out = run("blkid", &["-p", "-o", "export"], device, self.deadlines.probe)?;
        if out.status.code() == Some(2) {
            return Ok(None);
        }
        let out = check("blkid", device, out)?;
        Ok(Some(probe::parse_blkid_export(&String::from_utf8_lossy(&out.stdout))))
    }
}

impl Filesystems for Linux {
    fn probe(&self, device: &Path) -> Result<Option<String>, SysError> {
        dev_node(device)?;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC)
            .open(device)
            .map_err(io("open", device))?;
        // A loop device number is reused: drop whatever an earlier user of it
        // left in the page cache of what the quick probe reads, so the bytes
        // read are the backing file's.
        let size = std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)).unwrap_or(0);
        for (at, len) in probe::regions(size) {
            let _ = nix::fcntl::posix_fadvise(
                &f,
                at as i64,
                len as i64,
                nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
            );
        }
        if let Some(found) = probe::quick(&f, size) {
            return Ok(Some(found));
        }
        self.full_probe(device)
    }

    fn probe_attached(
        &self,
        device: &Path,
        file: &Path,
        backing: Option<&File>,
    ) -> Result<Option<String>, SysError> {
        // The device is the file rounded down to whole sectors: the same
        // bytes, and the same size for probes that look at the end, when the
        // file is whole sectors. (A file's own cache is its bytes.)
        let opened;
        let f = match backing {
            Some(f) => f,
            None => {
                opened = self.open_regular(file, false)?;
                &opened
            }
        };
        if let Ok(size) = f.metadata().map(|m| m.len())
            && size % 512 == 0
            && let Some(found) = probe::quick(f, size)
        {
            return Ok(Some(found));
        }
        dev_node(device)?;
        self.full_probe(device)
    }

    fn grow_filesystem(
        &self,
        device: &Path,
        mount_point: &Path,
        fs_type: &str,
    ) -> Result<u64, SysError> {
        dev_node(device)?;
        if loopdev::is_loop_path(device) {
            loopdev::refresh_capacity(device)?;
        }
        // Both grow a mounted filesystem online. xfs_growfs names it by its
        // mount point: it is given this process's handle on the dir, opened
        // beneath the roots, so a path swapped meanwhile cannot redirect it.
        match fs_type {
            "ext4" => {
                check("resize2fs", device, run("resize2fs", &[], device, self.deadlines.mkfs)?)
                    .map(drop)?;
            }
            "xfs" => {
                let dir = self.roots.open_at(mount_point, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
                let held = PathBuf::from(format!(
                    "/proc/{}/fd/{}",
                    std::process::id(),
                    std::os::fd::AsRawFd::as_raw_fd(&dir)
                ));
                check(
                    "xfs_growfs",
                    mount_point,
                    run("xfs_growfs", &["-d"], &held, self.deadlines.mkfs)?,
                )
                .map(drop)?;
            }
            other => {
                return Err(SysError::Refused {
                    path: device.to_path_buf(),
                    what: format!("cannot grow a {other:?} filesystem (ext4 and xfs grow online)"),
                });
            }
        }
        super::block_size(device)
    }

    fn mkfs(&self, device: &Path, fs_type: &str) -> Result<(), SysError> {
        let (program, args): (&'static str, &[&str]) = match fs_type {
            "ext4" => ("mkfs.ext4", &["-F", "-q", "-E", "lazy_itable_init=1,lazy_journal_init=1"]),
            "xfs" => ("mkfs.xfs", &["-f", "-q"]),
            other => {
                return Err(SysError::Refused {
                    path: device.to_path_buf(),
                    what: format!("no mkfs for filesystem {other:?}"),
                });
            }
        };
        dev_node(device)?;
        // Say clearly why a device in use is refused; mkfs opens it
        // exclusively itself, so nothing can take it in between.
        drop(block::exclusive(device)?);
        check(program, device, run(program, args, device, self.deadlines.mkfs)?).map(drop)
    }

    fn wipe(&self, device: &Path, method: Wipe) -> Result<(), SysError> {
        dev_node(device)?;
        let held = block::exclusive(device)?;
        match method {
            Wipe::Signatures => {
                // wipefs opens the device exclusively itself (no -f).
                drop(held);
                check("wipefs", device, run("wipefs", &["-a", "-q"], device, self.deadlines.wipe)?)
                    .map(drop)
            }
            Wipe::Discard => block::discard_all(&held, device, false),
            Wipe::Zero => block::discard_all(&held, device, true),
            Wipe::Shred(passes) => {
                // shred writes to the device held here (its standard output).
                let n = passes.to_string();
                // Dies with the agent (setpriv --pdeathsig): a wipe cut
                // short is started again, and must find the device free.
                let mut cmd = Command::new("setpriv");
                cmd.args(["--pdeathsig", "KILL", "--", "shred", "-n", &n, "-z", "-"])
                    .stdout(Stdio::from(held));
                check("shred", device, run_with(&mut cmd, "shred", device, self.deadlines.wipe)?)
                    .map(drop)
            }
        }
    }

    fn clear_dir(&self, dir: &Path) -> Result<u64, SysError> {
        let fd = self.roots.open_at(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
        super::clear_dir::clear(fd, dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_roots_as_the_mount_table_lists_them() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir_all(root.join("plain")).unwrap();
        std::os::unix::fs::symlink("/", root.join("link")).unwrap();
        let linux = Linux::new(Roots::open(std::slice::from_ref(&root)).unwrap(), "t");
        assert_eq!(linux.is_mount_point(&root.join("plain")).unwrap(), Some(false));
        assert_eq!(linux.is_mount_point(&root.join("missing")).unwrap(), Some(false));
        // A symlink to a mount point is not one.
        assert_eq!(linux.is_mount_point(&root.join("link")).unwrap(), Some(false));
        // Outside the roots, only the table can tell.
        assert_eq!(linux.is_mount_point(Path::new("/")).unwrap(), None);
    }

    #[test]
    fn mount_options_split_into_flags_and_data() {
        let (flags, data) = split_options("noatime,data=ordered,noexec,discard");
        assert_eq!(flags, MsFlags::MS_NOATIME | MsFlags::MS_NOEXEC);
        assert_eq!(data, "data=ordered,discard");
        assert_eq!(split_options(""), (MsFlags::empty(), String::new()));
    }

    #[test]
    fn device_arguments_are_block_device_nodes_under_dev() {
        for bad in ["/etc/passwd", "/dev/null", "/dev/../etc/passwd"] {
            assert!(dev_node(Path::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn files_are_opened_only_when_regular() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::write(root.join("f"), b"x").unwrap();
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .unwrap();
        std::fs::create_dir(root.join("d")).unwrap();
        let linux = Linux::new(Roots::open(std::slice::from_ref(&root)).unwrap(), "t");
        linux.open_regular(&root.join("f"), false).expect("a file");
        for bad in ["fifo", "d"] {
            let e = linux.open_regular(&root.join(bad), false).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{bad}: {e}");
        }
        assert!(linux.file_id(&root.join("missing")).unwrap().is_none());
        assert!(linux.file_id(&root.join("f")).unwrap().is_some());
    }
}
