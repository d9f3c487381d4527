//! Guest-side SDK for volagent backend policies.
//!
//! A policy implements [`Policy`] over plain Rust values and a [`Host`] for
//! its read-only queries, so its logic runs natively in `cargo test` with a
//! [`fake::FakeHost`] and, unchanged, inside the component with the real
//! imports ([`export_policy!`]).

pub mod fake;
pub mod fence;
pub mod options;
pub mod plans;

/// Generated from `wit/` (the one contract with the host).
pub mod bindings {
    wit_bindgen::generate!({
        world: "backend",
        path: "../../wit",
        pub_export_macro: true,
        default_bindings_module: "volagent_guest_sdk::bindings",
        additional_derives: [PartialEq],
    });
}

pub use bindings::exports::volagent::policy::policy::Guest;
pub use bindings::volagent::policy::types::*;

/// The read-only queries a policy may make of its host.
pub trait Host {
    fn log(&self, level: LogLevel, message: &str);
    fn node_state(&self, name: &str) -> NodeFacts;
    fn path_kind(&self, path: &str) -> PathKind;
    fn filesystem_type(&self, device: &str) -> Option<String>;
    fn mount_at(&self, target: &str) -> Option<MountEntry>;
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String>;
}

/// The real host: the component's imports. Only callable inside a component.
pub struct WasmHost;

impl Host for WasmHost {
    fn log(&self, level: LogLevel, message: &str) {
        bindings::volagent::policy::host::log(level, message);
    }
    fn node_state(&self, name: &str) -> NodeFacts {
        bindings::volagent::policy::host::node_state(name)
    }
    fn path_kind(&self, path: &str) -> PathKind {
        bindings::volagent::policy::host::lookup_path(path)
    }
    fn filesystem_type(&self, device: &str) -> Option<String> {
        bindings::volagent::policy::host::filesystem_type(device)
    }
    fn mount_at(&self, target: &str) -> Option<MountEntry> {
        bindings::volagent::policy::host::mount_at(target)
    }
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        bindings::volagent::policy::host::image_watchers(pool, image)
    }
}

/// A backend policy in plain Rust. Every call gets the host to query.
pub trait Policy {
    fn info() -> BackendInfo;
    fn fence(
        host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        holders: Vec<Holder>,
        nodes: Vec<NodeFacts>,
    ) -> Result<Decision, PolicyError>;
    fn attach(
        host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError>;
    fn detach(
        host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError>;
    /// The plan growing `volume` where `consumer` has it. By default the
    /// filesystem at the consumer's dir grows to its device's size (a
    /// block volume has nothing on the node to grow).
    fn expand(
        _host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        _paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        Ok(plans::grow(&volume, &consumer))
    }
    /// Why the volume is not healthy where `consumer` has it; by default
    /// nothing beyond what the host checked.
    fn condition(
        _host: &dyn Host,
        _volume: Volume,
        _consumer: Consumer,
        _paths: NodePaths,
    ) -> Option<String> {
        None
    }
    fn cleanup(
        host: &dyn Host,
        reason: CleanupReason,
        items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError>;
}

/// Exports a [`Policy`] as the component's `policy` interface. Expands to
/// nothing outside wasm, so policy crates also build and test natively.
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        #[cfg(target_arch = "wasm32")]
        mod __volagent_export {
            use $crate::{Policy as _, *};
            struct Exported;
            impl $crate::Guest for Exported {
                fn info() -> BackendInfo {
                    <$policy>::info()
                }
                fn fence(
                    volume: Volume,
                    requester: Consumer,
                    holders: Vec<Holder>,
                    nodes: Vec<NodeFacts>,
                ) -> Result<Decision, PolicyError> {
                    <$policy>::fence(&WasmHost, volume, requester, holders, nodes)
                }
                fn attach(
                    volume: Volume,
                    requester: Consumer,
                    local_holders: Vec<Holder>,
                    paths: NodePaths,
                ) -> Result<Plan, PolicyError> {
                    <$policy>::attach(&WasmHost, volume, requester, local_holders, paths)
                }
                fn detach(
                    volume: Volume,
                    consumer: Consumer,
                    local_holders: Vec<Holder>,
                    paths: NodePaths,
                ) -> Result<Plan, PolicyError> {
                    <$policy>::detach(&WasmHost, volume, consumer, local_holders, paths)
                }
                fn expand(volume: Volume, consumer: Consumer, paths: NodePaths) -> Result<Plan, PolicyError> {
                    <$policy>::expand(&WasmHost, volume, consumer, paths)
                }
                fn condition(volume: Volume, consumer: Consumer, paths: NodePaths) -> Option<String> {
                    <$policy>::condition(&WasmHost, volume, consumer, paths)
                }
                fn cleanup(
                    reason: CleanupReason,
                    items: Vec<CleanupItem>,
                ) -> Result<Plan, PolicyError> {
                    <$policy>::cleanup(&WasmHost, reason, items)
                }
            }
            $crate::bindings::export!(Exported with_types_in $crate::bindings);
        }
    };
}

/// The access mode's Kubernetes spelling, for messages users read.
pub fn mode_name(mode: AccessMode) -> &'static str {
    match mode {
        AccessMode::ReadWriteOnce => "ReadWriteOnce",
        AccessMode::ReadOnlyMany => "ReadOnlyMany",
        AccessMode::ReadWriteMany => "ReadWriteMany",
        AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
    }
}

/// "pod ns/name on node n", for messages users read.
pub fn describe(consumer: &Consumer) -> String {
    format!("pod {}/{} on node {}", consumer.pod_namespace, consumer.pod, consumer.node)
}
