//! gluster: a GlusterFS volume mounted with the FUSE client. No device;
//! many writers by nature (the standard access-mode rules still apply).
//!
//! Options: `servers` (comma-separated; the first is asked for the volfile,
//! the rest are backups; required unless the volume names a StorageCluster,
//! whose endpoints the host passes as `endpoints`), `volume` (required: the
//! gluster volume), `subdir` (a directory beneath the volume's root to mount
//! instead of the root: what the provisioner makes each volume).

use volagent_guest_sdk::staged::{Medium, Staged, StagedBackend};
use volagent_guest_sdk::{NodePaths, PathRoot, PolicyError, Volume, options};

mod provisioner;

pub struct Gluster;

volagent_guest_sdk::export_policy!(crate::Gluster, provisioner);

/// Most names in a `subdir`, and its longest.
const MAX_SUBDIR_NAMES: usize = 16;
const MAX_SUBDIR: usize = 1024;

/// `subdir`, checked: names of letters, digits, '-', '_' and '.' (none
/// starting with '.') joined by '/'. Nothing else reaches the mount source:
/// no way out of the volume, and nothing the helper reads as an option.
fn subdir(volume: &Volume) -> Result<Option<&str>, PolicyError> {
    let Some(dir) = options::get(volume, "subdir") else { return Ok(None) };
    let dir = dir.trim_matches('/');
    let name_ok = |n: &str| {
        !n.is_empty()
            && !n.starts_with('.')
            && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    let names: Vec<&str> = dir.split('/').collect();
    if dir.len() > MAX_SUBDIR || names.len() > MAX_SUBDIR_NAMES || !names.iter().all(|n| name_ok(n))
    {
        return Err(PolicyError::InvalidOptions(format!(
            "volume {}: subdir {dir:?} is not a directory beneath the gluster volume's root (names of letters, digits, '-', '_' and '.', not starting with '.', joined by '/')",
            volume.name
        )));
    }
    Ok(Some(dir))
}

impl StagedBackend for Gluster {
    const NAME: &'static str = "gluster";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str = "GlusterFS volumes through the FUSE client";
    const MEDIUM: Medium = Medium::Network { fs_type: "glusterfs" };
    /// The FUSE client's log is written in the state dir.
    const PATH_ROOTS: &'static [PathRoot] = &[PathRoot::StateDir];

    /// The first server is asked for the volfile, the rest are backups.
    fn stage(volume: &Volume) -> Result<Staged, PolicyError> {
        let mut servers = options::list(volume, "servers");
        if servers.is_empty() {
            // The StorageCluster the volume names: the host passes its endpoints.
            servers = options::list(volume, "endpoints");
        }
        let Some((first, backups)) = servers.split_first() else {
            return Err(PolicyError::InvalidOptions(format!(
                "volume {}: option \"servers\" is required (comma-separated gluster servers), unless the volume names a StorageCluster with endpoints",
                volume.name
            )));
        };
        let gluster_volume = options::required(volume, "volume")?;
        let source = match subdir(volume)? {
            Some(dir) => format!("{first}:/{gluster_volume}/{dir}"),
            None => format!("{first}:/{gluster_volume}"),
        };
        let mut mount_options = Vec::new();
        if !backups.is_empty() {
            mount_options.push(format!("backup-volfile-servers={}", backups.join(":")));
        }
        // auto_unmount: the FUSE mount goes away if the client dies, instead
        // of leaving a dead mount that hangs every stat.
        mount_options.push("auto_unmount".to_string());
        Ok(Staged::Network { source, options: mount_options })
    }

    fn node_options(paths: &NodePaths) -> Vec<String> {
        vec![format!("log-file={}/glusterfs.log", paths.state_dir)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::fake::{FakeHost, consumer, holder};
    use volagent_guest_sdk::{AccessMode, Decision, KeyValue, Mount, MountSource, Policy, Step};

    /// The mount at the staging dir that the first pod's attach plans.
    fn staging_mount(volume: &Volume, paths: &NodePaths) -> Result<Mount, PolicyError> {
        let plan = Gluster::attach(
            &FakeHost::default(),
            volume.clone(),
            consumer("n1", "a"),
            vec![],
            paths.clone(),
        )?;
        match plan.first() {
            Some(Step::Mount(m)) => Ok(m.clone()),
            other => panic!("the plan starts with {other:?}, not a mount"),
        }
    }

    fn volume(servers: &str) -> Volume {
        Volume {
            name: "pv1".into(),
            backend: "gluster".into(),
            access_mode: AccessMode::ReadWriteMany,
            fs_type: String::new(),
            mode: volagent_guest_sdk::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: vec![
                KeyValue { key: "servers".into(), value: servers.into() },
                KeyValue { key: "volume".into(), value: "gv0".into() },
            ],
            secret_keys: vec![],
        }
    }

    fn paths() -> NodePaths {
        NodePaths {
            kubelet_root: "/k".into(),
            staging_dir: "/k/plugins/volagent/gluster/mounts/pv1".into(),
            state_dir: "/var/lib/volagent/volumes/pv1".into(),
            discovery_dirs: vec![],
        }
    }

    #[test]
    fn mount_uses_backup_servers_auto_unmount_and_a_log_file() {
        let m = staging_mount(&volume("g1, g2,g3"), &paths()).unwrap();
        assert_eq!(m.source, MountSource::Network("g1:/gv0".into()));
        assert_eq!(m.fs_type, "glusterfs");
        assert_eq!(
            m.options,
            vec![
                "backup-volfile-servers=g2:g3",
                "auto_unmount",
                "log-file=/var/lib/volagent/volumes/pv1/glusterfs.log"
            ]
        );
        let single = staging_mount(&volume("g1"), &paths()).unwrap();
        assert!(!single.options.iter().any(|o| o.starts_with("backup-volfile-servers")));
        assert!(matches!(
            staging_mount(&volume(" , "), &paths()),
            Err(PolicyError::InvalidOptions(_))
        ));
        // A StorageCluster's endpoints stand in for servers.
        let mut v = volume(" ");
        v.options.push(KeyValue { key: "endpoints".into(), value: "g7,g8".into() });
        let m = staging_mount(&v, &paths()).unwrap();
        assert_eq!(m.source, MountSource::Network("g7:/gv0".into()));
        assert_eq!(m.options[0], "backup-volfile-servers=g8");
    }

    #[test]
    fn a_subdir_is_mounted_in_place_of_the_volumes_root_and_checked() {
        let mut v = volume("g1");
        v.options.push(KeyValue { key: "subdir".into(), value: "volagent/pvc-1".into() });
        let m = staging_mount(&v, &paths()).unwrap();
        assert_eq!(m.source, MountSource::Network("g1:/gv0/volagent/pvc-1".into()));
        for bad in ["../x", "a/../b", "a//b", ".hidden", "a b", "a,ro", "a:b", "x/\0"] {
            let mut v = volume("g1");
            v.options.push(KeyValue { key: "subdir".into(), value: bad.into() });
            match staging_mount(&v, &paths()) {
                Err(PolicyError::InvalidOptions(m)) => assert!(m.contains("subdir"), "{m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let deep = vec!["d"; 17].join("/");
        let mut v = volume("g1");
        v.options.push(KeyValue { key: "subdir".into(), value: deep });
        assert!(matches!(staging_mount(&v, &paths()), Err(PolicyError::InvalidOptions(_))));
    }

    #[test]
    fn many_writers_on_many_nodes() {
        let held = vec![holder(&consumer("n1", "a")), holder(&consumer("n2", "b"))];
        let d = <Gluster as Policy>::fence(
            &FakeHost::default(),
            volume("g1"),
            consumer("n3", "c"),
            held,
            vec![],
        )
        .unwrap();
        assert_eq!(d, Decision::Grant);
    }

    #[test]
    fn second_pod_binds_and_last_pod_unmounts_staging() {
        let (a, b) = (consumer("n1", "a"), consumer("n1", "b"));
        let plan = Gluster::attach(
            &FakeHost::default(),
            volume("g1"),
            b.clone(),
            vec![holder(&a)],
            paths(),
        )
        .unwrap();
        assert!(matches!(plan.as_slice(), [Step::BindMount(_)]));
        let plan = Gluster::detach(&FakeHost::default(), volume("g1"), b, vec![], paths()).unwrap();
        assert!(
            matches!(plan.as_slice(), [Step::Unmount(_), Step::Unmount(s)] if s.target == paths().staging_dir)
        );
    }
}
