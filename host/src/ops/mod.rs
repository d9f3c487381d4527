//! The operation pipeline: small steps over an operation's context
//! ([`context::Operation`]) and the node's services ([`node::Node`]):
//! policy → devices → lock → fence → record + plan → mount record → execute,
//! with the record and the mount record rolled back when execution fails
//! ([`attach`]), and its inverse ([`detach`]). The edges (Flexvolume
//! socket, CSI, the cluster) parse their wire formats into the typed
//! requests of [`request`] and [`csi`] and map [`Failure`] back.

mod attach;
pub mod cleanup;
pub mod cluster;
mod context;
pub mod csi;
mod define;
mod detach;
pub mod events;
mod execute;
mod failure;
mod fence;
mod helper_clients;
pub mod holdings;
pub mod mount_records;
pub mod node;
mod plan;
pub mod queries;
pub mod reconcile;
mod record;
pub mod release;
pub mod request;
mod takeover;

use crate::policy::Plugin;
use cluster::{ClusterError, ClusterView};
pub use execute::served;
pub use failure::{Done, Failure, FailureKind, MAX_MESSAGE};
use mount_records::MountRecords;
pub use node::{Node, NodeConfig, loop_tag};
pub use record::STORAGE_CLUSTER_OPTION;
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// What the cluster answered, as the failure of the request about `what`.
fn cluster_failure(what: &str, e: ClusterError) -> Failure {
    let kind = match e {
        ClusterError::Unavailable(_) => FailureKind::Unavailable,
        ClusterError::Refused(_) => FailureKind::Denied,
    };
    Failure::new(kind, format!("{what}: {e}"))
}

fn internal(e: impl std::fmt::Display) -> Failure {
    Failure::new(FailureKind::Failed, e.to_string())
}

/// This node's agent: the node's services and the backends it serves.
/// Its operations are the pipelines of [`attach`] and [`detach`] and the
/// passes of [`reconcile`], [`cleanup`], [`release`] and [`csi`].
pub struct Agent {
    pub node: Node,
    plugins: RwLock<BTreeMap<String, Arc<Plugin>>>,
}

impl Agent {
    pub fn new(
        config: NodeConfig,
        plugins: Vec<Plugin>,
        ledger: Arc<dyn crate::ledger::Ledger>,
        mount_records: MountRecords,
        sys: crate::sys::Sys,
        plan_deadline: Duration,
    ) -> Agent {
        let plugins = plugins.into_iter().map(|p| (p.name().to_string(), Arc::new(p))).collect();
        Agent {
            node: Node {
                config,
                ledger,
                mount_records: Arc::new(mount_records),
                sys,
                locks: node::Locks::default(),
                plan_deadline,
                cluster: None,
            },
            plugins: RwLock::new(plugins),
        }
    }

    /// Read node facts and PVs from `cluster`, and tell it of failures.
    pub fn with_cluster(mut self, cluster: Arc<dyn ClusterView>) -> Agent {
        self.node.cluster = Some(cluster);
        self
    }

    pub fn plugin(&self, backend: &str) -> Result<Arc<Plugin>, Failure> {
        let plugins = self.plugins.read().unwrap_or_else(|p| p.into_inner());
        plugins.get(backend).cloned().ok_or_else(|| {
            let known: Vec<&str> = plugins.keys().map(String::as_str).collect();
            Failure::new(
                FailureKind::UnknownBackend,
                format!(
                    "backend {backend:?} is not loaded on this node (loaded: {})",
                    known.join(", ")
                ),
            )
        })
    }

    /// Serve `plugin` for its backend from now on; calls already running
    /// finish on the version they started with (they hold its Arc).
    pub fn swap_plugin(&self, plugin: Plugin) -> Option<Arc<Plugin>> {
        let mut plugins = self.plugins.write().unwrap_or_else(|p| p.into_inner());
        plugins.insert(plugin.name().to_string(), Arc::new(plugin))
    }

    /// The backends served now.
    pub fn plugins(&self) -> Vec<Arc<Plugin>> {
        self.plugins.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    pub fn backend_names(&self) -> Vec<String> {
        self.plugins.read().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }

    /// Stop serving `backend`.
    pub fn remove_plugin(&self, backend: &str) -> Option<Arc<Plugin>> {
        self.plugins.write().unwrap_or_else(|p| p.into_inner()).remove(backend)
    }

    /// How long a request waits for its operation's steps.
    pub fn plan_deadline(&self) -> Duration {
        self.node.plan_deadline
    }

    /// Volumes of `backend` this node has mounted (from the stash).
    pub async fn volumes_of(&self, backend: &str) -> Result<Vec<String>, Failure> {
        let backend = backend.to_string();
        let entries = execute::read_mounts(&self.node, |s| s.all())?;
        let mut v: Vec<String> = entries
            .into_iter()
            .filter(|e| e.volume.backend == backend)
            .map(|e| e.volume.name)
            .collect();
        v.sort();
        v.dedup();
        Ok(v)
    }

    /// Scan the local classes' dirs for volumes, with this node's mount table.
    pub async fn discover_local(
        &self,
        classes: Vec<crate::local::LocalClass>,
    ) -> Result<crate::local::discovery::Scan, Failure> {
        let sys = self.node.sys.clone();
        execute::blocking(move || {
            let table =
                sys.mounts.mount_table().map_err(|e| internal(format!("discovery: {e}")))?;
            Ok(crate::local::discovery::scan(sys.inspect.as_ref(), &classes, &table))
        })
        .await?
    }

    /// Every mount the stash records on this node.
    pub async fn mount_records(&self) -> Result<Vec<mount_records::MountRecord>, Failure> {
        execute::read_mounts(&self.node, |s| s.all())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::Path;

    /// An agent of node `n1` with kubelet's root at `/k`, no backends, an
    /// embedded ledger (returned too) and a fake node.
    pub(crate) fn test_agent(
        dir: &Path,
    ) -> (Agent, Arc<crate::ledger::embedded::EmbeddedLedger>, Arc<crate::sys::fake::Fake>) {
        let config = NodeConfig {
            node: "n1".into(),
            kubelet_root: "/k".into(),
            kubelet_root_given: "/k".into(),
            state_dir: dir.join("state"),
            discovery_dirs: vec![],
            inline_backends: vec![],
        };
        let ledger = Arc::new(
            crate::ledger::embedded::EmbeddedLedger::open(&dir.join("ledger.redb"), false).unwrap(),
        );
        let stash = MountRecords::open(&dir.join("stash")).unwrap();
        let fake = crate::sys::fake::Fake::new();
        (
            Agent::new(
                config,
                Vec::new(),
                ledger.clone(),
                stash,
                fake.sys(),
                Duration::from_secs(5),
            ),
            ledger,
            fake,
        )
    }
}
