//! Kubernetes: the custom resources, the ledger on them, the node facts and
//! PVs the agent reads, and the controller.

pub mod crds;
pub mod ledger;
pub mod cluster;
pub mod node_tasks;
pub mod controller;
pub mod lease;
pub mod local_pvs;
pub mod local_volumes;
pub mod storage;
pub mod volumes;
