//! The CSI drivers as kubelet calls them: the real `volagent agent` binary
//! serving the built local-pv component, reached over its CSI socket with
//! a gRPC client, on real loop devices and mounts. Every RPC's success,
//! idempotency and error codes; fencing across two nodes; registration;
//! a restart in between. Needs root.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tonic::Code;
use volagent::csi::proto::csi::identity_client::IdentityClient;
use volagent::csi::proto::csi::node_client::NodeClient;
use volagent::csi::proto::csi::volume_capability::{
    AccessMode, AccessType, MountVolume, access_mode::Mode,
};
use volagent::csi::proto::csi::*;
use volagent::csi::proto::registration::registration_client::RegistrationClient;
use volagent::csi::proto::registration::{InfoRequest, RegistrationStatus};
use volagent_test_support::agent::Node;
use volagent_test_support::policy;
use volagent_test_support::wait_until;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

fn kubelet_root(node: &Node, name: &str) -> PathBuf {
    node.scratch.path(&format!("{name}/kubelet"))
}

fn wait_for(path: &Path) {
    wait_until(Duration::from_secs(30), &format!("{} to appear", path.display()), || path.exists());
}

/// The node client of `backend`'s driver on node `name`.
async fn node_client(
    node: &Node,
    name: &str,
    backend: &str,
) -> NodeClient<tonic::transport::Channel> {
    let socket = volagent::csi::drivers::socket_path(&kubelet_root(node, name), backend);
    wait_for(&socket);
    NodeClient::new(volagent::csi::client::connect(socket).await.expect("connect to the driver"))
}

fn capability(mode: Mode, fs: &str) -> Option<VolumeCapability> {
    Some(VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    })
}

/// kubelet's staging path of volume `id` (as kubelet 1.20 names it), made.
fn staging(node: &Node, id: &str) -> String {
    let p =
        kubelet_root(node, "node-a").join(format!("plugins/kubernetes.io/csi/pv/{id}/globalmount"));
    std::fs::create_dir_all(&p).expect("kubelet makes the staging dir");
    p.display().to_string()
}

/// kubelet's target path of volume `id` in pod `uid`; its parent made (the
/// driver makes the target).
fn target(node: &Node, uid: &str, id: &str) -> String {
    let p = kubelet_root(node, "node-a")
        .join(format!("pods/{uid}/volumes/kubernetes.io~csi/{id}/mount"));
    std::fs::create_dir_all(p.parent().expect("parent"))
        .expect("kubelet makes the target's parent");
    p.display().to_string()
}

fn stage_request(id: &str, staging: &str, image: &str, mode: Mode) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.into(),
        volume_capability: capability(mode, "ext4"),
        volume_context: HashMap::from([
            ("path".to_string(), image.to_string()),
            ("node".to_string(), "node-a".to_string()),
        ]),
        ..Default::default()
    }
}

fn publish_request(
    id: &str,
    staging: &str,
    target: &str,
    mode: Mode,
    pod: &str,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.into(),
        target_path: target.into(),
        volume_capability: capability(mode, "ext4"),
        volume_context: HashMap::from([
            ("csi.storage.k8s.io/pod.name".to_string(), pod.to_string()),
            ("csi.storage.k8s.io/pod.namespace".to_string(), "default".to_string()),
        ]),
        ..Default::default()
    }
}

fn unstage(id: &str, staging: &str) -> NodeUnstageVolumeRequest {
    NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging.into() }
}

fn unpublish(id: &str, target: &str) -> NodeUnpublishVolumeRequest {
    NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.into() }
}

#[track_caller]
fn assert_code<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
    code: Code,
    says: &str,
) {
    match r {
        Err(s) => {
            assert_eq!(s.code(), code, "{s:?}");
            assert!(s.message().contains(says), "{:?} does not say {says:?}", s.message());
        }
        Ok(r) => panic!("expected {code:?}, got {r:?}"),
    }
}

#[test]
fn identity_registration_and_node_info() {
    let node = Node::start(VOLAGENT);
    rt().block_on(async {
        let socket =
            volagent::csi::drivers::socket_path(&kubelet_root(&node, "node-a"), "local-pv");
        wait_for(&socket);
        let channel = volagent::csi::client::connect(socket.clone()).await.expect("connect");
        let mut identity = IdentityClient::new(channel.clone());
        let info = identity
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .expect("GetPluginInfo")
            .into_inner();
        assert_eq!(info.name, "local-pv.csi.volagent.io");
        assert_eq!(info.manifest["backend"], "local-pv");
        assert_eq!(info.manifest["policy-sha256"].len(), 64);
        assert_eq!(
            identity.probe(ProbeRequest {}).await.expect("Probe").into_inner().ready,
            Some(true)
        );
        assert!(
            identity
                .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
                .await
                .expect("caps")
                .into_inner()
                .capabilities
                .is_empty(),
            "no controller service"
        );

        let mut node_rpc = NodeClient::new(channel);
        let caps = node_rpc
            .node_get_capabilities(NodeGetCapabilitiesRequest {})
            .await
            .expect("caps")
            .into_inner();
        let kinds: Vec<i32> = caps
            .capabilities
            .iter()
            .filter_map(|c| c.r#type.as_ref().map(|node_service_capability::Type::Rpc(r)| r.r#type))
            .collect();
        use node_service_capability::rpc::Type;
        for want in [
            Type::StageUnstageVolume,
            Type::GetVolumeStats,
            Type::ExpandVolume,
            Type::VolumeCondition,
            Type::SingleNodeMultiWriter,
        ] {
            assert!(kinds.contains(&(want as i32)), "{want:?} missing from {kinds:?}");
        }
        let info =
            node_rpc.node_get_info(NodeGetInfoRequest {}).await.expect("NodeGetInfo").into_inner();
        assert_eq!(info.node_id, "node-a");
        assert_eq!(
            info.accessible_topology.expect("topology").segments["topology.volagent.io/node"],
            "node-a"
        );

        // kubelet's plugin watcher: what the registration socket says.
        let reg_socket =
            volagent::csi::drivers::registration_path(&kubelet_root(&node, "node-a"), "local-pv");
        wait_for(&reg_socket);
        let mut reg = RegistrationClient::new(
            volagent::csi::client::connect(reg_socket).await.expect("connect"),
        );
        let info = reg.get_info(InfoRequest {}).await.expect("GetInfo").into_inner();
        assert_eq!(
            (info.r#type.as_str(), info.name.as_str()),
            ("CSIPlugin", "local-pv.csi.volagent.io")
        );
        assert_eq!(Path::new(&info.endpoint), socket, "the endpoint kubelet dials");
        assert_eq!(info.supported_versions, ["1.0.0"]);
        reg.notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "test says no".into(),
        })
        .await
        .expect("notify");
        // Every backend is a driver of its own.
        let other =
            volagent::csi::drivers::socket_path(&kubelet_root(&node, "node-a"), "shared-file");
        wait_for(&other);
    });
    // `volagent status` lists the drivers and what kubelet said.
    let out = std::process::Command::new(VOLAGENT)
        .args(["status", "--json", "--socket"])
        .arg(&node.socket)
        .output()
        .expect("status");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let drivers = v["csi"]["drivers"].as_array().expect("drivers");
    let local = drivers
        .iter()
        .find(|d| d["name"] == "local-pv.csi.volagent.io")
        .expect("local-pv's driver");
    assert_eq!(local["registration"], "refused: test says no", "{v}");
    assert!(drivers.iter().any(|d| d["name"] == "shared-file.csi.volagent.io"), "{v}");
    let log = std::fs::read_to_string(node.log_path("node-a")).expect("log");
    assert!(
        log.contains("kubelet did not register the CSI driver") && log.contains("test says no"),
        "{log}"
    );
}

