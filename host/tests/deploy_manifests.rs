//! `deploy/` against a real kube-apiserver (1.20.2, from `tests/kube-env`).
//!
//! The files `deploy/kustomization.yaml` lists are applied in its order with
//! server-side apply, as `kubectl apply -k deploy/` would create them: the
//! namespace, CRDs and RBAC for real, the workloads (DaemonSet, Deployment)
//! as dry runs, since nothing here would run their pods. The API server must
//! keep every field the files set (a misspelt or misplaced field fails), and
//! a pod from each workload's template must pass pod admission. Then the RBAC
//! the files created is checked by acting as each service account: the calls
//! it needs succeed, others are forbidden, and an access review of a fixed
//! set of resources and verbs finds exactly the grants issue 4 specifies.
//!
//! The tests that need the API server fail (they do not skip) when its
//! binaries are missing: run `scripts/kube-assets`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Event, Namespace, Node, ObjectReference, PersistentVolume, PodSpec,
    Secret,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::core::GroupVersionKind;
use kube::discovery::{ApiResource, Discovery, Scope};
use serde::Deserialize;
use serde_json::{Value, json};
use volagent_kube_env::KubeEnv;

const NAMESPACE: &str = "volagent-system";
/// The controller's own namespace: its Lease, webhook certificate and the
/// credentials no node may read.
const CONTROLLER_NS: &str = "volagent-controller";
const AGENT_SA: &str = "volagent-agent";
const CONTROLLER_SA: &str = "volagent-controller";
const LEASE: &str = "volagent-controller";
const WEBHOOK: &str = "volagent-node-restriction";
const WEBHOOK_TLS: &str = "volagent-admission-tls";
const FIELD_MANAGER: &str = "volagent-deploy-test";
/// Applied as dry runs: their pods would need nodes, images and a kubelet.
const WORKLOAD_KINDS: [&str; 2] = ["DaemonSet", "Deployment"];

// --- the manifests ---------------------------------------------------------

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The parts of a kustomization this test understands; anything else (a
/// `namespace:`, patches, labels) would make `kubectl apply -k` produce
/// objects other than the files', so it fails the parse.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    api_version: String,
    kind: String,
    resources: Vec<String>,
    #[serde(default)]
    images: Vec<ImageOverride>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ImageOverride {
    name: String,
    new_name: Option<String>,
    new_tag: Option<String>,
}

impl ImageOverride {
    /// The image kustomize puts where `image` was, if this entry is for it.
    fn rewrite(&self, image: &str) -> Option<String> {
        let (name, tag) = match image.rsplit_once(':') {
            Some((n, t)) if !t.contains('/') => (n, Some(t)),
            _ => (image, None),
        };
        if name != self.name {
            return None;
        }
        let name = self.new_name.as_deref().unwrap_or(name);
        Some(match self.new_tag.as_deref().or(tag) {
            Some(tag) => format!("{name}:{tag}"),
            None => name.to_string(),
        })
    }
}

/// One object from one of the listed files.
struct Manifest {
    file: String,
    object: Value,
}

impl Manifest {
    fn kind(&self) -> &str {
        self.object["kind"].as_str().unwrap_or_default()
    }
    fn name(&self) -> &str {
        self.object["metadata"]["name"].as_str().unwrap_or_default()
    }
    fn namespace(&self) -> Option<&str> {
        self.object["metadata"]["namespace"].as_str()
    }
    fn describe(&self) -> String {
        format!("{} {} (in {})", self.kind(), self.name(), self.file)
    }
    fn gvk(&self) -> anyhow::Result<GroupVersionKind> {
        let api_version = self.object["apiVersion"]
            .as_str()
            .with_context(|| format!("{}: no apiVersion", self.describe()))?;
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        ensure!(!self.kind().is_empty(), "{}: no kind", self.file);
        Ok(GroupVersionKind::gvk(group, version, self.kind()))
    }
}

fn kustomization() -> anyhow::Result<Kustomization> {
    let path = deploy_dir().join("kustomization.yaml");
    let text = std::fs::read_to_string(&path).context("reading deploy/kustomization.yaml")?;
    let k: Kustomization =
        serde_norway::from_str(&text).context("parsing deploy/kustomization.yaml")?;
    ensure!(
        k.api_version == "kustomize.config.k8s.io/v1beta1" && k.kind == "Kustomization",
        "deploy/kustomization.yaml is a {} {}",
        k.api_version,
        k.kind
    );
    Ok(k)
}

/// Every object of every file the kustomization lists, in its order, as
/// the files have them.
fn raw_manifests(k: &Kustomization) -> anyhow::Result<Vec<Manifest>> {
    let mut out = Vec::new();
    for file in &k.resources {
        let text = std::fs::read_to_string(deploy_dir().join(file))
            .with_context(|| format!("reading deploy/{file}"))?;
        for document in serde_norway::Deserializer::from_str(&text) {
            let object =
                Value::deserialize(document).with_context(|| format!("parsing deploy/{file}"))?;
            if object.is_null() {
                continue; // an empty document, e.g. after a trailing `---`
            }
            out.push(Manifest { file: file.clone(), object });
        }
    }
    Ok(out)
}

/// [`raw_manifests`] with the kustomization's `images:` applied as kustomize
/// applies them.
fn manifests(k: &Kustomization) -> anyhow::Result<Vec<Manifest>> {
    let mut out = raw_manifests(k)?;
    for m in &mut out {
        for container in containers_mut(&mut m.object) {
            let rewritten = container["image"]
                .as_str()
                .and_then(|image| k.images.iter().find_map(|o| o.rewrite(image)));
            if let Some(image) = rewritten {
                container["image"] = Value::String(image);
            }
        }
    }
    Ok(out)
}

/// The containers and init containers of a workload's pod template.
fn containers_mut(object: &mut Value) -> Vec<&mut Value> {
    // Not `object["spec"]…`: indexing a Value mutably inserts what is missing.
    let Some(spec) = object.pointer_mut("/spec/template/spec").and_then(Value::as_object_mut)
    else {
        return Vec::new();
    };
    spec.iter_mut()
        .filter(|(key, _)| *key == "containers" || *key == "initContainers")
        .filter_map(|(_, list)| list.as_array_mut())
        .flatten()
        .collect()
}

/// Every `*.yaml` / `*.yml` under `dir`, relative to it.
fn yaml_files(dir: &Path, prefix: &str, out: &mut BTreeSet<String>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let rel = format!("{prefix}{name}");
        if entry.file_type()?.is_dir() {
            yaml_files(&entry.path(), &format!("{rel}/"), out)?;
        } else if name.ends_with(".yaml") || name.ends_with(".yml") {
            out.insert(rel);
        }
    }
    Ok(())
}

