//! The guest runtime: one engine, the one `bindgen!`, loading and checking
//! components, calling them with a deadline and a memory cap, validating the
//! plans they return, and running recorded scenarios against them.

mod call;
mod compiled;
mod contract;
pub mod differences;
mod imports;
mod invoke;
mod limits;
mod load;
mod prewarm;
pub mod queries;
pub mod recorded;
mod runtime;
pub mod scenario;
mod ticker;
pub mod validate;

/// The host's model is what policies are called with and answer in.
pub use crate::model::*;
pub use invoke::CallError;
pub use limits::Limits;
pub use load::{LoadError, Plugin};
pub use queries::{Queries, QueryError, RecordedQueries};
pub use runtime::{Runtime, RuntimeError};

/// The contract's package.
pub const CONTRACT_PACKAGE: &str = "volagent:policy";
/// The contract version this host speaks.
pub const CONTRACT_VERSION: &str = contract::CURRENT;
/// Earlier versions whose guests this host still serves, through adapters.
pub const COMPAT_VERSIONS: &[&str] = contract::OLDER;
/// The interface every backend exports.
pub const POLICY_INTERFACE: &str = "policy";
