//! `CSIStorageCapacity` objects for the classes whose volumes are placed
//! on discovered local volumes: for each node, the most a new volume of the
//! class can get there (the policy's `capacity`), so that kube-scheduler,
//! with the CSIDriver's `storageCapacity: true`, only chooses nodes that
//! can serve a claim. Kept in the controller's namespace, one per class and
//! node, rewritten when a figure changes and removed when its class or node
//! is gone; refreshed every [`INTERVAL`] while the controller leads.
//!
//! The kind is `storage.k8s.io/v1` since Kubernetes 1.24, `v1beta1` in
//! 1.21–1.23 and an alpha `v1alpha1` in 1.19–1.20 (with the API server's
//! runtime config and feature gate): the first one the cluster serves is
//! written; with none, nothing is.

use super::Provisioner;
use crate::kube::crds::NodeLocalVolumes;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

pub const INTERVAL: Duration = Duration::from_secs(5);
const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
const MANAGER: &str = "volagent-controller";
const VERSIONS: [&str; 3] = ["v1", "v1beta1", "v1alpha1"];

fn resource(version: &str) -> ApiResource {
    ApiResource {
        group: "storage.k8s.io".into(),
        version: version.into(),
        api_version: format!("storage.k8s.io/{version}"),
        kind: "CSIStorageCapacity".into(),
        plural: "csistoragecapacities".into(),
    }
}

/// The objects' API in `namespace`, at the first version the cluster
/// serves; None when it serves none.
async fn api(client: &kube::Client, namespace: &str) -> Option<(Api<DynamicObject>, ApiResource)> {
    for version in VERSIONS {
        let kind = resource(version);
        let api = Api::namespaced_with(client.clone(), namespace, &kind);
        match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => return Some((api, kind)),
            Err(kube::Error::Api(s)) if s.code == 404 => continue,
            Err(e) => {
                tracing::warn!("CSIStorageCapacity {version}: {e}; not published for now");
                return None;
            }
        }
    }
    None
}

/// The object's name for `class` on `node` (both may be long: hashed).
fn name_for(class: &str, node: &str) -> String {
    let digest = Sha256::digest(format!("{class}\0{node}").as_bytes());
    format!("volagent-{}", hex::encode(&digest[..10]))
}

/// What the object for `class` on `node` says.
fn object(class: &str, node: &str, bytes: u64) -> serde_json::Value {
    serde_json::json!({
        "storageClassName": class,
        "nodeTopology": { "matchLabels": { "kubernetes.io/hostname": node } },
        "capacity": bytes.to_string(),
    })
}

/// Keep the objects up to date while the controller leads.
pub async fn run(client: kube::Client, provisioner: Arc<Provisioner>, namespace: String) {
    if !provisioner.backends().iter().any(|b| provisioner.places_locally(b)) {
        return; // no policy places volumes on local ones: nothing to tell
    }
    let Some((api, kind)) = api(&client, &namespace).await else {
        tracing::info!(
            "this cluster serves no CSIStorageCapacity: the scheduler is not told local capacity"
        );
        return;
    };
    loop {
        if let Err(e) = publish(&client, &provisioner, &api, &kind).await {
            tracing::warn!("publishing local capacity: {e}");
        }
        tokio::time::sleep(INTERVAL).await;
    }
}

/// One round: every class of a backend that places on local volumes, on
/// every node that reports local volumes.
async fn publish(
    client: &kube::Client,
    provisioner: &Provisioner,
    api: &Api<DynamicObject>,
    kind: &ApiResource,
) -> anyhow::Result<()> {
    let drivers: BTreeMap<String, String> = provisioner
        .backends()
        .into_iter()
        .filter(|b| provisioner.places_locally(b))
        .map(|b| (crate::csi::driver_name(&b), b))
        .collect();
    let classes = Api::<StorageClass>::all(client.clone()).list(&Default::default()).await?.items;
    let nodes: Vec<String> = Api::<NodeLocalVolumes>::all(client.clone())
        .list(&Default::default())
        .await?
        .items
        .iter()
        .map(|l| l.name_any())
        .collect();
    let mut desired = BTreeMap::new();
    for class in classes.iter().filter(|c| drivers.contains_key(&c.provisioner)) {
        let backend = &drivers[&class.provisioner];
        let parameters = class.parameters.clone().unwrap_or_default();
        let name = class.name_any();
        match provisioner.local_capacities(backend, &parameters, &name, &nodes).await {
            Ok(figures) => {
                for (node, bytes) in figures {
                    if let Some(bytes) = bytes {
                        desired.insert(name_for(&name, &node), object(&name, &node, bytes));
                    }
                }
            }
            // Nothing rewritten or removed on what could not be asked:
            // the figures published stand until the next round.
            Err(f) => anyhow::bail!("class {name}: {f}"),
        }
    }
    let selector = format!("{MANAGED_BY}={MANAGER}");
    let existing = api.list(&ListParams::default().labels(&selector)).await?.items;
    for old in &existing {
        let name = old.name_any();
        match desired.remove(&name) {
            None => {
                api.delete(&name, &Default::default()).await?;
            }
            Some(want) => {
                let same = ["storageClassName", "nodeTopology", "capacity"]
                    .iter()
                    .all(|k| old.data.get(*k) == want.get(*k));
                if !same {
                    let mut new = old.clone();
                    for (k, v) in want.as_object().into_iter().flatten() {
                        new.data[k] = v.clone();
                    }
                    api.replace(&name, &PostParams::default(), &new).await?;
                }
            }
        }
    }
    for (name, want) in desired {
        let mut new = DynamicObject::new(&name, kind).data(want);
        new.metadata.labels = Some([(MANAGED_BY.to_string(), MANAGER.to_string())].into());
        match api.create(&PostParams::default(), &new).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_object_per_class_and_node_under_a_name_of_its_own() {
        let a = name_for("local-fast", "node-a");
        assert_eq!(a, name_for("local-fast", "node-a"));
        assert_ne!(a, name_for("local-fast", "node-b"));
        assert_ne!(name_for("a", "bc"), name_for("ab", "c"));
        assert!(a.len() <= 63 && a.starts_with("volagent-"), "{a}");
        let o = object("local-fast", "node-a", 64 << 20);
        assert_eq!(o["capacity"], "67108864");
        assert_eq!(o["nodeTopology"]["matchLabels"]["kubernetes.io/hostname"], "node-a");
    }
}
