//! Kubernetes: the custom resources, the ledger on them, the node facts and
//! PVs the agent reads, and the controller.

pub mod admission;
pub mod backend_policies;
pub mod cluster;
pub mod controller;
pub mod crds;
pub mod fencing;
pub mod lease;
pub mod ledger;
pub mod local_claims;
pub mod local_pvs;
pub mod local_volumes;
pub mod node_tasks;
mod node_view;
pub mod snapshot_crds;
pub mod storage;
pub mod volumes;
