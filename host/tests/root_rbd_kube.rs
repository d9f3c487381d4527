//! rbd fencing at the storage layer, with agents of two nodes against a
//! real etcd + kube-apiserver and the run's single-node Ceph: a node that
//! is deleted while its client still writes (its agent gone, its helper,
//! NBD client and mount still up: a partitioned machine) is taken over
//! only after its Ceph client was blocklisted by the address its agent
//! recorded at attach; from then on its writes fail with EIO while the new
//! node's succeed. Needs root.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

#[path = "support/agent.rs"]
mod agent_common;
#[path = "support/ceph.rs"]
mod ceph_common;
mod common;
mod driver_common;
mod kube_common;
#[path = "support/nbd.rs"]
mod nbd_common;

use base64::Engine;
use ceph_common::{Image, ceph_dir, volagent_key, watchers};
use common::RootScratch;
use driver_common::{assert_success, kubelet_options, run_driver};
use kube::api::Api;
use nbd_common::{clients_under, servers_under, wait_until};
use serde_json::Value;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use volagent::kube::crds::Attachment;
use volagent_kube_env::KubeEnv;

struct Cluster {
    // Dropped in this order: agents, the API server, the scratch dir.
    agents: Vec<(String, Child)>,
    env: KubeEnv,
    rt: tokio::runtime::Runtime,
    scratch: RootScratch,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, mut c) in self.agents.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Cluster {
    fn start(nodes: &[&str]) -> Cluster {
        let scratch = RootScratch::enter();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let env = rt.block_on(KubeEnv::start()).expect("a real kube-apiserver (scripts/kube-assets)");
        let client = {
            let _in_runtime = rt.enter();
            env.client()
        };
        rt.block_on(kube_common::install_crds(&client));
        for n in nodes {
            rt.block_on(kube_common::create_node(&client, n, true));
        }
        std::fs::create_dir_all(scratch.path("plugins")).unwrap();
        std::fs::copy(volagent_test_artifacts::RBD, scratch.path("plugins/rbd.wasm")).unwrap();
        let mut c = Cluster { agents: Vec::new(), env, rt, scratch };
        for n in nodes {
            c.spawn_agent(n);
        }
        c
    }

    fn client(&self) -> kube::Client {
        let _in_runtime = self.rt.enter();
        self.env.client()
    }

    fn spawn_agent(&mut self, node: &str) {
        let at = |p: &str| self.scratch.path(&format!("{node}/{p}"));
        let socket = at("run/agent.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_volagent"))
            .args(["agent", "--node-name", node])
            .arg("--kubeconfig").arg(self.env.kubeconfig_path())
            .arg("--runtime-dir").arg(at("run"))
            .arg("--state-dir").arg(at("state"))
            .arg("--plugin-dir").arg(self.scratch.path("plugins"))
            .arg("--kubelet-root").arg(at("kubelet"))
            .arg("--volume-plugin-dir").arg(at("vpd"))
            .arg("--flex-driver").arg(env!("CARGO_BIN_EXE_volagent-flex"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.scratch.path(&format!("{node}.log"))).unwrap())
            .spawn()
            .unwrap();
        self.agents.push((node.to_string(), child));
        let start = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(start.elapsed() < Duration::from_secs(60), "the agent of {node} did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill_agent(&mut self, node: &str) {
        if let Some(i) = self.agents.iter().position(|(n, _)| n == node) {
            let (_, mut c) = self.agents.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// kubelet's mount of PV `volume` for a new pod `pod` on `node`, with
    /// the Secret's key as kubelet passes it.
    fn mount(&self, node: &str, pod: &str, volume: &str, key: &str) -> (String, (i32, Value)) {
        let uid = self.rt.block_on(kube_common::create_pod(&self.client(), pod, &[volume], &[]));
        let dir = self.scratch.path(&format!("{node}/kubelet/pods/{uid}/volumes/volagent~rbd/{volume}"));
        std::fs::create_dir_all(&dir).unwrap();
        let dir = dir.display().to_string();
        let mut opts = kubelet_options(volume, pod, &uid, "ext4", "");
        opts.as_object_mut().unwrap().remove("path");
        opts["kubernetes.io/secret/key"] = base64::engine::general_purpose::STANDARD.encode(key).into();
        let driver = self.scratch.path(&format!("{node}/vpd/volagent~rbd/rbd"));
        (dir.clone(), run_driver(Command::new(driver).args(["mount", &dir, &opts.to_string()])))
    }

    fn record(&self, volume: &str) -> Attachment {
        let api: Api<Attachment> = Api::all(self.client());
        self.rt.block_on(api.get_opt(volume)).unwrap().expect("the volume's record")
    }
}

/// Write `bytes` to `path` and push them to the device.
fn write_through(path: &str, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn blocklist(dir: &std::path::Path) -> String {
    let out = Command::new("ceph").arg("-c").arg(dir.join("ceph.conf")).args(["osd", "blocklist", "ls"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_deleted_nodes_client_is_blocklisted_before_take_over_and_its_writes_then_fail() {
    let dir = ceph_dir();
    let key = volagent_key(&dir);
    let image = Image::create(&dir, 64);
    let mut c = Cluster::start(&["node-a", "node-b"]);
    let options = [("monitors", "127.0.0.1:6789"), ("pool", "rbd"), ("image", image.name.as_str()), ("user", "volagent")];
    c.rt.block_on(kube_common::create_pv(&c.client(), "pv-rbd", "rbd", "ReadWriteOnce", &options));

    // node-b mounts and writes; its agent records its Ceph client.
    let (old, r) = c.mount("node-b", "old", "pv-rbd", &key);
    assert_success(&r);
    let old_device = r.1["device"].as_str().unwrap().to_string();
    write_through(&format!("{old}/data"), b"before").unwrap();
    let clients = c.record("pv-rbd").spec.storage_clients;
    assert_eq!(clients.len(), 1, "{clients:?}");
    assert_eq!(clients[0].node, "node-b");
    assert_eq!(watchers(&image), [format!("client.{}", clients[0].id)]);

    // node-b's agent dies; its client and mount live on and keep writing.
    c.kill_agent("node-b");
    write_through(&format!("{old}/data"), b"still writing").unwrap();
    // A live node's volume is not taken over.
    let (_, r) = c.mount("node-a", "new-1", "pv-rbd", &key);
    assert_eq!(r.1["status"], "Failure", "{}", r.1);
    assert!(!blocklist(&dir).contains(&clients[0].address), "nobody was blocklisted yet");

    // node-b is deleted: node-a fences its client at the cluster, then takes over.
    c.rt.block_on(kube_common::delete_node(&c.client(), "node-b"));
    let (new, r) = c.mount("node-a", "new-2", "pv-rbd", &key);
    assert_success(&r);
    assert!(blocklist(&dir).contains(&clients[0].address), "{}", blocklist(&dir));
    let rec = c.record("pv-rbd").spec;
    let nodes: Vec<&str> = rec.consumers.iter().map(|x| x.node.as_str()).collect();
    assert_eq!(nodes, ["node-a"]);
    assert!(rec.storage_clients.iter().all(|s| s.node == "node-a") && rec.storage_clients.len() == 1, "{:?}", rec.storage_clients);

    // The old node's writes fail; the new node's succeed.
    let err = write_through(&format!("{old}/data"), b"too late").expect_err("the blocklisted client's write went through");
    assert!(err.raw_os_error() == Some(nix::libc::EIO) || err.raw_os_error() == Some(nix::libc::EROFS), "{err}");
    assert_eq!(std::fs::read(format!("{new}/data")).unwrap(), b"still writing", "node-a sees what node-b wrote before it was fenced");
    write_through(&format!("{new}/data"), b"taken over").unwrap();
    assert_eq!(std::fs::read(format!("{new}/data")).unwrap(), b"taken over");
    assert_success(&run_driver(Command::new(c.scratch.path("node-a/vpd/volagent~rbd/rbd")).args(["unmount", &new])));
    let st = c.scratch.path("node-a/state");
    wait_until("node-a's NBD client and helper to end", || clients_under(&st).is_empty() && servers_under(&st).is_empty());

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
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    let _ = Command::new("ceph").arg("-c").arg(dir.join("ceph.conf")).args(["osd", "blocklist", "rm", &clients[0].address]).output();
    let loops = std::fs::read_to_string(format!("/sys/block/{}/loop/backing_file", old_device.trim_start_matches("/dev/")));
    assert!(loops.is_err(), "{old_device} is still attached: {loops:?}");
}
