//! Local volumes' PVs (see [`crate::kube::local_pvs`]). Reconciled per
//! NodeLocalVolumes on its changes and its local PVs', and every
//! `--local-interval` (StorageClasses and hostnames are not watched).

use super::Context;
use super::retry::ReconcileError;
use crate::kube::crds::NodeLocalVolumes;
use crate::kube::local_pvs::NODE_LABEL;
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::Api;
use kube::runtime::controller::{Action, Config, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use std::sync::Arc;
use std::time::Duration;

pub fn controller(ctx: &Context) -> Controller<NodeLocalVolumes> {
    Controller::new(Api::all(ctx.client.clone()), watcher::Config::default())
        // One node at a time, each against the PVs as they are then: two
        // nodes reporting the same device cannot both get a PV for it.
        // A burst of changes (an agent's report, the PVs it leads to) is
        // one round.
        .with_config(Config::default().concurrency(1).debounce(Duration::from_millis(200)))
        .watches(
            Api::<PersistentVolume>::all(ctx.client.clone()),
            watcher::Config::default().labels(NODE_LABEL),
            |pv| {
                pv.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(NODE_LABEL))
                    .map(|n| ObjectRef::new(n))
            },
        )
}

pub async fn reconcile(
    list: Arc<NodeLocalVolumes>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let s = crate::kube::local_pvs::sync(&ctx.client, &list).await?;
    if s != Default::default() {
        tracing::info!(
            node = list.metadata.name.as_deref().unwrap_or(""),
            created = s.created.len(),
            wipes_requested = s.requested.len(),
            deleted = s.deleted.len(),
            refused = s.refused.len(),
            "local volumes"
        );
    }
    Ok(Action::requeue(ctx.config.local_interval))
}
