//! Acting as each service account: the calls it needs succeed, the others
//! are refused, and the access reviews find exactly [`crate::access`]'s grants.

use super::*;

/// A client that acts as service account `namespace/sa`: the admin
/// kubeconfig with impersonation (the admin is in system:masters, which may
/// impersonate). The API server adds the service-account groups itself.
pub(crate) async fn client_as(
    env: &KubeEnv,
    namespace: &str,
    sa: &str,
) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(env.kubeconfig_path())?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    config.auth_info.impersonate = Some(format!("system:serviceaccount:{namespace}:{sa}"));
    Ok(kube::Client::try_from(config)?)
}

pub(crate) fn code<T: std::fmt::Debug>(result: &Result<T, kube::Error>) -> Option<u16> {
    match result {
        Ok(_) => None,
        Err(kube::Error::Api(status)) => Some(status.code),
        Err(_) => Some(0),
    }
}

/// Fails unless the call was refused with 403 Forbidden.
pub(crate) fn forbidden<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, kube::Error>,
) -> anyhow::Result<()> {
    ensure!(code(&result) == Some(403), "{what}: expected 403 Forbidden, got {result:?}");
    Ok(())
}

pub(crate) fn crd_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("volagent.io", "v1alpha1", kind),
        plural,
    )
}

pub(crate) fn attachment(name: &str) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "volagent.io/v1alpha1",
        "kind": "Attachment",
        "metadata": { "name": name },
        "spec": { "backend": "rbd", "accessMode": "ReadWriteOnce", "consumers": [] },
    }))?)
}

