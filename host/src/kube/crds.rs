//! The custom resources of group `volagent.io`: attachment records (the
//! ledger), per-node cleanup lists, and storage clusters.

use kube::CustomResource;
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const GROUP: &str = "volagent.io";
/// Held on a StorageCluster until no attachment record refers to it.
pub const CLEANUP_FINALIZER: &str = "volagent.io/node-cleanup";

/// A volume's access mode, spelled as Kubernetes spells it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum AccessMode {
    ReadWriteOnce,
    ReadOnlyMany,
    ReadWriteMany,
    ReadWriteOncePod,
}

/// One pod using the volume.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerEntry {
    pub node: String,
    pub pod_namespace: String,
    pub pod: String,
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    /// The pod's mount dir, as kubelet gave it.
    pub mount_dir: String,
    #[serde(default)]
    pub read_only: bool,
    /// RFC 3339 time the consumer was recorded.
    pub since: String,
}

/// Who uses a volume: the ledger's record, named after the PV. Agents
/// settle races on it with create (AlreadyExists) and resourceVersion
/// (Conflict) alone.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "Attachment",
    plural = "attachments",
    shortname = "vatt",
    printcolumn = r#"{"name":"Nodes","type":"string","jsonPath":".spec.consumers[*].node"}"#,
    printcolumn = r#"{"name":"Pods","type":"string","jsonPath":".spec.consumers[*].pod"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.accessMode"}"#,
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AttachmentSpec {
    pub backend: String,
    pub access_mode: AccessMode,
    /// The StorageCluster the volume lives on, if it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_cluster: Option<String>,
    /// What the volume is: its filesystem type and the backend's options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<VolumeSourceSpec>,
    #[serde(default)]
    pub consumers: Vec<ConsumerEntry>,
    /// Each node's client of the storage system for the volume (an RBD
    /// helper's Ceph client): how other nodes place the image's watchers,
    /// and what a take-over blocklists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storage_clients: Vec<StorageClientEntry>,
}

/// A node's storage client, as the storage system names it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageClientEntry {
    pub node: String,
    /// Its global id ("client.<id>" in Ceph; int64 as librbd reports it,
    /// and a schema without the minimum an unsigned field would add).
    pub id: i64,
    /// Its address, as blocklisting takes it ("ip:port/nonce").
    pub address: String,
}

/// A volume's filesystem type and backend options, as the PV gives them.
/// (Absent rather than empty: kube-apiserver 1.20 reads `""` as null.)
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSourceSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub options: Option<BTreeMap<String, String>>,
}

/// Why an attachment was put on a node's cleanup list.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum CleanupReason {
    /// The Node object was deleted.
    NodeGone,
}

/// An attachment taken from the ledger that its node must still undo.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CleanupEntry {
    pub volume: String,
    pub backend: String,
    pub access_mode: AccessMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_cluster: Option<String>,
    pub consumer: ConsumerEntry,
    pub reason: CleanupReason,
    /// RFC 3339 time the entry was moved here.
    pub moved_at: String,
}

/// The attachments a node must clean up when its agent runs again, named
/// after the node. The controller appends; the node's agent works them off.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "NodeCleanup",
    plural = "nodecleanups",
    shortname = "vnc",
    printcolumn = r#"{"name":"Entries","type":"string","jsonPath":".spec.entries[*].volume"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeCleanupSpec {
    #[serde(default)]
    pub entries: Vec<CleanupEntry>,
}

/// A secret holding a backend's credentials.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretReference {
    pub namespace: String,
    pub name: String,
}

