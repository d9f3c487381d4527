//! What the agent answers when a guest asks: this node's view, gathered
//! cheaply (stat, the mount table) and without blocking on the network.

use crate::policy::{MountEntry, NodeFacts, PathKind, Queries, Watcher};
use crate::sys::{MountInfo, Sys};
use std::os::unix::fs::FileTypeExt;
use std::sync::OnceLock;

pub struct NodeQueries {
    pub node: String,
    pub sys: Sys,
    /// The mount table, read on the first `mount-at` (most policies never
    /// ask; reading procfs does not block).
    mounts: OnceLock<Vec<MountInfo>>,
    /// Node facts read from the cluster before the call.
    facts: Vec<NodeFacts>,
}

impl NodeQueries {
    pub fn new(node: String, sys: Sys) -> NodeQueries {
        NodeQueries { node, sys, mounts: OnceLock::new(), facts: Vec::new() }
    }

    pub fn with_facts(mut self, facts: Vec<NodeFacts>) -> NodeQueries {
        self.facts = facts;
        self
    }
}

impl Queries for NodeQueries {
    /// What the cluster said of the node, when it was asked. Otherwise this
    /// node exists and is ready, and other nodes cannot be judged: they count
    /// as existing (never provably gone) and not ready.
    fn node_state(&self, name: &str) -> NodeFacts {
        if let Some(f) = self.facts.iter().find(|f| f.name == name) {
            return f.clone();
        }
        let me = name == self.node;
        NodeFacts { name: name.to_string(), exists: true, ready: me, out_of_service: false }
    }

    fn lookup_path(&self, path: &str) -> PathKind {
        match std::fs::metadata(path) {
            Err(_) => PathKind::Missing,
            Ok(m) if m.is_file() => PathKind::RegularFile,
            Ok(m) if m.is_dir() => PathKind::Directory,
            Ok(m) if m.file_type().is_block_device() => PathKind::BlockDevice,
            Ok(_) => PathKind::Other,
        }
    }

    fn filesystem_type(&self, device: &str) -> Option<String> {
        // blkid reads the first blocks of a local device: quick, bounded by
        // the probe deadline.
        self.sys.filesystems.probe(std::path::Path::new(device)).ok().flatten()
    }

    fn mount_at(&self, target: &str) -> Option<MountEntry> {
        let mounts = self.mounts.get_or_init(|| {
            self.sys.mounts.mount_table().unwrap_or_else(|e| {
                tracing::error!("a guest asked for a mount, but the mount table is unreadable: {e}");
                Vec::new()
            })
        });
        mounts.iter().rev().find(|m| m.mount_point.as_os_str() == target).map(|m| MountEntry {
            source: m.source.clone(),
            target: target.to_string(),
            fs_type: m.fs_type.clone(),
            read_only: m.read_only(),
        })
    }

    fn image_watchers(&self, _pool: &str, _image: &str) -> Result<Vec<Watcher>, String> {
        Err("this agent has no storage cluster connection configured".to_string())
    }
}
