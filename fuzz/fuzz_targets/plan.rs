//! A guest's plan: the steps a (partly trusted) policy asks the host to
//! run, checked against a fixed volume, pod and node before anything runs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volagent::policy::validate::{self, Operation};
use volagent::policy::*;

const POD: &str = "/var/lib/kubelet/pods/uid-a/volumes/volagent~local-pv/pv-local-1";

// Everything declared, so that no check is cut short by a missing kind.
fn caps() -> Capabilities {
    Capabilities {
        steps: StepKind::ALL.to_vec(),
        device_kinds: DeviceKind::ALL.to_vec(),
        filesystems: vec!["ext4".into(), "xfs".into()],
        network_filesystems: vec!["glusterfs".into()],
        path_roots: PathRoot::ALL.to_vec(),
        controller_steps: ControllerStepKind::ALL.to_vec(),
    }
}

fn volume() -> Volume {
    Volume {
        name: "pv-local-1".into(),
        backend: "local-pv".into(),
        access_mode: AccessMode::ReadWriteOnce,
        fs_type: "ext4".into(),
        mode: VolumeMode::Filesystem,
        mount_flags: vec![],
        options: vec![KeyValue { key: "path".into(), value: "/mnt/disks/vol1.img".into() }],
        secret_keys: vec!["key".into()],
    }
}

fn consumer(node: &str, read_only: bool) -> Consumer {
    Consumer {
        node: node.into(),
        pod_namespace: "default".into(),
        pod: "pod-a".into(),
        pod_uid: "uid-a".into(),
        mount_dir: POD.into(),
        read_only,
        mount_group: None,
    }
}

fn paths() -> NodePaths {
    NodePaths {
        kubelet_root: "/var/lib/kubelet".into(),
        staging_dir: "/var/lib/kubelet/plugins/volagent/local-pv/mounts/pv-local-1".into(),
        state_dir: "/var/lib/volagent/volumes/pv-local-1".into(),
        discovery_dirs: vec!["/mnt/disks".into()],
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(steps) = serde_json::from_slice::<Vec<Step>>(data) else { return };
    let (caps, volume, paths) = (caps(), volume(), paths());
    for read_only in [false, true] {
        let consumer = consumer("node-a", read_only);
        let _ = validate::plan(
            &steps,
            &caps,
            &Operation::Attach { volume: &volume, consumer: &consumer, paths: &paths },
        );
    }
    // Releasing a local volume: the only plan that may wipe or re-format.
    let items = [CleanupItem { volume: volume.clone(), paths: paths.clone(), holders: vec![] }];
    let _ = validate::plan(
        &steps,
        &caps,
        &Operation::Cleanup { reason: CleanupReason::LocalVolumeReleased, items: &items },
    );
    // The same steps as a take-over's fencing of a holder on a gone node.
    let holders =
        vec![Holder { consumer: consumer("node-b", false), since: "2026-11-01T10:00:00Z".into() }];
    let nodes =
        [NodeFacts { name: "node-b".into(), exists: false, ready: false, out_of_service: false }];
    let take = TakeOver { stale: holders.clone(), fence_steps: steps };
    let _ = validate::take_over(&take, &holders, &nodes, &caps, &volume);
});
