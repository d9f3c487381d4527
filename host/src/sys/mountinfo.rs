//! The mount table: `/proc/thread-self/mountinfo` (proc(5)) read, and parsed
//! by a pure parser tested on recorded text.

use std::path::{Path, PathBuf};

/// One line of mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    pub id: u32,
    pub parent: u32,
    /// `major:minor` of the filesystem's device.
    pub device: (u32, u32),
    /// The path within the filesystem that is mounted (`/` unless a bind of a subdir).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `nosuid`, …).
    pub options: String,
    /// Optional fields, e.g. `shared:5`, `master:1`.
    pub propagation: Vec<String>,
    pub fs_type: String,
    pub source: String,
    pub super_options: String,
}

impl MountInfo {
    pub fn read_only(&self) -> bool {
        self.options.split(',').any(|o| o == "ro")
    }
}

/// The FUSE mounts of `table` by the device their files are on, as a loop
/// device over one of those files reports it. A loop device attached by an
/// agent that is gone (its container's mount namespace with it) reports
/// its file's path only as "/<file name>"; its device still names the
/// client's mount, and needs no request to that client, which may hang.
pub fn fuse_mounts_by_device(table: &[MountInfo]) -> std::collections::BTreeMap<u64, PathBuf> {
    table
        .iter()
        .filter(|m| m.fs_type == "fuse" || m.fs_type.starts_with("fuse."))
        .map(|m| {
            let dev = nix::sys::stat::makedev(u64::from(m.device.0), u64::from(m.device.1));
            (dev, m.mount_point.clone())
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mountinfo line {line}: {reason}: {text:?}")]
pub struct ParseError {
    pub line: usize,
    pub reason: &'static str,
    pub text: String,
}

/// Parse the whole file. A malformed line is an error naming it: a mount
/// table we cannot read is not one to act on.
/// This thread's mount table (thread-self: a mount namespace may be per
/// thread; tests unshare one).
pub fn own() -> Result<Vec<MountInfo>, super::SysError> {
    let path = Path::new("/proc/thread-self/mountinfo");
    let text = super::read_proc(path).map_err(|source| super::SysError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    })?;
    Ok(parse(&text)?)
}

pub fn parse(text: &str) -> Result<Vec<MountInfo>, ParseError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            parse_line(l).map_err(|reason| ParseError { line: i + 1, reason, text: l.to_string() })
        })
        .collect()
}

fn parse_line(line: &str) -> Result<MountInfo, &'static str> {
    let (head, tail) = line.split_once(" - ").ok_or("no \" - \" separator")?;
    let mut f = head.split(' ');
    let id = f.next().and_then(|s| s.parse().ok()).ok_or("bad mount id")?;
    let parent = f.next().and_then(|s| s.parse().ok()).ok_or("bad parent id")?;
    let device = f
        .next()
        .and_then(|s| s.split_once(':'))
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .ok_or("bad major:minor")?;
    let root = PathBuf::from(unescape(f.next().ok_or("no root")?));
    let mount_point = PathBuf::from(unescape(f.next().ok_or("no mount point")?));
    let options = f.next().ok_or("no mount options")?.to_string();
    let propagation = f.map(String::from).collect();
    let mut t = tail.splitn(3, ' ');
    let fs_type = unescape(t.next().ok_or("no filesystem type")?);
    let source = unescape(t.next().ok_or("no source")?);
    let super_options = t.next().unwrap_or("").to_string();
    Ok(MountInfo {
        id,
        parent,
        device,
        root,
        mount_point,
        options,
        propagation,
        fs_type,
        source,
        super_options,
    })
}

/// The kernel escapes space, tab, newline and backslash as `\ooo`: the
/// octal of one byte, so at most `\377`; anything above is left as it is.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && (b'0'..=b'3').contains(&b[i + 1])
            && b[i + 2..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
310 27 7:3 / /var/lib/kubelet/plugins/volagent/local-pv/mounts/pv\\0401 rw,relatime shared:200 master:3 - ext4 /dev/loop3 rw
311 27 7:3 / /var/lib/kubelet/pods/u/volumes/volagent~local-pv/pv1 ro,relatime - ext4 /dev/loop3 rw
";

    #[test]
    fn a_loop_device_an_earlier_agent_attached_is_placed_on_its_fuse_mount_by_device() {
        let table = parse(
            "40 27 0:77 / /var/lib/volagent/nbd/export-1 rw - fuse.rbd-fuse rbd-fuse rw\n\
             41 27 0:78 / /var/lib/volagent/nbd/export-2 rw - fuse.volagent-nbd x rw\n\
             42 27 8:1 / /mnt/disks rw - ext4 /dev/sda1 rw\n",
        )
        .unwrap();
        let fuse = fuse_mounts_by_device(&table);
        assert_eq!(fuse.len(), 2, "FUSE mounts only: {fuse:?}");
        let over = |dev: u64| crate::sys::LoopDevice {
            device: "/dev/loop3".into(),
            backing_file: "/image-a".into(),
            backing: Some(crate::sys::FileId { dev, ino: 2 }),
            tag: String::new(),
            number: (7, 3),
        };
        let rbd_fuse = over(nix::sys::stat::makedev(0, 77));
        assert_eq!(rbd_fuse.fuse_mount(&fuse), Some(Path::new("/var/lib/volagent/nbd/export-1")));
        assert_eq!(over(nix::sys::stat::makedev(8, 1)).fuse_mount(&fuse), None);
    }

    #[test]
    fn parses_fields_escapes_and_propagation() {
        let m = parse(SAMPLE).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[1].mount_point, PathBuf::from("/"));
        assert_eq!(m[1].propagation, vec!["shared:1"]);
        assert_eq!(
            m[2].mount_point,
            PathBuf::from("/var/lib/kubelet/plugins/volagent/local-pv/mounts/pv 1")
        );
        assert_eq!(m[2].device, (7, 3));
        assert_eq!(m[2].propagation, vec!["shared:200", "master:3"]);
        assert_eq!((m[2].fs_type.as_str(), m[2].source.as_str()), ("ext4", "/dev/loop3"));
        assert!(!m[2].read_only());
        assert!(m[3].read_only());
    }

    #[test]
    fn malformed_lines_are_errors_naming_the_line() {
        let e = parse("23 27 0:22 / /sys rw\n").unwrap_err();
        assert_eq!((e.line, e.reason), (1, "no \" - \" separator"));
        let e = parse("27 1 254:0 / / rw - ext4 /dev/vda rw\nx 1 0:1 / /a rw - tmpfs t rw\n")
            .unwrap_err();
        assert_eq!((e.line, e.reason), (2, "bad mount id"));
    }

    #[test]
    fn octal_escapes_above_a_byte_are_left_as_they_are() {
        let m = parse("27 1 254:0 / /a\\777\\400\\377 rw - ext4 /dev/vda rw\n").unwrap();
        assert_eq!(m[0].mount_point.as_os_str().as_encoded_bytes(), b"/a\\777\\400\xef\xbf\xbd");
    }

    #[test]
    fn reads_this_process_mount_table() {
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let m = parse(&text).unwrap();
        assert!(m.iter().any(|e| e.mount_point == std::path::Path::new("/")));
    }
}
