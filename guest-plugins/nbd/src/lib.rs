//! nbd: a network block device attached to an NBD export, formatted if
//! needed, mounted. An ext4 or xfs filesystem on a block device has one
//! writer node: ReadWriteOnce is fenced across nodes through the ledger, and
//! ReadWriteMany is refused unless the volume says its user is clustered.
//!
//! Options:
//! - `server`: "unix:/path.sock" or "host:port"; or instead
//! - `file`: a local file (beneath the node's discovery dirs) the agent
//!   serves itself and attaches through its own NBD export;
//! - `export`: the export name (default: the server's default export);
//! - `attach`: `auto` (default: the kernel's nbd driver where the node has
//!   it, else userspace), `kernel`, or `userspace` (nbdfuse on a loop device);
//! - `connections`: 1 to 16 (default 4) connections per attachment;
//! - `read-only`: "true" attaches and mounts read-only on any number of
//!   nodes, as ReadOnlyMany;
//! - `clustered`: "true" lets ReadWriteMany through, for users that
//!   coordinate writers themselves.

use volagent_guest_sdk::{
    AccessMode, BackendInfo, Capabilities, CleanupItem, CleanupReason, Consumer, Decision,
    DeviceKind, DeviceSpec, Holder, Host, NbdAttach, NbdSpec, NodeFacts, NodePaths, PathRoot, Plan,
    Policy, PolicyError, StepKind, Volume, fence, options, plans,
};

pub struct Nbd;

volagent_guest_sdk::export_policy!(crate::Nbd);

const FILESYSTEMS: &[&str] = &["ext4", "xfs"];
const MAX_CONNECTIONS: u8 = 16;
const DEFAULT_CONNECTIONS: u8 = 4;

pub fn export_spec(volume: &Volume) -> Result<NbdSpec, PolicyError> {
    let local_file = options::get(volume, "file").map(str::to_string);
    let server = match (options::get(volume, "server"), &local_file) {
        (Some(_), Some(_)) => {
            return Err(PolicyError::InvalidOptions(format!(
                "volume {}: give either server or file, not both",
                volume.name
            )));
        }
        (None, Some(_)) => "",
        (_, None) => options::required(volume, "server")?,
    };
    if let Some(file) = &local_file {
        if !file.starts_with('/') {
            return Err(PolicyError::InvalidOptions(format!(
                "volume {}: file \"{file}\" is not an absolute path",
                volume.name
            )));
        }
    } else {
        let valid = match server.strip_prefix("unix:") {
            Some(path) => path.starts_with('/'),
            None => server
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok()),
        };
        if !valid {
            return Err(PolicyError::InvalidOptions(format!(
                "volume {}: server \"{server}\" is neither unix:/absolute/path nor host:port",
                volume.name
            )));
        }
    }
    let attach = match options::get(volume, "attach").unwrap_or("auto") {
        "auto" => NbdAttach::Auto,
        "kernel" => NbdAttach::Kernel,
        "userspace" => NbdAttach::Userspace,
        other => {
            return Err(PolicyError::InvalidOptions(format!(
                "volume {}: attach \"{other}\" is not auto, kernel or userspace",
                volume.name
            )));
        }
    };
    let connections = match options::get(volume, "connections") {
        None => DEFAULT_CONNECTIONS,
        Some(n) => {
            n.parse::<u8>().ok().filter(|n| (1..=MAX_CONNECTIONS).contains(n)).ok_or_else(|| {
                PolicyError::InvalidOptions(format!(
                    "volume {}: connections \"{n}\" is not a number from 1 to {MAX_CONNECTIONS}",
                    volume.name
                ))
            })?
        }
    };
    Ok(NbdSpec {
        server: server.to_string(),
        export_name: options::get(volume, "export").unwrap_or("").to_string(),
        local_file,
        attach,
        connections,
    })
}

