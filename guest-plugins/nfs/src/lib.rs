//! nfs: an NFS export, mounted by the node's kernel NFS client once per
//! node at the volume's staging dir and bound into each pod. Many writers
//! on many nodes by nature (Kubernetes' access-mode rules still apply).
//!
//! Options: `server` (required: a host name or an IPv4 or IPv6 address),
//! `path` (required: the export's absolute path), `vers` (3, 4, 4.0, 4.1 or
//! 4.2; 4.2 unless the volume's mount options name a version), `readOnly`
//! ("true" for an export the server gives read-only: served ReadOnlyMany,
//! whatever the PV says). The PV's mount options (`nconnect`, `timeo`,
//! `hard`, ...) go to the mount; the host allows the NFS client's own.

use volagent_guest_sdk::staged::{Medium, Staged, StagedBackend};
use volagent_guest_sdk::{AccessMode, PolicyError, Volume, options};

pub struct Nfs;

volagent_guest_sdk::export_policy!(crate::Nfs);

/// The protocol versions a volume may ask for.
const VERSIONS: &[(&str, &str)] =
    &[("3", "3"), ("4", "4"), ("4.0", "4.0"), ("4.1", "4.1"), ("4.2", "4.2")];

impl StagedBackend for Nfs {
    const NAME: &'static str = "nfs";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str = "NFS exports through the kernel's NFS client";
    const MEDIUM: Medium = Medium::Network { fs_type: "nfs" };

    fn stage(volume: &Volume) -> Result<Staged, PolicyError> {
        let server = options::required(volume, "server")?;
        let path = options::required(volume, "path")?;
        if !path.starts_with('/') {
            return Err(PolicyError::InvalidOptions(format!(
                "volume {}: path \"{path}\" is not absolute",
                volume.name
            )));
        }
        let vers = options::choice(volume, "vers", "4.2", VERSIONS)?;
        // A version among the PV's mount options is the admin's choice.
        let named =
            volume.mount_flags.iter().any(|f| f.starts_with("vers=") || f.starts_with("nfsvers="));
        let options = if named { vec![] } else { vec![format!("vers={vers}")] };
        // An IPv6 address is bracketed in a source: "[fd00::1]:/export".
        let host = match server.contains(':') && !server.starts_with('[') {
            true => format!("[{server}]"),
            false => server.to_string(),
        };
        Ok(Staged::Network { source: format!("{host}:{path}"), options })
    }

