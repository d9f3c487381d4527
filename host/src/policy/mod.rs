//! The guest runtime: one engine, the one `bindgen!`, loading and checking
//! components, calling them with a deadline and a memory cap, validating the
//! plans they return, and running recorded scenarios against them.

pub mod bindings;
mod call;
mod imports;
mod load;
pub mod queries;
mod runtime;
pub mod scenario;
pub mod validate;

pub use bindings::volagent::policy::types::*;
pub use call::CallError;
pub use load::{LoadError, Plugin};
pub use queries::{Queries, QueryError, RecordedQueries};
pub use runtime::{Limits, Runtime, RuntimeError};

/// The contract version this host speaks.
pub const CONTRACT_PACKAGE: &str = "volagent:policy";
pub const CONTRACT_VERSION: &str = "0.1.0";
/// The interface every backend exports.
pub const POLICY_INTERFACE: &str = "policy";