/// A storage system volumes live on (a Ceph cluster, Gluster servers, an
/// NBD server), named by volumes in their `storageCluster` option.
/// Deleting one makes every node force-clean its volumes; the finalizer
/// goes when no attachment record names it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "StorageCluster",
    plural = "storageclusters",
    shortname = "vsc",
    status = "StorageClusterStatus",
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend"}"#,
    printcolumn = r#"{"name":"Endpoints","type":"string","jsonPath":".spec.endpoints"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct StorageClusterSpec {
    /// The backend serving its volumes, e.g. "rbd".
    pub backend: String,
    /// Ceph monitors, Gluster servers, the NBD server: host[:port] each.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// The nodes' credentials (Ceph: a user that may read the maps and use
    /// the pool's images, not blocklist). Agents read it only from their own
    /// namespace: a Secret elsewhere is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretReference>,
    /// What only the controller uses: a user that may fence other nodes'
    /// clients (Ceph: `osd blocklist`). Agents never read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller_credentials: Option<ControllerCredentials>,
    /// Backend-specific settings.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

/// The storage user the controller acts as, and where its key is.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControllerCredentials {
    /// The user's name (Ceph: without `client.`).
    pub user: String,
    /// The Secret holding its key (under the cluster's `secretKey`
    /// parameter, default `key`), in a namespace agents cannot read.
    pub secret_ref: SecretReference,
}

/// A node's agent asks the controller to cut a gone node's storage client
/// off before it takes that node's volume over: nodes hold no credentials
/// that may fence another node. The controller checks the request against
/// the volume's Attachment and the gone node's Node, fences with its own
/// credentials, and answers in the status; the requester deletes it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "FenceRequest",
    plural = "fencerequests",
    shortname = "vfr",
    status = "FenceRequestStatus",
    printcolumn = r#"{"name":"Volume","type":"string","jsonPath":".spec.volume"}"#,
    printcolumn = r#"{"name":"Requester","type":"string","jsonPath":".spec.requester"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.node"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct FenceRequestSpec {
    /// The volume (its Attachment's name) being taken over.
    pub volume: String,
    /// The node whose agent asks.
    pub requester: String,
    /// The gone node whose client is to be fenced.
    pub node: String,
    /// The client's address, as the Attachment records it.
    pub address: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum FencePhase {
    Fenced,
    Refused,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FenceRequestStatus {
    pub phase: FencePhase,
    /// Why it was refused, or what was done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// RFC 3339 time of the answer.
    pub answered_at: String,
}

impl FenceRequest {
    /// The request's name: one per volume and client, a valid object name
    /// whatever the volume is called.
    pub fn name_for(volume: &str, address: &str) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(format!("{volume}\n{address}").as_bytes());
        format!("fence-{}", &hex::encode(digest)[..32])
    }
}

