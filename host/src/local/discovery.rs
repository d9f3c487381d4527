//! Discovery of local volumes: every entry of a class's discovery dir that
//! is a volume, read-only (nothing is opened for writing, nothing mounted):
//!
//! - a mount point: a filesystem volume, sized by its filesystem;
//! - a block device node, or a symlink to one under `/dev` (an admin's
//!   `/dev/disk/by-id` link): a block volume. The link is resolved here
//!   only, and the volume records the device's stable identity, which the
//!   data path checks before it touches the device;
//! - a regular file: a file-backed block volume, for development.
//!
//! Anything else (a plain dir, a socket, a link to something that is not a
//! block device under /dev) is skipped and reported, never followed.

use super::{LocalClass, round_capacity};
use crate::sys::mountinfo::MountInfo;
use crate::sys::{Inspect, InspectedEntry};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What kind of local volume an entry is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase", tag = "mode")]
pub enum Kind {
    /// A mounted filesystem (`volumeMode: Filesystem`).
    Filesystem {
        #[serde(rename = "fsType")]
        fs_type: String,
    },
    /// A block device (`volumeMode: Block`).
    Block {
        /// The device's node under /dev, resolved at discovery.
        device: PathBuf,
        /// Its stable identity ("wwid:…", "serial:…", "loop:<backing
        /// file>", else "dev:<major>:<minor>").
        identity: String,
    },
    /// A regular file, attached as a loop device (development).
    File,
}

/// One discovered volume.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub class: String,
    /// Its path in the discovery dir (the link itself for a linked device).
    pub path: PathBuf,
    #[serde(flatten)]
    pub kind: Kind,
    /// Rounded down as the PV states it.
    pub capacity_bytes: u64,
}

/// An entry that is not a volume, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    pub path: PathBuf,
    pub why: String,
}

#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Scan {
    pub volumes: Vec<Volume>,
    pub skipped: Vec<Skipped>,
}

/// Scan every class's dirs through `node`, with the node's mount table read once.
pub fn scan(node: &dyn Inspect, classes: &[LocalClass], table: &[MountInfo]) -> Scan {
    // The last mount at a point is the one seen there.
    let mounts: BTreeMap<&Path, &MountInfo> =
        table.iter().map(|m| (m.mount_point.as_path(), m)).collect();
    let mut out = Scan::default();
    for class in classes {
        for dir in &class.dirs {
            let paths = match node.list_dir(dir) {
                Ok(paths) => paths,
                Err(e) => {
                    out.skipped
                        .push(Skipped { path: dir.clone(), why: format!("cannot list it: {e}") });
                    continue;
                }
            };
            for path in paths {
                match examine(node, &path, &mounts) {
                    Ok((kind, bytes)) => out.volumes.push(Volume {
                        class: class.name.clone(),
                        path,
                        kind,
                        capacity_bytes: round_capacity(bytes),
                    }),
                    Err(why) => out.skipped.push(Skipped { path, why }),
                }
            }
        }
    }
    out
}

fn examine(
    node: &dyn Inspect,
    path: &Path,
    mounts: &BTreeMap<&Path, &MountInfo>,
) -> Result<(Kind, u64), String> {
    if let Some(m) = mounts.get(path) {
        let bytes = node.filesystem_size(path).map_err(|e| e.to_string())?;
        return Ok((Kind::Filesystem { fs_type: m.fs_type.clone() }, bytes));
    }
    match node.entry(path).map_err(|e| e.to_string())? {
        InspectedEntry::Block { rdev } => block(node, path, rdev),
        InspectedEntry::Link => {
            // Resolved once, here, and only to a block device under /dev.
            let target =
                node.resolve(path).map_err(|e| format!("a link that does not resolve: {e}"))?;
            if !target.starts_with("/dev") {
                return Err(format!("a link to {}, which is not under /dev", target.display()));
            }
            match node.entry(&target).map_err(|e| e.to_string())? {
                InspectedEntry::Block { rdev } => block(node, &target, rdev),
                _ => Err(format!("a link to {}, which is not a block device", target.display())),
            }
        }
        InspectedEntry::File { bytes } => Ok((Kind::File, bytes)),
        InspectedEntry::Dir => Err("a dir that is not a mount point".into()),
        InspectedEntry::Other => Err("neither a mount point, a block device nor a file".into()),
    }
}

