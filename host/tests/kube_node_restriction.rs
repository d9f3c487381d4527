//! A compromised node stays contained: with node A's agent token (the
//! agents' ServiceAccount, bound to a pod on node A, as the DaemonSet's
//! projected token is), every write that would reach another node is
//! refused — by RBAC or by the controller's admission webhook — and the
//! same action with node B's own token still works. Against a real
//! kube-apiserver with `deploy/`'s RBAC and webhook and the controller
//! running as its ServiceAccount; no root needed.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use volagent::kube::crds::{Attachment, FencePhase, FenceRequest, NodeCleanup, NodeLocalVolumes};
use volagent_kube_env::KubeEnv;
use volagent_test_support::{Deadline, kube_objects, shipped, wait_until_async};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");
/// How long the controller may take to act on a change (polled every 100 ms).
const API_WAIT: Deadline =
    Deadline::within(Duration::from_secs(30)).polling(Duration::from_millis(100));

/// The API server with deploy/ applied, the controller (and its webhook)
/// running as its ServiceAccount, Nodes node-a and node-b, and a client of
/// each node's agent.
struct Setup {
    controller: Child,
    env: KubeEnv,
    dir: tempfile::TempDir,
    a: kube::Client,
    b: kube::Client,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = self.controller.kill();
        let _ = self.controller.wait();
        if std::thread::panicking() {
            eprintln!(
                "controller log:\n{}",
                std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap_or_default()
            );
        }
    }
}

async fn start() -> Setup {
    let env = KubeEnv::start().await.expect("a real kube-apiserver (scripts/kube-assets)");
    let dir = tempfile::tempdir().unwrap();
    let port = volagent_kube_env::free_ports(1).unwrap()[0];
    shipped::install(&env.client(), &shipped::webhook_url(port)).await.unwrap();
    for n in ["node-a", "node-b"] {
        kube_objects::create_node(&env.client(), n, true).await;
    }
    let kubeconfig =
        shipped::controller_kubeconfig(&env, &dir.path().join("controller.kubeconfig"))
            .await
            .unwrap();
    let controller = Command::new(VOLAGENT)
        .args(shipped::controller_args(&kubeconfig, port))
        .args(["--local-interval", "1s"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("controller.log")).unwrap())
        .spawn()
        .unwrap();
    let a = shipped::agent_client(&env, "node-a", "busybox", dir.path()).await.unwrap();
    let b = shipped::agent_client(&env, "node-b", "busybox", dir.path()).await.unwrap();
    shipped::wait_webhook(&a, "node-a").await.unwrap();
    Setup { controller, env, dir, a, b }
}

/// The call was refused: by RBAC (403) or by the webhook (its message).
fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>, says: &str) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains(says) => {}
        other => panic!("{what}: expected a refusal saying {says:?}, got {other:?}"),
    }
}

fn consumer(node: &str) -> serde_json::Value {
    json!({ "node": node, "podNamespace": "default", "pod": format!("pod-{node}"), "podUID": format!("uid-{node}"),
            "mountDir": format!("/var/lib/kubelet/pods/uid-{node}/volumes/volagent~rbd/pv-1"), "since": "2026-01-01T00:00:00Z" })
}

fn attachment(consumers: &[serde_json::Value], clients: &[(&str, i64)]) -> Attachment {
    let clients: Vec<_> = clients
        .iter()
        .map(|(n, id)| json!({ "node": n, "id": id, "address": format!("10.0.0.9:0/{id}") }))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "volagent.io/v1alpha1", "kind": "Attachment", "metadata": { "name": "pv-1" },
        "spec": { "backend": "rbd", "accessMode": "ReadWriteOnce", "storageCluster": "ceph", "consumers": consumers, "storageClients": clients }
    }))
    .unwrap()
}