#[test]
fn stage_publish_write_unpublish_unstage_and_back() {
    let node = Node::start(VOLAGENT);
    let image = node.image("csi1.img", 64);
    let (st, ta, tb) =
        (staging(&node, "pv1"), target(&node, "uid-a", "pv1"), target(&node, "uid-b", "pv1"));
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        let stage = stage_request("pv1", &st, &image, Mode::SingleNodeWriter);
        c.node_stage_volume(stage.clone()).await.expect("stage");
        c.node_stage_volume(stage.clone()).await.expect("stage again: idempotent");
        // Staged right at kubelet's staging path and nowhere else: kubelet
        // refuses to unstage a device that is mounted elsewhere too.
        assert_eq!(node.scratch.mounts(), [PathBuf::from(&st)]);
        let pa = publish_request("pv1", &st, &ta, Mode::SingleNodeWriter, "pod-a");
        c.node_publish_volume(pa.clone()).await.expect("publish");
        c.node_publish_volume(pa.clone()).await.expect("publish again: idempotent");
        std::fs::write(format!("{ta}/data"), b"through CSI").expect("write");
        // A second pod on the node shares a ReadWriteOnce volume.
        c.node_publish_volume(publish_request("pv1", &st, &tb, Mode::SingleNodeWriter, "pod-b"))
            .await
            .expect("second pod");
        assert_eq!(std::fs::read(format!("{tb}/data")).expect("read"), b"through CSI");
        // Read-only where asked.
        let tr = target(&node, "uid-r", "pv1");
        let mut ro = publish_request("pv1", &st, &tr, Mode::SingleNodeWriter, "pod-r");
        ro.readonly = true;
        c.node_publish_volume(ro).await.expect("read-only publish");
        let out = std::process::Command::new(VOLAGENT)
            .args(["status", "--socket"])
            .arg(&node.socket)
            .output()
            .expect("status");
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(
            table.contains("CSI publications: 3")
                && table.contains("default/pod-r")
                && table.contains(&tr),
            "{table}"
        );
        assert!(
            table.contains("csi/staged") && table.contains("/dev/loop"),
            "the stage is listed with its device:\n{table}"
        );
        assert!(
            std::fs::write(format!("{tr}/x"), b"no").is_err(),
            "a read-only publication is read-only"
        );
        c.node_unpublish_volume(unpublish("pv1", &tr)).await.expect("unpublish ro");

        let stats = c
            .node_get_volume_stats(NodeGetVolumeStatsRequest {
                volume_id: "pv1".into(),
                volume_path: ta.clone(),
                ..Default::default()
            })
            .await
            .expect("stats")
            .into_inner();
        let bytes =
            stats.usage.iter().find(|u| u.unit == volume_usage::Unit::Bytes as i32).expect("bytes");
        let inodes = stats
            .usage
            .iter()
            .find(|u| u.unit == volume_usage::Unit::Inodes as i32)
            .expect("inodes");
        assert!(
            bytes.total > 50 << 20
                && bytes.total <= 64 << 20
                && bytes.used > 0
                && bytes.available > 0,
            "{bytes:?}"
        );
        assert!(inodes.total > 0 && inodes.used > 0, "{inodes:?}");
        assert!(!stats.volume_condition.expect("condition").abnormal);
        // Unstage while published is refused; nothing changes.
        assert_code(
            c.node_unstage_volume(unstage("pv1", &st)).await,
            Code::FailedPrecondition,
            "still published",
        );
        assert_eq!(std::fs::read(format!("{ta}/data")).expect("still there"), b"through CSI");

        for t in [&ta, &tb] {
            c.node_unpublish_volume(unpublish("pv1", t)).await.expect("unpublish");
            c.node_unpublish_volume(unpublish("pv1", t))
                .await
                .expect("unpublish again: idempotent");
            assert!(!Path::new(t).exists(), "the driver removes the target it made: {t}");
        }
        c.node_unstage_volume(unstage("pv1", &st)).await.expect("unstage");
        c.node_unstage_volume(unstage("pv1", &st)).await.expect("unstage again: idempotent");
        assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
        assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());

        // Staged again: the data is the volume's.
        let st = staging(&node, "pv1");
        c.node_stage_volume(stage).await.expect("stage");
        let tc = target(&node, "uid-c", "pv1");
        c.node_publish_volume(publish_request("pv1", &st, &tc, Mode::SingleNodeWriter, "pod-c"))
            .await
            .expect("publish");
        assert_eq!(std::fs::read(format!("{tc}/data")).expect("read back"), b"through CSI");
        c.node_unpublish_volume(unpublish("pv1", &tc)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv1", &st)).await.expect("unstage");
    });
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

