//! The record step: the volume's attachment record in the ledger — who
//! holds it, from what source, with which storage clients — written with
//! optimistic concurrency, and read back to rebuild a lost stash entry.

use super::context::Operation;
use super::fence::Fenced;
use super::mount_records::MountRecord;
use super::node::Node;
use super::request::MountDir;
use super::{Failure, FailureKind, cluster, internal};
use crate::clock::now_rfc3339;
use crate::ledger::{LedgerError, Record, StorageClient, Version, VolumeSource};
use crate::model::{Holder, Step, Volume};

/// How many times a lost ledger race is retried before giving up.
pub(crate) const LEDGER_RETRIES: usize = 5;

/// The option naming the StorageCluster a volume lives on.
pub const STORAGE_CLUSTER_OPTION: &str = "storageCluster";

pub(crate) fn storage_cluster(volume: &Volume) -> Option<String> {
    volume.option(STORAGE_CLUSTER_OPTION).map(str::to_string)
}

pub(crate) fn ledger_failure(e: LedgerError) -> Failure {
    let kind = if e.is_race() { FailureKind::Busy } else { FailureKind::Unavailable };
    Failure::new(kind, e.to_string())
}

/// The volume's record as it is now, checked to be of the volume `op` names.
pub(crate) async fn read(
    node: &Node,
    op: &Operation,
    source: &VolumeSource,
) -> Result<Option<(Record, Version)>, Failure> {
    let current = node.ledger.get(&op.volume.name).await.map_err(ledger_failure)?;
    if let Some((recorded, _)) = &current {
        same_volume(recorded, op.backend(), source)?;
    }
    Ok(current)
}

/// A request for a recorded volume must be for that volume: the same
/// backend and the same source. Otherwise it is another volume that only
/// shares the name (a second pod naming the first one's volume with a path
/// of its own must not be handed the first one's mount).
fn same_volume(recorded: &Record, backend: &str, source: &VolumeSource) -> Result<(), Failure> {
    let other = if recorded.backend != backend {
        format!("backend {}", recorded.backend)
    } else if recorded.source.as_ref().is_some_and(|s| s != source) {
        "another source (filesystem type or backend options)".to_string()
    } else {
        return Ok(());
    };
    Err(Failure::new(
        FailureKind::Denied,
        format!(
            "volume {} is in use with {other} than this request names; a volume is its name and its source, so this request is not for it",
            recorded.volume
        ),
    ))
}

/// What the record step leaves for the execute step.
pub(crate) struct Held {
    /// The consumer is a new holder (not a retry of a mount that took).
    pub added: bool,
    /// The backend's attach plan, or why it has none.
    pub plan: Result<Vec<Step>, Failure>,
    /// Since when the consumer holds the volume.
    pub since: String,
}

