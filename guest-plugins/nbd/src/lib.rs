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

use volagent_guest_sdk::staged::{Medium, Staged, StagedBackend};
use volagent_guest_sdk::{
    AccessMode, Consumer, Decision, DeviceKind, DeviceSpec, Holder, Host, NbdAttach, NbdSpec,
    NodeFacts, PathRoot, PolicyError, Volume, fence, options,
};

pub struct Nbd;

volagent_guest_sdk::export_policy!(crate::Nbd);

pub fn export_spec(volume: &Volume) -> Result<NbdSpec, PolicyError> {
    let invalid =
        |why: String| Err(PolicyError::InvalidOptions(format!("volume {}: {why}", volume.name)));
    let local_file = options::get(volume, "file").map(str::to_string);
    let server = match (options::get(volume, "server"), &local_file) {
        (Some(_), Some(_)) => return invalid("give either server or file, not both".into()),
        (None, Some(_)) => "",
        (_, None) => options::required(volume, "server")?,
    };
    match (&local_file, server.strip_prefix("unix:")) {
        (Some(file), _) if !file.starts_with('/') => {
            return invalid(format!("file \"{file}\" is not an absolute path"));
        }
        (Some(_), _) => {}
        (None, Some(path)) if path.starts_with('/') => {}
        (None, None)
            if server
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok()) => {}
        (None, _) => {
            return invalid(format!(
                "server \"{server}\" is neither unix:/absolute/path nor host:port"
            ));
        }
    }
    let attach = options::choice(
        volume,
        "attach",
        NbdAttach::Auto,
        &[
            ("auto", NbdAttach::Auto),
            ("kernel", NbdAttach::Kernel),
            ("userspace", NbdAttach::Userspace),
        ],
    )?;
    Ok(NbdSpec {
        server: server.to_string(),
        export_name: options::get(volume, "export").unwrap_or("").to_string(),
        local_file,
        attach,
        connections: options::number(volume, "connections", 4, 1..=16)?,
    })
}

impl StagedBackend for Nbd {
    const NAME: &'static str = "nbd";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str =
        "NBD exports: attach, format if needed, mount; one writer node";
    const MEDIUM: Medium = Medium::Block { device: DeviceKind::Nbd, filesystems: &["ext4", "xfs"] };
    /// A local file the agent serves itself lies beneath the discovery dirs.
    const PATH_ROOTS: &'static [PathRoot] = &[PathRoot::DiscoveryDirs];

    fn stage(volume: &Volume) -> Result<Staged, PolicyError> {
        Ok(Staged::Block(DeviceSpec::Nbd(export_spec(volume)?)))
    }

    /// A read-only export is ReadOnlyMany, whatever the PV says.
    fn effective(mut volume: Volume) -> Result<Volume, PolicyError> {
        if options::boolean(&volume, "read-only", false)? {
            volume.access_mode = AccessMode::ReadOnlyMany;
        }
        Ok(volume)
    }

    fn fence(
        _host: &dyn Host,
        volume: &Volume,
        requester: &Consumer,
        holders: &[Holder],
        nodes: &[NodeFacts],
    ) -> Result<Decision, PolicyError> {
        if volume.access_mode == AccessMode::ReadWriteMany
            && !options::boolean(volume, "clustered", false)?
        {
            return Ok(Decision::Deny(format!(
                "volume {} is ReadWriteMany, but a filesystem on an NBD block device has one writer node; \
                 use ReadWriteOnce, or set clustered: \"true\" if its users coordinate writers themselves",
                volume.name
            )));
        }
        Ok(fence::standard(&volume.name, volume.access_mode, requester, holders, nodes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::fake::{FakeHost, consumer, holder, live_node};
    use volagent_guest_sdk::{KeyValue, NodePaths, Policy, Step};

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
        let d = <Nbd as Policy>::fence(
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
        let d = <Nbd as Policy>::fence(
            &FakeHost::default(),
            clustered,
            consumer("n2", "b"),
            held,
            nodes,
        )
        .unwrap();
        assert_eq!(d, Decision::Grant);
    }

    #[test]
    fn rwo_has_one_writer_node() {
        let held = vec![holder(&consumer("n1", "a"))];
        let nodes = vec![live_node("n1"), live_node("n2")];
        let d = <Nbd as Policy>::fence(
            &FakeHost::default(),
            volume(AccessMode::ReadWriteOnce, "unix:/s"),
            consumer("n2", "b"),
            held.clone(),
            nodes.clone(),
        )
        .unwrap();
        assert!(matches!(&d, Decision::Deny(r) if r.contains("node n1")), "{d:?}");
        let d = <Nbd as Policy>::fence(
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
        let d = <Nbd as Policy>::fence(
            &FakeHost::default(),
            ro.clone(),
            reader,
            held.clone(),
            nodes.clone(),
        )
        .unwrap();
        assert_eq!(d, Decision::Grant, "readers on two nodes");
        let d = <Nbd as Policy>::fence(
            &FakeHost::default(),
            ro.clone(),
            consumer("n2", "c"),
            held,
            nodes,
        )
        .unwrap();
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
            matches!(Nbd::effective(bad), Err(PolicyError::InvalidOptions(m)) if m.contains("read-only"))
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
        assert_eq!((spec.attach, spec.connections), (NbdAttach::Auto, 4));
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
