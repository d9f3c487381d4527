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