// --- applying them ---------------------------------------------------------

/// What the API server answered to one object's apply.
struct Applied {
    manifest: Manifest,
    answer: Value,
}

/// Applies the kustomization's objects in order: workloads as dry runs, the
/// rest for real (waiting for each CRD to be Established); the admission
/// webhook's configuration only `with_webhook` (its controller does not run
/// here, and with failurePolicy Fail it would refuse every write it covers).
async fn apply_deploy(env: &KubeEnv, with_webhook: bool) -> anyhow::Result<Vec<Applied>> {
    let client = env.client();
    // Plain discovery: kube-apiserver 1.20 has no aggregated discovery.
    let mut discovery = Discovery::new(client.clone()).run().await?;
    let mut applied = Vec::new();
    for m in manifests(&kustomization()?)? {
        if !with_webhook && m.kind() == "ValidatingWebhookConfiguration" {
            continue;
        }
        let gvk = m.gvk()?;
        let (resource, caps) = match discovery.resolve_gvk(&gvk) {
            Some(found) => found,
            None => {
                // Perhaps a kind a CRD applied earlier serves.
                discovery = Discovery::new(client.clone()).run().await?;
                discovery
                    .resolve_gvk(&gvk)
                    .with_context(|| format!("{}: the API server has no {gvk:?}", m.describe()))?
            }
        };
        ensure!(!m.name().is_empty(), "{}: no metadata.name", m.describe());
        let api: Api<DynamicObject> = match (caps.scope, m.namespace()) {
            (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
            (Scope::Namespaced, None) => bail!(
                "{}: a namespaced object must name its namespace (else it lands in the \
                 namespace of whoever applies it)",
                m.describe()
            ),
            (Scope::Cluster, None) => Api::all_with(client.clone(), &resource),
            (Scope::Cluster, Some(ns)) => {
                bail!("{}: cluster-scoped, but names namespace {ns}", m.describe())
            }
        };
        let mut params = PatchParams::apply(FIELD_MANAGER);
        if WORKLOAD_KINDS.contains(&m.kind()) {
            params = params.dry_run();
        }
        let answer = api
            .patch(m.name(), &params, &Patch::Apply(&m.object))
            .await
            .with_context(|| format!("server-side apply of {}", m.describe()))?;
        if m.kind() == "CustomResourceDefinition" {
            wait_established(&client, m.name()).await?;
        }
        applied.push(Applied { answer: serde_json::to_value(answer)?, manifest: m });
    }
    Ok(applied)
}

async fn wait_established(client: &kube::Client, crd: &str) -> anyhow::Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let current = crds.get(crd).await?;
        let established = current
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "CRD {crd} not Established after 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Where `want` (a manifest) has a field `got` (what the API server stored)
/// lacks or holds otherwise.
fn differences(want: &Value, got: &Value, path: &str, out: &mut Vec<String>) {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (key, w) in w {
                let path = format!("{path}.{key}");
                match g.get(key) {
                    Some(g) => differences(w, g, &path, out),
                    None => out.push(format!("{path}: dropped by the API server")),
                }
            }
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => {
            for (i, (w, g)) in w.iter().zip(g).enumerate() {
                differences(w, g, &format!("{path}[{i}]"), out);
            }
        }
        (w, g) if w == g => {}
        (w, g) => out.push(format!("{path}: applied {w}, stored {g}")),
    }
}

fn applied<'a>(all: &'a [Applied], kind: &str, name: &str) -> anyhow::Result<&'a Applied> {
    all.iter()
        .find(|a| a.manifest.kind() == kind && a.manifest.name() == name)
        .with_context(|| format!("deploy/ has no {kind} {name}"))
}

fn container<'a>(pod: &'a PodSpec, name: &str) -> anyhow::Result<&'a Container> {
    pod.containers.iter().find(|c| c.name == name).with_context(|| format!("no container {name:?}"))
}

fn field_ref_env(c: &Container, name: &str) -> Option<String> {
    c.env
        .as_ref()?
        .iter()
        .find(|e| e.name == name)?
        .value_from
        .as_ref()?
        .field_ref
        .as_ref()
        .map(|f| f.field_path.clone())
}

fn http_probe(probe: Option<&k8s_openapi::api::core::v1::Probe>) -> Option<(String, String)> {
    let get = probe?.http_get.as_ref()?;
    let port = match &get.port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => p.to_string(),
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
    };
    Some((get.path.clone().unwrap_or_default(), port))
}

fn args(list: &[&str]) -> Option<Vec<String>> {
    Some(list.iter().map(|s| s.to_string()).collect())
}

// --- acting as the service accounts ---------------------------------------

/// A client that acts as service account `namespace/sa`: the admin
/// kubeconfig with impersonation (the admin is in system:masters, which may
/// impersonate). The API server adds the service-account groups itself.
async fn client_as(env: &KubeEnv, namespace: &str, sa: &str) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(env.kubeconfig_path())?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    config.auth_info.impersonate = Some(format!("system:serviceaccount:{namespace}:{sa}"));
    Ok(kube::Client::try_from(config)?)
}

fn code<T: std::fmt::Debug>(result: &Result<T, kube::Error>) -> Option<u16> {
    match result {
        Ok(_) => None,
        Err(kube::Error::Api(status)) => Some(status.code),
        Err(_) => Some(0),
    }
}

/// Fails unless the call was refused with 403 Forbidden.
fn forbidden<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) -> anyhow::Result<()> {
    ensure!(code(&result) == Some(403), "{what}: expected 403 Forbidden, got {result:?}");
    Ok(())
}

fn crd_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("volagent.io", "v1alpha1", kind),
        plural,
    )
}

fn attachment(name: &str) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "volagent.io/v1alpha1",
        "kind": "Attachment",
        "metadata": { "name": name },
        "spec": { "backend": "rbd", "accessMode": "ReadWriteOnce", "consumers": [] },
    }))?)
}

fn lease(name: &str) -> Lease {
    Lease {
        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
        spec: Some(LeaseSpec {
            holder_identity: Some("volagent-controller-0".into()),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }),
    }
}

/// An event about a node: in `default`, where events about cluster-scoped
/// objects go.
fn event(name: &str, node: &str) -> Event {
    Event {
        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
        involved_object: ObjectReference {
            kind: Some("Node".into()),
            name: Some(node.into()),
            ..ObjectReference::default()
        },
        reason: Some("Test".into()),
        message: Some("deploy manifests test".into()),
        type_: Some("Normal".into()),
        ..Event::default()
    }
}

