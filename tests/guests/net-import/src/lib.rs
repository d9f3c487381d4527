//! A test-only backend that reaches for the network, which a policy may not:
//! the host must refuse it at load because it imports wasi:sockets.

use volagent_guest_sdk::{
    BackendInfo, Capabilities, CleanupItem, CleanupReason, Consumer, Decision, Holder, Host,
    NodeFacts, NodePaths, Plan, Policy, PolicyError, StepKind, Volume,
};

pub struct NetImport;

volagent_guest_sdk::export_policy!(crate::NetImport);

impl Policy for NetImport {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "net-import".into(),
            version: "0.0.1".into(),
            description: "test-only: phones home".into(),
            capabilities: Capabilities {
                steps: vec![StepKind::Unmount],
                device_kinds: vec![],
                filesystems: vec![],
                network_filesystems: vec![],
                path_roots: vec![],
            },
        }
    }

    fn fence(
        _: &dyn Host,
        volume: Volume,
        _: Consumer,
        _: Vec<Holder>,
        _: Vec<NodeFacts>,
    ) -> Result<Decision, PolicyError> {
        match std::net::TcpStream::connect("127.0.0.1:9") {
            Ok(_) => Ok(Decision::Grant),
            Err(e) => Ok(Decision::Deny(format!("{}: {e}", volume.name))),
        }
    }

    fn attach(
        _: &dyn Host,
        _: Volume,
        _: Consumer,
        _: Vec<Holder>,
        _: NodePaths,
    ) -> Result<Plan, PolicyError> {
        Ok(vec![])
    }

    fn detach(
        _: &dyn Host,
        _: Volume,
        _: Consumer,
        _: Vec<Holder>,
        _: NodePaths,
    ) -> Result<Plan, PolicyError> {
        Ok(vec![])
    }

    fn cleanup(_: &dyn Host, _: CleanupReason, _: Vec<CleanupItem>) -> Result<Plan, PolicyError> {
        Ok(vec![])
    }
}
