//! rbd fencing at the storage layer, with agents of two nodes against a
//! real etcd + kube-apiserver and the run's single-node Ceph, each side
//! with the Ceph user docs/rbd.md gives it (nodes may not blocklist; the
//! controller may): a node that is deleted while its client still writes
//! (its agent gone, its helper, NBD client and mount still up: a
//! partitioned machine) is taken over only after the controller, asked by
//! the new node, blocklisted its Ceph client by the address its agent
//! recorded at attach (not while the controller cannot: its credentials
//! missing leave the volume with the old node); from then on its writes
//! fail with EIO while the new node's succeed. And provisioning: the
//! controller's CSI Controller service makes, grows, snapshots, clones and
//! removes images as the rbd policy plans them, with the controller's
//! user, and answers with the CSI spec's codes. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use base64::Engine;
use kube::api::Api;
use serde_json::Value;
use std::io::Write;
use std::process::Command;
use volagent::kube::crds::Attachment;
use volagent_test_support::api_cluster::Cluster;
use volagent_test_support::ceph::{Image, ceph_dir, volagent_key, watchers};
use volagent_test_support::driver::{assert_success, kubelet_options, run_driver};
use volagent_test_support::nbd::{NBD_WAIT, clients_under, servers_under};
use volagent_test_support::wait_until;
use volagent_test_support::{ceph, ceph_cluster, kube_objects, shipped};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

const RBD: (&str, &str) = (volagent_test_artifacts::RBD, "rbd");

/// What this tier's tests ask of the cluster beyond [`Cluster`]'s own.
trait RbdCluster {
    fn mount_with(
        &self,
        node: &str,
        pod: &str,
        volume: &str,
        key: Option<&str>,
    ) -> (String, (i32, Value));
    fn csi_stage_and_publish(&self, node: &str, pv: &str, attrs: &[(&str, &str)]) -> String;
    fn csi_stage_and_publish_fs(
        &self,
        node: &str,
        pv: &str,
        attrs: &[(&str, &str)],
        fs: &str,
    ) -> String;
}

impl RbdCluster for Cluster {
    /// kubelet's mount of PV `volume` for a new pod `pod` on `node`, with
    /// the Secret's key as kubelet passes it, or none.
    fn mount_with(
        &self,
        node: &str,
        pod: &str,
        volume: &str,
        key: Option<&str>,
    ) -> (String, (i32, Value)) {
        let uid = self.pod_uid(pod, volume);
        let dir =
            self.scratch.path(&format!("{node}/kubelet/pods/{uid}/volumes/volagent~rbd/{volume}"));
        std::fs::create_dir_all(&dir).unwrap();
        let dir = dir.display().to_string();
        let mut opts = kubelet_options(volume, pod, &uid, "ext4", "");
        opts.as_object_mut().unwrap().remove("path");
        if let Some(key) = key {
            opts["kubernetes.io/secret/key"] =
                base64::engine::general_purpose::STANDARD.encode(key).into();
        }
        let driver = self.scratch.path(&format!("{node}/vpd/volagent~rbd/rbd"));
        (dir.clone(), run_driver(Command::new(driver).args(["mount", &dir, &opts.to_string()])))
    }

    /// NodeStage and NodePublish of CSI volume `pv` (attributes `attrs`, no
    /// secrets) on `node`, as kubelet makes them; the target.
    fn csi_stage_and_publish(&self, node: &str, pv: &str, attrs: &[(&str, &str)]) -> String {
        self.csi_stage_and_publish_fs(node, pv, attrs, "ext4")
    }

    /// [`Self::csi_stage_and_publish`] with filesystem `fs`.
    fn csi_stage_and_publish_fs(
        &self,
        node: &str,
        pv: &str,
        attrs: &[(&str, &str)],
        fs: &str,
    ) -> String {
        use volagent::csi::proto::csi::volume_capability::{
            AccessMode, AccessType, MountVolume, access_mode::Mode,
        };
        use volagent::csi::proto::csi::*;
        let kubelet = self.scratch.path(&format!("{node}/kubelet"));
        let staging = kubelet.join(format!("plugins/kubernetes.io/csi/pv/{pv}/globalmount"));
        let target = kubelet.join(format!("pods/uid-csi/volumes/kubernetes.io~csi/{pv}/mount"));
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let capability = Some(VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: fs.into(),
                ..Default::default()
            })),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        });
        let socket = volagent::csi::drivers::socket_path(&kubelet, "rbd");
        let (staging, target) = (staging.display().to_string(), target.display().to_string());
        self.rt.block_on(async {
            let mut client = volagent::csi::proto::csi::node_client::NodeClient::new(
                volagent::csi::client::connect(socket).await.unwrap(),
            );
            let context: std::collections::HashMap<String, String> =
                attrs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            client
                .node_stage_volume(NodeStageVolumeRequest {
                    volume_id: pv.into(),
                    staging_target_path: staging.clone(),
                    volume_capability: capability.clone(),
                    volume_context: context,
                    ..Default::default()
                })
                .await
                .unwrap();
            client
                .node_publish_volume(NodePublishVolumeRequest {
                    volume_id: pv.into(),
                    staging_target_path: staging,
                    target_path: target.clone(),
                    volume_capability: capability,
                    ..Default::default()
                })
                .await
                .unwrap();
        });
        target
    }
}

