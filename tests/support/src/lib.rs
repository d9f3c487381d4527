//! What the host's test tiers and benches share: the agent's command line
//! ([`agent::AgentBuilder`]), agents on a scratch dir ([`agent::Node`]),
//! the API-server, kubelet and DaemonSet clusters, [`wait_until`], and the
//! fixtures of policy calls, Flexvolume drivers and Kubernetes objects.
//!
//! The crate never names the agent's binary: a test passes
//! `env!("CARGO_BIN_EXE_volagent")`, which cargo sets only for the host's
//! own tests and benches.

pub mod agent;
pub mod api_cluster;
pub mod bench;
pub mod ceph;
pub mod ceph_cluster;
pub mod daemonset_cluster;
pub mod driver;
pub mod host_ports;
pub mod kernel_cycle;
pub mod kube_objects;
pub mod kubelet_cluster;
pub mod nbd;
pub mod policy;
pub mod scratch;
pub mod shipped;
pub mod vm;
pub mod wait;
pub mod workload;

pub use wait::{Deadline, wait_until, wait_until_async, wait_until_or};

use std::path::{Path, PathBuf};

/// The workspace's root dir.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
