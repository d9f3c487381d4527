//! volagent: a storage node agent for Kubernetes whose policy decisions are
//! made by per-backend WebAssembly components.
//!
//! Floors (arrows point down only), from the top: `cli`; the edges
//! `plugin`, `kube`, `socket`, `csi`; `ops`; `exec` and `ledger`; `policy`;
//! `local`; `sys`; the leaves. docs/architecture.md says what each may
//! import, and tests/architecture.rs holds the edges apart from the rest.

pub mod cli;
pub mod clock;
pub mod csi;
pub mod exec;
pub mod fuse;
pub mod http;
pub mod init;
pub mod kube;
pub mod ledger;
pub mod listener;
pub mod local;
pub mod metrics;
pub mod model;
pub mod mounter;
pub mod nbd;
pub mod ops;
pub mod plugin;
pub mod policy;
pub mod provision;
pub mod reopening_db;
pub mod secret;
pub mod socket;
pub mod stats;
pub mod sys;
pub mod text;
pub mod workers;
