//! Nodes gone from the API: their consumers move from the Attachments into
//! the nodes' cleanup lists, their storage clients fenced first. Reconciled
//! per Attachment: when it changes, after every Node deletion (then once
//! `--gone-node-grace` has passed), and every `--scan-interval`.

use super::Context;
use super::retry::{ReconcileError, api_error};
use crate::kube::crds::{Attachment, CleanupEntry, CleanupReason, NodeCleanup, NodeCleanupSpec};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams, Preconditions};
use kube::runtime::controller::{Action, Config, Controller};
use kube::runtime::reflector::{ObjectRef, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedMutexGuard, mpsc};

/// Records reconciled at once: at start every record is, and each one
/// whose node is gone may wait on the storage to fence.
const AT_ONCE: u16 = 16;

/// What this leader saw of Node deletions, and whose moves run.
#[derive(Default)]
pub struct GoneNodes {
    /// When each Node's deletion was seen: its records wait out the grace
    /// from then. A node gone before this leader started has none.
    deleted: Mutex<HashMap<String, Instant>>,
    /// One move per node at a time: they append to the same cleanup list.
    moving: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl GoneNodes {
    fn deleted(&self, node: &str) {
        let mut deleted = self.deleted.lock().unwrap_or_else(PoisonError::into_inner);
        deleted.entry(node.to_string()).or_insert_with(Instant::now);
    }

    fn registered(&self, node: &str) {
        self.deleted.lock().unwrap_or_else(PoisonError::into_inner).remove(node);
    }

    /// How long `node`'s records still wait; None when they need not.
    fn grace_left(&self, node: &str, grace: Duration) -> Option<Duration> {
        let mut deleted = self.deleted.lock().unwrap_or_else(PoisonError::into_inner);
        let left = grace.checked_sub(deleted.get(node)?.elapsed()).filter(|l| !l.is_zero());
        if left.is_none() {
            deleted.remove(node);
        }
        left
    }

    async fn turn(&self, node: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut moving = self.moving.lock().unwrap_or_else(PoisonError::into_inner);
            moving.entry(node.to_string()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

/// The Attachments' controller; `deletions` has every record looked at.
pub fn controller(ctx: &Context, deletions: mpsc::Receiver<()>) -> Controller<Attachment> {
    Controller::new(Api::all(ctx.client.clone()), watcher::Config::default())
        .with_config(Config::default().concurrency(AT_ONCE))
        .reconcile_all_on(tokio_stream::wrappers::ReceiverStream::new(deletions))
}

/// Keep the Nodes' store and note their deletions, sending on `deletions`
/// after each. Runs until cancelled.
pub async fn follow_nodes(ctx: Arc<Context>, writer: Writer<Node>, deletions: mpsc::Sender<()>) {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let events = watcher(nodes, watcher::Config::default()).default_backoff().reflect(writer);
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Delete(node)) => {
                ctx.gone.deleted(&node.name_any());
                // Full means a round is pending: it sees this deletion too.
                let _ = deletions.try_send(());
            }
            Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => {
                ctx.gone.registered(&node.name_any());
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("watching Nodes: {e}"),
        }
    }
}

/// Move the consumers of `record` whose nodes are gone (and past their
/// grace); look again when the next grace ends, or at the next scan.
pub async fn reconcile(
    record: Arc<Attachment>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    // Until the Nodes are listed every node would look gone. (A store whose
    // watch ended is asked anyway: the API confirms every absence.)
    let _ = ctx.nodes.wait_until_ready().await;
    let volume = record.name_any();
    let nodes: BTreeSet<&str> = record.spec.consumers.iter().map(|c| c.node.as_str()).collect();
    let mut next = ctx.config.scan_interval;
    let records: Api<Attachment> = Api::all(ctx.client.clone());
    for node in nodes {
        if ctx.nodes.get(&ObjectRef::new(node)).is_some() {
            continue;
        }
        // The store may not have a node that just registered yet.
        let found = Api::<Node>::all(ctx.client.clone())
            .get_opt(node)
            .await
            .map_err(api_error(format!("Node {node}")))?;
        if found.is_some() {
            continue;
        }
        if let Some(left) = ctx.gone.grace_left(node, ctx.config.gone_node_grace) {
            next = next.min(left);
            continue;
        }
        let _turn = ctx.gone.turn(node).await;
        // The store's copy may predate a take-over or an earlier move.
        let Some(fresh) =
            records.get_opt(&volume).await.map_err(api_error(format!("Attachment {volume}")))?
        else {
            return Ok(Action::await_change());
        };
        let moved = move_consumers(&ctx.client, &records, &fresh, node).await?;
        if moved > 0 {
            tracing::warn!(%volume, %node, moved, "the node is gone: its consumers moved to its cleanup list");
        }
    }
    Ok(Action::requeue(next))
}

/// One pass over every record as the reconciles make it, grace aside, and
/// the emptied cleanup lists deleted; how many consumers moved.
pub async fn scan(client: &kube::Client) -> anyhow::Result<usize> {
    let nodes: BTreeSet<String> = Api::<Node>::all(client.clone())
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    let records = Api::<Attachment>::all(client.clone()).list(&Default::default()).await?.items;
    let gone: BTreeSet<String> = records
        .iter()
        .flat_map(|r| r.spec.consumers.iter().map(|c| c.node.clone()))
        .filter(|n| !nodes.contains(n))
        .collect();
    let mut moved = 0;
    for node in gone {
        moved += move_node(client, &node).await?;
    }
    for list in Api::<NodeCleanup>::all(client.clone()).list(&Default::default()).await?.items {
        super::cleanup_lists::delete_if_empty(client, &list).await?;
    }
    Ok(moved)
}

/// Move every consumer on `node` from the records into the node's cleanup
/// list; how many moved. A record whose clients could not all be fenced
/// stays as it is (logged).
pub async fn move_node(client: &kube::Client, node: &str) -> anyhow::Result<usize> {
    let records: Api<Attachment> = Api::all(client.clone());
    let mut moved = 0;
    for record in records.list(&Default::default()).await?.items {
        match move_consumers(client, &records, &record, node).await {
            Ok(n) => moved += n,
            Err(e @ ReconcileError::NotFenced { .. }) => tracing::error!("{e}"),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(moved)
}

/// Move the consumers on `node` of `record` (as just read) into the node's
/// cleanup list: appended there first, then removed from the record, so a
/// crash in between leaves a duplicate (skipped next time), never a loss.
async fn move_consumers(
    client: &kube::Client,
    records: &Api<Attachment>,
    record: &Attachment,
    node: &str,
) -> Result<usize, ReconcileError> {
    let mine: Vec<_> = record.spec.consumers.iter().filter(|c| c.node == node).cloned().collect();
    if mine.is_empty() {
        return Ok(0);
    }
    let volume = record.name_any();
    let now = crate::clock::now_rfc3339();
    let entries: Vec<CleanupEntry> = mine
        .iter()
        .map(|c| CleanupEntry {
            volume: volume.clone(),
            backend: record.spec.backend.clone(),
            access_mode: record.spec.access_mode,
            storage_cluster: record.spec.storage_cluster.clone(),
            consumer: c.clone(),
            reason: CleanupReason::NodeGone,
            moved_at: now.clone(),
        })
        .collect();
    // Its storage clients are cut off at the storage first: a node that
    // vanished from the API may still run and write (partitioned). A
    // record whose clients could not all be fenced stays as it is, so
    // that another node's take-over (which asks for the fencing again)
    // still sees who holds it.
    let fenced = fence_clients(client, record, node).await;
    let theirs = record.spec.storage_clients.iter().filter(|c| c.node == node).count();
    if fenced.len() < theirs {
        return Err(ReconcileError::NotFenced { volume, node: node.into() });
    }
    append_cleanup(client, node, entries).await?;
    remove_consumers(records, &volume, node, &fenced).await?;
    Ok(mine.len())
}

async fn append_cleanup(
    client: &kube::Client,
    node: &str,
    entries: Vec<CleanupEntry>,
) -> Result<(), ReconcileError> {
    let api: Api<NodeCleanup> = Api::all(client.clone());
    let object = format!("NodeCleanup {node}");
    for _ in 0..10 {
        let result = match api.get_opt(node).await.map_err(api_error(&object))? {
            None => {
                let list = NodeCleanup {
                    metadata: ObjectMeta { name: Some(node.into()), ..Default::default() },
                    spec: NodeCleanupSpec { entries: entries.clone() },
                };
                api.create(&PostParams::default(), &list).await.map(drop)
            }
            Some(mut list) => {
                let known: BTreeSet<(String, String)> = list
                    .spec
                    .entries
                    .iter()
                    .map(|e| (e.volume.clone(), e.consumer.mount_dir.clone()))
                    .collect();
                let new: Vec<CleanupEntry> = entries
                    .iter()
                    .filter(|e| !known.contains(&(e.volume.clone(), e.consumer.mount_dir.clone())))
                    .cloned()
                    .collect();
                if new.is_empty() {
                    return Ok(());
                }
                list.spec.entries.extend(new);
                api.replace(node, &PostParams::default(), &list).await.map(drop)
            }
        };
        match result {
            Ok(()) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(api_error(&object)(e)),
        }
    }
    Err(ReconcileError::KeepsChanging { object })
}

/// Blocklist `node`'s storage clients of `record` at its StorageCluster
/// (and break the locks they held); the ids of those fenced. One that
/// could not be stays recorded, so other nodes keep placing its watcher on
/// the gone node and deny (or take over with fencing) rather than write
/// beside it.
async fn fence_clients(client: &kube::Client, record: &Attachment, node: &str) -> Vec<i64> {
    let volume = record.name_any();
    let mut fenced = Vec::new();
    for c in record.spec.storage_clients.iter().filter(|c| c.node == node) {
        match crate::kube::fencing::fence(client, record, &c.address).await {
            Ok(done) => {
                tracing::warn!(%volume, %node, "the gone node's storage client: {done}");
                fenced.push(c.id);
            }
            Err(e) => {
                tracing::error!(%volume, %node, "cannot fence the gone node's storage client: {e}");
            }
        }
    }
    fenced
}

async fn remove_consumers(
    api: &Api<Attachment>,
    volume: &str,
    node: &str,
    fenced: &[i64],
) -> Result<(), ReconcileError> {
    let object = format!("Attachment {volume}");
    for _ in 0..10 {
        let Some(mut record) = api.get_opt(volume).await.map_err(api_error(&object))? else {
            return Ok(());
        };
        let before = record.spec.consumers.len();
        record.spec.consumers.retain(|c| c.node != node);
        if record.spec.consumers.len() == before {
            return Ok(());
        }
        record.spec.storage_clients.retain(|c| !(c.node == node && fenced.contains(&c.id)));
        let result = if record.spec.consumers.is_empty() {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: record.metadata.resource_version.clone(),
                    uid: None,
                }),
                ..Default::default()
            };
            api.delete(volume, &dp).await.map(drop)
        } else {
            api.replace(volume, &PostParams::default(), &record).await.map(drop)
        };
        match result {
            Ok(()) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
            Err(e) => return Err(api_error(&object)(e)),
        }
    }
    Err(ReconcileError::KeepsChanging { object })
}
