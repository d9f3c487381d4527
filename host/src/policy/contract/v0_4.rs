//! Guests of `volagent:policy@0.4.0`. 0.5 only added to 0.4 — cases of
//! `step` and `step-kind`, fields of `volume` and `consumer`, the `expand`
//! and `condition` calls — so a 0.4 guest's answers convert as they stand
//! and a request reaches it with the new fields left out. A request it
//! cannot be asked truthfully (a block volume, mount flags, a mount group)
//! is refused as unsupported rather than narrowed.

use super::convert::{Down, Up, cases, cases_up, record, record_up};
use super::{Answer, Guest, Linked};
use crate::model as m;
use crate::policy::imports::CallState;
use wasmtime::Store;
use wasmtime::component::{HasSelf, InstancePre, Linker};

mod bindings {
    wasmtime::component::bindgen!({
        world: "backend",
        path: "wit-compat/0.4",
        imports: { default: trappable },
    });
}

use bindings::volagent::policy::types as a;

pub(crate) const VERSION: &str = "0.4.0";

record!(KeyValue { key, value });
record!(Volume { name, backend, access_mode, fs_type, options, secret_keys }
    default { mode, mount_flags });
record!(Consumer { node, pod_namespace, pod, pod_uid, mount_dir, read_only }
    default { mount_group });
record!(Holder { consumer, since });
record!(NodeFacts { name, exists, ready, out_of_service });
record!(NodePaths { kubelet_root, staging_dir, state_dir, discovery_dirs });
record!(MountEntry { source, target, fs_type, read_only });
record!(Watcher { address, client, node });
record!(NbdSpec { server, export_name, local_file, attach, connections });
record!(RbdSpec { monitors, pool, image, user, secret_key, attach });
record!(AttachDevice { id, spec, read_only });
record!(Format { device, fs_type, mode });
record!(Mount { source, target, fs_type, options, read_only });
record!(BindMount { source, target, read_only });
record!(Unmount { target, force });
record!(DetachDevice { spec, force });
record!(Wipe { device, method });
record!(ClearDirectory { path });
record!(BlocklistClient { monitors, user, secret_key, address });
record_up!(Capabilities { steps, device_kinds, filesystems, network_filesystems, path_roots } default { controller_steps });
record_up!(BackendInfo { name, version, description, capabilities });
record_up!(TakeOver { stale, fence_steps });
record!(CleanupItem { volume, paths, holders });
cases!(AccessMode [ReadWriteOnce, ReadOnlyMany, ReadWriteMany, ReadWriteOncePod]);
cases!(PathKind [Missing, RegularFile, Directory, BlockDevice, Other]);
cases!(LogLevel [Debug, Info, Warn, Error]);
cases!(DeviceKind [Loop, Nbd, Rbd]);
cases!(NbdAttach [Auto, Kernel, Userspace]);
cases!(RbdAttach [Auto, Kernel, Nbd, Fuse]);
cases!(FormatMode [IfUnformatted, Always]);
cases!(CleanupReason [StaleNode, StorageClusterDeleted, LocalVolumeReleased]);
cases!(PathRoot [PodMountDir, StagingDir, StateDir, DiscoveryDirs]);
cases_up!(StepKind [
    AttachDevice, Format, Mount, BindMount, Unmount, DetachDevice, Wipe, BlocklistClient,
    ClearDirectory,
]);
cases!(DeviceSpec [] (Loop, Nbd, Rbd));
cases!(BlockSource [] (Attached, Device));
cases!(WipeMethod [Signatures, Discard, Zero] (Shred));
cases!(MountSource [] (Block, Network));
cases_up!(Step [] (
    AttachDevice, Format, Mount, BindMount, Unmount, DetachDevice, Wipe, ClearDirectory,
    BlocklistClient,
));
cases_up!(Decision[Grant](Deny, TakeOver));
cases_up!(PolicyError [] (InvalidOptions, Unsupported));

/// Why `volume` and `consumer` cannot be put to a 0.4 guest, if they cannot.
fn unaskable(volume: &m::Volume, consumer: Option<&m::Consumer>) -> Option<m::PolicyError> {
    let why = if volume.mode == m::VolumeMode::Block {
        "block volumes"
    } else if !volume.mount_flags.is_empty() {
        "mount flags"
    } else if consumer.is_some_and(|c| c.mount_group.is_some()) {
        "a volume mount group"
    } else {
        return None;
    };
    Some(m::PolicyError::Unsupported(format!(
        "the backend speaks volagent:policy@{VERSION}, which has no {why}; rebuild it against a newer contract"
    )))
}

/// The `host` imports of this contract.
pub(crate) fn add_to_linker(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    bindings::Backend::add_to_linker::<CallState, HasSelf<CallState>>(linker, |s| s)
}

pub(crate) struct Pre(bindings::BackendPre<CallState>);

pub(crate) fn link(pre: InstancePre<CallState>) -> wasmtime::Result<Pre> {
    Ok(Pre(bindings::BackendPre::new(pre)?))
}

impl Linked for Pre {
    fn version(&self) -> &'static str {
        VERSION
    }
    fn unaskable(
        &self,
        volume: &m::Volume,
        consumer: Option<&m::Consumer>,
    ) -> Option<m::PolicyError> {
        unaskable(volume, consumer)
    }
    fn instantiate(&self, store: &mut Store<CallState>) -> wasmtime::Result<Box<dyn Guest>> {
        Ok(Box::new(self.0.instantiate(store)?))
    }
}

impl Guest for bindings::Backend {
    super::records::record_calls!();

    /// 0.4 had no expand: the host grows the filesystem itself.
    fn expand(
        &self,
        _: &mut Store<CallState>,
        _: &m::Volume,
        _: &m::Consumer,
        _: &m::NodePaths,
    ) -> Answer<Option<m::Plan>> {
        Ok(Ok(None))
    }

    /// 0.4 was never asked.
    fn condition(
        &self,
        _: &mut Store<CallState>,
        _: &m::Volume,
        _: &m::Consumer,
        _: &m::NodePaths,
    ) -> wasmtime::Result<Option<String>> {
        Ok(None)
    }
}

super::records::record_host!();
