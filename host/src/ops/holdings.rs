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
/// mount there: its type, and its device.
pub fn pinned_by(
    pins: &crate::sys::pins::Pins,
    table: &[MountInfo],
    staging_dir: &str,
) -> Option<&'static str> {
    let m = table.iter().rev().find(|m| m.mount_point == std::path::Path::new(staging_dir))?;
    let device = m.source.starts_with("/dev/").then_some(m.source.as_str());
    pins.of(device, &m.fs_type)
}
