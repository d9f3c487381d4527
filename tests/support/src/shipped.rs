//! volagent in a test cluster as it ships: the namespaces, CRDs, RBAC and
//! admission webhook of `deploy/` applied as they are (the webhook's
//! `clientConfig` pointed at a controller on this machine instead of its
//! Service), the controller running as its ServiceAccount, and each node's
//! agent on a token of the agents' ServiceAccount bound to a pod on that
//! node — as the DaemonSet's projected token is. The admin kubeconfig is
//! for the test's own set-up only: a missing or excess grant fails a test.

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, Toleration};
use kube::api::{Api, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::discovery::{ApiCapabilities, ApiResource, Discovery, Scope};
use serde::Deserialize as _;
use serde_json::Value;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use volagent_kube_env::KubeEnv;

pub const AGENT_NAMESPACE: &str = "volagent-system";
pub const AGENT_ACCOUNT: &str = "volagent-agent";
pub const CONTROLLER_NAMESPACE: &str = "volagent-controller";
pub const CONTROLLER_ACCOUNT: &str = "volagent-controller";
/// The files of `deploy/` a cluster without its workloads gets, in order.
pub const FILES: [&str; 11] = [
    "namespace.yaml",
    "crds/attachments.volagent.io.yaml",
    "crds/nodecleanups.volagent.io.yaml",
    "crds/storageclusters.volagent.io.yaml",
    "crds/nodelocalvolumes.volagent.io.yaml",
    "crds/fencerequests.volagent.io.yaml",
    "crds/provisionrecords.volagent.io.yaml",
    "crds/backendpolicies.volagent.io.yaml",
    "rbac-agent.yaml",
    "rbac-controller.yaml",
    "admission-webhook.yaml",
];
/// Tokens outlive any test.
const TOKEN_SECONDS: i64 = 6 * 3600;

fn deploy_dir() -> PathBuf {
    crate::workspace().join("deploy")
}

/// Every object of `deploy/<file>`.
pub fn objects(file: &str) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(deploy_dir().join(file))
        .with_context(|| format!("reading deploy/{file}"))?;
    let mut out = Vec::new();
    for document in serde_norway::Deserializer::from_str(&text) {
        let object =
            Value::deserialize(document).with_context(|| format!("parsing deploy/{file}"))?;
        if !object.is_null() {
            out.push(object);
        }
    }
    Ok(out)
}

/// Apply [`FILES`] with server-side apply as the admin, waiting for each
/// CRD to be Established; the webhook is called at `webhook_url`.
pub async fn install(client: &kube::Client, webhook_url: &str) -> anyhow::Result<()> {
    install_files(client, &FILES, webhook_url).await
}

/// [`install`] without the admission webhook: the RBAC alone, for tests of
/// a store that involve no node (the ledger's conformance, leader election).
pub async fn install_rbac(client: &kube::Client) -> anyhow::Result<()> {
    install_files(client, &FILES[..FILES.len() - 1], "").await
}

async fn install_files(
    client: &kube::Client,
    files: &[&str],
    webhook_url: &str,
) -> anyhow::Result<()> {
    let mut discovery = Discovery::new(client.clone()).run().await?;
    for &file in files {
        for mut object in objects(file)? {
            if object["kind"] == "ValidatingWebhookConfiguration" {
                for hook in object["webhooks"].as_array_mut().into_iter().flatten() {
                    hook["clientConfig"] = serde_json::json!({ "url": webhook_url });
                }
            }
            let gvk = kube::core::GroupVersionKind::try_from(&serde_json::from_value::<
                kube::core::TypeMeta,
            >(object.clone())?)?;
            let (resource, caps) = resolve(&mut discovery, client, &gvk)
                .await?
                .with_context(|| format!("deploy/{file}: no {gvk:?}"))?;
            let name = object["metadata"]["name"].as_str().context("a named object")?.to_string();
            let api: Api<DynamicObject> =
                match (caps.scope, object["metadata"]["namespace"].as_str()) {
                    (Scope::Namespaced, Some(ns)) => {
                        Api::namespaced_with(client.clone(), ns, &resource)
                    }
                    _ => Api::all_with(client.clone(), &resource),
                };
            api.patch(&name, &PatchParams::apply("volagent-tests").force(), &Patch::Apply(&object))
                .await
                .with_context(|| format!("applying deploy/{file}: {name}"))?;
            if object["kind"] == "CustomResourceDefinition" {
                crate::kube_objects::wait_established(client, &name).await;
            }
        }
    }
    Ok(())
}

/// What serves `gvk`, discovering again once when it is unknown: perhaps a
/// kind a CRD applied just now serves. (Plain discovery: kube-apiserver
/// 1.20 has no aggregated discovery.)
pub async fn resolve(
    discovery: &mut Discovery,
    client: &kube::Client,
    gvk: &kube::core::GroupVersionKind,
) -> anyhow::Result<Option<(ApiResource, ApiCapabilities)>> {
    if let Some(found) = discovery.resolve_gvk(gvk) {
        return Ok(Some(found));
    }
    *discovery = Discovery::new(client.clone()).run().await?;
    Ok(discovery.resolve_gvk(gvk))
}

