//! volagent: a storage node agent for Kubernetes whose policy decisions are
//! made by per-backend WebAssembly components.
//!
//! Floors (arrows point down only): `cli` → `exec` → `policy`, `sys`.

pub mod cli;
pub mod exec;
pub mod ledger;
pub mod policy;
pub mod stats;
pub mod sys;