pub(crate) fn lease(name: &str) -> Lease {
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
pub(crate) fn event(name: &str, node: &str) -> Event {
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
pub(crate) async fn cluster_with_deploy(env: &KubeEnv) -> anyhow::Result<()> {
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

// --- the calls each account is refused ---------------------------------------

/// A call a service account must be refused with 403 Forbidden. The API
/// server authorizes a request before it reads or validates its object, so
/// a refused call's object is its name alone.
pub(crate) struct Refused {
    what: &'static str,
    verb: Verb,
    resource: Resource,
    /// None: cluster-wide (all namespaces, for a namespaced resource).
    namespace: Option<&'static str>,
    name: &'static str,
}

#[derive(Clone, Copy)]
pub(crate) enum Verb {
    Get,
    List,
    Create,
    Replace,
    /// A JSON merge patch: its body.
    Patch(&'static str),
    PatchStatus(&'static str),
    Delete,
}

#[derive(Clone, Copy)]
pub(crate) enum Resource {
    Attachment,
    StorageCluster,
    NodeCleanup,
    FenceRequest,
    Node,
    Secret,
    ConfigMap,
    Lease,
    Pod,
}

impl Resource {
    fn api_resource(self) -> ApiResource {
        match self {
            Resource::Attachment => crd_resource("Attachment", "attachments"),
            Resource::StorageCluster => crd_resource("StorageCluster", "storageclusters"),
            Resource::NodeCleanup => crd_resource("NodeCleanup", "nodecleanups"),
            Resource::FenceRequest => crd_resource("FenceRequest", "fencerequests"),
            Resource::Node => ApiResource::erase::<Node>(&()),
            Resource::Secret => ApiResource::erase::<Secret>(&()),
            Resource::ConfigMap => ApiResource::erase::<ConfigMap>(&()),
            Resource::Lease => ApiResource::erase::<Lease>(&()),
            Resource::Pod => ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&()),
        }
    }
}

const fn refused(
    what: &'static str,
    verb: Verb,
    resource: Resource,
    namespace: Option<&'static str>,
    name: &'static str,
) -> Refused {
    Refused { what, verb, resource, namespace, name }
}

const LABEL: Verb = Verb::Patch(r#"{"metadata": {"labels": {"a": "b"}}}"#);

/// Calls the agent must be refused, one by one (the access reviews then
/// check every verb against [`AGENT_GRANTS`]).
pub(crate) const AGENT_REFUSED: &[Refused] = {
    use Resource::*;
    use Verb::*;
    &[
        refused("agent patches an Attachment", LABEL, Attachment, None, "pv-1"),
        refused("agent deletes a node", Delete, Node, None, "node-1"),
        refused("agent patches a node", LABEL, Node, None, "node-1"),
        // Secrets: none outside its namespace (the controller's, another
        // namespace's), no listing anywhere, no making one.
        refused("agent gets a secret in ceph", Get, Secret, Some("ceph"), "ceph-a-keyring"),
        refused(
            "agent gets a secret in volagent-controller",
            Get,
            Secret,
            Some(CONTROLLER_NS),
            "ceph-a-keyring",
        ),
        refused(
            "agent gets a secret in kube-system",
            Get,
            Secret,
            Some("kube-system"),
            "ceph-a-keyring",
        ),
        refused("agent lists secrets in a namespace", List, Secret, Some(NAMESPACE), ""),
        refused("agent lists secrets in all namespaces", List, Secret, None, ""),
        refused("agent creates a secret", Create, Secret, Some(NAMESPACE), "x"),
        refused("agent updates a StorageCluster", Replace, StorageCluster, None, "ceph-a"),
        refused(
            "agent patches a StorageCluster's status",
            PatchStatus(r#"{"status": {"phase": "Active"}}"#),
            StorageCluster,
            None,
            "ceph-a",
        ),
        refused("agent creates a NodeCleanup", Create, NodeCleanup, None, "node-2"),
        refused("agent deletes its NodeCleanup", Delete, NodeCleanup, None, "node-1"),
        refused(
            "agent answers a fence request",
            PatchStatus(r#"{"status": {"phase": "Fenced", "answeredAt": "t"}}"#),
            FenceRequest,
            None,
            "fence-1",
        ),
        refused("agent lists fence requests", List, FenceRequest, None, ""),
        refused("agent gets a config map", Get, ConfigMap, Some(NAMESPACE), "x"),
        refused("agent gets a lease", Get, Lease, Some(NAMESPACE), LEASE),
    ]
};

/// Calls the controller must be refused, one by one.
pub(crate) const CONTROLLER_REFUSED: &[Refused] = {
    use Resource::*;
    use Verb::*;
    &[
        // Leases: only its own, never deleted or listed.
        refused("controller deletes its Lease", Delete, Lease, Some(CONTROLLER_NS), LEASE),
        refused("controller lists leases", List, Lease, Some(CONTROLLER_NS), ""),
        refused("controller gets another Lease", Get, Lease, Some(CONTROLLER_NS), "other"),
        refused("controller creates a Lease in default", Create, Lease, Some("default"), LEASE),
        refused("controller gets a Lease in default", Get, Lease, Some("default"), LEASE),
        refused("controller creates a StorageCluster", Create, StorageCluster, None, "ceph-b"),
        refused("controller deletes a StorageCluster", Delete, StorageCluster, None, "ceph-a"),
        refused("controller creates an Attachment", Create, Attachment, None, "pv-2"),
        refused("controller deletes a node", Delete, Node, None, "node-1"),
        // The nodes' credentials are not its business; its own by name only.
        refused(
            "controller gets a secret in volagent-system",
            Get,
            Secret,
            Some(NAMESPACE),
            "ceph-a-keyring",
        ),
        refused("controller gets a secret in ceph", Get, Secret, Some("ceph"), "ceph-a-keyring"),
        refused("controller lists secrets", List, Secret, Some(CONTROLLER_NS), ""),
        // Its webhook reads the agents' pods by name only.
        refused("controller lists the agents' pods", List, Pod, Some(NAMESPACE), ""),
        refused("controller lists pods", List, Pod, None, ""),
    ]
};

/// Makes each call as `client`; fails on the first that is not refused.
pub(crate) async fn assert_refused(client: &kube::Client, calls: &[Refused]) -> anyhow::Result<()> {
    let (pp, patch) = (PostParams::default(), PatchParams::default());
    for call in calls {
        let resource = call.resource.api_resource();
        let api: Api<DynamicObject> = match call.namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        let object = DynamicObject::new(call.name, &resource);
        let merge = |body: &str| serde_json::from_str::<Value>(body).map(Patch::Merge);
        let result = match call.verb {
            Verb::Get => api.get(call.name).await.map(drop),
            Verb::List => api.list(&ListParams::default()).await.map(drop),
            Verb::Create => api.create(&pp, &object).await.map(drop),
            Verb::Replace => api.replace(call.name, &pp, &object).await.map(drop),
            Verb::Patch(body) => api.patch(call.name, &patch, &merge(body)?).await.map(drop),
            Verb::PatchStatus(body) => {
                api.patch_status(call.name, &patch, &merge(body)?).await.map(drop)
            }
            Verb::Delete => api.delete(call.name, &DeleteParams::default()).await.map(drop),
        };
        forbidden(call.what, result)?;
    }
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
    attachments
        .delete("pv-1", &DeleteParams::default())
        .await
        .context("the agent deletes an Attachment")?;

    // Nodes: read, never change.
    let nodes: Api<Node> = Api::all(agent.clone());
    nodes.get("node-1").await.context("the agent gets a node")?;
    nodes.list(&ListParams::default()).await?;

    // PVs: read.
    Api::<PersistentVolume>::all(agent.clone()).list(&ListParams::default()).await?;

    // Secrets: get one in its own namespace (none elsewhere, and no
    // listing: AGENT_REFUSED).
    let secrets: Api<Secret> = Api::namespaced(agent.clone(), NAMESPACE);
    secrets
        .get("ceph-a-keyring")
        .await
        .context("the agent gets a backend secret in its namespace")?;

    // StorageClusters: read only.
    let clusters: Api<DynamicObject> =
        Api::all_with(agent.clone(), &crd_resource("StorageCluster", "storageclusters"));
    clusters.get("ceph-a").await.context("the agent gets a StorageCluster")?;

    // Its cleanup list: work it off, never create one.
    let cleanups: Api<DynamicObject> =
        Api::all_with(agent.clone(), &crd_resource("NodeCleanup", "nodecleanups"));
    let list = cleanups.get("node-1").await?;
    cleanups.replace("node-1", &pp, &list).await.context("the agent updates its NodeCleanup")?;
    cleanups
        .patch("node-1", &PatchParams::default(), &Patch::Merge(json!({"spec": {"entries": []}})))
        .await
        .context("the agent patches its NodeCleanup")?;

    // Fence requests: make, read, delete its own; never answer one.
    let requests: Api<DynamicObject> =
        Api::all_with(agent.clone(), &crd_resource("FenceRequest", "fencerequests"));
    let request: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "volagent.io/v1alpha1", "kind": "FenceRequest", "metadata": { "name": "fence-1" },
        "spec": { "volume": "pv-1", "requester": "node-1", "node": "node-2", "address": "10.0.0.2:0/1" },
    }))?;
    requests.create(&pp, &request).await.context("the agent asks for fencing")?;
    requests.get("fence-1").await.context("the agent reads the answer")?;
    requests
        .delete("fence-1", &DeleteParams::default())
        .await
        .context("the agent deletes its request")?;

    // Events: create.
    Api::<Event>::namespaced(agent.clone(), "default")
        .create(&pp, &event("agent-event", "node-1"))
        .await
        .context("the agent creates an event")?;

    assert_refused(&agent, AGENT_REFUSED).await?;
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

    // The ledger: tend records, never create them.
    let admin_attachments: Api<DynamicObject> =
        Api::all_with(env.client(), &crd_resource("Attachment", "attachments"));
    admin_attachments.create(&pp, &attachment("pv-1")?).await?;
    let attachments: Api<DynamicObject> =
        Api::all_with(controller.clone(), &crd_resource("Attachment", "attachments"));
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
    Api::<PersistentVolume>::all(controller.clone())
        .list(&ListParams::default())
        .await
        .context("the controller lists PVs (local volumes)")?;

    assert_refused(&controller, CONTROLLER_REFUSED).await?;
    let wrong = access_differences(controller, CONTROLLER_GRANTS).await?;
    assert!(wrong.is_empty(), "the controller's access:\n{}", wrong.join("\n"));
    Ok(())
}
