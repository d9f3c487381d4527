//! The nfs backend against a real NFS server: the kernel's NFS client and
//! server, which this machine's kernel lacks. The test at the top boots the
//! VM tier's Debian kernel (see vm_nbd_kernel.rs), whose prelude starts
//! the kernel's nfsd there, exporting a tmpfs over NFSv4 on the loopback;
//! the inner tests run the real agent binaries in the VM and mount that
//! export through the node's `mount.nfs`. Outside the VM the inner tests
//! are ignored; they fail, not pass, when run without an NFS server.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use volagent_test_support::vm;

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// What the server exports (a tmpfs in the VM), as the v4 root: "server:/".
const EXPORT: &str = "/run/volagent-nfs/export";

/// The NFS server, started in the VM before the inner tests: nfsd in the
/// kernel, v4 only over TCP on the loopback (no rpcbind: v4 needs none),
/// mountd for the kernel's export-cache questions, and a grace period
/// cut short so that the first opens need not wait 90 s for it.
const PRELUDE: &str = r#"
nfs_failed() { echo "VOLAGENT_VM_FAILED: the NFS server: $*"; exit 1; }
mkdir -p /run/volagent-nfs/export /var/lib/nfs/v4recovery
mount -t tmpfs -o mode=0777 nfs-export /run/volagent-nfs/export || nfs_failed "tmpfs"
mount -t nfsd nfsd /proc/fs/nfsd || nfs_failed "mount nfsd"
echo 10 > /proc/fs/nfsd/nfsv4leasetime
echo 10 > /proc/fs/nfsd/nfsv4gracetime
: > /etc/exports
exportfs -o rw,sync,no_subtree_check,no_root_squash,insecure,fsid=0 127.0.0.1:/run/volagent-nfs/export || nfs_failed "exportfs"
rpc.mountd -N 2 -N 3 -u || nfs_failed "rpc.mountd"
rpc.nfsd -N 3 -U -H 127.0.0.1 4 || nfs_failed "rpc.nfsd"
echo Y > /proc/fs/nfsd/v4_end_grace 2>/dev/null
echo "nfs server: $(cat /proc/fs/nfsd/versions)"
"#;

/// The inner tests, by name (each runs in its own process in the VM).
const IN_THE_VM: &[&str] = &[
    "a_dropped_in_nfs_policy_serves_one_export_to_pods_on_two_nodes",
    "an_unreachable_server_or_a_foreign_address_mounts_nothing",
];

#[test]
fn every_test_for_the_vm_is_run_by_it() {
    vm::assert_every_test_is_run("in_the_vm", IN_THE_VM);
}

#[test]
fn the_nfs_backend_mounts_a_real_export_in_a_vm_whose_kernel_has_nfs() {
    let dir = vm::work_dir();
    vm::run_tests(
        dir.path(),
        2048,
        PRELUDE,
        "in_the_vm",
        IN_THE_VM,
        "cat /var/lib/nfs/etab /proc/fs/nfsd/exports; dmesg | tail -n 40",
    );
}

mod in_the_vm {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::time::{Duration, Instant};
    use volagent::csi::proto::csi::node_client::NodeClient;
    use volagent::csi::proto::csi::volume_capability::{
        AccessMode, AccessType, MountVolume, access_mode::Mode,
    };
    use volagent::csi::proto::csi::*;
    use volagent::sys::mountinfo::{self, MountInfo};
    use volagent_test_support::agent::Node;
    use volagent_test_support::driver::{
        assert_failure, assert_success, kubelet_options, run_driver,
    };
    use volagent_test_support::wait_until;

    const WHY: &str = "needs an NFS server and the kernel's NFS client: runs inside the VM (the_nfs_backend_mounts_a_real_export_in_a_vm_whose_kernel_has_nfs)";

