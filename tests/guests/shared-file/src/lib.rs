//! A test-only backend: an image file on storage every node can reach
//! (here, one machine's disk), loop-attached on whichever node asks. With no
//! home-node rule of its own, it lets tests exercise cross-node fencing
//! (standard Kubernetes rules) with real devices and mounts.
//!
//! Options: `path` (the image file).

use volagent_guest_sdk::{
    BackendInfo, Capabilities, CleanupItem, CleanupReason, Consumer, Decision, DetachDevice,
    DeviceKind, DeviceSpec, Holder, Host, NodeFacts, NodePaths, PathRoot, Plan, Policy,
    PolicyError, Step, StepKind, Volume, fence, options, plans,
};

pub struct SharedFile;

volagent_guest_sdk::export_policy!(crate::SharedFile);

impl Policy for SharedFile {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "shared-file".into(),
            version: "0.0.1".into(),
            description: "test-only: a shared image file on a loop device".into(),
            capabilities: Capabilities {
                steps: vec![
                    StepKind::AttachDevice,
                    StepKind::Format,
                    StepKind::Mount,
                    StepKind::BindMount,
                    StepKind::Unmount,
                    StepKind::DetachDevice,
                ],
                device_kinds: vec![DeviceKind::Loop],
                filesystems: vec!["ext4".into()],
                network_filesystems: vec![],
                path_roots: vec![
                    PathRoot::PodMountDir,
                    PathRoot::StagingDir,
                    PathRoot::DiscoveryDirs,
                ],
            },
        }
    }

    /// Standard rules; a take-over first detaches every loop device of
    /// this machine over the file: in tests, "nodes" share one machine, so
    /// a gone node's leftover device is visible here and is its I/O path.
    fn fence(
        _: &dyn Host,
        volume: Volume,
        requester: Consumer,
        holders: Vec<Holder>,
        nodes: Vec<NodeFacts>,
    ) -> Result<Decision, PolicyError> {
        match fence::standard(&volume.name, volume.access_mode, &requester, &holders, &nodes) {
            Decision::TakeOver(mut take) => {
                let file = options::required(&volume, "path")?.to_string();
                take.fence_steps.push(Step::DetachDevice(DetachDevice {
                    spec: DeviceSpec::Loop(file),
                    force: true,
                }));
                Ok(Decision::TakeOver(take))
            }
            other => Ok(other),
        }
    }

    fn attach(
        _: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let file = options::required(&volume, "path")?.to_string();
        Ok(plans::stage_block(
            &volume,
            plans::BlockOrigin::Attach(DeviceSpec::Loop(file)),
            "ext4",
            vec![],
            &requester,
            &local_holders,
            &paths,
        ))
    }

    fn detach(
        _: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let file = options::required(&volume, "path")?.to_string();
        Ok(plans::unstage(&consumer, &local_holders, &paths, Some(DeviceSpec::Loop(file)), false))
    }

    /// Tear down what this node holds of each volume; forced when its
    /// storage cluster is gone (nothing will answer a clean unmount).
    fn cleanup(
        _: &dyn Host,
        reason: CleanupReason,
        items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError> {
        let force = reason == CleanupReason::StorageClusterDeleted;
        let mut plan = Vec::new();
        for item in items {
            let file = options::required(&item.volume, "path")?.to_string();
            plan.extend(plans::teardown(
                &item.holders,
                &item.paths,
                Some(DeviceSpec::Loop(file)),
                force,
            ));
        }
        Ok(plan)
    }
}