#[test]
fn error_codes_and_nothing_changes() {
    let node = Node::start(VOLAGENT);
    let image = node.image("csi2.img", 64);
    let st = staging(&node, "pv2");
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        let good = stage_request("pv2", &st, &image, Mode::SingleNodeSingleWriter);
        let mut r = good.clone();
        r.volume_id.clear();
        assert_code(c.node_stage_volume(r).await, Code::InvalidArgument, "volume_id is missing");
        let mut r = good.clone();
        r.staging_target_path.clear();
        assert_code(
            c.node_stage_volume(r).await,
            Code::InvalidArgument,
            "staging_target_path is missing",
        );
        let mut r = good.clone();
        r.volume_capability = None;
        assert_code(
            c.node_stage_volume(r).await,
            Code::InvalidArgument,
            "volume_capability is missing",
        );
        let mut r = good.clone();
        r.staging_target_path = "/etc".into();
        assert_code(
            c.node_stage_volume(r).await,
            Code::InvalidArgument,
            "not under kubelet's root",
        );
        let mut r = good.clone();
        r.staging_target_path = format!("{st}/../../../../../../../etc");
        assert_code(c.node_stage_volume(r).await, Code::InvalidArgument, "staging_target_path");
        let mut r = good.clone();
        r.volume_id = "../etc".into();
        assert_code(
            c.node_stage_volume(r).await,
            Code::InvalidArgument,
            "not a Kubernetes object name",
        );
        let mut r = good.clone();
        r.volume_context.insert("csi.storage.k8s.io/ephemeral".into(), "true".into());
        assert_code(c.node_stage_volume(r).await, Code::FailedPrecondition, "ephemeral");
        // The policy refuses a volume of another node (its fence), and a path outside the discovery dirs.
        let mut r = good.clone();
        r.volume_context.insert("node".into(), "node-b".into());
        assert_code(c.node_stage_volume(r).await, Code::FailedPrecondition, "lives on node node-b");
        let mut r = good.clone();
        r.volume_context.insert("path".into(), "/etc/shadow".into());
        assert!(c.node_stage_volume(r).await.is_err(), "a path outside the discovery dirs");
        assert!(
            node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty(),
            "refusals change nothing"
        );

        let (t1, t2) = (target(&node, "uid-1", "pv2"), target(&node, "uid-2", "pv2"));
        let p1 = publish_request("pv2", &st, &t1, Mode::SingleNodeSingleWriter, "one");
        assert_code(
            c.node_publish_volume(p1.clone()).await,
            Code::FailedPrecondition,
            "not staged",
        );
        let mut r = p1.clone();
        r.target_path.clear();
        assert_code(
            c.node_publish_volume(r).await,
            Code::InvalidArgument,
            "target_path is missing",
        );
        let mut r = p1.clone();
        r.volume_capability = None;
        assert_code(
            c.node_publish_volume(r).await,
            Code::InvalidArgument,
            "volume_capability is missing",
        );

        c.node_stage_volume(good.clone()).await.expect("stage");
        // The staging path is pv2's: another volume or capability there is refused.
        let mut other = stage_request("pv3", &st, &image, Mode::SingleNodeWriter);
        assert_code(
            c.node_stage_volume(other.clone()).await,
            Code::AlreadyExists,
            "staging path of volume pv2",
        );
        other.volume_id = "pv2".into();
        assert_code(c.node_stage_volume(other).await, Code::AlreadyExists, "another capability");

        c.node_publish_volume(p1.clone()).await.expect("publish");
        // ReadWriteOncePod: one pod.
        assert_code(
            c.node_publish_volume(publish_request(
                "pv2",
                &st,
                &t2,
                Mode::SingleNodeSingleWriter,
                "two",
            ))
            .await,
            Code::FailedPrecondition,
            "by pod default/one",
        );
        assert!(!Path::new(&t2).exists(), "the refused target was not made");
        // The same target with another volume or read-only-ness.
        let mut ro = p1.clone();
        ro.readonly = true;
        assert_code(c.node_publish_volume(ro).await, Code::AlreadyExists, "already published");
        assert_code(
            c.node_unpublish_volume(unpublish("pv9", &t1)).await,
            Code::NotFound,
            "publishes volume pv2",
        );

        // Stats: missing fields, unknown volumes and paths.
        let stats = |id: &str, path: &str| NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        };
        assert_code(
            c.node_get_volume_stats(stats("", &t1)).await,
            Code::InvalidArgument,
            "volume_id is missing",
        );
        assert_code(
            c.node_get_volume_stats(stats("pv2", "")).await,
            Code::InvalidArgument,
            "volume_path is missing",
        );
        assert_code(
            c.node_get_volume_stats(stats("fake-vol-id", &t1)).await,
            Code::NotFound,
            "fake-vol-id",
        );
        assert_code(
            c.node_get_volume_stats(stats("Fake-Vol-ID", "some/path")).await,
            Code::NotFound,
            "",
        );
        assert_code(
            c.node_get_volume_stats(stats("pv2", &t2)).await,
            Code::NotFound,
            "neither staged nor published",
        );
        let expand = |id: &str, path: &str| NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        };
        assert_code(
            c.node_expand_volume(expand("", &t1)).await,
            Code::InvalidArgument,
            "volume_id is missing",
        );
        assert_code(
            c.node_expand_volume(expand("pv2", "")).await,
            Code::InvalidArgument,
            "volume_path is missing",
        );
        assert_code(
            c.node_expand_volume(expand("fake-vol-id", &t1)).await,
            Code::NotFound,
            "fake-vol-id",
        );
        let mut more = expand("pv2", &t1);
        more.capacity_range = Some(CapacityRange { required_bytes: 1 << 40, limit_bytes: 0 });
        assert_code(c.node_expand_volume(more).await, Code::OutOfRange, "has not grown enough");
        // A mount gone from under the driver is reported abnormal.
        nix::mount::umount2(t1.as_str(), nix::mount::MntFlags::MNT_DETACH)
            .expect("unmount behind the driver's back");
        let s = c.node_get_volume_stats(stats("pv2", &t1)).await.expect("stats").into_inner();
        let cond = s.volume_condition.expect("condition");
        assert!(cond.abnormal && cond.message.contains("not mounted"), "{cond:?}");
        // Its publication no longer counts: the target may be published anew (read-only now).
        let mut again = p1.clone();
        again.readonly = true;
        c.node_publish_volume(again).await.expect("a publication whose mount is gone is replaced");
        assert!(std::fs::write(format!("{t1}/x"), b"no").is_err(), "read-only this time");
        c.node_unpublish_volume(unpublish("pv2", &t1)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv2", &st)).await.expect("unstage");
    });
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// A ReadWriteOnce volume of a backend that may move between nodes (the
/// shared-file test guest), staged on node-a, is refused on node-b (the
/// backend's fence, through the shared ledger), then served there once
/// node-a let go.
#[test]
fn fencing_across_nodes() {
    let mut node = Node::start(VOLAGENT);
    node.spawn_agent("node-b");
    let image = node.image("csi3.img", 64);
    let st_a = staging(&node, "pv3");
    let st_b = kubelet_root(&node, "node-b").join("plugins/kubernetes.io/csi/pv/pv3/globalmount");
    std::fs::create_dir_all(&st_b).expect("dir");
    let st_b = st_b.display().to_string();
    rt().block_on(async {
        let mut a = node_client(&node, "node-a", "shared-file").await;
        let mut b = node_client(&node, "node-b", "shared-file").await;
        let mut on_a = stage_request("pv3", &st_a, &image, Mode::SingleNodeWriter);
        let mut on_b = stage_request("pv3", &st_b, &image, Mode::SingleNodeWriter);
        on_a.volume_context.remove("node");
        on_b.volume_context.remove("node");
        assert!(
            Command::new("mkfs.ext4").args(["-F", "-q", &image]).status().expect("mkfs").success()
        );
        a.node_stage_volume(on_a).await.expect("stage on node-a");
        assert_code(b.node_stage_volume(on_b.clone()).await, Code::FailedPrecondition, "node-a");
        a.node_unstage_volume(unstage("pv3", &st_a)).await.expect("unstage on node-a");
        b.node_stage_volume(on_b).await.expect("stage on node-b once node-a let go");
        b.node_unstage_volume(unstage("pv3", &st_b)).await.expect("unstage on node-b");
    });
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// A stage whose steps do not return (held here by the test hook after its
/// loop attach, as a dead local disk would hold them) keeps the CSI thread
/// that runs them. kubelet connects anew for every call: the next calls are
/// taken by the other thread, and another volume stages and unstages
/// meanwhile; the held stage then ends as it would have.
#[test]
fn a_stage_held_in_its_steps_leaves_the_next_calls_served() {
    let mut node = Node::start(VOLAGENT);
    node.stop_agent();
    node.spawn_agent_env(
        "node-a",
        &[(volagent::sys::faults::STALL_AFTER_STEP_ENV, "1:5000".to_string())],
        &[],
    );
    let (held_image, free_image) = (node.image("held.img", 64), node.image("free.img", 64));
    let (held_staging, free_staging) = (staging(&node, "pv-held"), staging(&node, "pv-free"));
    rt().block_on(async {
        let mut held_client = node_client(&node, "node-a", "local-pv").await;
        let started = Instant::now();
        let request = stage_request("pv-held", &held_staging, &held_image, Mode::SingleNodeWriter);
        let held = tokio::spawn(async move { held_client.node_stage_volume(request).await });
        // The held stage is in its stall once its device is attached.
        while node.scratch.loops_left().is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(4),
                "the held stage did not attach its device"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut next = node_client(&node, "node-a", "local-pv").await;
        next.node_stage_volume(stage_request(
            "pv-free",
            &free_staging,
            &free_image,
            Mode::SingleNodeWriter,
        ))
        .await
        .expect("stage beside the held one");
        assert!(node.scratch.mounts().contains(&PathBuf::from(&free_staging)));
        next.node_unstage_volume(unstage("pv-free", &free_staging))
            .await
            .expect("unstage beside the held one");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the next calls waited for the held stage: {:?}",
            started.elapsed()
        );
        held.await.expect("task").expect("the held stage ends as it would have");
        assert!(started.elapsed() >= Duration::from_secs(5), "the stage was held");
        assert_eq!(node.scratch.mounts(), [PathBuf::from(&held_staging)]);
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_unstage_volume(unstage("pv-held", &held_staging)).await.expect("unstage");
    });
    assert!(
        node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty(),
        "{:?} {:?}",
        node.scratch.mounts(),
        node.scratch.loops()
    );
}