/// What the admin sets up for the RBAC tests: the deploy/ objects (but the
/// webhook), a node, the nodes' backend secret in the agents' namespace,
/// the controller's in its own, another in a namespace of its own, and a
/// StorageCluster naming the first two.
async fn cluster_with_deploy(env: &KubeEnv) -> anyhow::Result<()> {
    apply_deploy(env, false).await?;
    let admin = env.client();
    let pp = PostParams::default();
    Api::<Node>::all(admin.clone())
        .create(&pp, &serde_json::from_value(json!({ "metadata": { "name": "node-1" } }))?)
        .await?;
    Api::<Namespace>::all(admin.clone())
        .create(&pp, &serde_json::from_value(json!({ "metadata": { "name": "ceph" } }))?)
        .await?;
    for namespace in ["ceph", NAMESPACE, CONTROLLER_NS] {
        Api::<Secret>::namespaced(admin.clone(), namespace)
            .create(
                &pp,
                &serde_json::from_value(json!({
                    "metadata": { "name": "ceph-a-keyring" },
                    "stringData": { "key": "AQB..." },
                }))?,
            )
            .await?;
    }
    let clusters: Api<DynamicObject> =
        Api::all_with(admin.clone(), &crd_resource("StorageCluster", "storageclusters"));
    clusters
        .create(
            &pp,
            &serde_json::from_value(json!({
                "apiVersion": "volagent.io/v1alpha1",
                "kind": "StorageCluster",
                "metadata": { "name": "ceph-a" },
                "spec": {
                    "backend": "rbd",
                    "endpoints": ["10.0.0.1:6789"],
                    "secretRef": { "namespace": NAMESPACE, "name": "ceph-a-keyring" },
                    "controllerCredentials": {
                        "user": "volagent-controller",
                        "secretRef": { "namespace": CONTROLLER_NS, "name": "ceph-a-keyring" },
                    },
                },
            }))?,
        )
        .await?;
    let cleanups: Api<DynamicObject> =
        Api::all_with(admin, &crd_resource("NodeCleanup", "nodecleanups"));
    cleanups
        .create(
            &pp,
            &serde_json::from_value(json!({
                "apiVersion": "volagent.io/v1alpha1",
                "kind": "NodeCleanup",
                "metadata": { "name": "node-1" },
                "spec": { "entries": [] },
            }))?,
        )
        .await?;
    Ok(())
}

// --- the access matrix -----------------------------------------------------

const VERBS: [&str; 8] =
    ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"];

/// (group, resource, subresource, namespaced) checked for both accounts.
const RESOURCES: [(&str, &str, &str, bool); 22] = [
    ("volagent.io", "attachments", "", false),
    ("volagent.io", "fencerequests", "", false),
    ("volagent.io", "fencerequests", "status", false),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "", false),
    ("volagent.io", "nodelocalvolumes", "", false),
    ("volagent.io", "nodelocalvolumes", "status", false),
    ("storage.k8s.io", "storageclasses", "", false),
    ("volagent.io", "nodecleanups", "", false),
    ("volagent.io", "storageclusters", "", false),
    ("volagent.io", "storageclusters", "status", false),
    ("", "nodes", "", false),
    ("", "nodes", "status", false),
    ("", "persistentvolumes", "", false),
    ("", "secrets", "", true),
    ("", "events", "", true),
    ("", "pods", "", true),
    ("", "configmaps", "", true),
    ("", "persistentvolumeclaims", "", true),
    ("coordination.k8s.io", "leases", "", true),
    ("apps", "daemonsets", "", true),
    ("rbac.authorization.k8s.io", "clusterroles", "", false),
    ("apiextensions.k8s.io", "customresourcedefinitions", "", false),
];

/// One grant of issue 4's RBAC: `namespace` None is cluster-wide,
/// `names` None is any name.
struct Grant {
    group: &'static str,
    resource: &'static str,
    verbs: &'static [&'static str],
    namespace: Option<&'static str>,
    names: Option<&'static [&'static str]>,
}

const fn grant(
    group: &'static str,
    resource: &'static str,
    verbs: &'static [&'static str],
) -> Grant {
    Grant { group, resource, verbs, namespace: None, names: None }
}

const READ: &[&str] = &["get", "list", "watch"];

const AGENT_GRANTS: &[Grant] = &[
    grant("volagent.io", "attachments", &["get", "list", "watch", "create", "update", "delete"]),
    grant("volagent.io", "nodecleanups", &["get", "list", "watch", "update", "patch"]),
    grant("volagent.io", "storageclusters", READ),
    // A take-over's request that the controller fence a gone node.
    grant("volagent.io", "fencerequests", &["get", "create", "delete"]),
    // Its node's local volumes: the object, and the status it writes.
    grant("volagent.io", "nodelocalvolumes", &["get", "list", "watch", "create"]),
    grant("volagent.io", "nodelocalvolumes/status", &["get", "patch", "update"]),
    grant("", "nodes", READ),
    grant("", "persistentvolumes", READ),
    // A mount's pod and its claim are read back (found by the DaemonSet
    // tier: the agent in its pod was refused).
    grant("", "pods", &["get"]),
    grant("", "persistentvolumeclaims", &["get"]),
    // Credentials: only in its own namespace.
    Grant { namespace: Some(NAMESPACE), ..grant("", "secrets", &["get"]) },
    grant("", "events", &["create", "patch"]),
];

