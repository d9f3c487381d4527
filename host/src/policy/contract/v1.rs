//! Guests of `volagent:policy@1.x`: facts as host resources, plans built
//! through the host's `plan` resource, backend-specific steps in their own
//! interfaces, and the optional exports (block volumes, expand, health)
//! looked for at load. Every later 1.x host serves a 1.0 guest through
//! this module unchanged: a minor version only adds to it.

use super::convert::{Down, Up, cases};
use super::{Answer, Guest, Linked, ProvisionCall, Provisioned};
use crate::model as m;
use crate::policy::imports::{CallState, Made};
use crate::policy::validate::MAX_PLAN_STEPS;
use wasmtime::Store;
use wasmtime::component::{HasSelf, InstancePre, Linker, Resource};

mod bindings {
    wasmtime::component::bindgen!({
        world: "provisioning-backend",
        path: "../wit",
        // A host query may refuse to answer (outside the backend's roots,
        // no answer in time): the guest's call then fails.
        imports: { default: trappable },
        with: {
            "volagent:policy/types.volume": crate::model::Volume,
            "volagent:policy/types.consumer": crate::policy::contract::v1::Facts,
            "volagent:policy/types.node": crate::model::NodeFacts,
            "volagent:policy/types.node-paths": crate::model::NodePaths,
            "volagent:policy/types.plan": crate::policy::contract::v1::Steps,
            "volagent:policy/provisioning.create-request": crate::model::CreateRequest,
            "volagent:policy/provisioning.target": crate::model::Target,
            "volagent:policy/provisioning.capacity-request": crate::model::CapacityRequest,
            "volagent:policy/provisioning.provision": crate::model::Provision,
        },
    });
}

use bindings::exports::volagent::policy as ex;
use bindings::volagent::policy::{
    ceph, ceph_provisioning, gluster_provisioning, host, local_provisioning as lp, loop_devices,
    nbd, provisioning as pv, types as a,
};

pub(crate) const VERSION: &str = "1.1.0";

/// A consumer as a guest sees it: the requester, or a holder with the
/// time the ledger recorded it.
pub struct Facts {
    consumer: m::Consumer,
    since: Option<String>,
}

/// A plan as a guest builds it.
#[derive(Default)]
pub struct Steps {
    steps: m::Plan,
}

/// Plans one call may make, and node facts it may ask for: a guest making
/// them without end is stopped rather than let grow the host's memory.
const MAX_PLANS_PER_CALL: u32 = 64;
const MAX_NODES_PER_CALL: u32 = 1024;

cases!(AccessMode [ReadWriteOnce, ReadOnlyMany, ReadWriteMany, ReadWriteOncePod]);
cases!(VolumeMode [Filesystem, Block]);
cases!(PathKind [Missing, RegularFile, Directory, BlockDevice, Other]);
cases!(LogLevel [Debug, Info, Warn, Error]);
cases!(FormatMode [IfUnformatted, Always]);
cases!(CleanupReason [StaleNode, StorageClusterDeleted, LocalVolumeReleased]);
cases!(BlockSource [] (Attached, Device));
cases!(WipeMethod [Signatures, Discard, Zero] (Shred));
cases!(MountSource [] (Block, Network));
cases!(PolicyError [] (InvalidOptions, Unsupported));

impl Down<a::MountEntry> for m::MountEntry {
    fn down(&self) -> a::MountEntry {
        a::MountEntry {
            source: self.source.clone(),
            target: self.target.clone(),
            fs_type: self.fs_type.clone(),
            read_only: self.read_only,
        }
    }
}

/// The `host` and backend imports of this contract.
pub(crate) fn add_to_linker(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    bindings::ProvisioningBackend::add_to_linker::<CallState, HasSelf<CallState>>(linker, |s| s)
}

pub(crate) struct Pre {
    pre: InstancePre<CallState>,
    policy: ex::policy::GuestIndices,
    block: Option<ex::block_volumes::GuestIndices>,
    expand: Option<ex::expand::GuestIndices>,
    health: Option<ex::health::GuestIndices>,
    provisioner: Option<ex::provisioner::GuestIndices>,
}

/// Whether the component exports interface `name` of this contract (at
/// any 1.x version: wasmtime matches export names by semver).
fn exports(pre: &InstancePre<CallState>, name: &str) -> bool {
    pre.component().get_export_index(None, format!("volagent:policy/{name}@{VERSION}")).is_some()
}

pub(crate) fn link(pre: InstancePre<CallState>) -> wasmtime::Result<Pre> {
    let policy = ex::policy::GuestIndices::new(&pre)?;
    // An optional interface the guest exports must be whole.
    let block = exports(&pre, "block-volumes")
        .then(|| ex::block_volumes::GuestIndices::new(&pre))
        .transpose()?;
    let expand =
        exports(&pre, "expand").then(|| ex::expand::GuestIndices::new(&pre)).transpose()?;
    let health =
        exports(&pre, "health").then(|| ex::health::GuestIndices::new(&pre)).transpose()?;
    let provisioner = exports(&pre, "provisioner")
        .then(|| ex::provisioner::GuestIndices::new(&pre))
        .transpose()?;
    Ok(Pre { pre, policy, block, expand, health, provisioner })
}

