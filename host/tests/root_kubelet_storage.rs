//! rbd and gluster volumes under the kubelet tier: a real kubelet 1.20.2
//! and containerd on two nodes (volagent_test_support::kubelet_cluster) mount PVs of
//! `volagent/rbd` (whose `secretRef` kubelet resolves and passes on, as for
//! any Flexvolume driver) and `volagent/gluster`. The nodes live in a
//! network namespace of their own, so each test starts its own storage
//! there: a single-node Ceph (scripts/ceph-env, its dir in the scratch dir)
//! or GlusterFS (scripts/gluster-env, under a /run of its own); their fixed
//! ports are free in that namespace. Needs root and the kubelet tier's
//! assets; fails (never skips) without them.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use volagent_test_support::kubelet_cluster::*;
use volagent_test_support::{ceph, scratch};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// A single-node Ceph in the calling thread's network namespace, stopped
/// on drop.
struct Ceph {
    dir: PathBuf,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts").join(name)
}

fn ceph_env() -> PathBuf {
    script("ceph-env")
}

/// A single-node GlusterFS in the calling thread's network namespace
/// (glusterd's CLI socket in a /run of its own), stopped on drop.
struct Gluster {
    dir: PathBuf,
}

impl Gluster {
    fn start(dir: PathBuf) -> Gluster {
        let out = Command::new("unshare")
            .args([
                "-m",
                "bash",
                "-c",
                "mount --make-rprivate / && mount -t tmpfs tmpfs /run && exec bash \"$0\" start",
            ])
            .arg(script("gluster-env"))
            .env("VOLAGENT_GLUSTER_DIR", &dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/gluster-env start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Gluster { dir }
    }
}

impl Drop for Gluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script("gluster-env"))
            .arg("stop")
            .env("VOLAGENT_GLUSTER_DIR", &self.dir)
            .output();
    }
}

