//! Most backends are one thing per volume per node — a block device or a
//! network filesystem — mounted once at the volume's staging dir and bound
//! into each pod. [`StagedBackend`] is what such a backend is: what it
//! stages, from which options, and its fence rule. Every [`Policy`] call,
//! the capabilities it declares, its cleanups and its expansion follow.

use crate::{
    BackendInfo, Capabilities, CleanupItem, CleanupReason, Consumer, Decision, DeviceKind,
    DeviceSpec, Holder, Host, Mount, MountSource, NodeFacts, NodePaths, PathRoot, Plan, Policy,
    PolicyError, StepKind, Volume, VolumeMode, fence, options, plans,
};

/// What a staged backend's volumes are made of.
pub enum Medium {
    /// Block devices of this kind, with a filesystem of these (the first is
    /// the default when the volume names none); block volumes are
    /// published raw.
    Block { device: DeviceKind, filesystems: &'static [&'static str] },
    /// A network filesystem of this type; block volumes are refused.
    Network { fs_type: &'static str },
}

/// What one volume stages, from its options.
pub enum Staged {
    /// This block device.
    Block(DeviceSpec),
    /// This network filesystem source (e.g. "server:/export"), with these
    /// options of the volume's (after its mount flags).
    Network { source: String, options: Vec<String> },
}

/// A backend that stages one block device or network filesystem per
/// volume per node. Implementing it implements [`Policy`].
pub trait StagedBackend {
    /// The backend's name: the Flexvolume driver becomes volagent/<name>.
    const NAME: &'static str;
    /// The policy's version (its crate's: `env!("CARGO_PKG_VERSION")`).
    const VERSION: &'static str;
    const DESCRIPTION: &'static str;
    const MEDIUM: Medium;
    /// Path roots its steps use beyond the pod's dir and the staging dir
    /// (the state dir for a helper's log, the discovery dirs for files the
    /// agent serves itself).
    const PATH_ROOTS: &'static [PathRoot] = &[];
    /// Steps its fence decisions plan (e.g. blocklist-client).
    const FENCE_STEPS: &'static [StepKind] = &[];

    /// What `volume` stages: an invalid-options error names what is wrong.
    fn stage(volume: &Volume) -> Result<Staged, PolicyError>;

    /// Mount options that depend on the node (e.g. a log file in the state
    /// dir), after the volume's own.
    fn node_options(_paths: &NodePaths) -> Vec<String> {
        Vec::new()
    }

    /// The volume as the backend serves it (e.g. a read-only export as
    /// ReadOnlyMany, whatever the PV says); by default as it is.
    fn effective(volume: Volume) -> Result<Volume, PolicyError> {
        Ok(volume)
    }

    /// May `requester` use `volume`? By default Kubernetes' access-mode
    /// rules ([`fence::standard`]).
    fn fence(
        _host: &dyn Host,
        volume: &Volume,
        requester: &Consumer,
        holders: &[Holder],
        nodes: &[NodeFacts],
    ) -> Result<Decision, PolicyError> {
        Ok(fence::standard(&volume.name, volume.access_mode, requester, holders, nodes))
    }

    /// Why the volume is not healthy where `consumer` has it; by default
    /// nothing beyond what the host checked.
    fn condition(
        _host: &dyn Host,
        _volume: &Volume,
        _consumer: &Consumer,
        _paths: &NodePaths,
    ) -> Option<String> {
        None
    }
}

/// The device `volume` attached, for its detach: a block backend's, from
/// the volume's options; none for a network filesystem, whose unmount
/// needs nothing of them (a record being cleaned up may have lost them).
fn device<B: StagedBackend>(volume: &Volume) -> Result<Option<DeviceSpec>, PolicyError> {
    match B::MEDIUM {
        Medium::Network { .. } => Ok(None),
        Medium::Block { .. } => match B::stage(volume)? {
            Staged::Block(spec) => Ok(Some(spec)),
            Staged::Network { .. } => Ok(None),
        },
    }
}

/// Whether a cleanup for `reason` forces its unmounts and detaches, for a
/// backend whose volumes live on a storage cluster: when the cluster is
/// gone, I/O would hang forever. Such volumes are never local volumes.
pub fn cleanup_force(reason: CleanupReason, backend: &str) -> Result<bool, PolicyError> {
    match reason {
        CleanupReason::StaleNode => Ok(false),
        CleanupReason::StorageClusterDeleted => Ok(true),
        CleanupReason::LocalVolumeReleased => {
            Err(PolicyError::Unsupported(format!("{backend} volumes are not local volumes")))
        }
    }
}

