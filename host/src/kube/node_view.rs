//! The node agent's view of the cluster, as operations ask for it
//! ([`crate::ops::cluster::ClusterView`]): the kube API's answers and errors
//! in the operations' terms.

use super::cluster::Cluster;
use super::volumes::VolumeError;
use crate::model::NodeFacts;
use crate::ops::cluster::{ClusterError, ClusterView, ClusterVolume, Connection, VolumeRequest};
use std::time::Duration;

fn cluster_error(e: VolumeError) -> ClusterError {
    match e {
        VolumeError::Api { .. } => ClusterError::Unavailable(e.to_string()),
        VolumeError::Refused(_) => ClusterError::Refused(e.to_string()),
    }
}

#[async_trait::async_trait]
impl ClusterView for Cluster {
    async fn node_facts(&self, names: &[&str]) -> Result<Vec<NodeFacts>, ClusterError> {
        Cluster::node_facts(self, names).await.map_err(|e| ClusterError::Unavailable(e.to_string()))
    }

    async fn volume(&self, req: &VolumeRequest<'_>) -> Result<ClusterVolume, ClusterError> {
        Cluster::volume(self, req).await.map_err(cluster_error)
    }

    async fn storage_connection(
        &self,
        name: &str,
        backend: &str,
    ) -> Result<Connection, ClusterError> {
        let c = Cluster::storage_connection(self, name, backend).await.map_err(cluster_error)?;
        Ok(Connection { options: c.options(), secrets: c.secrets })
    }

    async fn fence_client(
        &self,
        volume: &str,
        node: &str,
        address: &str,
        wait: Duration,
    ) -> Result<(), String> {
        Cluster::fence_client(self, volume, node, address, wait).await
    }

    async fn pod_event(
        &self,
        namespace: &str,
        pod: &str,
        pod_uid: &str,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        Cluster::pod_event(self, namespace, pod, pod_uid, warning, reason, message).await;
    }
}
