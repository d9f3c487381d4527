//! The agent's cluster-driven work: its node's cleanup list (records the
//! controller moved there while the node was gone) and the volumes of
//! deleted StorageClusters. Run at start-up, on every change the watches
//! see, and periodically in case a round failed.

use super::crds::{CleanupEntry, NodeCleanup, StorageCluster};
use crate::model::CleanupReason;
use crate::ops::mount_records::MountRecord;
use crate::ops::{Agent, STORAGE_CLUSTER_OPTION};
use futures_util::StreamExt;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// Work through the cleanup list and deleted clusters now, then whenever
/// either changes, and at least every `interval`. Runs until cancelled.
pub async fn run(agent: Arc<Agent>, client: kube::Client, node: String, interval: Duration) {
    let lists: Api<NodeCleanup> = Api::all(client.clone());
    let clusters: Api<StorageCluster> = Api::all(client.clone());
    // With backoff: while the API server is away, a watch must not spin.
    let list_changes =
        watcher(lists, watcher::Config::default().fields(&format!("metadata.name={node}")))
            .default_backoff()
            .map(|_| ());
    let cluster_changes =
        watcher(clusters, watcher::Config::default()).default_backoff().map(|_| ());
    let mut changes = futures_util::stream::select(list_changes, cluster_changes).boxed();
    loop {
        sync_once(&agent, &client, &node).await;
        // Coalesce a burst of watch events into one round.
        let _ = tokio::time::timeout(interval, changes.next()).await;
        while let Ok(Some(())) =
            tokio::time::timeout(Duration::from_millis(200), changes.next()).await
        {}
    }
}

/// One round; failures are logged and retried next round.
pub async fn sync_once(agent: &Arc<Agent>, client: &kube::Client, node: &str) {
    if let Err(e) = work_off_cleanup_list(agent, client, node).await {
        tracing::error!(node, "cleanup list: {e:#}");
    }
    if let Err(e) = clean_deleted_clusters(agent, client).await {
        tracing::error!(node, "deleted storage clusters: {e:#}");
    }
}

/// Undo what the node's cleanup list names, then drop the entries that
/// are done: the list is left empty, and the controller deletes it (an
/// agent may only take entries out of its own list, never delete it).
///
/// An entry is about one mount: the consumer's mount dir, pod UID and the
/// time the ledger recorded it. A mount of the same dir made since (a CSI
/// stage's dir is the same for every stage of a volume) is another mount
/// and is left alone; the entry is then done.
pub async fn work_off_cleanup_list(
    agent: &Arc<Agent>,
    client: &kube::Client,
    node: &str,
) -> anyhow::Result<usize> {
    let api: Api<NodeCleanup> = Api::all(client.clone());
    let Some(list) = api.get_opt(node).await? else { return Ok(0) };
    if list.spec.entries.is_empty() {
        return Ok(0);
    }
    let entries = list.spec.entries.clone();
    let cleaned = agent
        .clean_volumes(CleanupReason::StaleNode, |e| entries.iter().any(|c| names_mount(c, e)))
        .await
        .map_err(|f| anyhow::anyhow!(f.message))?;
    let stashed = agent.mount_records().await.map_err(|f| anyhow::anyhow!(f.message))?;
    let pending = |c: &CleanupEntry| stashed.iter().any(|e| names_mount(c, e));
    let done = entries.iter().filter(|c| !pending(c)).count();
    // Drop the finished entries; the controller may have appended meanwhile,
    // so this is a compare-and-swap on what was read, retried on conflict.
    let mut current = list;
    for _ in 0..5 {
        let mut next = current.clone();
        next.spec.entries.retain(|c| pending(c) || !entries.contains(c));
        if next.spec.entries == current.spec.entries {
            break;
        }
        match api.replace(node, &PostParams::default(), &next).await {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 409 => match api.get_opt(node).await? {
                Some(fresh) => current = fresh,
                None => break,
            },
            Err(e) => return Err(e.into()),
        }
    }
    if !cleaned.failed.is_empty() {
        anyhow::bail!("still held: {}", cleaned.failed.join("; "));
    }
    Ok(done)
}

