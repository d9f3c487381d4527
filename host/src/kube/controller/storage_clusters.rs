//! StorageClusters' finalizer: on every cluster, and off once a deleted
//! one's volumes are released; meanwhile its status says which nodes still
//! hold some. Reconciled per StorageCluster on its changes and on every
//! change of an Attachment naming it; a deleted one also every
//! `--cluster-interval`, the others every `--scan-interval`.

use super::Context;
use super::retry::{ReconcileError, api_error};
use crate::kube::crds::{Attachment, CLEANUP_FINALIZER, StorageCluster, StorageClusterStatus};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use std::collections::BTreeSet;
use std::sync::Arc;

pub fn controller(ctx: &Context) -> Controller<StorageCluster> {
    Controller::new(Api::all(ctx.client.clone()), watcher::Config::default()).watches(
        Api::<Attachment>::all(ctx.client.clone()),
        watcher::Config::default(),
        |record| record.spec.storage_cluster.as_deref().map(ObjectRef::new),
    )
}

pub async fn reconcile(
    sc: Arc<StorageCluster>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let api: Api<StorageCluster> = Api::all(ctx.client.clone());
    let name = sc.name_any();
    let finalizers = sc.metadata.finalizers.clone().unwrap_or_default();
    let has = finalizers.iter().any(|f| f == CLEANUP_FINALIZER);
    if sc.metadata.deletion_timestamp.is_none() {
        if !has {
            let mut f = finalizers;
            f.push(CLEANUP_FINALIZER.to_string());
            set_finalizers(&api, &sc, f).await?;
        }
        return Ok(Action::requeue(ctx.config.scan_interval));
    }
    // Read from the API, not a watch that may lag: the finalizer must not
    // go while a record still names the cluster.
    let records = Api::<Attachment>::all(ctx.client.clone())
        .list(&Default::default())
        .await
        .map_err(api_error("the Attachments"))?
        .items;
    let pending: Vec<String> = records
        .iter()
        .filter(|r| r.spec.storage_cluster.as_deref() == Some(name.as_str()))
        .flat_map(|r| r.spec.consumers.iter().map(|c| c.node.clone()))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if pending.is_empty() {
        if has {
            let f: Vec<String> =
                finalizers.into_iter().filter(|f| f != CLEANUP_FINALIZER).collect();
            set_finalizers(&api, &sc, f).await?;
            tracing::info!(cluster = %name, "every node released the deleted cluster's volumes: finalizer removed");
        }
        return Ok(Action::await_change());
    }
    let status = StorageClusterStatus { phase: Some("Deleting".into()), pending_nodes: pending };
    if sc.status.as_ref() != Some(&status) {
        let patch = serde_json::json!({ "status": status });
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(format!("StorageCluster {name} (status)")))?;
    }
    Ok(Action::requeue(ctx.config.cluster_interval))
}

async fn set_finalizers(
    api: &Api<StorageCluster>,
    sc: &StorageCluster,
    finalizers: Vec<String>,
) -> Result<(), ReconcileError> {
    let name = sc.name_any();
    // The resourceVersion makes this a compare-and-swap: a stale view fails
    // (409) and the change it brought reconciles the cluster again.
    let patch = serde_json::json!({ "metadata": { "finalizers": finalizers, "resourceVersion": sc.metadata.resource_version } });
    match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(()),
        Err(e) => Err(api_error(format!("StorageCluster {name}"))(e)),
    }
}
