//! Test-only: the local-pv policy as shipped, except that it denies every
//! ReadOnlyMany volume. Named local-pv, with a version of its own: a
//! candidate whose one difference `plugin replay` and the agent's shadow
//! must find, and that can be promoted and rolled back.

use policy_local_pv::LocalPv;
use volagent_guest_sdk::provision::{
    CapacityRequest, ControllerStepKind, CreateRequest, Provision, ProvisionError, Provisioner,
    Target,
};
use volagent_guest_sdk::{
    AccessMode, BackendInfo, CleanupItem, CleanupReason, Consumer, Decision, Holder, Host,
    NodeFacts, NodePaths, Plan, Policy, PolicyError, Volume,
};

pub struct Strict;

volagent_guest_sdk::export_policy!(crate::Strict, provisioner);

impl Policy for Strict {
    fn info() -> BackendInfo {
        let mut info = LocalPv::info();
        info.version = format!("{}-strict", info.version);
        info
    }
    fn fence(
        host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        holders: Vec<Holder>,
        nodes: Vec<NodeFacts>,
    ) -> Result<Decision, PolicyError> {
        if volume.access_mode == AccessMode::ReadOnlyMany {
            return Ok(Decision::Deny(format!(
                "volume {}: this version refuses ReadOnlyMany",
                volume.name
            )));
        }
        LocalPv::fence(host, volume, requester, holders, nodes)
    }
    fn attach(
        host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        LocalPv::attach(host, volume, requester, local_holders, paths)
    }
    fn detach(
        host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        LocalPv::detach(host, volume, consumer, local_holders, paths)
    }
    fn expand(
        host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        <LocalPv as Policy>::expand(host, volume, consumer, paths)
    }
    fn condition(
        host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        paths: NodePaths,
    ) -> Option<String> {
        LocalPv::condition(host, volume, consumer, paths)
    }
    fn cleanup(
        host: &dyn Host,
        reason: CleanupReason,
        items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError> {
        LocalPv::cleanup(host, reason, items)
    }
}

impl Provisioner for Strict {
    const CONTROLLER_STEPS: &'static [ControllerStepKind] = LocalPv::CONTROLLER_STEPS;
    fn create(request: CreateRequest) -> Result<Provision, ProvisionError> {
        LocalPv::create(request)
    }
    fn delete(volume: Target) -> Result<Provision, ProvisionError> {
        LocalPv::delete(volume)
    }
    fn expand(volume: Target) -> Result<Provision, ProvisionError> {
        <LocalPv as Provisioner>::expand(volume)
    }
    fn snapshot(volume: Target) -> Result<Provision, ProvisionError> {
        LocalPv::snapshot(volume)
    }
    fn delete_snapshot(snapshot: Target) -> Result<Provision, ProvisionError> {
        LocalPv::delete_snapshot(snapshot)
    }
    fn capacity(request: CapacityRequest) -> Result<Option<u64>, ProvisionError> {
        LocalPv::capacity(request)
    }
}
