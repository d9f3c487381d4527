//! Guest-side SDK for volagent backend policies.
//!
//! A policy implements [`Policy`] over plain Rust values and a [`Host`] for
//! its read-only queries, so its logic runs natively in `cargo test` with a
//! [`fake::FakeHost`] and, unchanged, inside the component with the real
//! imports ([`export_policy!`]).

pub mod fake;
pub mod fence;
mod glue;
mod model;
pub mod options;
pub mod plans;
pub mod provision;
#[cfg(feature = "provisioner")]
mod provision_glue;
pub mod staged;

/// Generated from the contract this SDK carries (`wit/`): the guest side of
/// `volagent:policy@1.1.0`. Policies use the plain values of [`model`]; only
/// [`export_policy!`] and the SDK's glue touch these. With the
/// `provisioner` feature the world also exports the provisioner.
pub mod bindings {
    #[cfg(not(feature = "provisioner"))]
    wit_bindgen::generate!({
        world: "full-backend",
        path: "wit",
        pub_export_macro: true,
        default_bindings_module: "volagent_guest_sdk::bindings",
    });
    #[cfg(feature = "provisioner")]
    wit_bindgen::generate!({
        world: "provisioning-backend",
        path: "wit",
        pub_export_macro: true,
        default_bindings_module: "volagent_guest_sdk::bindings",
    });
}

pub use glue::WasmHost;
#[doc(hidden)]
pub use glue::export as __export;
pub use model::*;
pub use provision::Provisioner;
#[cfg(feature = "provisioner")]
#[doc(hidden)]
pub use provision_glue::export as __export_provisioner;
pub use staged::{Medium, Staged, StagedBackend};

/// The read-only queries a policy may make of its host.
pub trait Host {
    fn log(&self, level: LogLevel, message: &str);
    fn node_state(&self, name: &str) -> NodeFacts;
    fn path_kind(&self, path: &str) -> PathKind;
    fn filesystem_type(&self, device: &str) -> Option<String>;
    fn mount_at(&self, target: &str) -> Option<MountEntry>;
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String>;
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

/// Exports a [`Policy`] as the component's `policy` interface and the
/// optional `block-volumes`, `expand` and `health` ones; with
/// `, provisioner` (and the SDK's `provisioner` feature) also its
/// [`Provisioner`] as `provisioner`. Expands to nothing outside wasm, so
/// policy crates also build and test natively.
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        $crate::__export_policy!($policy, { glue::info::<$policy>() }, {});
    };
    ($policy:ty, provisioner) => {
        $crate::__export_policy!($policy, { $crate::__export_provisioner::info::<$policy>() }, {
            use $crate::bindings::volagent::policy::provisioning as pv;
            impl ex::provisioner::Guest for Exported {
                fn create(
                    request: &$crate::bindings::volagent::policy::provisioning::CreateRequest,
                ) -> Result<pv::Provision, pv::ProvisionError> {
                    $crate::__export_provisioner::create::<$policy>(request)
                }
                fn delete(volume: &pv::Target) -> Result<pv::Provision, pv::ProvisionError> {
                    $crate::__export_provisioner::delete::<$policy>(volume)
                }
                fn expand(volume: &pv::Target) -> Result<pv::Provision, pv::ProvisionError> {
                    $crate::__export_provisioner::expand::<$policy>(volume)
                }
                fn snapshot(volume: &pv::Target) -> Result<pv::Provision, pv::ProvisionError> {
                    $crate::__export_provisioner::snapshot::<$policy>(volume)
                }
                fn delete_snapshot(
                    snapshot: &pv::Target,
                ) -> Result<pv::Provision, pv::ProvisionError> {
                    $crate::__export_provisioner::delete_snapshot::<$policy>(snapshot)
                }
                fn capacity(
                    request: &pv::CapacityRequest,
                ) -> Result<Option<u64>, pv::ProvisionError> {
                    $crate::__export_provisioner::capacity::<$policy>(request)
                }
            }
        });
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __export_policy {
    ($policy:ty, $info:block, { $($extra:item)* }) => {
        #[cfg(target_arch = "wasm32")]
        mod __volagent_export {
            use $crate::bindings::exports::volagent::policy as ex;
            use $crate::bindings::volagent::policy::types as t;
            use $crate::__export as glue;
            struct Exported;
            impl ex::policy::Guest for Exported {
                fn info() -> t::BackendInfo {
                    $info
                }
                fn fence(
                    volume: &t::Volume,
                    requester: &t::Consumer,
                    holders: Vec<t::Consumer>,
                    nodes: Vec<t::Node>,
                ) -> Result<t::Decision, t::PolicyError> {
                    glue::fence::<$policy>(volume, requester, holders, nodes)
                }
                fn attach(
                    volume: &t::Volume,
                    requester: &t::Consumer,
                    local_holders: Vec<t::Consumer>,
                    paths: &t::NodePaths,
                ) -> Result<t::Plan, t::PolicyError> {
                    glue::attach::<$policy>(volume, requester, local_holders, paths)
                }
                fn detach(
                    volume: &t::Volume,
                    consumer: &t::Consumer,
                    local_holders: Vec<t::Consumer>,
                    paths: &t::NodePaths,
                ) -> Result<t::Plan, t::PolicyError> {
                    glue::detach::<$policy>(volume, consumer, local_holders, paths)
                }
                fn cleanup(
                    reason: t::CleanupReason,
                    items: Vec<t::CleanupItem>,
                ) -> Result<t::Plan, t::PolicyError> {
                    glue::cleanup::<$policy>(reason, items)
                }
            }
            impl ex::block_volumes::Guest for Exported {
                fn attach(
                    volume: &t::Volume,
                    requester: &t::Consumer,
                    local_holders: Vec<t::Consumer>,
                    paths: &t::NodePaths,
                ) -> Result<t::Plan, t::PolicyError> {
                    glue::attach::<$policy>(volume, requester, local_holders, paths)
                }
            }
            impl ex::expand::Guest for Exported {
                fn expand(
                    volume: &t::Volume,
                    consumer: &t::Consumer,
                    paths: &t::NodePaths,
                ) -> Result<t::Plan, t::PolicyError> {
                    glue::expand::<$policy>(volume, consumer, paths)
                }
            }
            impl ex::health::Guest for Exported {
                fn condition(
                    volume: &t::Volume,
                    consumer: &t::Consumer,
                    paths: &t::NodePaths,
                ) -> Option<String> {
                    glue::condition::<$policy>(volume, consumer, paths)
                }
            }
            $($extra)*
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
