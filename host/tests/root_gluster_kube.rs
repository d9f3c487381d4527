//! gluster provisioning end to end: a real etcd + kube-apiserver, the
//! controller as its ServiceAccount with `deploy/`'s RBAC serving the
//! built gluster policy's CSI Controller service, the run's single-node
//! GlusterFS (scripts/gluster-env, volume v0 with its quota enabled) as a
//! StorageCluster, and an agent on a node that mounts what was made
//! through its CSI node service and Debian's FUSE client. A volume is a
//! directory of v0 limited by its quota; it is made once however often
//! asked, mounted, grown and removed. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use kube::api::Api;
use std::path::PathBuf;
use volagent::csi::proto::csi::volume_capability::{
    AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode,
};
use volagent::csi::proto::csi::*;
use volagent::sys::gluster_dirs::{GlusterDirs, GlusterVolume, LibGfapiDirs};
use volagent_test_support::api_cluster::Cluster;
use volagent_test_support::{ceph_cluster, wait_until};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");
const GLUSTER: (&str, &str) = (volagent_test_artifacts::GLUSTER, "gluster");
const MIB: i64 = 1 << 20;

/// The run's gluster dir and the host its volume v0 is served from.
fn gluster() -> (PathBuf, String) {
    let dir = PathBuf::from(std::env::var("VOLAGENT_GLUSTER_DIR").expect(
        "VOLAGENT_GLUSTER_DIR: the single-node GlusterFS of this run (scripts/gluster-env start makes it; scripts/test sets it)",
    ));
    assert!(dir.join("ready").exists(), "no GlusterFS ready in {}", dir.display());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    (dir, host)
}

/// The quota limit the brick keeps on `path` of v0.
fn brick_limit(dir: &std::path::Path, path: &str) -> Option<u64> {
    let mut value = [0u8; 16];
    let at = dir.join("bricks/v0").join(path);
    rustix::fs::lgetxattr(&at, "trusted.glusterfs.quota.limit-set.1", &mut value).ok()?;
    Some(u64::from_be_bytes(value[..8].try_into().unwrap()))
}

/// StorageCluster `name` of gluster at the run's glusterd: its endpoints
/// only, as Gluster has no users.
fn create_storage_cluster(c: &Cluster, name: &str, host: &str) {
    use volagent::kube::crds::{StorageCluster, StorageClusterSpec};
    let spec = StorageClusterSpec {
        backend: "gluster".into(),
        endpoints: vec![host.to_string()],
        secret_ref: None,
        controller_credentials: None,
        parameters: Default::default(),
    };
    let api: Api<StorageCluster> = Api::all(c.client());
    c.rt.block_on(api.create(&Default::default(), &StorageCluster::new(name, spec))).unwrap();
}

/// The code and message of a call that must fail.
fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> (tonic::Code, String) {
    match r {
        Ok(ok) => panic!("succeeded: {ok:?}"),
        Err(s) => (s.code(), s.message().to_string()),
    }
}

fn statvfs_bytes(path: &str) -> u64 {
    let s = nix::sys::statvfs::statvfs(path).unwrap();
    s.blocks() * s.fragment_size()
}

