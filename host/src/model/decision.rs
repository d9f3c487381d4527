//! What a policy answers besides plans: who it is, fence decisions,
//! cleanups and refusals.

use super::plan::{Capabilities, Plan};
use super::volume::{Holder, NodePaths, Volume};
use serde::{Deserialize, Serialize};

/// What a backend is and what its plans may need.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendInfo {
    pub name: String,
    /// The policy's own version (semver).
    pub version: String,
    pub description: String,
    pub capabilities: Capabilities,
}

/// A fence decision for one consumer of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    Grant,
    /// The reason is shown to users and names the conflicting holder.
    Deny(String),
    TakeOver(TakeOver),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeOver {
    /// Holders to remove from the record (their nodes are gone).
    pub stale: Vec<Holder>,
    /// Fencing run on the requester's node before the record changes hands.
    pub fence_steps: Plan,
}

/// Why a cleanup is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CleanupReason {
    StaleNode,
    StorageClusterDeleted,
    LocalVolumeReleased,
}

/// A volume to clean up and what the ledger knew of it on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupItem {
    pub volume: Volume,
    pub paths: NodePaths,
    pub holders: Vec<Holder>,
}

/// A refusal by the policy itself (as opposed to a trap).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicyError {
    /// The volume's options are missing or malformed.
    InvalidOptions(String),
    /// The request is valid but this backend cannot do it.
    Unsupported(String),
}

impl PolicyError {
    /// For users: what kind of refusal, and the policy's message.
    pub fn describe(&self) -> String {
        match self {
            PolicyError::InvalidOptions(m) => format!("invalid options: {m}"),
            PolicyError::Unsupported(m) => format!("unsupported: {m}"),
        }
    }
}
