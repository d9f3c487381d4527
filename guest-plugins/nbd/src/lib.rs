//! nbd: a network block device attached to an NBD export, formatted if
//! needed, mounted. An NBD export has no cluster filesystem and no storage
//! fencing, so it is a single-writer-node volume whatever its access mode.
//!
//! Options: `server` (required: "unix:/path.sock" or "host:port"), `export`
//! (the export name; default the server's default export).

use volagent_guest_sdk::{
    AccessMode, BackendInfo, Capabilities, CleanupItem, CleanupReason, Consumer, Decision,
    DeviceKind, DeviceSpec, Holder, Host, NbdSpec, NodeFacts, NodePaths, PathRoot, Plan, Policy,
    PolicyError, StepKind, Volume, fence, options, plans,
};

pub struct Nbd;

volagent_guest_sdk::export_policy!(crate::Nbd);

const FILESYSTEMS: &[&str] = &["ext4", "xfs"];

pub fn export_spec(volume: &Volume) -> Result<NbdSpec, PolicyError> {
    let server = options::required(volume, "server")?;
    let valid = match server.strip_prefix("unix:") {
        Some(path) => path.starts_with('/'),
        None => server.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok()),
    };
    if !valid {
        return Err(PolicyError::InvalidOptions(format!(
            "volume {}: server \"{server}\" is neither unix:/absolute/path nor host:port",
            volume.name
        )));
    }
    Ok(NbdSpec {
        server: server.to_string(),
        export_name: options::get(volume, "export").unwrap_or("").to_string(),
    })
}

/// One writer node: ReadWriteMany is narrowed to ReadWriteOnce.
fn effective_mode(mode: AccessMode) -> AccessMode {
    match mode {
        AccessMode::ReadWriteMany => AccessMode::ReadWriteOnce,
        other => other,
    }
}

impl Policy for Nbd {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "nbd".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: "NBD exports: attach, format if needed, mount; one writer node".into(),
            capabilities: Capabilities {
                steps: vec![
                    StepKind::AttachDevice,
                    StepKind::Format,
                    StepKind::Mount,
                    StepKind::BindMount,
                    StepKind::Unmount,
                    StepKind::DetachDevice,
                ],
                device_kinds: vec![DeviceKind::Nbd],
                filesystems: FILESYSTEMS.iter().map(|s| s.to_string()).collect(),
                network_filesystems: vec![],
                path_roots: vec![PathRoot::PodMountDir, PathRoot::StagingDir],
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
        export_spec(&volume)?;
        let mode = effective_mode(volume.access_mode);
        Ok(match fence::standard(&volume.name, mode, &requester, &holders, &nodes) {
            Decision::Deny(reason) if mode != volume.access_mode => Decision::Deny(format!(
                "{reason}; nbd volumes have a single writer node, even when ReadWriteMany"
            )),
            other => other,
        })
    }

    fn attach(
        _host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let spec = export_spec(&volume)?;
        let fs = options::fs_type(&volume, "ext4", FILESYSTEMS)?;
        Ok(plans::stage_block(&volume, plans::BlockOrigin::Attach(DeviceSpec::Nbd(spec)), &fs, vec![], &requester, &local_holders, &paths))
    }

    fn detach(
        _host: &dyn Host,
        volume: Volume,
        consumer: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let spec = export_spec(&volume)?;
        Ok(plans::unstage(&consumer, &local_holders, &paths, Some(DeviceSpec::Nbd(spec)), false))
    }

    fn cleanup(
        _host: &dyn Host,
        reason: CleanupReason,
        items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError> {
        let force = match reason {
            CleanupReason::StaleNode => false,
            CleanupReason::StorageClusterDeleted => true,
            CleanupReason::LocalVolumeReleased => {
                return Err(PolicyError::Unsupported("nbd volumes are not local volumes".into()));
            }
        };
        let mut plan = Vec::new();
        for item in items {
            let spec = export_spec(&item.volume)?;
            plan.extend(plans::teardown(&item.holders, &item.paths, Some(DeviceSpec::Nbd(spec)), force));
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::fake::{FakeHost, consumer, holder, live_node};
    use volagent_guest_sdk::{KeyValue, Step};

    fn volume(mode: AccessMode, server: &str) -> Volume {
        Volume {
            name: "pv1".into(),
            backend: "nbd".into(),
            access_mode: mode,
            fs_type: String::new(),
            options: vec![
                KeyValue { key: "server".into(), value: server.into() },
                KeyValue { key: "export".into(), value: "disk0".into() },
            ],
            secret_keys: vec![],
        }
    }

    #[test]
    fn server_address_is_validated() {
        for good in ["unix:/run/nbd.sock", "127.0.0.1:10809", "nbd.example:10809"] {
            assert!(export_spec(&volume(AccessMode::ReadWriteOnce, good)).is_ok(), "{good}");
        }
        for bad in ["unix:relative.sock", "127.0.0.1", ":10809", "host:port"] {
            assert!(matches!(export_spec(&volume(AccessMode::ReadWriteOnce, bad)), Err(PolicyError::InvalidOptions(_))), "{bad}");
        }
    }

    #[test]
    fn single_writer_node_even_for_rwx() {
        let held = vec![holder(&consumer("n1", "a"))];
        let nodes = vec![live_node("n1"), live_node("n2")];
        let d = Nbd::fence(&FakeHost::default(), volume(AccessMode::ReadWriteMany, "unix:/s"), consumer("n2", "b"), held.clone(), nodes.clone()).unwrap();
        assert!(matches!(&d, Decision::Deny(r) if r.contains("single writer") && r.contains("node n1")), "{d:?}");
        // The same node is still fine.
        let d = Nbd::fence(&FakeHost::default(), volume(AccessMode::ReadWriteMany, "unix:/s"), consumer("n1", "c"), held, nodes).unwrap();
        assert_eq!(d, Decision::Grant);
    }

    #[test]
    fn attach_and_last_detach() {
        let paths = NodePaths {
            kubelet_root: "/k".into(),
            staging_dir: "/k/plugins/volagent/nbd/mounts/pv1".into(),
            state_dir: "/s".into(),
            discovery_dirs: vec![],
        };
        let v = volume(AccessMode::ReadWriteOnce, "unix:/run/nbd.sock");
        let c = consumer("n1", "a");
        let plan = Nbd::attach(&FakeHost::default(), v.clone(), c.clone(), vec![], paths.clone()).unwrap();
        assert!(matches!(&plan[0], Step::AttachDevice(a) if matches!(&a.spec, DeviceSpec::Nbd(n) if n.export_name == "disk0")));
        assert_eq!(plan.len(), 4);
        let plan = Nbd::detach(&FakeHost::default(), v, c, vec![], paths).unwrap();
        assert!(matches!(plan.last(), Some(Step::DetachDevice(d)) if !d.force));
    }
}
