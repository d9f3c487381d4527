//! The contract versions this host serves, each behind one trait: a guest
//! is called in the host's model ([`crate::model`]) whatever version it was
//! built against, and each version's module converts to and from its own
//! bindings. Nothing outside this module sees a binding.

pub(crate) mod convert;
mod records;
mod v0_4;
mod v0_5;
mod v1;

use super::imports::CallState;
use crate::model::{
    BackendInfo, CapacityRequest, CleanupItem, CleanupReason, Consumer, CreateRequest, Decision,
    Holder, NodeFacts, NodePaths, Plan, PolicyError, Provision, ProvisionError, Target, Volume,
};
use wasmtime::Store;
use wasmtime::component::{InstancePre, Linker};

/// The contract version this host speaks.
pub const CURRENT: &str = v1::VERSION;
/// Earlier versions whose guests this host still serves.
pub const OLDER: &[&str] = &[v0_5::VERSION, v0_4::VERSION];

/// A guest's answer: a trap or host fault, or the policy's own refusal.
pub(crate) type Answer<T> = wasmtime::Result<Result<T, PolicyError>>;

/// A provisioner's answer: a trap or host fault, or its own refusal.
pub(crate) type Provisioned<T> = wasmtime::Result<Result<T, ProvisionError>>;

/// The provisioner calls that answer with a controller plan.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ProvisionCall<'a> {
    Create(&'a CreateRequest),
    Delete(&'a Target),
    Expand(&'a Target),
    Snapshot(&'a Target),
    DeleteSnapshot(&'a Target),
}

impl ProvisionCall<'_> {
    pub(crate) fn function(&self) -> &'static str {
        match self {
            ProvisionCall::Create(_) => "create",
            ProvisionCall::Delete(_) => "delete",
            ProvisionCall::Expand(_) => "expand-volume",
            ProvisionCall::Snapshot(_) => "snapshot",
            ProvisionCall::DeleteSnapshot(_) => "delete-snapshot",
        }
    }
}

/// One instance of a guest, called in the host's model.
pub(crate) trait Guest: Send {
    fn info(&self, s: &mut Store<CallState>) -> wasmtime::Result<BackendInfo>;
    fn fence(
        &self,
        s: &mut Store<CallState>,
        volume: &Volume,
        requester: &Consumer,
        holders: &[Holder],
        nodes: &[NodeFacts],
    ) -> Answer<Decision>;
    fn attach(
        &self,
        s: &mut Store<CallState>,
        volume: &Volume,
        requester: &Consumer,
        local_holders: &[Holder],
        paths: &NodePaths,
    ) -> Answer<Plan>;
    fn detach(
        &self,
        s: &mut Store<CallState>,
        volume: &Volume,
        consumer: &Consumer,
        local_holders: &[Holder],
        paths: &NodePaths,
    ) -> Answer<Plan>;
    /// None when the guest has no expand of its own: the host then grows
    /// the filesystem at the consumer's dir itself.
    fn expand(
        &self,
        s: &mut Store<CallState>,
        volume: &Volume,
        consumer: &Consumer,
        paths: &NodePaths,
    ) -> Answer<Option<Plan>>;
    /// None when healthy, or when the guest has no say.
    fn condition(
        &self,
        s: &mut Store<CallState>,
        volume: &Volume,
        consumer: &Consumer,
        paths: &NodePaths,
    ) -> wasmtime::Result<Option<String>>;
    fn cleanup(
        &self,
        s: &mut Store<CallState>,
        reason: CleanupReason,
        items: &[CleanupItem],
    ) -> Answer<Plan>;
    /// Asked only of guests that export the provisioner ([`Linked::provisions`]).
    fn provision(
        &self,
        _s: &mut Store<CallState>,
        call: ProvisionCall<'_>,
    ) -> Provisioned<Provision> {
        wasmtime::bail!("{} put to a guest of a contract without the provisioner", call.function())
    }
    fn capacity(
        &self,
        _s: &mut Store<CallState>,
        _request: &CapacityRequest,
    ) -> Provisioned<Option<u64>> {
        wasmtime::bail!("capacity put to a guest of a contract without the provisioner")
    }
}

/// A component linked for the contract it speaks, ready to instantiate.
pub(crate) trait Linked: Send + Sync {
    fn version(&self) -> &'static str;
    /// Why this request cannot be put to a guest of this contract at all,
    /// if it cannot (it would have to be narrowed to be asked).
    fn unaskable(&self, _volume: &Volume, _consumer: Option<&Consumer>) -> Option<PolicyError> {
        None
    }
    fn instantiate(&self, store: &mut Store<CallState>) -> wasmtime::Result<Box<dyn Guest>>;
    /// The optional interfaces the guest exports (none before 1.0, where
    /// nothing was optional).
    fn optional(&self) -> Vec<&'static str> {
        Vec::new()
    }
    /// The guest exports the provisioner (1.1 on).
    fn provisions(&self) -> bool {
        false
    }
}

/// Every version's `host` imports.
pub(crate) fn add_to_linker(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    v1::add_to_linker(linker)?;
    v0_5::add_to_linker(linker)?;
    v0_4::add_to_linker(linker)
}

/// Link `pre` for `version` (one of [`CURRENT`] and [`OLDER`]).
pub(crate) fn link(
    version: &str,
    pre: InstancePre<CallState>,
) -> wasmtime::Result<std::sync::Arc<dyn Linked>> {
    Ok(match version {
        v1::VERSION => std::sync::Arc::new(v1::link(pre)?),
        v0_5::VERSION => std::sync::Arc::new(v0_5::link(pre)?),
        v0_4::VERSION => std::sync::Arc::new(v0_4::link(pre)?),
        other => wasmtime::bail!("no adapter for contract {other}"),
    })
}