impl Linked for Pre {
    fn version(&self) -> &'static str {
        VERSION
    }

    fn unaskable(&self, volume: &m::Volume, _: Option<&m::Consumer>) -> Option<m::PolicyError> {
        (volume.mode == m::VolumeMode::Block && self.block.is_none()).then(|| {
            m::PolicyError::Unsupported(
                "block volumes: the backend does not export volagent:policy/block-volumes".into(),
            )
        })
    }

    fn optional(&self) -> Vec<&'static str> {
        [
            ("block-volumes", self.block.is_some()),
            ("expand", self.expand.is_some()),
            ("health", self.health.is_some()),
            ("provisioner", self.provisioner.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, exported)| exported.then_some(name))
        .collect()
    }

    fn instantiate(&self, store: &mut Store<CallState>) -> wasmtime::Result<Box<dyn Guest>> {
        let instance = self.pre.instantiate(&mut *store)?;
        let policy = self.policy.load(&mut *store, &instance)?;
        let block = self.block.as_ref().map(|i| i.load(&mut *store, &instance)).transpose()?;
        let expand = self.expand.as_ref().map(|i| i.load(&mut *store, &instance)).transpose()?;
        let health = self.health.as_ref().map(|i| i.load(&mut *store, &instance)).transpose()?;
        let provisioner =
            self.provisioner.as_ref().map(|i| i.load(&mut *store, &instance)).transpose()?;
        Ok(Box::new(Instance { policy, block, expand, health, provisioner }))
    }

    fn provisions(&self) -> bool {
        self.provisioner.is_some()
    }
}

struct Instance {
    policy: ex::policy::Guest,
    block: Option<ex::block_volumes::Guest>,
    expand: Option<ex::expand::Guest>,
    health: Option<ex::health::Guest>,
    provisioner: Option<ex::provisioner::Guest>,
}

/// A host value put in the call's table, for the guest to borrow.
fn give<T: Send + 'static>(s: &mut Store<CallState>, value: T) -> wasmtime::Result<Resource<T>> {
    let owned = s.data_mut().table().push(value)?;
    Ok(Resource::new_borrow(owned.rep()))
}

/// A host value put in the call's table, handed to the guest (lists and
/// records hold owned handles: the guest drops them, and the host's `drop`
/// takes them out of the table).
fn hand<T: Send + 'static>(s: &mut Store<CallState>, value: T) -> wasmtime::Result<Resource<T>> {
    Ok(s.data_mut().table().push(value)?)
}

fn give_consumers(
    s: &mut Store<CallState>,
    holders: &[m::Holder],
) -> wasmtime::Result<Vec<Resource<Facts>>> {
    holders
        .iter()
        .map(|h| hand(s, Facts { consumer: h.consumer.clone(), since: Some(h.since.clone()) }))
        .collect()
}

fn give_requester(
    s: &mut Store<CallState>,
    consumer: &m::Consumer,
) -> wasmtime::Result<Resource<Facts>> {
    give(s, Facts { consumer: consumer.clone(), since: None })
}

/// The plan a guest returned, out of the call's table.
fn take_plan(s: &mut Store<CallState>, plan: Resource<Steps>) -> wasmtime::Result<m::Plan> {
    Ok(s.data_mut().table().delete(plan)?.steps)
}

fn plan_answer(
    s: &mut Store<CallState>,
    r: Result<Resource<Steps>, a::PolicyError>,
) -> Answer<m::Plan> {
    Ok(match r {
        Ok(plan) => Ok(take_plan(s, plan)?),
        Err(e) => Err(e.up()),
    })
}

/// The request every plan call is given: the volume, the consumer, the
/// consumers beside it on this node and the paths.
type Request = (Resource<m::Volume>, Resource<Facts>, Vec<Resource<Facts>>, Resource<m::NodePaths>);

fn give_request(
    s: &mut Store<CallState>,
    volume: &m::Volume,
    consumer: &m::Consumer,
    local_holders: &[m::Holder],
    paths: &m::NodePaths,
) -> wasmtime::Result<Request> {
    Ok((
        give(s, volume.clone())?,
        give_requester(s, consumer)?,
        give_consumers(s, local_holders)?,
        give(s, paths.clone())?,
    ))
}

impl Guest for Instance {
    fn info(&self, s: &mut Store<CallState>) -> wasmtime::Result<m::BackendInfo> {
        capabilities(self.policy.call_info(s)?)
    }

    fn fence(
        &self,
        s: &mut Store<CallState>,
        volume: &m::Volume,
        requester: &m::Consumer,
        holders: &[m::Holder],
        nodes: &[m::NodeFacts],
    ) -> Answer<m::Decision> {
        let v = give(s, volume.clone())?;
        let r = give_requester(s, requester)?;
        let h = give_consumers(s, holders)?;
        let n = nodes.iter().map(|n| hand(s, n.clone())).collect::<wasmtime::Result<Vec<_>>>()?;
        let decision = match self.policy.call_fence(&mut *s, v, r, &h, &n)? {
            Ok(d) => d,
            Err(e) => return Ok(Err(e.up())),
        };
        Ok(Ok(match decision {
            a::Decision::Grant => m::Decision::Grant,
            a::Decision::Deny(why) => m::Decision::Deny(why),
            a::Decision::TakeOver(t) => {
                let fence_steps = take_plan(s, t.fence_steps)?;
                let stale = t
                    .stale
                    .iter()
                    .map(|&i| {
                        holders.get(i as usize).cloned().ok_or_else(|| {
                            wasmtime::format_err!(
                                "fence named stale holder {i}, but was given {} holders",
                                holders.len()
                            )
                        })
                    })
                    .collect::<wasmtime::Result<Vec<_>>>()?;
                m::Decision::TakeOver(m::TakeOver { stale, fence_steps })
            }
        }))
    }