    fn server_runs() {
        // exportfs's table; the kernel learns of an export when first asked.
        let exports = std::fs::read_to_string("/var/lib/nfs/etab").unwrap_or_default();
        let serving = std::fs::read_to_string("/proc/fs/nfsd/threads").unwrap_or_default();
        assert!(exports.contains(super::EXPORT) && serving.trim() != "0", "{WHY}");
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    /// The NFS mounts of this test's mount namespace.
    fn nfs_mounts() -> Vec<MountInfo> {
        let nfs = |m: &MountInfo| m.fs_type == "nfs" || m.fs_type == "nfs4";
        mountinfo::own().unwrap().into_iter().filter(nfs).collect()
    }

    fn kubelet_root(node: &Node, name: &str) -> PathBuf {
        node.scratch.path(&format!("{name}/kubelet"))
    }

    /// Install nfs.wasm the way an admin does: a dot-name, renamed.
    fn drop_in(node: &Node) {
        let tmp = node.scratch.path("plugins/.nfs.wasm");
        std::fs::copy(volagent_test_artifacts::NFS, &tmp).unwrap();
        std::fs::rename(&tmp, node.scratch.path("plugins/nfs.wasm")).unwrap();
    }

    fn flex(node: &Node, name: &str, args: &[&str]) -> (i32, serde_json::Value) {
        run_driver(Command::new(node.driver_of(name, "nfs")).args(args))
    }

    fn flex_options(volume: &str, pod: &str, uid: &str, server: &str) -> serde_json::Value {
        let mut o = kubelet_options(volume, pod, uid, "", "/");
        let m = o.as_object_mut().unwrap();
        m.insert("server".into(), server.into());
        m.insert("accessMode".into(), "ReadWriteMany".into());
        o
    }

    fn capability(flags: &[&str]) -> Option<VolumeCapability> {
        Some(VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                mount_flags: flags.iter().map(|f| f.to_string()).collect(),
                ..Default::default()
            })),
            access_mode: Some(AccessMode { mode: Mode::MultiNodeMultiWriter as i32 }),
        })
    }

    /// kubelet's staging dir of CSI volume `id` on node-a, made.
    fn staging(node: &Node, id: &str) -> String {
        let p = kubelet_root(node, "node-a")
            .join(format!("plugins/kubernetes.io/csi/pv/{id}/globalmount"));
        std::fs::create_dir_all(&p).unwrap();
        p.display().to_string()
    }

    /// kubelet's target of CSI volume `id` in pod `uid` on node-a, its
    /// parent made.
    fn target(node: &Node, uid: &str, id: &str) -> String {
        let p = kubelet_root(node, "node-a")
            .join(format!("pods/{uid}/volumes/kubernetes.io~csi/{id}/mount"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        p.display().to_string()
    }

    fn stage(id: &str, staging: &str, server: &str, flags: &[&str]) -> NodeStageVolumeRequest {
        NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            volume_capability: capability(flags),
            volume_context: HashMap::from([
                ("server".to_string(), server.to_string()),
                ("path".to_string(), "/".to_string()),
            ]),
            ..Default::default()
        }
    }

    fn publish(id: &str, staging: &str, target: &str, pod: &str) -> NodePublishVolumeRequest {
        NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            target_path: target.into(),
            volume_capability: capability(&[]),
            volume_context: HashMap::from([
                ("csi.storage.k8s.io/pod.name".to_string(), pod.to_string()),
                ("csi.storage.k8s.io/pod.namespace".to_string(), "default".to_string()),
            ]),
            ..Default::default()
        }
    }

    async fn csi_client(node: &Node) -> NodeClient<tonic::transport::Channel> {
        let socket = volagent::csi::drivers::socket_path(&kubelet_root(node, "node-a"), "nfs");
        NodeClient::new(volagent::csi::client::connect(socket).await.unwrap())
    }

    fn write(dir: &str, file: &str, text: &str) {
        std::fs::write(Path::new(dir).join(file), text)
            .unwrap_or_else(|e| panic!("write {file} in {dir}: {e}"));
    }

    fn read(dir: &str, file: &str) -> String {
        std::fs::read_to_string(Path::new(dir).join(file))
            .unwrap_or_else(|e| panic!("read {file} in {dir}: {e}"))
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn a_dropped_in_nfs_policy_serves_one_export_to_pods_on_two_nodes() {
        server_runs();
        let mut node = Node::start(super::VOLAGENT);
        node.spawn_agent("node-b");
        let csi_socket = volagent::csi::drivers::socket_path(&kubelet_root(&node, "node-a"), "nfs");
        assert!(!node.driver_of("node-a", "nfs").exists() && !csi_socket.exists());

        // Dropped into the running agents: both drivers appear, no restart.
        let dropped = Instant::now();
        drop_in(&node);
        wait_until(Duration::from_secs(60), "the nfs drivers of both nodes", || {
            node.driver_of("node-a", "nfs").exists()
                && node.driver_of("node-b", "nfs").exists()
                && csi_socket.exists()
        });
        eprintln!("drop-in to drivers: {:?}", dropped.elapsed());

        // Two pods on node-a through CSI: one mount of the export, staged.
        let id = "pv-nfs";
        let staging = staging(&node, id);
        let (target_a, target_b) = (target(&node, "uid-a", id), target(&node, "uid-b", id));
        rt().block_on(async {
            let mut csi = csi_client(&node).await;
            csi.node_stage_volume(stage(id, &staging, "127.0.0.1", &["nconnect=2"]))
                .await
                .expect("NodeStageVolume");
            csi.node_publish_volume(publish(id, &staging, &target_a, "pod-a"))
                .await
                .expect("NodePublishVolume a");
            csi.node_publish_volume(publish(id, &staging, &target_b, "pod-b"))
                .await
                .expect("NodePublishVolume b");
        });
        let mounts = nfs_mounts();
        let staged = mounts
            .iter()
            .find(|m| m.mount_point == Path::new(&staging))
            .unwrap_or_else(|| panic!("no nfs mount at the staging dir: {mounts:?}"));
        assert_eq!((staged.fs_type.as_str(), staged.source.as_str()), ("nfs4", "127.0.0.1:/"));
        for want in ["nosuid", "nodev"] {
            assert!(staged.options.split(',').any(|o| o == want), "{staged:?}");
        }
        assert!(staged.super_options.contains("vers=4.2"), "{staged:?}");
        assert!(staged.super_options.contains("nconnect=2"), "{staged:?}");

        // Each pod reads what the other wrote; the server has both.
        write(&target_a, "from-a", "written by pod a");
        write(&target_b, "from-b", "written by pod b");
        assert_eq!(read(&target_b, "from-a"), "written by pod a");
        assert_eq!(read(&target_a, "from-b"), "written by pod b");
        assert_eq!(read(super::EXPORT, "from-b"), "written by pod b");

        // A third pod on node-b through Flexvolume: the same export.
        let dir_c = node.mount_dir_of("node-b", "nfs", "uid-c", "pv-nfs-flex");
        let options = flex_options("pv-nfs-flex", "pod-c", "uid-c", "127.0.0.1");
        assert_success(&flex(&node, "node-b", &["mount", &dir_c, &options.to_string()]));
        assert_eq!(read(&dir_c, "from-a"), "written by pod a");
        write(&dir_c, "from-c", "written by pod c");
        assert_eq!(read(&target_a, "from-c"), "written by pod c");
        assert_eq!(read(super::EXPORT, "from-c"), "written by pod c");

        // Everything goes: no NFS mount is left.
        assert_success(&flex(&node, "node-b", &["unmount", &dir_c]));
        rt().block_on(async {
            let mut csi = csi_client(&node).await;
            for target in [&target_a, &target_b] {
                csi.node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: id.into(),
                    target_path: target.clone(),
                })
                .await
                .expect("NodeUnpublishVolume");
            }
            csi.node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.clone(),
            })
            .await
            .expect("NodeUnstageVolume");
        });
        assert_eq!(nfs_mounts(), vec![], "nfs mounts left");
        assert_eq!(read(super::EXPORT, "from-a"), "written by pod a", "the data stays");
    }

    #[test]
    #[ignore = "runs inside the VM"]
    fn an_unreachable_server_or_a_foreign_address_mounts_nothing() {
        server_runs();
        let node = Node::start_with(super::VOLAGENT, &[(volagent_test_artifacts::NFS, "nfs")]);
        wait_until(Duration::from_secs(60), "the nfs driver", || {
            node.driver_of("node-a", "nfs").exists()
        });
        // Nothing listens on 127.0.0.9: one attempt, refused, well within
        // the deadline.
        let dir = node.mount_dir_of("node-a", "nfs", "uid-x", "pv-gone");
        let options = flex_options("pv-gone", "pod-x", "uid-x", "127.0.0.9");
        let started = Instant::now();
        assert_failure(&flex(&node, "node-a", &["mount", &dir, &options.to_string()]), "mount.nfs");
        assert!(started.elapsed() < Duration::from_secs(50), "{:?}", started.elapsed());
        assert_eq!(nfs_mounts(), vec![], "a failed mount leaves nothing mounted");
        // The volume's mount options may not point the client elsewhere.
        let staging = staging(&node, "pv-addr");
        rt().block_on(async {
            let mut csi = csi_client(&node).await;
            let err = csi
                .node_stage_volume(stage("pv-addr", &staging, "127.0.0.1", &["addr=10.1.2.3"]))
                .await
                .expect_err("a foreign address is refused");
            assert!(err.message().contains("\"addr\""), "{err:?}");
        });
        assert_eq!(nfs_mounts(), vec![], "a refused plan mounts nothing");
    }
}
