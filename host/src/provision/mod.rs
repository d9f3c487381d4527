//! Provisioning: volumes and snapshots made, grown and removed on request,
//! as the backend's policy plans it, by the controller and with its own
//! credentials. One implementation behind both ways in: the CSI Controller
//! service ([`csi`]) and the controller's own claim
//! watcher. Every request is settled by name through a [`records`] entry
//! written before the storage is touched, so a retry (the same name after
//! a timeout) ends with the same volume, and another request under a name
//! in use is refused.

pub mod capacity;
pub mod claims;
pub mod csi;
pub mod execute;
pub mod local;
pub mod objects;
pub mod records;
pub mod resize;
pub mod snapshots;

use crate::kube::crds::{ProvisionKind, ProvisionPhase, ProvisionRecordSpec};
use crate::model::{
    CapacityRequest, ContentSource, ControllerStepKind, CreateRequest, KeyValue, ProvisionError,
    Segment, Target,
};
use crate::policy::{CallError, Plugin};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a request failed, in the kinds CSI distinguishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    Unimplemented,
    NotFound,
    AlreadyExists,
    OutOfRange,
    ResourceExhausted,
    /// Not now: in use, or waiting on something else (retried).
    FailedPrecondition,
    /// Another request for the same name is running.
    Aborted,
    Unavailable,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub code: Code,
    pub message: String,
}

impl Failure {
    pub fn new(code: Code, message: impl Into<String>) -> Failure {
        Failure { code, message: message.into() }
    }
}

fn refusal(backend: &str, e: ProvisionError) -> Failure {
    let (code, message) = match e {
        ProvisionError::Invalid(m) => (Code::InvalidArgument, m),
        ProvisionError::Unsupported(m) => (Code::InvalidArgument, m),
        ProvisionError::NotFound(m) => (Code::NotFound, m),
        ProvisionError::Exhausted(m) => (Code::ResourceExhausted, m),
        ProvisionError::OutOfRange(m) => (Code::OutOfRange, m),
    };
    Failure::new(code, format!("backend {backend}: {message}"))
}

fn fault(e: CallError) -> Failure {
    Failure::new(Code::Internal, e.to_string())
}

/// A volume as made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MadeVolume {
    pub id: String,
    pub capacity_bytes: u64,
    /// What nodes get as the volume's options (CSI volume_context).
    pub attributes: BTreeMap<String, String>,
    pub topology: Vec<Segment>,
    pub source: Option<ContentSource>,
}

/// A snapshot as made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MadeSnapshot {
    pub id: String,
    pub source_volume_id: String,
    pub size_bytes: u64,
    /// RFC 3339.
    pub created: String,
}

/// The controller's provisioning, for every backend whose policy has a
/// provisioner.
pub struct Provisioner {
    plugins: BTreeMap<String, Arc<Plugin>>,
    client: kube::Client,
    records: records::Records,
    executor: execute::Executor,
    /// Names with a request running: a second one at once is aborted, as
    /// CSI asks (the caller retries).
    running: Mutex<BTreeSet<String>>,
    /// Held from the look at which local volumes are free to the record of
    /// the one taken, so that two requests never take the same.
    placing: tokio::sync::Mutex<()>,
}

/// The StorageClass parameters CSI's sidecars and Kubernetes reserve for
/// themselves; a policy never sees them.
const RESERVED_PREFIX: &str = "csi.storage.k8s.io/";

impl Provisioner {
    pub fn new(
        plugins: BTreeMap<String, Arc<Plugin>>,
        client: kube::Client,
        mechanisms: execute::Mechanisms,
        step_deadline: Duration,
    ) -> Provisioner {
        Provisioner {
            plugins,
            records: records::Records::new(client.clone()),
            executor: execute::Executor::new(client.clone(), mechanisms, step_deadline),
            client,
            running: Mutex::new(BTreeSet::new()),
            placing: tokio::sync::Mutex::new(()),
        }
    }

    /// The backends this controller serves (their policies loaded).
    pub fn backends(&self) -> Vec<String> {
        self.plugins.keys().cloned().collect()
    }

    /// Whether `backend`'s policy provisions.
    pub fn provisions(&self, backend: &str) -> bool {
        self.plugins.get(backend).is_some_and(|p| p.provisions())
    }