/// The agent restarted (SIGKILL) with a volume staged and published: the
/// retried calls are answered from what it recorded, and it cleans up.
#[test]
fn a_restart_keeps_stages_and_publications() {
    let mut node = Node::start(VOLAGENT);
    let image = node.image("csi4.img", 64);
    let (st, ta) = (staging(&node, "pv4"), target(&node, "uid-a", "pv4"));
    let stage = stage_request("pv4", &st, &image, Mode::SingleNodeSingleWriter);
    let publish = publish_request("pv4", &st, &ta, Mode::SingleNodeSingleWriter, "a");
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_stage_volume(stage.clone()).await.expect("stage");
        c.node_publish_volume(publish.clone()).await.expect("publish");
        std::fs::write(format!("{ta}/data"), b"kept").expect("write");
    });
    let pid = node.pid_of("node-a");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)
        .expect("kill");
    node.stop_agent();
    node.spawn_agent("node-a");
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_stage_volume(stage).await.expect("stage retried after the restart");
        c.node_publish_volume(publish).await.expect("publish retried after the restart");
        // Still one pod: the publication outlived the restart.
        let t2 = target(&node, "uid-b", "pv4");
        assert_code(
            c.node_publish_volume(publish_request(
                "pv4",
                &st,
                &t2,
                Mode::SingleNodeSingleWriter,
                "b",
            ))
            .await,
            Code::FailedPrecondition,
            "ReadWriteOncePod",
        );
        assert_eq!(std::fs::read(format!("{ta}/data")).expect("read"), b"kept");
        c.node_unpublish_volume(unpublish("pv4", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv4", &st)).await.expect("unstage");
    });
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// A backend dropped into the plugin dir becomes a driver (its sockets
/// appear) with no restart; removed, its sockets go.
#[test]
fn a_hot_loaded_backend_is_a_driver_and_goes_with_its_file() {
    let node = Node::start(VOLAGENT);
    let root = kubelet_root(&node, "node-a");
    let (socket, reg) = (
        volagent::csi::drivers::socket_path(&root, "nbd"),
        volagent::csi::drivers::registration_path(&root, "nbd"),
    );
    assert!(!socket.exists());
    std::fs::copy(volagent_test_artifacts::NBD, node.scratch.path("plugins/.nbd.wasm"))
        .expect("copy");
    std::fs::rename(node.scratch.path("plugins/.nbd.wasm"), node.scratch.path("plugins/nbd.wasm"))
        .expect("install");
    wait_for(&socket);
    wait_for(&reg);
    rt().block_on(async {
        let channel = volagent::csi::client::connect(socket.clone()).await.expect("connect");
        let info = IdentityClient::new(channel)
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .expect("info")
            .into_inner();
        assert_eq!(info.name, "nbd.csi.volagent.io");
    });
    std::fs::remove_file(node.scratch.path("plugins/nbd.wasm")).expect("remove");
    let start = Instant::now();
    while reg.exists() || socket.exists() {
        assert!(start.elapsed() < Duration::from_secs(30), "the removed backend's sockets stayed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether this process may use CAP_SYS_RESOURCE, which ext4's online
/// resize needs (some sandboxes withhold it even from root).
fn has_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).expect("hex"))
        .expect("CapEff");
    eff >> 24 & 1 == 1
}

