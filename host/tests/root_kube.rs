//! Agents of two nodes against a real etcd + kube-apiserver: fencing through
//! Attachment records, node facts and PVs from the API, with real loop
//! devices and mounts on this machine (both "nodes" are this machine, each
//! agent with its own kubelet root, runtime and state dirs). Needs root.

mod common;
mod driver_common;
mod kube_common;

use common::RootScratch;
use driver_common::{assert_failure, assert_success, kubelet_options, run_driver};
use kube::api::Api;
use serde_json::Value;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use volagent::kube::crds::Attachment;
use volagent_kube_env::KubeEnv;

struct Cluster {
    // Dropped in this order: agents, then the API server, then the scratch
    // dir (unmounting and detaching what is left).
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
        // The mount namespace is per thread: unshare on the test thread, and
        // run the async parts on it too (a current-thread runtime).
        let scratch = RootScratch::enter();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let env = rt.block_on(KubeEnv::start()).expect("a real kube-apiserver (scripts/kube-assets)");
        let client = {
            let _in_runtime = rt.enter();
            env.client()
        };
        rt.block_on(kube_common::install_crds(&client));
        for n in nodes {
            rt.block_on(kube_common::create_node(&client, n, true));
        }
        std::fs::create_dir_all(scratch.path("plugins")).expect("dir");
        std::fs::create_dir_all(scratch.path("disks")).expect("dir");
        std::fs::copy(volagent_test_artifacts::SHARED_FILE, scratch.path("plugins/shared-file.wasm")).expect("plugin");
        let mut c = Cluster { agents: Vec::new(), env, rt, scratch };
        for n in nodes {
            c.spawn_agent(n);
        }
        c
    }

    /// An admin client (made inside the runtime, which its I/O needs).
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
            .arg("--discovery-dir").arg(self.scratch.path("disks"))
            .arg("--volume-plugin-dir").arg(at("vpd"))
            .arg("--flex-driver").arg(env!("CARGO_BIN_EXE_volagent-flex"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the agent");
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

    fn mount_dir(&self, node: &str, pod: &str, volume: &str) -> String {
        let d = self.scratch.path(&format!("{node}/kubelet/pods/uid-{pod}/volumes/volagent~shared-file/{volume}"));
        std::fs::create_dir_all(&d).expect("kubelet makes the pod's dir");
        d.display().to_string()
    }

    fn driver(&self, node: &str) -> std::path::PathBuf {
        self.scratch.path(&format!("{node}/vpd/volagent~shared-file/shared-file"))
    }

    fn mount(&self, node: &str, pod: &str, volume: &str, image: &str) -> (String, (i32, Value)) {
        let dir = self.mount_dir(node, pod, volume);
        let mut opts = kubelet_options(volume, pod, &format!("uid-{pod}"), "ext4", image);
        // What the pod's author could write: the PV's mode must win.
        opts["accessMode"] = Value::from("ReadWriteMany");
        let r = run_driver(Command::new(self.driver(node)).args(["mount", &dir, &opts.to_string()]));
        (dir, r)
    }

    fn unmount(&self, node: &str, dir: &str) -> (i32, Value) {
        run_driver(Command::new(self.driver(node)).args(["unmount", dir]))
    }

    fn record(&self, volume: &str) -> Option<Attachment> {
        let api: Api<Attachment> = Api::all(self.client());
        self.rt.block_on(api.get_opt(volume)).expect("read the record")
    }

    fn image(&self, name: &str) -> String {
        let p = self.scratch.image(&format!("disks/{name}"), 64);
        let ok = Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&p).status().expect("mkfs").success();
        assert!(ok, "mkfs.ext4 {}", p.display());
        p.display().to_string()
    }
}

