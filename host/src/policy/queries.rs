//! What the host answers when a guest asks (`host` imports). The agent
//! answers from its own cached view of the node and cluster; scenario files
//! and benchmarks answer from recorded facts. Answers never block.

use crate::model::{MountEntry, NodeFacts, PathKind, Watcher};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why the host would not answer a query: the guest's call then fails
/// with this error (a trap), as no answer in the contract would be true.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("{query} {path}: outside the dirs this backend may ask about ({roots})")]
    OutsideRoots { query: &'static str, path: String, roots: String },
    #[error(
        "{query} {path}: no answer within {ms} ms (a hung filesystem, or a device that does not answer); the guest's call is failed"
    )]
    Timeout { query: &'static str, path: String, ms: u128 },
    #[error("{query} {path}: {message}")]
    Failed { query: &'static str, path: String, message: String },
}

/// Answers a guest's read-only queries. Implementations must not block
/// past the guest's deadline: they run inside a guest call that has one.
pub trait Queries: Send + Sync {
    fn node_state(&self, name: &str) -> NodeFacts;
    fn lookup_path(&self, path: &str) -> Result<PathKind, QueryError>;
    fn filesystem_type(&self, device: &str) -> Result<Option<String>, QueryError>;
    fn mount_at(&self, target: &str) -> Result<Option<MountEntry>, QueryError>;
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

/// A recorded call's answers, for the same call made again on another
/// version (replay, the shadow): a node the recording has no answer for is
/// not taken as gone, as the agent never takes a node it cannot see as
/// gone; anything else not recorded is absent, as in a scenario.
pub struct ReplayQueries(pub RecordedQueries);

impl Queries for ReplayQueries {
    fn node_state(&self, name: &str) -> NodeFacts {
        self.0.nodes.iter().find(|n| n.name == name).cloned().unwrap_or(NodeFacts {
            name: name.to_string(),
            exists: true,
            ready: false,
            out_of_service: false,
        })
    }
    fn lookup_path(&self, path: &str) -> Result<PathKind, QueryError> {
        self.0.lookup_path(path)
    }
    fn filesystem_type(&self, device: &str) -> Result<Option<String>, QueryError> {
        self.0.filesystem_type(device)
    }
    fn mount_at(&self, target: &str) -> Result<Option<MountEntry>, QueryError> {
        self.0.mount_at(target)
    }
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        self.0.image_watchers(pool, image)
    }
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
    fn lookup_path(&self, path: &str) -> Result<PathKind, QueryError> {
        Ok(self.paths.get(path).copied().unwrap_or(PathKind::Missing))
    }
    fn filesystem_type(&self, device: &str) -> Result<Option<String>, QueryError> {
        Ok(self.filesystems.get(device).cloned())
    }
    fn mount_at(&self, target: &str) -> Result<Option<MountEntry>, QueryError> {
        Ok(self.mounts.iter().find(|m| m.target == target).cloned())
    }
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        match self.watchers.get(&format!("{pool}/{image}")) {
            None => Ok(Vec::new()),
            Some(WatchersAnswer::Watchers(w)) => Ok(w.clone()),
            Some(WatchersAnswer::Error { error }) => Err(error.clone()),
        }
    }
}
