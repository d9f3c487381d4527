//! The guest runtime: one engine, the one `bindgen!`, loading and checking
//! components, calling them with a deadline and a memory cap, validating the
//! plans they return, and running recorded scenarios against them.

pub mod bindings;
mod call;
mod compat;
mod imports;
mod invoke;
mod limits;
mod load;
mod pre;
mod prewarm;
pub mod queries;
mod runtime;
pub mod scenario;
mod ticker;
pub mod validate;

pub use bindings::volagent::policy::types::*;
pub use invoke::CallError;
pub use limits::Limits;
pub use load::{LoadError, Plugin};
pub use queries::{Queries, QueryError, RecordedQueries};
pub use runtime::{Runtime, RuntimeError};

/// The contract version this host speaks.
pub const CONTRACT_PACKAGE: &str = "volagent:policy";
pub const CONTRACT_VERSION: &str = "0.5.0";
/// Earlier versions whose guests this host still serves, through adapters.
pub const COMPAT_VERSIONS: &[&str] = &["0.4.0"];
/// The interface every backend exports.
pub const POLICY_INTERFACE: &str = "policy";

/// Fill in what a volume written before contract 0.5 lacks: a filesystem
/// volume with no mount flags.
pub fn volume_defaults(volume: &mut serde_json::Value) {
    if let Some(v) = volume.as_object_mut() {
        v.entry("mode").or_insert_with(|| serde_json::json!("Filesystem"));
        v.entry("mount_flags").or_insert_with(|| serde_json::json!([]));
    }
}

/// Kubernetes' spelling of an access mode.
pub fn parse_access_mode(s: &str) -> Option<AccessMode> {
    Some(match s {
        "ReadWriteOnce" => AccessMode::ReadWriteOnce,
        "ReadOnlyMany" => AccessMode::ReadOnlyMany,
        "ReadWriteMany" => AccessMode::ReadWriteMany,
        "ReadWriteOncePod" => AccessMode::ReadWriteOncePod,
        _ => return None,
    })
}

/// The Kubernetes name of `mode`.
pub fn access_mode_name(mode: AccessMode) -> &'static str {
    match mode {
        AccessMode::ReadWriteOnce => "ReadWriteOnce",
        AccessMode::ReadOnlyMany => "ReadOnlyMany",
        AccessMode::ReadWriteMany => "ReadWriteMany",
        AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
    }
}
