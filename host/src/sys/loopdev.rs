//! Loop devices through /dev/loop-control and the loop ioctls (loop(4)).
//! A device is attached from an open handle on its backing file (resolved
//! beneath its root), and carries the attaching agent's tag as its
//! `lo_file_name` (an informational field: the kernel reports the backing
//! file by its own path in sysfs; losetup sets it to the file's absolute
//! path, which never looks like a tag), so that a start-up sweep tells the
//! agent's own devices from everyone else's with no record at all.
#![allow(unsafe_code)]

use super::{FileId, LoopDevice, LoopStatus, SysError, errno, io};
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

const LOOP_CONTROL: &str = "/dev/loop-control";
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `struct loop_info64` from <linux/loop.h>.
#[repr(C)]
#[derive(Clone, Copy)]
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

impl LoopInfo64 {
    fn zeroed() -> LoopInfo64 {
        LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; LO_KEY_SIZE],
            lo_init: [0; 2],
        }
    }
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
nix::ioctl_read_bad!(loop_get_status64, 0x4C05, LoopInfo64);
nix::ioctl_write_ptr_bad!(loop_set_status64, 0x4C04, LoopInfo64);
nix::ioctl_none_bad!(loop_set_capacity, 0x4C07);

/// A NUL-padded copy of `bytes` for a `LO_NAME_SIZE` field.
fn name_field(bytes: &[u8]) -> [u8; LO_NAME_SIZE] {
    let mut field = [0; LO_NAME_SIZE];
    let len = bytes.len().min(LO_NAME_SIZE - 1);
    field[..len].copy_from_slice(&bytes[..len]);
    field
}

fn field_str(field: &[u8; LO_NAME_SIZE]) -> String {
    let end = field.iter().position(|b| *b == 0).unwrap_or(LO_NAME_SIZE);
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// How long an attach keeps asking for a free device while the kernel
/// hands out devices that are not free after all.
const ATTACH_BUDGET: std::time::Duration = std::time::Duration::from_secs(3);

/// Whether a failure to bind the device the kernel called free is a race
/// that a fresh device (or the same one a moment later) resolves: another
/// process bound it first (EBUSY), it is being torn down or was removed
/// since (ENXIO, ENOENT), or created twice at once (EEXIST).
fn transient(e: nix::errno::Errno) -> bool {
    use nix::errno::Errno;
    matches!(e, Errno::EBUSY | Errno::EEXIST | Errno::ENXIO | Errno::ENOENT)
}

/// Attach the open file `backing` (named `file` in errors) to a free loop
/// device, tagged `tag`. The free device can be taken by another process
/// between asking and binding, or still be released by the kernel (a
/// detach completes after the last opener closes it, and udev probes every
/// device that changes): then ask again, backing off, within a budget.
pub fn attach(
    backing: BorrowedFd<'_>,
    file: &Path,
    read_only: bool,
    tag: &str,
) -> Result<PathBuf, SysError> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open(LOOP_CONTROL)
        .map_err(io("open", Path::new(LOOP_CONTROL)))?;
    let mut info = LoopInfo64::zeroed();
    info.lo_flags = if read_only { LO_FLAGS_READ_ONLY } else { 0 };
    info.lo_file_name = name_field(tag.as_bytes());
    let config =
        LoopConfig { fd: backing.as_raw_fd() as u32, block_size: 0, info, reserved: [0; 8] };
    let start = std::time::Instant::now();
    let mut pause = std::time::Duration::from_micros(500);
    loop {
        let last = match bind_free(&control, &config, read_only) {
            Ok(device) => return Ok(device),
            Err(Bind::Fatal(e)) => return Err(e),
            Err(Bind::Raced(device, e)) => (device, e),
        };
        if start.elapsed() + pause > ATTACH_BUDGET {
            let (device, e) = last;
            tracing::warn!(file = %file.display(), device = %device.display(), "no loop device could be bound in {ATTACH_BUDGET:?}: {e}");
            return Err(SysError::Errno {
                op: "attach a loop device for",
                path: file.to_path_buf(),
                errno: e,
            });
        }
        tracing::debug!(file = %file.display(), device = %last.0.display(), "loop device taken or being released ({}); asking again", last.1);
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
}

enum Bind {
    /// Another try may succeed: the device asked for, and why it failed.
    Raced(PathBuf, nix::errno::Errno),
    Fatal(SysError),
}

/// One try: ask the kernel for a free device and bind it.
fn bind_free(
    control: &std::fs::File,
    config: &LoopConfig,
    read_only: bool,
) -> Result<PathBuf, Bind> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument; the fd is open.
    let n = unsafe { loop_ctl_get_free(control.as_raw_fd()) }
        .map_err(|e| Bind::Fatal(errno("find a free loop device", Path::new(LOOP_CONTROL))(e)))?;
    let device = PathBuf::from(format!("/dev/loop{n}"));
    let dev = match OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(nix::libc::O_CLOEXEC)
        .open(&device)
    {
        Ok(dev) => dev,
        Err(e) => {
            let errno = nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0));
            return Err(match transient(errno) {
                true => Bind::Raced(device, errno),
                false => Bind::Fatal(io("open", &device)(e)),
            });
        }
    };
    // SAFETY: `config` is a fully initialised loop_config that outlives
    // the call; both fds are open.
    match unsafe { loop_configure(dev.as_raw_fd(), config) } {
        Ok(_) => Ok(device),
        Err(e) if transient(e) => Err(Bind::Raced(device, e)),
        Err(e) => Err(Bind::Fatal(errno("configure loop device", &device)(e))),
    }
}