fn block(node: &dyn Inspect, device: &Path, rdev: u64) -> Result<(Kind, u64), String> {
    let (device, bytes) = node.block_node(rdev, device).map_err(|e| e.to_string())?;
    let identity = node.identity(rdev);
    Ok((Kind::Block { device, identity }, bytes))
}

/// The option a PV of a discovered block device carries its identity in.
pub const IDENTITY_OPTION: &str = "identity";

/// Check, before the data path touches it, that `device` is still the
/// device a PV was made of: a block device node under /dev (not a link)
/// whose identity is `identity`. Device numbers and by-id links move
/// between boots and hot-plugs; a wrong disk must never be mounted or wiped.
pub fn verify_device(node: &dyn Inspect, device: &Path, identity: &str) -> Result<(), String> {
    if !device.starts_with("/dev/")
        || device.components().any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(format!("{} is not a device node under /dev", device.display()));
    }
    let InspectedEntry::Block { rdev } = node.entry(device).map_err(|e| e.to_string())? else {
        return Err(format!("{} is not a block device node", device.display()));
    };
    let found = node.identity(rdev);
    if found != identity {
        return Err(format!(
            "{} is now {found}, not the volume's {identity}: the disk moved or was replaced; the agent's next discovery will publish it anew",
            device.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::inspect::Node;

    #[test]
    fn devices_are_checked_by_identity_and_links_refused() {
        assert!(
            verify_device(&Node, Path::new("/etc/hostname"), "dev:1:1")
                .unwrap_err()
                .contains("not a device node under /dev")
        );
        assert!(
            verify_device(&Node, Path::new("/dev/null"), "dev:1:3")
                .unwrap_err()
                .contains("not a block device")
        );
        assert!(verify_device(&Node, Path::new("/dev/../etc/hostname"), "x").is_err());
    }

    fn class(dir: &Path) -> Vec<LocalClass> {
        vec![LocalClass { name: "fast".into(), dirs: vec![dir.to_path_buf()] }]
    }

    #[test]
    fn files_are_volumes_and_plain_dirs_and_stray_links_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("disk1.img"), vec![0u8; 4096]).unwrap();
        std::fs::create_dir(d.join("not-mounted")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.join("to-etc")).unwrap();
        std::os::unix::fs::symlink("/dev/null", d.join("to-null")).unwrap();
        std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling")).unwrap();
        let scan = scan(&Node, &class(d), &[]);
        assert_eq!(
            scan.volumes,
            vec![Volume {
                class: "fast".into(),
                path: d.join("disk1.img"),
                kind: Kind::File,
                capacity_bytes: 4096
            }]
        );
        let why = |name: &str| {
            scan.skipped
                .iter()
                .find(|s| s.path == d.join(name))
                .map(|s| s.why.clone())
                .unwrap_or_default()
        };
        assert!(why("not-mounted").contains("not a mount point"), "{scan:?}");
        assert!(why("to-etc").contains("not under /dev"), "{scan:?}");
        assert!(why("to-null").contains("not a block device"), "{scan:?}");
        assert!(why("dangling").contains("does not resolve"), "{scan:?}");
    }

    #[test]
    fn a_mount_point_is_a_filesystem_volume_sized_by_its_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let vol = dir.path().join("vol1");
        std::fs::create_dir(&vol).unwrap();
        // The dir is not mounted; the table says it is: statvfs then reads
        // the filesystem the dir is on, which is all the scan needs.
        let table = vec![MountInfo {
            id: 1,
            parent: 0,
            device: (0, 99),
            root: "/".into(),
            mount_point: vol.clone(),
            options: "rw".into(),
            propagation: vec![],
            fs_type: "ext4".into(),
            source: "/dev/loop9".into(),
            super_options: "rw".into(),
        }];
        let scan = scan(&Node, &class(dir.path()), &table);
        assert_eq!(scan.volumes.len(), 1, "{scan:?}");
        assert_eq!(scan.volumes[0].kind, Kind::Filesystem { fs_type: "ext4".into() });
        assert!(scan.volumes[0].capacity_bytes > 0);
    }

    #[test]
    fn a_missing_dir_is_reported_not_fatal() {
        let scan = scan(&Node, &class(Path::new("/nonexistent/volagent")), &[]);
        assert!(scan.volumes.is_empty());
        assert!(scan.skipped[0].why.contains("cannot list"), "{scan:?}");
    }
}
