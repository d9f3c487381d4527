//! Loop devices through /dev/loop-control and the loop ioctls (loop(4)).
#![allow(unsafe_code)]

use super::{LoopDevice, SysError, errno, io};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const LOOP_CONTROL: &str = "/dev/loop-control";
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `struct loop_info64` from <linux/loop.h>.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config` from <linux/loop.h> (LOOP_CONFIGURE, Linux 5.8+).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

nix::ioctl_none_bad!(loop_ctl_get_free, 0x4C82);
nix::ioctl_write_ptr_bad!(loop_configure, 0x4C0A, LoopConfig);
nix::ioctl_none_bad!(loop_clr_fd, 0x4C01);

/// Attach `file` to a free loop device. Another process may take the free
/// device between asking and configuring (EBUSY): then ask again.
pub fn attach(file: &Path, read_only: bool) -> Result<PathBuf, SysError> {
    let backing = OpenOptions::new().read(true).write(!read_only).open(file).map_err(io("open loop backing file", file))?;
    let control = OpenOptions::new().read(true).write(true).open(LOOP_CONTROL).map_err(io("open", Path::new(LOOP_CONTROL)))?;
    let mut last = nix::errno::Errno::EBUSY;
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument; the fd is open.
        let n = unsafe { loop_ctl_get_free(control.as_raw_fd()) }.map_err(errno("find a free loop device", Path::new(LOOP_CONTROL)))?;
        let device = PathBuf::from(format!("/dev/loop{n}"));
        let dev = OpenOptions::new().read(true).write(!read_only).open(&device).map_err(io("open", &device))?;
        let mut config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: if read_only { LO_FLAGS_READ_ONLY } else { 0 },
                lo_file_name: [0; LO_NAME_SIZE],
                lo_crypt_name: [0; LO_NAME_SIZE],
                lo_encrypt_key: [0; LO_KEY_SIZE],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        let name = file.as_os_str().as_encoded_bytes();
        let len = name.len().min(LO_NAME_SIZE - 1);
        config.info.lo_file_name[..len].copy_from_slice(&name[..len]);
        // SAFETY: `config` is a fully initialised loop_config that outlives
        // the call; both fds are open.
        match unsafe { loop_configure(dev.as_raw_fd(), &config) } {
            Ok(_) => return Ok(device),
            Err(nix::errno::Errno::EBUSY) => last = nix::errno::Errno::EBUSY,
            Err(e) => return Err(errno("configure loop device", &device)(e)),
        }
    }
    Err(SysError::Errno { op: "attach a loop device for", path: file.to_path_buf(), errno: last })
}

/// Detach `device`; a device that is not attached is fine.
pub fn detach(device: &Path) -> Result<(), SysError> {
    let dev = match File::open(device) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("open", device)(e)),
    };
    // SAFETY: LOOP_CLR_FD takes no argument; the fd is open.
    match unsafe { loop_clr_fd(dev.as_raw_fd()) } {
        Ok(_) | Err(nix::errno::Errno::ENXIO) => Ok(()),
        Err(e) => Err(errno("detach loop device", device)(e)),
    }
}

/// Every attached loop device and its backing file. /proc/partitions lists
/// the loop devices that have a size, i.e. are attached (a device over an
/// empty file has none and is not seen): one read instead of probing every
/// /sys/block/loop* node, of which a busy node has many.
pub fn list() -> Result<Vec<LoopDevice>, SysError> {
    let partitions = Path::new("/proc/partitions");
    let text = std::fs::read_to_string(partitions).map_err(io("read", partitions))?;
    let mut found = Vec::new();
    for name in text.lines().filter_map(|l| l.split_whitespace().nth(3)).filter(|n| n.starts_with("loop")) {
        let backing = Path::new("/sys/block").join(name).join("loop/backing_file");
        match std::fs::read_to_string(&backing) {
            Ok(text) => found.push(LoopDevice {
                device: PathBuf::from(format!("/dev/{name}")),
                backing_file: PathBuf::from(text.trim_end_matches('\n')),
            }),
            // Detached while we looked (ENOENT, ENODEV, ENXIO).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound || [Some(nix::libc::ENODEV), Some(nix::libc::ENXIO)].contains(&e.raw_os_error()) => {}
            Err(e) => return Err(io("read", &backing)(e)),
        }
    }
    found.sort_by(|a, b| a.device.cmp(&b.device));
    Ok(found)
}