const CONTROLLER_GRANTS: &[Grant] = &[
    grant("volagent.io", "attachments", &["get", "list", "watch", "update", "delete"]),
    grant(
        "volagent.io",
        "nodecleanups",
        &["get", "list", "watch", "create", "update", "patch", "delete"],
    ),
    grant("volagent.io", "fencerequests", &["get", "list", "watch", "delete"]),
    grant("volagent.io", "fencerequests/status", &["get", "update", "patch"]),
    grant("volagent.io", "storageclusters", &["get", "list", "watch", "update", "patch"]),
    grant("volagent.io", "storageclusters/status", &["get", "update", "patch"]),
    grant("", "nodes", READ),
    // Local volumes: the operations it requests, the PVs it makes and
    // deletes, the classes' reclaim policies and parameters.
    grant("volagent.io", "nodelocalvolumes", &["get", "list", "watch", "patch", "update"]),
    grant("", "persistentvolumes", &["get", "list", "watch", "create", "patch", "delete"]),
    grant("storage.k8s.io", "storageclasses", READ),
    grant("", "events", &["create", "patch"]),
    // Its webhook's CA, into its own configuration.
    Grant {
        names: Some(&[WEBHOOK]),
        ..grant(
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            &["get", "update"],
        )
    },
    // The agents' pods, to tell an agent's node (webhook).
    Grant { namespace: Some(NAMESPACE), ..grant("", "pods", &["get"]) },
    Grant { namespace: Some(CONTROLLER_NS), ..grant("coordination.k8s.io", "leases", &["create"]) },
    Grant {
        namespace: Some(CONTROLLER_NS),
        names: Some(&[LEASE]),
        ..grant("coordination.k8s.io", "leases", &["get", "update"])
    },
    // Its own namespace's Secrets: the credentials StorageClusters name
    // for it, and its webhook's certificate, which it makes and renews.
    Grant { namespace: Some(CONTROLLER_NS), ..grant("", "secrets", &["get", "create"]) },
    Grant {
        namespace: Some(CONTROLLER_NS),
        names: Some(&[WEBHOOK_TLS]),
        ..grant("", "secrets", &["update"])
    },
];

fn expected(grants: &[Grant], attrs: &ResourceAttributes) -> bool {
    let resource = match attrs.subresource.as_deref() {
        Some(sub) if !sub.is_empty() => {
            format!("{}/{sub}", attrs.resource.as_deref().unwrap_or_default())
        }
        _ => attrs.resource.clone().unwrap_or_default(),
    };
    let ns = attrs.namespace.as_deref().unwrap_or_default();
    let name = attrs.name.as_deref().unwrap_or_default();
    grants.iter().any(|g| {
        g.group == attrs.group.as_deref().unwrap_or_default()
            && g.resource == resource
            && g.verbs.contains(&attrs.verb.as_deref().unwrap_or_default())
            && g.namespace.is_none_or(|n| n == ns)
            && g.names.is_none_or(|names| !name.is_empty() && names.contains(&name))
    })
}

/// Asks the API server, as the client's user, about every verb on every
/// resource of [`RESOURCES`] (cluster-wide and, for namespaced ones, in
/// volagent-system and default; leases also by name) and lists where its
/// answer differs from `grants`.
async fn access_differences(client: kube::Client, grants: &[Grant]) -> anyhow::Result<Vec<String>> {
    let reviews: Api<SelfSubjectAccessReview> = Api::all(client);
    let mut wrong = Vec::new();
    for (group, resource, subresource, namespaced) in RESOURCES {
        let namespaces: &[&str] =
            if namespaced { &["", NAMESPACE, CONTROLLER_NS, "default"] } else { &[""] };
        let names: &[&str] = match resource {
            "leases" => &["", LEASE, "other"],
            "secrets" => &["", WEBHOOK_TLS, "other"],
            "validatingwebhookconfigurations" => &["", WEBHOOK, "other"],
            _ => &[""],
        };
        for ns in namespaces {
            for name in names {
                for verb in VERBS {
                    let attrs = ResourceAttributes {
                        group: Some(group.into()),
                        resource: Some(resource.into()),
                        subresource: Some(subresource.into()),
                        namespace: Some(ns.to_string()),
                        name: Some(name.to_string()),
                        verb: Some(verb.into()),
                        ..ResourceAttributes::default()
                    };
                    let review = SelfSubjectAccessReview {
                        spec: SelfSubjectAccessReviewSpec {
                            resource_attributes: Some(attrs.clone()),
                            ..SelfSubjectAccessReviewSpec::default()
                        },
                        ..SelfSubjectAccessReview::default()
                    };
                    let answer = reviews.create(&PostParams::default(), &review).await?;
                    let allowed = answer.status.is_some_and(|s| s.allowed);
                    let want = expected(grants, &attrs);
                    if allowed != want {
                        let full = if subresource.is_empty() {
                            resource.to_string()
                        } else {
                            format!("{resource}/{subresource}")
                        };
                        let group = if group.is_empty() { "core" } else { group };
                        wrong.push(format!(
                            "{verb} {group} {full} ns={ns:?} name={name:?}: allowed {allowed}, \
                             issue 4 says {want}"
                        ));
                    }
                }
            }
        }
    }
    Ok(wrong)
}

// --- the tests ---------------------------------------------------------------

#[test]
fn kustomization_lists_every_manifest_in_deploy() -> anyhow::Result<()> {
    let k = kustomization()?;
    let mut on_disk = BTreeSet::new();
    yaml_files(&deploy_dir(), "", &mut on_disk)?;
    on_disk.remove("kustomization.yaml");
    // admission-policy/ is a kustomization of its own (Kubernetes ≥ 1.30):
    // it lists its files, and the main one does not.
    let policy_dir = deploy_dir().join("admission-policy");
    let policy: Kustomization =
        serde_norway::from_str(&std::fs::read_to_string(policy_dir.join("kustomization.yaml"))?)?;
    let mut policy_files = BTreeSet::new();
    yaml_files(&policy_dir, "", &mut policy_files)?;
    policy_files.remove("kustomization.yaml");
    assert_eq!(
        policy.resources.iter().cloned().collect::<BTreeSet<_>>(),
        policy_files,
        "admission-policy/kustomization.yaml lists its files"
    );
    on_disk.retain(|f| !f.starts_with("admission-policy/"));
    let listed: BTreeSet<String> = k.resources.iter().cloned().collect();
    assert_eq!(listed.len(), k.resources.len(), "a file listed twice: {:?}", k.resources);
    let forgotten: Vec<_> = on_disk.difference(&listed).collect();
    let missing: Vec<_> = listed.difference(&on_disk).collect();
    assert!(forgotten.is_empty(), "in deploy/ but not in kustomization.yaml: {forgotten:?}");
    assert!(missing.is_empty(), "in kustomization.yaml but not in deploy/: {missing:?}");
    for crd in [
        "crds/attachments.volagent.io.yaml",
        "crds/nodecleanups.volagent.io.yaml",
        "crds/storageclusters.volagent.io.yaml",
        "crds/fencerequests.volagent.io.yaml",
    ] {
        assert!(listed.contains(crd), "{crd} not listed");
    }
    // Applied in list order: what others need comes first.
    let position = |f: &str| k.resources.iter().position(|r| r == f);
    assert_eq!(position("namespace.yaml"), Some(0), "the namespace first");
    let last_crd = k.resources.iter().rposition(|r| r.starts_with("crds/"));
    let first_workload = ["agent-daemonset.yaml", "controller-deployment.yaml"]
        .iter()
        .filter_map(|f| position(f))
        .min();
    assert!(last_crd < first_workload && first_workload.is_some(), "CRDs before workloads");
    Ok(())
}