/// The file under a volume grew: NodeExpandVolume grows the mounted
/// filesystem (xfs by xfs_growfs, ext4 by resize2fs) through the loop
/// device, online, and the stats show it; the data stays. Where the kernel
/// refuses ext4's online resize (no CAP_SYS_RESOURCE), the call fails
/// saying so, and the volume is unharmed.
#[test]
fn expansion_grows_a_mounted_filesystem() {
    let node = Node::start(VOLAGENT);
    for (fs, from, to) in [("xfs", 320u64, 480u64), ("ext4", 64, 160)] {
        let id = format!("grow-{fs}");
        let image = node.image(&format!("{id}.img"), from);
        assert!(
            Command::new(format!("mkfs.{fs}"))
                .arg(if fs == "xfs" { "-f" } else { "-F" })
                .arg("-q")
                .arg(&image)
                .status()
                .expect("mkfs")
                .success()
        );
        let (st, ta) = (staging(&node, &id), target(&node, "uid-g", &id));
        rt().block_on(async {
            let mut c = node_client(&node, "node-a", "local-pv").await;
            let mut stage = stage_request(&id, &st, &image, Mode::SingleNodeWriter);
            stage.volume_capability = capability(Mode::SingleNodeWriter, fs);
            c.node_stage_volume(stage).await.expect("stage");
            let mut publish = publish_request(&id, &st, &ta, Mode::SingleNodeWriter, "g");
            publish.volume_capability = capability(Mode::SingleNodeWriter, fs);
            c.node_publish_volume(publish).await.expect("publish");
            std::fs::write(format!("{ta}/data"), b"before").expect("write");
            let total = |c: &mut NodeClient<tonic::transport::Channel>| {
                let req = NodeGetVolumeStatsRequest {
                    volume_id: id.clone(),
                    volume_path: ta.clone(),
                    ..Default::default()
                };
                let mut c = c.clone();
                async move {
                    c.node_get_volume_stats(req)
                        .await
                        .expect("stats")
                        .into_inner()
                        .usage
                        .iter()
                        .find(|u| u.unit == volume_usage::Unit::Bytes as i32)
                        .expect("bytes")
                        .total
                }
            };
            let before = total(&mut c).await;
            std::fs::OpenOptions::new()
                .write(true)
                .open(&image)
                .expect("image")
                .set_len(to << 20)
                .expect("grow the file");
            let mut req = NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: ta.clone(),
                ..Default::default()
            };
            req.capacity_range =
                Some(CapacityRange { required_bytes: (to << 20) as i64, limit_bytes: 0 });
            if fs == "ext4" && !has_sys_resource() {
                eprintln!(
                    "ext4: this machine withholds CAP_SYS_RESOURCE; checking the refusal instead"
                );
                assert_code(
                    c.node_expand_volume(req).await,
                    Code::Internal,
                    "Permission denied to resize",
                );
                assert_eq!(total(&mut c).await, before, "nothing changed");
                assert_eq!(std::fs::read(format!("{ta}/data")).expect("read"), b"before");
                c.node_unpublish_volume(unpublish(&id, &ta)).await.expect("unpublish");
                c.node_unstage_volume(unstage(&id, &st)).await.expect("unstage");
                return;
            }
            let grown = c.node_expand_volume(req).await.expect("expand").into_inner();
            assert_eq!(grown.capacity_bytes, (to << 20) as i64, "{fs}: the device's new size");
            let after = total(&mut c).await;
            assert!(after > before + (((to - from) << 20) / 2) as i64, "{fs}: {before} -> {after}");
            assert_eq!(std::fs::read(format!("{ta}/data")).expect("read"), b"before");
            c.node_unpublish_volume(unpublish(&id, &ta)).await.expect("unpublish");
            c.node_unstage_volume(unstage(&id, &st)).await.expect("unstage");
        });
    }
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

fn block_capability(mode: Mode) -> Option<VolumeCapability> {
    Some(VolumeCapability {
        access_type: Some(AccessType::Block(Default::default())),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    })
}

