//! Block devices: their /dev nodes, exclusive opens, and the ioctls that
//! destroy data (discard, zero-out) on a device held exclusively.
#![allow(unsafe_code)]

use super::{SysError, errno, io};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

nix::ioctl_read!(blkgetsize64, 0x12, 114, u64);
nix::ioctl_write_ptr_bad!(blkdiscard, 0x1277, [u64; 2]);
nix::ioctl_write_ptr_bad!(blkzeroout, 0x127f, [u64; 2]);

/// The node under /dev of the block device `rdev`, found through sysfs and
/// checked to be that device (not a symlink, the same numbers).
pub fn devnode(rdev: u64, what: &Path) -> Result<PathBuf, SysError> {
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    let uevent = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/uevent"));
    let text = std::fs::read_to_string(&uevent).map_err(io("read", &uevent))?;
    let name = text
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .filter(|n| !n.is_empty() && !n.split('/').any(|c| c.is_empty() || c == "." || c == ".."))
        .ok_or_else(|| SysError::Refused {
            path: what.to_path_buf(),
            what: format!("block device {major}:{minor} has no name in {}", uevent.display()),
        })?;
    let node = Path::new("/dev").join(name);
    let meta = std::fs::symlink_metadata(&node).map_err(io("stat", &node))?;
    if !meta.file_type().is_block_device() || meta.rdev() != rdev {
        return Err(SysError::Refused {
            path: what.to_path_buf(),
            what: format!("{} is not block device {major}:{minor}", node.display()),
        });
    }
    Ok(node)
}

/// `device` opened read-write and exclusively: refused while it is mounted
/// or another program holds it exclusively (mkfs, another agent's wipe).
pub fn exclusive(device: &Path) -> Result<File, SysError> {
    let meta = std::fs::symlink_metadata(device).map_err(io("stat", device))?;
    if !meta.file_type().is_block_device() {
        return Err(SysError::Refused {
            path: device.to_path_buf(),
            what: "is not a block device".into(),
        });
    }
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(nix::libc::O_EXCL | nix::libc::O_CLOEXEC)
        .open(device)
        .map_err(|e| match e.raw_os_error() {
            Some(nix::libc::EBUSY) => SysError::Refused {
                path: device.to_path_buf(),
                what: "is in use (mounted, or held open exclusively by another program); refusing to destroy its data".into(),
            },
            _ => io("open exclusively", device)(e),
        })
}

/// The size of the block device open as `f`.
pub fn size(f: &File, device: &Path) -> Result<u64, SysError> {
    let mut bytes = 0u64;
    // SAFETY: BLKGETSIZE64 writes one u64 into `bytes`; the fd is open.
    unsafe { blkgetsize64(f.as_raw_fd(), &mut bytes) }
        .map_err(errno("read the size of", device))?;
    Ok(bytes)
}

/// Discard (`zero` false) or zero out every byte of the device held as `f`.
pub fn discard_all(f: &File, device: &Path, zero: bool) -> Result<(), SysError> {
    let range = [0u64, size(f, device)?];
    if range[1] == 0 {
        return Ok(());
    }
    // SAFETY: both ioctls read a [start, length] pair of u64 that outlives
    // the call; the fd is open.
    let result = unsafe {
        if zero { blkzeroout(f.as_raw_fd(), &range) } else { blkdiscard(f.as_raw_fd(), &range) }
    };
    result.map(drop).map_err(errno(if zero { "zero out" } else { "discard" }, device))
}

/// The size of block device `device`, opened read-only for the ioctl.
pub fn size_of(device: &Path) -> Result<u64, SysError> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(device)
        .map_err(io("open", device))?;
    size(&f, device)
}