/// The controller's record of a volume or snapshot it provisions: written
/// (phase Creating) before the storage is touched, Ready once made, and
/// deleted after the storage is removed. It settles a retried request by
/// name, lists snapshots, and lets a restarted controller find what a
/// create it did not finish left behind. Only the controller reads or
/// writes these.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "ProvisionRecord",
    plural = "provisionrecords",
    shortname = "vpr",
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend"}"#,
    printcolumn = r#"{"name":"Kind","type":"string","jsonPath":".spec.kind"}"#,
    printcolumn = r#"{"name":"Name","type":"string","jsonPath":".spec.name"}"#,
    printcolumn = r#"{"name":"Id","type":"string","jsonPath":".spec.id"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".spec.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ProvisionRecordSpec {
    pub backend: String,
    pub kind: ProvisionKind,
    /// The name it was asked for (CSI name: pvc-<uid>, snapshot-<uid>).
    pub name: String,
    /// The id the policy gave it.
    pub id: String,
    /// A volume's content source, a snapshot's volume; by id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Bytes asked for (a volume: required; 0 unspecified) and made.
    #[serde(default)]
    pub required_bytes: i64,
    #[serde(default)]
    pub limit_bytes: i64,
    #[serde(default)]
    pub capacity_bytes: i64,
    /// A fingerprint of the rest of a volume's request (parameters,
    /// access, source): the same name with another request is refused.
    /// (Absent rather than empty: kube-apiserver 1.20 reads `""` as null.)
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_digest: String,
    pub phase: ProvisionPhase,
    /// RFC 3339 time the record was written.
    pub created: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ProvisionKind {
    Volume,
    Snapshot,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ProvisionPhase {
    Creating,
    Ready,
    Deleting,
}

impl ProvisionRecord {
    /// The record's object name: one per backend, kind and requested
    /// name, a valid object name whatever the name is.
    pub fn name_for(backend: &str, kind: ProvisionKind, name: &str) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(format!("{backend}\n{kind:?}\n{name}").as_bytes());
        let prefix = match kind {
            ProvisionKind::Volume => "vol",
            ProvisionKind::Snapshot => "snap",
        };
        format!("{prefix}-{}", &hex::encode(digest)[..32])
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageClusterStatus {
    /// Active, or Deleting while nodes clean up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Nodes that still hold volumes of a deleted cluster.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending_nodes: Vec<String>,
}

/// Held on a local volume's PV from its release until its wipe is done.
pub const LOCAL_WIPE_FINALIZER: &str = "volagent.io/local-wipe";
/// The backend whose policy decides local volumes' plans.
pub const LOCAL_BACKEND: &str = "local-pv";
/// Labels on every local PV the controller makes: its node and its class.
pub const NODE_LABEL: &str = "volagent.io/local-node";
pub const CLASS_LABEL: &str = "volagent.io/local-class";
/// Who provisioned a local PV, as kube-controller-manager reads it: an
/// external provisioner, so that its PV controller leaves the deletion to us.
pub const PROVISIONER: &str = "local.volagent.io";

/// What the controller asks of a node's agent about one local volume.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum LocalOperationKind {
    /// Wipe the released volume, so that it can be offered again.
    Delete,
}

/// An operation the controller requests (the spec is the controller's).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocalOperation {
    /// The discovered volume's name (its static PV's name too).
    pub volume: String,
    pub kind: LocalOperationKind,
    /// The released PV's UID: the operation is about that PV, not a later
    /// one of the same name.
    #[serde(rename = "pvUID")]
    pub pv_uid: String,
    /// RFC 3339 time it was requested.
    pub requested_at: String,
    /// A provisioned volume's PV (`pvc-<claim uid>`, a CSI volume whose
    /// handle is `volume`), asked for by the provisioner; absent for a
    /// discovered volume's own PV, named `volume`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv: Option<String>,
}

impl LocalOperation {
    /// The PV the operation is about.
    pub fn pv_name(&self) -> &str {
        self.pv.as_deref().unwrap_or(&self.volume)
    }

    /// Whether `status` is about this request.
    pub fn is(&self, status: &LocalOperationStatus) -> bool {
        self.volume == status.volume
            && self.pv_uid == status.pv_uid
            && self.requested_at == status.requested_at
    }
}

/// Where an operation stands (the status is the agent's).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum LocalOperationPhase {
    InProgress,
    Complete,
    Error,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LocalOperationStatus {
    pub volume: String,
    #[serde(rename = "pvUID")]
    pub pv_uid: String,
    /// The request's time: a request made again is a new one.
    pub requested_at: String,
    pub phase: LocalOperationPhase,
    /// How many times it was started (an agent restart starts it again).
    pub attempt: i64,
    /// The wipe method the volume's policy chose, once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// Why it failed, or what it is doing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

/// A local volume the node's agent discovered.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiscoveredVolume {
    /// Its PV's name (a hash of node, class and path).
    pub name: String,
    /// Its StorageClass.
    pub class: String,
    /// Its path in the discovery dir.
    pub path: String,
    /// Filesystem (a mount point), Block (a device) or File (an image).
    pub kind: String,
    /// The filesystem of a mount point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    /// A block device's node under /dev, resolved at discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// A block device's stable identity, which the data path checks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// Rounded down as the PV states it (a Kubernetes quantity).
    pub capacity: String,
}