/// A block volume as kubelet 1.20 lays it out: the stage binds the loop
/// device at a file named after the volume in kubelet's staging dir; each
/// publish binds it again at kubelet's target file, which the container
/// then gets as a device. Data written through one target is read through
/// another; nothing is formatted or mounted; unpublish and unstage remove
/// the files they made and detach the device.
#[test]
fn a_block_volume_is_published_as_a_device_node() {
    let node = Node::start(VOLAGENT);
    let image = node.image("blk.img", 16);
    let root = kubelet_root(&node, "node-a");
    let st = root.join("plugins/kubernetes.io/csi/volumeDevices/staging/blk1");
    std::fs::create_dir_all(&st).expect("kubelet makes the staging dir");
    let st = st.display().to_string();
    let publish_dir = root.join("plugins/kubernetes.io/csi/volumeDevices/publish/blk1");
    std::fs::create_dir_all(&publish_dir).expect("kubelet makes the publish dir");
    let (ta, tb) = (
        publish_dir.join("uid-a").display().to_string(),
        publish_dir.join("uid-b").display().to_string(),
    );
    let is_block = |p: &str| {
        std::fs::metadata(p)
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
    };
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        let mut stage = stage_request("blk1", &st, &image, Mode::SingleNodeWriter);
        stage.volume_capability = block_capability(Mode::SingleNodeWriter);
        c.node_stage_volume(stage.clone()).await.expect("stage");
        c.node_stage_volume(stage.clone()).await.expect("stage again: idempotent");
        let staged = format!("{st}/blk1");
        assert!(is_block(&staged), "the device is bound at {staged}");
        assert_eq!(node.scratch.mounts(), [PathBuf::from(&staged)]);
        // The same volume asked as a filesystem is another capability.
        assert_code(
            c.node_stage_volume(stage_request("blk1", &st, &image, Mode::SingleNodeWriter)).await,
            Code::AlreadyExists,
            "another capability",
        );

        for (t, pod) in [(&ta, "pod-a"), (&tb, "pod-b")] {
            let mut p = publish_request("blk1", &st, t, Mode::SingleNodeWriter, pod);
            p.volume_capability = block_capability(Mode::SingleNodeWriter);
            c.node_publish_volume(p.clone()).await.expect("publish");
            c.node_publish_volume(p).await.expect("publish again: idempotent");
            assert!(is_block(t), "{t} is the device");
        }
        // A filesystem publish of a block stage is refused.
        let tc = publish_dir.join("uid-c").display().to_string();
        assert_code(
            c.node_publish_volume(publish_request(
                "blk1",
                &st,
                &tc,
                Mode::SingleNodeWriter,
                "pod-c",
            ))
            .await,
            Code::FailedPrecondition,
            "staged as a block volume",
        );

        // Raw data through one target, read through the other.
        {
            use std::io::{Read, Seek, Write};
            let mut w = std::fs::OpenOptions::new().write(true).open(&ta).expect("open a");
            w.seek(std::io::SeekFrom::Start(4096)).expect("seek");
            w.write_all(b"raw through CSI").expect("write");
            w.sync_all().expect("sync");
            let mut r = std::fs::File::open(&tb).expect("open b");
            r.seek(std::io::SeekFrom::Start(4096)).expect("seek");
            let mut got = [0u8; 15];
            r.read_exact(&mut got).expect("read");
            assert_eq!(&got, b"raw through CSI");
        }
        let stats = c
            .node_get_volume_stats(NodeGetVolumeStatsRequest {
                volume_id: "blk1".into(),
                volume_path: ta.clone(),
                ..Default::default()
            })
            .await
            .expect("stats")
            .into_inner();
        assert!(
            stats.usage.is_empty() && !stats.volume_condition.expect("condition").abnormal,
            "a device has no filesystem usage"
        );

        for t in [&ta, &tb] {
            c.node_unpublish_volume(unpublish("blk1", t)).await.expect("unpublish");
            c.node_unpublish_volume(unpublish("blk1", t))
                .await
                .expect("unpublish again: idempotent");
            assert!(!Path::new(t).exists(), "the target file is removed: {t}");
        }
        c.node_unstage_volume(unstage("blk1", &st)).await.expect("unstage");
        c.node_unstage_volume(unstage("blk1", &st)).await.expect("unstage again: idempotent");
        assert!(!Path::new(&staged).exists(), "the staged device file is removed");
    });
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    let data = std::fs::read(&image).expect("image");
    assert_eq!(&data[4096..4096 + 15], b"raw through CSI", "the data is in the volume's file");
}