/// The pod node `node`'s agent runs as (its token is bound to it): in the
/// agents' namespace, on the node. Where a kubelet runs the node, it runs
/// the pod (`image`, sleeping); without one it is only an object.
pub async fn stand_in_pod(
    client: &kube::Client,
    node: &str,
    image: &str,
) -> anyhow::Result<(String, String)> {
    let api: Api<Pod> = Api::namespaced(client.clone(), AGENT_NAMESPACE);
    let name = format!("volagent-agent-{node}");
    if let Some(found) = api.get_opt(&name).await? {
        return Ok((name, found.metadata.uid.context("a pod has a UID")?));
    }
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(
                [("app.kubernetes.io/name".to_string(), "volagent-agent".to_string())].into(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            service_account_name: Some(AGENT_ACCOUNT.into()),
            automount_service_account_token: Some(false),
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "agent".into(),
                image: Some(image.into()),
                command: Some(vec!["sleep".into(), "86400".into()]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let created = api
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("the stand-in pod of node {node}'s agent"))?;
    Ok((name, created.metadata.uid.context("a pod has a UID")?))
}

/// A kubeconfig (written to `path`) for node `node`'s agent: a token of the
/// agents' ServiceAccount bound to its stand-in pod.
pub async fn agent_kubeconfig(
    env: &KubeEnv,
    node: &str,
    image: &str,
    path: &Path,
) -> anyhow::Result<PathBuf> {
    let (pod, uid) = stand_in_pod(&env.client(), node, image).await?;
    let token = env
        .service_account_token(AGENT_NAMESPACE, AGENT_ACCOUNT, Some((&pod, &uid)), TOKEN_SECONDS)
        .await?;
    env.kubeconfig_with_token(path, &format!("agent-{node}"), &token)?;
    Ok(path.to_path_buf())
}

/// A client acting as node `node`'s agent.
pub async fn agent_client(
    env: &KubeEnv,
    node: &str,
    image: &str,
    dir: &Path,
) -> anyhow::Result<kube::Client> {
    let path =
        agent_kubeconfig(env, node, image, &dir.join(format!("agent-{node}.kubeconfig"))).await?;
    client_from(&path).await
}

/// A client acting as ServiceAccount `namespace/name` (a token bound to
/// nothing), written as a kubeconfig into `dir`.
pub async fn account_client(
    env: &KubeEnv,
    namespace: &str,
    name: &str,
    dir: &Path,
) -> anyhow::Result<kube::Client> {
    let token = env.service_account_token(namespace, name, None, TOKEN_SECONDS).await?;
    let path = dir.join(format!("{namespace}-{name}.kubeconfig"));
    env.kubeconfig_with_token(&path, name, &token)?;
    client_from(&path).await
}

/// A kubeconfig (written to `path`) for the controller's ServiceAccount.
pub async fn controller_kubeconfig(env: &KubeEnv, path: &Path) -> anyhow::Result<PathBuf> {
    let token = env
        .service_account_token(CONTROLLER_NAMESPACE, CONTROLLER_ACCOUNT, None, TOKEN_SECONDS)
        .await?;
    env.kubeconfig_with_token(path, "controller", &token)?;
    Ok(path.to_path_buf())
}

pub async fn client_from(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let parsed = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(parsed, &Default::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// The controller's arguments: its kubeconfig, its namespace, and its
/// webhook on loopback port `port` (the URL [`install`] configured).
pub fn controller_args(kubeconfig: &Path, port: u16) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "controller",
        "--namespace",
        CONTROLLER_NAMESPACE,
        "--identity",
        "test-controller",
        "--lease-duration",
        "3s",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push("--kubeconfig".into());
    args.push(kubeconfig.into());
    args.push("--webhook-addr".into());
    args.push(format!("127.0.0.1:{port}").into());
    args.push("--webhook-host".into());
    args.push("127.0.0.1".into());
    args
}

pub fn webhook_url(port: u16) -> String {
    format!("https://127.0.0.1:{port}/validate")
}

/// Wait until the webhook answers the API server: an agent's dry-run write
/// naming another node is refused by it (not by a failed call).
pub async fn wait_webhook(agent: &kube::Client, node: &str) -> anyhow::Result<()> {
    let api: Api<volagent::kube::crds::Attachment> = Api::all(agent.clone());
    let probe: volagent::kube::crds::Attachment = serde_json::from_value(serde_json::json!({
        "apiVersion": "volagent.io/v1alpha1", "kind": "Attachment", "metadata": { "name": "volagent-webhook-probe" },
        "spec": { "backend": "probe", "accessMode": "ReadWriteOnce", "consumers": [{
            "node": format!("not-{node}"), "podNamespace": "default", "pod": "p", "podUID": "u", "mountDir": "/p", "since": "2026-01-01T00:00:00Z" }] }
    }))?;
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < Duration::from_secs(60) {
        match api.create(&PostParams { dry_run: true, ..Default::default() }, &probe).await {
            Err(kube::Error::Api(s)) if s.message.contains("may record only its own node's") => {
                return Ok(());
            }
            Err(e) => last = e.to_string(),
            Ok(_) => {
                anyhow::bail!("the webhook let node {node}'s agent record another node's consumer")
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("the admission webhook did not answer within 60 s (last: {last})")
}
