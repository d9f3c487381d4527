//! The plan shapes backends share: one device per volume per node, mounted
//! once at the staging dir, and one bind mount per pod.

use crate::{
    AccessMode, AttachDevice, BindMount, BlockSource, Consumer, DetachDevice, DeviceSpec, Format,
    FormatMode, GrowFilesystem, Holder, Mount, MountSource, NodePaths, Plan, PublishBlock, Step,
    StepKind, Unmount, Volume, VolumeMode,
};

/// The id this crate gives the one device a plan attaches.
pub const DEVICE_ID: &str = "dev";

/// A ReadOnlyMany volume is attached, and its filesystem mounted, read-only.
pub fn volume_read_only(volume: &Volume) -> bool {
    volume.access_mode == AccessMode::ReadOnlyMany
}

/// Bind the staging dir into the requester's pod mount dir.
pub fn bind_into_pod(paths: &NodePaths, requester: &Consumer) -> Step {
    Step::BindMount(BindMount {
        source: paths.staging_dir.clone(),
        target: requester.mount_dir.clone(),
        read_only: requester.read_only,
    })
}

/// Where a volume's block device comes from.
pub enum BlockOrigin {
    /// Attached by the plan.
    Attach(DeviceSpec),
    /// Already a block device on the node.
    Existing(String),
}

impl BlockOrigin {
    /// The device as later steps name it; an attach-device step first
    /// (added to `plan`) when the plan attaches it.
    fn into_source(self, read_only: bool, plan: &mut Plan) -> BlockSource {
        match self {
            BlockOrigin::Attach(spec) => {
                plan.push(Step::AttachDevice(AttachDevice {
                    id: DEVICE_ID.to_string(),
                    spec,
                    read_only,
                }));
                BlockSource::Attached(DEVICE_ID.to_string())
            }
            BlockOrigin::Existing(device) => BlockSource::Device(device),
        }
    }
}

/// A block volume: its device attached (or found attached: attaching is
/// idempotent) and published as a device node at the requester's path.
/// No filesystem is made or mounted.
pub fn publish_block(volume: &Volume, origin: BlockOrigin, requester: &Consumer) -> Plan {
    let read_only = volume_read_only(volume);
    let mut plan = Vec::new();
    let device = origin.into_source(read_only, &mut plan);
    plan.push(Step::PublishBlock(PublishBlock {
        device,
        target: requester.mount_dir.clone(),
        read_only: read_only || requester.read_only,
    }));
    plan
}

/// Grow the filesystem at the consumer's dir; nothing for a block volume.
pub fn grow(volume: &Volume, consumer: &Consumer) -> Plan {
    match volume.mode {
        VolumeMode::Block => Vec::new(),
        VolumeMode::Filesystem => {
            vec![Step::GrowFilesystem(GrowFilesystem { target: consumer.mount_dir.clone() })]
        }
    }
}

/// Attach the block device (or use the existing one), make a filesystem on
/// it if it has none (never on a read-only volume), mount it at the staging
/// dir and bind it into the pod. When the volume is already staged on this
/// node (`local_holders` not empty), only the bind. A block volume is
/// published instead ([`publish_block`]).
pub fn stage_block(
    volume: &Volume,
    origin: BlockOrigin,
    fs_type: &str,
    mount_options: Vec<String>,
    requester: &Consumer,
    local_holders: &[Holder],
    paths: &NodePaths,
) -> Plan {
    if volume.mode == VolumeMode::Block {
        return publish_block(volume, origin, requester);
    }
    if !local_holders.is_empty() {
        return vec![bind_into_pod(paths, requester)];
    }
    let read_only = volume_read_only(volume);
    let mut plan = Vec::new();
    let source = origin.into_source(read_only, &mut plan);
    if !read_only {
        plan.push(Step::Format(Format {
            device: source.clone(),
            fs_type: fs_type.to_string(),
            mode: FormatMode::IfUnformatted,
        }));
    }
    plan.push(Step::Mount(Mount {
        source: MountSource::Block(source),
        target: paths.staging_dir.clone(),
        fs_type: fs_type.to_string(),
        options: mount_options,
        read_only,
    }));
    plan.push(bind_into_pod(paths, requester));
    plan
}

/// Unmount the pod's bind mount; when no consumer remains on this node, also
/// unmount the staging dir and detach the device (if any).
pub fn unstage(
    consumer: &Consumer,
    local_holders: &[Holder],
    paths: &NodePaths,
    spec: Option<DeviceSpec>,
    force: bool,
) -> Plan {
    let mut plan = vec![Step::Unmount(Unmount { target: consumer.mount_dir.clone(), force })];
    if local_holders.iter().all(|h| h.consumer.pod_uid == consumer.pod_uid) {
        plan.push(Step::Unmount(Unmount { target: paths.staging_dir.clone(), force }));
        if let Some(spec) = spec {
            plan.push(Step::DetachDevice(DetachDevice { spec, force }));
        }
    }
    plan
}

