//! `deploy/`'s kustomization and the objects of the files it lists, and
//! applying them to the API server as `kubectl apply -k` would.

use super::*;

pub(crate) fn deploy_dir() -> PathBuf {
    volagent_test_support::workspace().join("deploy")
}

/// The parts of a kustomization this test understands; anything else (a
/// `namespace:`, patches, labels) would make `kubectl apply -k` produce
/// objects other than the files', so it fails the parse.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct Kustomization {
    pub(crate) api_version: String,
    pub(crate) kind: String,
    pub(crate) resources: Vec<String>,
    #[serde(default)]
    pub(crate) images: Vec<ImageOverride>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct ImageOverride {
    pub(crate) name: String,
    pub(crate) new_name: Option<String>,
    pub(crate) new_tag: Option<String>,
}

impl ImageOverride {
    /// The image kustomize puts where `image` was, if this entry is for it.
    pub(crate) fn rewrite(&self, image: &str) -> Option<String> {
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
pub(crate) struct Manifest {
    pub(crate) file: String,
    pub(crate) object: Value,
}

impl Manifest {
    pub(crate) fn kind(&self) -> &str {
        self.object["kind"].as_str().unwrap_or_default()
    }
    pub(crate) fn name(&self) -> &str {
        self.object["metadata"]["name"].as_str().unwrap_or_default()
    }
    pub(crate) fn namespace(&self) -> Option<&str> {
        self.object["metadata"]["namespace"].as_str()
    }
    pub(crate) fn describe(&self) -> String {
        format!("{} {} (in {})", self.kind(), self.name(), self.file)
    }
    pub(crate) fn gvk(&self) -> anyhow::Result<GroupVersionKind> {
        let api_version = self.object["apiVersion"]
            .as_str()
            .with_context(|| format!("{}: no apiVersion", self.describe()))?;
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        ensure!(!self.kind().is_empty(), "{}: no kind", self.file);
        Ok(GroupVersionKind::gvk(group, version, self.kind()))
    }
}

pub(crate) fn kustomization() -> anyhow::Result<Kustomization> {
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
pub(crate) fn raw_manifests(k: &Kustomization) -> anyhow::Result<Vec<Manifest>> {
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
pub(crate) fn manifests(k: &Kustomization) -> anyhow::Result<Vec<Manifest>> {
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
pub(crate) fn containers_mut(object: &mut Value) -> Vec<&mut Value> {
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
pub(crate) fn yaml_files(
    dir: &Path,
    prefix: &str,
    out: &mut BTreeSet<String>,
) -> anyhow::Result<()> {
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

/// What the API server answered to one object's apply.
pub(crate) struct Applied {
    pub(crate) manifest: Manifest,
    pub(crate) answer: Value,
}

/// Applies the kustomization's objects in order: workloads as dry runs, the
/// rest for real (waiting for each CRD to be Established); the admission
/// webhook's configuration only `with_webhook` (its controller does not run
/// here, and with failurePolicy Fail it would refuse every write it covers).
pub(crate) async fn apply_deploy(
    env: &KubeEnv,
    with_webhook: bool,
) -> anyhow::Result<Vec<Applied>> {
    let client = env.client();
    // Plain discovery: kube-apiserver 1.20 has no aggregated discovery.
    let mut discovery = Discovery::new(client.clone()).run().await?;
    let mut applied = Vec::new();
    for m in manifests(&kustomization()?)? {
        if !with_webhook && m.kind() == "ValidatingWebhookConfiguration" {
            continue;
        }
        let gvk = m.gvk()?;
        let (resource, caps) = shipped::resolve(&mut discovery, &client, &gvk)
            .await?
            .with_context(|| format!("{}: the API server has no {gvk:?}", m.describe()))?;
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
            kube_objects::wait_established(&client, m.name()).await;
        }
        applied.push(Applied { answer: serde_json::to_value(answer)?, manifest: m });
    }
    Ok(applied)
}

/// Where `want` (a manifest) has a field `got` (what the API server stored)
/// lacks or holds otherwise.
pub(crate) fn differences(want: &Value, got: &Value, path: &str, out: &mut Vec<String>) {
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

pub(crate) fn applied<'a>(
    all: &'a [Applied],
    kind: &str,
    name: &str,
) -> anyhow::Result<&'a Applied> {
    all.iter()
        .find(|a| a.manifest.kind() == kind && a.manifest.name() == name)
        .with_context(|| format!("deploy/ has no {kind} {name}"))
}

pub(crate) fn container<'a>(pod: &'a PodSpec, name: &str) -> anyhow::Result<&'a Container> {
    pod.containers.iter().find(|c| c.name == name).with_context(|| format!("no container {name:?}"))
}

pub(crate) fn field_ref_env(c: &Container, name: &str) -> Option<String> {
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

pub(crate) fn http_probe(
    probe: Option<&k8s_openapi::api::core::v1::Probe>,
) -> Option<(String, String)> {
    let get = probe?.http_get.as_ref()?;
    let port = match &get.port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => p.to_string(),
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
    };
    Some((get.path.clone().unwrap_or_default(), port))
}

pub(crate) fn args(list: &[&str]) -> Option<Vec<String>> {
    Some(list.iter().map(|s| s.to_string()).collect())
}
