//! The attachment ledger: one record per volume listing its consumers.
//! Races between agents are settled by the store alone: create fails when
//! the record exists, update and delete fail on a stale version.

pub mod conformance;
pub mod embedded;
pub mod write_behind;

use crate::model::{AccessMode, Holder, KeyValue, Volume};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a volume is, besides its name: its filesystem type and the
/// backend's options (a local volume's path, an image's pool and name).
/// A volume is its name and its source: a request naming a recorded volume
/// with another source is not for that volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSource {
    #[serde(default)]
    pub fs_type: String,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

impl VolumeSource {
    pub fn of(volume: &Volume) -> VolumeSource {
        VolumeSource {
            fs_type: volume.fs_type.clone(),
            options: volume.options.iter().map(|kv| (kv.key.clone(), kv.value.clone())).collect(),
        }
    }

    /// The volume options it holds, as guests get them.
    pub fn options(&self) -> Vec<KeyValue> {
        self.options.iter().map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() }).collect()
    }
}

/// What the ledger knows of one volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// PV name (the record's key).
    pub volume: String,
    pub backend: String,
    pub access_mode: AccessMode,
    /// The StorageCluster the volume names in its `storageCluster` option.
    #[serde(default)]
    pub storage_cluster: Option<String>,
    /// What the volume is; none in records of agents before it was kept.
    #[serde(default)]
    pub source: Option<VolumeSource>,
    pub holders: Vec<Holder>,
    /// The storage clients nodes opened the volume with (an RBD helper's
    /// Ceph client), so that another node's agent can place the image's
    /// watchers and fence a gone node's clients by address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storage_clients: Vec<StorageClient>,
}

/// A node's client of the storage system, as the storage names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StorageClient {
    pub node: String,
    /// Its global id ("client.<id>" in Ceph).
    pub id: u64,
    /// Its address, as blocklisting takes it.
    pub address: String,
}

impl Record {
    /// The holders on `node`.
    pub fn on_node<'r>(&'r self, node: &'r str) -> impl Iterator<Item = &'r Holder> + 'r {
        self.holders.iter().filter(move |h| h.consumer.node == node)
    }
}

/// An opaque version of a stored record (a counter, or a resourceVersion).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Version(pub String);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("attachment record {volume} already exists")]
    AlreadyExists { volume: String },
    #[error("attachment record {volume} changed since version {expected} was read")]
    Conflict { volume: String, expected: Version },
    #[error("attachment record {volume} does not exist")]
    NotFound { volume: String },
    #[error("attachment ledger {store}: {message}")]
    Store { store: String, message: String },
}

impl LedgerError {
    /// A race lost to another writer: read again and retry.
    pub fn is_race(&self) -> bool {
        matches!(self, LedgerError::AlreadyExists { .. } | LedgerError::Conflict { .. })
    }
}

/// The store of attachment records.
#[async_trait::async_trait]
pub trait Ledger: Send + Sync {
    /// The record of `volume` and its version, if any.
    async fn get(&self, volume: &str) -> Result<Option<(Record, Version)>, LedgerError>;
    /// Store a new record; `AlreadyExists` if there is one.
    async fn create(&self, record: &Record) -> Result<Version, LedgerError>;
    /// Replace the record if it is still at `expected`; else `Conflict`.
    async fn update(&self, record: &Record, expected: &Version) -> Result<Version, LedgerError>;
    /// Delete the record if it is still at `expected`; else `Conflict`.
    async fn delete(&self, volume: &str, expected: &Version) -> Result<(), LedgerError>;
    /// Every record with a holder on `node`.
    async fn list_by_node(&self, node: &str) -> Result<Vec<(Record, Version)>, LedgerError>;
    /// Whether this agent alone reads and writes the store. Then no other
    /// node acts on what a record says, and a record may become durable
    /// after the operation that wrote it: the stash holds the intent
    /// meanwhile, and start-up reconciliation restores a holder a crash
    /// kept from the disk (and drops one whose mount is gone).
    fn node_private(&self) -> bool {
        false
    }
    /// Make durable, now, the writes taken but not yet stored (at
    /// shutdown). A ledger that stores each write as it takes it has none.
    fn flush(&self) -> Result<(), LedgerError> {
        Ok(())
    }
}
