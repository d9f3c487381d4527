//! Read-only looks at the node for local volume discovery: what lies in a
//! discovery dir, where an admin's link leads, a filesystem's size, a block
//! device's node, size and identity. Nothing is opened for writing and
//! nothing is resolved beneath the agent's roots: discovery reports what
//! is there, and a link may lead anywhere (it is checked after).

use super::{Inspect, InspectedEntry, SysError, io};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The real node's looks: plain syscalls and sysfs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Node;

impl Inspect for Node {
    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, SysError> {
        let entries = std::fs::read_dir(dir).map_err(io("list", dir))?;
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        Ok(paths)
    }

    fn entry(&self, path: &Path) -> Result<InspectedEntry, SysError> {
        let meta = std::fs::symlink_metadata(path).map_err(io("stat", path))?;
        let ft = meta.file_type();
        Ok(if ft.is_block_device() {
            InspectedEntry::Block { rdev: meta.rdev() }
        } else if ft.is_symlink() {
            InspectedEntry::Link
        } else if ft.is_file() {
            InspectedEntry::File { bytes: meta.len() }
        } else if ft.is_dir() {
            InspectedEntry::Dir
        } else {
            InspectedEntry::Other
        })
    }

    fn resolve(&self, link: &Path) -> Result<PathBuf, SysError> {
        std::fs::canonicalize(link).map_err(io("resolve", link))
    }

    fn filesystem_size(&self, path: &Path) -> Result<u64, SysError> {
        let stat = nix::sys::statvfs::statvfs(path).map_err(super::errno("statvfs", path))?;
        Ok(stat.blocks().saturating_mul(stat.fragment_size()))
    }

    fn block_node(&self, rdev: u64, what: &Path) -> Result<(PathBuf, u64), SysError> {
        let node = super::block::devnode(rdev, what)?;
        let bytes = super::block::size_of(&node)?;
        Ok((node, bytes))
    }

    fn identity(&self, rdev: u64) -> String {
        let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
        let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
        let read = |p: &str| {
            std::fs::read_to_string(sys.join(p))
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        if let Some(w) = read("device/wwid").or_else(|| read("wwid")) {
            return format!("wwid:{w}");
        }
        if let Some(s) = read("device/serial").or_else(|| read("serial")) {
            return format!("serial:{s}");
        }
        if let Some(b) = read("loop/backing_file") {
            return format!("loop:{b}");
        }
        format!("dev:{major}:{minor}")
    }
}