impl Ceph {
    fn start(dir: PathBuf) -> Ceph {
        let out = Command::new("bash")
            .arg(ceph_env())
            .arg("start")
            .env("VOLAGENT_CEPH_DIR", &dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/ceph-env start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ceph { dir }
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(ceph_env())
            .arg("stop")
            .env("VOLAGENT_CEPH_DIR", &self.dir)
            .output();
    }
}

/// PVC → PV (`volagent/rbd`, its Ceph key in a Secret kubelet reads) → a
/// pod on node-a writes and keeps the ReadWriteOnce image; a pod on
/// node-b waits, fenced, until it is gone, then reads what node-a wrote.
/// After the last pod, nothing is left: no mount, loop device, helper,
/// record, or watcher on the image.
#[test]
fn a_pod_writes_an_rbd_image_and_a_pod_on_the_other_node_reads_it_once_it_is_free() {
    let c = Cluster::start(
        VOLAGENT,
        &[("node-a", &[]), ("node-b", &[])],
        &[(volagent_test_artifacts::RBD, "rbd")],
    );
    let ceph = Ceph::start(c.scratch.path("ceph"));
    let image = ceph::Image::create(&ceph.dir, 64);
    let key = ceph::volagent_key(&ceph.dir);

    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": { "name": "ceph-volagent" },
        // kubelet hands a Flexvolume driver only a Secret of its own type.
        "type": "volagent/rbd",
        "stringData": { "key": key },
    }))
    .unwrap();
    c.rt.block_on(
        Api::<k8s_openapi::api::core::v1::Secret>::namespaced(c.client(), "default")
            .create(&PostParams::default(), &secret),
    )
    .unwrap();
    let pv: k8s_openapi::api::core::v1::PersistentVolume = serde_json::from_value(json!({
        "metadata": { "name": "img" },
        "spec": {
            "capacity": { "storage": "64Mi" },
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "flexVolume": {
                "driver": "volagent/rbd",
                "fsType": "ext4",
                "secretRef": { "name": "ceph-volagent", "namespace": "default" },
                "options": { "monitors": "127.0.0.1:6789", "pool": "rbd", "image": image.name, "user": "volagent" },
            },
        }
    }))
    .unwrap();
    c.rt.block_on(
        Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(c.client())
            .create(&PostParams::default(), &pv),
    )
    .unwrap();
    let claim_of: k8s_openapi::api::core::v1::PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": { "name": "img-claim" },
        "spec": { "accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": "img", "resources": { "requests": { "storage": "64Mi" } } }
    }))
    .unwrap();
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(c.client(), "default");
    c.rt.block_on(claims.create(&PostParams::default(), &claim_of)).unwrap();
    let start = std::time::Instant::now();
    while c.rt.block_on(claims.get("img-claim")).ok().and_then(|c| c.status?.phase).as_deref()
        != Some("Bound")
    {
        assert!(start.elapsed() < Duration::from_secs(60), "the claim of PV img did not bind");
        std::thread::sleep(Duration::from_millis(200));
    }

    let vol = || [("data", claim("img"))];
    c.create_pod(pod_with(
        "writer",
        "node-a",
        &serve("echo from-node-a > /data/note"),
        &vol(),
        Some("test -s /data/note"),
        "Never",
    ));
    c.wait_pod("writer", "Ready", is_ready);
    assert_eq!(ceph::watchers(&image).len(), 1, "node-a's helper holds the image");
    let rec = c.record("img").expect("record");
    assert_eq!(
        rec.spec.storage_clients.iter().map(|s| s.node.as_str()).collect::<Vec<_>>(),
        ["node-a"]
    );

    c.create_pod(pod_with(
        "reader",
        "node-b",
        &serve("cat /data/note > /dev/termination-log"),
        &vol(),
        Some("test -s /data/note"),
        "Never",
    ));
    let said = c.wait_event(
        "reader",
        "VolumeFenced",
        &["volume img (ReadWriteOnce) is in use by pod default/writer", "on node node-a"],
    );
    assert!(said.starts_with("volagent on node-b"), "{said}");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(waiting_reason(c.pod("reader").as_ref()).as_deref(), Some("ContainerCreating"));

    c.delete_pod("writer");
    c.wait_pod("reader", "Ready once the writer is gone (and seeing its note)", is_ready);
    let rec = c.record("img").expect("record");
    assert_eq!(rec.spec.consumers.iter().map(|h| h.node.as_str()).collect::<Vec<_>>(), ["node-b"]);
    c.delete_pod("reader");

    // Everything comes down with the last pod.
    let start = std::time::Instant::now();
    while (c.record("img").is_some()
        || !ceph::watchers(&image).is_empty()
        || !c.scratch.loops_left().is_empty())
        && start.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(c.record("img").is_none(), "the record is left");
    assert_eq!(
        ceph::watchers(&image).len(),
        0,
        "a helper is left on the image\n{}",
        tail(&c.node("node-b").agent_log())
    );
    assert!(c.scratch.loops_left().is_empty(), "loop devices left: {:?}", c.scratch.loops());
    for node in ["node-a", "node-b"] {
        let root = c.node(node).kubelet_root();
        let left: Vec<PathBuf> = c
            .mounts_below(&root)
            .into_iter()
            .filter(|m| {
                m.strip_prefix(&root).is_ok_and(|rel| rel.to_string_lossy().contains("volagent"))
            })
            .collect();
        assert!(left.is_empty(), "volume mounts left on {node}: {left:?}");
    }
}