/// local-pv as built for the previous contract (tests/fixtures), swapped in
/// by hot reload, serves a filesystem volume through CSI as before; a block
/// volume, which that contract cannot express, is refused and changes
/// nothing.
#[test]
fn a_guest_of_the_previous_contract_serves_on() {
    let node = Node::start(VOLAGENT);
    let old = volagent_test_support::workspace().join("tests/fixtures/contract-0.4/local-pv.wasm");
    node.trust("local-pv", &old);
    std::fs::copy(&old, node.scratch.path("plugins/.local-pv.wasm")).expect("copy");
    std::fs::rename(
        node.scratch.path("plugins/.local-pv.wasm"),
        node.scratch.path("plugins/local-pv.wasm"),
    )
    .expect("install");
    let start = Instant::now();
    loop {
        let out = Command::new(VOLAGENT)
            .args(["plugin", "status", "--json", "--socket"])
            .arg(&node.socket)
            .output()
            .expect("status");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let sha = v["backends"]
            .as_array()
            .and_then(|b| b.iter().find(|b| b["name"] == "local-pv"))
            .map(|b| b["sha256"].clone());
        if sha.is_some_and(|s| {
            s == volagent::policy::Plugin::load_file(&policy::runtime(500), &old)
                .expect("fixture")
                .sha256()
        }) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the 0.4 build was not loaded: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let image = node.image("old.img", 64);
    let (st, ta) = (staging(&node, "pv-old"), target(&node, "uid-o", "pv-old"));
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_stage_volume(stage_request("pv-old", &st, &image, Mode::SingleNodeWriter))
            .await
            .expect("stage");
        c.node_publish_volume(publish_request("pv-old", &st, &ta, Mode::SingleNodeWriter, "pod-o"))
            .await
            .expect("publish");
        std::fs::write(format!("{ta}/data"), b"0.4").expect("write");
        assert_eq!(std::fs::read(format!("{ta}/data")).expect("read"), b"0.4");
        c.node_unpublish_volume(unpublish("pv-old", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv-old", &st)).await.expect("unstage");

        let blk = kubelet_root(&node, "node-a")
            .join("plugins/kubernetes.io/csi/volumeDevices/staging/pv-blk");
        std::fs::create_dir_all(&blk).expect("staging dir");
        let mut stage =
            stage_request("pv-blk", &blk.display().to_string(), &image, Mode::SingleNodeWriter);
        stage.volume_capability = block_capability(Mode::SingleNodeWriter);
        let err = c.node_stage_volume(stage).await.expect_err("a 0.4 guest has no block volumes");
        assert!(err.message().contains("0.4.0, which has no block volumes"), "{err:?}");
    });
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
}

/// The backend judges a volume's health for NodeGetVolumeStats beyond the
/// host's own checks: local-pv says so when the volume's file is gone from
/// its path while it is mounted (the loop device still holds the data).
#[test]
fn the_backend_judges_the_volume_condition() {
    let node = Node::start(VOLAGENT);
    let image = node.image("cond.img", 64);
    let (st, ta) = (staging(&node, "pv-cond"), target(&node, "uid-c", "pv-cond"));
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_stage_volume(stage_request("pv-cond", &st, &image, Mode::SingleNodeWriter))
            .await
            .expect("stage");
        c.node_publish_volume(publish_request(
            "pv-cond",
            &st,
            &ta,
            Mode::SingleNodeWriter,
            "pod-c",
        ))
        .await
        .expect("publish");
        let stats = |c: &NodeClient<tonic::transport::Channel>| {
            let (mut c, req) = (
                c.clone(),
                NodeGetVolumeStatsRequest {
                    volume_id: "pv-cond".into(),
                    volume_path: ta.clone(),
                    ..Default::default()
                },
            );
            async move {
                c.node_get_volume_stats(req)
                    .await
                    .expect("stats")
                    .into_inner()
                    .volume_condition
                    .expect("condition")
            }
        };
        assert!(!stats(&c).await.abnormal);
        std::fs::rename(&image, format!("{image}.moved")).expect("move the file away");
        let cond = stats(&c).await;
        assert!(cond.abnormal && cond.message.contains("does not exist on this node"), "{cond:?}");
        std::fs::rename(format!("{image}.moved"), &image).expect("move it back");
        assert!(!stats(&c).await.abnormal);
        c.node_unpublish_volume(unpublish("pv-cond", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv-cond", &st)).await.expect("unstage");
    });
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// The stage holders in the record of `volume` in `node`'s private ledger
/// (read with the agent stopped: it holds the file locked).
fn recorded_holders(node: &Node, volume: &str) -> Vec<String> {
    rt().block_on(async {
        use volagent::ledger::Ledger;
        let ledger =
            volagent::ledger::embedded::EmbeddedLedger::open(&node.ledger_path("node-a"), false)
                .expect("open the ledger");
        let record = ledger.get(volume).await.expect("read the ledger");
        record
            .map(|(r, _)| r.holders.into_iter().map(|h| h.consumer.mount_dir).collect())
            .unwrap_or_default()
    })
}

/// A standalone agent's own ledger stores its records behind the stages
/// (they are committed in batches, nobody else reads them): every stage is
/// recorded all the same, and a holder that a crash kept from the disk is
/// recorded again from the stash when the agent starts.
#[test]
fn a_private_ledger_records_every_stage_and_recovers_a_lost_holder() {
    let mut node = Node::start_alone(VOLAGENT);
    let image = node.image("alone.img", 64);
    let (st, ta) = (staging(&node, "pv-alone"), target(&node, "uid-a", "pv-alone"));
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_stage_volume(stage_request("pv-alone", &st, &image, Mode::SingleNodeWriter))
            .await
            .expect("stage");
        c.node_publish_volume(publish_request(
            "pv-alone",
            &st,
            &ta,
            Mode::SingleNodeWriter,
            "pod-a",
        ))
        .await
        .expect("publish");
    });
    std::fs::write(format!("{ta}/data"), b"alone").expect("write");
    node.stop_agent_of("node-a");
    assert_eq!(recorded_holders(&node, "pv-alone"), vec![st.clone()]);

    // A crash before the commit reached the disk: the record is not there.
    rt().block_on(async {
        use volagent::ledger::Ledger;
        let ledger =
            volagent::ledger::embedded::EmbeddedLedger::open(&node.ledger_path("node-a"), false)
                .expect("open the ledger");
        let (_, version) = ledger.get("pv-alone").await.expect("read").expect("recorded");
        ledger.delete("pv-alone", &version).await.expect("delete the record");
    });
    node.spawn_agent("node-a");
    node.stop_agent_of("node-a");
    assert_eq!(recorded_holders(&node, "pv-alone"), vec![st.clone()], "recorded again at start-up");
    let log = std::fs::read_to_string(node.log_path("node-a")).expect("log");
    assert!(log.contains("recorded a mounted holder the ledger had lost"), "{log}");

    node.spawn_agent("node-a");
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        assert_eq!(std::fs::read(format!("{ta}/data")).expect("still published"), b"alone");
        c.node_unpublish_volume(unpublish("pv-alone", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv-alone", &st)).await.expect("unstage");
    });
    node.stop_agent_of("node-a");
    assert!(recorded_holders(&node, "pv-alone").is_empty());
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// Killed (SIGKILL) just after a stage and publish, and again just after
/// the unpublish and unstage — before the records they took can have been
/// committed: at the next start the ledger holds the mounted holder, and
/// no longer holds the one whose volume went.
#[test]
fn a_kill_right_after_staging_or_unstaging_loses_no_holder_and_keeps_no_stale_one() {
    let mut node = Node::start_alone(VOLAGENT);
    let image = node.image("killed.img", 64);
    let (st, ta) = (staging(&node, "pv-killed"), target(&node, "uid-a", "pv-killed"));
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_stage_volume(stage_request("pv-killed", &st, &image, Mode::SingleNodeWriter))
            .await
            .expect("stage");
        c.node_publish_volume(publish_request(
            "pv-killed",
            &st,
            &ta,
            Mode::SingleNodeWriter,
            "pod-a",
        ))
        .await
        .expect("publish");
    });
    node.kill_agent_of("node-a");
    node.spawn_agent("node-a");
    node.stop_agent_of("node-a");
    assert_eq!(
        recorded_holders(&node, "pv-killed"),
        vec![st.clone()],
        "the mounted holder is recorded"
    );

    node.spawn_agent("node-a");
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_unpublish_volume(unpublish("pv-killed", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv-killed", &st)).await.expect("unstage");
    });
    node.kill_agent_of("node-a");
    node.spawn_agent("node-a");
    node.stop_agent_of("node-a");
    assert!(recorded_holders(&node, "pv-killed").is_empty(), "the released holder is not kept");
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}

