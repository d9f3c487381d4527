//! local-pv: a volume that lives on one node — a file (attached as a loop
//! device), a block device, or a directory under a discovery dir.
//!
//! Options: `path` (required, absolute), `node` (required: the node the
//! volume lives on), `wipe` (on release: `quick-reset` (default), `blkdiscard`,
//! `zero`, `shred` or `shred:<passes>`).

use volagent_guest_sdk::{
    AttachDevice, BackendInfo, BindMount, BlockSource, Capabilities, CleanupItem, CleanupReason,
    ClearDirectory, Consumer, Decision, DetachDevice, DeviceKind, DeviceSpec, Format, FormatMode,
    Holder, Host, NodeFacts, NodePaths, PathKind, PathRoot, Plan, Policy, PolicyError, Step,
    StepKind, Unmount, Volume, VolumeMode, Wipe, WipeMethod, fence, options, plans,
};

mod provisioner;

pub struct LocalPv;

#[cfg(feature = "component")]
volagent_guest_sdk::export_policy!(crate::LocalPv, provisioner);

const FILESYSTEMS: &[&str] = &["ext4", "xfs"];
const DEFAULT_SHRED_PASSES: u32 = 3;

/// What the volume's `path` is.
enum Source {
    File(String),
    Block(String),
    Dir(String),
}

fn source(host: &dyn Host, volume: &Volume) -> Result<Source, PolicyError> {
    let path = options::required(volume, "path")?;
    if !path.starts_with('/') {
        return Err(PolicyError::InvalidOptions(format!(
            "volume {}: option \"path\" must be absolute, got \"{path}\"",
            volume.name
        )));
    }
    match host.path_kind(path) {
        PathKind::RegularFile => Ok(Source::File(path.to_string())),
        PathKind::BlockDevice => Ok(Source::Block(path.to_string())),
        PathKind::Directory => Ok(Source::Dir(path.to_string())),
        PathKind::Missing => Err(PolicyError::InvalidOptions(format!(
            "volume {}: path {path} does not exist on this node",
            volume.name
        ))),
        PathKind::Other => Err(PolicyError::Unsupported(format!(
            "volume {}: path {path} is neither a regular file, a block device nor a directory",
            volume.name
        ))),
    }
}

/// The loop device to detach when a volume is torn down: its file's —
/// also when the path no longer leads to a regular file (removed,
/// replaced, a symlink now), as the device attached from it may still be
/// there; the host then finds it by what the plan unmounted. None for a
/// directory or a block device, which have none.
fn loop_spec(volume: &Volume, src: &Result<Source, PolicyError>) -> Option<DeviceSpec> {
    match src {
        Ok(Source::File(file)) => Some(DeviceSpec::Loop(file.clone())),
        Ok(Source::Dir(_) | Source::Block(_)) => None,
        Err(_) => options::get(volume, "path")
            .filter(|p| p.starts_with('/'))
            .map(|p| DeviceSpec::Loop(p.to_string())),
    }
}

/// A local volume is usable on its own node only.
fn check_node(volume: &Volume, consumer: &Consumer) -> Result<(), String> {
    let home = options::get(volume, "node").ok_or_else(|| {
        format!("local volume {} has no \"node\" option: it cannot be placed", volume.name)
    })?;
    if home == consumer.node {
        Ok(())
    } else {
        Err(format!(
            "local volume {} lives on node {home}; {} cannot use it",
            volume.name,
            volagent_guest_sdk::describe(consumer)
        ))
    }
}

fn wipe_method(volume: &Volume) -> Result<Vec<WipeMethod>, PolicyError> {
    let method = options::get(volume, "wipe").unwrap_or("quick-reset");
    let bad = || {
        PolicyError::InvalidOptions(format!(
            "volume {}: wipe method \"{method}\" is not one of quick-reset, blkdiscard, zero, shred, shred:<passes>",
            volume.name
        ))
    };
    Ok(match method {
        "quick-reset" => vec![WipeMethod::Signatures],
        "blkdiscard" => vec![WipeMethod::Discard],
        "zero" => vec![WipeMethod::Zero],
        "shred" => vec![WipeMethod::Shred(DEFAULT_SHRED_PASSES)],
        other => match other.strip_prefix("shred:").map(str::parse::<u32>) {
            Some(Ok(passes)) if (1..=35).contains(&passes) => vec![WipeMethod::Shred(passes)],
            _ => return Err(bad()),
        },
    })
}