fn mount(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

/// The staging and target paths kubelet gives volume `pv` on `node`.
fn node_paths(c: &Cluster, node: &str, pv: &str) -> (String, String) {
    let kubelet = c.scratch.path(&format!("{node}/kubelet"));
    let staging = kubelet.join(format!("plugins/kubernetes.io/csi/pv/{pv}/globalmount"));
    let target = kubelet.join(format!("pods/uid-csi/volumes/kubernetes.io~csi/{pv}/mount"));
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    (staging.display().to_string(), target.display().to_string())
}

fn node_client(c: &Cluster, node: &str) -> node_client::NodeClient<tonic::transport::Channel> {
    let socket =
        volagent::csi::drivers::socket_path(&c.scratch.path(&format!("{node}/kubelet")), "gluster");
    c.rt.block_on(async {
        node_client::NodeClient::new(volagent::csi::client::connect(socket).await.unwrap())
    })
}

#[test]
fn the_csi_controller_provisions_gluster_directories_limited_by_quota_that_nodes_mount() {
    use tonic::Code;
    use volagent::csi::proto::csi::controller_client::ControllerClient;
    let (dir, host) = gluster();
    let suffix = std::process::id();
    let name = format!("pvc-g{suffix}");
    let path = format!("volagent/{name}");
    let id = format!("gluster-a.v0.{name}");
    let v0 = GlusterVolume { servers: vec![host.clone()], volume: "v0".into() };
    let dirs = LibGfapiDirs::new();
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[GLUSTER]);
    create_storage_cluster(&c, "gluster-a", &host);
    let csi = ceph_cluster::provisioning_controller(&mut c);
    let socket = volagent::provision::csi::socket_path(&csi, "gluster");
    c.wait("the gluster controller socket", || socket.exists());
    let params: std::collections::HashMap<String, String> =
        [("storageCluster", "gluster-a"), ("volume", "v0")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    let create = |name: &str, mib: i64| CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange { required_bytes: mib * MIB, limit_bytes: 0 }),
        volume_capabilities: vec![mount(Mode::MultiNodeMultiWriter)],
        parameters: params.clone(),
        ..Default::default()
    };
    let mut ctl = c.rt.block_on(async {
        ControllerClient::new(volagent::csi::client::connect(socket.clone()).await.unwrap())
    });

    // Made once, its size held by the quota; a retry is the same volume.
    let made = c.rt.block_on(async {
        let made = ctl.create_volume(create(&name, 64)).await.unwrap().into_inner().volume.unwrap();
        assert_eq!(made.volume_id, id);
        assert_eq!(made.capacity_bytes, 64 * MIB);
        assert_eq!(made.volume_context.get("subdir"), Some(&path));
        assert_eq!(made.volume_context.get("volume").map(String::as_str), Some("v0"));
        let again =
            ctl.create_volume(create(&name, 64)).await.unwrap().into_inner().volume.unwrap();
        assert_eq!(again, made, "a retried create returns the same volume");
        made
    });
    assert!(dir.join("bricks/v0").join(&path).is_dir());
    assert_eq!(brick_limit(&dir, &path), Some(64 << 20));
    let state = dirs.state(&v0, &path).unwrap().expect("the directory, through libgfapi");
    assert_eq!(state.quota_bytes, Some(64 << 20));

    // Refusals change nothing.
    c.rt.block_on(async {
        let (got, why) = code(ctl.create_volume(create(&name, 128)).await);
        assert_eq!(got, Code::AlreadyExists, "{why}");
        let mut block = create(&format!("{name}-b"), 8);
        block.volume_capabilities = vec![VolumeCapability {
            access_type: Some(AccessType::Block(BlockVolume {})),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        }];
        let (got, why) = code(ctl.create_volume(block).await);
        assert_eq!(got, Code::InvalidArgument, "{why}");
        assert!(why.contains("block"), "{why}");
        let mut no_volume = create(&format!("{name}-n"), 8);
        no_volume.parameters.remove("volume");
        let (got, why) = code(ctl.create_volume(no_volume).await);
        assert_eq!(got, Code::InvalidArgument, "{why}");
        let mut absent = create(&format!("{name}-a"), 8);
        absent.parameters.insert("volume".into(), "no-such-volume".into());
        let (got, why) = code(ctl.create_volume(absent).await);
        assert_eq!(got, Code::Unavailable, "{why}");
        assert!(why.contains("no-such-volume"), "{why}");
        let snap = CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: format!("snap-{suffix}"),
            ..Default::default()
        };
        let (got, why) = code(ctl.create_snapshot(snap).await);
        assert_eq!(got, Code::InvalidArgument, "{why}");
        assert!(why.contains("no snapshots"), "{why}");
    });
    for made_not in ["b", "n"] {
        assert!(!dir.join(format!("bricks/v0/volagent/{name}-{made_not}")).exists());
    }

    // Mounted on node-a through the agent's CSI stage: the directory, not the volume's root.
    let (staging, target) = node_paths(&c, "node-a", &id);
    let mut node = node_client(&c, "node-a");
    c.rt.block_on(async {
        node.node_stage_volume(NodeStageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
            volume_capability: Some(mount(Mode::MultiNodeMultiWriter)),
            volume_context: made.volume_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        node.node_publish_volume(NodePublishVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
            target_path: target.clone(),
            volume_capability: Some(mount(Mode::MultiNodeMultiWriter)),
            volume_context: made.volume_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let table = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap();
    let line = table.lines().find(|l| l.split(' ').nth(4) == Some(staging.as_str())).unwrap();
    assert!(
        line.contains(&format!("{host}:/v0/{path}")) && line.contains("fuse.glusterfs"),
        "{line}"
    );
    std::fs::write(format!("{target}/data"), b"provisioned").unwrap();
    assert_eq!(
        std::fs::read(dir.join("bricks/v0").join(&path).join("data")).unwrap(),
        b"provisioned"
    );
    // The quota is the size the node sees (once the brick has counted).
    wait_until(std::time::Duration::from_secs(20), "the node to see the quota as its size", || {
        statvfs_bytes(&target) == 64 << 20
    });

    // Grown: the limit is raised, and the node sees it.
    c.rt.block_on(async {
        let grown = ctl
            .controller_expand_volume(ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(CapacityRange { required_bytes: 96 * MIB, limit_bytes: 0 }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(grown.capacity_bytes, 96 * MIB);
        let shrink = ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
            ..Default::default()
        };
        let (got, why) = code(ctl.controller_expand_volume(shrink).await);
        assert_eq!(got, Code::OutOfRange, "{why}");
    });
    assert_eq!(brick_limit(&dir, &path), Some(96 << 20));
    wait_until(std::time::Duration::from_secs(20), "the node to see the new size", || {
        statvfs_bytes(&target) == 96 << 20
    });

    c.rt.block_on(async {
        node.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: target.clone(),
        })
        .await
        .unwrap();
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
        })
        .await
        .unwrap();
    });
    let node_a = c.scratch.path("node-a");
    let left: Vec<PathBuf> =
        c.scratch.mounts().into_iter().filter(|m| m.starts_with(&node_a)).collect();
    assert!(left.is_empty(), "{left:?}");

    // Removed with what was written in it; removing again is success.
    c.rt.block_on(async {
        let delete = DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() };
        ctl.delete_volume(delete.clone()).await.unwrap();
        ctl.delete_volume(delete).await.unwrap();
        let records: Api<volagent::kube::crds::ProvisionRecord> = Api::all(c.client());
        let listed = records.list(&Default::default()).await.unwrap();
        assert!(!listed.items.iter().any(|r| r.spec.id == id), "{listed:?}");
    });
    assert!(!dir.join("bricks/v0").join(&path).exists());
    assert_eq!(dirs.state(&v0, &path).unwrap(), None);
}

