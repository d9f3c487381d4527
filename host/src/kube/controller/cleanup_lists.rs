//! Cleanup lists the nodes emptied: an agent takes the entries it worked
//! off out of its list but may not delete it, so the list goes here once
//! it is empty. Reconciled per NodeCleanup on every change, and every
//! `--scan-interval`.

use super::Context;
use super::retry::{ReconcileError, api_error};
use crate::kube::crds::NodeCleanup;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use std::sync::Arc;

pub fn controller(ctx: &Context) -> Controller<NodeCleanup> {
    Controller::new(Api::all(ctx.client.clone()), watcher::Config::default())
}

pub async fn reconcile(
    list: Arc<NodeCleanup>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    if delete_if_empty(&ctx.client, &list).await? {
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(ctx.config.scan_interval))
}

/// Delete cleanup list `list` when it holds no entry, as read: an entry
/// the controller appends meanwhile makes the delete fail (Conflict) and
/// keeps the list.
pub async fn delete_if_empty(
    client: &kube::Client,
    list: &NodeCleanup,
) -> Result<bool, ReconcileError> {
    if !list.spec.entries.is_empty() || list.metadata.deletion_timestamp.is_some() {
        return Ok(false);
    }
    let name = list.name_any();
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: list.metadata.resource_version.clone(),
            uid: list.metadata.uid.clone(),
        }),
        ..Default::default()
    };
    match Api::<NodeCleanup>::all(client.clone()).delete(&name, &dp).await {
        Ok(_) => {
            tracing::info!(node = %name, "the node worked off its cleanup list: list deleted");
            Ok(true)
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(false),
        Err(e) => Err(api_error(format!("NodeCleanup {name}"))(e)),
    }
}
