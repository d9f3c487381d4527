//! The ledger on the Kubernetes API: one cluster-scoped `Attachment` per
//! volume. Races between agents are settled by the API server alone —
//! create answers AlreadyExists, replace and delete carry the
//! resourceVersion read and answer Conflict when it is stale. Transient
//! failures (the API server down, 5xx, 429) are retried with backoff for a
//! bounded time, then reported as the store being unavailable.

use super::crds::{self, Attachment, AttachmentSpec, ConsumerEntry};
use crate::ledger::{Ledger, LedgerError, Record, Version};
use crate::model::{AccessMode, Consumer, Holder};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions};
use std::future::Future;
use std::time::Duration;

pub struct KubeLedger {
    api: Api<Attachment>,
    retry: Backoff,
}

/// How transient failures are retried: `attempts` tries, waits doubling
/// from `first`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub attempts: u32,
    pub first: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        // 0.1 + 0.2 + ... + 1.6 s: about 3 s of an API server restarting.
        Backoff { attempts: 6, first: Duration::from_millis(100) }
    }
}

impl KubeLedger {
    pub fn new(client: kube::Client) -> KubeLedger {
        KubeLedger { api: Api::all(client), retry: Backoff::default() }
    }

    pub fn with_backoff(mut self, retry: Backoff) -> KubeLedger {
        self.retry = retry;
        self
    }

