//! The kubelet tier itself: two nodes register and become Ready, and a pod
//! on each runs its container and reports its output. Needs root; fails
//! (does not skip) without it or without the assets.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use volagent_kube_env::KubeEnv;
use volagent_kube_env::node::{self, Containerd, ControllerManager, Kubelet};

#[test]
fn two_nodes_run_pods() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "needs root: it runs kubelets and containerd (CI runs it as root)"
    );
    let assets = node::node_assets().expect("kubelet tier assets");
    node::become_subreaper().expect("subreaper");
    let ns = node::enter_node_namespaces().expect("namespaces");
    let scratch =
        tempfile::Builder::new().prefix("volagent-nodes-").tempdir_in("/var/tmp").expect("scratch");
    // Dropped after the daemons, before the scratch dir, also on failure.
    let _teardown = Teardown(scratch.path().to_owned());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let env = rt.block_on(KubeEnv::start_in(Some(ns.clone()))).expect("API server");
    let client = {
        let _g = rt.enter();
        env.client()
    };
    let kcm = ControllerManager::start(&env, scratch.path(), &assets, Some(ns.clone()))
        .expect("controller-manager");
    let mut nodes = Vec::new();
    for (i, name) in ["node-a", "node-b"].into_iter().enumerate() {
        let dir = scratch.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let c = Containerd::start(
            &dir.join("containerd"),
            i as u8 + 1,
            &assets.image,
            Some(ns.clone()),
        )
        .expect("containerd");
        let k = Kubelet::start(&env, name, &dir, &c, &assets).expect("kubelet");
        nodes.push((c, k));
    }
    for (_, k) in &nodes {
        rt.block_on(node::wait_node_ready(&client, &k.name, Duration::from_secs(90), k))
            .expect("ready");
    }
    kcm.check().expect("controller-manager runs");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for (_, k) in &nodes {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("hello-{}", k.name)},
            "spec": {
                "nodeName": k.name,
                "restartPolicy": "Never",
                "automountServiceAccountToken": false,
                "containers": [{"name": "c", "image": node::IMAGE, "command": ["sh", "-c", "echo hi from $(hostname) > /dev/termination-log"]}]
            }
        })).unwrap();
        rt.block_on(pods.create(&PostParams::default(), &pod)).expect("create pod");
    }
    for (_, k) in &nodes {
        let name = format!("hello-{}", k.name);
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let p = rt.block_on(pods.get(&name)).expect("get");
            let phase = p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
            if phase == "Succeeded" {
                let msg = p.status.unwrap().container_statuses.unwrap()[0]
                    .state
                    .as_ref()
                    .unwrap()
                    .terminated
                    .as_ref()
                    .unwrap()
                    .message
                    .clone();
                assert_eq!(msg.as_deref().map(str::trim), Some(format!("hi from {name}").as_str()));
                break;
            }
            assert!(phase != "Failed", "{name} failed: {:?}", p.status);
            assert!(
                std::time::Instant::now() < deadline,
                "{name} not done: {:?}\n{}",
                p.status,
                volagent_kube_env::log_tail(k.log())
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

struct Teardown(std::path::PathBuf);

impl Drop for Teardown {
    fn drop(&mut self) {
        node::teardown(&self.0);
    }
}
