//! Guests of `volagent:policy@0.5.0`: the whole contract in records and
//! variants, every call one export of the `policy` interface.

use super::convert::{Down, Up, cases, record};
use super::{Answer, Guest, Linked};
use crate::model as m;
use crate::policy::imports::CallState;
use wasmtime::Store;
use wasmtime::component::{HasSelf, InstancePre, Linker};

mod bindings {
    wasmtime::component::bindgen!({
        world: "backend",
        path: "wit-compat/0.5",
        // A host query may refuse to answer (outside the backend's roots,
        // no answer in time): the guest's call then fails.
        imports: { default: trappable },
    });
}

use bindings::volagent::policy::types as a;

pub(crate) const VERSION: &str = "0.5.0";

record!(KeyValue { key, value });
record!(Volume { name, backend, access_mode, fs_type, mode, mount_flags, options, secret_keys });
record!(Consumer { node, pod_namespace, pod, pod_uid, mount_dir, read_only, mount_group });
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
record!(PublishBlock { device, target, read_only });
record!(GrowFilesystem { target });
record!(Capabilities { steps, device_kinds, filesystems, network_filesystems, path_roots } default { controller_steps });
record!(BackendInfo { name, version, description, capabilities });
record!(TakeOver { stale, fence_steps });
record!(CleanupItem { volume, paths, holders });
cases!(AccessMode [ReadWriteOnce, ReadOnlyMany, ReadWriteMany, ReadWriteOncePod]);
cases!(VolumeMode [Filesystem, Block]);
cases!(PathKind [Missing, RegularFile, Directory, BlockDevice, Other]);
cases!(LogLevel [Debug, Info, Warn, Error]);
cases!(DeviceKind [Loop, Nbd, Rbd]);
cases!(NbdAttach [Auto, Kernel, Userspace]);
cases!(RbdAttach [Auto, Kernel, Nbd, Fuse]);
cases!(FormatMode [IfUnformatted, Always]);
cases!(CleanupReason [StaleNode, StorageClusterDeleted, LocalVolumeReleased]);
cases!(PathRoot [PodMountDir, StagingDir, StateDir, DiscoveryDirs]);
cases!(StepKind [
    AttachDevice, Format, Mount, BindMount, Unmount, DetachDevice, Wipe, BlocklistClient,
    ClearDirectory, PublishBlock, GrowFilesystem,
]);
cases!(DeviceSpec [] (Loop, Nbd, Rbd));
cases!(BlockSource [] (Attached, Device));
cases!(WipeMethod [Signatures, Discard, Zero] (Shred));
cases!(MountSource [] (Block, Network));
cases!(Step [] (
    AttachDevice, Format, Mount, BindMount, Unmount, DetachDevice, Wipe, ClearDirectory,
    BlocklistClient, PublishBlock, GrowFilesystem,
));
cases!(Decision[Grant](Deny, TakeOver));
cases!(PolicyError [] (InvalidOptions, Unsupported));

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
    fn instantiate(&self, store: &mut Store<CallState>) -> wasmtime::Result<Box<dyn Guest>> {
        Ok(Box::new(self.0.instantiate(store)?))
    }
}

impl Guest for bindings::Backend {
    super::records::record_calls!();

    fn expand(
        &self,
        s: &mut Store<CallState>,
        volume: &m::Volume,
        consumer: &m::Consumer,
        paths: &m::NodePaths,
    ) -> Answer<Option<m::Plan>> {
        let r = self.volagent_policy_policy().call_expand(
            s,
            &volume.down(),
            &consumer.down(),
            &paths.down(),
        )?;
        Ok(r.map(|plan| Some(plan.up())).map_err(Up::up))
    }

    fn condition(
        &self,
        s: &mut Store<CallState>,
        volume: &m::Volume,
        consumer: &m::Consumer,
        paths: &m::NodePaths,
    ) -> wasmtime::Result<Option<String>> {
        self.volagent_policy_policy().call_condition(
            s,
            &volume.down(),
            &consumer.down(),
            &paths.down(),
        )
    }
}

super::records::record_host!();