/// Whether cleanup entry `c` is about stashed mount `e`: the same dir and
/// pod, recorded at the same time. (A stash entry an older agent wrote has
/// no time: it is matched by its dir and pod alone.)
pub fn names_mount(c: &CleanupEntry, e: &MountRecord) -> bool {
    c.consumer.mount_dir == e.consumer.mount_dir
        && c.consumer.pod_uid == e.consumer.pod_uid
        && e.since.as_ref().is_none_or(|since| *since == c.consumer.since)
}

/// Force-clean this node's volumes of every StorageCluster being deleted.
pub async fn clean_deleted_clusters(
    agent: &Arc<Agent>,
    client: &kube::Client,
) -> anyhow::Result<usize> {
    let api: Api<StorageCluster> = Api::all(client.clone());
    let deleting: BTreeSet<String> = api
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|c| c.metadata.deletion_timestamp.is_some())
        .filter_map(|c| c.metadata.name)
        .collect();
    if deleting.is_empty() {
        return Ok(0);
    }
    let cleaned = agent
        .clean_volumes(CleanupReason::StorageClusterDeleted, |e| {
            e.volume
                .options
                .iter()
                .any(|kv| kv.key == STORAGE_CLUSTER_OPTION && deleting.contains(&kv.value))
        })
        .await
        .map_err(|f| anyhow::anyhow!(f.message))?;
    if !cleaned.failed.is_empty() {
        anyhow::bail!("still held: {}", cleaned.failed.join("; "));
    }
    Ok(cleaned.released.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::crds::{AccessMode, CleanupReason, ConsumerEntry};

    fn entry(dir: &str, uid: &str, since: &str) -> CleanupEntry {
        CleanupEntry {
            volume: "pv1".into(),
            backend: "local-pv".into(),
            access_mode: AccessMode::ReadWriteOnce,
            storage_cluster: None,
            consumer: ConsumerEntry {
                node: "n1".into(),
                pod_namespace: "ns".into(),
                pod: "p".into(),
                pod_uid: uid.into(),
                mount_dir: dir.into(),
                read_only: false,
                since: since.into(),
            },
            reason: CleanupReason::NodeGone,
            moved_at: "2026-01-01T00:10:00Z".into(),
        }
    }

    fn stashed(dir: &str, uid: &str, since: Option<&str>) -> MountRecord {
        use crate::model::{Consumer, NodePaths, Volume, VolumeMode};
        let volume = Volume {
            name: "pv1".into(),
            backend: "local-pv".into(),
            access_mode: crate::policy::AccessMode::ReadWriteOnce,
            fs_type: "ext4".into(),
            mode: VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: vec![],
            secret_keys: vec![],
        };
        let consumer = Consumer {
            node: "n1".into(),
            pod_namespace: "ns".into(),
            pod: "p".into(),
            pod_uid: uid.into(),
            mount_dir: dir.into(),
            read_only: false,
            mount_group: None,
        };
        let paths = NodePaths {
            kubelet_root: "/k".into(),
            staging_dir: "/k/s".into(),
            state_dir: "/s".into(),
            discovery_dirs: vec![],
        };
        MountRecord { volume, consumer, paths, since: since.map(String::from) }
    }

    #[test]
    fn a_cleanup_entry_names_one_mount_not_every_mount_of_its_dir() {
        let stage = "/k/plugins/kubernetes.io/csi/pv/pv1/globalmount";
        let c = entry(stage, "csi-stage-n1", "2026-01-01T00:00:00Z");
        assert!(
            names_mount(&c, &stashed(stage, "csi-stage-n1", Some("2026-01-01T00:00:00Z"))),
            "the mount it was written about"
        );
        assert!(
            !names_mount(&c, &stashed(stage, "csi-stage-n1", Some("2026-01-01T00:20:00Z"))),
            "the same dir staged again later"
        );
        assert!(
            !names_mount(&c, &stashed(stage, "other-pod", Some("2026-01-01T00:00:00Z"))),
            "another pod's"
        );
        assert!(!names_mount(
            &c,
            &stashed("/k/elsewhere", "csi-stage-n1", Some("2026-01-01T00:00:00Z"))
        ));
        assert!(
            names_mount(&c, &stashed(stage, "csi-stage-n1", None)),
            "an older agent's entry: by dir and pod"
        );
    }
}
