//! The node an operation runs on: its config and the services every step
//! of the pipeline may use (records, effects, locks, the cluster).

use super::cluster::ClusterView;
use super::mount_records::MountRecords;
use crate::ledger::Ledger;
use crate::model::NodePaths;
use crate::sys::Sys;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where this node keeps things. The dirs are resolved (no symlinks): the
/// agent acts only beneath them.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node: String,
    pub kubelet_root: PathBuf,
    /// kubelet's root as configured, which is how kubelet spells the dirs
    /// it passes (it may be a symlink to `kubelet_root`).
    pub kubelet_root_given: PathBuf,
    pub state_dir: PathBuf,
    pub discovery_dirs: Vec<PathBuf>,
    /// Backends whose inline pod volumes are served (with a cluster; keyed
    /// by pod UID and volume name).
    pub inline_backends: Vec<String>,
}

/// The tag of the loop devices the agent of `node` with state dir
/// `state_dir` attaches: stable across its restarts, and not another
/// agent's on the same machine (test nodes, two installs). At most 63
/// bytes, the size of the field that carries it.
pub fn loop_tag(node: &str, state_dir: &std::path::Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(state_dir.as_os_str().as_encoded_bytes());
    let mut node = node.to_string();
    while node.len() > 36 {
        node.pop();
    }
    format!("volagent:{node}:{}", hex::encode(&digest[..8]))
}

impl NodeConfig {
    /// The roots the agent acts beneath.
    pub fn roots(&self) -> Vec<PathBuf> {
        let mut roots = vec![self.kubelet_root.clone(), self.state_dir.clone()];
        roots.extend(self.discovery_dirs.iter().cloned());
        roots
    }

    /// kubelet's root in both spellings, the resolved one first.
    pub fn kubelet_roots(&self) -> [&std::path::Path; 2] {
        [&self.kubelet_root, &self.kubelet_root_given]
    }

    pub fn paths(&self, backend: &str, volume: &str) -> NodePaths {
        NodePaths {
            kubelet_root: self.kubelet_root.display().to_string(),
            staging_dir: self
                .kubelet_root
                .join("plugins/volagent")
                .join(backend)
                .join("mounts")
                .join(volume)
                .display()
                .to_string(),
            state_dir: self.state_dir.join("volumes").join(volume).display().to_string(),
            discovery_dirs: self.discovery_dirs.iter().map(|d| d.display().to_string()).collect(),
        }
    }
}

/// What every step of an operation may use. Steps are functions over
/// `&Node` and their operation's context ([`super::context`]); none keeps
/// state of its own beyond the volume locks.
pub struct Node {
    pub config: NodeConfig,
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) mount_records: Arc<MountRecords>,
    pub(crate) sys: Sys,
    pub(super) locks: Locks,
    /// How long a request waits for a plan's steps.
    pub(crate) plan_deadline: Duration,
    /// The cluster, when there is one: node facts, PVs, Events.
    pub(crate) cluster: Option<Arc<dyn ClusterView>>,
}

/// Volumes with an operation in progress.
#[derive(Default, Clone)]
pub(super) struct Locks(Arc<Mutex<HashSet<String>>>);

/// Held while an operation's steps may still run; it can outlive the request
/// (see [`super::execute::on_plan_thread`]).
pub(crate) struct LockGuard {
    locks: Locks,
    volume: String,
}

impl Locks {
    pub(super) fn try_lock(&self, volume: &str) -> Option<LockGuard> {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        held.insert(volume.to_string())
            .then(|| LockGuard { locks: self.clone(), volume: volume.to_string() })
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.locks.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.volume);
    }
}

/// The lock step: one operation per volume on this node at a time.
pub(crate) fn lock(node: &Node, volume: &str) -> Result<LockGuard, super::Failure> {
    node.locks.try_lock(volume).ok_or_else(|| {
        super::Failure::new(
            super::FailureKind::Busy,
            format!("volume {volume}: an operation is in progress on this node; retry"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn loop_tags_are_per_agent_stable_and_fit_their_field() {
        let a = loop_tag("node-a", Path::new("/var/lib/volagent"));
        assert_eq!(
            a,
            loop_tag("node-a", Path::new("/var/lib/volagent")),
            "the same after a restart"
        );
        assert_ne!(
            a,
            loop_tag("node-a", Path::new("/tmp/test-1/state")),
            "another agent's on this machine"
        );
        assert_ne!(a, loop_tag("node-b", Path::new("/var/lib/volagent")));
        assert!(a.starts_with("volagent:node-a:"), "{a}");
        assert!(loop_tag(&"n".repeat(253), Path::new("/x")).len() <= 63);
    }

    #[test]
    fn a_volume_takes_one_operation_at_a_time() {
        let locks = Locks::default();
        let first = locks.try_lock("pv1").expect("free");
        assert!(locks.try_lock("pv1").is_none(), "a second operation on pv1 must be refused");
        assert!(locks.try_lock("pv2").is_some(), "other volumes are independent");
        drop(first);
        assert!(locks.try_lock("pv1").is_some(), "released with the guard");
    }
}
