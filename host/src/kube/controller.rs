//! `volagent controller`: the cluster-wide half. While it holds the lease
//! it moves the attachments of vanished nodes into those nodes' cleanup
//! lists (a periodic scan, and at once on a Node deletion), blocklisting
//! their storage clients at the storage first, and keeps a
//! finalizer on every StorageCluster, released once no attachment record
//! names a deleted one; and makes PVs of the local volumes agents discover,
//! asking the agents to wipe released ones (see `local_pvs`).

use super::crds::{
    Attachment, CLEANUP_FINALIZER, CleanupEntry, CleanupReason, NodeCleanup, NodeCleanupSpec,
    StorageCluster, StorageClusterStatus,
};
use super::lease::LeaderElector;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
    /// How often every record is checked against the Nodes.
    pub scan_interval: Duration,
    /// How long after a Node's deletion its records move to its cleanup
    /// list (other nodes may take its volumes over meanwhile, fencing it).
    pub gone_node_grace: Duration,
    /// How often deleted StorageClusters are checked for release.
    pub cluster_interval: Duration,
    /// How often local volumes' PVs are checked besides on every change.
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
pub async fn run(client: kube::Client, config: ControllerConfig, state: Arc<State>) {
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
                tracing::info!(identity = %config.identity, "leading: started scanning");
                work = Some(tokio::spawn(lead_work(client.clone(), config.clone())));
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

async fn lead_work(client: kube::Client, config: ControllerConfig) {
    let scan = {
        let client = client.clone();
        async move {
            loop {
                match scan(&client).await {
                    Ok(moved) if moved > 0 => tracing::warn!(
                        moved,
                        "scan moved attachments of vanished nodes to their cleanup lists"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::error!("scan: {e:#}"),
                }
                tokio::time::sleep(config.scan_interval).await;
            }
        }
    };
    let deletions = {
        let client = client.clone();
        async move {
            let nodes: Api<Node> = Api::all(client.clone());
            let mut events = watcher(nodes, watcher::Config::default()).default_backoff().boxed();
            while let Some(event) = events.next().await {
                if let Ok(watcher::Event::Delete(node)) = event {
                    let (name, client, grace) = (
                        node.metadata.name.unwrap_or_default(),
                        client.clone(),
                        config.gone_node_grace,
                    );
                    tokio::spawn(async move {
                        tokio::time::sleep(grace).await;
                        // Registered again meanwhile: not gone.
                        if let Ok(Some(_)) = Api::<Node>::all(client.clone()).get_opt(&name).await {
                            return;
                        }
                        match move_node(&client, &name).await {
                            Ok(moved) => {
                                tracing::warn!(node = %name, moved, "Node deleted: its attachments moved to its cleanup list");
                            }
                            Err(e) => {
                                tracing::error!(node = %name, "moving a deleted node's attachments: {e:#} (the next scan retries)");
                            }
                        }
                    });
                }
            }
        }
    };
    let clusters = {
        let client = client.clone();
        async move {
            loop {
                if let Err(e) = storage_clusters(&client).await {
                    tracing::error!("storage clusters: {e:#}");
                }
                tokio::time::sleep(config.cluster_interval).await;
            }
        }
    };
    let local = {
        let client = client.clone();
        async move {
            let lists = watcher(
                Api::<super::crds::NodeLocalVolumes>::all(client.clone()),
                watcher::Config::default(),
            )
            .default_backoff()
            .map(|_| ());
            let pvs = watcher(
                Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(client.clone()),
                watcher::Config::default().labels(super::local_pvs::NODE_LABEL),
            )
            .default_backoff()
            .map(|_| ());
            let mut changes = futures_util::stream::select(lists, pvs).boxed();
            loop {
                match super::local_pvs::sync(&client).await {
                    Ok(s) if s != Default::default() => tracing::info!(
                        created = s.created.len(),
                        wipes_requested = s.requested.len(),
                        deleted = s.deleted.len(),
                        refused = s.refused.len(),
                        "local volumes"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::error!("local volumes: {e:#}"),
                }
                let _ = tokio::time::timeout(config.local_interval, changes.next()).await;
                while let Ok(Some(())) =
                    tokio::time::timeout(Duration::from_millis(200), changes.next()).await
                {
                }
            }
        }
    };
    let emptied = {
        let client = client.clone();
        async move {
            // An agent takes the entries it worked off out of its list but
            // may not delete it: the list goes here once it is empty.
            let lists =
                watcher(Api::<NodeCleanup>::all(client.clone()), watcher::Config::default())
                    .default_backoff()
                    .applied_objects();
            let mut lists = std::pin::pin!(lists);
            while let Some(list) = lists.next().await {
                if let Ok(list) = list
                    && let Err(e) = delete_if_empty(&client, &list).await
                {
                    tracing::error!(
                        node = list.metadata.name.as_deref().unwrap_or(""),
                        "deleting an emptied cleanup list: {e:#}"
                    );
                }
            }
        }
    };
    tokio::join!(scan, deletions, clusters, local, emptied, super::fencing::serve(client.clone()));
}

/// Delete cleanup list `list` when it holds no entry, as read: an entry
/// the controller appends meanwhile makes the delete fail (Conflict) and
/// keeps the list.
pub async fn delete_if_empty(client: &kube::Client, list: &NodeCleanup) -> anyhow::Result<bool> {
    if !list.spec.entries.is_empty() || list.metadata.deletion_timestamp.is_some() {
        return Ok(false);
    }
    let name = list.metadata.name.clone().unwrap_or_default();
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
        Err(e) => Err(e.into()),
    }
}

/// Move the consumers on nodes that no longer exist, and delete the
/// cleanup lists their nodes emptied; how many consumers moved.
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
        delete_if_empty(client, &list).await?;
    }
    Ok(moved)
}