/// `/dev/loop<N>` and nothing else: a device path from a plan or a record
/// is checked before it is opened.
pub fn is_loop_path(device: &Path) -> bool {
    device
        .to_str()
        .and_then(|d| d.strip_prefix("/dev/loop"))
        .is_some_and(|n| !n.is_empty() && n.len() <= 7 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Make `device` as big as its backing file is now (LOOP_SET_CAPACITY):
/// a grown file's device grows, with the device in use.
pub fn refresh_capacity(device: &Path) -> Result<(), SysError> {
    if !is_loop_path(device) {
        return Err(SysError::Refused {
            path: device.to_path_buf(),
            what: "is not a loop device path (/dev/loopN)".into(),
        });
    }
    let dev = File::open(device).map_err(io("open", device))?;
    // The capacity is read from the backing file's inode. A file served by
    // FUSE (an NBD export through `volagent nbd fuse`) learns a new size
    // only when asked: a stat asks. Nothing to do when it cannot be reached.
    if let Some(name) = device.file_name().and_then(|n| n.to_str()) {
        let sysfs = format!("/sys/block/{name}/loop/backing_file");
        if let Ok(backing) = std::fs::read_to_string(&sysfs) {
            let _ = std::fs::metadata(backing.trim_end_matches('\n'));
        }
    }
    // SAFETY: LOOP_SET_CAPACITY takes no argument; the fd is open.
    unsafe { loop_set_capacity(dev.as_raw_fd()) }
        .map_err(errno("refresh the capacity of", device))?;
    Ok(())
}

/// Detach `device`; a device that is not attached is fine.
pub fn detach(device: &Path) -> Result<(), SysError> {
    if !is_loop_path(device) {
        return Err(SysError::Refused {
            path: device.to_path_buf(),
            what: "is not a loop device path (/dev/loopN)".into(),
        });
    }
    let dev = match File::open(device) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        // ENXIO: the device is being torn down (its last user closed it with
        // autoclear set): detached, as far as the caller is concerned.
        Err(e) if e.raw_os_error() == Some(nix::libc::ENXIO) => return Ok(()),
        Err(e) => return Err(io("open", device)(e)),
    };
    // SAFETY: LOOP_CLR_FD takes no argument; the fd is open.
    match unsafe { loop_clr_fd(dev.as_raw_fd()) } {
        Ok(_) | Err(nix::errno::Errno::ENXIO) => Ok(()),
        Err(e) => Err(errno("detach loop device", device)(e)),
    }
}

/// Keep `device` over the file `backing` for a new user. LOOP_CLR_FD on a
/// device still held (a filesystem on it lazily unmounted while a process
/// had a file open) only sets autoclear: the device goes when its last
/// user closes it — under a new mount of the same file that reused it
/// (which it must: a second device would put a second filesystem instance
/// on the file, beside the detached one). Clearing the flag takes the
/// device back. False when it is no longer over `backing`.
pub fn keep(device: &Path, backing: FileId) -> Result<bool, SysError> {
    if !is_loop_path(device) {
        return Err(SysError::Refused {
            path: device.to_path_buf(),
            what: "is not a loop device path (/dev/loopN)".into(),
        });
    }
    // Held open from the check to the change: the device cannot be torn
    // down and handed to another file in between.
    let dev = match OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_CLOEXEC | nix::libc::O_NONBLOCK)
        .open(device)
    {
        Ok(f) => f,
        Err(e) if gone(&e) => return Ok(false),
        Err(e) => return Err(io("open", device)(e)),
    };
    let mut info = LoopInfo64::zeroed();
    // SAFETY: `info` is a loop_info64 the kernel fills; the fd is open.
    match unsafe { loop_get_status64(dev.as_raw_fd(), &mut info) } {
        Ok(_) => {}
        Err(nix::errno::Errno::ENXIO) => return Ok(false),
        Err(e) => return Err(errno("read the status of loop device", device)(e)),
    }
    if (info.lo_device, info.lo_inode) != (backing.dev, backing.ino) {
        return Ok(false);
    }
    if info.lo_flags & LO_FLAGS_AUTOCLEAR != 0 {
        info.lo_flags &= !LO_FLAGS_AUTOCLEAR;
        // SAFETY: `info` is the device's own status, one flag cleared; the fd is open.
        match unsafe { loop_set_status64(dev.as_raw_fd(), &info) } {
            Ok(_) => {
                tracing::info!(device = %device.display(), "took back a loop device whose detach waited for its last user (a filesystem on it unmounted lazily while in use)");
            }
            Err(nix::errno::Errno::ENXIO) => return Ok(false),
            Err(e) => return Err(errno("keep loop device", device)(e)),
        }
    }
    Ok(true)
}

