//! volagent: a storage node agent for Kubernetes whose policy decisions are
//! made by per-backend WebAssembly components.
//!
//! Floors (arrows point down only): `cli` → `policy`.

pub mod cli;
pub mod policy;
pub mod stats;