/// Everything a node holds for one volume, torn down: every recorded pod
/// mount dir, the staging dir and the device. Used by cleanups.
pub fn teardown(
    holders: &[Holder],
    paths: &NodePaths,
    spec: Option<DeviceSpec>,
    force: bool,
) -> Plan {
    let mut plan: Plan = holders
        .iter()
        .map(|h| Step::Unmount(Unmount { target: h.consumer.mount_dir.clone(), force }))
        .collect();
    plan.push(Step::Unmount(Unmount { target: paths.staging_dir.clone(), force }));
    if let Some(spec) = spec {
        plan.push(Step::DetachDevice(DetachDevice { spec, force }));
    }
    plan
}

/// The steps the block shapes above emit ([`stage_block`], [`publish_block`],
/// [`grow`], [`unstage`] and [`teardown`] with a device): what a backend
/// using them declares. The SDK's tests check each shape against it.
pub const BLOCK_STEPS: &[StepKind] = &[
    StepKind::AttachDevice,
    StepKind::Format,
    StepKind::Mount,
    StepKind::BindMount,
    StepKind::Unmount,
    StepKind::DetachDevice,
    StepKind::PublishBlock,
    StepKind::GrowFilesystem,
];

/// The steps of a network filesystem mounted at the staging dir and bound
/// into pods ([`stage_network`], [`unstage`] and [`teardown`] without a
/// device).
pub const NETWORK_STEPS: &[StepKind] = &[StepKind::Mount, StepKind::BindMount, StepKind::Unmount];

/// Mount the network filesystem at the staging dir and bind it into the
/// pod; when the volume is already staged on this node (`local_holders`
/// not empty), only the bind.
pub fn stage_network(
    mount: Mount,
    requester: &Consumer,
    local_holders: &[Holder],
    paths: &NodePaths,
) -> Plan {
    if !local_holders.is_empty() {
        return vec![bind_into_pod(paths, requester)];
    }
    vec![Step::Mount(mount), bind_into_pod(paths, requester)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{consumer, holder};
    use crate::{AccessMode, KeyValue};

    fn volume(mode: VolumeMode, access: AccessMode) -> Volume {
        Volume {
            name: "pv1".into(),
            backend: "test".into(),
            access_mode: access,
            fs_type: String::new(),
            mode,
            mount_flags: vec![],
            options: vec![KeyValue { key: "k".into(), value: "v".into() }],
            secret_keys: vec![],
        }
    }

    fn paths() -> NodePaths {
        NodePaths {
            kubelet_root: "/var/lib/kubelet".into(),
            staging_dir: "/var/lib/kubelet/plugins/volagent/test/mounts/pv1".into(),
            state_dir: "/var/lib/volagent/state/test/pv1".into(),
            discovery_dirs: vec![],
        }
    }

    fn within(plans: &[Plan], declared: &[StepKind]) {
        for step in plans.iter().flatten() {
            assert!(declared.contains(&step.kind()), "{step:?} is not in {declared:?}");
        }
    }

    /// Every branch of each shape emits only the steps its constant names,
    /// so a backend declaring the constant never plans a step it did not
    /// declare.
    #[test]
    fn the_shapes_emit_only_the_steps_they_declare() {
        let (a, b) = (consumer("n1", "a"), consumer("n1", "b"));
        let spec = || DeviceSpec::Loop("/mnt/disks/a.img".into());
        let mut block = Vec::new();
        for mode in [VolumeMode::Filesystem, VolumeMode::Block] {
            for access in [AccessMode::ReadWriteOnce, AccessMode::ReadOnlyMany] {
                let v = volume(mode, access);
                for holders in [vec![], vec![holder(&b)]] {
                    for origin in
                        [BlockOrigin::Attach(spec()), BlockOrigin::Existing("/dev/sdb".into())]
                    {
                        block.push(stage_block(&v, origin, "ext4", vec![], &a, &holders, &paths()));
                    }
                    block.push(unstage(&a, &holders, &paths(), Some(spec()), false));
                }
                block.push(grow(&v, &a));
                block.push(publish_block(&v, BlockOrigin::Attach(spec()), &a));
            }
        }
        block.push(teardown(&[holder(&a)], &paths(), Some(spec()), true));
        within(&block, BLOCK_STEPS);
        assert!(block.iter().flatten().any(|s| s.kind() == StepKind::PublishBlock));

        let mount = Mount {
            source: MountSource::Network("server:/gv0".into()),
            target: paths().staging_dir,
            fs_type: "glusterfs".into(),
            options: vec![],
            read_only: false,
        };
        let network = vec![
            stage_network(mount.clone(), &a, &[], &paths()),
            stage_network(mount, &a, &[holder(&b)], &paths()),
            unstage(&a, &[], &paths(), None, false),
            teardown(&[holder(&a)], &paths(), None, false),
        ];
        within(&network, NETWORK_STEPS);
    }
}
