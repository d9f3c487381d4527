//! What the host answers when a guest asks (`host` imports). The agent
//! answers from its own cached view of the node and cluster; scenario files
//! and benchmarks answer from recorded facts. Answers never block.

use super::bindings::{MountEntry, NodeFacts, PathKind, Watcher};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Answers a guest's read-only queries. Implementations must not block:
/// they run inside a guest call that has a deadline.
pub trait Queries: Send + Sync {
    fn node_state(&self, name: &str) -> NodeFacts;
    fn lookup_path(&self, path: &str) -> PathKind;
    fn filesystem_type(&self, device: &str) -> Option<String>;
    fn mount_at(&self, target: &str) -> Option<MountEntry>;
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String>;
}

/// A recorded view of a node: what each query answers. Anything not
/// recorded is absent (unknown node, missing path, no filesystem, not
/// mounted, no watchers).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RecordedQueries {
    pub nodes: Vec<NodeFacts>,
    /// Path → what is there.
    pub paths: BTreeMap<String, PathKind>,
    /// Device → filesystem type.
    pub filesystems: BTreeMap<String, String>,
    pub mounts: Vec<MountEntry>,
    /// "pool/image" → watchers, or an error string when the cluster cannot be asked.
    pub watchers: BTreeMap<String, WatchersAnswer>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum WatchersAnswer {
    Watchers(Vec<Watcher>),
    Error { error: String },
}

impl Queries for RecordedQueries {
    fn node_state(&self, name: &str) -> NodeFacts {
        self.nodes.iter().find(|n| n.name == name).cloned().unwrap_or(NodeFacts {
            name: name.to_string(),
            exists: false,
            ready: false,
            out_of_service: false,
        })
    }
    fn lookup_path(&self, path: &str) -> PathKind {
        self.paths.get(path).copied().unwrap_or(PathKind::Missing)
    }
    fn filesystem_type(&self, device: &str) -> Option<String> {
        self.filesystems.get(device).cloned()
    }
    fn mount_at(&self, target: &str) -> Option<MountEntry> {
        self.mounts.iter().find(|m| m.target == target).cloned()
    }
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        match self.watchers.get(&format!("{pool}/{image}")) {
            None => Ok(Vec::new()),
            Some(WatchersAnswer::Watchers(w)) => Ok(w.clone()),
            Some(WatchersAnswer::Error { error }) => Err(error.clone()),
        }
    }
}
