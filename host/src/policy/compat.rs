//! Serving guests of the previous contract, `volagent:policy@0.4.0`, as they
//! are. 0.5 only added to 0.4 — cases of `step` and `step-kind`, fields of
//! `volume` and `consumer`, the `expand` call — so a 0.4 guest's answers are
//! 0.5 values as they stand, and a 0.5 request reaches it with the new fields
//! left out. A request it cannot be asked truthfully (a block volume, mount
//! flags, a mount group) is refused as unsupported rather than narrowed.
//! Values cross by their serde form, which both bindings derive alike.

use super::bindings::{Consumer, PolicyError, Volume, VolumeMode};
use super::imports::CallState;
use serde::Serialize;
use serde::de::DeserializeOwned;

pub mod v0_4 {
    wasmtime::component::bindgen!({
        world: "backend",
        path: "wit-compat/0.4",
        additional_derives: [serde::Serialize, serde::Deserialize],
        imports: { default: trappable },
    });
}

pub const VERSION: &str = "0.4.0";

/// One value as the same value in the other contract's bindings.
pub fn convert<A: Serialize + ?Sized, B: DeserializeOwned>(value: &A) -> wasmtime::Result<B> {
    let json = serde_json::to_value(value)?;
    Ok(serde_json::from_value(json)?)
}

/// Why `volume` and `consumer` cannot be put to a 0.4 guest, if they cannot.
pub fn unaskable(volume: &Volume, consumer: Option<&Consumer>) -> Option<PolicyError> {
    let why = if volume.mode == VolumeMode::Block {
        "block volumes"
    } else if !volume.mount_flags.is_empty() {
        "mount flags"
    } else if consumer.is_some_and(|c| c.mount_group.is_some()) {
        "a volume mount group"
    } else {
        return None;
    };
    Some(PolicyError::Unsupported(format!(
        "the backend speaks volagent:policy@{VERSION}, which has no {why}; rebuild it against 0.5"
    )))
}

impl v0_4::volagent::policy::types::Host for CallState {}

/// The 0.4 `host` is the 0.5 one: the same queries, the same types.
impl v0_4::volagent::policy::host::Host for CallState {
    fn log(
        &mut self,
        level: v0_4::volagent::policy::types::LogLevel,
        message: String,
    ) -> wasmtime::Result<()> {
        super::bindings::volagent::policy::host::Host::log(self, convert(&level)?, message)
    }

    fn node_state(
        &mut self,
        name: String,
    ) -> wasmtime::Result<v0_4::volagent::policy::types::NodeFacts> {
        convert(&super::bindings::volagent::policy::host::Host::node_state(self, name)?)
    }

    fn lookup_path(
        &mut self,
        path: String,
    ) -> wasmtime::Result<v0_4::volagent::policy::types::PathKind> {
        convert(&super::bindings::volagent::policy::host::Host::lookup_path(self, path)?)
    }

    fn filesystem_type(&mut self, device: String) -> wasmtime::Result<Option<String>> {
        super::bindings::volagent::policy::host::Host::filesystem_type(self, device)
    }

    fn mount_at(
        &mut self,
        target: String,
    ) -> wasmtime::Result<Option<v0_4::volagent::policy::types::MountEntry>> {
        convert(&super::bindings::volagent::policy::host::Host::mount_at(self, target)?)
    }

    fn image_watchers(
        &mut self,
        pool: String,
        image: String,
    ) -> wasmtime::Result<Result<Vec<v0_4::volagent::policy::types::Watcher>, String>> {
        convert(&super::bindings::volagent::policy::host::Host::image_watchers(self, pool, image)?)
    }
}