impl Policy for LocalPv {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "local-pv".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: "Node-local volumes: files on loop devices, block devices or directories"
                .into(),
            capabilities: Capabilities {
                // The block shapes, and what a release adds to them.
                steps: [plans::BLOCK_STEPS, &[StepKind::Wipe, StepKind::ClearDirectory]].concat(),
                device_kinds: vec![DeviceKind::Loop],
                filesystems: FILESYSTEMS.iter().map(|s| s.to_string()).collect(),
                network_filesystems: vec![],
                path_roots: vec![
                    PathRoot::PodMountDir,
                    PathRoot::StagingDir,
                    PathRoot::DiscoveryDirs,
                ],
            },
        }
    }

    fn fence(
        _host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        holders: Vec<Holder>,
        nodes: Vec<NodeFacts>,
    ) -> Result<Decision, PolicyError> {
        if let Err(reason) = check_node(&volume, &requester) {
            return Ok(Decision::Deny(reason));
        }
        // The data cannot move, so a take-over is never useful: the holders
        // are all on the volume's own node anyway.
        Ok(fence::standard(&volume.name, volume.access_mode, &requester, &holders, &nodes))
    }

    fn attach(
        host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        check_node(&volume, &requester).map_err(PolicyError::Unsupported)?;
        if volume.mode == VolumeMode::Block {
            return match source(host, &volume)? {
                Source::File(file) => Ok(plans::publish_block(
                    &volume,
                    plans::BlockOrigin::Attach(DeviceSpec::Loop(file)),
                    &requester,
                )),
                Source::Block(device) => Ok(plans::publish_block(
                    &volume,
                    plans::BlockOrigin::Existing(device),
                    &requester,
                )),
                Source::Dir(dir) => Err(PolicyError::Unsupported(format!(
                    "volume {}: {dir} is a directory, which has no block mode",
                    volume.name
                ))),
            };
        }
        if !local_holders.is_empty() {
            return Ok(vec![plans::bind_into_pod(&paths, &requester)]);
        }
        Ok(match source(host, &volume)? {
            Source::Dir(dir) => vec![
                Step::BindMount(BindMount {
                    source: dir,
                    target: paths.staging_dir.clone(),
                    read_only: plans::volume_read_only(&volume),
                }),
                plans::bind_into_pod(&paths, &requester),
            ],
            Source::File(file) => {
                let fs = options::fs_type(&volume, "ext4", FILESYSTEMS)?;
                plans::stage_block(
                    &volume,
                    plans::BlockOrigin::Attach(DeviceSpec::Loop(file)),
                    &fs,
                    volume.mount_flags.clone(),
                    &requester,
                    &local_holders,
                    &paths,
                )
            }
            Source::Block(device) => {
                let fs = options::fs_type(&volume, "ext4", FILESYSTEMS)?;
                plans::stage_block(
                    &volume,
                    plans::BlockOrigin::Existing(device),
                    &fs,
                    volume.mount_flags.clone(),
                    &requester,
                    &local_holders,
                    &paths,
                )
            }
        })
    }

    fn detach(
        host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let spec = loop_spec(&volume, &source(host, &volume));
        Ok(plans::unstage(&consumer, &local_holders, &paths, spec, false))
    }

    /// A local volume whose file, disk or dir is gone from its path (removed
    /// or replaced while in use) is not healthy, mounted or not.
    fn condition(
        host: &dyn Host,
        volume: Volume,
        _consumer: Consumer,
        _paths: NodePaths,
    ) -> Option<String> {
        source(host, &volume).err().map(|e| match e {
            PolicyError::InvalidOptions(m) | PolicyError::Unsupported(m) => m,
        })
    }

    fn cleanup(
        host: &dyn Host,
        reason: CleanupReason,
        items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError> {
        let mut plan = Vec::new();
        for item in items {
            let src = source(host, &item.volume);
            let spec = loop_spec(&item.volume, &src);
            match reason {
                CleanupReason::StaleNode => {
                    plan.extend(plans::teardown(&item.holders, &item.paths, spec, false));
                }
                CleanupReason::StorageClusterDeleted => {
                    return Err(PolicyError::Unsupported(format!(
                        "volume {}: local volumes belong to no storage cluster",
                        item.volume.name
                    )));
                }
                CleanupReason::LocalVolumeReleased => plan.extend(release(&item, src?)?),
            }
        }
        Ok(plan)
    }
}