    fn effective(mut volume: Volume) -> Result<Volume, PolicyError> {
        if options::boolean(&volume, "readOnly", false)? {
            volume.access_mode = AccessMode::ReadOnlyMany;
        }
        Ok(volume)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::fake::{FakeHost, assert_declared, consumer, holder, live_node};
    use volagent_guest_sdk::{
        BindMount, Decision, KeyValue, Mount, MountSource, NodePaths, Policy, Step, VolumeMode,
    };

    fn volume(access_mode: AccessMode, options: &[(&str, &str)]) -> Volume {
        let mut all = vec![("server", "nfs.example"), ("path", "/exports/a")];
        all.extend(options);
        Volume {
            name: "pv1".into(),
            backend: "nfs".into(),
            access_mode,
            fs_type: String::new(),
            mode: VolumeMode::Filesystem,
            mount_flags: vec![],
            options: all
                .iter()
                .map(|(k, v)| KeyValue { key: k.to_string(), value: v.to_string() })
                .collect(),
            secret_keys: vec![],
        }
    }

    fn paths() -> NodePaths {
        NodePaths {
            kubelet_root: "/var/lib/kubelet".into(),
            staging_dir: "/var/lib/kubelet/plugins/volagent/nfs/mounts/pv1".into(),
            state_dir: "/var/lib/volagent/volumes/pv1".into(),
            discovery_dirs: vec![],
        }
    }

    /// The plan of the first pod on its node.
    fn attach(v: Volume) -> Result<Vec<Step>, PolicyError> {
        Nfs::attach(&FakeHost::default(), v, consumer("n1", "a"), vec![], paths())
    }

    fn staging_mount(v: Volume) -> Mount {
        match attach(v).unwrap().first() {
            Some(Step::Mount(m)) => m.clone(),
            other => panic!("the plan starts with {other:?}, not a mount"),
        }
    }

    #[test]
    fn the_first_pod_mounts_the_export_and_binds_it() {
        let plan = attach(volume(AccessMode::ReadWriteMany, &[])).unwrap();
        assert_eq!(
            plan,
            vec![
                Step::Mount(Mount {
                    source: MountSource::Network("nfs.example:/exports/a".into()),
                    target: paths().staging_dir,
                    fs_type: "nfs".into(),
                    options: vec!["vers=4.2".into()],
                    read_only: false,
                }),
                Step::BindMount(BindMount {
                    source: paths().staging_dir,
                    target: consumer("n1", "a").mount_dir,
                    read_only: false,
                }),
            ]
        );
        assert_declared::<Nfs>(&plan);
    }

    #[test]
    fn the_version_is_the_volumes_or_its_mount_options() {
        let m = staging_mount(volume(AccessMode::ReadWriteMany, &[("vers", "3")]));
        assert_eq!(m.options, ["vers=3"]);
        let mut v = volume(AccessMode::ReadWriteMany, &[]);
        v.mount_flags = vec!["nfsvers=4.1".into(), "nconnect=4".into()];
        assert_eq!(staging_mount(v).options, ["nfsvers=4.1", "nconnect=4"]);
        let err = attach(volume(AccessMode::ReadWriteMany, &[("vers", "2")])).unwrap_err();
        assert!(matches!(err, PolicyError::InvalidOptions(m) if m.contains("vers \"2\"")));
    }

    #[test]
    fn an_ipv6_server_is_bracketed() {
        let m = staging_mount(volume(AccessMode::ReadWriteMany, &[("server", "fd00::5")]));
        assert_eq!(m.source, MountSource::Network("[fd00::5]:/exports/a".into()));
    }

    #[test]
    fn a_read_only_export_is_read_only_many() {
        let v = volume(AccessMode::ReadWriteOnce, &[("readOnly", "true")]);
        assert!(staging_mount(v.clone()).read_only);
        // Readers on two nodes, where the PV's ReadWriteOnce would deny;
        // a writer is told to mount it read-only.
        let held = vec![holder(&consumer("n1", "a"))];
        let nodes = vec![live_node("n1"), live_node("n2")];
        let fence = |reader: bool| {
            let mut b = consumer("n2", "b");
            b.read_only = reader;
            <Nfs as Policy>::fence(&FakeHost::default(), v.clone(), b, held.clone(), nodes.clone())
                .unwrap()
        };
        assert_eq!(fence(true), Decision::Grant);
        assert!(matches!(fence(false), Decision::Deny(m) if m.contains("mount it read-only")));
    }

    #[test]
    fn read_write_once_is_one_node_at_a_time() {
        let held = vec![holder(&consumer("n1", "a"))];
        let nodes = vec![live_node("n1"), live_node("n2")];
        let v = volume(AccessMode::ReadWriteOnce, &[]);
        let d = <Nfs as Policy>::fence(&FakeHost::default(), v, consumer("n2", "b"), held, nodes)
            .unwrap();
        assert!(matches!(d, Decision::Deny(_)), "{d:?}");
    }

    #[test]
    fn a_relative_path_or_no_server_is_invalid() {
        let err = attach(volume(AccessMode::ReadWriteMany, &[("path", "exports/a")])).unwrap_err();
        assert!(matches!(err, PolicyError::InvalidOptions(m) if m.contains("not absolute")));
        let err = attach(volume(AccessMode::ReadWriteMany, &[("server", "")])).unwrap_err();
        assert!(matches!(err, PolicyError::InvalidOptions(m) if m.contains("\"server\"")));
    }
}
