//! What a policy is told before it decides: the facts of the nodes that
//! hold a volume, the devices its PV names (verified), and what its guest
//! may ask of this node ([`NodeQueries`]).

use super::execute::blocking;
use super::node::Node;
use super::queries::NodeQueries;
use super::{Failure, FailureKind, cluster};
use crate::model::{Holder, NodeFacts, PathRoot, Volume};
use crate::policy::Plugin;
use crate::secret::Secrets;
use crate::sys::Sys;
use crate::sys::rbd_export::CephClient;
use std::sync::Arc;
use std::time::Duration;

/// The device a discovered disk's PV names, checked to be that disk (by
/// its identity) before any policy sees the volume; none for other volumes.
pub(crate) async fn verified_devices(sys: &Sys, volume: &Volume) -> Result<Vec<String>, Failure> {
    let Some(device) = crate::policy::validate::verified_device(volume) else {
        return Ok(Vec::new());
    };
    let identity = volume
        .options
        .iter()
        .find(|kv| kv.key == crate::local::discovery::IDENTITY_OPTION)
        .map(|kv| kv.value.clone())
        .unwrap_or_default();
    let (path, inspect) = (device.clone(), sys.inspect.clone());
    blocking(move || {
        crate::local::discovery::verify_device(
            inspect.as_ref(),
            std::path::Path::new(&path),
            &identity,
        )
    })
    .await?
    .map_err(|m| Failure::new(FailureKind::Denied, format!("volume {}: {m}", volume.name)))?;
    Ok(vec![device])
}

/// What `plugin`'s guest may ask this call: about the dirs it declared,
/// within its own deadline.
pub(crate) fn queries(node: &Node, plugin: &Plugin, facts: &[NodeFacts]) -> Arc<NodeQueries> {
    Arc::new(node_queries(node, plugin, facts))
}

/// [`queries`], to be told more before the call.
pub(crate) fn node_queries(node: &Node, plugin: &Plugin, facts: &[NodeFacts]) -> NodeQueries {
    let config = &node.config;
    let roots = plugin
        .info()
        .capabilities
        .path_roots
        .iter()
        .flat_map(|root| match root {
            PathRoot::PodMountDir => vec![config.kubelet_root.join("pods")],
            PathRoot::StagingDir => vec![
                config.kubelet_root.join("plugins/volagent").join(plugin.name()).join("mounts"),
            ],
            PathRoot::StateDir => vec![config.state_dir.join("volumes")],
            PathRoot::DiscoveryDirs => config.discovery_dirs.clone(),
        })
        .collect();
    let deadline = plugin.limits().deadline;
    NodeQueries::new(config.node.clone(), node.sys.clone(), roots, deadline)
        .with_facts(facts.to_vec())
}

/// Facts of this node and of every holder's: from the cluster when
/// there is one, else this node's own view.
pub(crate) async fn node_facts(node: &Node, holders: &[Holder]) -> Result<Vec<NodeFacts>, Failure> {
    let mut names: Vec<&str> = holders.iter().map(|h| h.consumer.node.as_str()).collect();
    names.push(&node.config.node);
    names.sort();
    names.dedup();
    match &node.cluster {
        Some(cluster) => cluster.node_facts(&names).await.map_err(|e| {
            Failure::new(
                FailureKind::Unavailable,
                format!("reading Nodes from the Kubernetes API: {e}"),
            )
        }),
        None => {
            let q = NodeQueries::new(
                node.config.node.clone(),
                node.sys.clone(),
                Vec::new(),
                Duration::ZERO,
            );
            Ok(names.into_iter().map(|n| crate::policy::Queries::node_state(&q, n)).collect())
        }
    }
}

/// How the host reaches the Ceph cluster of a volume for the guest's
/// `image-watchers`: its `monitors` (or its StorageCluster's endpoints),
/// `user` (default admin) and, from its secret, the key named by
/// `secretKey` (default "key") — the rbd backend's option names. None when
/// the volume names no monitors.
pub(crate) fn ceph_client(volume: &Volume, secrets: &Secrets) -> Option<CephClient> {
    let get = |k: &str| volume.option(k);
    let listed = get("monitors").or(get(cluster::ENDPOINTS_OPTION))?;
    let monitors: Vec<&str> = listed.split(',').map(str::trim).filter(|m| !m.is_empty()).collect();
    if monitors.is_empty() {
        return None;
    }
    Some(CephClient {
        conf: None,
        monitors: Some(monitors.join(",")),
        user: get("user").unwrap_or("admin").to_string(),
        keyring: None,
        key: secrets.get(get("secretKey").unwrap_or("key")).cloned(),
    })
}
