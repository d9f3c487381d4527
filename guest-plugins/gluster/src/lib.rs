//! gluster: a GlusterFS volume mounted with the FUSE client. No device;
//! many writers by nature (the standard access-mode rules still apply).
//!
//! Options: `servers` (comma-separated; the first is asked for the volfile,
//! the rest are backups; required unless the volume names a StorageCluster,
//! whose endpoints the host passes as `endpoints`), `volume` (required: the
//! gluster volume).

use volagent_guest_sdk::{
    BackendInfo, Capabilities, CleanupItem, CleanupReason, Consumer, Decision, Holder, Host, Mount,
    MountSource, NodeFacts, NodePaths, PathRoot, Plan, Policy, PolicyError, Step, StepKind, Volume,
    VolumeMode, fence, options, plans,
};

pub struct Gluster;

volagent_guest_sdk::export_policy!(crate::Gluster);

/// The mount of the volume at the staging dir.
pub fn staging_mount(volume: &Volume, paths: &NodePaths) -> Result<Mount, PolicyError> {
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
    if volume.mode == VolumeMode::Block {
        return Err(PolicyError::Unsupported(format!(
            "volume {}: a gluster volume is a filesystem; it has no block mode",
            volume.name
        )));
    }
    let gluster_volume = options::required(volume, "volume")?;
    // The volume's own mount flags first; the policy's own after, so they
    // are the ones that count.
    let mut mount_options = volume.mount_flags.clone();
    if !backups.is_empty() {
        mount_options.push(format!("backup-volfile-servers={}", backups.join(":")));
    }
    // auto_unmount: the FUSE mount goes away if the client dies, instead of
    // leaving a dead mount that hangs every stat.
    mount_options.push("auto_unmount".to_string());
    mount_options.push(format!("log-file={}/glusterfs.log", paths.state_dir));
    Ok(Mount {
        source: MountSource::Network(format!("{first}:/{gluster_volume}")),
        target: paths.staging_dir.clone(),
        fs_type: "glusterfs".to_string(),
        options: mount_options,
        read_only: plans::volume_read_only(volume),
    })
}

impl Policy for Gluster {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "gluster".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: "GlusterFS volumes through the FUSE client".into(),
            capabilities: Capabilities {
                steps: vec![StepKind::Mount, StepKind::BindMount, StepKind::Unmount],
                device_kinds: vec![],
                filesystems: vec![],
                network_filesystems: vec!["glusterfs".into()],
                path_roots: vec![PathRoot::PodMountDir, PathRoot::StagingDir, PathRoot::StateDir],
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
        Ok(fence::standard(&volume.name, volume.access_mode, &requester, &holders, &nodes))
    }

    fn attach(
        _host: &dyn Host,
        volume: Volume,
        requester: Consumer,
        local_holders: Vec<Holder>,
        paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        let mount = staging_mount(&volume, &paths)?;
        if !local_holders.is_empty() {
            return Ok(vec![plans::bind_into_pod(&paths, &requester)]);
        }
        Ok(vec![Step::Mount(mount), plans::bind_into_pod(&paths, &requester)])
    }

    /// A gluster volume grows on its servers; the node has nothing to do.
    fn expand(
        _host: &dyn Host,
        _volume: Volume,
        _consumer: Consumer,
        _paths: NodePaths,
    ) -> Result<Plan, PolicyError> {
        Ok(Vec::new())
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
        reason: CleanupReason,
        items: Vec<CleanupItem>,
    ) -> Result<Plan, PolicyError> {
        let force = match reason {
            CleanupReason::StaleNode => false,
            CleanupReason::StorageClusterDeleted => true,
            CleanupReason::LocalVolumeReleased => {
                return Err(PolicyError::Unsupported(
                    "gluster volumes are not local volumes".into(),
                ));
            }
        };
        Ok(items.iter().flat_map(|i| plans::teardown(&i.holders, &i.paths, None, force)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::fake::{FakeHost, consumer, holder};
    use volagent_guest_sdk::{AccessMode, KeyValue};

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
    fn many_writers_on_many_nodes() {
        let held = vec![holder(&consumer("n1", "a")), holder(&consumer("n2", "b"))];
        let d =
            Gluster::fence(&FakeHost::default(), volume("g1"), consumer("n3", "c"), held, vec![])
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