/// Two pods on two nodes mount one gluster volume (ReadWriteMany) and each
/// sees what the other wrote; after them nothing is left: no mount, no
/// FUSE client, no record.
#[test]
fn pods_on_two_nodes_share_a_gluster_volume() {
    let c = Cluster::start(
        VOLAGENT,
        &[("node-a", &[]), ("node-b", &[])],
        &[(volagent_test_artifacts::GLUSTER, "gluster")],
    );
    let _gluster = Gluster::start(c.scratch.path("gluster"));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    c.create_volume("shared", "gluster", "ReadWriteMany", &[("servers", &host), ("volume", "v0")]);
    let both = "test -f /data/from-node-a && test -f /data/from-node-b";
    for node in ["node-a", "node-b"] {
        let script = serve(&format!("echo {node} > /data/from-{node}"));
        c.create_pod(pod_with(
            &format!("on-{node}"),
            node,
            &script,
            &[("data", claim("shared"))],
            Some(both),
            "Never",
        ));
    }
    c.wait_pod("on-node-a", "Ready (it sees node-b's file)", is_ready);
    c.wait_pod("on-node-b", "Ready (it sees node-a's file)", is_ready);
    let rec = c.record("shared").expect("record");
    let mut nodes: Vec<&str> = rec.spec.consumers.iter().map(|h| h.node.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["node-a", "node-b"]);

    c.delete_pod("on-node-a");
    c.delete_pod("on-node-b");
    let clients = || {
        scratch::processes_under(&c.scratch.path(""), |a| {
            a.first().is_some_and(|p| p.ends_with("glusterfs"))
        })
        .len()
    };
    let start = std::time::Instant::now();
    while (c.record("shared").is_some() || clients() > 0)
        && start.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(c.record("shared").is_none(), "the record is left");
    assert_eq!(clients(), 0, "a FUSE client is left");
    for node in ["node-a", "node-b"] {
        let root = c.node(node).kubelet_root();
        let left: Vec<PathBuf> = c
            .mounts_below(&root)
            .into_iter()
            .filter(|m| {
                m.strip_prefix(&root).is_ok_and(|rel| rel.to_string_lossy().contains("volagent"))
            })
            .collect();
        assert!(left.is_empty(), "volume mounts left on {node}: {left:?}");
    }
}

