//! A backend as an author without the SDK writes one: the contract's least
//! world (`backend`: the `policy` export and the `host` queries), none of
//! the optional interfaces. The host must do without them: block volumes
//! refused, expand done by the host itself, no health checks of its own.
//! It binds the staging dir into the pod, and mounts nothing.

// The generated bindings and export glue are wit-bindgen's unsafe code.
#![allow(unsafe_code)]

wit_bindgen::generate!({ world: "backend", path: "../../../wit" });

use exports::volagent::policy::policy::Guest;
use volagent::policy::types::{
    BackendInfo, CleanupItem, CleanupReason, Consumer, Decision, Node, NodePaths, Plan,
    PolicyError, Volume,
};

struct CoreOnly;

impl Guest for CoreOnly {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "core-only".into(),
            version: "1.0.0".into(),
            description: "a backend exporting only the core policy".into(),
            steps: vec!["bind-mount".into(), "unmount".into()],
            device_kinds: vec![],
            filesystems: vec![],
            network_filesystems: vec![],
            path_roots: vec!["pod-mount-dir".into(), "staging-dir".into()],
        }
    }

    fn fence(
        _: &Volume,
        _: &Consumer,
        _: Vec<Consumer>,
        _: Vec<Node>,
    ) -> Result<Decision, PolicyError> {
        Ok(Decision::Grant)
    }

    fn attach(
        _: &Volume,
        requester: &Consumer,
        _: Vec<Consumer>,
        paths: &NodePaths,
    ) -> Result<Plan, PolicyError> {
        let plan = Plan::new();
        plan.bind_mount(&paths.staging_dir(), &requester.mount_dir(), requester.read_only());
        Ok(plan)
    }

    fn detach(
        _: &Volume,
        consumer: &Consumer,
        _: Vec<Consumer>,
        _: &NodePaths,
    ) -> Result<Plan, PolicyError> {
        let plan = Plan::new();
        plan.unmount(&consumer.mount_dir(), false);
        Ok(plan)
    }

    fn cleanup(_: CleanupReason, _: Vec<CleanupItem>) -> Result<Plan, PolicyError> {
        Ok(Plan::new())
    }
}

export!(CoreOnly);