    fn attach(
        &self,
        s: &mut Store<CallState>,
        volume: &m::Volume,
        requester: &m::Consumer,
        local_holders: &[m::Holder],
        paths: &m::NodePaths,
    ) -> Answer<m::Plan> {
        let (v, c, h, p) = give_request(s, volume, requester, local_holders, paths)?;
        let r = match (&self.block, volume.mode) {
            (Some(block), m::VolumeMode::Block) => block.call_attach(&mut *s, v, c, &h, p)?,
            // Asked only of guests that export it (`unaskable`).
            (None, m::VolumeMode::Block) => {
                wasmtime::bail!("a block volume put to a guest without block-volumes")
            }
            (_, m::VolumeMode::Filesystem) => self.policy.call_attach(&mut *s, v, c, &h, p)?,
        };
        plan_answer(s, r)
    }

    fn detach(
        &self,
        s: &mut Store<CallState>,
        volume: &m::Volume,
        consumer: &m::Consumer,
        local_holders: &[m::Holder],
        paths: &m::NodePaths,
    ) -> Answer<m::Plan> {
        let (v, c, h, p) = give_request(s, volume, consumer, local_holders, paths)?;
        let r = self.policy.call_detach(&mut *s, v, c, &h, p)?;
        plan_answer(s, r)
    }

    fn expand(
        &self,
        s: &mut Store<CallState>,
        volume: &m::Volume,
        consumer: &m::Consumer,
        paths: &m::NodePaths,
    ) -> Answer<Option<m::Plan>> {
        let Some(expand) = &self.expand else { return Ok(Ok(None)) };
        let (v, c, _, p) = give_request(s, volume, consumer, &[], paths)?;
        let r = expand.call_expand(&mut *s, v, c, p)?;
        Ok(plan_answer(s, r)?.map(Some))
    }

    fn condition(
        &self,
        s: &mut Store<CallState>,
        volume: &m::Volume,
        consumer: &m::Consumer,
        paths: &m::NodePaths,
    ) -> wasmtime::Result<Option<String>> {
        let Some(health) = &self.health else { return Ok(None) };
        let (v, c, _, p) = give_request(s, volume, consumer, &[], paths)?;
        health.call_condition(&mut *s, v, c, p)
    }

    fn cleanup(
        &self,
        s: &mut Store<CallState>,
        reason: m::CleanupReason,
        items: &[m::CleanupItem],
    ) -> Answer<m::Plan> {
        let mut given = Vec::with_capacity(items.len());
        for item in items {
            given.push(a::CleanupItem {
                volume: hand(s, item.volume.clone())?,
                paths: hand(s, item.paths.clone())?,
                holders: give_consumers(s, &item.holders)?,
            });
        }
        let r = self.policy.call_cleanup(&mut *s, reason.down(), &given)?;
        plan_answer(s, r)
    }

    fn provision(
        &self,
        s: &mut Store<CallState>,
        call: ProvisionCall<'_>,
    ) -> Provisioned<m::Provision> {
        let Some(p) = &self.provisioner else {
            wasmtime::bail!("a provisioner call put to a guest without the provisioner")
        };
        let r = match call {
            ProvisionCall::Create(request) => {
                let r = give(s, request.clone())?;
                p.call_create(&mut *s, r)?
            }
            ProvisionCall::Delete(t) => {
                let t = give(s, t.clone())?;
                p.call_delete(&mut *s, t)?
            }
            ProvisionCall::Expand(t) => {
                let t = give(s, t.clone())?;
                p.call_expand(&mut *s, t)?
            }
            ProvisionCall::Snapshot(t) => {
                let t = give(s, t.clone())?;
                p.call_snapshot(&mut *s, t)?
            }
            ProvisionCall::DeleteSnapshot(t) => {
                let t = give(s, t.clone())?;
                p.call_delete_snapshot(&mut *s, t)?
            }
        };
        Ok(match r {
            Ok(plan) => Ok(s.data_mut().table().delete(plan)?),
            Err(e) => Err(provision_error(e)),
        })
    }

    fn capacity(
        &self,
        s: &mut Store<CallState>,
        request: &m::CapacityRequest,
    ) -> Provisioned<Option<u64>> {
        let Some(p) = &self.provisioner else {
            wasmtime::bail!("a capacity call put to a guest without the provisioner")
        };
        let r = give(s, request.clone())?;
        Ok(p.call_capacity(&mut *s, r)?.map_err(provision_error))
    }
}

