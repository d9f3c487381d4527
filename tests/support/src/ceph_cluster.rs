//! The run's Ceph as a StorageCluster of an API-server cluster: the nodes'
//! and the controller's users and Secrets, and the controller serving the
//! shipped policies' provisioners.
// Helpers outside #[test] fns: a failed setup step fails the test.
#![allow(clippy::unwrap_used)]

use crate::api_cluster::Cluster;
use crate::ceph::{self, ceph_dir};
use crate::shipped;
use kube::api::Api;

/// A StorageCluster of rbd at the run's Ceph: the nodes' user (its key
/// in Secret `secret` of the agents' namespace) and the controller's
/// (its key in Secret `volagent-controller/<name>-fencing`).
pub fn create_storage_cluster(c: &Cluster, name: &str, secret: &str) {
    create_storage_cluster_in(&c.rt, &c.client(), name, secret);
}

/// [`create_storage_cluster`] through any client (the kubelet tier's too).
pub fn create_storage_cluster_in(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    name: &str,
    secret: &str,
) {
    use volagent::kube::crds::{
        ControllerCredentials, SecretReference, StorageCluster, StorageClusterSpec,
    };
    let spec = StorageClusterSpec {
        backend: "rbd".into(),
        endpoints: vec!["127.0.0.1:6789".into()],
        secret_ref: Some(SecretReference {
            namespace: shipped::AGENT_NAMESPACE.into(),
            name: secret.into(),
        }),
        controller_credentials: Some(ControllerCredentials {
            user: "volagent-controller".into(),
            secret_ref: SecretReference {
                namespace: shipped::CONTROLLER_NAMESPACE.into(),
                name: format!("{name}-fencing"),
            },
        }),
        parameters: [
            ("user".to_string(), "volagent".to_string()),
            ("pool".to_string(), "rbd".to_string()),
        ]
        .into(),
    };
    let api: Api<StorageCluster> = Api::all(client.clone());
    rt.block_on(api.create(&Default::default(), &StorageCluster::new(name, spec))).unwrap();
}

/// The controller's key for StorageCluster `name`, where it looks for it.
pub fn create_fencing_secret(c: &Cluster, name: &str) {
    create_secret(
        c,
        shipped::CONTROLLER_NAMESPACE,
        &format!("{name}-fencing"),
        &ceph::controller_key(&ceph_dir()),
    );
}

/// Secret `namespace/name` holding `key` under "key".
pub fn create_secret(c: &Cluster, namespace: &str, name: &str, key: &str) {
    create_secret_in(&c.rt, &c.client(), namespace, name, key);
}

/// [`create_secret`] through any client.
pub fn create_secret_in(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    namespace: &str,
    name: &str,
    key: &str,
) {
    use k8s_openapi::api::core::v1::Secret;
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
        data: Some([("key".to_string(), k8s_openapi::ByteString(key.as_bytes().to_vec()))].into()),
        ..Default::default()
    };
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    rt.block_on(api.create(&Default::default(), &secret)).unwrap();
}

/// The controller as its ServiceAccount again, now with the shipped
/// policies and their CSI controller drivers.
pub fn provisioning_controller(c: &mut Cluster) -> std::path::PathBuf {
    let csi = c.scratch.path("csi");
    c.kill_agent("controller");
    c.controller_args = vec![
        "--plugin-dir".into(),
        c.scratch.path("plugins").display().to_string(),
        "--csi-dir".into(),
        csi.display().to_string(),
    ];
    c.spawn_controller();
    csi
}

/// Secrets and the StorageCluster `ceph` at the run's Ceph, and the
/// provisioning controller: what a provisioning test or bench starts from.
pub fn provisioning(c: &mut Cluster) -> std::path::PathBuf {
    create_secret(c, shipped::AGENT_NAMESPACE, "ceph-volagent", &ceph::volagent_key(&ceph_dir()));
    create_storage_cluster(c, "ceph", "ceph-volagent");
    create_fencing_secret(c, "ceph");
    provisioning_controller(c)
}

/// The CSI snapshot API's CRDs (deploy/snapshot-crds/), Established, as
/// an admin installs them where the cluster has none.
pub fn install_snapshot_crds(c: &Cluster) {
    install_snapshot_crds_in(&c.rt, &c.client());
}

/// [`install_snapshot_crds`] through any client.
pub fn install_snapshot_crds_in(rt: &tokio::runtime::Runtime, client: &kube::Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/snapshot-crds");
    for (file, _) in volagent::kube::snapshot_crds::all() {
        let text = std::fs::read_to_string(dir.join(&file)).unwrap();
        let crd: CustomResourceDefinition = serde_norway::from_str(&text).unwrap();
        let name = crd.metadata.name.clone().unwrap();
        rt.block_on(api.create(&Default::default(), &crd)).unwrap();
        rt.block_on(crate::kube_objects::wait_established(client, &name));
    }
}