/// Dynamic provisioning under a real kubelet, with no sidecar: a claim on
/// a volagent rbd class gets an image and a bound PV from the controller
/// (its policy deciding, its own Ceph user making it); a pod on node-a
/// writes to it through the agent's CSI driver (librbd behind the agent's
/// NBD helper and its FUSE client: this kernel has no rbd or nbd driver)
/// and, while it runs, the claim is grown: the image, then kubelet's
/// NodeExpandVolume grow the mounted xfs, and the pod writes more than
/// the old size held. A VolumeSnapshot of it is restored into a second
/// claim, which a pod on node-b reads the note from; deleted, everything
/// goes — snapshot, images, PVs. Prints how long a claim takes to be Bound
/// and the growth to be seen in the pod. (xfs: ext4 grows online only
/// with CAP_SYS_RESOURCE, which this machine's root lacks.)
#[test]
fn a_dynamic_rbd_claim_serves_a_pod_and_its_snapshot_restores_for_a_pod_on_another_node() {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
    use volagent::kube::snapshot_crds::{VolumeSnapshot, VolumeSnapshotClass};
    use volagent_test_support::{ceph_cluster, shipped};
    let mut c = Cluster::start(
        VOLAGENT,
        &[("node-a", &[]), ("node-b", &[])],
        &[(volagent_test_artifacts::RBD, "rbd")],
    );
    let ceph = Ceph::start(c.scratch.path("ceph"));
    let client = c.client();
    // The admin's part: the driver object, the cluster's users, the
    // snapshot API; then the controller with the image's policies.
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/csidrivers.yaml"),
    )
    .unwrap();
    let drivers: Vec<CSIDriver> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let rbd_driver =
        drivers.iter().find(|d| d.metadata.name.as_deref() == Some("rbd.csi.volagent.io")).unwrap();
    c.rt.block_on(Api::<CSIDriver>::all(client.clone()).create(&PostParams::default(), rbd_driver))
        .unwrap();
    let key = ceph::volagent_key(&ceph.dir);
    ceph_cluster::create_secret_in(&c.rt, &client, shipped::AGENT_NAMESPACE, "ceph-volagent", &key);
    let controller_key = ceph::controller_key(&ceph.dir);
    let fencing = "ceph-fencing";
    ceph_cluster::create_secret_in(
        &c.rt,
        &client,
        shipped::CONTROLLER_NAMESPACE,
        fencing,
        &controller_key,
    );
    ceph_cluster::create_storage_cluster_in(&c.rt, &client, "ceph", "ceph-volagent");
    ceph_cluster::install_snapshot_crds_in(&c.rt, &client);
    c.start_provisioning_controller();
    let class: StorageClass = serde_json::from_value(json!({
        "metadata": { "name": "rbd-dynamic" },
        "provisioner": "rbd.csi.volagent.io",
        "parameters": { "storageCluster": "ceph", "csi.storage.k8s.io/fstype": "xfs" },
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
        "allowVolumeExpansion": true,
    }))
    .unwrap();
    c.rt.block_on(Api::<StorageClass>::all(client.clone()).create(&PostParams::default(), &class))
        .unwrap();
    let snapshot_class: VolumeSnapshotClass = serde_json::from_value(json!({
        "metadata": { "name": "rbd",
                      "annotations": { "snapshot.storage.k8s.io/is-default-class": "true" } },
        "driver": "rbd.csi.volagent.io",
        "deletionPolicy": "Delete",
    }))
    .unwrap();
    c.rt.block_on(
        Api::<VolumeSnapshotClass>::all(client.clone())
            .create(&PostParams::default(), &snapshot_class),
    )
    .unwrap();

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    // xfs needs 300 MB at least.
    let new_claim = |name: &str, size: &str, source: Option<serde_json::Value>| {
        let mut spec = json!({
            "storageClassName": "rbd-dynamic",
            "accessModes": ["ReadWriteOnce"],
            "resources": { "requests": { "storage": size } },
        });
        if let Some(source) = source {
            spec["dataSource"] = source;
        }
        let object: PersistentVolumeClaim =
            serde_json::from_value(json!({ "metadata": { "name": name }, "spec": spec })).unwrap();
        c.rt.block_on(claims.create(&PostParams::default(), &object)).unwrap();
        let asked = std::time::Instant::now();
        while c.rt.block_on(claims.get(name)).ok().and_then(|c| c.status?.phase).as_deref()
            != Some("Bound")
        {
            assert!(
                asked.elapsed() < Duration::from_secs(60),
                "claim {name} was not Bound\n{}",
                tail(&c.scratch.path("controller.log"))
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        asked.elapsed()
    };
    let bound_in = new_claim("data", "320Mi", None);
    println!("claim → Bound (image made, PV made, bound by the PV binder): {bound_in:?}");
    let volume = |claim: &str| json!({ "persistentVolumeClaim": { "claimName": claim } });
    // The writer notes the time and its filesystem's size, says it is
    // ready, waits (at most 120 s) for the filesystem to grow by more than
    // 100 MiB, then writes 320 MiB — more than the old filesystem held —
    // and syncs.
    c.create_pod(pod_with(
        "writer",
        "node-a",
        "size() { df -m /data | awk 'NR==2 {print $2}'; } && \
         date +%s%N > /data/note && sync && old=$(size) && touch /tmp/ready && \
         i=0; while [ $(size) -le $((old + 100)) ]; do \
           i=$((i+1)); [ $i -gt 1200 ] && exit 3; sleep 0.1; done && \
         dd if=/dev/zero of=/data/more bs=1M count=320 conv=fsync 2>/dev/null && \
         cat /data/note > /dev/termination-log",
        &[("data", volume("data"))],
        Some("test -e /tmp/ready"),
        "Never",
    ));
    c.wait_pod("writer", "Ready", is_ready);
    let grown_at = std::time::Instant::now();
    let grow = json!({ "spec": { "resources": { "requests": { "storage": "512Mi" } } } });
    c.rt.block_on(claims.patch("data", &PatchParams::default(), &Patch::Merge(&grow))).unwrap();
    let done =
        c.wait_pod("writer", "Succeeded", |p| matches!(phase(p).as_str(), "Succeeded" | "Failed"));
    assert_eq!(
        phase(done.as_ref()),
        "Succeeded",
        "the writer did not see its volume grow\n{}\n{}",
        tail(&c.scratch.path("controller.log")),
        tail(&c.node("node-a").agent_log())
    );
    println!("claim grown → the pod wrote past the old size: {:?}", grown_at.elapsed());
    let written = output(done.as_ref()).expect("the writer's output");
    assert!(written.trim().len() > 10, "{written:?}");
    // kubelet records the growth on the claim once the node grew it.
    let asked = std::time::Instant::now();
    loop {
        let claim = c.rt.block_on(claims.get("data")).unwrap();
        let status = claim.status.unwrap_or_default();
        let capacity = status.capacity.unwrap_or_default().get("storage").map(|q| q.0.clone());
        let pending = status.conditions.unwrap_or_default().iter().any(|c| c.status == "True");
        if matches!(capacity.as_deref(), Some("512Mi" | "536870912")) && !pending {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "the claim says {capacity:?}, conditions pending: {pending}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    c.delete_pod("writer");

    // The snapshot, once the writer's node let go of the volume.
    let snapshots: Api<VolumeSnapshot> = Api::namespaced(client.clone(), "default");
    let snapshot: VolumeSnapshot = serde_json::from_value(json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": { "name": "snap" },
        "spec": { "source": { "persistentVolumeClaimName": "data" } },
    }))
    .unwrap();
    c.rt.block_on(snapshots.create(&PostParams::default(), &snapshot)).unwrap();
    let asked = std::time::Instant::now();
    while c.rt.block_on(snapshots.get("snap")).unwrap().status.and_then(|s| s.ready_to_use)
        != Some(true)
    {
        assert!(
            asked.elapsed() < Duration::from_secs(60),
            "the snapshot was not ready\n{}",
            tail(&c.scratch.path("controller.log"))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let source =
        json!({ "apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap" });
    new_claim("restored", "512Mi", Some(source));
    c.create_pod(pod(
        "reader",
        "node-b",
        "cat /data/note > /dev/termination-log",
        &[("data", volume("restored"))],
    ));
    let read = c.wait_pod("reader", "Succeeded", |p| phase(p) == "Succeeded");
    assert_eq!(
        output(read.as_ref()).unwrap().trim(),
        written.trim(),
        "the restored claim holds what the first pod wrote"
    );
    c.delete_pod("reader");

    // Everything goes: the snapshot, then both claims, their PVs and images.
    c.rt.block_on(snapshots.delete("snap", &Default::default())).unwrap();
    c.rt.block_on(claims.delete("restored", &Default::default())).unwrap();
    c.rt.block_on(claims.delete("data", &Default::default())).unwrap();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let images = || {
        let out = ceph::rbd(&ceph.dir, &["ls", "rbd"]);
        String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect::<Vec<_>>()
    };
    let asked = std::time::Instant::now();
    loop {
        let left_pvs = c.rt.block_on(pvs.list(&Default::default())).unwrap().items.len();
        let left_images: Vec<String> =
            images().into_iter().filter(|i| i.starts_with("pvc-")).collect();
        let left_snapshot = c.rt.block_on(snapshots.get_opt("snap")).unwrap().is_some();
        if left_pvs == 0 && left_images.is_empty() && !left_snapshot {
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(90),
            "left: {left_pvs} PVs, images {left_images:?}, snapshot {left_snapshot}\n{}",
            tail(&c.scratch.path("controller.log"))
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let contents: Api<volagent::kube::snapshot_crds::VolumeSnapshotContent> =
        Api::all(client.clone());
    let records: Api<volagent::kube::crds::ProvisionRecord> = Api::all(client.clone());
    let asked = std::time::Instant::now();
    while !c.rt.block_on(contents.list(&Default::default())).unwrap().items.is_empty()
        || !c.rt.block_on(records.list(&Default::default())).unwrap().items.is_empty()
    {
        assert!(asked.elapsed() < Duration::from_secs(30), "contents or records left");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(c.scratch.loops_left().is_empty(), "loop devices left: {:?}", c.scratch.loops());
}
