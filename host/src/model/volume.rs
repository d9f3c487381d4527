//! What a call is about: the volume, its consumers and holders, the node's
//! facts and paths, and what the host answers when asked.

use serde::{Deserialize, Serialize};

/// Kubernetes access mode of a persistent volume. Semantics are
/// Kubernetes', not stricter: ReadWriteOnce is per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AccessMode {
    ReadWriteOnce,
    ReadOnlyMany,
    ReadWriteMany,
    ReadWriteOncePod,
}

impl AccessMode {
    /// Kubernetes' spelling.
    pub fn parse(s: &str) -> Option<AccessMode> {
        Some(match s {
            "ReadWriteOnce" => AccessMode::ReadWriteOnce,
            "ReadOnlyMany" => AccessMode::ReadOnlyMany,
            "ReadWriteMany" => AccessMode::ReadWriteMany,
            "ReadWriteOncePod" => AccessMode::ReadWriteOncePod,
            _ => return None,
        })
    }

    /// The Kubernetes name.
    pub fn name(self) -> &'static str {
        match self {
            AccessMode::ReadWriteOnce => "ReadWriteOnce",
            AccessMode::ReadOnlyMany => "ReadOnlyMany",
            AccessMode::ReadWriteMany => "ReadWriteMany",
            AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
        }
    }
}

/// How a volume reaches its consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum VolumeMode {
    /// A filesystem, mounted at the consumer's dir.
    #[default]
    Filesystem,
    /// The raw block device, published at the consumer's path.
    Block,
}

/// A key/value pair; option values are strings, as Flexvolume sends them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyValue {
    pub key: String,
    pub value: String,
}

/// The volume a call is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    /// PersistentVolume name (or the inline volume's name).
    pub name: String,
    /// Backend name, e.g. "rbd".
    pub backend: String,
    pub access_mode: AccessMode,
    /// Filesystem type asked for; empty when unspecified (and for block).
    pub fs_type: String,
    /// Absent in records written before contract 0.5: a filesystem.
    #[serde(default)]
    pub mode: VolumeMode,
    /// Mount options the volume asks for (a PV's mountOptions); absent in
    /// records written before contract 0.5.
    #[serde(default)]
    pub mount_flags: Vec<String>,
    /// The backend's own options.
    pub options: Vec<KeyValue>,
    /// Names of the keys of the volume's secret; values never reach guests.
    pub secret_keys: Vec<String>,
}

impl Volume {
    /// The value of option `key`, if given.
    pub fn option(&self, key: &str) -> Option<&str> {
        self.options.iter().find(|kv| kv.key == key).map(|kv| kv.value.as_str())
    }
}

/// One pod using a volume on one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Consumer {
    pub node: String,
    pub pod_namespace: String,
    pub pod: String,
    pub pod_uid: String,
    /// The pod's mount dir for this volume, as kubelet gave it.
    pub mount_dir: String,
    pub read_only: bool,
    /// The group the volume should be writable by (CSI volume_mount_group).
    #[serde(default)]
    pub mount_group: Option<String>,
}

/// A consumer recorded in the attachment ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub consumer: Consumer,
    /// When the consumer was recorded, RFC 3339.
    pub since: String,
}

/// What the host knows of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFacts {
    pub name: String,
    /// False when the Node object is gone from the cluster.
    pub exists: bool,
    pub ready: bool,
    /// The node carries the `node.kubernetes.io/out-of-service` taint.
    pub out_of_service: bool,
}

/// Paths on this node a plan for one volume may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePaths {
    pub kubelet_root: String,
    /// <kubelet-root>/plugins/volagent/<backend>/mounts/<volume>
    pub staging_dir: String,
    /// A per-volume dir owned by the agent, for logs of mount helpers.
    pub state_dir: String,
    /// Dirs under which local volumes are discovered (local-pv only).
    pub discovery_dirs: Vec<String>,
}

/// What is at a path on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PathKind {
    Missing,
    RegularFile,
    Directory,
    BlockDevice,
    Other,
}

/// A mount-table entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountEntry {
    pub source: String,
    pub target: String,
    pub fs_type: String,
    pub read_only: bool,
}

/// A client watching a network block image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watcher {
    /// Client address as the storage cluster reports it.
    pub address: String,
    /// Client id, e.g. "client.4135".
    pub client: String,
    /// Node the host resolved the address to.
    pub node: Option<String>,
}

/// Severity of a guest's log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}
