//! The real node: nix syscalls for mounts, ioctls for loop devices, and the
//! system's filesystem tools (there is no syscall for mkfs) with a deadline.

use super::{Devices, Filesystems, LoopDevice, MountInfo, Mounts, SysError, Wipe, errno, loopdev, mountinfo};
use nix::mount::{MntFlags, MsFlags};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Deadlines of the external tools: a hung mkfs must not hang a mount.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub probe: Duration,
    pub mkfs: Duration,
    /// Whole-device wipes (zero, shred) take as long as the device is big.
    pub wipe: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines { probe: Duration::from_secs(10), mkfs: Duration::from_secs(300), wipe: Duration::from_secs(6 * 3600) }
    }
}

#[derive(Debug, Default)]
pub struct Linux {
    pub deadlines: Deadlines,
}

/// Run `program` with `args` on `device`, killed after `deadline`. Its
/// output is captured and only shown when it fails.
fn run(program: &'static str, args: &[&str], device: &Path, deadline: Duration) -> Result<std::process::Output, SysError> {
    let mut child = Command::new(program)
        .args(args)
        .arg(device)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| SysError::Io { op: program, path: device.to_path_buf(), source })?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SysError::Timeout { program, path: device.to_path_buf(), secs: deadline.as_secs() });
            }
            Err(source) => return Err(SysError::Io { op: program, path: device.to_path_buf(), source }),
        }
    }
    // The pipes are small and the tools quiet; reading after exit is fine.
    child.wait_with_output().map_err(|source| SysError::Io { op: program, path: device.to_path_buf(), source })
}

