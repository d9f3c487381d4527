//! What the node holds, as the status reports it: the ledger's records of
//! this node's pods (the ledger, not the stash: it is what other nodes
//! fence against) and the mount table, to tell the device at each staging
//! dir.

use super::execute::blocking;
use super::record::ledger_failure;
use super::{Agent, Failure};
use crate::ledger::Record;
use crate::sys::MountInfo;

impl Agent {
    /// The records holding this node's pods, and the node's mount table
    /// (empty when it cannot be read: the volumes are still listed).
    pub async fn held_records(&self) -> Result<(Vec<Record>, Vec<MountInfo>), Failure> {
        let records =
            self.node.ledger.list_by_node(&self.node.config.node).await.map_err(ledger_failure)?;
        let sys = self.node.sys.clone();
        let table = blocking(move || sys.mounts.mount_table()).await?.unwrap_or_else(|e| {
            tracing::warn!("status: devices left out, the mount table cannot be read: {e}");
            Vec::new()
        });
        Ok((records.into_iter().map(|(r, _)| r).collect(), table))
    }

    /// Which of this node's devices pin the pod serving them ([`crate::sys::pins`]).
    pub async fn pins(&self) -> crate::sys::pins::Pins {
        let sys = self.node.sys.clone();
        blocking(move || sys.pins()).await.unwrap_or_default()
    }

    /// This node's mounted volumes that pin the pod serving them, as
    /// `backend/volume (what serves it)`, sorted.
    pub async fn pinned_volumes(&self) -> Result<Vec<String>, Failure> {
        let (records, table) = self.held_records().await?;
        let pins = self.pins().await;
        let node = &self.node.config.node;
        let mut pinned: Vec<String> = records
            .iter()
            .filter(|r| r.on_node(node).next().is_some())
            .filter_map(|r| {
                let by = pinned_by(&pins, &table, &self.staging_dir_of(r))?;
                Some(format!("{}/{} ({by})", r.backend, r.volume))
            })
            .collect();
        pinned.sort();
        Ok(pinned)
    }

    /// Where `record`'s volume is staged on this node: a CSI stage's
    /// staging dir is kubelet's, the stage's own mount dir.
    pub fn staging_dir_of(&self, r: &Record) -> String {
        r.on_node(&self.node.config.node)
            .find(|h| {
                h.consumer.pod_namespace == super::csi::STAGE_NAMESPACE
                    && h.consumer.pod == super::csi::STAGE_POD
            })
            .map(|h| h.consumer.mount_dir.clone())
            .unwrap_or_else(|| self.node.config.paths(&r.backend, &r.volume).staging_dir)
    }
}

/// What pins the pod serving the volume staged at `staging_dir`, by the
/// mounts there or just beneath (a CSI block stage binds the device node
/// to a file in its dir): their type, and their device.
pub fn pinned_by(
    pins: &crate::sys::pins::Pins,
    table: &[MountInfo],
    staging_dir: &str,
) -> Option<&'static str> {
    let dir = std::path::Path::new(staging_dir);
    table
        .iter()
        .rev()
        .filter(|m| m.mount_point == dir || m.mount_point.parent() == Some(dir))
        .find_map(|m| {
            let device = if m.source.starts_with("/dev/") {
                Some(m.source.clone())
            } else if m.fs_type == "devtmpfs" {
                // A bind of a device node: its path within /dev.
                Some(format!("/dev{}", m.root.display()))
            } else {
                None
            };
            pins.of(device.as_deref(), &m.fs_type)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::pins::{GLUSTERFS, Pins, RBD_FUSE};
    use std::path::PathBuf;

    fn mount(at: &str, root: &str, fs_type: &str, source: &str) -> MountInfo {
        MountInfo {
            id: 1,
            parent: 0,
            device: (0, 0),
            root: PathBuf::from(root),
            mount_point: PathBuf::from(at),
            options: "rw".into(),
            propagation: vec![],
            fs_type: fs_type.into(),
            source: source.into(),
            super_options: String::new(),
        }
    }

    #[test]
    fn a_volume_is_pinned_by_its_mounts_device_or_type_or_a_block_stages_device_node() {
        let pins = Pins::of_devices(&[("/dev/loop3", RBD_FUSE), ("/dev/loop4", RBD_FUSE)]);
        let table = [
            mount("/s/fs", "/", "ext4", "/dev/loop3"),
            mount("/s/gluster", "/", "fuse.glusterfs", "host:/v0"),
            // A CSI block stage: the device node bound to a file in its dir.
            mount("/s/block/pv-b", "/loop4", "devtmpfs", "udev"),
            mount("/s/free", "/", "ext4", "/dev/loop5"),
        ];
        assert_eq!(pinned_by(&pins, &table, "/s/fs"), Some(RBD_FUSE));
        assert_eq!(pinned_by(&pins, &table, "/s/gluster"), Some(GLUSTERFS));
        assert_eq!(pinned_by(&pins, &table, "/s/block"), Some(RBD_FUSE));
        assert_eq!(pinned_by(&pins, &table, "/s/free"), None);
        assert_eq!(pinned_by(&pins, &table, "/s/none"), None);
    }
}