/// The volume as this backend serves it: a read-only export is
/// ReadOnlyMany, whatever the PV says.
fn effective(volume: &Volume) -> Result<Volume, PolicyError> {
    let mut v = volume.clone();
    if options::boolean(volume, "read-only", false)? {
        v.access_mode = AccessMode::ReadOnlyMany;
    }
    Ok(v)
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
                    StepKind::PublishBlock,
                    StepKind::GrowFilesystem,
                ],
                device_kinds: vec![DeviceKind::Nbd],
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
        export_spec(&volume)?;
        let volume = effective(&volume)?;
        if volume.access_mode == AccessMode::ReadWriteMany
            && !options::boolean(&volume, "clustered", false)?
        {
            return Ok(Decision::Deny(format!(
                "volume {} is ReadWriteMany, but a filesystem on an NBD block device has one writer node; \
                 use ReadWriteOnce, or set clustered: \"true\" if its users coordinate writers themselves",
                volume.name
            )));
        }
        Ok(fence::standard(&volume.name, volume.access_mode, &requester, &holders, &nodes))
    }

    fn attach(
        _host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let spec = export_spec(&volume)?;
        let volume = effective(&volume)?;
        let fs = options::fs_type(&volume, "ext4", FILESYSTEMS)?;
        Ok(plans::stage_block(
            &volume,
            plans::BlockOrigin::Attach(DeviceSpec::Nbd(spec)),
            &fs,
            volume.mount_flags.clone(),
            &requester,
            &local_holders,
            &paths,
        ))
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
            plan.extend(plans::teardown(
                &item.holders,
                &item.paths,
                Some(DeviceSpec::Nbd(spec)),
                force,
            ));
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
            mode: volagent_guest_sdk::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
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
            assert!(
                matches!(
                    export_spec(&volume(AccessMode::ReadWriteOnce, bad)),
                    Err(PolicyError::InvalidOptions(_))
                ),
                "{bad}"
            );
        }
    }

    fn with(mut v: Volume, key: &str, value: &str) -> Volume {
        v.options.push(KeyValue { key: key.into(), value: value.into() });
        v
    }

    #[test]
    fn rwx_is_refused_unless_clustered() {
        let nodes = vec![live_node("n1"), live_node("n2")];
        let rwx = volume(AccessMode::ReadWriteMany, "unix:/s");
        let d = Nbd::fence(
            &FakeHost::default(),
            rwx.clone(),
            consumer("n1", "a"),
            vec![],
            nodes.clone(),
        )
        .unwrap();
        assert!(
            matches!(&d, Decision::Deny(r) if r.contains("one writer node") && r.contains("clustered")),
            "{d:?}"
        );
        let clustered = with(rwx, "clustered", "true");
        let held = vec![holder(&consumer("n1", "a"))];
        let d =
            Nbd::fence(&FakeHost::default(), clustered, consumer("n2", "b"), held, nodes).unwrap();
        assert_eq!(d, Decision::Grant);
    }

    #[test]
    fn rwo_has_one_writer_node() {
        let held = vec![holder(&consumer("n1", "a"))];
        let nodes = vec![live_node("n1"), live_node("n2")];
        let d = Nbd::fence(
            &FakeHost::default(),
            volume(AccessMode::ReadWriteOnce, "unix:/s"),
            consumer("n2", "b"),
            held.clone(),
            nodes.clone(),
        )
        .unwrap();
        assert!(matches!(&d, Decision::Deny(r) if r.contains("node n1")), "{d:?}");
        let d = Nbd::fence(
            &FakeHost::default(),
            volume(AccessMode::ReadWriteOnce, "unix:/s"),
            consumer("n1", "c"),
            held,
            nodes,
        )
        .unwrap();
        assert_eq!(d, Decision::Grant);
    }

    #[test]
    fn a_read_only_export_is_read_only_many() {
        let held = vec![holder(&consumer("n1", "a"))];
        let nodes = vec![live_node("n1"), live_node("n2")];
        let ro = with(volume(AccessMode::ReadWriteOnce, "unix:/s"), "read-only", "true");
        let mut reader = consumer("n2", "b");
        reader.read_only = true;
        let d = Nbd::fence(&FakeHost::default(), ro.clone(), reader, held.clone(), nodes.clone())
            .unwrap();
        assert_eq!(d, Decision::Grant, "readers on two nodes");
        let d =
            Nbd::fence(&FakeHost::default(), ro.clone(), consumer("n2", "c"), held, nodes).unwrap();
        assert!(
            matches!(&d, Decision::Deny(r) if r.contains("read-only")),
            "a writer is turned away: {d:?}"
        );
        let paths = NodePaths {
            kubelet_root: "/k".into(),
            staging_dir: "/k/plugins/volagent/nbd/mounts/pv1".into(),
            state_dir: "/s".into(),
            discovery_dirs: vec![],
        };
        let plan =
            Nbd::attach(&FakeHost::default(), ro, consumer("n2", "b"), vec![], paths).unwrap();
        assert!(matches!(&plan[0], Step::AttachDevice(a) if a.read_only));
        assert!(
            !plan.iter().any(|s| matches!(s, Step::Format(_))),
            "never formats a read-only export"
        );
        let bad = with(volume(AccessMode::ReadWriteOnce, "unix:/s"), "read-only", "yes");
        assert!(
            matches!(effective(&bad), Err(PolicyError::InvalidOptions(m)) if m.contains("read-only"))
        );
    }

    #[test]
    fn a_local_file_is_served_by_the_agent_instead_of_a_server() {
        let mut v = volume(AccessMode::ReadWriteOnce, "unix:/s");
        v.options.retain(|kv| kv.key != "server");
        let spec = export_spec(&with(v.clone(), "file", "/mnt/disks/vol.img")).unwrap();
        assert_eq!(
            (spec.server.as_str(), spec.local_file.as_deref()),
            ("", Some("/mnt/disks/vol.img"))
        );
        let both = with(with(v.clone(), "file", "/mnt/disks/vol.img"), "server", "unix:/s");
        assert!(
            matches!(export_spec(&both), Err(PolicyError::InvalidOptions(m)) if m.contains("not both"))
        );
        assert!(matches!(
            export_spec(&with(v.clone(), "file", "vol.img")),
            Err(PolicyError::InvalidOptions(_))
        ));
        assert!(
            matches!(export_spec(&v), Err(PolicyError::InvalidOptions(m)) if m.contains("server"))
        );
    }

    #[test]
    fn attach_path_and_connections_are_chosen_and_checked() {
        let v = volume(AccessMode::ReadWriteOnce, "unix:/s");
        let spec = export_spec(&v).unwrap();
        assert_eq!((spec.attach, spec.connections), (NbdAttach::Auto, DEFAULT_CONNECTIONS));
        let spec =
            export_spec(&with(with(v.clone(), "attach", "userspace"), "connections", "1")).unwrap();
        assert_eq!((spec.attach, spec.connections), (NbdAttach::Userspace, 1));
        assert_eq!(
            export_spec(&with(v.clone(), "attach", "kernel")).unwrap().attach,
            NbdAttach::Kernel
        );
        for (k, bad) in [
            ("attach", "fuse"),
            ("connections", "0"),
            ("connections", "17"),
            ("connections", "many"),
        ] {
            assert!(
                matches!(export_spec(&with(v.clone(), k, bad)), Err(PolicyError::InvalidOptions(m)) if m.contains(k)),
                "{k}={bad}"
            );
        }
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
        let plan =
            Nbd::attach(&FakeHost::default(), v.clone(), c.clone(), vec![], paths.clone()).unwrap();
        assert!(
            matches!(&plan[0], Step::AttachDevice(a) if matches!(&a.spec, DeviceSpec::Nbd(n) if n.export_name == "disk0"))
        );
        assert_eq!(plan.len(), 4);
        let plan = Nbd::detach(&FakeHost::default(), v, c, vec![], paths).unwrap();
        assert!(matches!(plan.last(), Some(Step::DetachDevice(d)) if !d.force));
    }
}
