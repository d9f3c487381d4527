//! Forced cleanups on this node: the volumes its agent must let go of
//! because the cluster says so — its records were moved to its cleanup
//! list while it was gone, or their storage cluster was deleted. Each
//! volume is torn down by its backend's cleanup plan in its own task, so one
//! that hangs does not hold up the others.

use super::mount_records::MountRecord;
use super::{Agent, Failure, internal};
use crate::clock::now_rfc3339;
use crate::model::{CleanupItem, CleanupReason, Holder, Step, Unmount};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// What a cleanup round did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Cleaned {
    /// Pod mount dirs released.
    pub released: Vec<String>,
    /// "<volume>: <why>" for volumes that are still held.
    pub failed: Vec<String>,
}

impl Agent {
    /// Tear down every volume with a stashed mount that `pick` selects.
    pub async fn clean_volumes(
        self: &Arc<Self>,
        reason: CleanupReason,
        pick: impl Fn(&MountRecord) -> bool,
    ) -> Result<Cleaned, Failure> {
        let entries = super::execute::read_mounts(&self.node, |s| s.all())?;
        let mut by_volume: BTreeMap<String, Vec<MountRecord>> = BTreeMap::new();
        for e in entries.into_iter().filter(|e| pick(e)) {
            by_volume.entry(e.volume.name.clone()).or_default().push(e);
        }
        let mut tasks = tokio::task::JoinSet::new();
        // Beyond the plan deadline, a task is waiting on something else
        // (the API server, a lock): give up on it for this round.
        let bound = self.node.plan_deadline + Duration::from_secs(60);
        for (volume, entries) in by_volume {
            let agent = self.clone();
            tasks.spawn(async move {
                let dirs: Vec<String> =
                    entries.iter().map(|e| e.consumer.mount_dir.clone()).collect();
                let result =
                    match tokio::time::timeout(bound, agent.clean_volume(reason, entries)).await {
                        Ok(r) => r,
                        Err(_) => Err(internal(format!("cleanup still running after {bound:?}"))),
                    };
                (volume, dirs, result)
            });
        }
        let mut done = Cleaned::default();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((_, dirs, Ok(()))) => done.released.extend(dirs),
                Ok((volume, _, Err(f))) => {
                    tracing::error!(volume, ?reason, "forced cleanup failed: {}", f.message);
                    done.failed.push(format!("{volume}: {}", f.message));
                }
                Err(e) => done.failed.push(format!("a cleanup task failed: {e}")),
            }
        }
        for dir in &done.released {
            tracing::warn!(mount_dir = %dir, ?reason, "forced cleanup released a pod's volume");
        }
        Ok(done)
    }

    /// One volume: its backend's cleanup plan for every local holder, then
    /// the holders leave the ledger and the stash.
    async fn clean_volume(
        &self,
        reason: CleanupReason,
        entries: Vec<MountRecord>,
    ) -> Result<(), Failure> {
        let Some(first) = entries.first() else { return Ok(()) };
        let volume = first.volume.clone();
        let plugin = self.plugin(&volume.backend)?;
        let mut lock = Some(super::node::lock(&self.node, &volume.name)?);
        let item = CleanupItem {
            volume: volume.clone(),
            paths: first.paths.clone(),
            holders: entries
                .iter()
                .map(|e| Holder { consumer: e.consumer.clone(), since: now_rfc3339() })
                .collect(),
        };
        let plan = plugin
            .cleanup(
                super::plan::queries(&self.node, &plugin, &[]),
                reason,
                std::slice::from_ref(&item),
            )
            .map_err(internal)?;
        // The volume's CSI publications (the host's binds into pods) go
        // first: a device stays busy while any mount of it remains.
        let publications: Vec<_> =
            self.publications().await?.into_iter().filter(|p| p.volume == volume.name).collect();
        let force = reason == CleanupReason::StorageClusterDeleted;
        let mut steps: Vec<Step> = publications
            .iter()
            .map(|p| Step::Unmount(Unmount { target: p.target.clone(), force }))
            .collect();
        steps.extend(plan);
        // Off the request path: a blocking thread, whatever the plan.
        super::execute::run_plan(&self.node, steps, false, &mut lock).await?;
        for p in publications {
            super::execute::write_mounts(&self.node, move |s| s.remove_publication(&p.target))?;
        }
        for e in entries {
            super::record::remove_holder(&self.node, &volume.name, &e.consumer.mount_dir).await?;
            let dir = e.consumer.mount_dir.clone();
            super::execute::write_mounts(&self.node, move |s| s.remove(&dir))?;
        }
        Ok(())
    }
}