/// A device's (major, minor).
pub(super) type Numbers = (u32, u32);

/// What [`status`] found.
enum Status {
    Detached,
    Attached(Box<LoopInfo64>, Numbers),
    /// Attached, but its status cannot be read: the kernel stats the
    /// backing file for it, which fails on a dead FUSE mount (ENOTCONN).
    Unreadable(Numbers, nix::errno::Errno),
}

/// The status of `device`, numbered `number` (as /proc/partitions says).
fn status(device: &Path, number: Numbers) -> Result<Status, SysError> {
    let dev = match OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_CLOEXEC | nix::libc::O_NONBLOCK)
        .open(device)
    {
        Ok(f) => f,
        // Removed, or being torn down (its last user closed it with
        // autoclear set) while the list was read: detached.
        Err(e) if gone(&e) => return Ok(Status::Detached),
        Err(e) => return Err(io("open", device)(e)),
    };
    let mut info = LoopInfo64::zeroed();
    // SAFETY: `info` is a loop_info64 the kernel fills; the fd is open.
    match unsafe { loop_get_status64(dev.as_fd().as_raw_fd(), &mut info) } {
        Ok(_) => Ok(Status::Attached(Box::new(info), number)),
        Err(nix::errno::Errno::ENXIO) => Ok(Status::Detached),
        Err(e) => Ok(Status::Unreadable(number, e)),
    }
}

/// A path in a sysfs attribute, in one read (open, read, close: this runs
/// for every loop device on every lookup). sysfs gives at most a page.
fn read_path_attribute(path: &Path) -> std::io::Result<PathBuf> {
    use std::io::Read;
    use std::os::unix::ffi::OsStrExt;
    let mut buf = [0u8; 4096];
    let n = File::open(path)?.read(&mut buf)?;
    let text = buf[..n].strip_suffix(b"\n").unwrap_or(&buf[..n]);
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(text)))
}

