//! The attach pipeline, once the volume and its consumer are known:
//! policy → devices verified → lock → fence → record + plan → mount record → execute,
//! with the record and the mount record rolled back when the steps fail.
//! Flexvolume mounts and CSI stages both run it.

use super::context::Operation;
use super::execute::{on_plan_thread, write_mounts};
use super::mount_records::MountRecord;
use super::node::Node;
use super::record::{self, LEDGER_RETRIES, ledger_failure};
use super::{Agent, Done, Failure, FailureKind, fence, internal};
use crate::exec::Outcome;
use crate::ledger::{LedgerError, VolumeSource};
use crate::model::{Consumer, NodePaths, Volume};
use crate::secret::Secrets;

impl Agent {
    /// Attach `volume` for `consumer` on this node.
    pub(crate) async fn attach(
        &self,
        backend: &str,
        volume: Volume,
        consumer: Consumer,
        secrets: Secrets,
        paths: NodePaths,
    ) -> Result<Done, Failure> {
        let mut op = Operation::new(self, backend, volume, consumer, secrets, paths)?;
        op.verify_devices(&self.node).await?;
        op.lock(&self.node)?;
        attach(&self.node, op).await
    }
}

async fn attach(node: &Node, mut op: Operation) -> Result<Done, Failure> {
    // Fence and record, retrying lost races with a fresh read.
    let source = VolumeSource::of(&op.volume);
    let mut attempt = 0;
    let held = loop {
        attempt += 1;
        let current = record::read(node, &op, &source).await?;
        let fenced = fence::decide(node, &mut op, current.as_ref().map(|(r, _)| r)).await?;
        match record::hold_and_plan(node, &op, current, fenced, source.clone()).await? {
            Ok(held) => break held,
            // A record deleted since it was read (its last holder left, or
            // the controller moved a gone node's holders) is a race lost too:
            // read it again.
            Err(e)
                if (e.is_race() || matches!(e, LedgerError::NotFound { .. }))
                    && attempt < LEDGER_RETRIES =>
            {
                continue;
            }
            Err(e) => return Err(ledger_failure(e)),
        }
    };
    let result = execute(node, &mut op, held.plan, held.since).await;
    let (volume, me) = (&op.volume, &op.consumer);
    if let Ok(outcome) = &result
        && !outcome.storage_clients.is_empty()
        && let Err(e) = record::storage_clients(node, &volume.name, &outcome.storage_clients).await
    {
        // Fencing stays safe without it: other nodes cannot place this
        // node's client, so they deny rather than take over.
        tracing::warn!(volume = %volume.name, "recording the volume's storage client failed: {}", e.message);
    }
    match result {
        Ok(outcome) => Ok(Done {
            message: format!("volume {} mounted at {}", volume.name, me.mount_dir),
            device: outcome.devices.values().next().map(|d| d.display().to_string()),
        }),
        // Leave no trace of a mount that did not happen. A failed retry of a
        // mount that had succeeded keeps its record and stash entry: its
        // earlier steps are still in place.
        Err(failure) if held.added && failure.kind != FailureKind::TimedOut => {
            roll_back(node, &op).await;
            Err(failure)
        }
        Err(failure) => Err(failure),
    }
}

/// The stash and execute steps: the entry is stashed before any step
/// runs, on the steps' own thread. A refused plan fails here.
async fn execute(
    node: &Node,
    op: &mut Operation,
    plan: Result<Vec<crate::model::Step>, Failure>,
    since: String,
) -> Result<Outcome, Failure> {
    let plan = plan?;
    let entry = MountRecord {
        volume: op.volume.clone(),
        consumer: op.consumer.clone(),
        paths: op.paths.clone(),
        since: Some(since),
    };
    let local = crate::exec::runs_locally(crate::exec::holding(&op.volume), &plan);
    let stash = node.mount_records.clone();
    on_plan_thread(node, &mut op.lock, local, op.secrets.clone(), move |exec| {
        stash.put(&entry).map_err(internal)?;
        exec.run(&plan).map_err(internal)
    })
    .await
}

/// Undo the record and the stash entry of an attach that failed.
async fn roll_back(node: &Node, op: &Operation) {
    let (volume, dir) = (&op.volume.name, &op.consumer.mount_dir);
    if let Err(e) = record::remove_holder(node, volume, dir).await {
        tracing::error!(volume = %volume, "rolling back the ledger entry failed: {}", e.message);
    }
    if let Err(e) = write_mounts(node, |s| s.remove(dir)) {
        tracing::error!(volume = %volume, "rolling back the stash entry failed: {}", e.message);
    }
}