/// Record `op`'s consumer as a holder beside `fenced`'s kept ones, while
/// the backend computes its attach plan from the same view: the plan has
/// no effects, and is dropped when the write loses a race or fails. A
/// node-private ledger takes the write in memory
/// ([`crate::ledger::write_behind`]): no task for it. The ledger's answer
/// is the caller's to retry; only a failed task fails here.
pub(crate) async fn hold_and_plan(
    node: &Node,
    op: &Operation,
    current: Option<(Record, Version)>,
    fenced: Fenced,
    source: VolumeSource,
) -> Result<Result<Held, LedgerError>, Failure> {
    let me = &op.consumer;
    let Fenced { read, mut kept, clients, queries } = fenced;
    let earlier = kept
        .iter()
        .find(|h| h.consumer.pod_uid == me.pod_uid && h.consumer.mount_dir == me.mount_dir)
        .map(|h| h.since.clone());
    let already = earlier.is_some();
    // This node's other holders: the plan shares their devices.
    let local: Vec<Holder> = kept
        .iter()
        .filter(|h| h.consumer.node == me.node && h.consumer.mount_dir != me.mount_dir)
        .cloned()
        .collect();
    let since = earlier.unwrap_or_else(now_rfc3339);
    if !already {
        kept.push(Holder { consumer: me.clone(), since: since.clone() });
    }
    let record = Record {
        volume: op.volume.name.clone(),
        backend: op.backend().to_string(),
        access_mode: op.volume.access_mode,
        storage_cluster: storage_cluster(&op.volume),
        source: Some(source),
        holders: kept,
        storage_clients: clients,
    };
    let changed = match &current {
        None => true,
        Some((r, _)) => {
            record.holders != read
                || r.source.is_none()
                || record.storage_clients != r.storage_clients
        }
    };
    let version = current.map(|(_, v)| v);
    let ledger = node.ledger.clone();
    let write = async move {
        match version {
            None => ledger.create(&record).await,
            Some(v) if changed => ledger.update(&record, &v).await,
            Some(v) => Ok(v),
        }
    };
    let plan =
        || op.plugin.attach(queries.clone(), &op.volume, me, &local, &op.paths).map_err(internal);
    let (written, plan) = if node.ledger.node_private() {
        (write.await, plan())
    } else {
        let write = tokio::spawn(write);
        let plan = plan();
        (write.await.map_err(|e| internal(format!("agent task failed: {e}")))?, plan)
    };
    Ok(written.map(|_| Held { added: !already, plan, since }))
}

/// Record this node's storage clients of `volume` (replacing earlier ones).
pub(crate) async fn storage_clients(
    node: &Node,
    volume: &str,
    clients: &[(u64, String)],
) -> Result<(), Failure> {
    let me = &node.config.node;
    for _ in 0..LEDGER_RETRIES {
        let Some((mut record, version)) = node.ledger.get(volume).await.map_err(ledger_failure)?
        else {
            return Ok(());
        };
        let mut wanted: Vec<StorageClient> =
            record.storage_clients.iter().filter(|c| c.node != *me).cloned().collect();
        wanted.extend(clients.iter().map(|(id, address)| StorageClient {
            node: me.clone(),
            id: *id,
            address: address.clone(),
        }));
        if wanted == record.storage_clients {
            return Ok(());
        }
        record.storage_clients = wanted;
        match node.ledger.update(&record, &version).await {
            Ok(_) => return Ok(()),
            Err(e) if e.is_race() => continue,
            Err(e) => return Err(ledger_failure(e)),
        }
    }
    Err(keeps_changing(volume))
}

/// Name this node's storage client `new` (id, address) wherever its
/// records name client `old`: a helper started again in place of a dead
/// one is a new Ceph client, and fencing must blocklist that one. Returns
/// the volumes whose records were changed.
pub(crate) async fn replace_storage_client(
    node: &Node,
    old: (u64, &str),
    new: (u64, &str),
) -> Result<Vec<String>, Failure> {
    let me = &node.config.node;
    // Global ids are a cluster's: the address tells clusters apart.
    let is_old = |c: &StorageClient| c.node == *me && c.id == old.0 && c.address == old.1;
    let names_old = |r: &Record| r.storage_clients.iter().any(is_old);
    let mut changed = Vec::new();
    let records = node.ledger.list_by_node(me).await.map_err(ledger_failure)?;
    for (record, _) in records.into_iter().filter(|(r, _)| names_old(r)) {
        let volume = record.volume;
        for attempt in 0..=LEDGER_RETRIES {
            if attempt == LEDGER_RETRIES {
                return Err(keeps_changing(&volume));
            }
            let Some((mut record, version)) =
                node.ledger.get(&volume).await.map_err(ledger_failure)?
            else {
                break;
            };
            if !names_old(&record) {
                break;
            }
            for c in record.storage_clients.iter_mut().filter(|c| is_old(c)) {
                (c.id, c.address) = (new.0, new.1.to_string());
            }
            match node.ledger.update(&record, &version).await {
                Ok(_) => {
                    changed.push(volume.clone());
                    break;
                }
                Err(e) if e.is_race() => continue,
                Err(e) => return Err(ledger_failure(e)),
            }
        }
    }
    Ok(changed)
}

