//! FenceRequests (see [`crate::kube::fencing`]): answered as they come,
//! deleted once answered long ago. Reconciled per request on its changes,
//! and when an answered one is due to go.

use super::Context;
use super::retry::ReconcileError;
use crate::kube::crds::FenceRequest;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use std::sync::Arc;

pub fn controller(ctx: &Context) -> Controller<FenceRequest> {
    Controller::new(Api::all(ctx.client.clone()), watcher::Config::default())
}

pub async fn reconcile(
    request: Arc<FenceRequest>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    Ok(match crate::kube::fencing::tend(&ctx.client, &request).await? {
        Some(after) => Action::requeue(after),
        None => Action::await_change(),
    })
}
