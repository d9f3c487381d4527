//! `volagent controller`: the cluster-wide half. While it holds the lease
//! it runs one kube-runtime `Controller` per kind it tends, each reconcile
//! acting on one object: it moves the consumers of vanished nodes into
//! those nodes' cleanup lists, blocklisting their storage clients at the
//! storage first (`gone_nodes`), and deletes the lists their nodes emptied
//! (`cleanup_lists`); keeps a finalizer on every StorageCluster, released
//! once no attachment record names a deleted one (`storage_clusters`);
//! makes PVs of the local volumes agents discover, asking the agents to
//! wipe released ones (`local_pvs`); and answers FenceRequests
//! (`fence_requests`). A failed reconcile is retried as `retry` says.

mod cleanup_lists;
mod fence_requests;
mod gone_nodes;
mod local_pvs;
pub mod retry;
mod storage_clusters;

pub use cleanup_lists::delete_if_empty;
pub use gone_nodes::{move_node, scan};
pub use retry::{ErrorClass, ReconcileError, api_error};

use super::lease::LeaderElector;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::controller::{self as runtime, Action, Controller};
use kube::runtime::reflector::{self, Store};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
    /// How often every record is checked against the Nodes, and every
    /// other object looked at again without a change.
    pub scan_interval: Duration,
    /// How long after a Node's deletion its records move to its cleanup
    /// list (other nodes may take its volumes over meanwhile, fencing it).
    pub gone_node_grace: Duration,
    /// How often a deleted StorageCluster is checked for release besides
    /// on every change of a record naming it.
    pub cluster_interval: Duration,
    /// How often a node's local volumes' PVs are checked besides on every
    /// change.
    pub local_interval: Duration,
}

/// What the controller's endpoints report.
#[derive(Default)]
pub struct State {
    /// This replica holds the lease.
    pub leading: AtomicBool,
    /// The last lease round reached the API server.
    pub reachable: AtomicBool,
}

/// Lead when the lease allows, work while leading; runs until cancelled.
/// More work that runs only while this replica leads (provisioning, which
/// lives above this module): made afresh each time the lease is taken.
pub type LeaderWork =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

pub async fn run(
    client: kube::Client,
    config: ControllerConfig,
    state: Arc<State>,
    more: Option<LeaderWork>,
) {
    let elector = LeaderElector::new(
        client.clone(),
        &config.namespace,
        &config.lease_name,
        &config.identity,
        config.lease_duration,
    );
    let renew = config.lease_duration / 3;
    let mut work: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let lead = match elector.try_lead().await {
            Ok(l) => {
                state.reachable.store(true, Ordering::Relaxed);
                l
            }
            Err(e) => {
                // With its causes: "client error (Connect)" alone does not say why.
                tracing::warn!("leader election: {:#}", anyhow::Error::from(e));
                state.reachable.store(false, Ordering::Relaxed);
                false
            }
        };
        match (lead, work.is_some()) {
            (true, false) => {
                tracing::info!(identity = %config.identity, "leading: controllers started");
                let more = more.as_ref().map(|m| m());
                work = Some(tokio::spawn(lead_work(client.clone(), config.clone(), more)));
            }
            (false, true) => {
                tracing::warn!(identity = %config.identity, "lost the lease: stopped");
                if let Some(w) = work.take() {
                    w.abort();
                }
            }
            _ => {}
        }
        state.leading.store(lead, Ordering::Relaxed);
        crate::metrics::get().leader.set(i64::from(lead));
        tokio::time::sleep(renew).await;
    }
}

/// What every reconcile reads.
pub struct Context {
    client: kube::Client,
    config: ControllerConfig,
    retries: retry::Retries,
    /// The Nodes as watched (a node missing here is asked of the API).
    nodes: Store<Node>,
    gone: gone_nodes::GoneNodes,
}

/// The controllers, until cancelled (the lease lost): aborting this drops
/// them, and kube-runtime aborts their reconciles with them.
async fn lead_work(
    client: kube::Client,
    config: ControllerConfig,
    more: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>,
) {
    let (nodes, writer) = reflector::store();
    let ctx = Arc::new(Context {
        client,
        config,
        retries: retry::Retries::default(),
        nodes,
        gone: gone_nodes::GoneNodes::default(),
    });
    let more = async {
        if let Some(more) = more {
            more.await;
        }
    };
    let (deleted, deletions) = tokio::sync::mpsc::channel(1);
    tokio::join!(
        gone_nodes::follow_nodes(ctx.clone(), writer, deleted),
        drive(gone_nodes::controller(&ctx, deletions), gone_nodes::reconcile, ctx.clone()),
        drive(cleanup_lists::controller(&ctx), cleanup_lists::reconcile, ctx.clone()),
        drive(storage_clusters::controller(&ctx), storage_clusters::reconcile, ctx.clone()),
        drive(local_pvs::controller(&ctx), local_pvs::reconcile, ctx.clone()),
        drive(fence_requests::controller(&ctx), fence_requests::reconcile, ctx.clone()),
        more,
    );
}

/// A reconcilers' context that counts their failures.
pub trait Retrying: Send + Sync + 'static {
    fn retries(&self) -> &retry::Retries;
}

impl Retrying for Context {
    fn retries(&self) -> &retry::Retries {
        &self.retries
    }
}

/// Run `controller` with `reconcile`, each failure retried per
/// [`retry::Retries`]; runs until cancelled.
pub async fn drive<K, C, R, F>(controller: Controller<K>, reconcile: R, ctx: Arc<C>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    C: Retrying,
    R: Fn(Arc<K>, Arc<C>) -> F + Send + 'static,
    F: Future<Output = Result<Action, ReconcileError>> + Send + 'static,
{
    let kind = K::kind(&()).to_string();
    let key = |object: &K| format!("{}/{}", K::kind(&()), object.name_any());
    controller
        .run(
            move |object, ctx: Arc<C>| {
                let key = key(&object);
                let work = reconcile(object, ctx.clone());
                async move {
                    let result = work.await;
                    if result.is_ok() {
                        ctx.retries().succeeded(&key);
                    }
                    result
                }
            },
            move |object, error, ctx| ctx.retries().failed(&key(&object), error),
            ctx,
        )
        .for_each(|result| {
            match result {
                // Logged by the error policy, with when it is retried.
                Ok(_) | Err(runtime::Error::ReconcilerFailed(..)) => {}
                // Deleted before its turn came: nothing left to do.
                Err(runtime::Error::ObjectNotFound(o)) => tracing::debug!("{kind} {o} is gone"),
                Err(e) => tracing::warn!("{kind}s: {e}"),
            }
            std::future::ready(())
        })
        .await;
}