#[test]
fn every_workload_image_is_set_by_the_kustomization() -> anyhow::Result<()> {
    let k = kustomization()?;
    let mut images = Vec::new();
    for mut m in raw_manifests(&k)? {
        for c in containers_mut(&mut m.object) {
            images.push(c["image"].as_str().unwrap_or_default().to_string());
        }
    }
    ensure!(images.len() >= 2, "workload images: {images:?}");
    for image in &images {
        let rewritten = k
            .images
            .iter()
            .find_map(|o| o.rewrite(image))
            .with_context(|| format!("image {image:?} has no images: entry"))?;
        ensure!(
            rewritten.contains('/') && rewritten.contains(':'),
            "image {image} becomes {rewritten}: no registry or tag"
        );
    }
    Ok(())
}

#[test]
fn the_image_ships_what_the_daemonset_runs() -> anyhow::Result<()> {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile"))?;
    let entrypoint = dockerfile
        .lines()
        .find(|l| l.starts_with("ENTRYPOINT"))
        .context("deploy/Dockerfile has no ENTRYPOINT")?;
    ensure!(
        entrypoint.contains("tini") && entrypoint.contains("\"/opt/volagent/volagent\""),
        "ENTRYPOINT: {entrypoint}"
    );
    ensure!(
        dockerfile.contains("/opt/volagent/plugins/") && dockerfile.contains("volagent-flex"),
        "the image must ship volagent-flex and the default plugins in /opt/volagent/plugins"
    );
    let all = manifests(&kustomization()?)?;
    let ds = all.iter().find(|m| m.kind() == "DaemonSet").context("no DaemonSet")?;
    let args: Vec<&str> = ds.object["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .context("the agent's args")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let plugin_dir = args.iter().position(|a| *a == "--plugin-dir").and_then(|i| args.get(i + 1));
    ensure!(
        plugin_dir == Some(&"/opt/volagent/plugins"),
        "the DaemonSet's --plugin-dir is the image's /opt/volagent/plugins: {args:?}"
    );
    Ok(())
}

#[tokio::test]
async fn manifests_apply_in_order_to_a_real_apiserver_and_keep_every_field() -> anyhow::Result<()> {
    let env = KubeEnv::start().await?;
    let all = apply_deploy(&env, true).await?;

    // Nothing the files set was dropped or changed by the API server.
    let mut wrong = Vec::new();
    for a in &all {
        let mut here = Vec::new();
        differences(&a.manifest.object, &a.answer, "", &mut here);
        wrong.extend(here.into_iter().map(|d| format!("{}: {d}", a.manifest.describe())));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // The real ones exist; the workloads were dry runs.
    let admin = env.client();
    for ns in [NAMESPACE, CONTROLLER_NS] {
        Api::<Namespace>::all(admin.clone()).get(ns).await?;
    }
    for (ns, sa) in [(NAMESPACE, AGENT_SA), (CONTROLLER_NS, CONTROLLER_SA)] {
        Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin.clone(), ns)
            .get(sa)
            .await
            .with_context(|| format!("ServiceAccount {ns}/{sa}"))?;
    }
    let daemonsets: Api<DaemonSet> = Api::namespaced(admin.clone(), NAMESPACE);
    assert_eq!(code(&daemonsets.get(AGENT_SA).await), Some(404), "DaemonSet was a dry run");

    // A pod of each workload passes pod admission and validation (dry run):
    // the priority class resolves, privileged and hostPath are accepted.
    for (kind, name, ns) in
        [("DaemonSet", AGENT_SA, NAMESPACE), ("Deployment", CONTROLLER_SA, CONTROLLER_NS)]
    {
        let a = applied(&all, kind, name)?;
        let template = &a.answer["spec"]["template"];
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": format!("{name}-admission"), "namespace": ns,
                          "labels": template["metadata"]["labels"] },
            "spec": template["spec"],
        });
        let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(admin.clone(), ns);
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod)?;
        let created = pods
            .create(&PostParams { dry_run: true, ..PostParams::default() }, &pod)
            .await
            .with_context(|| format!("a pod from {kind} {name}'s template"))?;
        if kind == "DaemonSet" {
            let priority = created.spec.and_then(|s| s.priority);
            assert_eq!(priority, Some(2_000_001_000), "system-node-critical resolved");
        }
    }

    // The agent's DaemonSet, as the API server has it.
    let ds: DaemonSet =
        serde_json::from_value(applied(&all, "DaemonSet", AGENT_SA)?.answer.clone())?;
    let spec = ds.spec;
    assert_eq!(
        spec.update_strategy.and_then(|u| u.type_).as_deref(),
        Some("OnDelete"),
        "FUSE daemons die with the agent's container: nodes are drained before it restarts"
    );
    let pod = spec.template.spec.context("pod spec")?;
    assert_eq!(pod.service_account_name.as_deref(), Some(AGENT_SA));
    // Its token is the projected, pod-bound one (the webhook tells its node
    // by the pod), not the legacy Secret token.
    assert_eq!(pod.automount_service_account_token, Some(false));
    let projected = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "service-account")
        .and_then(|v| v.projected.clone())
        .context("the projected service-account volume")?;
    let sources = projected.sources.unwrap_or_default();
    assert!(
        sources.iter().any(|s| s.service_account_token.as_ref().is_some_and(|t| t.path == "token")),
        "a projected token: {sources:?}"
    );
    assert!(
        sources.iter().any(|s| s.config_map.as_ref().is_some_and(|c| c.name == "kube-root-ca.crt")),
        "the cluster's CA: {sources:?}"
    );
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_ne!(pod.host_pid, Some(true), "hostPID is not needed");
    let tolerations = pod.tolerations.clone().unwrap_or_default();
    assert!(
        tolerations.iter().any(|t| t.operator.as_deref() == Some("Exists")
            && t.key.is_none()
            && t.effect.is_none()),
        "tolerates every taint: {tolerations:?}"
    );
    let agent = container(&pod, "agent")?;
    assert_eq!(
        agent.image.as_deref(),
        Some("ghcr.io/volagent/volagent:0.1.0"),
        "the kustomization's images: entry"
    );
    assert_eq!(agent.security_context.as_ref().and_then(|s| s.privileged), Some(true));
    assert_eq!(
        agent.args,
        args(&[
            "agent",
            "--in-cluster",
            "--runtime-dir",
            "/run/volagent",
            "--state-dir",
            "/var/lib/volagent",
            "--plugin-dir",
            "/opt/volagent/plugins",
            "--kubelet-root",
            "/var/lib/kubelet",
            "--volume-plugin-dir",
            "/usr/libexec/kubernetes/kubelet-plugins/volume/exec",
            "--metrics-addr",
            "$(NODE_IP):9479",
        ])
    );
    assert_eq!(agent.command, None, "the image's ENTRYPOINT (tini) stays");
    for (var, path) in [
        ("NODE_NAME", "spec.nodeName"),
        ("NODE_IP", "status.hostIP"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("POD_NAME", "metadata.name"),
        ("POD_UID", "metadata.uid"),
    ] {
        assert_eq!(field_ref_env(agent, var).as_deref(), Some(path), "env {var}");
    }
    let container_name = agent.env.iter().flatten().find(|e| e.name == "CONTAINER_NAME");
    assert_eq!(container_name.and_then(|e| e.value.as_deref()), Some("agent"));
    assert_eq!(http_probe(agent.liveness_probe.as_ref()), Some(("/healthz".into(), "9479".into())));
    assert_eq!(http_probe(agent.readiness_probe.as_ref()), Some(("/readyz".into(), "9479".into())));
    let requests = agent.resources.as_ref().and_then(|r| r.requests.clone());
    assert!(requests.is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")));

    // Host paths: each at the same path in the container as on the host.
    let volumes = pod.volumes.clone().unwrap_or_default();
    let mounts = agent.volume_mounts.clone().unwrap_or_default();
    let mut host_paths = BTreeSet::new();
    for v in volumes.iter().filter(|v| v.name != "service-account") {
        let host =
            v.host_path.as_ref().with_context(|| format!("volume {} is no hostPath", v.name))?;
        let mount = mounts
            .iter()
            .find(|m| m.name == v.name)
            .with_context(|| format!("volume {} is not mounted", v.name))?;
        assert_eq!(mount.mount_path, host.path, "volume {} at its host path", v.name);
        host_paths.insert((host.path.clone(), host.type_.clone().unwrap_or_default()));
        match host.path.as_str() {
            "/var/lib/kubelet" => assert_eq!(
                mount.mount_propagation.as_deref(),
                Some("Bidirectional"),
                "staging mounts made in the container must show on the host"
            ),
            "/lib/modules" => assert_eq!(mount.read_only, Some(true), "/lib/modules read-only"),
            "/run/volagent" => assert_eq!(host.type_.as_deref(), Some("DirectoryOrCreate")),
            _ => {}
        }
    }
    for path in [
        "/dev",
        "/sys",
        "/var/lib/kubelet",
        "/usr/libexec/kubernetes/kubelet-plugins/volume/exec",
        "/var/lib/volagent",
        "/run/volagent",
        "/lib/modules",
    ] {
        assert!(
            host_paths.iter().any(|(p, _)| p == path),
            "hostPath {path} missing: {host_paths:?}"
        );
    }

    // The controller's Deployment.
    let deploy: Deployment =
        serde_json::from_value(applied(&all, "Deployment", CONTROLLER_SA)?.answer.clone())?;
    let spec = deploy.spec;
    assert_eq!(spec.replicas, Some(2), "two replicas, one leader");
    let pod = spec.template.spec.context("pod spec")?;
    assert_eq!(pod.service_account_name.as_deref(), Some(CONTROLLER_SA));
    assert_eq!(pod.host_network, None);
    assert_eq!(pod.security_context.as_ref().and_then(|s| s.run_as_non_root), Some(true));
    let controller = container(&pod, "controller")?;
    assert_eq!(
        controller.args,
        args(&[
            "controller",
            "--in-cluster",
            "--scan-interval",
            "1h",
            "--metrics-addr",
            "0.0.0.0:9480",
            "--webhook-addr",
            "0.0.0.0:9443",
        ])
    );
    let sc = controller.security_context.clone().context("container securityContext")?;
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.capabilities.and_then(|c| c.drop), Some(vec!["ALL".to_string()]));
    for (var, path) in [("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")] {
        assert_eq!(field_ref_env(controller, var).as_deref(), Some(path), "env {var}");
    }
    assert_eq!(
        http_probe(controller.liveness_probe.as_ref()),
        Some(("/healthz".into(), "9480".into()))
    );
    assert_eq!(
        http_probe(controller.readiness_probe.as_ref()),
        Some(("/readyz".into(), "9480".into()))
    );

    // The webhook: every write of agents' objects, failing closed, at the
    // controller's Service.
    let hooks: k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration =
        serde_json::from_value(
            applied(&all, "ValidatingWebhookConfiguration", WEBHOOK)?.answer.clone(),
        )?;
    let hook = hooks.webhooks.as_ref().and_then(|w| w.first()).context("a webhook")?;
    assert_eq!(hook.failure_policy.as_deref(), Some("Fail"));
    assert_eq!(hook.side_effects, "None");
    let service = hook.client_config.service.as_ref().context("a Service")?;
    assert_eq!(
        (service.namespace.as_str(), service.name.as_str(), service.path.as_deref()),
        (CONTROLLER_NS, "volagent-admission", Some("/validate"))
    );
    let resources: Vec<String> =
        hook.rules.iter().flatten().flat_map(|r| r.resources.clone().unwrap_or_default()).collect();
    for r in [
        "attachments",
        "nodecleanups",
        "nodelocalvolumes",
        "nodelocalvolumes/status",
        "fencerequests",
        "fencerequests/status",
    ] {
        assert!(resources.iter().any(|x| x == r), "the webhook reviews {r}: {resources:?}");
    }
    let svc: k8s_openapi::api::core::v1::Service =
        serde_json::from_value(applied(&all, "Service", "volagent-admission")?.answer.clone())?;
    let port =
        svc.spec.and_then(|s| s.ports).unwrap_or_default().into_iter().next().context("a port")?;
    assert_eq!(
        (port.port, port.target_port),
        (
            443,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                "webhook".into()
            ))
        )
    );

    // Applying again works too (kubectl apply -k a second time).
    apply_deploy(&env, true).await.context("applying deploy/ a second time")?;
    Ok(())
}