/// The same volumes through Kubernetes objects, with no sidecar: a claim
/// on a gluster class gets a PV of its own directory (the cluster's PV
/// binder binds them), limited by its quota; the claim grown, the quota and
/// the PV follow (and the claim waits for kubelet's node expansion, as
/// external-resizer leaves it); the claim deleted, the PV, the directory
/// and the record go.
#[test]
fn claims_on_a_gluster_class_get_quota_limited_directories_that_grow_and_go_with_them() {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    use kube::api::{Patch, PatchParams};
    let (dir, host) = gluster();
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[GLUSTER]);
    create_storage_cluster(&c, "gluster-k", &host);
    let _kcm = c.pv_binder();
    ceph_cluster::provisioning_controller(&mut c);
    let class: StorageClass = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "gluster-shared" },
        "provisioner": "gluster.csi.volagent.io",
        "parameters": { "storageCluster": "gluster-k", "volume": "v0" },
        "reclaimPolicy": "Delete",
        "allowVolumeExpansion": true,
        "volumeBindingMode": "Immediate",
    }))
    .unwrap();
    c.rt.block_on(Api::<StorageClass>::all(c.client()).create(&Default::default(), &class))
        .unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");
    let pvs: Api<PersistentVolume> = Api::all(c.client());
    let object: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "shared", "namespace": "default" },
        "spec": { "storageClassName": "gluster-shared", "accessModes": ["ReadWriteMany"],
                  "resources": { "requests": { "storage": "32Mi" } } },
    }))
    .unwrap();
    let claim = c.rt.block_on(claims.create(&Default::default(), &object)).unwrap();
    let pv_name = format!("pvc-{}", claim.metadata.uid.unwrap());
    let path = format!("volagent/{pv_name}");
    let phase = || {
        c.rt.block_on(claims.get("shared"))
            .unwrap()
            .status
            .and_then(|s| s.phase)
            .unwrap_or_default()
    };
    c.wait("claim shared to be Bound", || phase() == "Bound");

    let pv = c.rt.block_on(pvs.get(&pv_name)).unwrap();
    let spec = pv.spec.unwrap();
    let csi = spec.csi.unwrap();
    assert_eq!(csi.driver, "gluster.csi.volagent.io");
    assert_eq!(csi.volume_handle, format!("gluster-k.v0.{pv_name}"));
    let attributes = csi.volume_attributes.unwrap_or_default();
    assert_eq!(attributes.get("subdir"), Some(&path), "{attributes:?}");
    assert_eq!(spec.capacity.unwrap()["storage"].0, (32 << 20).to_string());
    assert_eq!(spec.access_modes.unwrap(), ["ReadWriteMany"]);
    assert_eq!(spec.persistent_volume_reclaim_policy.as_deref(), Some("Delete"));
    assert!(dir.join("bricks/v0").join(&path).is_dir());
    assert_eq!(brick_limit(&dir, &path), Some(32 << 20));

    // Grown: the quota, then the PV; the claim waits for the node.
    let grow =
        serde_json::json!({ "spec": { "resources": { "requests": { "storage": "48Mi" } } } });
    c.rt.block_on(claims.patch("shared", &PatchParams::default(), &Patch::Merge(&grow))).unwrap();
    c.wait("the PV to grow", || {
        c.rt.block_on(pvs.get(&pv_name)).unwrap().spec.unwrap().capacity.unwrap()["storage"].0
            == (48 << 20).to_string()
    });
    assert_eq!(brick_limit(&dir, &path), Some(48 << 20));
    let conditions = c.rt.block_on(claims.get("shared")).unwrap().status.unwrap().conditions;
    assert!(
        conditions.unwrap_or_default().iter().any(|c| c.type_ == "FileSystemResizePending"),
        "the claim waits for kubelet's NodeExpandVolume"
    );

    // Deleted: the PV, the directory, the record.
    c.rt.block_on(claims.delete("shared", &Default::default())).unwrap();
    let records: Api<volagent::kube::crds::ProvisionRecord> = Api::all(c.client());
    c.wait("the PV, the directory and the record to go", || {
        c.rt.block_on(pvs.get_opt(&pv_name)).unwrap().is_none()
            && !dir.join("bricks/v0").join(&path).exists()
            && c.rt.block_on(records.list(&Default::default())).unwrap().items.is_empty()
    });
}