/// Write `bytes` to `path` and push them to the device.
fn write_through(path: &str, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn blocklist(dir: &std::path::Path) -> String {
    let out = Command::new("ceph")
        .arg("-c")
        .arg(dir.join("ceph.conf"))
        .args(["osd", "blocklist", "ls"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_deleted_nodes_client_is_blocklisted_before_take_over_and_its_writes_then_fail() {
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let image = Image::create(&dir, 64);
    let mut c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[RBD]);
    ceph_cluster::create_secret(&c, shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    // The controller's key is not there yet: it cannot fence.
    ceph_cluster::create_storage_cluster(&c, "ceph", "ceph-volagent");
    c.rt.block_on(kube_objects::create_pv(
        &c.client(),
        "pv-rbd",
        "rbd",
        "ReadWriteOnce",
        &[("storageCluster", "ceph"), ("image", image.name.as_str())],
    ));

    // node-b mounts and writes; its agent records its Ceph client.
    let (old, r) = c.mount_with("node-b", "old", "pv-rbd", None);
    assert_success(&r);
    let old_device = r.1["device"].as_str().unwrap().to_string();
    write_through(&format!("{old}/data"), b"before").unwrap();
    let clients = c.record("pv-rbd").expect("the volume\'s record").spec.storage_clients;
    assert_eq!(clients.len(), 1, "{clients:?}");
    assert_eq!(clients[0].node, "node-b");
    assert_eq!(watchers(&image), [format!("client.{}", clients[0].id)]);

    // node-b's agent dies; its client and mount live on and keep writing.
    c.kill_agent("node-b");
    write_through(&format!("{old}/data"), b"still writing").unwrap();
    // A live node's volume is not taken over.
    let (_, r) = c.mount_with("node-a", "new-1", "pv-rbd", None);
    assert_eq!(r.1["status"], "Failure", "{}", r.1);
    assert!(!blocklist(&dir).contains(&clients[0].address), "nobody was blocklisted yet");
    // Nor can node-a fence node-b itself: its Ceph user may not blocklist.
    let denied = Command::new("ceph")
        .arg("-c")
        .arg(dir.join("ceph.conf"))
        .args([
            "--name",
            "client.volagent",
            "--key",
            &key,
            "osd",
            "blocklist",
            "add",
            &clients[0].address,
        ])
        .output()
        .unwrap();
    assert!(
        !denied.status.success() && String::from_utf8_lossy(&denied.stderr).contains("EACCES"),
        "a node's user blocklisted: {denied:?}"
    );

    // node-b is deleted: node-a asks the controller to fence its client
    // before it takes over. While the controller cannot, it does not.
    c.rt.block_on(kube_objects::delete_node(&c.client(), "node-b"));
    // (Nor can the controller move node-b's records: it cannot fence its client.)
    let (failed_dir, r) = c.mount_with("node-a", "new-2", "pv-rbd", None);
    let said = r.1["message"].as_str().unwrap_or_default().to_string();
    assert!(
        r.1["status"] == "Failure"
            && said.contains("ceph-fencing")
            && said.contains("does not exist"),
        "the fence's failure is said: {}",
        r.1
    );
    assert!(!blocklist(&dir).contains(&clients[0].address));
    assert!(
        !c.scratch.mounts().iter().any(|m| m.starts_with(c.scratch.path("node-a"))),
        "nothing mounted on node-a: {:?}",
        c.scratch.mounts()
    );
    assert_eq!(
        watchers(&image),
        [format!("client.{}", clients[0].id)],
        "node-a did not open the image"
    );
    ceph_cluster::create_fencing_secret(&c, "ceph");
    let (new, r) = c.mount_with("node-a", "new-2", "pv-rbd", None);
    assert_eq!(new, failed_dir);
    assert_success(&r);
    assert!(blocklist(&dir).contains(&clients[0].address), "{}", blocklist(&dir));
    assert!(
        !ceph::lockers(&image).contains(&clients[0].address),
        "the controller broke the fenced client's lock (node-a's user could not have)"
    );
    let rec = c.record("pv-rbd").expect("the volume\'s record").spec;
    let nodes: Vec<&str> = rec.consumers.iter().map(|x| x.node.as_str()).collect();
    assert_eq!(nodes, ["node-a"]);
    assert!(
        rec.storage_clients.iter().all(|s| s.node == "node-a") && rec.storage_clients.len() == 1,
        "{:?}",
        rec.storage_clients
    );
    let requests: Api<volagent::kube::crds::FenceRequest> = Api::all(c.client());
    assert!(
        c.rt.block_on(requests.list(&Default::default())).unwrap().items.is_empty(),
        "node-a deleted its answered request"
    );

    // The old node's writes fail; the new node's succeed.
    let err = write_through(&format!("{old}/data"), b"too late")
        .expect_err("the blocklisted client's write went through");
    assert!(
        err.raw_os_error() == Some(nix::libc::EIO) || err.raw_os_error() == Some(nix::libc::EROFS),
        "{err}"
    );
    assert_eq!(
        std::fs::read(format!("{new}/data")).unwrap(),
        b"still writing",
        "node-a sees what node-b wrote before it was fenced"
    );
    write_through(&format!("{new}/data"), b"taken over").unwrap();
    assert_eq!(std::fs::read(format!("{new}/data")).unwrap(), b"taken over");
    assert_success(&run_driver(
        Command::new(c.scratch.path("node-a/vpd/volagent~rbd/rbd")).args(["unmount", &new]),
    ));
    let st = c.scratch.path("node-a/state");
    wait_until(NBD_WAIT, "node-a's NBD client and helper to end", || {
        clients_under(&st).is_empty() && servers_under(&st).is_empty()
    });

    // What the dead machine left: its mount, loop device, NBD client and helper.
    let gone = c.scratch.path("node-b/state");
    // (The scratch dir's drop would too, also when an assertion above fails.)
    assert_eq!(c.scratch.loops(), [std::path::PathBuf::from(&old_device)]);
    for m in c.scratch.mounts().into_iter().rev() {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    use volagent::sys::Devices;
    volagent::sys::linux::Linux::unrooted().loop_detach(std::path::Path::new(&old_device)).unwrap();
    for pid in clients_under(&gone).into_iter().chain(servers_under(&gone)) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = Command::new("ceph")
        .arg("-c")
        .arg(dir.join("ceph.conf"))
        .args(["osd", "blocklist", "rm", &clients[0].address])
        .output();
    // (Not by its number: another test may take the freed device at once.)
    assert!(c.scratch.loops_left().is_empty(), "loop devices left: {:?}", c.scratch.loops());
}

/// A volume that names a StorageCluster gets its monitors, user and pool
/// from it and the Ceph key from the Secret it references (kubelet passes
/// none); a missing Secret is a clear error naming it. Deleting the
/// StorageCluster force-cleans its volumes on every node: mounts, devices,
/// helpers and the images' watchers all go, and so do the records.
#[test]
fn a_storage_cluster_connects_its_volumes_and_deleting_it_cleans_every_node() {
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let (one, two) = (Image::create(&dir, 64), Image::create(&dir, 64));
    let c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[RBD]);
    ceph_cluster::create_secret(&c, shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    ceph_cluster::create_storage_cluster(&c, "ceph", "ceph-volagent");
    ceph_cluster::create_storage_cluster(&c, "ceph-unkeyed", "absent");
    let clusters: Api<volagent::kube::crds::StorageCluster> = Api::all(c.client());
    c.wait("the finalizer", || {
        c.rt.block_on(clusters.get("ceph"))
            .ok()
            .and_then(|s| s.metadata.finalizers)
            .is_some_and(|f| f.iter().any(|f| f == volagent::kube::crds::CLEANUP_FINALIZER))
    });
    let three = Image::create(&dir, 64);
    for (pv, image, sc) in
        [("pv-sc-1", &one, "ceph"), ("pv-sc-2", &two, "ceph"), ("pv-unkeyed", &one, "ceph-unkeyed")]
    {
        c.rt.block_on(kube_objects::create_pv(
            &c.client(),
            pv,
            "rbd",
            "ReadWriteOnce",
            &[("storageCluster", sc), ("image", image.name.as_str())],
        ));
    }

    let (_, r) = c.mount_with("node-a", "unkeyed", "pv-unkeyed", None);
    assert_eq!(r.1["status"], "Failure", "{}", r.1);
    let message = r.1["message"].as_str().unwrap();
    assert!(
        message.contains(
            "Secret volagent-system/absent (named by StorageCluster ceph-unkeyed) does not exist"
        ),
        "{message}"
    );

    let (a, r) = c.mount_with("node-a", "a", "pv-sc-1", None);
    assert_success(&r);
    let (b, r) = c.mount_with("node-b", "b", "pv-sc-2", None);
    assert_success(&r);
    write_through(&format!("{a}/data"), b"on node-a").unwrap();
    write_through(&format!("{b}/data"), b"on node-b").unwrap();
    assert_eq!((watchers(&one).len(), watchers(&two).len()), (1, 1));
    assert_eq!(
        c.record("pv-sc-1").expect("the volume\'s record").spec.storage_cluster.as_deref(),
        Some("ceph")
    );
    // Through CSI too: a PV whose attributes name only the StorageCluster
    // and the image is staged with the monitors, user, pool and key the
    // StorageCluster gives (kubelet passes no secret), and published.
    let published = c.csi_stage_and_publish(
        "node-b",
        "pv-sc-csi",
        &[("storageCluster", "ceph"), ("image", three.name.as_str())],
    );
    write_through(&format!("{published}/data"), b"through CSI").unwrap();
    assert_eq!(watchers(&three).len(), 1);

    c.rt.block_on(clusters.delete("ceph", &Default::default())).unwrap();
    c.wait("the StorageCluster to go", || {
        c.rt.block_on(clusters.get_opt("ceph")).unwrap().is_none()
    });
    assert!(
        c.scratch.mounts().is_empty(),
        "every node's mounts are gone: {:?}",
        c.scratch.mounts()
    );
    assert!(c.scratch.loops_left().is_empty(), "and their devices");
    for node in ["node-a", "node-b"] {
        let st = c.scratch.path(&format!("{node}/state"));
        wait_until(NBD_WAIT, "the NBD clients and helpers to end", || {
            clients_under(&st).is_empty() && servers_under(&st).is_empty()
        });
    }
    assert!(
        watchers(&one).is_empty() && watchers(&two).is_empty() && watchers(&three).is_empty(),
        "no client is left on the images"
    );
    let api: Api<Attachment> = Api::all(c.client());
    assert!(
        c.rt.block_on(api.get_opt("pv-sc-1")).unwrap().is_none()
            && c.rt.block_on(api.get_opt("pv-sc-2")).unwrap().is_none(),
        "the records went"
    );
}

/// A node vanishes (its agent gone, its client still writing) while no
/// other node wants its volume: the controller moves its records to its
/// cleanup list and, first, blocklists its Ceph client at the volume's
/// StorageCluster, so its writes fail from then on. The volume is then
/// free: another node mounts it with no take-over, its image's stale
/// watcher gone with the blocklisting.
#[test]
fn the_controller_blocklists_a_vanished_nodes_clients_before_moving_its_records() {
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let image = Image::create(&dir, 64);
    let mut c = Cluster::start(VOLAGENT, &["node-a", "node-b"], &[RBD]);
    ceph_cluster::create_secret(&c, shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    ceph_cluster::create_storage_cluster(&c, "ceph", "ceph-volagent");
    ceph_cluster::create_fencing_secret(&c, "ceph");
    c.rt.block_on(kube_objects::create_pv(
        &c.client(),
        "pv-gone",
        "rbd",
        "ReadWriteOnce",
        &[("storageCluster", "ceph"), ("image", image.name.as_str())],
    ));
    let (old, r) = c.mount_with("node-b", "old", "pv-gone", None);
    assert_success(&r);
    write_through(&format!("{old}/data"), b"before").unwrap();
    let client = c.record("pv-gone").expect("the volume\'s record").spec.storage_clients[0].clone();
    assert_eq!(client.node, "node-b");

    c.kill_agent("node-b");
    c.rt.block_on(kube_objects::delete_node(&c.client(), "node-b"));
    let cleanups: Api<volagent::kube::crds::NodeCleanup> = Api::all(c.client());
    c.wait("node-b's records to move", || {
        c.rt.block_on(cleanups.get_opt("node-b"))
            .ok()
            .flatten()
            .is_some_and(|l| l.spec.entries.len() == 1)
    });
    assert!(blocklist(&dir).contains(&client.address), "{}", blocklist(&dir));
    let err = write_through(&format!("{old}/data"), b"too late")
        .expect_err("the vanished node's write went through");
    assert!(
        err.raw_os_error() == Some(nix::libc::EIO) || err.raw_os_error() == Some(nix::libc::EROFS),
        "{err}"
    );

    // The record is gone with its last consumer: node-a mounts afresh.
    c.wait("the record to go", || {
        let api: Api<Attachment> = Api::all(c.client());
        c.rt.block_on(api.get_opt("pv-gone")).unwrap().is_none()
    });
    let (new, r) = c.mount_with("node-a", "new", "pv-gone", None);
    assert_success(&r);
    assert_eq!(std::fs::read(format!("{new}/data")).unwrap(), b"before");
    assert_success(&run_driver(
        Command::new(c.scratch.path("node-a/vpd/volagent~rbd/rbd")).args(["unmount", &new]),
    ));
    let _ = Command::new("ceph")
        .arg("-c")
        .arg(dir.join("ceph.conf"))
        .args(["osd", "blocklist", "rm", &client.address])
        .output();
}

/// Images a test provisions, with their snapshots, removed on drop however
/// it ends.
struct Provisioned {
    dir: std::path::PathBuf,
    images: Vec<String>,
}

impl Drop for Provisioned {
    fn drop(&mut self) {
        for image in self.images.iter().rev() {
            let spec = format!("rbd/{image}");
            let conf = self.dir.join("ceph.conf");
            for args in
                [&["snap", "purge", "--no-progress", &spec][..], &["rm", "--no-progress", &spec]]
            {
                let _ = Command::new("rbd").arg("-c").arg(&conf).args(args).output();
            }
        }
    }
}

/// NodeUnpublish and NodeUnstage of what `csi_stage_and_publish` did.
fn csi_unpublish_and_unstage(c: &Cluster, node: &str, pv: &str) {
    use volagent::csi::proto::csi::*;
    let kubelet = c.scratch.path(&format!("{node}/kubelet"));
    let staging = kubelet.join(format!("plugins/kubernetes.io/csi/pv/{pv}/globalmount"));
    let target = kubelet.join(format!("pods/uid-csi/volumes/kubernetes.io~csi/{pv}/mount"));
    let socket = volagent::csi::drivers::socket_path(&kubelet, "rbd");
    c.rt.block_on(async {
        let mut client =
            node_client::NodeClient::new(volagent::csi::client::connect(socket).await.unwrap());
        client
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: pv.into(),
                target_path: target.display().to_string(),
            })
            .await
            .unwrap();
        client
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: pv.into(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .unwrap();
    });
}

/// The size of the filesystem at `path`, in bytes.
fn statvfs_bytes(path: &str) -> u64 {
    let s = nix::sys::statvfs::statvfs(path).unwrap();
    s.blocks() * s.fragment_size()
}

/// The code and message of a call that must fail.
fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> (tonic::Code, String) {
    match r {
        Ok(ok) => panic!("succeeded: {ok:?}"),
        Err(s) => (s.code(), s.message().to_string()),
    }
}

fn image_size(dir: &std::path::Path, image: &str) -> Option<u64> {
    let out = Command::new("rbd")
        .arg("-c")
        .arg(dir.join("ceph.conf"))
        .args(["info", "--format", "json", &format!("rbd/{image}")])
        .output()
        .unwrap();
    if !out.status.success() {
        return None;
    }
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["size"].as_u64()
}

#[test]
fn the_csi_controller_provisions_rbd_images_as_the_policy_plans_with_the_specs_codes() {
    use tonic::Code;
    use volagent::csi::proto::csi::controller_client::ControllerClient;
    use volagent::csi::proto::csi::identity_client::IdentityClient;
    use volagent::csi::proto::csi::volume_capability::{
        AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode,
    };
    use volagent::csi::proto::csi::*;
    const MIB: i64 = 1 << 20;
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let suffix = ceph::rand_suffix() % 1_000_000_000;
    let (name, restored, cloned) =
        (format!("pvc-{suffix}"), format!("pvc-{suffix}-r"), format!("pvc-{suffix}-c"));
    // Declared before the cluster: dropped after it, once nothing maps them.
    let _cleanup = Provisioned {
        dir: dir.clone(),
        images: vec![name.clone(), restored.clone(), cloned.clone()],
    };
    let mut c =
        Cluster::start(VOLAGENT, &["node-a"], &[RBD, (volagent_test_artifacts::NBD, "nbd")]);
    ceph_cluster::create_secret(&c, shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    ceph_cluster::create_storage_cluster(&c, "ceph", "ceph-volagent");
    ceph_cluster::create_fencing_secret(&c, "ceph");
    // The controller again, now serving the policies' CSI controllers.
    let csi = ceph_cluster::provisioning_controller(&mut c);
    let socket = volagent::provision::csi::socket_path(&csi, "rbd");
    c.wait("the rbd controller socket", || socket.exists());
    let mount = |mode: Mode| VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "xfs".into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    };
    let block = |mode: Mode| VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    };
    let params: std::collections::HashMap<String, String> = [
        ("storageCluster", "ceph"),
        ("csi.storage.k8s.io/fstype", "xfs"),
        ("imageFeatures", "layering,exclusive-lock"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let create =
        |name: &str, mib: i64, source: Option<volume_content_source::Type>| CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange { required_bytes: mib * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![mount(Mode::SingleNodeWriter)],
            parameters: params.clone(),
            volume_content_source: source.map(|t| VolumeContentSource { r#type: Some(t) }),
            ..Default::default()
        };
    let (mut ctl, made) = c.rt.block_on(async {
        let channel = volagent::csi::client::connect(socket.clone()).await.unwrap();
        let mut ctl = ControllerClient::new(channel.clone());
        let mut identity = IdentityClient::new(channel);
        let caps = identity.get_plugin_capabilities(GetPluginCapabilitiesRequest {}).await.unwrap();
        let services: Vec<i32> = caps
            .into_inner()
            .capabilities
            .iter()
            .filter_map(|c| match &c.r#type {
                Some(plugin_capability::Type::Service(s)) => Some(s.r#type),
                _ => None,
            })
            .collect();
        assert_eq!(
            services,
            [
                plugin_capability::service::Type::ControllerService as i32,
                plugin_capability::service::Type::VolumeAccessibilityConstraints as i32
            ]
        );
        let rpcs =
            ctl.controller_get_capabilities(ControllerGetCapabilitiesRequest {}).await.unwrap();
        assert_eq!(rpcs.into_inner().capabilities.len(), 6);

        // Made as asked, rounded to a MiB, on the pool; a retry is the same volume.
        let mut first = create(&name, 320, None);
        first.capacity_range.as_mut().unwrap().required_bytes = 320 * MIB - 5;
        let made = ctl.create_volume(first.clone()).await.unwrap().into_inner().volume.unwrap();
        assert_eq!(made.volume_id, format!("ceph.rbd.{name}"));
        assert_eq!(made.capacity_bytes, 320 * MIB);
        assert_eq!(made.volume_context.get("storageCluster").map(String::as_str), Some("ceph"));
        assert_eq!(made.volume_context.get("image"), Some(&name));
        assert_eq!(image_size(&dir, &name), Some(320 << 20));
        let again = ctl.create_volume(first.clone()).await.unwrap().into_inner().volume.unwrap();
        assert_eq!(again, made, "a retried create returns the same volume");
        // The controller recorded it before making it.
        let records: Api<volagent::kube::crds::ProvisionRecord> = Api::all(c.client());
        let listed = records.list(&Default::default()).await.unwrap();
        assert!(listed.items.iter().any(|r| r.spec.id == made.volume_id), "{listed:?}");

        // The spec's codes.
        let (got, why) = code(ctl.create_volume(create(&name, 512, None)).await);
        assert_eq!(got, Code::AlreadyExists, "{why}");
        let mut other = first.clone();
        other.parameters.insert("pool".into(), "elsewhere".into());
        assert_eq!(code(ctl.create_volume(other).await).0, Code::AlreadyExists);
        assert_eq!(code(ctl.create_volume(create("", 8, None)).await).0, Code::InvalidArgument);
        let (got, why) = code(ctl.create_volume(create(&"p".repeat(129), 8, None)).await);
        assert_eq!(got, Code::InvalidArgument, "{why}");
        assert!(why.contains("more than 128"), "{why}");
        let mut no_caps = create("pvc-x", 8, None);
        no_caps.volume_capabilities.clear();
        assert_eq!(code(ctl.create_volume(no_caps).await).0, Code::InvalidArgument);
        let mut rwx = create("pvc-x", 8, None);
        rwx.volume_capabilities = vec![mount(Mode::MultiNodeMultiWriter)];
        let (got, why) = code(ctl.create_volume(rwx).await);
        assert_eq!(got, Code::InvalidArgument, "{why}");
        assert!(why.contains("ReadWriteMany"), "{why}");
        let mut rwx_block = create("pvc-x", 8, None);
        rwx_block.volume_capabilities =
            vec![block(Mode::MultiNodeMultiWriter), mount(Mode::SingleNodeWriter)];
        assert_eq!(
            code(ctl.create_volume(rwx_block).await).0,
            Code::InvalidArgument,
            "block and mount at once"
        );
        let mut bad_range = create("pvc-x", 8, None);
        bad_range.capacity_range =
            Some(CapacityRange { required_bytes: 8 * MIB, limit_bytes: 4 * MIB });
        assert_eq!(code(ctl.create_volume(bad_range).await).0, Code::OutOfRange);
        let mut unfit = create("pvc-x", 8, None);
        unfit.capacity_range =
            Some(CapacityRange { required_bytes: 8 * MIB + 1, limit_bytes: 8 * MIB + 2 });
        assert_eq!(code(ctl.create_volume(unfit).await).0, Code::OutOfRange);
        let mut unnamed_cluster = create("pvc-x", 8, None);
        unnamed_cluster.parameters.remove("storageCluster");
        assert_eq!(code(ctl.create_volume(unnamed_cluster).await).0, Code::InvalidArgument);
        let missing =
            Some(volume_content_source::Type::Snapshot(volume_content_source::SnapshotSource {
                snapshot_id: format!("ceph.rbd.{name}.nothing"),
            }));
        let (got, why) = code(ctl.create_volume(create(&format!("{name}-m"), 8, missing)).await);
        assert_eq!(got, Code::NotFound, "{why}");
        assert_eq!(
            image_size(&dir, &format!("{name}-m")),
            None,
            "nothing made for a missing source"
        );

        // Capabilities of a made volume, and of one that is not there.
        let valid = ctl
            .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
                volume_id: made.volume_id.clone(),
                volume_capabilities: vec![mount(Mode::SingleNodeWriter)],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(valid.confirmed.is_some());
        let unknown = ValidateVolumeCapabilitiesRequest {
            volume_id: "ceph.rbd.nothing-here".into(),
            volume_capabilities: vec![mount(Mode::SingleNodeWriter)],
            ..Default::default()
        };
        assert_eq!(code(ctl.validate_volume_capabilities(unknown).await).0, Code::NotFound);
        (ctl, made)
    });

    // Used by a pod on node-a, through the nodes' own user of the
    // StorageCluster the volume's attributes name.
    let attrs: Vec<(&str, &str)> =
        made.volume_context.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let target = c.csi_stage_and_publish_fs("node-a", &made.volume_id, &attrs, "xfs");
    write_through(&format!("{target}/data"), b"provisioned").unwrap();
    let node_socket = volagent::csi::drivers::socket_path(&c.scratch.path("node-a/kubelet"), "rbd");
    let (snap, r) = c.rt.block_on(async {
        // In use: never removed under its user.
        let in_use =
            DeleteVolumeRequest { volume_id: made.volume_id.clone(), ..Default::default() };
        let (got, why) = code(ctl.delete_volume(in_use).await);
        assert_eq!(got, Code::FailedPrecondition, "{why}");
        assert!(why.contains("in use"), "{why}");
        assert_eq!(image_size(&dir, &name), Some(320 << 20));

        // Grown on the storage; the node grows the filesystem after.
        let grown = ctl
            .controller_expand_volume(ControllerExpandVolumeRequest {
                volume_id: made.volume_id.clone(),
                capacity_range: Some(CapacityRange { required_bytes: 400 * MIB, limit_bytes: 0 }),
                volume_capability: Some(mount(Mode::SingleNodeWriter)),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((grown.capacity_bytes, grown.node_expansion_required), (400 * MIB, true));
        assert_eq!(image_size(&dir, &name), Some(400 << 20));
        let no_range = ControllerExpandVolumeRequest {
            volume_id: made.volume_id.clone(),
            ..Default::default()
        };
        assert_eq!(code(ctl.controller_expand_volume(no_range).await).0, Code::InvalidArgument);
        // On this machine the image is mapped through the agent's NBD
        // helper and its FUSE client, which asks the helper the size again:
        // the mounted filesystem grows online.
        let before = statvfs_bytes(&target);
        let expand = NodeExpandVolumeRequest {
            volume_id: made.volume_id.clone(),
            volume_path: target.clone(),
            capacity_range: Some(CapacityRange { required_bytes: 400 * MIB, limit_bytes: 0 }),
            volume_capability: Some(mount(Mode::SingleNodeWriter)),
            ..Default::default()
        };
        let mut node = volagent::csi::proto::csi::node_client::NodeClient::new(
            volagent::csi::client::connect(node_socket.clone()).await.unwrap(),
        );
        let grown = node.node_expand_volume(expand).await.unwrap().into_inner();
        assert_eq!(grown.capacity_bytes, 400 * MIB);
        let after = statvfs_bytes(&target);
        assert!(after > before + (60 << 20), "the mounted filesystem grew: {before} -> {after}");

        // A snapshot, idempotent by name, listed, and restored as a clone.
        let snap_req = CreateSnapshotRequest {
            source_volume_id: made.volume_id.clone(),
            name: "snap-1".into(),
            ..Default::default()
        };
        let snap =
            ctl.create_snapshot(snap_req.clone()).await.unwrap().into_inner().snapshot.unwrap();
        assert_eq!(snap.snapshot_id, format!("ceph.rbd.{name}.snap-1"));
        assert_eq!((snap.size_bytes, snap.ready_to_use), (400 * MIB, true));
        assert!(snap.creation_time.is_some());
        assert_eq!(
            ctl.create_snapshot(snap_req).await.unwrap().into_inner().snapshot.unwrap(),
            snap
        );
        let elsewhere = CreateSnapshotRequest {
            source_volume_id: "ceph.rbd.another".into(),
            name: "snap-1".into(),
            ..Default::default()
        };
        assert_eq!(code(ctl.create_snapshot(elsewhere).await).0, Code::AlreadyExists);
        let listed = ctl
            .list_snapshots(ListSnapshotsRequest {
                source_volume_id: made.volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(listed.entries.len(), 1);
        assert_eq!(listed.entries[0].snapshot.as_ref(), Some(&snap));
        let by_id = ctl
            .list_snapshots(ListSnapshotsRequest {
                snapshot_id: "ceph.rbd.none.snap".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(by_id.entries.is_empty());
        let bad_token = ListSnapshotsRequest { starting_token: "x".into(), ..Default::default() };
        assert_eq!(code(ctl.list_snapshots(bad_token).await).0, Code::Aborted);
        let from_snapshot =
            Some(volume_content_source::Type::Snapshot(volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            }));
        let r = ctl
            .create_volume(create(&restored, 512, from_snapshot))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert_eq!((r.capacity_bytes, image_size(&dir, &restored)), (512 * MIB, Some(512 << 20)));
        (snap, r)
    });

    // Staged again, the filesystem keeps its new size, and growing it
    // again is success with nothing to do.
    csi_unpublish_and_unstage(&c, "node-a", &made.volume_id);
    let target = c.csi_stage_and_publish_fs("node-a", &made.volume_id, &attrs, "xfs");
    let before = statvfs_bytes(&target);
    c.rt.block_on(async {
        let mut node = volagent::csi::proto::csi::node_client::NodeClient::new(
            volagent::csi::client::connect(node_socket.clone()).await.unwrap(),
        );
        node.node_expand_volume(NodeExpandVolumeRequest {
            volume_id: made.volume_id.clone(),
            volume_path: target.clone(),
            capacity_range: Some(CapacityRange { required_bytes: 400 * MIB, limit_bytes: 0 }),
            volume_capability: Some(mount(Mode::SingleNodeWriter)),
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let after = statvfs_bytes(&target);
    assert_eq!(after, before, "the filesystem kept the size it grew to");
    assert!(after > 300 << 20, "{after}");
    assert_eq!(std::fs::read(format!("{target}/data")).unwrap(), b"provisioned");
    csi_unpublish_and_unstage(&c, "node-a", &made.volume_id);

    // The restore holds what was written before the snapshot.
    let attrs: Vec<(&str, &str)> =
        r.volume_context.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let restored_target = c.csi_stage_and_publish_fs("node-a", &r.volume_id, &attrs, "xfs");
    assert_eq!(std::fs::read(format!("{restored_target}/data")).unwrap(), b"provisioned");
    csi_unpublish_and_unstage(&c, "node-a", &r.volume_id);
    c.rt.block_on(async {
        let from_volume =
            Some(volume_content_source::Type::Volume(volume_content_source::VolumeSource {
                volume_id: made.volume_id.clone(),
            }));
        let cl = ctl
            .create_volume(create(&cloned, 400, from_volume))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(cl.capacity_bytes, 400 * MIB);
        assert!(image_size(&dir, &cloned).is_some());

        // Removal: refused while snapshots need the image; a snapshot and
        // volumes go; unknown ids are success.
        let (got, why) = code(
            ctl.delete_volume(DeleteVolumeRequest {
                volume_id: made.volume_id.clone(),
                ..Default::default()
            })
            .await,
        );
        assert_eq!(got, Code::FailedPrecondition, "{why}");
        assert!(why.contains("snapshot"), "{why}");
        ctl.delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        ctl.delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        for id in [&cl.volume_id, &r.volume_id, &made.volume_id] {
            ctl.delete_volume(DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() })
                .await
                .unwrap();
        }
        assert_eq!(image_size(&dir, &name), None);
        ctl.delete_volume(DeleteVolumeRequest {
            volume_id: made.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        ctl.delete_volume(DeleteVolumeRequest {
            volume_id: "not-an-rbd-id".into(),
            ..Default::default()
        })
        .await
        .unwrap();
        assert_eq!(
            code(ctl.delete_volume(DeleteVolumeRequest::default()).await).0,
            Code::InvalidArgument
        );
        let records: Api<volagent::kube::crds::ProvisionRecord> = Api::all(c.client());
        let left = records.list(&Default::default()).await.unwrap();
        assert!(!left.items.iter().any(|r| r.spec.name.starts_with(&name)), "{left:?}");

        // nbd's policy has no provisioner: its driver says so.
        let nbd = volagent::provision::csi::socket_path(&csi, "nbd");
        let mut nbd = ControllerClient::new(volagent::csi::client::connect(nbd).await.unwrap());
        let (got, why) = code(nbd.create_volume(create("pvc-n", 8, None)).await);
        assert_eq!(got, Code::Unimplemented, "{why}");
        assert!(why.contains("does not export volagent:policy/provisioner"), "{why}");
    });
}

#[test]
fn a_claim_on_a_volagent_class_gets_an_image_and_a_bound_pv_without_sidecars_and_leaves_nothing() {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    use volagent::kube::crds::{
        ProvisionKind, ProvisionPhase, ProvisionRecord, ProvisionRecordSpec,
    };
    let dir = ceph_dir();
    let suffix = ceph::rand_suffix() % 1_000_000_000;
    let orphan = format!("pvc-orphan-{suffix}");
    let mut cleanup = Provisioned { dir: dir.clone(), images: vec![orphan.clone()] };
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[RBD]);
    ceph_cluster::create_secret(&c, shipped::AGENT_NAMESPACE, "ceph-volagent", &volagent_key(&dir));
    ceph_cluster::create_storage_cluster(&c, "ceph", "ceph-volagent");
    ceph_cluster::create_fencing_secret(&c, "ceph");
    // A controller killed between making an image and its PV: its record
    // says Creating, and the claim it was for is gone.
    ceph::rbd(&dir, &["create", "--size", "16M", &format!("rbd/{orphan}")]);
    let records: Api<ProvisionRecord> = Api::all(c.client());
    let spec = ProvisionRecordSpec {
        backend: "rbd".into(),
        kind: ProvisionKind::Volume,
        name: orphan.clone(),
        id: format!("ceph.rbd.{orphan}"),
        source: None,
        required_bytes: 16 << 20,
        limit_bytes: 0,
        capacity_bytes: 16 << 20,
        request_digest: "0".into(),
        phase: ProvisionPhase::Creating,
        created: volagent::clock::now_rfc3339(),
    };
    let object = ProvisionRecord::name_for("rbd", ProvisionKind::Volume, &orphan);
    let mut record = ProvisionRecord::new(&object, spec);
    // As the controller labels its records.
    record.metadata.labels = Some([("volagent.io/backend".to_string(), "rbd".to_string())].into());
    c.rt.block_on(records.create(&Default::default(), &record)).unwrap();
    ceph_cluster::provisioning_controller(&mut c);
    c.wait("the orphaned image to be removed", || image_size(&dir, &orphan).is_none());
    c.wait("its record to go", || c.rt.block_on(records.get_opt(&object)).unwrap().is_none());

    let class: StorageClass = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "rbd-dynamic" },
        "provisioner": "rbd.csi.volagent.io",
        "parameters": { "storageCluster": "ceph", "csi.storage.k8s.io/fstype": "xfs" },
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }))
    .unwrap();
    c.rt.block_on(Api::<StorageClass>::all(c.client()).create(&Default::default(), &class))
        .unwrap();
    let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "data", "namespace": "default" },
        "spec": {
            "storageClassName": "rbd-dynamic",
            "accessModes": ["ReadWriteOnce"],
            "resources": { "requests": { "storage": "300Mi" } },
        },
    }))
    .unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");
    let claim = c.rt.block_on(claims.create(&Default::default(), &claim)).unwrap();
    let pv_name = format!("pvc-{}", claim.metadata.uid.clone().unwrap());
    cleanup.images.push(pv_name.clone());
    let pvs: Api<PersistentVolume> = Api::all(c.client());
    let mut pv = None;
    c.wait("the claim's PV", || {
        pv = c.rt.block_on(pvs.get_opt(&pv_name)).unwrap();
        pv.is_some()
    });
    let pv = pv.unwrap();
    let spec = pv.spec.clone().unwrap();
    let csi = spec.csi.clone().unwrap();
    assert_eq!(csi.driver, "rbd.csi.volagent.io");
    assert_eq!(csi.volume_handle, format!("ceph.rbd.{pv_name}"));
    assert_eq!(csi.fs_type.as_deref(), Some("xfs"));
    let attributes = csi.volume_attributes.clone().unwrap();
    assert_eq!(attributes.get("storageCluster").map(String::as_str), Some("ceph"));
    let claim_ref = spec.claim_ref.clone().unwrap();
    assert_eq!(
        (claim_ref.name.as_deref(), claim_ref.uid),
        (Some("data"), claim.metadata.uid.clone())
    );
    assert_eq!(spec.capacity.unwrap()["storage"].0, (300u64 << 20).to_string());
    assert_eq!(spec.persistent_volume_reclaim_policy.as_deref(), Some("Delete"));
    assert!(
        pv.metadata.finalizers.unwrap().contains(&"volagent.io/provisioned-volume".to_string())
    );
    assert_eq!(image_size(&dir, &pv_name), Some(300 << 20));

    // The claim goes; the PV controller marks its PV Released (this tier
    // runs no controller-manager: the test does what it would).
    c.rt.block_on(claims.delete("data", &Default::default())).unwrap();
    let mut released = c.rt.block_on(pvs.get(&pv_name)).unwrap();
    released.status = Some(k8s_openapi::api::core::v1::PersistentVolumeStatus {
        phase: Some("Released".into()),
        ..Default::default()
    });
    c.rt.block_on(pvs.replace_status(&pv_name, &Default::default(), &released)).unwrap();
    c.wait("the image to be removed", || image_size(&dir, &pv_name).is_none());
    // Deleted, and its finalizer off (kubernetes.io/pv-protection stays:
    // the controller-manager this tier lacks would take it off).
    c.wait("the PV to be deleted", || match c.rt.block_on(pvs.get_opt(&pv_name)).unwrap() {
        None => true,
        Some(pv) => {
            pv.metadata.deletion_timestamp.is_some()
                && !pv
                    .metadata
                    .finalizers
                    .unwrap_or_default()
                    .iter()
                    .any(|f| f.starts_with("volagent.io/"))
        }
    });
    let left = c.rt.block_on(records.list(&Default::default())).unwrap();
    assert!(left.items.is_empty(), "{left:?}");
}

/// `rbd info` of an image as JSON, or None when it is not there.
fn image_info(dir: &std::path::Path, image: &str) -> Option<Value> {
    let out = ceph::rbd(dir, &["info", "--format", "json", &format!("rbd/{image}")]);
    out.status.success().then(|| serde_json::from_slice(&out.stdout).unwrap())
}

/// The reasons of the Events about `kind` `name` in `namespace`.
fn event_reasons(c: &Cluster, namespace: &str, kind: &str, name: &str) -> Vec<String> {
    events_about(c, namespace, kind, name).into_iter().map(|(reason, ..)| reason).collect()
}

/// The Events about `kind` `name` in `namespace`: (reason, type, message).
fn events_about(
    c: &Cluster,
    namespace: &str,
    kind: &str,
    name: &str,
) -> Vec<(String, String, String)> {
    use k8s_openapi::api::core::v1::Event;
    let events: Api<Event> = Api::namespaced(c.client(), namespace);
    c.rt.block_on(events.list(&Default::default()))
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.kind.as_deref() == Some(kind)
                && e.involved_object.name.as_deref() == Some(name)
        })
        .map(|e| {
            (
                e.reason.unwrap_or_default(),
                e.type_.unwrap_or_default(),
                e.message.unwrap_or_default(),
            )
        })
        .collect()
}

/// A volume served by rbd-fuse pins the node's mounter: no new mounter
/// could take over rbd-fuse's FUSE connection. The agent, as its
/// ServiceAccount, writes a Warning Event on the mounter's pod naming the
/// volume, and a Normal one once it is unmounted. The mounter runs as a
/// process named after a Pod object, as the downward API names it in the
/// DaemonSet.
#[test]
fn a_volume_that_pins_the_mounter_is_named_in_an_event_on_the_mounter_pod() {
    use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let image = Image::create(&dir, 64);
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[RBD]);
    ceph_cluster::create_secret(&c, shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    ceph_cluster::create_storage_cluster(&c, "ceph", "ceph-volagent");
    c.rt.block_on(kube_objects::create_pv(
        &c.client(),
        "pv-fuse",
        "rbd",
        "ReadWriteOnce",
        &[("storageCluster", "ceph"), ("image", image.name.as_str()), ("attach", "fuse")],
    ));
    let name = "volagent-mounter-x1";
    let pod = Pod {
        metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
        spec: Some(PodSpec {
            node_name: Some("node-a".into()),
            containers: vec![Container {
                name: "mounter".into(),
                image: Some("volagent".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let pods: Api<Pod> = Api::namespaced(c.client(), shipped::AGENT_NAMESPACE);
    let uid = c.rt.block_on(pods.create(&Default::default(), &pod)).unwrap().metadata.uid.unwrap();
    let socket = c.scratch.path("mounter.sock");
    // Killed at the end, even after a failure (it outlives the agents).
    struct Mounter(std::process::Child);
    impl Drop for Mounter {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _mounter = Mounter(
        Command::new(VOLAGENT)
            .args(["mounter", "--socket"])
            .arg(&socket)
            .env("POD_NAMESPACE", shipped::AGENT_NAMESPACE)
            .env("POD_NAME", name)
            .env("POD_UID", &uid)
            .stderr(std::fs::File::create(c.scratch.path("mounter.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_until(std::time::Duration::from_secs(10), "the mounter to answer", || {
        Command::new(VOLAGENT)
            .args(["mounter", "--check", "--socket"])
            .arg(&socket)
            .output()
            .is_ok_and(|o| o.status.success())
    });
    c.kill_agent("node-a");
    c.spawn_agent_with("node-a", &["--mounter", socket.to_str().unwrap()]);

    let (target, r) = c.mount_with("node-a", "web", "pv-fuse", None);
    assert_success(&r);
    assert!(!clients_under(&c.scratch.path("")).is_empty(), "rbd-fuse serves the volume");
    let said = |reason: &str| {
        events_about(&c, shipped::AGENT_NAMESPACE, "Pod", name)
            .into_iter()
            .find(|(r, ..)| r == reason)
    };
    c.wait("a Warning on the mounter's pod naming the volume", || said("MounterPinned").is_some());
    let (_, kind, message) = said("MounterPinned").unwrap();
    assert_eq!(kind, "Warning");
    assert!(message.contains("rbd/pv-fuse (rbd-fuse)"), "{message}");
    assert!(said("MounterFree").is_none(), "not free while the volume is mounted");

    let driver = c.scratch.path("node-a/vpd/volagent~rbd/rbd");
    assert_success(&run_driver(Command::new(driver).args(["unmount", &target])));
    c.wait("a Normal Event once nothing pins the mounter", || said("MounterFree").is_some());
    assert_eq!(said("MounterFree").unwrap().1, "Normal");
}

#[test]
fn claims_grow_snapshot_and_restore_through_kubernetes_objects_without_sidecars() {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    use kube::api::{Patch, PatchParams};
    use volagent::kube::crds::ProvisionRecord;
    use volagent::kube::snapshot_crds::{
        VolumeSnapshot, VolumeSnapshotClass, VolumeSnapshotContent,
    };
    let dir = ceph_dir();
    let mut cleanup = Provisioned { dir: dir.clone(), images: Vec::new() };
    let mut c = Cluster::start(VOLAGENT, &["node-a"], &[RBD]);
    // The admin installs the snapshot API; the PV binder and the
    // protection controllers run as in any cluster.
    ceph_cluster::install_snapshot_crds(&c);
    let _kcm = c.pv_binder();
    ceph_cluster::provisioning(&mut c);
    let class: StorageClass = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "rbd-grow" },
        "provisioner": "rbd.csi.volagent.io",
        "parameters": { "storageCluster": "ceph", "csi.storage.k8s.io/fstype": "xfs" },
        "reclaimPolicy": "Delete",
        "allowVolumeExpansion": true,
        "volumeBindingMode": "Immediate",
    }))
    .unwrap();
    c.rt.block_on(Api::<StorageClass>::all(c.client()).create(&Default::default(), &class))
        .unwrap();
    let snapshot_class: VolumeSnapshotClass = serde_json::from_value(serde_json::json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
        "metadata": { "name": "rbd-snap",
                      "annotations": { "snapshot.storage.k8s.io/is-default-class": "true" } },
        "driver": "rbd.csi.volagent.io",
        "deletionPolicy": "Delete",
    }))
    .unwrap();
    c.rt.block_on(
        Api::<VolumeSnapshotClass>::all(c.client()).create(&Default::default(), &snapshot_class),
    )
    .unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "default");
    let pvs: Api<PersistentVolume> = Api::all(c.client());
    let claim = |name: &str, size: &str, source: Option<Value>| -> PersistentVolumeClaim {
        let mut spec = serde_json::json!({
            "storageClassName": "rbd-grow",
            "accessModes": ["ReadWriteOnce"],
            "resources": { "requests": { "storage": size } },
        });
        if let Some(source) = source {
            spec["dataSource"] = source;
        }
        let object: PersistentVolumeClaim = serde_json::from_value(
            serde_json::json!({ "metadata": { "name": name, "namespace": "default" }, "spec": spec }),
        )
        .unwrap();
        c.rt.block_on(claims.create(&Default::default(), &object)).unwrap()
    };
    let phase_of = |name: &str| {
        c.rt.block_on(claims.get_opt(name))
            .unwrap()
            .and_then(|c| c.status?.phase)
            .unwrap_or_default()
    };

    // A claim is provisioned and bound by the cluster's own binder.
    let data = claim("data", "300Mi", None);
    let data_pv = format!("pvc-{}", data.metadata.uid.clone().unwrap());
    cleanup.images.push(data_pv.clone());
    c.wait("claim data to be Bound", || phase_of("data") == "Bound");
    assert_eq!(image_size(&dir, &data_pv), Some(300 << 20));
    assert!(
        event_reasons(&c, "default", "PersistentVolumeClaim", "data")
            .contains(&"ProvisioningSucceeded".to_string())
    );

    // It grows: the image, the PV, and the claim waits for its node.
    let grow =
        serde_json::json!({ "spec": { "resources": { "requests": { "storage": "400Mi" } } } });
    c.rt.block_on(claims.patch("data", &PatchParams::default(), &Patch::Merge(&grow))).unwrap();
    c.wait("the image to grow", || image_size(&dir, &data_pv) == Some(400 << 20));
    c.wait("the PV to take the size", || {
        let pv = c.rt.block_on(pvs.get(&data_pv)).unwrap();
        pv.spec.unwrap().capacity.unwrap()["storage"].0 == (400u64 << 20).to_string()
    });
    c.wait("the claim's filesystem to wait for its node", || {
        let claim = c.rt.block_on(claims.get("data")).unwrap();
        let conditions = claim.status.and_then(|s| s.conditions).unwrap_or_default();
        conditions.iter().any(|c| c.type_ == "FileSystemResizePending" && c.status == "True")
    });
    assert!(
        event_reasons(&c, "default", "PersistentVolumeClaim", "data")
            .contains(&"FileSystemResizeRequired".to_string())
    );

    // A growth the policy refuses (past 1 PiB): said once, not retried,
    // never in a loop woken by the controller's own writes; the image stays
    // as it was.
    let huge = claim("huge", "64Mi", None);
    let huge_pv = format!("pvc-{}", huge.metadata.uid.clone().unwrap());
    cleanup.images.push(huge_pv.clone());
    c.wait("claim huge to be Bound", || phase_of("huge") == "Bound");
    let too_much =
        serde_json::json!({ "spec": { "resources": { "requests": { "storage": "2Pi" } } } });
    c.rt.block_on(claims.patch("huge", &PatchParams::default(), &Patch::Merge(&too_much))).unwrap();
    let failures = || {
        event_reasons(&c, "default", "PersistentVolumeClaim", "huge")
            .iter()
            .filter(|r| *r == "VolumeResizeFailed")
            .count()
    };
    c.wait("the growth to fail", || failures() > 0);
    std::thread::sleep(std::time::Duration::from_secs(8));
    assert_eq!(failures(), 1, "a refused growth is tried once per size");
    let marked = c.rt.block_on(claims.get("huge")).unwrap();
    assert_eq!(
        marked.metadata.annotations.unwrap_or_default().get("volagent.io/resize-infeasible"),
        Some(&(2u64 << 50).to_string())
    );
    assert_eq!(image_size(&dir, &huge_pv), Some(64 << 20));
    c.rt.block_on(claims.delete("huge", &Default::default())).unwrap();

    // A VolumeSnapshot of it, on the default class: an RBD snapshot, its
    // content, ready.
    let snapshots: Api<VolumeSnapshot> = Api::namespaced(c.client(), "default");
    let snapshot = |name: &str, class: Option<&str>| {
        let mut spec = serde_json::json!({ "source": { "persistentVolumeClaimName": "data" } });
        if let Some(class) = class {
            spec["volumeSnapshotClassName"] = class.into();
        }
        let object: VolumeSnapshot = serde_json::from_value(serde_json::json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
            "metadata": { "name": name, "namespace": "default" }, "spec": spec,
        }))
        .unwrap();
        c.rt.block_on(snapshots.create(&Default::default(), &object)).unwrap()
    };
    let snap = snapshot("snap", None);
    let snap_uid = snap.metadata.uid.clone().unwrap();
    let mut ready = None;
    c.wait("the snapshot to be ready", || {
        ready = c.rt.block_on(snapshots.get("snap")).unwrap().status;
        ready.as_ref().is_some_and(|s| s.ready_to_use == Some(true))
    });
    let ready = ready.unwrap();
    let content_name = format!("snapcontent-{snap_uid}");
    assert_eq!(ready.bound_volume_snapshot_content_name.as_deref(), Some(content_name.as_str()));
    assert_eq!(ready.restore_size, Some(Value::from((400u64 << 20).to_string())));
    let contents: Api<VolumeSnapshotContent> = Api::all(c.client());
    let content = c.rt.block_on(contents.get(&content_name)).unwrap();
    let handle = content.status.clone().unwrap().snapshot_handle.unwrap();
    let rbd_snapshot = format!("snapshot-{snap_uid}");
    assert_eq!(handle, format!("ceph.rbd.{data_pv}.{rbd_snapshot}"));
    assert_eq!(content.spec.deletion_policy, "Delete");
    let listed = ceph::rbd(&dir, &["snap", "ls", &format!("rbd/{data_pv}")]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&rbd_snapshot), "{listed:?}");

    // A class that does not exist: the snapshot says so, nothing is made.
    snapshot("unclassed", Some("no-such-class"));
    c.wait("the snapshot's error", || {
        let status = c.rt.block_on(snapshots.get("unclassed")).unwrap().status;
        status.and_then(|s| s.error?.message).is_some_and(|m| m.contains("no-such-class"))
    });
    assert!(
        event_reasons(&c, "default", "VolumeSnapshot", "unclassed")
            .contains(&"SnapshotCreationFailed".to_string())
    );

    // Nothing was made for it.
    let unclassed = c.rt.block_on(snapshots.get("unclassed")).unwrap();
    let unclassed_content = format!("snapcontent-{}", unclassed.metadata.uid.unwrap());
    assert!(c.rt.block_on(contents.get_opt(&unclassed_content)).unwrap().is_none());

    // Another namespace's user cannot reach this volume: not by a claim
    // naming its PV (never bound to it), nor by a snapshot status pointing
    // at its content; nor is a filesystem snapshot restored as a block
    // claim.
    use k8s_openapi::api::core::v1::Namespace;
    let namespace: Namespace =
        serde_json::from_value(serde_json::json!({ "metadata": { "name": "other" } })).unwrap();
    c.rt.block_on(Api::<Namespace>::all(c.client()).create(&Default::default(), &namespace))
        .unwrap();
    let other_claims: Api<PersistentVolumeClaim> = Api::namespaced(c.client(), "other");
    let thief: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "thief", "namespace": "other" },
        "spec": { "storageClassName": "rbd-grow", "accessModes": ["ReadWriteOnce"],
                  "volumeName": data_pv, "resources": { "requests": { "storage": "400Mi" } } },
    }))
    .unwrap();
    c.rt.block_on(other_claims.create(&Default::default(), &thief)).unwrap();
    let other_snapshots: Api<VolumeSnapshot> = Api::namespaced(c.client(), "other");
    let steal: VolumeSnapshot = serde_json::from_value(serde_json::json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": { "name": "steal", "namespace": "other" },
        "spec": { "source": { "persistentVolumeClaimName": "thief" } },
    }))
    .unwrap();
    let steal = c.rt.block_on(other_snapshots.create(&Default::default(), &steal)).unwrap();
    let forged: VolumeSnapshot = serde_json::from_value(serde_json::json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": { "name": "forged", "namespace": "other" },
        "spec": { "source": { "persistentVolumeClaimName": "nothing" } },
    }))
    .unwrap();
    c.rt.block_on(other_snapshots.create(&Default::default(), &forged)).unwrap();
    let forge = serde_json::json!({ "status": {
        "boundVolumeSnapshotContentName": content_name, "readyToUse": true } });
    c.rt.block_on(other_snapshots.patch_status(
        "forged",
        &Default::default(),
        &Patch::Merge(&forge),
    ))
    .unwrap();
    let loot: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "loot", "namespace": "other" },
        "spec": { "storageClassName": "rbd-grow", "accessModes": ["ReadWriteOnce"],
                  "dataSource": { "apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "forged" },
                  "resources": { "requests": { "storage": "400Mi" } } },
    }))
    .unwrap();
    let loot = c.rt.block_on(other_claims.create(&Default::default(), &loot)).unwrap();
    let raw: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "raw", "namespace": "default" },
        "spec": { "storageClassName": "rbd-grow", "accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                  "dataSource": { "apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap" },
                  "resources": { "requests": { "storage": "400Mi" } } },
    }))
    .unwrap();
    let raw = c.rt.block_on(claims.create(&Default::default(), &raw)).unwrap();
    let refused = |ns: &str, claim: &str, words: &str| {
        use k8s_openapi::api::core::v1::Event;
        let events: Api<Event> = Api::namespaced(c.client(), ns);
        c.rt.block_on(events.list(&Default::default())).unwrap().items.into_iter().any(|e| {
            e.involved_object.name.as_deref() == Some(claim)
                && e.reason.as_deref() == Some("ProvisioningFailed")
                && e.message.unwrap_or_default().contains(words)
        })
    };
    c.wait("the forged snapshot refused", || refused("other", "loot", "not bound to it"));
    c.wait("the change of volume mode refused", || {
        refused("default", "raw", "allow-volume-mode-change")
    });
    // The stolen snapshot waits (its claim never binds), past a retry.
    std::thread::sleep(std::time::Duration::from_secs(7));
    let steal_content = format!("snapcontent-{}", steal.metadata.uid.unwrap());
    assert!(c.rt.block_on(contents.get_opt(&steal_content)).unwrap().is_none());
    let steal_now = c.rt.block_on(other_snapshots.get("steal")).unwrap();
    assert_ne!(steal_now.status.and_then(|s| s.ready_to_use), Some(true));
    for claim in [&loot, &raw] {
        let pv = format!("pvc-{}", claim.metadata.uid.clone().unwrap());
        assert!(c.rt.block_on(pvs.get_opt(&pv)).unwrap().is_none(), "{pv} was made");
        assert!(image_size(&dir, &pv).is_none(), "image {pv} was made");
    }
    let listed = ceph::rbd(&dir, &["snap", "ls", &format!("rbd/{data_pv}")]);
    assert_eq!(
        String::from_utf8_lossy(&listed.stdout).matches("snapshot-").count(),
        1,
        "only the one snapshot: {listed:?}"
    );
    c.rt.block_on(other_claims.delete("loot", &Default::default())).unwrap();
    c.rt.block_on(claims.delete("raw", &Default::default())).unwrap();
    for name in ["steal", "forged"] {
        c.rt.block_on(other_snapshots.delete(name, &Default::default())).unwrap();
    }

    // A claim from the snapshot: a clone of exactly that snapshot.
    let source = serde_json::json!({
        "apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap",
    });
    let restored = claim("restored", "400Mi", Some(source));
    let restored_pv = format!("pvc-{}", restored.metadata.uid.clone().unwrap());
    cleanup.images.push(restored_pv.clone());
    c.wait("claim restored to be Bound", || phase_of("restored") == "Bound");
    let info = image_info(&dir, &restored_pv).unwrap();
    assert_eq!(info["parent"]["image"], data_pv.as_str(), "{info}");
    assert_eq!(info["parent"]["snapshot"], rbd_snapshot.as_str(), "{info}");

    // Deleting the VolumeSnapshot deletes its content and the RBD snapshot
    // (kept in the trash while its clone lives).
    c.rt.block_on(snapshots.delete("snap", &Default::default())).unwrap();
    c.wait("the snapshot and its content to go", || {
        c.rt.block_on(snapshots.get_opt("snap")).unwrap().is_none()
            && c.rt.block_on(contents.get_opt(&content_name)).unwrap().is_none()
    });
    let listed = ceph::rbd(&dir, &["snap", "ls", &format!("rbd/{data_pv}")]);
    assert!(!String::from_utf8_lossy(&listed.stdout).contains(&rbd_snapshot), "{listed:?}");

    // A claim deleted at once, while its create may be running: nothing
    // of it is left.
    let brief = claim("brief", "64Mi", None);
    let brief_pv = format!("pvc-{}", brief.metadata.uid.clone().unwrap());
    cleanup.images.push(brief_pv.clone());
    c.rt.block_on(claims.delete("brief", &Default::default())).unwrap();

    // Every claim goes: the binder releases their PVs, whose images the
    // controller removes (the clone first: its parent waits for it).
    c.rt.block_on(claims.delete("restored", &Default::default())).unwrap();
    c.rt.block_on(claims.delete("data", &Default::default())).unwrap();
    for image in [&restored_pv, &data_pv, &brief_pv, &huge_pv] {
        c.wait(&format!("image {image} to be removed"), || image_size(&dir, image).is_none());
        c.wait(&format!("PV {image} to go"), || {
            c.rt.block_on(pvs.get_opt(image)).unwrap().is_none()
        });
    }
    let records: Api<ProvisionRecord> = Api::all(c.client());
    c.wait("every provisioning record to go", || {
        c.rt.block_on(records.list(&Default::default())).unwrap().items.is_empty()
    });
}
