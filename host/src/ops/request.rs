//! The typed requests of the Flexvolume edge (the socket parses kubelet's
//! strings into them): a pod's mount dir, a mount.

use crate::model::{Consumer, Volume};
use std::path::PathBuf;

/// A pod's mount dir: `<kubelet-root>/pods/<pod-uid>/volumes/volagent~<backend>/<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountDir {
    /// The dir under the resolved kubelet root.
    pub dir: PathBuf,
    pub pod_uid: String,
    pub name: String,
}

/// Longest a mount dir kubelet sends may be (PATH_MAX).
pub const MAX_PATH: usize = 4096;

/// A parsed `mount` call.
#[derive(Debug, Clone)]
pub struct MountRequest {
    pub volume: Volume,
    pub consumer: Consumer,
    /// The volume's secret values: host-side only (the guest sees the keys).
    pub secrets: crate::secret::Secrets,
}