/// An entry of a discovery dir that is not a volume.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct SkippedEntry {
    pub path: String,
    pub why: String,
}

/// A node's local volumes, named after the node: the controller writes the
/// operations (spec), the node's agent the discovered list and how each
/// operation stands (status) — never the same field.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "NodeLocalVolumes",
    plural = "nodelocalvolumes",
    shortname = "vlv",
    status = "NodeLocalVolumesStatus",
    printcolumn = r#"{"name":"Volumes","type":"integer","jsonPath":".status.volumeCount"}"#,
    printcolumn = r#"{"name":"Wiping","type":"integer","jsonPath":".status.wiping"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","jsonPath":".status.failed"}"#,
    printcolumn = r#"{"name":"Skipped","type":"integer","jsonPath":".status.skippedCount","priority":1}"#,
    printcolumn = r#"{"name":"Scanned","type":"date","jsonPath":".status.scannedAt"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocalVolumesSpec {
    #[serde(default)]
    pub operations: Vec<LocalOperation>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeLocalVolumesStatus {
    #[serde(default)]
    pub volumes: Vec<DiscoveredVolume>,
    #[serde(default)]
    pub operations: Vec<LocalOperationStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedEntry>,
    #[serde(default)]
    pub volume_count: i64,
    #[serde(default)]
    pub wiping: i64,
    #[serde(default)]
    pub failed: i64,
    #[serde(default)]
    pub skipped_count: i64,
    /// RFC 3339 time of the scan the list is from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scanned_at: Option<String>,
}

/// What a `BackendPolicy`'s candidate does on every node.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RolloutMode {
    /// The candidate runs in the shadow of the serving version: its answers
    /// are compared, never run.
    #[default]
    Shadow,
    /// The candidate serves; the serving version is kept for a rollback.
    Serve,
}

/// A backend's name: a DNS label.
fn backend_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "maxLength": 63, "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" })
}

/// A sha256 as the spec takes it: 64 lowercase hex digits.
fn sha256_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "pattern": "^[0-9a-f]{64}$" })
}

fn optional_sha256_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "nullable": true, "pattern": "^[0-9a-f]{64}$" })
}

/// Each node's entry written by that node's agent alone (server-side apply
/// merges them by node).
fn node_entries(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let item = generator.subschema_for::<NodeRollout>();
    schemars::json_schema!({
        "type": "array",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["node"]
    })
}

/// One backend's policy versions for every node, chosen by the admin: the
/// version that serves and a candidate beside it, each by sha256. Every
/// agent trusts both digests for the backend, and puts them in place in
/// its plugin dir from the versions it has (`--policy-store`); each says in
/// the status what serves on its node and what the shadow saw.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "BackendPolicy",
    plural = "backendpolicies",
    shortname = "vbp",
    status = "BackendPolicyStatus",
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.mode"}"#,
    printcolumn = r#"{"name":"Serving","type":"string","jsonPath":".spec.serving","priority":1}"#,
    printcolumn = r#"{"name":"Candidate","type":"string","jsonPath":".spec.candidate","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BackendPolicySpec {
    /// The backend (a DNS label): its policy's `info` name. One object
    /// per backend: agents apply none of two that name the same one.
    #[schemars(schema_with = "backend_schema")]
    pub backend: String,
    /// The sha256 of the version that serves (in mode Shadow) or is kept
    /// for a rollback (in mode Serve).
    #[schemars(schema_with = "sha256_schema")]
    pub serving: String,
    /// The sha256 of the candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional_sha256_schema")]
    pub candidate: Option<String>,
    /// Shadow (the default) or Serve; without a candidate, the serving
    /// version serves either way.
    #[serde(default)]
    pub mode: RolloutMode,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackendPolicyStatus {
    /// One entry per node, each written by that node's agent.
    #[serde(default)]
    #[schemars(schema_with = "node_entries")]
    pub nodes: Vec<NodeRollout>,
}