#[tokio::test]
async fn agent_rbac_allows_its_calls_and_nothing_more() -> anyhow::Result<()> {
    let env = KubeEnv::start().await?;
    cluster_with_deploy(&env).await?;
    let agent = client_as(&env, NAMESPACE, AGENT_SA).await?;
    let pp = PostParams::default();

    // The ledger: create, read, update, delete an Attachment.
    let attachments: Api<DynamicObject> =
        Api::all_with(agent.clone(), &crd_resource("Attachment", "attachments"));
    let created = attachments
        .create(&pp, &attachment("pv-1")?)
        .await
        .context("the agent creates an Attachment")?;
    attachments.list(&ListParams::default()).await?;
    let mut changed = created.clone();
    changed.data["spec"]["consumers"] = json!([{
        "node": "node-1", "podNamespace": "default", "pod": "web-0", "podUID": "uid-1",
        "mountDir": "/var/lib/kubelet/pods/uid-1/volumes/volagent~rbd/pv-1",
        "since": "2024-01-01T00:00:00Z",
    }]);
    attachments.replace("pv-1", &pp, &changed).await.context("the agent updates an Attachment")?;
    forbidden(
        "agent patches an Attachment",
        attachments
            .patch(
                "pv-1",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
            )
            .await,
    )?;
    attachments
        .delete("pv-1", &DeleteParams::default())
        .await
        .context("the agent deletes an Attachment")?;

    // Nodes: read, never change.
    let nodes: Api<Node> = Api::all(agent.clone());
    nodes.get("node-1").await.context("the agent gets a node")?;
    nodes.list(&ListParams::default()).await?;
    forbidden("agent deletes a node", nodes.delete("node-1", &DeleteParams::default()).await)?;
    forbidden(
        "agent patches a node",
        nodes
            .patch(
                "node-1",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
            )
            .await,
    )?;

    // PVs: read.
    Api::<PersistentVolume>::all(agent.clone()).list(&ListParams::default()).await?;

    // Secrets: get one in its own namespace; none elsewhere (the
    // controller's, another namespace's); list none, anywhere.
    let secrets: Api<Secret> = Api::namespaced(agent.clone(), NAMESPACE);
    secrets
        .get("ceph-a-keyring")
        .await
        .context("the agent gets a backend secret in its namespace")?;
    for elsewhere in ["ceph", CONTROLLER_NS, "kube-system"] {
        forbidden(
            &format!("agent gets a secret in {elsewhere}"),
            Api::<Secret>::namespaced(agent.clone(), elsewhere).get("ceph-a-keyring").await,
        )?;
    }
    forbidden("agent lists secrets in a namespace", secrets.list(&ListParams::default()).await)?;
    forbidden(
        "agent lists secrets in all namespaces",
        Api::<Secret>::all(agent.clone()).list(&ListParams::default()).await,
    )?;
    forbidden(
        "agent creates a secret",
        secrets.create(&pp, &serde_json::from_value(json!({"metadata": {"name": "x"}}))?).await,
    )?;

    // StorageClusters: read only.
    let clusters: Api<DynamicObject> =
        Api::all_with(agent.clone(), &crd_resource("StorageCluster", "storageclusters"));
    let cluster = clusters.get("ceph-a").await.context("the agent gets a StorageCluster")?;
    forbidden("agent updates a StorageCluster", clusters.replace("ceph-a", &pp, &cluster).await)?;
    forbidden(
        "agent patches a StorageCluster's status",
        clusters
            .patch_status(
                "ceph-a",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Active"}})),
            )
            .await,
    )?;

    // Its cleanup list: work it off, never create one.
    let cleanups: Api<DynamicObject> =
        Api::all_with(agent.clone(), &crd_resource("NodeCleanup", "nodecleanups"));
    let list = cleanups.get("node-1").await?;
    cleanups.replace("node-1", &pp, &list).await.context("the agent updates its NodeCleanup")?;
    cleanups
        .patch("node-1", &PatchParams::default(), &Patch::Merge(json!({"spec": {"entries": []}})))
        .await
        .context("the agent patches its NodeCleanup")?;
    let mut other = list.clone();
    other.metadata = ObjectMeta { name: Some("node-2".into()), ..ObjectMeta::default() };
    forbidden("agent creates a NodeCleanup", cleanups.create(&pp, &other).await)?;
    forbidden(
        "agent deletes its NodeCleanup",
        cleanups.delete("node-1", &DeleteParams::default()).await,
    )?;

    // Fence requests: make, read, delete its own; never answer one.
    let requests: Api<DynamicObject> =
        Api::all_with(agent.clone(), &crd_resource("FenceRequest", "fencerequests"));
    let request: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "volagent.io/v1alpha1", "kind": "FenceRequest", "metadata": { "name": "fence-1" },
        "spec": { "volume": "pv-1", "requester": "node-1", "node": "node-2", "address": "10.0.0.2:0/1" },
    }))?;
    requests.create(&pp, &request).await.context("the agent asks for fencing")?;
    requests.get("fence-1").await.context("the agent reads the answer")?;
    forbidden(
        "agent answers a fence request",
        requests
            .patch_status(
                "fence-1",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Fenced", "answeredAt": "t"}})),
            )
            .await,
    )?;
    forbidden("agent lists fence requests", requests.list(&ListParams::default()).await)?;
    requests
        .delete("fence-1", &DeleteParams::default())
        .await
        .context("the agent deletes its request")?;

    // Events: create.
    Api::<Event>::namespaced(agent.clone(), "default")
        .create(&pp, &event("agent-event", "node-1"))
        .await
        .context("the agent creates an event")?;

    // Nothing else.
    forbidden(
        "agent gets a config map",
        Api::<ConfigMap>::namespaced(agent.clone(), NAMESPACE).get("x").await,
    )?;
    forbidden(
        "agent gets a lease",
        Api::<Lease>::namespaced(agent.clone(), NAMESPACE).get(LEASE).await,
    )?;

    let wrong = access_differences(agent, AGENT_GRANTS).await?;
    assert!(wrong.is_empty(), "the agent's access:\n{}", wrong.join("\n"));
    Ok(())
}

