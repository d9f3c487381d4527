//! A test-only backend that misbehaves on request: the volume's name says
//! how. Each misbehaviour must fail only its own call, with its own error.
//!
//! - `spin`: fence loops forever
//! - `hog`: fence allocates without bound
//! - `trap`: fence panics (a wasm trap)
//! - `flood-log`: fence logs far more lines than allowed, then grants
//! - `takeover-live`: fence takes over every holder, whatever their nodes
//! - `undeclared-device`: attach asks for an rbd device (only loop declared)
//! - `escape`: attach bind-mounts onto /etc
//! - `dotdot`: attach mounts at staging-dir/../../..
//! - `refuse`: attach returns a policy error
//! - `huge-plan`: attach returns a plan of a million steps
//! - `big-plan`: attach returns a plan of 5000 steps
//! - `huge-error`: attach refuses with a 2 MiB message
//! - `ask-etc`: attach asks the host about /etc/shadow
//! - `hoard-plans`: attach makes plans through the contract and keeps them all
//! - `hoard-nodes`: attach asks for a node's facts over and over, keeping
//!   every answer
//! - anything else: fence grants, attach binds staging into the pod

use std::hint::black_box;
use volagent_guest_sdk::{
    AttachDevice, BackendInfo, BindMount, Capabilities, CleanupItem, CleanupReason, Consumer,
    Decision, DeviceKind, DeviceSpec, Holder, Host, LogLevel, NodeFacts, NodePaths, PathRoot, Plan,
    Policy, PolicyError, RbdSpec, Step, StepKind, TakeOver, Unmount, Volume, plans,
};

pub struct Misbehave;

volagent_guest_sdk::export_policy!(crate::Misbehave);

impl Policy for Misbehave {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "misbehave".into(),
            version: "0.0.1".into(),
            description: "test-only: misbehaves on request".into(),
            capabilities: Capabilities {
                steps: vec![
                    StepKind::AttachDevice,
                    StepKind::BindMount,
                    StepKind::Unmount,
                    StepKind::Mount,
                ],
                device_kinds: vec![DeviceKind::Loop],
                filesystems: vec!["ext4".into()],
                network_filesystems: vec![],
                path_roots: vec![PathRoot::PodMountDir, PathRoot::StagingDir],
            },
        }
    }

    fn fence(
        host: &dyn Host,
        volume: Volume,
        _requester: Consumer,
        holders: Vec<Holder>,
        _nodes: Vec<NodeFacts>,
    ) -> Result<Decision, PolicyError> {
        match volume.name.as_str() {
            "spin" => {
                let mut n: u64 = 0;
                loop {
                    n = black_box(n.wrapping_add(1));
                }
            }
            "hog" => {
                let mut chunks: Vec<Vec<u8>> = Vec::new();
                loop {
                    chunks.push(vec![1u8; 1 << 20]);
                    black_box(&chunks);
                }
            }
            "trap" => panic!("deliberate trap"),
            "flood-log" => {
                for i in 0..10_000 {
                    host.log(LogLevel::Info, &format!("line {i}"));
                }
                Ok(Decision::Grant)
            }
            "takeover-live" => {
                Ok(Decision::TakeOver(TakeOver { stale: holders, fence_steps: vec![] }))
            }
            _ => Ok(Decision::Grant),
        }
    }

    fn attach(
        host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        _local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let bind = |source: String, target: String| {
            Step::BindMount(BindMount { source, target, read_only: false })
        };
        match volume.name.as_str() {
            "undeclared-device" => Ok(vec![Step::AttachDevice(AttachDevice {
                id: "dev".into(),
                spec: DeviceSpec::Rbd(RbdSpec {
                    monitors: vec!["127.0.0.1:6789".into()],
                    pool: "rbd".into(),
                    image: "img".into(),
                    user: "admin".into(),
                    secret_key: None,
                    attach: volagent_guest_sdk::RbdAttach::Auto,
                }),
                read_only: false,
            })]),
            "escape" => Ok(vec![bind(paths.staging_dir.clone(), "/etc".into())]),
            "dotdot" => Ok(vec![bind(
                paths.staging_dir.clone(),
                format!("{}/../../..", requester.mount_dir),
            )]),
            "refuse" => Err(PolicyError::InvalidOptions(format!(
                "volume {} is refused on request",
                volume.name
            ))),
            "huge-plan" => Ok((0..1_000_000)
                .map(|_| Step::Unmount(Unmount { target: String::new(), force: false }))
                .collect()),
            "big-plan" => Ok((0..5_000)
                .map(|_| Step::Unmount(Unmount { target: String::new(), force: false }))
                .collect()),
            "huge-error" => Err(PolicyError::InvalidOptions("x".repeat(2 << 20))),
            "hoard-plans" => {
                for _ in 0..1000 {
                    std::mem::forget(
                        volagent_guest_sdk::bindings::volagent::policy::types::Plan::new(),
                    );
                }
                Ok(Vec::new())
            }
            "hoard-nodes" => {
                for _ in 0..100_000 {
                    std::mem::forget(
                        volagent_guest_sdk::bindings::volagent::policy::host::node_state("n1"),
                    );
                }
                Ok(Vec::new())
            }
            "ask-etc" => {
                let kind = host.path_kind("/etc/shadow");
                Err(PolicyError::Unsupported(format!(
                    "the host answered {kind:?} about /etc/shadow"
                )))
            }
            _ => Ok(vec![plans::bind_into_pod(&paths, &requester)]),
        }
    }

    fn detach(
        _host: &dyn Host,
        _volume: Volume,
        consumer: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        Ok(plans::unstage(&consumer, &local_holders, &paths, None, false))
    }

    fn cleanup(
        _host: &dyn Host,
        _reason: CleanupReason,
        _items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError> {
        Ok(vec![])
    }
}