/// How the rollout stands on one node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeRollout {
    pub node: String,
    /// The sha256 of the version serving the backend there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<String>,
    /// The sha256 of the candidate running in the shadow there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<String>,
    /// Calls the shadow compared, and how many were answered otherwise.
    #[serde(default)]
    pub compared: i64,
    #[serde(default)]
    pub differences: i64,
    /// Applied, or Pending (waiting for a version the node does not have,
    /// or for the agent's checks), or Refused (the version failed them).
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// RFC 3339 time of this entry.
    pub updated_at: String,
}

/// Every CRD with the file name `deploy/crds/` keeps it under.
pub fn all() -> Vec<(String, String)> {
    [
        Attachment::crd(),
        NodeCleanup::crd(),
        StorageCluster::crd(),
        NodeLocalVolumes::crd(),
        FenceRequest::crd(),
        ProvisionRecord::crd(),
        BackendPolicy::crd(),
    ]
    .into_iter()
    .map(|crd| {
        let name = crd.metadata.name.clone().unwrap_or_default();
        // Serialising a derived CRD cannot fail: it is plain data.
        let yaml = serde_norway::to_string(&crd).unwrap_or_default();
        (format!("{name}.yaml"), yaml)
    })
    .collect()
}

/// All CRDs as one YAML stream.
pub fn yaml_stream() -> String {
    yaml_stream_of(all())
}

/// CRD files as one YAML stream.
pub fn yaml_stream_of(files: Vec<(String, String)>) -> String {
    files.into_iter().map(|(_, y)| format!("---\n{y}")).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `files` (generated) are exactly what `deploy/<dir>` holds.
    pub(crate) fn assert_generated(dir: &str, files: Vec<(String, String)>, regenerate: &str) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(dir);
        for (file, yaml) in &files {
            let committed = std::fs::read_to_string(path.join(file)).unwrap_or_else(|e| {
                panic!("deploy/{dir}/{file}: {e}; regenerate with `{regenerate}`")
            });
            assert_eq!(
                &committed, yaml,
                "deploy/{dir}/{file} is stale; regenerate with `{regenerate}`"
            );
        }
        let mut on_disk: Vec<String> = std::fs::read_dir(&path)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f != "kustomization.yaml")
            .collect();
        on_disk.sort();
        let mut expected: Vec<String> = files.into_iter().map(|(f, _)| f).collect();
        expected.sort();
        assert_eq!(on_disk, expected, "deploy/{dir}/ holds exactly the generated CRDs");
    }

    #[test]
    fn deploy_crds_are_the_generated_ones() {
        assert_generated("crds", all(), "volagent crds --dir deploy/crds");
    }

    #[test]
    fn records_serialise_with_kubernetes_spelling() {
        let spec = AttachmentSpec {
            backend: "rbd".into(),
            access_mode: AccessMode::ReadWriteOnce,
            storage_cluster: None,
            source: Some(VolumeSourceSpec {
                fs_type: Some("ext4".into()),
                options: Some([("pool".into(), "rbd".into())].into()),
            }),
            consumers: vec![ConsumerEntry {
                node: "n1".into(),
                pod_namespace: "default".into(),
                pod: "web-0".into(),
                pod_uid: "u1".into(),
                mount_dir: "/var/lib/kubelet/pods/u1/volumes/volagent~rbd/pv1".into(),
                read_only: false,
                since: "2026-01-01T00:00:00Z".into(),
            }],
            storage_clients: vec![],
        };
        let v = serde_json::to_value(&spec).unwrap();
        assert_eq!(v["accessMode"], "ReadWriteOnce");
        assert_eq!(v["source"]["fsType"], "ext4");
        assert_eq!(v["source"]["options"]["pool"], "rbd");
        assert_eq!(v["consumers"][0]["podUID"], "u1");
        assert_eq!(
            v["consumers"][0]["mountDir"],
            "/var/lib/kubelet/pods/u1/volumes/volagent~rbd/pv1"
        );
    }
}