/// The state dir's disk full. The ledger takes a stage's record in memory,
/// so the first stage after the disk filled succeeds; its commit then
/// fails, and from then on stages are refused, saying why, and leave
/// nothing mounted or attached. Once there is space the agent stages again
/// without a restart, and the record taken while the disk was full is on
/// disk: nothing was lost.
#[test]
fn a_full_state_disk_refuses_stages_until_there_is_room_and_loses_no_record() {
    let mut node = Node::start_alone(VOLAGENT);
    node.stop_agent_of("node-a");
    let state = node.scratch.path("node-a/state");
    std::fs::remove_dir_all(&state).expect("clear the state dir");
    std::fs::create_dir_all(&state).expect("state dir");
    nix::mount::mount(
        Some("tmpfs"),
        &state,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=8m"),
    )
    .expect("a small disk for the state dir");
    node.spawn_agent("node-a");
    let (first, second) = (node.image("first.img", 64), node.image("full.img", 64));
    let (st1, st2) = (staging(&node, "pv-first"), staging(&node, "pv-full"));
    let ta = target(&node, "uid-a", "pv-full");
    let volume_mounts =
        |node: &Node| node.scratch.mounts().into_iter().filter(|m| *m != state).collect::<Vec<_>>();

    // Fill it.
    let filler = state.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).expect("filler");
        let chunk = vec![0xa5u8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
    }
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_stage_volume(stage_request("pv-first", &st1, &first, Mode::SingleNodeWriter))
            .await
            .expect("taken in memory");
        let staged = volume_mounts(&node);
        assert_eq!(staged.len(), 1, "{staged:?}");
        // Its commit is due within 100 ms, and fails.
        std::thread::sleep(std::time::Duration::from_millis(600));
        let stage = stage_request("pv-full", &st2, &second, Mode::SingleNodeWriter);
        let e = c.node_stage_volume(stage.clone()).await.expect_err("no room for records");
        assert!(
            e.message().contains("pv-full") && e.message().contains("No space left on device"),
            "{e:?}"
        );
        assert_eq!(volume_mounts(&node), staged, "nothing of the refused stage is left");
        assert_eq!(node.scratch.loops().len(), 1, "{:?}", node.scratch.loops());

        std::fs::remove_file(&filler).expect("space again");
        let start = std::time::Instant::now();
        while let Err(e) = c.node_stage_volume(stage.clone()).await {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "the agent did not take records again: {e:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        c.node_publish_volume(publish_request(
            "pv-full",
            &st2,
            &ta,
            Mode::SingleNodeWriter,
            "pod-a",
        ))
        .await
        .expect("publish");
        std::fs::write(format!("{ta}/data"), b"room").expect("write");
    });
    node.stop_agent_of("node-a");
    assert_eq!(
        recorded_holders(&node, "pv-first"),
        vec![st1.clone()],
        "the record taken on the full disk was stored"
    );
    assert_eq!(recorded_holders(&node, "pv-full"), vec![st2.clone()]);
    node.spawn_agent("node-a");
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        c.node_unpublish_volume(unpublish("pv-full", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("pv-full", &st2)).await.expect("unstage");
        c.node_unstage_volume(unstage("pv-first", &st1)).await.expect("unstage");
    });
    assert!(volume_mounts(&node).is_empty() && node.scratch.loops_left().is_empty());
    node.stop_agent_of("node-a");
    assert!(
        recorded_holders(&node, "pv-full").is_empty()
            && recorded_holders(&node, "pv-first").is_empty(),
        "the ledger reads back, with nothing held"
    );
}

/// Faults injected at the sys seam (the chaos tier's fault layer) into the
/// step kinds only CSI uses: publishing a block device node and growing a
/// mounted filesystem. The call fails naming the step and the fault, and
/// leaves what it found; once the fault is gone the retry succeeds.
#[test]
fn faults_at_publish_block_and_grow_filesystem_fail_clearly_and_retries_succeed() {
    let mut node = Node::start_alone(VOLAGENT);
    let rules = node.restart_with_faults(&[]);
    let inject = |rule: &str| std::fs::write(&rules, format!("{rule}\n")).expect("rules");
    let clear = || std::fs::remove_file(&rules).expect("the fault is gone");
    #[track_caller]
    fn says<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>, step: &str) {
        let m = r.expect_err("the injected fault fails the call").message().to_string();
        assert!(
            m.contains(&format!("({step}) failed"))
                && m.contains("injected fault")
                && m.contains("EIO"),
            "{m}"
        );
    }

    let image = node.image("fb.img", 16);
    let root = kubelet_root(&node, "node-a");
    let st = root.join("plugins/kubernetes.io/csi/volumeDevices/staging/fb");
    let publish_dir = root.join("plugins/kubernetes.io/csi/volumeDevices/publish/fb");
    std::fs::create_dir_all(&st).expect("kubelet makes the staging dir");
    std::fs::create_dir_all(&publish_dir).expect("kubelet makes the publish dir");
    let (st, ta) = (st.display().to_string(), publish_dir.join("uid-a").display().to_string());
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        let mut stage = stage_request("fb", &st, &image, Mode::SingleNodeWriter);
        stage.volume_capability = block_capability(Mode::SingleNodeWriter);
        inject("publish-block EIO");
        says(c.node_stage_volume(stage.clone()).await, "publish-block");
        assert!(
            node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty(),
            "the stage is rolled back"
        );
        clear();
        c.node_stage_volume(stage).await.expect("stage");
        let mut publish = publish_request("fb", &st, &ta, Mode::SingleNodeWriter, "pod-a");
        publish.volume_capability = block_capability(Mode::SingleNodeWriter);
        inject("publish-block EIO");
        says(c.node_publish_volume(publish.clone()).await, "publish-block");
        assert_eq!(node.scratch.mounts().len(), 1, "the stage alone: {:?}", node.scratch.mounts());
        clear();
        c.node_publish_volume(publish).await.expect("publish");
        c.node_unpublish_volume(unpublish("fb", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("fb", &st)).await.expect("unstage");
    });

    let image = node.image("fg.img", 320);
    assert!(
        Command::new("mkfs.xfs").args(["-f", "-q"]).arg(&image).status().expect("mkfs").success()
    );
    let (st, ta) = (staging(&node, "fg"), target(&node, "uid-g", "fg"));
    rt().block_on(async {
        let mut c = node_client(&node, "node-a", "local-pv").await;
        let mut stage = stage_request("fg", &st, &image, Mode::SingleNodeWriter);
        stage.volume_capability = capability(Mode::SingleNodeWriter, "xfs");
        c.node_stage_volume(stage).await.expect("stage");
        let mut publish = publish_request("fg", &st, &ta, Mode::SingleNodeWriter, "g");
        publish.volume_capability = capability(Mode::SingleNodeWriter, "xfs");
        c.node_publish_volume(publish).await.expect("publish");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .expect("image")
            .set_len(480 << 20)
            .expect("grow the file");
        let expand = NodeExpandVolumeRequest {
            volume_id: "fg".into(),
            volume_path: ta.clone(),
            ..Default::default()
        };
        inject("grow-filesystem EIO");
        says(c.node_expand_volume(expand.clone()).await, "grow-filesystem");
        clear();
        assert_eq!(
            c.node_expand_volume(expand).await.expect("expand").into_inner().capacity_bytes,
            480 << 20
        );
        c.node_unpublish_volume(unpublish("fg", &ta)).await.expect("unpublish");
        c.node_unstage_volume(unstage("fg", &st)).await.expect("unstage");
    });
    assert!(node.scratch.mounts().is_empty() && node.scratch.loops_left().is_empty());
}