fn keeps_changing(volume: &str) -> Failure {
    Failure::new(FailureKind::Busy, format!("attachment record {volume} keeps changing; retry"))
}

/// The holders of `volume` on this node other than the one at `mount_dir`.
pub(crate) async fn others_here(
    node: &Node,
    volume: &str,
    mount_dir: &str,
) -> Result<Vec<Holder>, Failure> {
    let current = node.ledger.get(volume).await.map_err(ledger_failure)?;
    Ok(current
        .map(|(r, _)| r.holders)
        .unwrap_or_default()
        .into_iter()
        .filter(|h| h.consumer.node == node.config.node && h.consumer.mount_dir != mount_dir)
        .collect())
}

/// Remove the holder at `mount_dir`; the record goes with its last
/// holder, and this node's storage clients with its last one here.
pub(crate) async fn remove_holder(
    node: &Node,
    volume: &str,
    mount_dir: &str,
) -> Result<(), Failure> {
    for _ in 0..LEDGER_RETRIES {
        let Some((mut record, version)) = node.ledger.get(volume).await.map_err(ledger_failure)?
        else {
            return Ok(());
        };
        let before = record.holders.len();
        record.holders.retain(|h| h.consumer.mount_dir != mount_dir);
        if record.holders.len() == before {
            return Ok(());
        }
        let me = &node.config.node;
        if !record.holders.iter().any(|h| h.consumer.node == *me) {
            record.storage_clients.retain(|c| c.node != *me);
        }
        let result = if record.holders.is_empty() {
            node.ledger.delete(volume, &version).await
        } else {
            node.ledger.update(&record, &version).await.map(drop)
        };
        match result {
            Ok(()) => return Ok(()),
            Err(e) if e.is_race() => continue,
            Err(e) => return Err(ledger_failure(e)),
        }
    }
    Err(keeps_changing(volume))
}

/// What the stash would hold for `dir`, rebuilt from the ledger: the
/// record of the volume the dir is named after, holding a consumer at
/// that dir on this node, with the source it was mounted from.
pub(crate) async fn entry_from_ledger(
    node: &Node,
    backend: &str,
    dir: &MountDir,
) -> Result<Option<MountRecord>, Failure> {
    for key in [dir.name.clone(), cluster::inline_key(&dir.pod_uid, &dir.name)] {
        if let Some(entry) =
            entry_of_record(node, backend, &dir.dir.display().to_string(), &key).await?
        {
            return Ok(Some(entry));
        }
    }
    Ok(None)
}

/// The stash entry of `path` rebuilt from the ledger's record `key`.
pub(crate) async fn entry_of_record(
    node: &Node,
    backend: &str,
    path: &str,
    key: &str,
) -> Result<Option<MountRecord>, Failure> {
    let Some((record, _)) = node.ledger.get(key).await.map_err(ledger_failure)? else {
        return Ok(None);
    };
    let holder = record
        .holders
        .iter()
        .find(|h| h.consumer.node == node.config.node && h.consumer.mount_dir == path);
    let (Some(holder), Some(source)) = (holder, &record.source) else { return Ok(None) };
    if record.backend != backend {
        return Ok(None);
    }
    let volume = Volume {
        name: record.volume.clone(),
        backend: record.backend.clone(),
        access_mode: record.access_mode,
        fs_type: source.fs_type.clone(),
        mode: crate::policy::VolumeMode::Filesystem,
        mount_flags: Vec::new(),
        options: source.options(),
        secret_keys: Vec::new(),
    };
    Ok(Some(MountRecord {
        paths: node.config.paths(backend, &volume.name),
        volume,
        consumer: holder.consumer.clone(),
        since: Some(holder.since.clone()),
    }))
}