fn provision_error(e: pv::ProvisionError) -> m::ProvisionError {
    match e {
        pv::ProvisionError::Invalid(why) => m::ProvisionError::Invalid(why),
        pv::ProvisionError::Unsupported(why) => m::ProvisionError::Unsupported(why),
        pv::ProvisionError::NotFound(why) => m::ProvisionError::NotFound(why),
        pv::ProvisionError::Exhausted(why) => m::ProvisionError::Exhausted(why),
        pv::ProvisionError::OutOfRange(why) => m::ProvisionError::OutOfRange(why),
    }
}

/// Capabilities by name, as this contract declares them; a name this host
/// does not know (a later contract's) is refused.
fn capabilities(info: a::BackendInfo) -> wasmtime::Result<m::BackendInfo> {
    fn known<T: Copy>(
        what: &str,
        names: &[String],
        all: &[T],
        name: impl Fn(T) -> &'static str,
    ) -> wasmtime::Result<Vec<T>> {
        names
            .iter()
            .map(|n| {
                all.iter().copied().find(|k| name(*k) == n).ok_or_else(|| {
                    wasmtime::format_err!(
                        "info declares {what} {n:?}, which contract {VERSION} does not have"
                    )
                })
            })
            .collect()
    }
    // Node steps and controller steps share the one list of names.
    let (controller, node): (Vec<String>, Vec<String>) = info
        .steps
        .into_iter()
        .partition(|n| m::ControllerStepKind::ALL.iter().any(|k| k.name() == n));
    Ok(m::BackendInfo {
        capabilities: m::Capabilities {
            steps: known("step kind", &node, &m::StepKind::ALL, m::StepKind::name)?,
            controller_steps: known(
                "step kind",
                &controller,
                &m::ControllerStepKind::ALL,
                m::ControllerStepKind::name,
            )?,
            device_kinds: known(
                "device kind",
                &info.device_kinds,
                &m::DeviceKind::ALL,
                m::DeviceKind::name,
            )?,
            filesystems: info.filesystems,
            network_filesystems: info.network_filesystems,
            path_roots: known("path root", &info.path_roots, &m::PathRoot::ALL, m::PathRoot::name)?,
        },
        name: info.name,
        version: info.version,
        description: info.description,
    })
}

impl CallState {
    fn get<T: 'static>(&mut self, r: &Resource<T>) -> wasmtime::Result<&T> {
        Ok(self.table().get(r)?)
    }

    /// One step more in `plan`. Past the most a plan may have, steps are
    /// no longer kept: the plan is refused as too long when checked.
    fn push_step(&mut self, plan: &Resource<Steps>, step: m::Step) -> wasmtime::Result<()> {
        let steps = &mut self.table().get_mut(plan)?.steps;
        if steps.len() <= MAX_PLAN_STEPS {
            steps.push(step);
        }
        Ok(())
    }
}

impl a::Host for CallState {}

