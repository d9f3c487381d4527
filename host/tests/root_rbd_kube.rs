//! rbd fencing at the storage layer, with agents of two nodes against a
//! real etcd + kube-apiserver and the run's single-node Ceph, each side
//! with the Ceph user docs/rbd.md gives it (nodes may not blocklist; the
//! controller may): a node that is deleted while its client still writes
//! (its agent gone, its helper, NBD client and mount still up: a
//! partitioned machine) is taken over only after the controller, asked by
//! the new node, blocklisted its Ceph client by the address its agent
//! recorded at attach (not while the controller cannot: its credentials
//! missing leave the volume with the old node); from then on its writes
//! fail with EIO while the new node's succeed. Needs root.
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
use volagent_test_support::{ceph, kube_objects, shipped};

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
    fn create_storage_cluster(&self, name: &str, secret: &str);
    fn create_fencing_secret(&self, name: &str);
    fn csi_stage_and_publish(&self, node: &str, pv: &str, attrs: &[(&str, &str)]) -> String;
    fn create_secret(&self, namespace: &str, name: &str, key: &str);
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

    /// A StorageCluster of rbd at the run's Ceph: the nodes' user (its key
    /// in Secret `secret` of the agents' namespace) and the controller's
    /// (its key in Secret `volagent-controller/<name>-fencing`).
    fn create_storage_cluster(&self, name: &str, secret: &str) {
        use volagent::kube::crds::{
            ControllerCredentials, SecretReference, StorageCluster, StorageClusterSpec,
        };
        let spec = StorageClusterSpec {
            backend: "rbd".into(),
            endpoints: vec!["127.0.0.1:6789".into()],
            secret_ref: Some(SecretReference {
                namespace: shipped::AGENT_NAMESPACE.into(),
                name: secret.into(),
            }),
            controller_credentials: Some(ControllerCredentials {
                user: "volagent-controller".into(),
                secret_ref: SecretReference {
                    namespace: shipped::CONTROLLER_NAMESPACE.into(),
                    name: format!("{name}-fencing"),
                },
            }),
            parameters: [
                ("user".to_string(), "volagent".to_string()),
                ("pool".to_string(), "rbd".to_string()),
            ]
            .into(),
        };
        let api: Api<StorageCluster> = Api::all(self.client());
        self.rt
            .block_on(api.create(&Default::default(), &StorageCluster::new(name, spec)))
            .unwrap();
    }

    /// The controller's key for StorageCluster `name`, where it looks for it.
    fn create_fencing_secret(&self, name: &str) {
        self.create_secret(
            shipped::CONTROLLER_NAMESPACE,
            &format!("{name}-fencing"),
            &ceph::controller_key(&ceph_dir()),
        );
    }

    /// NodeStage and NodePublish of CSI volume `pv` (attributes `attrs`, no
    /// secrets) on `node`, as kubelet makes them; the target.
    fn csi_stage_and_publish(&self, node: &str, pv: &str, attrs: &[(&str, &str)]) -> String {
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
                fs_type: "ext4".into(),
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

    fn create_secret(&self, namespace: &str, name: &str, key: &str) {
        use k8s_openapi::api::core::v1::Secret;
        let secret = Secret {
            metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
            data: Some(
                [("key".to_string(), k8s_openapi::ByteString(key.as_bytes().to_vec()))].into(),
            ),
            ..Default::default()
        };
        let api: Api<Secret> = Api::namespaced(self.client(), namespace);
        self.rt.block_on(api.create(&Default::default(), &secret)).unwrap();
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
    c.create_secret(shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    // The controller's key is not there yet: it cannot fence.
    c.create_storage_cluster("ceph", "ceph-volagent");
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
    c.create_fencing_secret("ceph");
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
    c.create_secret(shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    c.create_storage_cluster("ceph", "ceph-volagent");
    c.create_storage_cluster("ceph-unkeyed", "absent");
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
    c.create_secret(shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    c.create_storage_cluster("ceph", "ceph-volagent");
    c.create_fencing_secret("ceph");
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