fn discovered(node: &str, class: &str, path: &str) -> serde_json::Value {
    let name = volagent::local::pv_name(node, class, std::path::Path::new(path));
    json!({ "name": name, "class": class, "path": path, "kind": "File", "capacity": "1Gi" })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_token_reaches_only_its_own_nodes_objects() {
    let t = start().await;
    let pp = PostParams::default();
    let admin = t.env.client();

    // NodeLocalVolumes: B's object and status are B's.
    let (la, lb): (Api<NodeLocalVolumes>, Api<NodeLocalVolumes>) =
        (Api::all(t.a.clone()), Api::all(t.b.clone()));
    refused(
        "A creates B's NodeLocalVolumes",
        la.create(&pp, &NodeLocalVolumes::new("node-b", Default::default())).await,
        "only its own node's NodeLocalVolumes",
    );
    lb.create(&pp, &NodeLocalVolumes::new("node-b", Default::default()))
        .await
        .expect("B creates its own");
    let status = json!({ "status": { "volumes": [discovered("node-b", "fast", "/mnt/fast/d1")] } });
    refused(
        "A writes B's status",
        la.patch_status("node-b", &PatchParams::default(), &Patch::Merge(&status)).await,
        "only its own node's NodeLocalVolumes",
    );
    lb.patch_status("node-b", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("B publishes what it discovered");
    // B itself cannot name a volume as it likes (e.g. after a victim's PV).
    let chosen = json!({ "status": { "volumes": [{ "name": "pvc-victim", "class": "fast", "path": "/mnt/tenant/data", "kind": "File", "capacity": "1Gi" }] } });
    refused(
        "B names a volume as it likes",
        lb.patch_status("node-b", &PatchParams::default(), &Patch::Merge(&chosen)).await,
        "that volume is",
    );
    let ops = json!({ "spec": { "operations": [{ "volume": "x", "kind": "Delete", "pvUID": "u", "requestedAt": "t" }] } });
    refused(
        "B requests a wipe",
        lb.patch("node-b", &PatchParams::default(), &Patch::Merge(&ops)).await,
        "forbidden",
    );

    // Attachments: B's holder is B's while B lives.
    let (aa, ab): (Api<Attachment>, Api<Attachment>) =
        (Api::all(t.a.clone()), Api::all(t.b.clone()));
    refused(
        "A records a consumer on B",
        aa.create(&pp, &attachment(&[consumer("node-b")], &[])).await,
        "names node node-b",
    );
    let held = ab
        .create(&pp, &attachment(&[consumer("node-b")], &[("node-b", 41)]))
        .await
        .expect("B records its own consumer and client");
    let mut stolen = held.clone();
    stolen.spec.consumers = vec![serde_json::from_value(consumer("node-a")).unwrap()];
    refused(
        "A replaces B's holder with its own",
        aa.replace("pv-1", &pp, &stolen).await,
        "node node-b is not gone",
    );
    let mut moved = held.clone();
    moved.spec.consumers[0].mount_dir =
        "/var/lib/kubelet/pods/uid-a/volumes/volagent~rbd/elsewhere".into();
    refused(
        "A rewrites B's holder",
        aa.replace("pv-1", &pp, &moved).await,
        "may not change node node-b's",
    );
    refused(
        "A deletes B's record",
        aa.delete("pv-1", &DeleteParams::default()).await,
        "node node-b still holds it",
    );
    let mut rwx = held.clone();
    rwx.spec.access_mode = volagent::kube::crds::AccessMode::ReadWriteMany;
    refused(
        "A changes what B's volume is",
        aa.replace("pv-1", &pp, &rwx).await,
        "while other nodes hold it",
    );

    // Fencing B: A's request is checked by the controller, which refuses
    // while B lives; A cannot ask as B, nor delete B's request.
    let (fa, fb): (Api<FenceRequest>, Api<FenceRequest>) =
        (Api::all(t.a.clone()), Api::all(t.b.clone()));
    let request = |requester: &str, node: &str| -> FenceRequest {
        serde_json::from_value(json!({
            "apiVersion": "volagent.io/v1alpha1", "kind": "FenceRequest", "metadata": { "name": FenceRequest::name_for("pv-1", &format!("{requester}-{node}")) },
            "spec": { "volume": "pv-1", "requester": requester, "node": node, "address": "10.0.0.9:0/41" }
        }))
        .unwrap()
    };
    refused("A asks as B", fa.create(&pp, &request("node-b", "node-a")).await, "only as itself");
    let asked = fa.create(&pp, &request("node-a", "node-b")).await.expect("A may ask");
    let name = asked.metadata.name.clone().unwrap();
    let answer = wait_until_async(API_WAIT, "the fence request's answer", || async {
        fa.get(&name).await.ok().and_then(|r| r.status)
    })
    .await;
    assert_eq!(answer.phase, FencePhase::Refused, "{answer:?}");
    assert!(
        answer.message.as_deref().unwrap_or("").contains("node node-b is not gone"),
        "{answer:?}"
    );
    refused(
        "B deletes A's request",
        fb.delete(&name, &DeleteParams::default()).await,
        "not node node-b's",
    );
    fa.delete(&name, &DeleteParams::default()).await.expect("A deletes its own");
    let answered = json!({ "status": { "phase": "Fenced", "answeredAt": "2026-01-01T00:00:00Z" } });
    refused(
        "A answers a request itself",
        fa.patch_status(&name, &PatchParams::default(), &Patch::Merge(&answered)).await,
        "forbidden",
    );

    // Cleanup lists: B's is B's to work off, and only to work off.
    let entry = json!({ "volume": "pv-1", "backend": "rbd", "accessMode": "ReadWriteOnce", "consumer": consumer("node-b"), "reason": "NodeGone", "movedAt": "2026-01-01T00:00:01Z" });
    let list: NodeCleanup = serde_json::from_value(json!({ "apiVersion": "volagent.io/v1alpha1", "kind": "NodeCleanup", "metadata": { "name": "node-b" }, "spec": { "entries": [entry] } })).unwrap();
    Api::<NodeCleanup>::all(admin.clone()).create(&pp, &list).await.unwrap();
    let (ca, cb): (Api<NodeCleanup>, Api<NodeCleanup>) =
        (Api::all(t.a.clone()), Api::all(t.b.clone()));
    let mut emptied = ca.get("node-b").await.unwrap();
    emptied.spec.entries.clear();
    refused(
        "A empties B's cleanup list",
        ca.replace("node-b", &pp, &emptied).await,
        "only its own node's NodeCleanup",
    );
    let mut added = ca.get("node-b").await.unwrap();
    added.spec.entries.push(added.spec.entries[0].clone());
    added.spec.entries[1].consumer.mount_dir =
        "/var/lib/kubelet/pods/uid-x/volumes/volagent~rbd/pv-1".into();
    refused(
        "B adds to its cleanup list",
        cb.replace("node-b", &pp, &added).await,
        "only take entries out",
    );
    refused(
        "A creates a cleanup list",
        ca.create(&pp, &{
            let mut l = list.clone();
            l.metadata = ObjectMeta { name: Some("node-a".into()), ..Default::default() };
            l
        })
        .await,
        "forbidden",
    );
    cb.replace("node-b", &pp, &emptied).await.expect("B works its list off");
    wait_until_async(API_WAIT, "node-b's cleanup list to go", || async {
        cb.get_opt("node-b").await.ok().and_then(|l| l.is_none().then_some(()))
    })
    .await;

    // Secrets: only the agents' namespace.
    Api::<Namespace>::all(admin.clone())
        .create(&pp, &serde_json::from_value(json!({ "metadata": { "name": "tenant" } })).unwrap())
        .await
        .unwrap();
    for ns in [shipped::AGENT_NAMESPACE, shipped::CONTROLLER_NAMESPACE, "tenant", "kube-system"] {
        let secret: Secret = serde_json::from_value(
            json!({ "metadata": { "name": "creds" }, "stringData": { "key": "AQB" } }),
        )
        .unwrap();
        Api::<Secret>::namespaced(admin.clone(), ns).create(&pp, &secret).await.unwrap();
    }
    Api::<Secret>::namespaced(t.b.clone(), shipped::AGENT_NAMESPACE)
        .get("creds")
        .await
        .expect("B reads the nodes' credentials");
    Api::<Secret>::namespaced(t.a.clone(), shipped::AGENT_NAMESPACE)
        .get("creds")
        .await
        .expect("so does A");
    for ns in [shipped::CONTROLLER_NAMESPACE, "tenant", "kube-system"] {
        refused(
            &format!("A reads a Secret in {ns}"),
            Api::<Secret>::namespaced(t.a.clone(), ns).get("creds").await,
            "forbidden",
        );
    }

    // A token of the agents' ServiceAccount bound to no pod names no node.
    let unbound = shipped::account_client(
        &t.env,
        shipped::AGENT_NAMESPACE,
        shipped::AGENT_ACCOUNT,
        t.dir.path(),
    )
    .await
    .unwrap();
    let mut own = attachment(&[consumer("node-a")], &[]);
    own.metadata.name = Some("pv-2".into());
    refused(
        "an unbound token writes",
        Api::<Attachment>::all(unbound).create(&pp, &own).await,
        "not bound to its pod",
    );

    // B gone (out of service): A may take its holder out, as a take-over does.
    kube_objects::taint_out_of_service(&admin, "node-b").await;
    let current = aa.get("pv-1").await.unwrap();
    let mut taken = current.clone();
    taken.spec.consumers = vec![serde_json::from_value(consumer("node-a")).unwrap()];
    taken.spec.storage_clients.clear();
    aa.replace("pv-1", &pp, &taken).await.expect("A takes a gone node's volume over");
    // B, back, may not put itself back in beside A.
    let mut back = aa.get("pv-1").await.unwrap();
    back.spec.consumers.push(serde_json::from_value(consumer("node-b")).unwrap());
    ab.replace("pv-1", &pp, &back)
        .await
        .expect("B may add its own holder (fencing is the policy's)");
    let mut kick = ab.get("pv-1").await.unwrap();
    kick.spec.consumers.retain(|c| c.node == "node-b");
    refused(
        "B removes A's holder",
        ab.replace("pv-1", &pp, &kick).await,
        "node node-a is not gone",
    );
}

/// The controller takes no node's report on trust: a volume whose name is
/// not the one discovery gives its path on that node, and a path or device
/// another PV already offers, get no PV; a good volume in the same report
/// does. (Written as the admin here, as a cluster without the webhook
/// would let an agent write them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_makes_pvs_only_of_reports_it_can_verify() {
    let t = start().await;
    let admin = t.env.client();
    let class: StorageClass = serde_json::from_value(json!({ "metadata": { "name": "fast" }, "provisioner": "kubernetes.io/no-provisioner", "reclaimPolicy": "Delete" })).unwrap();
    Api::<StorageClass>::all(admin.clone()).create(&PostParams::default(), &class).await.unwrap();
    let lists: Api<NodeLocalVolumes> = Api::all(admin.clone());
    let good = discovered("node-b", "fast", "/mnt/fast/good");
    let mut misnamed = discovered("node-b", "fast", "/mnt/tenant/data");
    misnamed["name"] = json!("pvc-victim");
    let borrowed = discovered("node-a", "fast", "/mnt/fast/borrowed"); // node-a's name, in node-b's list
    let mut disk_b = discovered("node-b", "fast", "/mnt/fast/disk");
    disk_b["kind"] = json!("Block");
    disk_b["device"] = json!("/dev/sdb");
    disk_b["identity"] = json!("wwn-0x5000");
    let mut disk_a = discovered("node-a", "fast", "/mnt/fast/disk");
    disk_a["kind"] = json!("Block");
    disk_a["device"] = json!("/dev/sdc");
    disk_a["identity"] = json!("wwn-0x5000");
    for (node, volumes) in
        [("node-b", json!([good, misnamed, borrowed, disk_b])), ("node-a", json!([]))]
    {
        lists
            .create(&PostParams::default(), &NodeLocalVolumes::new(node, Default::default()))
            .await
            .unwrap();
        lists
            .patch_status(
                node,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": { "volumes": volumes } })),
            )
            .await
            .unwrap();
    }
    let pvs: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(admin.clone());
    let name = |v: &serde_json::Value| v["name"].as_str().unwrap().to_string();
    wait_until_async(API_WAIT, "the good disk's PV", || async {
        pvs.get_opt(&name(&good)).await.ok().flatten()
    })
    .await;
    wait_until_async(API_WAIT, "node-b's disk's PV", || async {
        pvs.get_opt(&name(&disk_b)).await.ok().flatten()
    })
    .await;
    // node-a now reports the same disk (by identity) under its own name.
    lists
        .patch_status(
            "node-a",
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": { "volumes": [disk_a] } })),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    for bad in ["pvc-victim".to_string(), name(&borrowed), name(&disk_a)] {
        assert!(pvs.get_opt(&bad).await.unwrap().is_none(), "no PV for {bad}");
    }
    let log = std::fs::read_to_string(t.dir.path().join("controller.log")).unwrap();
    for says in ["on node node-b that volume is", "device wwn-0x5000 is already offered by PV"] {
        assert!(log.contains(says), "the controller says why ({says}):\n{log}");
    }
}