#[tokio::test]
async fn controller_rbac_allows_its_calls_and_nothing_more() -> anyhow::Result<()> {
    let env = KubeEnv::start().await?;
    cluster_with_deploy(&env).await?;
    let controller = client_as(&env, CONTROLLER_NS, CONTROLLER_SA).await?;
    let pp = PostParams::default();

    // Leader election: its Lease in its own namespace, and only that one.
    let leases: Api<Lease> = Api::namespaced(controller.clone(), CONTROLLER_NS);
    leases.create(&pp, &lease(LEASE)).await.context("the controller creates its Lease")?;
    let mut held = leases.get(LEASE).await.context("the controller gets its Lease")?;
    if let Some(spec) = held.spec.as_mut() {
        spec.holder_identity = Some("volagent-controller-1".into());
    }
    leases.replace(LEASE, &pp, &held).await.context("the controller updates its Lease")?;
    forbidden(
        "controller deletes its Lease",
        leases.delete(LEASE, &DeleteParams::default()).await,
    )?;
    forbidden("controller lists leases", leases.list(&ListParams::default()).await)?;
    forbidden("controller gets another Lease", leases.get("other").await)?;
    let elsewhere: Api<Lease> = Api::namespaced(controller.clone(), "default");
    forbidden("controller creates a Lease in default", elsewhere.create(&pp, &lease(LEASE)).await)?;
    forbidden("controller gets a Lease in default", elsewhere.get(LEASE).await)?;

    // StorageClusters: finalizer and status.
    let clusters: Api<DynamicObject> =
        Api::all_with(controller.clone(), &crd_resource("StorageCluster", "storageclusters"));
    clusters
        .patch(
            "ceph-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["volagent.io/node-cleanup"]}})),
        )
        .await
        .context("the controller sets the finalizer")?;
    clusters
        .patch_status(
            "ceph-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Active"}})),
        )
        .await
        .context("the controller patches StorageCluster status")?;
    let cluster = clusters.get_status("ceph-a").await?;
    clusters
        .replace_status("ceph-a", &pp, &cluster)
        .await
        .context("the controller updates StorageCluster status")?;
    forbidden(
        "controller creates a StorageCluster",
        clusters
            .create(&pp, &{
                let mut c = cluster.clone();
                c.metadata = ObjectMeta { name: Some("ceph-b".into()), ..ObjectMeta::default() };
                c
            })
            .await,
    )?;
    forbidden(
        "controller deletes a StorageCluster",
        clusters.delete("ceph-a", &DeleteParams::default()).await,
    )?;

    // The ledger: tend records, never create them.
    let admin_attachments: Api<DynamicObject> =
        Api::all_with(env.client(), &crd_resource("Attachment", "attachments"));
    admin_attachments.create(&pp, &attachment("pv-1")?).await?;
    let attachments: Api<DynamicObject> =
        Api::all_with(controller.clone(), &crd_resource("Attachment", "attachments"));
    forbidden(
        "controller creates an Attachment",
        attachments.create(&pp, &attachment("pv-2")?).await,
    )?;
    let record = attachments.get("pv-1").await?;
    attachments.list(&ListParams::default()).await?;
    attachments
        .replace("pv-1", &pp, &record)
        .await
        .context("the controller updates an Attachment")?;
    attachments
        .delete("pv-1", &DeleteParams::default())
        .await
        .context("the controller deletes an Attachment")?;

    // Cleanup lists: create and extend.
    let cleanups: Api<DynamicObject> =
        Api::all_with(controller.clone(), &crd_resource("NodeCleanup", "nodecleanups"));
    let mut list = cleanups.get("node-1").await?;
    cleanups.replace("node-1", &pp, &list).await?;
    list.metadata = ObjectMeta { name: Some("node-2".into()), ..ObjectMeta::default() };
    cleanups.create(&pp, &list).await.context("the controller creates a NodeCleanup")?;
    cleanups
        .delete("node-2", &DeleteParams::default())
        .await
        .context("the controller deletes an emptied NodeCleanup")?;

    // Nodes: read. Events: create.
    let nodes: Api<Node> = Api::all(controller.clone());
    nodes.get("node-1").await?;
    forbidden("controller deletes a node", nodes.delete("node-1", &DeleteParams::default()).await)?;
    Api::<Event>::namespaced(controller.clone(), "default")
        .create(&pp, &event("controller-event", "node-1"))
        .await
        .context("the controller creates an event")?;

    // A StorageCluster's controller credentials by name (to fence a gone
    // node's clients), in its own namespace only, and no listing; the
    // nodes' credentials are not its business.
    Api::<Secret>::namespaced(controller.clone(), CONTROLLER_NS)
        .get("ceph-a-keyring")
        .await
        .context("the controller gets its StorageCluster credentials")?;
    for elsewhere in [NAMESPACE, "ceph"] {
        forbidden(
            &format!("controller gets a secret in {elsewhere}"),
            Api::<Secret>::namespaced(controller.clone(), elsewhere).get("ceph-a-keyring").await,
        )?;
    }
    forbidden(
        "controller lists secrets",
        Api::<Secret>::namespaced(controller.clone(), CONTROLLER_NS)
            .list(&ListParams::default())
            .await,
    )?;
    // Its webhook: the agents' pods by name, its configuration's caBundle.
    forbidden(
        "controller lists the agents' pods",
        Api::<k8s_openapi::api::core::v1::Pod>::namespaced(controller.clone(), NAMESPACE)
            .list(&ListParams::default())
            .await,
    )?;
    Api::<PersistentVolume>::all(controller.clone())
        .list(&ListParams::default())
        .await
        .context("the controller lists PVs (local volumes)")?;
    forbidden(
        "controller lists pods",
        Api::<k8s_openapi::api::core::v1::Pod>::all(controller.clone())
            .list(&ListParams::default())
            .await,
    )?;

    let wrong = access_differences(controller, CONTROLLER_GRANTS).await?;
    assert!(wrong.is_empty(), "the controller's access:\n{}", wrong.join("\n"));
    Ok(())
}

/// The DaemonSet's and the Deployment's args are a command line the
/// binary accepts, with the environment the pods give it.
#[test]
fn the_workloads_args_parse_as_the_binary_expects() -> anyhow::Result<()> {
    use clap::Parser;
    let all = manifests(&kustomization()?)?;
    for kind in ["DaemonSet", "Deployment"] {
        let w = all.iter().find(|m| m.kind() == kind).with_context(|| format!("no {kind}"))?;
        let args: Vec<String> = w.object["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .with_context(|| format!("the {kind}'s args"))?
            .iter()
            .filter_map(|a| a.as_str().map(String::from))
            .collect();
        // kubelet expands $(VAR) from the container's env: the node's IP
        // comes from the downward API.
        let expanded = args.iter().map(|a| a.replace("$(NODE_IP)", "10.0.0.7"));
        let argv = std::iter::once("volagent".to_string()).chain(expanded);
        volagent::cli::Cli::try_parse_from(argv)
            .map_err(|e| anyhow::anyhow!("{kind} args {args:?}: {e}"))?;
    }
    Ok(())
}