/// /proc/partitions, mostly in one read. The kernel makes it afresh at
/// every read(2) by walking all its block devices (hundreds of unattached
/// loop nodes on a busy node), the read that only finds the end included.
/// A read of it stops short only at the end, at a full user buffer, or
/// when the kernel's page-sized buffer cannot take the next line; its
/// lines are under 100 bytes, so one read returning less than half a page
/// into a larger buffer has reached the end.
fn read_partitions(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    const SURELY_ALL: usize = 2048;
    let mut file = File::open(path)?;
    let mut bytes = vec![0u8; 16 << 10];
    let mut len = 0;
    loop {
        if len == bytes.len() {
            bytes.resize(len * 2, 0);
        }
        match file.read(&mut bytes[len..]) {
            Ok(0) => break,
            Ok(n) if len == 0 && n < SURELY_ALL => {
                len = n;
                break;
            }
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    bytes.truncate(len);
    String::from_utf8(bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Every attached loop device: its backing file (by path, as the kernel
/// reports it, and by identity) and its tag. /proc/partitions lists the loop
/// devices that have a size, i.e. are attached (a device over an empty file
/// has none and is not seen): one read instead of probing every
/// /sys/block/loop* node, of which a busy node has many.
pub fn list() -> Result<Vec<LoopDevice>, SysError> {
    let mut found = Vec::new();
    // A device whose status is unreadable is still listed, by its backing
    // file's path alone and with no tag (nobody's to detach by tag): one
    // broken device must not hide the others.
    for l in statuses()? {
        let name = l.device.file_name().unwrap_or_default();
        let backing = Path::new("/sys/block").join(name).join("loop/backing_file");
        let backing_file = match read_path_attribute(&backing) {
            Ok(path) => path,
            // Detached while we looked (ENOENT, ENODEV, ENXIO).
            Err(e) if gone(&e) => continue,
            Err(e) => return Err(io("read", &backing)(e)),
        };
        found.push(LoopDevice {
            device: l.device,
            backing_file,
            backing: l.backing,
            tag: l.tag,
            number: l.number,
        });
    }
    Ok(found)
}

/// The status of the one device `device`, numbered `number`; none when
/// it is not attached.
pub(super) fn status_of(device: &Path, number: Numbers) -> Result<Option<LoopStatus>, SysError> {
    Ok(match status(device, number)? {
        Status::Detached => None,
        Status::Attached(info, number) => Some(LoopStatus {
            device: device.to_path_buf(),
            backing: Some(FileId { dev: info.lo_device, ino: info.lo_inode }),
            tag: field_str(&info.lo_file_name),
            number,
        }),
        Status::Unreadable(number, e) => {
            tracing::warn!(device = %device.display(), "loop device status unreadable: {e}");
            Some(LoopStatus {
                device: device.to_path_buf(),
                backing: None,
                tag: String::new(),
                number,
            })
        }
    })
}

/// [`list`] without the backing files' paths: what a lookup by identity
/// or tag needs. The path is a sysfs read per device, which costs more
/// than its status (8 µs against 5 here), and a node with a hundred
/// volumes attached has a hundred devices to look at on every attach and
/// detach: with a hundred others attached, a CSI stage + publish took
/// 1.1–1.2 ms less this way (three runs, the two ways alternating).
pub fn statuses() -> Result<Vec<LoopStatus>, SysError> {
    let mut found = Vec::new();
    for (device, number) in sized()? {
        found.extend(status_of(&device, number)?);
    }
    found.sort_by(|a, b| a.device.cmp(&b.device));
    Ok(found)
}

/// The loop devices /proc/partitions lists (those that have a size): each
/// one's node and numbers. Their partitions (loop0p1) are left out.
fn sized() -> Result<Vec<(PathBuf, Numbers)>, SysError> {
    let partitions = Path::new("/proc/partitions");
    let text = read_partitions(partitions).map_err(io("read", partitions))?;
    let mut found = Vec::new();
    for fields in text.lines().map(|l| l.split_whitespace().collect::<Vec<_>>()) {
        let [major, minor, _, name] = fields[..] else { continue };
        let (Ok(major), Ok(minor)) = (major.parse(), minor.parse()) else { continue };
        if !name.starts_with("loop") {
            continue;
        }
        let device = PathBuf::from(format!("/dev/{name}"));
        if is_loop_path(&device) {
            found.push((device, (major, minor)));
        }
    }
    Ok(found)
}

fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        || [Some(nix::libc::ENODEV), Some(nix::libc::ENXIO)].contains(&e.raw_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loop_device_paths_are_loop_devices() {
        for ok in ["/dev/loop0", "/dev/loop12"] {
            assert!(is_loop_path(Path::new(ok)), "{ok}");
        }
        for bad in [
            "/dev/sda",
            "/dev/loop",
            "/dev/loop0p1",
            "/dev/loop/0",
            "/etc/loop0",
            "/dev/loop1/../sda",
            "/dev/loop99999999",
        ] {
            assert!(!is_loop_path(Path::new(bad)), "{bad}");
        }
    }

    #[test]
    fn the_partition_list_is_read_whole() {
        let listed = read_partitions(Path::new("/proc/partitions")).unwrap();
        assert!(listed.starts_with("major minor") && listed.ends_with('\n'), "{listed}");
        // Any length, short or over the first buffer.
        let dir = tempfile::tempdir().unwrap();
        for len in [0, 100, 40 << 10] {
            let text: String = (0..len).map(|i| if i % 50 == 49 { '\n' } else { 'x' }).collect();
            std::fs::write(dir.path().join("f"), &text).unwrap();
            assert_eq!(read_partitions(&dir.path().join("f")).unwrap(), text, "{len} bytes");
        }
    }

    #[test]
    fn names_fit_their_fields() {
        let long = "x".repeat(100);
        let f = name_field(long.as_bytes());
        assert_eq!(f[LO_NAME_SIZE - 1], 0, "always NUL-terminated");
        assert_eq!(field_str(&f).len(), LO_NAME_SIZE - 1);
        assert_eq!(field_str(&name_field(b"volagent:n1")), "volagent:n1");
    }
}