impl<B: StagedBackend> Policy for B {
    fn info() -> BackendInfo {
        let (base, device_kinds, filesystems, network_filesystems) = match B::MEDIUM {
            Medium::Block { device, filesystems } => (
                plans::BLOCK_STEPS,
                vec![device],
                filesystems.iter().map(|s| s.to_string()).collect(),
                vec![],
            ),
            Medium::Network { fs_type } => {
                (plans::NETWORK_STEPS, vec![], vec![], vec![fs_type.to_string()])
            }
        };
        let mut steps = base.to_vec();
        steps.extend(B::FENCE_STEPS.iter().filter(|s| !base.contains(s)));
        let mut path_roots = vec![PathRoot::PodMountDir, PathRoot::StagingDir];
        for root in B::PATH_ROOTS {
            if !path_roots.contains(root) {
                path_roots.push(*root);
            }
        }
        BackendInfo {
            name: B::NAME.into(),
            version: B::VERSION.into(),
            description: B::DESCRIPTION.into(),
            capabilities: Capabilities {
                steps,
                device_kinds,
                filesystems,
                network_filesystems,
                path_roots,
            },
        }
    }

    fn fence(
        host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        holders: Vec<Holder>,
        nodes: Vec<NodeFacts>,
    ) -> Result<Decision, PolicyError> {
        B::stage(&volume)?;
        let volume = B::effective(volume)?;
        B::fence(host, &volume, &requester, &holders, &nodes)
    }

    fn attach(
        _host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let staged = B::stage(&volume)?;
        let volume = B::effective(volume)?;
        match (staged, B::MEDIUM) {
            (Staged::Block(spec), Medium::Block { filesystems, .. }) => {
                let default = filesystems.first().copied().unwrap_or("ext4");
                let fs = options::fs_type(&volume, default, filesystems)?;
                let mut mount_options = volume.mount_flags.clone();
                mount_options.extend(B::node_options(&paths));
                Ok(plans::stage_block(
                    &volume,
                    plans::BlockOrigin::Attach(spec),
                    &fs,
                    mount_options,
                    &requester,
                    &local_holders,
                    &paths,
                ))
            }
            (Staged::Network { source, options }, Medium::Network { fs_type }) => {
                if volume.mode == VolumeMode::Block {
                    return Err(PolicyError::Unsupported(format!(
                        "volume {}: a {} volume is a filesystem; it has no block mode",
                        volume.name,
                        B::NAME
                    )));
                }
                let mut mount_options = volume.mount_flags.clone();
                mount_options.extend(options);
                mount_options.extend(B::node_options(&paths));
                let mount = Mount {
                    source: MountSource::Network(source),
                    target: paths.staging_dir.clone(),
                    fs_type: fs_type.to_string(),
                    options: mount_options,
                    read_only: plans::volume_read_only(&volume),
                };
                Ok(plans::stage_network(mount, &requester, &local_holders, &paths))
            }
            _ => Err(PolicyError::Unsupported(format!(
                "volume {}: backend {} staged what its medium is not",
                volume.name,
                B::NAME
            ))),
        }
    }

    fn detach(
        _host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let device = device::<B>(&volume)?;
        Ok(plans::unstage(&consumer, &local_holders, &paths, device, false))
    }

    /// A block volume's filesystem grows where it is mounted; a network
    /// filesystem grows on its servers, and the node has nothing to do.
    fn expand(
        _host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        _paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        Ok(match B::MEDIUM {
            Medium::Block { .. } => plans::grow(&volume, &consumer),
            Medium::Network { .. } => Vec::new(),
        })
    }

    fn condition(
        host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        paths: NodePaths,
    ) -> Option<String> {
        B::condition(host, &volume, &consumer, &paths)
    }

    fn cleanup(
        _host: &dyn Host,
        reason: CleanupReason,
        items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError> {
        let force = cleanup_force(reason, B::NAME)?;
        let mut plan = Vec::new();
        for item in items {
            let device = device::<B>(&item.volume)?;
            plan.extend(plans::teardown(&item.holders, &item.paths, device, force));
        }
        Ok(plan)
    }
}