/// Tear down whatever is left, then destroy the data so the volume can be
/// handed to someone else.
fn release(item: &CleanupItem, src: Source) -> Result<Plan, PolicyError> {
    let volume = &item.volume;
    let methods = wipe_method(volume)?;
    let quick_reset = methods == [WipeMethod::Signatures];
    let mut plan: Plan = item
        .holders
        .iter()
        .map(|h| Step::Unmount(Unmount { target: h.consumer.mount_dir.clone(), force: false }))
        .collect();
    plan.push(Step::Unmount(Unmount { target: item.paths.staging_dir.clone(), force: false }));
    let (device, spec) = match src {
        Source::File(file) => {
            (BlockSource::Attached(plans::DEVICE_ID.into()), Some(DeviceSpec::Loop(file)))
        }
        Source::Block(dev) => (BlockSource::Device(dev), None),
        // A filesystem volume (the admin's mount point): its contents go,
        // whatever the method; the filesystem and the mount stay the admin's.
        Source::Dir(dir) => {
            plan.push(Step::ClearDirectory(ClearDirectory { path: dir }));
            return Ok(plan);
        }
    };
    // (A mount point's filesystem is the admin's, whatever it is.)
    let fs = options::fs_type(volume, "ext4", FILESYSTEMS)?;
    if let Some(spec) = &spec {
        plan.push(Step::AttachDevice(AttachDevice {
            id: plans::DEVICE_ID.into(),
            spec: spec.clone(),
            read_only: false,
        }));
    }
    for method in methods {
        plan.push(Step::Wipe(Wipe { device: device.clone(), method }));
    }
    if quick_reset {
        plan.push(Step::Format(Format {
            device: device.clone(),
            fs_type: fs,
            mode: FormatMode::Always,
        }));
    }
    if let Some(spec) = spec {
        plan.push(Step::DetachDevice(DetachDevice { spec, force: false }));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::fake::{FakeHost, consumer, holder, live_node};
    use volagent_guest_sdk::{AccessMode, KeyValue, Mount, MountSource};

    fn volume(path: &str, mode: AccessMode) -> Volume {
        Volume {
            name: "pv1".into(),
            backend: "local-pv".into(),
            access_mode: mode,
            fs_type: String::new(),
            mode: volagent_guest_sdk::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: vec![
                KeyValue { key: "path".into(), value: path.into() },
                KeyValue { key: "node".into(), value: "n1".into() },
            ],
            secret_keys: vec![],
        }
    }

    fn paths() -> NodePaths {
        NodePaths {
            kubelet_root: "/var/lib/kubelet".into(),
            staging_dir: "/var/lib/kubelet/plugins/volagent/local-pv/mounts/pv1".into(),
            state_dir: "/var/lib/volagent/volumes/pv1".into(),
            discovery_dirs: vec!["/mnt/disks".into()],
        }
    }

    fn host_with(path: &str, kind: PathKind) -> FakeHost {
        let mut host = FakeHost::default();
        host.paths.insert(path.into(), kind);
        host
    }

    #[test]
    fn other_node_is_denied_naming_the_home_node() {
        let v = volume("/mnt/disks/a.img", AccessMode::ReadWriteOnce);
        let d = LocalPv::fence(
            &FakeHost::default(),
            v,
            consumer("n2", "p"),
            vec![],
            vec![live_node("n2")],
        )
        .unwrap();
        assert!(
            matches!(&d, Decision::Deny(r) if r.contains("lives on node n1") && r.contains("node n2")),
            "{d:?}"
        );
        let home = LocalPv::fence(
            &FakeHost::default(),
            volume("/x", AccessMode::ReadWriteOnce),
            consumer("n1", "p"),
            vec![],
            vec![],
        );
        assert_eq!(home.unwrap(), Decision::Grant);
    }

    #[test]
    fn file_volume_is_loop_attached_formatted_if_needed_and_bound() {
        let host = host_with("/mnt/disks/a.img", PathKind::RegularFile);
        let c = consumer("n1", "p");
        let plan = LocalPv::attach(
            &host,
            volume("/mnt/disks/a.img", AccessMode::ReadWriteOnce),
            c.clone(),
            vec![],
            paths(),
        )
        .unwrap();
        assert_eq!(plan.len(), 4, "{plan:?}");
        assert!(
            matches!(&plan[0], Step::AttachDevice(a) if a.spec == DeviceSpec::Loop("/mnt/disks/a.img".into()))
        );
        assert!(
            matches!(&plan[1], Step::Format(f) if f.mode == FormatMode::IfUnformatted && f.fs_type == "ext4")
        );
        assert!(
            matches!(&plan[2], Step::Mount(Mount { source: MountSource::Block(BlockSource::Attached(_)), target, .. }) if *target == paths().staging_dir)
        );
        assert!(
            matches!(&plan[3], Step::BindMount(b) if b.target == c.mount_dir && b.source == paths().staging_dir)
        );
    }

    #[test]
    fn second_pod_on_the_node_only_binds() {
        let host = host_with("/mnt/disks/a.img", PathKind::RegularFile);
        let first = consumer("n1", "a");
        let plan = LocalPv::attach(
            &host,
            volume("/mnt/disks/a.img", AccessMode::ReadWriteOnce),
            consumer("n1", "b"),
            vec![holder(&first)],
            paths(),
        )
        .unwrap();
        assert!(matches!(plan.as_slice(), [Step::BindMount(_)]), "{plan:?}");
    }

    #[test]
    fn block_device_is_used_as_is_and_directory_is_bound() {
        let host = host_with("/mnt/disks/ssd0", PathKind::BlockDevice);
        let plan = LocalPv::attach(
            &host,
            volume("/mnt/disks/ssd0", AccessMode::ReadWriteOnce),
            consumer("n1", "p"),
            vec![],
            paths(),
        )
        .unwrap();
        assert!(
            matches!(&plan[0], Step::Format(f) if f.device == BlockSource::Device("/mnt/disks/ssd0".into()))
        );
        assert!(!plan.iter().any(|s| matches!(s, Step::AttachDevice(_))));
        let host = host_with("/mnt/disks/d", PathKind::Directory);
        let plan = LocalPv::attach(
            &host,
            volume("/mnt/disks/d", AccessMode::ReadWriteOnce),
            consumer("n1", "p"),
            vec![],
            paths(),
        )
        .unwrap();
        assert!(
            matches!(plan.as_slice(), [Step::BindMount(a), Step::BindMount(_)] if a.source == "/mnt/disks/d")
        );
    }

    #[test]
    fn missing_path_and_bad_fs_are_policy_errors() {
        let err = LocalPv::attach(
            &FakeHost::default(),
            volume("/mnt/disks/gone", AccessMode::ReadWriteOnce),
            consumer("n1", "p"),
            vec![],
            paths(),
        );
        assert!(
            matches!(err, Err(PolicyError::InvalidOptions(m)) if m.contains("/mnt/disks/gone"))
        );
        let host = host_with("/mnt/disks/a.img", PathKind::RegularFile);
        let mut v = volume("/mnt/disks/a.img", AccessMode::ReadWriteOnce);
        v.fs_type = "btrfs".into();
        assert!(matches!(
            LocalPv::attach(&host, v, consumer("n1", "p"), vec![], paths()),
            Err(PolicyError::Unsupported(_))
        ));
    }

    #[test]
    fn detach_keeps_the_device_while_other_pods_remain() {
        let host = host_with("/mnt/disks/a.img", PathKind::RegularFile);
        let v = volume("/mnt/disks/a.img", AccessMode::ReadWriteOnce);
        let (a, b) = (consumer("n1", "a"), consumer("n1", "b"));
        let plan = LocalPv::detach(&host, v.clone(), a.clone(), vec![holder(&b)], paths()).unwrap();
        assert!(matches!(plan.as_slice(), [Step::Unmount(u)] if u.target == a.mount_dir));
        let plan = LocalPv::detach(&host, v, a, vec![], paths()).unwrap();
        assert!(
            matches!(plan.as_slice(), [Step::Unmount(_), Step::Unmount(_), Step::DetachDevice(_)]),
            "{plan:?}"
        );
    }

    #[test]
    fn a_file_that_is_no_longer_one_is_still_detached() {
        let v = volume("/mnt/disks/a.img", AccessMode::ReadWriteOnce);
        let a = consumer("n1", "a");
        for host in [FakeHost::default(), host_with("/mnt/disks/a.img", PathKind::Other)] {
            let plan = LocalPv::detach(&host, v.clone(), a.clone(), vec![], paths()).unwrap();
            assert!(
                matches!(plan.last(), Some(Step::DetachDevice(d)) if d.spec == DeviceSpec::Loop("/mnt/disks/a.img".into())),
                "{plan:?}"
            );
        }
        let dir = host_with("/mnt/disks/a.img", PathKind::Directory);
        let plan = LocalPv::detach(&dir, v, a, vec![], paths()).unwrap();
        assert!(
            !plan.iter().any(|s| matches!(s, Step::DetachDevice(_))),
            "a directory has no device: {plan:?}"
        );
    }

    fn released(method: &str) -> Result<Plan, PolicyError> {
        let host = host_with("/mnt/disks/a.img", PathKind::RegularFile);
        let mut v = volume("/mnt/disks/a.img", AccessMode::ReadWriteOnce);
        v.options.push(KeyValue { key: "wipe".into(), value: method.into() });
        let plan = LocalPv::cleanup(
            &host,
            CleanupReason::LocalVolumeReleased,
            vec![CleanupItem { volume: v, paths: paths(), holders: vec![] }],
        )?;
        volagent_guest_sdk::fake::assert_declared::<LocalPv>(&plan);
        Ok(plan)
    }

    fn wipes(plan: &Plan) -> Vec<WipeMethod> {
        plan.iter()
            .filter_map(|s| match s {
                Step::Wipe(w) => Some(w.method),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn release_wipes_by_the_configured_method() {
        let quick = released("quick-reset").unwrap();
        assert_eq!(wipes(&quick), vec![WipeMethod::Signatures]);
        assert!(quick.iter().any(|s| matches!(s, Step::Format(f) if f.mode == FormatMode::Always)));
        assert!(matches!(quick.last(), Some(Step::DetachDevice(_))));
        assert_eq!(wipes(&released("blkdiscard").unwrap()), vec![WipeMethod::Discard]);
        assert_eq!(wipes(&released("zero").unwrap()), vec![WipeMethod::Zero]);
        assert_eq!(wipes(&released("shred").unwrap()), vec![WipeMethod::Shred(3)]);
        assert_eq!(wipes(&released("shred:7").unwrap()), vec![WipeMethod::Shred(7)]);
        assert!(!released("zero").unwrap().iter().any(|s| matches!(s, Step::Format(_))));
        assert!(matches!(released("shred:0"), Err(PolicyError::InvalidOptions(_))));
        assert!(matches!(released("rm -rf"), Err(PolicyError::InvalidOptions(_))));
    }

    #[test]
    fn a_released_filesystem_volume_is_emptied_in_place() {
        let host = host_with("/mnt/disks/fs1", PathKind::Directory);
        let mut v = volume("/mnt/disks/fs1", AccessMode::ReadWriteOnce);
        v.fs_type = "tmpfs".into();
        let item = CleanupItem { volume: v, paths: paths(), holders: vec![] };
        let plan = LocalPv::cleanup(&host, CleanupReason::LocalVolumeReleased, vec![item]).unwrap();
        assert!(
            matches!(plan.last(), Some(Step::ClearDirectory(c)) if c.path == "/mnt/disks/fs1"),
            "{plan:?}"
        );
        assert!(
            !plan
                .iter()
                .any(|s| matches!(s, Step::Wipe(_) | Step::Format(_) | Step::AttachDevice(_))),
            "{plan:?}"
        );
    }
}