impl a::HostVolume for CallState {
    fn name(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<String> {
        Ok(self.get(&v)?.name.clone())
    }
    fn backend(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<String> {
        Ok(self.get(&v)?.backend.clone())
    }
    fn access_mode(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<a::AccessMode> {
        Ok(self.get(&v)?.access_mode.down())
    }
    fn fs_type(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<String> {
        Ok(self.get(&v)?.fs_type.clone())
    }
    fn mode(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<a::VolumeMode> {
        Ok(self.get(&v)?.mode.down())
    }
    fn mount_flags(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<Vec<String>> {
        Ok(self.get(&v)?.mount_flags.clone())
    }
    fn options(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(self.get(&v)?.options.iter().map(|kv| (kv.key.clone(), kv.value.clone())).collect())
    }
    fn secret_keys(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<Vec<String>> {
        Ok(self.get(&v)?.secret_keys.clone())
    }
    fn drop(&mut self, v: Resource<m::Volume>) -> wasmtime::Result<()> {
        self.table().delete(v)?;
        Ok(())
    }
}

impl a::HostConsumer for CallState {
    fn node(&mut self, c: Resource<Facts>) -> wasmtime::Result<String> {
        Ok(self.get(&c)?.consumer.node.clone())
    }
    fn pod_namespace(&mut self, c: Resource<Facts>) -> wasmtime::Result<String> {
        Ok(self.get(&c)?.consumer.pod_namespace.clone())
    }
    fn pod(&mut self, c: Resource<Facts>) -> wasmtime::Result<String> {
        Ok(self.get(&c)?.consumer.pod.clone())
    }
    fn pod_uid(&mut self, c: Resource<Facts>) -> wasmtime::Result<String> {
        Ok(self.get(&c)?.consumer.pod_uid.clone())
    }
    fn mount_dir(&mut self, c: Resource<Facts>) -> wasmtime::Result<String> {
        Ok(self.get(&c)?.consumer.mount_dir.clone())
    }
    fn read_only(&mut self, c: Resource<Facts>) -> wasmtime::Result<bool> {
        Ok(self.get(&c)?.consumer.read_only)
    }
    fn mount_group(&mut self, c: Resource<Facts>) -> wasmtime::Result<Option<String>> {
        Ok(self.get(&c)?.consumer.mount_group.clone())
    }
    fn since(&mut self, c: Resource<Facts>) -> wasmtime::Result<Option<String>> {
        Ok(self.get(&c)?.since.clone())
    }
    fn drop(&mut self, c: Resource<Facts>) -> wasmtime::Result<()> {
        self.table().delete(c)?;
        Ok(())
    }
}

impl a::HostNode for CallState {
    fn name(&mut self, n: Resource<m::NodeFacts>) -> wasmtime::Result<String> {
        Ok(self.get(&n)?.name.clone())
    }
    fn exists(&mut self, n: Resource<m::NodeFacts>) -> wasmtime::Result<bool> {
        Ok(self.get(&n)?.exists)
    }
    fn ready(&mut self, n: Resource<m::NodeFacts>) -> wasmtime::Result<bool> {
        Ok(self.get(&n)?.ready)
    }
    fn out_of_service(&mut self, n: Resource<m::NodeFacts>) -> wasmtime::Result<bool> {
        Ok(self.get(&n)?.out_of_service)
    }
    fn drop(&mut self, n: Resource<m::NodeFacts>) -> wasmtime::Result<()> {
        self.table().delete(n)?;
        Ok(())
    }
}

impl a::HostNodePaths for CallState {
    fn kubelet_root(&mut self, p: Resource<m::NodePaths>) -> wasmtime::Result<String> {
        Ok(self.get(&p)?.kubelet_root.clone())
    }
    fn staging_dir(&mut self, p: Resource<m::NodePaths>) -> wasmtime::Result<String> {
        Ok(self.get(&p)?.staging_dir.clone())
    }
    fn state_dir(&mut self, p: Resource<m::NodePaths>) -> wasmtime::Result<String> {
        Ok(self.get(&p)?.state_dir.clone())
    }
    fn discovery_dirs(&mut self, p: Resource<m::NodePaths>) -> wasmtime::Result<Vec<String>> {
        Ok(self.get(&p)?.discovery_dirs.clone())
    }
    fn drop(&mut self, p: Resource<m::NodePaths>) -> wasmtime::Result<()> {
        self.table().delete(p)?;
        Ok(())
    }
}

impl a::HostPlan for CallState {
    fn new(&mut self) -> wasmtime::Result<Resource<Steps>> {
        if !self.count_made(Made::Plan, MAX_PLANS_PER_CALL) {
            wasmtime::bail!("more than {MAX_PLANS_PER_CALL} plans made in one call");
        }
        Ok(self.table().push(Steps::default())?)
    }
    fn format(
        &mut self,
        p: Resource<Steps>,
        device: a::BlockSource,
        fs_type: String,
        mode: a::FormatMode,
    ) -> wasmtime::Result<()> {
        let step = m::Format { device: device.up(), fs_type, mode: mode.up() };
        self.push_step(&p, m::Step::Format(step))
    }
    fn mount(
        &mut self,
        p: Resource<Steps>,
        source: a::MountSource,
        target: String,
        fs_type: String,
        options: Vec<String>,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        let step = m::Mount { source: source.up(), target, fs_type, options, read_only };
        self.push_step(&p, m::Step::Mount(step))
    }
    fn bind_mount(
        &mut self,
        p: Resource<Steps>,
        source: String,
        target: String,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        self.push_step(&p, m::Step::BindMount(m::BindMount { source, target, read_only }))
    }
    fn unmount(&mut self, p: Resource<Steps>, target: String, force: bool) -> wasmtime::Result<()> {
        self.push_step(&p, m::Step::Unmount(m::Unmount { target, force }))
    }
    fn wipe(
        &mut self,
        p: Resource<Steps>,
        device: a::BlockSource,
        method: a::WipeMethod,
    ) -> wasmtime::Result<()> {
        self.push_step(&p, m::Step::Wipe(m::Wipe { device: device.up(), method: method.up() }))
    }
    fn clear_directory(&mut self, p: Resource<Steps>, path: String) -> wasmtime::Result<()> {
        self.push_step(&p, m::Step::ClearDirectory(m::ClearDirectory { path }))
    }
    fn publish_block(
        &mut self,
        p: Resource<Steps>,
        device: a::BlockSource,
        target: String,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        let step = m::PublishBlock { device: device.up(), target, read_only };
        self.push_step(&p, m::Step::PublishBlock(step))
    }
    fn grow_filesystem(&mut self, p: Resource<Steps>, target: String) -> wasmtime::Result<()> {
        self.push_step(&p, m::Step::GrowFilesystem(m::GrowFilesystem { target }))
    }
    fn drop(&mut self, p: Resource<Steps>) -> wasmtime::Result<()> {
        self.table().delete(p)?;
        Ok(())
    }
}

impl host::Host for CallState {
    fn log(&mut self, level: a::LogLevel, message: String) -> wasmtime::Result<()> {
        self.guest_log(level.up(), message);
        Ok(())
    }

    fn node_state(&mut self, name: String) -> wasmtime::Result<Resource<m::NodeFacts>> {
        if !self.count_made(Made::Node, MAX_NODES_PER_CALL) {
            wasmtime::bail!("more than {MAX_NODES_PER_CALL} node-state answers in one call");
        }
        let facts = self.queries().node_state(&name);
        Ok(self.table().push(facts)?)
    }

    // A query the host will not answer fails the guest's call (a trap
    // carrying the QueryError): no answer the contract has would be true.
    fn lookup_path(&mut self, path: String) -> wasmtime::Result<a::PathKind> {
        Ok(self.queries().lookup_path(&path)?.down())
    }

    fn filesystem_type(&mut self, device: String) -> wasmtime::Result<Option<String>> {
        Ok(self.queries().filesystem_type(&device)?)
    }

    fn mount_at(&mut self, target: String) -> wasmtime::Result<Option<a::MountEntry>> {
        Ok(self.queries().mount_at(&target)?.down())
    }
}

impl loop_devices::Host for CallState {
    fn attach(
        &mut self,
        p: Resource<Steps>,
        id: String,
        file: String,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        let spec = m::DeviceSpec::Loop(file);
        self.push_step(&p, m::Step::AttachDevice(m::AttachDevice { id, spec, read_only }))
    }
    fn detach(&mut self, p: Resource<Steps>, file: String, force: bool) -> wasmtime::Result<()> {
        let spec = m::DeviceSpec::Loop(file);
        self.push_step(&p, m::Step::DetachDevice(m::DetachDevice { spec, force }))
    }
}

fn nbd_spec(e: nbd::NbdExport) -> m::DeviceSpec {
    m::DeviceSpec::Nbd(m::NbdSpec {
        server: e.server,
        export_name: e.export_name,
        local_file: e.local_file,
        attach: match e.transport {
            nbd::Transport::Auto => m::NbdAttach::Auto,
            nbd::Transport::Kernel => m::NbdAttach::Kernel,
            nbd::Transport::Userspace => m::NbdAttach::Userspace,
        },
        connections: e.connections,
    })
}

impl nbd::Host for CallState {
    fn attach(
        &mut self,
        p: Resource<Steps>,
        id: String,
        export: nbd::NbdExport,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        let spec = nbd_spec(export);
        self.push_step(&p, m::Step::AttachDevice(m::AttachDevice { id, spec, read_only }))
    }
    fn detach(
        &mut self,
        p: Resource<Steps>,
        export: nbd::NbdExport,
        force: bool,
    ) -> wasmtime::Result<()> {
        let spec = nbd_spec(export);
        self.push_step(&p, m::Step::DetachDevice(m::DetachDevice { spec, force }))
    }
}

fn rbd_spec(i: ceph::Image) -> m::DeviceSpec {
    m::DeviceSpec::Rbd(m::RbdSpec {
        monitors: i.monitors,
        pool: i.pool,
        image: i.image,
        user: i.user,
        secret_key: i.secret_key,
        attach: match i.attach {
            ceph::RbdAttach::Auto => m::RbdAttach::Auto,
            ceph::RbdAttach::Kernel => m::RbdAttach::Kernel,
            ceph::RbdAttach::Nbd => m::RbdAttach::Nbd,
            ceph::RbdAttach::Fuse => m::RbdAttach::Fuse,
        },
    })
}

impl ceph::Host for CallState {
    fn attach(
        &mut self,
        p: Resource<Steps>,
        id: String,
        image: ceph::Image,
        read_only: bool,
    ) -> wasmtime::Result<()> {
        let spec = rbd_spec(image);
        self.push_step(&p, m::Step::AttachDevice(m::AttachDevice { id, spec, read_only }))
    }
    fn detach(
        &mut self,
        p: Resource<Steps>,
        image: ceph::Image,
        force: bool,
    ) -> wasmtime::Result<()> {
        let spec = rbd_spec(image);
        self.push_step(&p, m::Step::DetachDevice(m::DetachDevice { spec, force }))
    }
    fn blocklist_client(
        &mut self,
        p: Resource<Steps>,
        monitors: Vec<String>,
        user: String,
        secret_key: Option<String>,
        address: String,
    ) -> wasmtime::Result<()> {
        let step = m::BlocklistClient { monitors, user, secret_key, address };
        self.push_step(&p, m::Step::BlocklistClient(step))
    }
    fn image_watchers(
        &mut self,
        pool: String,
        image: String,
    ) -> wasmtime::Result<Result<Vec<ceph::Watcher>, String>> {
        Ok(self.queries().image_watchers(&pool, &image).map(|ws| {
            ws.into_iter()
                .map(|w| ceph::Watcher { address: w.address, client: w.client, node: w.node })
                .collect()
        }))
    }
}

/// A provision plan's steps are kept up to this many; past it the plan is
/// refused when checked.
const MAX_CONTROLLER_STEPS: usize = 32;

fn segment_down(segment: &m::Segment) -> pv::Segment {
    segment.clone()
}

fn pairs(kvs: &[m::KeyValue]) -> Vec<(String, String)> {
    kvs.iter().map(|kv| (kv.key.clone(), kv.value.clone())).collect()
}

impl pv::Host for CallState {}

impl pv::HostCreateRequest for CallState {
    fn name(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<String> {
        Ok(self.get(&r)?.name.clone())
    }
    fn required_bytes(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<u64> {
        Ok(self.get(&r)?.required_bytes)
    }
    fn limit_bytes(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<u64> {
        Ok(self.get(&r)?.limit_bytes)
    }
    fn parameters(
        &mut self,
        r: Resource<m::CreateRequest>,
    ) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(pairs(&self.get(&r)?.parameters))
    }
    fn access_modes(
        &mut self,
        r: Resource<m::CreateRequest>,
    ) -> wasmtime::Result<Vec<a::AccessMode>> {
        Ok(self.get(&r)?.access_modes.down())
    }
    fn mode(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<a::VolumeMode> {
        Ok(self.get(&r)?.mode.down())
    }
    fn fs_type(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<String> {
        Ok(self.get(&r)?.fs_type.clone())
    }
    fn requisite(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<Vec<pv::Segment>> {
        Ok(self.get(&r)?.requisite.iter().map(segment_down).collect())
    }
    fn preferred(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<Vec<pv::Segment>> {
        Ok(self.get(&r)?.preferred.iter().map(segment_down).collect())
    }
    fn source(
        &mut self,
        r: Resource<m::CreateRequest>,
    ) -> wasmtime::Result<Option<pv::ContentSource>> {
        Ok(self.get(&r)?.source.as_ref().map(|s| match s {
            m::ContentSource::Snapshot(id) => pv::ContentSource::Snapshot(id.clone()),
            m::ContentSource::Volume(id) => pv::ContentSource::Volume(id.clone()),
        }))
    }
    fn drop(&mut self, r: Resource<m::CreateRequest>) -> wasmtime::Result<()> {
        self.table().delete(r)?;
        Ok(())
    }
}

impl pv::HostTarget for CallState {
    fn id(&mut self, t: Resource<m::Target>) -> wasmtime::Result<String> {
        Ok(self.get(&t)?.id.clone())
    }
    fn name(&mut self, t: Resource<m::Target>) -> wasmtime::Result<String> {
        Ok(self.get(&t)?.name.clone())
    }
    fn required_bytes(&mut self, t: Resource<m::Target>) -> wasmtime::Result<u64> {
        Ok(self.get(&t)?.required_bytes)
    }
    fn limit_bytes(&mut self, t: Resource<m::Target>) -> wasmtime::Result<u64> {
        Ok(self.get(&t)?.limit_bytes)
    }
    fn parameters(&mut self, t: Resource<m::Target>) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(pairs(&self.get(&t)?.parameters))
    }
    fn drop(&mut self, t: Resource<m::Target>) -> wasmtime::Result<()> {
        self.table().delete(t)?;
        Ok(())
    }
}

impl pv::HostCapacityRequest for CallState {
    fn parameters(
        &mut self,
        r: Resource<m::CapacityRequest>,
    ) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(pairs(&self.get(&r)?.parameters))
    }
    fn segment(
        &mut self,
        r: Resource<m::CapacityRequest>,
    ) -> wasmtime::Result<Option<pv::Segment>> {
        Ok(self.get(&r)?.segment.as_ref().map(segment_down))
    }
    fn drop(&mut self, r: Resource<m::CapacityRequest>) -> wasmtime::Result<()> {
        self.table().delete(r)?;
        Ok(())
    }
}

impl CallState {
    /// One controller step more in `plan`, kept up to the most a plan may
    /// have (a longer plan is refused when checked).
    fn push_controller_step(
        &mut self,
        plan: &Resource<m::Provision>,
        step: m::ControllerStep,
    ) -> wasmtime::Result<()> {
        let steps = &mut self.table().get_mut(plan)?.steps;
        if steps.len() <= MAX_CONTROLLER_STEPS {
            steps.push(step);
        }
        Ok(())
    }
}

impl pv::HostProvision for CallState {
    fn new(&mut self) -> wasmtime::Result<Resource<m::Provision>> {
        if !self.count_made(Made::Plan, MAX_PLANS_PER_CALL) {
            wasmtime::bail!("more than {MAX_PLANS_PER_CALL} plans made in one call");
        }
        Ok(self.table().push(m::Provision::default())?)
    }
    // Setters keep a bounded amount: the plan's check refuses what is over.
    fn set_id(&mut self, p: Resource<m::Provision>, id: String) -> wasmtime::Result<()> {
        self.table().get_mut(&p)?.id = crate::text::bounded(id, 1024);
        Ok(())
    }
    fn set_capacity(&mut self, p: Resource<m::Provision>, bytes: u64) -> wasmtime::Result<()> {
        self.table().get_mut(&p)?.capacity_bytes = bytes;
        Ok(())
    }
    fn set_attribute(
        &mut self,
        p: Resource<m::Provision>,
        key: String,
        value: String,
    ) -> wasmtime::Result<()> {
        let attributes = &mut self.table().get_mut(&p)?.attributes;
        attributes.retain(|kv| kv.key != key);
        if attributes.len() <= crate::policy::validate::MAX_ATTRIBUTES {
            attributes.push(m::KeyValue { key, value });
        }
        Ok(())
    }
    fn add_topology(
        &mut self,
        p: Resource<m::Provision>,
        segment: pv::Segment,
    ) -> wasmtime::Result<()> {
        let topology = &mut self.table().get_mut(&p)?.topology;
        if topology.len() <= crate::policy::validate::MAX_SEGMENTS {
            topology.push(segment);
        }
        Ok(())
    }
    fn drop(&mut self, p: Resource<m::Provision>) -> wasmtime::Result<()> {
        self.table().delete(p)?;
        Ok(())
    }
}

fn image_ref(cluster: String, pool: String, image: String) -> m::ImageRef {
    m::ImageRef { cluster, pool, image }
}

impl ceph_provisioning::Host for CallState {
    fn create_image(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        pool: String,
        image: String,
        size_bytes: u64,
        data_pool: Option<String>,
        features: Vec<String>,
    ) -> wasmtime::Result<()> {
        let image = image_ref(cluster, pool, image);
        let step = m::CreateImage { image, size_bytes, data_pool, features };
        self.push_controller_step(&p, m::ControllerStep::CreateImage(step))
    }
    fn delete_image(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        pool: String,
        image: String,
    ) -> wasmtime::Result<()> {
        let step = m::ControllerStep::DeleteImage(image_ref(cluster, pool, image));
        self.push_controller_step(&p, step)
    }
    fn resize_image(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        pool: String,
        image: String,
        size_bytes: u64,
    ) -> wasmtime::Result<()> {
        let step = m::ResizeImage { image: image_ref(cluster, pool, image), size_bytes };
        self.push_controller_step(&p, m::ControllerStep::ResizeImage(step))
    }
    fn create_snapshot(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        pool: String,
        image: String,
        snapshot: String,
    ) -> wasmtime::Result<()> {
        let step = m::SnapshotRef { image: image_ref(cluster, pool, image), snapshot };
        self.push_controller_step(&p, m::ControllerStep::CreateSnapshot(step))
    }
    fn delete_snapshot(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        pool: String,
        image: String,
        snapshot: String,
    ) -> wasmtime::Result<()> {
        let step = m::SnapshotRef { image: image_ref(cluster, pool, image), snapshot };
        self.push_controller_step(&p, m::ControllerStep::DeleteSnapshot(step))
    }
    fn clone_image(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        pool: String,
        parent: String,
        snapshot: String,
        image: String,
        features: Vec<String>,
        max_depth: u32,
    ) -> wasmtime::Result<()> {
        let parent = m::SnapshotRef { image: image_ref(cluster, pool, parent), snapshot };
        let step = m::CloneImage { parent, image, features, max_depth };
        self.push_controller_step(&p, m::ControllerStep::CloneImage(step))
    }
}

fn directory_ref(cluster: String, volume: String, path: String) -> m::DirectoryRef {
    m::DirectoryRef { cluster, volume, path }
}

impl gluster_provisioning::Host for CallState {
    fn create_directory(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        volume: String,
        path: String,
        quota_bytes: u64,
    ) -> wasmtime::Result<()> {
        let step = m::CreateDirectory { dir: directory_ref(cluster, volume, path), quota_bytes };
        self.push_controller_step(&p, m::ControllerStep::CreateDirectory(step))
    }
    fn remove_directory(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        volume: String,
        path: String,
    ) -> wasmtime::Result<()> {
        let step = m::ControllerStep::RemoveDirectory(directory_ref(cluster, volume, path));
        self.push_controller_step(&p, step)
    }
    fn set_quota(
        &mut self,
        p: Resource<m::Provision>,
        cluster: String,
        volume: String,
        path: String,
        bytes: u64,
    ) -> wasmtime::Result<()> {
        let step = m::SetQuota { dir: directory_ref(cluster, volume, path), bytes };
        self.push_controller_step(&p, m::ControllerStep::SetQuota(step))
    }
}

fn local_volumes_down(volumes: &[m::LocalVolume]) -> Vec<lp::LocalVolume> {
    volumes
        .iter()
        .map(|v| lp::LocalVolume {
            name: v.name.clone(),
            node: v.node.clone(),
            kind: match v.kind {
                m::LocalKind::Filesystem => lp::LocalKind::Filesystem,
                m::LocalKind::Block => lp::LocalKind::Block,
                m::LocalKind::File => lp::LocalKind::File,
            },
            capacity_bytes: v.capacity_bytes,
        })
        .collect()
}

impl lp::Host for CallState {
    fn free_volumes(
        &mut self,
        r: Resource<m::CreateRequest>,
    ) -> wasmtime::Result<Vec<lp::LocalVolume>> {
        Ok(local_volumes_down(&self.get(&r)?.local_volumes))
    }
    fn free_volumes_in(
        &mut self,
        r: Resource<m::CapacityRequest>,
    ) -> wasmtime::Result<Vec<lp::LocalVolume>> {
        Ok(local_volumes_down(&self.get(&r)?.local_volumes))
    }
    fn take_volume(&mut self, p: Resource<m::Provision>, volume: String) -> wasmtime::Result<()> {
        let volume = crate::text::bounded(volume, 1024);
        self.push_controller_step(&p, m::ControllerStep::TakeLocalVolume(volume))
    }
    fn release_volume(
        &mut self,
        p: Resource<m::Provision>,
        volume: String,
    ) -> wasmtime::Result<()> {
        let volume = crate::text::bounded(volume, 1024);
        self.push_controller_step(&p, m::ControllerStep::ReleaseLocalVolume(volume))
    }
}
