//! What an operation asks of the cluster it runs in, when there is one:
//! what a volume is (its PV, never the pod's options), how it reaches its
//! storage system, the facts of nodes, Events on pods, and fencing another
//! node's client (the controller's to do). The kube edge implements it.

use crate::model::{AccessMode, KeyValue, NodeFacts};
use crate::secret::Secrets;
use std::time::Duration;

/// The option a guest finds a StorageCluster's endpoints in (comma-separated).
pub const ENDPOINTS_OPTION: &str = "endpoints";

/// A volume as the cluster defines it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterVolume {
    /// The name the volume goes by on nodes and in the ledger: the PV's
    /// name, or for an inline volume one made of the pod's UID and the
    /// volume's name (no two pods share an inline volume by naming it).
    pub key: String,
    pub access_mode: AccessMode,
    pub fs_type: String,
    /// The backend's options.
    pub options: Vec<KeyValue>,
    /// The PV (or the inline volume) says read-only.
    pub read_only: bool,
}

/// What a request for volume `name` of backend `backend` by pod
/// `namespace/pod` (`pod_uid`, as kubelet sent them) on `node` gets.
pub struct VolumeRequest<'a> {
    pub backend: &'a str,
    pub name: &'a str,
    pub namespace: &'a str,
    pub pod: &'a str,
    pub pod_uid: &'a str,
    pub node: &'a str,
    /// An admin enabled inline volumes of this backend on this node.
    pub inline_allowed: bool,
}

/// The ledger key of `pod_uid`'s inline volume `name`.
pub fn inline_key(pod_uid: &str, name: &str) -> String {
    format!("inline-{pod_uid}-{name}")
}

/// What a volume gets from the StorageCluster it names.
#[derive(Debug, Default)]
pub struct Connection {
    /// Options the volume gets where it does not set them itself: the
    /// endpoints and the backend's parameters.
    pub options: Vec<(String, String)>,
    /// The credentials, values kept host-side.
    pub secrets: Secrets,
}

/// Why the cluster did not answer what was asked.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The cluster could not be asked (the API server is away).
    #[error("{0}")]
    Unavailable(String),
    /// What the cluster says does not allow it.
    #[error("{0}")]
    Refused(String),
}

#[async_trait::async_trait]
pub trait ClusterView: Send + Sync {
    /// Facts of the nodes named, one each, in order.
    async fn node_facts(&self, names: &[&str]) -> Result<Vec<NodeFacts>, ClusterError>;
    /// What the volume asked for is, as the cluster defines it.
    async fn volume(&self, req: &VolumeRequest<'_>) -> Result<ClusterVolume, ClusterError>;
    /// The connection of StorageCluster `name` for `backend`.
    async fn storage_connection(
        &self,
        name: &str,
        backend: &str,
    ) -> Result<Connection, ClusterError>;
    /// Have the controller fence `node`'s client `address` for `volume`,
    /// waiting at most `wait`.
    async fn fence_client(
        &self,
        volume: &str,
        node: &str,
        address: &str,
        wait: Duration,
    ) -> Result<(), String>;
    /// An Event on a pod; best effort, never fails the operation.
    async fn pod_event(
        &self,
        namespace: &str,
        pod: &str,
        pod_uid: &str,
        warning: bool,
        reason: &str,
        message: &str,
    );
}
