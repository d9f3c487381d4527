//! A host with canned answers, for native tests of policies.

use crate::{
    Consumer, Holder, Host, LogLevel, MountEntry, NodeFacts, PathKind, Plan, Policy, Watcher,
};
use std::cell::RefCell;
use std::collections::BTreeMap;

/// Answers queries from maps; records every log line.
#[derive(Default)]
pub struct FakeHost {
    pub nodes: Vec<NodeFacts>,
    pub paths: BTreeMap<String, PathKind>,
    pub filesystems: BTreeMap<String, String>,
    pub mounts: Vec<MountEntry>,
    /// Keyed by "pool/image"; an `Err` is a storage cluster that cannot be asked.
    pub watchers: BTreeMap<String, Result<Vec<Watcher>, String>>,
    pub logs: RefCell<Vec<(LogLevel, String)>>,
}

impl Host for FakeHost {
    fn log(&self, level: LogLevel, message: &str) {
        self.logs.borrow_mut().push((level, message.to_string()));
    }
    fn node_state(&self, name: &str) -> NodeFacts {
        self.nodes.iter().find(|n| n.name == name).cloned().unwrap_or(NodeFacts {
            name: name.to_string(),
            exists: false,
            ready: false,
            out_of_service: false,
        })
    }
    fn path_kind(&self, path: &str) -> PathKind {
        self.paths.get(path).copied().unwrap_or(PathKind::Missing)
    }
    fn filesystem_type(&self, device: &str) -> Option<String> {
        self.filesystems.get(device).cloned()
    }
    fn mount_at(&self, target: &str) -> Option<MountEntry> {
        self.mounts.iter().find(|m| m.target == target).cloned()
    }
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        self.watchers.get(&format!("{pool}/{image}")).cloned().unwrap_or(Ok(Vec::new()))
    }
}

/// A read-write consumer `pod` (namespace "default", uid "uid-<pod>") on `node`.
pub fn consumer(node: &str, pod: &str) -> Consumer {
    Consumer {
        node: node.to_string(),
        pod_namespace: "default".to_string(),
        pod: pod.to_string(),
        pod_uid: format!("uid-{pod}"),
        mount_dir: format!("/var/lib/kubelet/pods/uid-{pod}/volumes/volagent~test/pv"),
        read_only: false,
        mount_group: None,
    }
}

pub fn holder(consumer: &Consumer) -> Holder {
    Holder { consumer: consumer.clone(), since: "2026-01-01T00:00:00Z".to_string() }
}

pub fn live_node(name: &str) -> NodeFacts {
    NodeFacts { name: name.to_string(), exists: true, ready: true, out_of_service: false }
}

/// Fails when `plan` has a step of a kind, or a device of a kind, that
/// `P`'s `info` does not declare: a policy's own tests find the mismatch
/// the host would refuse at run time.
pub fn assert_declared<P: Policy>(plan: &Plan) {
    let caps = P::info().capabilities;
    for step in plan {
        assert!(
            caps.steps.contains(&step.kind()),
            "{step:?}: its kind is not declared in {:?}",
            caps.steps
        );
        if let crate::Step::AttachDevice(crate::AttachDevice { spec, .. })
        | crate::Step::DetachDevice(crate::DetachDevice { spec, .. }) = step
        {
            assert!(caps.device_kinds.contains(&spec.kind()), "{step:?}: device kind not declared");
        }
    }
}