/// Move every consumer on `node` from the records into the node's cleanup
/// list: appended there first, then removed from the record, so a crash in
/// between leaves a duplicate (skipped next time), never a loss.
pub async fn move_node(client: &kube::Client, node: &str) -> anyhow::Result<usize> {
    let records: Api<Attachment> = Api::all(client.clone());
    let mut moved = 0;
    for record in records.list(&Default::default()).await?.items {
        let mine: Vec<_> =
            record.spec.consumers.iter().filter(|c| c.node == node).cloned().collect();
        if mine.is_empty() {
            continue;
        }
        let volume = record.metadata.name.clone().unwrap_or_default();
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
        // still sees who holds it; the next scan tries again.
        let fenced = fence_clients(client, &record, node).await;
        let theirs = record.spec.storage_clients.iter().filter(|c| c.node == node).count();
        if fenced.len() < theirs {
            tracing::error!(%volume, %node, "the gone node's storage clients are not all fenced: its records stay until they are");
            continue;
        }
        append_cleanup(client, node, entries).await?;
        remove_consumers(&records, &volume, node, &fenced).await?;
        moved += mine.len();
    }
    Ok(moved)
}

async fn append_cleanup(
    client: &kube::Client,
    node: &str,
    entries: Vec<CleanupEntry>,
) -> anyhow::Result<()> {
    let api: Api<NodeCleanup> = Api::all(client.clone());
    for _ in 0..10 {
        let result = match api.get_opt(node).await? {
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
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("cleanup list {node} keeps changing")
}

/// Blocklist `node`'s storage clients of `record` at its StorageCluster
/// (and break the locks they held); the ids of those fenced. One that
/// could not be stays recorded, so other nodes keep placing its watcher on
/// the gone node and deny (or take over with fencing) rather than write
/// beside it.
async fn fence_clients(client: &kube::Client, record: &Attachment, node: &str) -> Vec<i64> {
    let volume = record.metadata.name.clone().unwrap_or_default();
    let mut fenced = Vec::new();
    for c in record.spec.storage_clients.iter().filter(|c| c.node == node) {
        match super::fencing::fence(client, record, &c.address).await {
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
) -> anyhow::Result<()> {
    for _ in 0..10 {
        let Some(mut record) = api.get_opt(volume).await? else { return Ok(()) };
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
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("attachment record {volume} keeps changing")
}

/// Finalizers on, and off once a deleted cluster's volumes are released;
/// the status says which nodes still hold some.
pub async fn storage_clusters(client: &kube::Client) -> anyhow::Result<()> {
    let api: Api<StorageCluster> = Api::all(client.clone());
    let records = Api::<Attachment>::all(client.clone()).list(&Default::default()).await?.items;
    let mut holders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in &records {
        if let Some(c) = &r.spec.storage_cluster {
            holders
                .entry(c.clone())
                .or_default()
                .extend(r.spec.consumers.iter().map(|c| c.node.clone()));
        }
    }
    for sc in api.list(&Default::default()).await?.items {
        let name = sc.metadata.name.clone().unwrap_or_default();
        let finalizers = sc.metadata.finalizers.clone().unwrap_or_default();
        let has = finalizers.iter().any(|f| f == CLEANUP_FINALIZER);
        let pending: Vec<String> =
            holders.get(&name).map(|s| s.iter().cloned().collect()).unwrap_or_default();
        if sc.metadata.deletion_timestamp.is_none() {
            if !has {
                let mut f = finalizers.clone();
                f.push(CLEANUP_FINALIZER.to_string());
                set_finalizers(&api, &sc, f).await?;
            }
            continue;
        }
        if pending.is_empty() {
            if has {
                let f: Vec<String> =
                    finalizers.into_iter().filter(|f| f != CLEANUP_FINALIZER).collect();
                set_finalizers(&api, &sc, f).await?;
                tracing::info!(cluster = %name, "every node released the deleted cluster's volumes: finalizer removed");
            }
        } else {
            let status =
                StorageClusterStatus { phase: Some("Deleting".into()), pending_nodes: pending };
            if sc.status.as_ref() != Some(&status) {
                let patch = serde_json::json!({ "status": status });
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
            }
        }
    }
    Ok(())
}

async fn set_finalizers(
    api: &Api<StorageCluster>,
    sc: &StorageCluster,
    finalizers: Vec<String>,
) -> anyhow::Result<()> {
    let name = sc.metadata.name.clone().unwrap_or_default();
    // The resourceVersion makes this a compare-and-swap: a stale view fails
    // (409) and the next round looks again.
    let patch = serde_json::json!({ "metadata": { "finalizers": finalizers, "resourceVersion": sc.metadata.resource_version } });
    match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}