    /// Run `call`, retrying transient failures.
    async fn call<T, F, Fut>(&self, volume: &str, what: &str, mut call: F) -> Result<T, kube::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let mut wait = self.retry.first;
        let mut attempt = 1;
        loop {
            match call().await {
                Ok(v) => return Ok(v),
                // A 403 too: an API server that has just started answers
                // so until its RBAC caches hold the agent's bindings. A real
                // refusal costs the few seconds of retries, then is reported.
                Err(e)
                    if (is_transient(&e) || is_forbidden(&e)) && attempt < self.retry.attempts =>
                {
                    tracing::debug!(
                        volume,
                        "{what}: transient API error, retrying in {wait:?}: {e}"
                    );
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

fn is_forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403)
}

/// Worth retrying: the server could not answer, or asked us to come back.
pub fn is_transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code >= 500 || s.code == 429,
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

/// The ledger's error for a failed `what` on `volume`; `expected`: the
/// version a replace or delete was conditional on.
fn map_error(volume: &str, what: &str, expected: Option<&Version>, e: kube::Error) -> LedgerError {
    let volume = volume.to_string();
    match (&e, expected) {
        (kube::Error::Api(s), _) if s.code == 409 && s.reason == "AlreadyExists" => {
            LedgerError::AlreadyExists { volume }
        }
        (kube::Error::Api(s), Some(expected)) if s.code == 409 => {
            LedgerError::Conflict { volume, expected: expected.clone() }
        }
        (kube::Error::Api(s), _) if s.code == 404 => LedgerError::NotFound { volume },
        _ => LedgerError::Store {
            store: "Kubernetes API (attachments.volagent.io)".into(),
            message: format!("{what} {volume}: {e}"),
        },
    }
}

fn to_crd_mode(m: AccessMode) -> crds::AccessMode {
    match m {
        AccessMode::ReadWriteOnce => crds::AccessMode::ReadWriteOnce,
        AccessMode::ReadOnlyMany => crds::AccessMode::ReadOnlyMany,
        AccessMode::ReadWriteMany => crds::AccessMode::ReadWriteMany,
        AccessMode::ReadWriteOncePod => crds::AccessMode::ReadWriteOncePod,
    }
}

pub fn from_crd_mode(m: crds::AccessMode) -> AccessMode {
    match m {
        crds::AccessMode::ReadWriteOnce => AccessMode::ReadWriteOnce,
        crds::AccessMode::ReadOnlyMany => AccessMode::ReadOnlyMany,
        crds::AccessMode::ReadWriteMany => AccessMode::ReadWriteMany,
        crds::AccessMode::ReadWriteOncePod => AccessMode::ReadWriteOncePod,
    }
}

pub fn to_entry(h: &Holder) -> ConsumerEntry {
    let c = &h.consumer;
    ConsumerEntry {
        node: c.node.clone(),
        pod_namespace: c.pod_namespace.clone(),
        pod: c.pod.clone(),
        pod_uid: c.pod_uid.clone(),
        mount_dir: c.mount_dir.clone(),
        read_only: c.read_only,
        since: h.since.clone(),
    }
}

pub fn from_entry(e: &ConsumerEntry) -> Holder {
    Holder {
        consumer: Consumer {
            node: e.node.clone(),
            pod_namespace: e.pod_namespace.clone(),
            pod: e.pod.clone(),
            pod_uid: e.pod_uid.clone(),
            mount_dir: e.mount_dir.clone(),
            read_only: e.read_only,
            mount_group: None,
        },
        since: e.since.clone(),
    }
}

fn to_object(record: &Record, version: Option<&Version>) -> Attachment {
    Attachment {
        metadata: ObjectMeta {
            name: Some(record.volume.clone()),
            resource_version: version.map(|v| v.0.clone()),
            ..Default::default()
        },
        spec: AttachmentSpec {
            backend: record.backend.clone(),
            access_mode: to_crd_mode(record.access_mode),
            storage_cluster: record.storage_cluster.clone(),
            source: record.source.as_ref().map(|s| crds::VolumeSourceSpec {
                fs_type: Some(s.fs_type.clone()).filter(|f| !f.is_empty()),
                options: Some(s.options.clone()).filter(|o| !o.is_empty()),
            }),
            consumers: record.holders.iter().map(to_entry).collect(),
            storage_clients: record
                .storage_clients
                .iter()
                // Ceph's global ids are far below 2^63.
                .filter_map(|c| {
                    Some(crds::StorageClientEntry {
                        node: c.node.clone(),
                        id: i64::try_from(c.id).ok()?,
                        address: c.address.clone(),
                    })
                })
                .collect(),
        },
    }
}

/// The record and version an object holds.
pub fn from_object(a: &Attachment) -> (Record, Version) {
    let record = Record {
        volume: a.metadata.name.clone().unwrap_or_default(),
        backend: a.spec.backend.clone(),
        access_mode: from_crd_mode(a.spec.access_mode),
        storage_cluster: a.spec.storage_cluster.clone(),
        source: a.spec.source.as_ref().map(|s| crate::ledger::VolumeSource {
            fs_type: s.fs_type.clone().unwrap_or_default(),
            options: s.options.clone().unwrap_or_default(),
        }),
        holders: a.spec.consumers.iter().map(from_entry).collect(),
        storage_clients: a
            .spec
            .storage_clients
            .iter()
            .filter_map(|c| {
                Some(crate::ledger::StorageClient {
                    node: c.node.clone(),
                    id: u64::try_from(c.id).ok()?,
                    address: c.address.clone(),
                })
            })
            .collect(),
    };
    (record, Version(a.metadata.resource_version.clone().unwrap_or_default()))
}

#[async_trait::async_trait]
impl Ledger for KubeLedger {
    async fn get(&self, volume: &str) -> Result<Option<(Record, Version)>, LedgerError> {
        let found = self
            .call(volume, "get", || self.api.get_opt(volume))
            .await
            .map_err(|e| map_error(volume, "get", None, e))?;
        Ok(found.as_ref().map(from_object))
    }

    async fn create(&self, record: &Record) -> Result<Version, LedgerError> {
        let object = to_object(record, None);
        let pp = PostParams::default();
        let created = self
            .call(&record.volume, "create", || self.api.create(&pp, &object))
            .await
            .map_err(|e| map_error(&record.volume, "create", None, e))?;
        Ok(from_object(&created).1)
    }

    async fn update(&self, record: &Record, expected: &Version) -> Result<Version, LedgerError> {
        let object = to_object(record, Some(expected));
        let pp = PostParams::default();
        let replaced = self
            .call(&record.volume, "replace", || self.api.replace(&record.volume, &pp, &object))
            .await
            .map_err(|e| map_error(&record.volume, "replace", Some(expected), e))?;
        Ok(from_object(&replaced).1)
    }

    async fn delete(&self, volume: &str, expected: &Version) -> Result<(), LedgerError> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: Some(expected.0.clone()),
                uid: None,
            }),
            ..Default::default()
        };
        self.call(volume, "delete", || self.api.delete(volume, &params))
            .await
            .map_err(|e| map_error(volume, "delete", Some(expected), e))?;
        Ok(())
    }

    async fn list_by_node(&self, node: &str) -> Result<Vec<(Record, Version)>, LedgerError> {
        let lp = ListParams::default();
        let list = self
            .call("*", "list", || self.api.list(&lp))
            .await
            .map_err(|e| map_error("*", "list", None, e))?;
        Ok(list
            .items
            .iter()
            .map(from_object)
            .filter(|(r, _)| r.on_node(node).next().is_some())
            .collect())
    }
}