/// Two agents race for one ReadWriteOnce volume, 100 rounds: exactly one
/// wins each round and the loser's error names the winner's pod and node.
#[test]
fn two_nodes_race_for_a_read_write_once_volume() {
    let c = Cluster::start(&["node-a", "node-b"]);
    let image = c.image("race.img");
    c.rt.block_on(kube_common::create_pv(&c.client(), "pv-race", "shared-file", "ReadWriteOnce", &[("path", &image)]));
    let mut wins = [0usize; 2];
    for round in 0..100 {
        let (pa, pb) = (format!("a{round}"), format!("b{round}"));
        let ((da, ra), (db, rb)) = std::thread::scope(|s| {
            let a = s.spawn(|| c.mount("node-a", &pa, "pv-race", &image));
            let b = s.spawn(|| c.mount("node-b", &pb, "pv-race", &image));
            (a.join().expect("a"), b.join().expect("b"))
        });
        let (winner, dir, loser_reply, holder) = match (ra.0, rb.0) {
            (0, 1) => ("node-a", da, rb, format!("pod default/{pa} on node node-a")),
            (1, 0) => ("node-b", db, ra, format!("pod default/{pb} on node node-b")),
            other => panic!("round {round}: exactly one node must win, got exit codes {other:?}: {} / {}", ra.1, rb.1),
        };
        assert_failure(&loser_reply, &holder);
        wins[usize::from(winner == "node-b")] += 1;
        let rec = c.record("pv-race").expect("the winner's record");
        assert_eq!(rec.spec.consumers.len(), 1, "round {round}: one consumer recorded");
        assert_eq!(rec.spec.consumers[0].node, winner);
        assert_success(&c.unmount(winner, &dir));
        assert!(c.record("pv-race").is_none(), "round {round}: the record goes with its last consumer");
    }
    assert!(c.scratch.mounts().is_empty() && c.scratch.loops().is_empty(), "nothing left mounted or attached");
    eprintln!("wins: node-a {}, node-b {}", wins[0], wins[1]);
}

/// A holder's node is gone — deleted, or tainted out-of-service — so its
/// volume is taken over, but only after the guest's fence steps ran here;
/// a holder on a live node (even NotReady) is never taken over.
#[test]
fn only_gone_nodes_are_taken_over_and_only_after_fencing() {
    use volagent::sys::Devices;
    let mut c = Cluster::start(&["node-a", "node-b", "node-c"]);
    let loops = volagent::sys::linux::Linux::default();
    for (volume, how) in [("pv-deleted", "deleted"), ("pv-tainted", "out-of-service")] {
        let image = c.image(&format!("{volume}.img"));
        c.rt.block_on(kube_common::create_pv(&c.client(), volume, "shared-file", "ReadWriteOnce", &[("path", &image)]));
        let holder = if how == "deleted" { "node-b" } else { "node-c" };
        let (dir, r) = c.mount(holder, "h", volume, &image);
        assert_success(&r);

        // NotReady is not gone: denied, and the reason says why.
        c.rt.block_on(kube_common::set_ready(&c.client(), holder, false));
        let (_, r) = c.mount("node-a", "a", volume, &image);
        assert_failure(&r, "is NotReady, but a volume is only taken over from a deleted node or one tainted");

        // The holder's machine dies: its agent and mounts are gone, but a
        // read-only mapping of the file is left behind. Without the fence
        // step node-a would reuse that device.
        c.kill_agent(holder);
        for m in c.scratch.mounts().into_iter().rev() {
            nix::mount::umount2(&m, nix::mount::MntFlags::empty()).expect("unmount");
        }
        let _ = dir;
        for d in c.scratch.loops() {
            loops.loop_detach(&d).expect("detach");
        }
        let leftover = loops.loop_attach(std::path::Path::new(&image), true).expect("a leftover read-only mapping");
        match how {
            "deleted" => c.rt.block_on(kube_common::delete_node(&c.client(), holder)),
            _ => c.rt.block_on(kube_common::taint_out_of_service(&c.client(), holder)),
        }

        let (adir, r) = c.mount("node-a", "a", volume, &image);
        assert_success(&r);
        let device = r.1["device"].as_str().expect("the device").to_string();
        let name = device.trim_start_matches("/dev/");
        let ro = std::fs::read_to_string(format!("/sys/block/{name}/ro")).expect("sysfs ro");
        assert_eq!(ro.trim(), "0", "{how}: node-a got a fresh read-write device, not the leftover {}", leftover.display());
        let rec = c.record(volume).expect("record");
        let nodes: Vec<&str> = rec.spec.consumers.iter().map(|x| x.node.as_str()).collect();
        assert_eq!(nodes, ["node-a"], "{how}: the gone holder was removed from the record");
        std::fs::write(format!("{adir}/proof"), b"taken over").expect("node-a writes");
        assert_success(&c.unmount("node-a", &adir));
    }
    assert!(c.scratch.mounts().is_empty() && c.scratch.loops().is_empty(), "nothing left mounted or attached");
}