fn check(program: &'static str, device: &Path, out: std::process::Output) -> Result<std::process::Output, SysError> {
    if out.status.success() {
        return Ok(out);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(SysError::Command {
        program,
        path: device.to_path_buf(),
        message: format!("{}: {}", out.status, stderr.trim()),
    })
}

impl Mounts for Linux {
    fn mount_table(&self) -> Result<Vec<MountInfo>, SysError> {
        // thread-self: a mount namespace may be per thread (tests unshare one).
        let path = Path::new("/proc/thread-self/mountinfo");
        // proc files report no size, so std's read grows its buffer from 32
        // bytes, a syscall per doubling; one large buffer reads it in one or two.
        let read = || -> std::io::Result<String> {
            use std::io::Read;
            let mut text = String::with_capacity(64 << 10);
            std::fs::File::open(path)?.read_to_string(&mut text)?;
            Ok(text)
        };
        let text = read().map_err(|source| SysError::Io { op: "read", path: path.to_path_buf(), source })?;
        Ok(mountinfo::parse(&text)?)
    }

    fn is_mount_point(&self, target: &Path) -> Result<Option<bool>, SysError> {
        Ok(is_mount_root(target))
    }

    fn mount(&self, source: &str, target: &Path, fs_type: &str, options: &str, read_only: bool) -> Result<(), SysError> {
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        let data = (!options.is_empty()).then_some(options);
        nix::mount::mount(Some(source), target, Some(fs_type), flags, data).map_err(errno("mount", target))
    }

    fn bind(&self, source: &Path, target: &Path, read_only: bool) -> Result<(), SysError> {
        nix::mount::mount(Some(source), target, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(errno("bind-mount onto", target))?;
        if read_only {
            // A bind mount takes its flags only on a remount.
            let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
            if let Err(e) = nix::mount::mount(None::<&str>, target, None::<&str>, flags, None::<&str>) {
                let _ = nix::mount::umount2(target, MntFlags::MNT_DETACH);
                return Err(errno("make read-only", target)(e));
            }
        }
        Ok(())
    }

    fn unmount(&self, target: &Path, force: bool) -> Result<(), SysError> {
        let flags = if force { MntFlags::MNT_FORCE | MntFlags::MNT_DETACH } else { MntFlags::empty() };
        nix::mount::umount2(target, flags).map_err(errno("unmount", target))
    }

    fn ensure_dir(&self, dir: &Path) -> Result<bool, SysError> {
        if dir.is_dir() {
            return Ok(false);
        }
        std::fs::create_dir_all(dir).map_err(|source| SysError::Io { op: "create dir", path: dir.to_path_buf(), source })?;
        Ok(true)
    }

    fn remove_dir(&self, dir: &Path) -> Result<(), SysError> {
        match std::fs::remove_dir(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(SysError::Io { op: "remove dir", path: dir.to_path_buf(), source: e })
            }
            _ => Ok(()),
        }
    }
}

impl Devices for Linux {
    fn loop_attach(&self, file: &Path, read_only: bool) -> Result<PathBuf, SysError> {
        loopdev::attach(file, read_only)
    }
    fn loop_devices(&self) -> Result<Vec<LoopDevice>, SysError> {
        loopdev::list()
    }
    fn loop_detach(&self, device: &Path) -> Result<(), SysError> {
        loopdev::detach(device)
    }
}

/// Whether `target` is the root of a mount, as statx(2) tells (Linux 5.8+),
/// in the terms of the mount table: the table lists mounts by their
/// resolved paths, so the path itself is not followed if it is a symlink,
/// and a mount seen through a symlinked dir is left to the table.
#[allow(unsafe_code)]
fn is_mount_root(target: &Path) -> Option<bool> {
    use nix::libc;
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(target.as_os_str().as_bytes()).ok()?;
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    let flags = libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT;
    // SAFETY: `path` is a NUL-terminated string and `stx` a statx buffer,
    // both live for the call.
    if unsafe { libc::statx(libc::AT_FDCWD, path.as_ptr(), flags, libc::STATX_TYPE, stx.as_mut_ptr()) } != 0 {
        return match nix::errno::Errno::last() {
            // Nothing is mounted where there is nothing.
            nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR => Some(false),
            _ => None,
        };
    }
    // SAFETY: statx succeeded, so it filled the buffer (zeroed before).
    let stx = unsafe { stx.assume_init() };
    let root = libc::STATX_ATTR_MOUNT_ROOT as u64;
    if stx.stx_attributes_mask & root == 0 {
        return None; // a kernel that does not say
    }
    if stx.stx_attributes & root == 0 {
        return Some(false);
    }
    // A mount root: listed at `target` only if that is its resolved path.
    std::fs::canonicalize(target).ok().filter(|resolved| resolved == target).map(|_| true)
}

/// How much of a device the quick probe reads: every signature blkid
/// knows for the common filesystems, partition tables, LVM, LUKS, RAID and
/// btrfs (at 64 KiB) lies within it.
const QUICK_PROBE_BYTES: usize = 128 << 10;

/// The quick answer for the two common cases of the mount path, which
/// saves running blkid (about 5 ms): a device whose first 128 KiB are all
/// zero is blank, and one with the ext4 or xfs superblock at its place is
/// that. Anything else is for blkid to tell.
fn quick_probe(device: &Path) -> Option<Option<String>> {
    use std::io::Read;
    let mut f = std::fs::File::open(device).ok()?;
    // A loop device number is reused: drop whatever an earlier user of it
    // left in the page cache, so the bytes read are the backing file's. (A
    // file's own cache is its bytes, and dropping it costs a disk read.)
    if f.metadata().is_ok_and(|m| m.file_type().is_block_device()) {
        let _ = nix::fcntl::posix_fadvise(&f, 0, QUICK_PROBE_BYTES as i64, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED);
    }
    // The superblocks recognised here sit in the first 4 KiB; the whole
    // window is read only to call a device blank.
    let mut head = vec![0u8; 4096];
    f.read_exact(&mut head).ok()?;
    // ext2/3/4: magic 0xEF53 at 1024 + 56; a journal (ext3+) and extents
    // (ext4) are features blkid would look at, so only claim ext4 when the
    // incompat "extents" flag (0x40) at 1024 + 96 is set.
    if head[1080..1082] == [0x53, 0xEF] && head[1120] & 0x40 != 0 {
        return Some(Some("ext4".to_string()));
    }
    if &head[0..4] == b"XFSB" {
        return Some(Some("xfs".to_string()));
    }
    head.resize(QUICK_PROBE_BYTES, 0);
    f.read_exact(&mut head[4096..]).ok()?;
    if head.iter().all(|b| *b == 0) {
        return Some(None);
    }
    None
}

impl Filesystems for Linux {
    fn probe(&self, device: &Path) -> Result<Option<String>, SysError> {
        if let Some(answer) = quick_probe(device) {
            return Ok(answer);
        }
        // blkid exits 2 when it finds nothing: a blank device.
        let out = run("blkid", &["-p", "-o", "export"], device, self.deadlines.probe)?;
        if out.status.code() == Some(2) {
            return Ok(None);
        }
        let out = check("blkid", device, out)?;
        let text = String::from_utf8_lossy(&out.stdout);
        let field = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)).map(str::to_string);
        Ok(field("TYPE=").or_else(|| field("PTTYPE=")).or_else(|| Some("unknown signature".to_string())))
    }

    fn probe_attached(&self, device: &Path, file: &Path) -> Result<Option<String>, SysError> {
        // The device is the file rounded down to whole sectors: the same
        // bytes, and the same size for probes that look at the end, when the
        // file is whole sectors.
        match std::fs::metadata(file) {
            Ok(m) if m.len() % 512 == 0 => self.probe(file),
            _ => self.probe(device),
        }
    }

    fn mkfs(&self, device: &Path, fs_type: &str) -> Result<(), SysError> {
        let (program, args): (&'static str, &[&str]) = match fs_type {
            "ext4" => ("mkfs.ext4", &["-F", "-q", "-E", "lazy_itable_init=1,lazy_journal_init=1"]),
            "xfs" => ("mkfs.xfs", &["-f", "-q"]),
            other => {
                return Err(SysError::Refused { path: device.to_path_buf(), what: format!("no mkfs for filesystem {other:?}") });
            }
        };
        check(program, device, run(program, args, device, self.deadlines.mkfs)?).map(drop)
    }

    fn wipe(&self, device: &Path, method: Wipe) -> Result<(), SysError> {
        let d = self.deadlines.wipe;
        match method {
            Wipe::Signatures => check("wipefs", device, run("wipefs", &["-a", "-q"], device, d)?),
            Wipe::Discard => check("blkdiscard", device, run("blkdiscard", &["-f"], device, d)?),
            Wipe::Zero => check("blkdiscard", device, run("blkdiscard", &["-f", "-z"], device, d)?),
            Wipe::Shred(passes) => {
                let n = passes.to_string();
                check("shred", device, run("shred", &["-n", &n, "-z"], device, d)?)
            }
        }
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(bytes: &[(usize, &[u8])]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        for (at, b) in bytes {
            std::os::unix::fs::FileExt::write_all_at(f.as_file(), b, *at as u64).unwrap();
        }
        f
    }

    #[test]
    fn quick_probe_knows_blank_ext4_and_xfs_and_defers_the_rest() {
        assert_eq!(quick_probe(image(&[]).path()), Some(None));
        assert_eq!(quick_probe(image(&[(1080, &[0x53, 0xEF]), (1120, &[0x40])]).path()), Some(Some("ext4".into())));
        assert_eq!(quick_probe(image(&[(0, b"XFSB")]).path()), Some(Some("xfs".into())));
        // ext2 (no extents), a GPT, LUKS, stray bytes: blkid decides.
        assert_eq!(quick_probe(image(&[(1080, &[0x53, 0xEF])]).path()), None);
        assert_eq!(quick_probe(image(&[(512, b"EFI PART")]).path()), None);
        assert_eq!(quick_probe(image(&[(0, b"LUKS\xba\xbe")]).path()), None);
        assert_eq!(quick_probe(image(&[(100_000, b"x")]).path()), None);
        // Too small to hold 128 KiB: blkid decides.
        let small = tempfile::NamedTempFile::new().unwrap();
        assert_eq!(quick_probe(small.path()), None);
    }

    #[test]
    fn mount_roots_as_the_mount_table_lists_them() {
        assert_eq!(is_mount_root(Path::new("/")), Some(true));
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(is_mount_root(dir.path()), Some(false));
        assert_eq!(is_mount_root(&dir.path().join("missing")), Some(false));
        // The table lists resolved paths: a symlink is not a mount point,
        // and a mount seen through one is for the table to tell.
        let link = dir.path().join("root");
        std::os::unix::fs::symlink("/", &link).unwrap();
        assert_eq!(is_mount_root(&link), Some(false));
        let table = Linux::default().mount_table().unwrap();
        let visible = table.iter().rev().map(|m| m.mount_point.clone()).find(|p| p != Path::new("/") && p.is_dir()).unwrap();
        let through_link = link.join(visible.strip_prefix("/").unwrap());
        assert!(matches!(is_mount_root(&through_link), None | Some(false)), "{}", through_link.display());
        // Every mount the table lists at a resolved path that is visible
        // (not covered by a later mount) is seen as one.
        for (i, m) in table.iter().enumerate() {
            let covered = table[i + 1..].iter().any(|later| m.mount_point.starts_with(&later.mount_point));
            if !covered && std::fs::canonicalize(&m.mount_point).is_ok_and(|r| r == m.mount_point) {
                assert_eq!(is_mount_root(&m.mount_point), Some(true), "{}", m.mount_point.display());
            }
        }
    }

    #[test]
    fn quick_probe_agrees_with_mkfs() {
        for (fs, args, size) in [("ext4", &["-F", "-q"][..], 64u64 << 20), ("xfs", &["-f", "-q"][..], 320 << 20)] {
            let f = tempfile::NamedTempFile::new().unwrap();
            f.as_file().set_len(size).unwrap();
            let ok = Command::new(format!("mkfs.{fs}")).args(args).arg(f.path()).status().unwrap().success();
            assert!(ok, "mkfs.{fs}");
            assert_eq!(quick_probe(f.path()), Some(Some(fs.to_string())), "{fs}");
        }
    }
}