    fn plugin(&self, backend: &str) -> Result<Arc<Plugin>, Failure> {
        let plugin = self.plugins.get(backend).ok_or_else(|| {
            Failure::new(Code::Unimplemented, format!("no policy for backend {backend} is loaded"))
        })?;
        if !plugin.provisions() {
            return Err(Failure::new(
                Code::Unimplemented,
                format!(
                    "backend {backend} does not provision volumes: its policy ({}) does not export volagent:policy/provisioner",
                    plugin.path().display()
                ),
            ));
        }
        Ok(plugin.clone())
    }

    /// A policy call off the runtime's threads (a guest call is short,
    /// but it is compute).
    async fn ask<T: Send + 'static>(
        &self,
        backend: &str,
        call: impl FnOnce(&Plugin) -> Result<Result<T, ProvisionError>, CallError> + Send + 'static,
    ) -> Result<T, Failure> {
        let plugin = self.plugin(backend)?;
        let answer = tokio::task::spawn_blocking(move || call(&plugin))
            .await
            .map_err(|e| Failure::new(Code::Internal, format!("policy call: {e}")))?;
        answer.map_err(fault)?.map_err(|e| refusal(backend, e))
    }

    /// Hold `name` for one request; released on drop.
    fn hold(&self, key: String) -> Result<Held<'_>, Failure> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if !running.insert(key.clone()) {
            return Err(Failure::new(
                Code::Aborted,
                format!("a request for {key} is already running; try again"),
            ));
        }
        Ok(Held { set: &self.running, key })
    }

    /// The class's parameters as the policy gets them: without the
    /// reserved ones, and with the StorageCluster's they name (the class's
    /// win) and its endpoints.
    async fn parameters(
        &self,
        backend: &str,
        given: &BTreeMap<String, String>,
    ) -> Result<Vec<KeyValue>, Failure> {
        let mut out: Vec<KeyValue> = given
            .iter()
            .filter(|(k, _)| !k.starts_with(RESERVED_PREFIX))
            .map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() })
            .collect();
        if let Some(cluster) = given.get(crate::ops::STORAGE_CLUSTER_OPTION) {
            let from =
                crate::kube::storage::provisioning_parameters(&self.client, cluster, backend)
                    .await
                    .map_err(execute::cluster_failure)?;
            for (key, value) in from {
                if !out.iter().any(|kv| kv.key == key) {
                    out.push(KeyValue { key, value });
                }
            }
        }
        Ok(out)
    }

    /// Whether `backend`'s policy places volumes on discovered local
    /// volumes (it declared the step taking one).
    pub fn places_locally(&self, backend: &str) -> bool {
        self.plugins.get(backend).is_some_and(|p| {
            p.info().capabilities.controller_steps.contains(&ControllerStepKind::TakeLocalVolume)
        })
    }

    /// The free local volumes of the request's discovery class (`class`:
    /// the claim's StorageClass, when the request comes from one) on
    /// `nodes` (None: any).
    async fn local_candidates(
        &self,
        backend: &str,
        class_parameters: &BTreeMap<String, String>,
        class: Option<&str>,
        nodes: Option<&BTreeSet<String>>,
        own: Option<&str>,
    ) -> Result<Vec<local::Candidate>, Failure> {
        let class = local::class_of(class_parameters, class).ok_or_else(|| {
            Failure::new(
                Code::InvalidArgument,
                format!(
                    "backend {backend} places volumes on discovered local volumes: parameter {} must name their class",
                    local::CLASS_PARAMETER
                ),
            )
        })?;
        local::free(&self.client, &self.records, backend, &class, nodes, own).await
    }

    /// Make the volume `request` asks for (`request.parameters` are the
    /// class's, as given; `class` the claim's StorageClass, if any), or
    /// find it made.
    pub async fn create_volume(
        &self,
        backend: &str,
        mut request: CreateRequest,
        class_parameters: &BTreeMap<String, String>,
        class: Option<&str>,
    ) -> Result<MadeVolume, Failure> {
        self.plugin(backend)?;
        if request.name.is_empty() {
            return Err(Failure::new(Code::InvalidArgument, "a volume needs a name"));
        }
        if request.limit_bytes != 0 && request.limit_bytes < request.required_bytes {
            return Err(Failure::new(
                Code::InvalidArgument,
                format!(
                    "the limit ({} bytes) is below the required size ({} bytes)",
                    request.limit_bytes, request.required_bytes
                ),
            ));
        }
        let _held = self.hold(format!("{backend} volume {}", request.name))?;
        request.parameters = self.parameters(backend, class_parameters).await?;
        let digest = records::digest(&request);
        let found = self.records.get(backend, ProvisionKind::Volume, &request.name).await?;
        if let Some(r) = &found {
            let same = r.spec.request_digest == digest
                && r.spec.required_bytes == records::signed(request.required_bytes)
                && r.spec.limit_bytes == records::signed(request.limit_bytes);
            if !same {
                return Err(Failure::new(
                    Code::AlreadyExists,
                    format!(
                        "volume {} exists ({}) for another request (size, parameters, access or source differ)",
                        request.name, r.spec.id
                    ),
                ));
            }
            if r.spec.phase == ProvisionPhase::Deleting {
                return Err(Failure::new(
                    Code::Aborted,
                    format!("volume {} ({}) is being deleted", request.name, r.spec.id),
                ));
            }
        }
        // A volume placed on a discovered one: offered the free ones (a
        // retry only the one it took), under the placing lock until the
        // record says which it took.
        let placing = self.places_locally(backend);
        let _placing = if placing { Some(self.placing.lock().await) } else { None };
        let mut candidates = Vec::new();
        if placing {
            let nodes = local::nodes_of(&request.requisite);
            candidates = self
                .local_candidates(
                    backend,
                    class_parameters,
                    class,
                    nodes.as_ref(),
                    Some(&request.name),
                )
                .await?;
            if let Some(r) = &found {
                candidates.retain(|c| c.volume.name == r.spec.id);
            }
            request.local_volumes = candidates.iter().map(|c| c.volume.clone()).collect();
        }
        let asked = request.clone();
        let mut plan = self.ask(backend, move |p| p.create_volume(&asked)).await?;
        local::settle(&mut plan, &candidates)?;
        let spec = ProvisionRecordSpec {
            backend: backend.to_string(),
            kind: ProvisionKind::Volume,
            name: request.name.clone(),
            id: plan.id.clone(),
            source: request.source.as_ref().map(|s| match s {
                ContentSource::Snapshot(id) | ContentSource::Volume(id) => id.clone(),
            }),
            required_bytes: records::signed(request.required_bytes),
            limit_bytes: records::signed(request.limit_bytes),
            capacity_bytes: records::signed(plan.capacity_bytes),
            request_digest: digest,
            phase: ProvisionPhase::Creating,
            created: crate::clock::now_rfc3339(),
        };
        if let Some(r) = &found {
            if r.spec.id != plan.id {
                return Err(Failure::new(
                    Code::Internal,
                    format!(
                        "backend {backend}: the policy named volume {} {} this time, {} before",
                        request.name, plan.id, r.spec.id
                    ),
                ));
            }
        } else {
            // Written before the storage is touched: a controller stopped
            // between the two leaves a record to clean up after, never an
            // image nobody knows of.
            self.records.create(spec.clone()).await?;
        }
        let made = match self.executor.run(backend, &plan.steps).await {
            Ok(made) => made,
            Err(f) => {
                self.undo(backend, ProvisionKind::Volume, &request.name, &plan.id, &f).await;
                return Err(f);
            }
        };
        let capacity =
            if plan.capacity_bytes > 0 { plan.capacity_bytes } else { made.unwrap_or(0) };
        if capacity < request.required_bytes
            || (request.limit_bytes != 0 && capacity > request.limit_bytes)
        {
            let f = Failure::new(
                Code::OutOfRange,
                format!(
                    "volume {} ({}) has {capacity} bytes, outside the {} to {} asked for",
                    request.name, plan.id, request.required_bytes, request.limit_bytes
                ),
            );
            self.undo(backend, ProvisionKind::Volume, &request.name, &plan.id, &f).await;
            return Err(f);
        }
        self.records
            .set_phase(
                backend,
                ProvisionKind::Volume,
                &request.name,
                ProvisionPhase::Ready,
                capacity,
            )
            .await?;
        Ok(MadeVolume {
            id: plan.id,
            capacity_bytes: capacity,
            attributes: plan.attributes.into_iter().map(|kv| (kv.key, kv.value)).collect(),
            topology: plan.topology,
            source: request.source,
        })
    }

    /// After a create that failed for good (what it names does not exist,
    /// the request cannot be served): whatever of it the plan made is
    /// removed, by the policy's own removal plan, and so is its record. The
    /// caller gets no id to delete it by. A failure that may pass (the
    /// storage or API unreachable, in use, a conflict with something not
    /// ours) leaves both for the retry.
    async fn undo(&self, backend: &str, kind: ProvisionKind, name: &str, id: &str, why: &Failure) {
        if !matches!(why.code, Code::NotFound | Code::InvalidArgument | Code::OutOfRange) {
            return;
        }
        if let Err(e) = self.remove_made(backend, kind, name, id).await {
            tracing::warn!(
                backend,
                name,
                id,
                "what a failed create made stays, to be removed on its retry or reconciliation: {e}"
            );
        }
    }

    /// Remove what a create of `name` (its plan naming `id`) made, by the
    /// policy's removal plan, then its record.
    async fn remove_made(
        &self,
        backend: &str,
        kind: ProvisionKind,
        name: &str,
        id: &str,
    ) -> Result<(), Failure> {
        let target = Target { id: id.to_string(), ..Default::default() };
        let plan = match kind {
            ProvisionKind::Volume => self.ask(backend, move |p| p.delete_volume(&target)).await,
            ProvisionKind::Snapshot => self.ask(backend, move |p| p.delete_snapshot(&target)).await,
        };
        match plan {
            Ok(plan) => self.executor.run(backend, &plan.steps).await.map(drop)?,
            Err(f) if f.code == Code::NotFound => {}
            Err(f) => return Err(f),
        }
        self.records.delete(backend, kind, name).await
    }

    /// The volumes whose create never finished (their record still says
    /// Creating): (backend, name, id) each.
    pub async fn unfinished(&self) -> Result<Vec<(String, String, String)>, Failure> {
        let mut out = Vec::new();
        for backend in self.backends().into_iter().filter(|b| self.provisions(b)) {
            for r in self.records.list(&backend, ProvisionKind::Volume).await? {
                if r.spec.phase == ProvisionPhase::Creating {
                    out.push((backend.clone(), r.spec.name, r.spec.id));
                }
            }
        }
        Ok(out)
    }

    /// Remove what the unfinished create of volume `name` made, and its
    /// record: nobody will ask for it again.
    pub async fn abandon(&self, backend: &str, name: &str, id: &str) -> Result<(), Failure> {
        let _held = self.hold(format!("{backend} volume {name}"))?;
        self.remove_made(backend, ProvisionKind::Volume, name, id).await
    }

    /// Remove volume `id`; one that is not there (or not this backend's)
    /// is success. Refused while it is in use: it is never forced.
    pub async fn delete_volume(&self, backend: &str, id: &str) -> Result<(), Failure> {
        if id.is_empty() {
            return Err(Failure::new(Code::InvalidArgument, "a volume id is required"));
        }
        let _held = self.hold(format!("{backend} id {id}"))?;
        let target = Target { id: id.to_string(), ..Default::default() };
        let plan = match self.ask(backend, move |p| p.delete_volume(&target)).await {
            Err(f) if f.code == Code::NotFound => return Ok(()),
            other => other?,
        };
        let record = self.records.by_id(backend, ProvisionKind::Volume, id).await?;
        if let Some(r) = &record {
            self.records
                .set_phase(
                    backend,
                    ProvisionKind::Volume,
                    &r.spec.name,
                    ProvisionPhase::Deleting,
                    0,
                )
                .await?;
        }
        self.executor.run(backend, &plan.steps).await?;
        if let Some(r) = record {
            self.records.delete(backend, ProvisionKind::Volume, &r.spec.name).await?;
        }
        Ok(())
    }

    /// Grow volume `id` to at least `required` bytes (at most `limit`, 0
    /// unlimited); its size afterwards.
    pub async fn expand_volume(
        &self,
        backend: &str,
        id: &str,
        required: u64,
        limit: u64,
    ) -> Result<u64, Failure> {
        if id.is_empty() {
            return Err(Failure::new(Code::InvalidArgument, "a volume id is required"));
        }
        if limit != 0 && limit < required {
            return Err(Failure::new(
                Code::InvalidArgument,
                "the limit is below the required size",
            ));
        }
        let _held = self.hold(format!("{backend} id {id}"))?;
        let target = Target {
            id: id.to_string(),
            required_bytes: required,
            limit_bytes: limit,
            ..Default::default()
        };
        let plan = self.ask(backend, move |p| p.expand_volume(&target)).await?;
        let made = self.executor.run(backend, &plan.steps).await?;
        let size = if plan.capacity_bytes > 0 { plan.capacity_bytes } else { made.unwrap_or(0) };
        if size < required {
            return Err(Failure::new(
                Code::Internal,
                format!("volume {id} has {size} bytes after growing, not the {required} asked for"),
            ));
        }
        if let Some(r) = self.records.by_id(backend, ProvisionKind::Volume, id).await? {
            self.records
                .set_phase(backend, ProvisionKind::Volume, &r.spec.name, r.spec.phase, size)
                .await?;
        }
        Ok(size)
    }

    /// Snapshot volume `source` as `name`, or find it made.
    pub async fn create_snapshot(
        &self,
        backend: &str,
        source: &str,
        name: &str,
        parameters: &BTreeMap<String, String>,
    ) -> Result<MadeSnapshot, Failure> {
        if source.is_empty() || name.is_empty() {
            return Err(Failure::new(
                Code::InvalidArgument,
                "a snapshot needs a name and a source volume id",
            ));
        }
        let _held = self.hold(format!("{backend} snapshot {name}"))?;
        let found = self.records.get(backend, ProvisionKind::Snapshot, name).await?;
        if let Some(r) = &found {
            if r.spec.source.as_deref() != Some(source) {
                return Err(Failure::new(
                    Code::AlreadyExists,
                    format!(
                        "snapshot {name} exists ({}) of another volume ({})",
                        r.spec.id,
                        r.spec.source.as_deref().unwrap_or("?")
                    ),
                ));
            }
            if r.spec.phase == ProvisionPhase::Ready {
                return Ok(records::snapshot_of(&r.spec));
            }
        }
        let target = Target {
            id: source.to_string(),
            name: name.to_string(),
            parameters: parameters
                .iter()
                .filter(|(k, _)| !k.starts_with(RESERVED_PREFIX))
                .map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() })
                .collect(),
            ..Default::default()
        };
        let plan = self.ask(backend, move |p| p.snapshot(&target)).await?;
        let mut spec = ProvisionRecordSpec {
            backend: backend.to_string(),
            kind: ProvisionKind::Snapshot,
            name: name.to_string(),
            id: plan.id.clone(),
            source: Some(source.to_string()),
            required_bytes: 0,
            limit_bytes: 0,
            capacity_bytes: 0,
            request_digest: String::new(),
            phase: ProvisionPhase::Creating,
            created: crate::clock::now_rfc3339(),
        };
        if found.is_none() {
            self.records.create(spec.clone()).await?;
        } else if let Some(r) = found {
            spec.created = r.spec.created;
        }
        let made = match self.executor.run(backend, &plan.steps).await {
            Ok(made) => made,
            Err(f) => {
                self.undo(backend, ProvisionKind::Snapshot, name, &plan.id, &f).await;
                return Err(f);
            }
        };
        let size = if plan.capacity_bytes > 0 { plan.capacity_bytes } else { made.unwrap_or(0) };
        self.records
            .set_phase(backend, ProvisionKind::Snapshot, name, ProvisionPhase::Ready, size)
            .await?;
        spec.capacity_bytes = records::signed(size);
        Ok(records::snapshot_of(&spec))
    }

    /// Remove snapshot `id`; one that is not there is success.
    pub async fn delete_snapshot(&self, backend: &str, id: &str) -> Result<(), Failure> {
        if id.is_empty() {
            return Err(Failure::new(Code::InvalidArgument, "a snapshot id is required"));
        }
        let _held = self.hold(format!("{backend} id {id}"))?;
        let target = Target { id: id.to_string(), ..Default::default() };
        let plan = match self.ask(backend, move |p| p.delete_snapshot(&target)).await {
            Err(f) if f.code == Code::NotFound => return Ok(()),
            other => other?,
        };
        let record = self.records.by_id(backend, ProvisionKind::Snapshot, id).await?;
        if let Some(r) = &record {
            self.records
                .set_phase(
                    backend,
                    ProvisionKind::Snapshot,
                    &r.spec.name,
                    ProvisionPhase::Deleting,
                    0,
                )
                .await?;
        }
        self.executor.run(backend, &plan.steps).await?;
        if let Some(r) = record {
            self.records.delete(backend, ProvisionKind::Snapshot, &r.spec.name).await?;
        }
        Ok(())
    }

    /// Remove the snapshot a request named `name` made, of whichever
    /// backend made it; none is success. For a VolumeSnapshot deleted
    /// before its content recorded what was made.
    pub async fn forget_snapshot(&self, name: &str) -> Result<(), Failure> {
        for backend in self.backends().into_iter().filter(|b| self.provisions(b)) {
            if let Some(r) = self.records.get(&backend, ProvisionKind::Snapshot, name).await? {
                self.delete_snapshot(&backend, &r.spec.id).await?;
                // A record left Creating (its steps never ran) goes too.
                self.records.delete(&backend, ProvisionKind::Snapshot, name).await?;
            }
        }
        Ok(())
    }

    /// The snapshots this controller made and holds ready, optionally only
    /// the one with `id` or those of volume `source`, in a stable order.
    pub async fn snapshots(
        &self,
        backend: &str,
        id: Option<&str>,
        source: Option<&str>,
    ) -> Result<Vec<MadeSnapshot>, Failure> {
        let mut list: Vec<MadeSnapshot> = self
            .records
            .list(backend, ProvisionKind::Snapshot)
            .await?
            .into_iter()
            .filter(|r| r.spec.phase == ProvisionPhase::Ready)
            .filter(|r| id.is_none_or(|id| r.spec.id == id))
            .filter(|r| source.is_none_or(|s| r.spec.source.as_deref() == Some(s)))
            .map(|r| records::snapshot_of(&r.spec))
            .collect();
        list.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(list)
    }

    /// Whether volume `id` is one this controller made and holds ready.
    pub async fn volume_exists(&self, backend: &str, id: &str) -> Result<bool, Failure> {
        Ok(self
            .records
            .by_id(backend, ProvisionKind::Volume, id)
            .await?
            .is_some_and(|r| r.spec.phase == ProvisionPhase::Ready))
    }

    /// For a class placed on local volumes, bytes a new volume could get
    /// on each of `nodes`: one look at what is free for all of them (not
    /// one per node), then the policy asked per node.
    pub async fn local_capacities(
        &self,
        backend: &str,
        parameters: &BTreeMap<String, String>,
        class: &str,
        nodes: &[String],
    ) -> Result<Vec<(String, Option<u64>)>, Failure> {
        self.plugin(backend)?;
        let free = self.local_candidates(backend, parameters, Some(class), None, None).await?;
        let given = self.parameters(backend, parameters).await?;
        let mut out = Vec::with_capacity(nodes.len());
        for node in nodes {
            let request = CapacityRequest {
                parameters: given.clone(),
                segment: Some(vec![(local::NODE_KEY.to_string(), node.clone())]),
                local_volumes: free
                    .iter()
                    .filter(|c| c.volume.node == *node)
                    .map(|c| c.volume.clone())
                    .collect(),
            };
            out.push((node.clone(), self.ask(backend, move |p| p.capacity(&request)).await?));
        }
        Ok(out)
    }

    /// Bytes a new volume could get where asked (`class`: the
    /// StorageClass asked about, if known); none when unknown.
    pub async fn capacity(
        &self,
        backend: &str,
        parameters: &BTreeMap<String, String>,
        class: Option<&str>,
        segment: Option<Segment>,
    ) -> Result<Option<u64>, Failure> {
        self.plugin(backend)?;
        let mut local_volumes = Vec::new();
        if self.places_locally(backend) {
            let nodes = local::nodes_of(segment.as_slice());
            local_volumes = self
                .local_candidates(backend, parameters, class, nodes.as_ref(), None)
                .await?
                .into_iter()
                .map(|c| c.volume)
                .collect();
        }
        let request = CapacityRequest {
            parameters: self.parameters(backend, parameters).await?,
            segment,
            local_volumes,
        };
        self.ask(backend, move |p| p.capacity(&request)).await
    }
}

/// A name held by a running request.
struct Held<'a> {
    set: &'a Mutex<BTreeSet<String>>,
    key: String,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
    }
}
