//! How a volume reaches its storage system, from the StorageCluster it
//! names: the endpoints (Ceph monitors, Gluster servers), the backend's
//! parameters, and the credentials in the Secret the cluster references.
//! The values stay host-side; the guest learns the endpoints and
//! parameters as options, and the Secret's keys, never its values.

use super::cluster::Cluster;
use super::crds::{SecretReference, StorageCluster};
use super::volumes::VolumeError;
use crate::ops::cluster::ENDPOINTS_OPTION;
use crate::secret::{Secret, Secrets};
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use kube::api::Api;
use std::collections::BTreeMap;

/// What a StorageCluster gives a volume that names it.
#[derive(Debug, Default)]
pub struct StorageConnection {
    pub endpoints: Vec<String>,
    pub parameters: BTreeMap<String, String>,
    pub secrets: Secrets,
}

impl StorageConnection {
    /// The options a volume gets from its cluster: its endpoints and each
    /// parameter, where the PV does not set the same option itself.
    pub fn options(&self) -> Vec<(String, String)> {
        let mut options: Vec<(String, String)> =
            self.parameters.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if !self.endpoints.is_empty() {
            options.push((ENDPOINTS_OPTION.to_string(), self.endpoints.join(",")));
        }
        options
    }
}

impl Cluster {
    /// The connection of StorageCluster `name`, which must serve `backend`
    /// and not be being deleted, with the nodes' credentials.
    pub async fn storage_connection(
        &self,
        name: &str,
        backend: &str,
    ) -> Result<StorageConnection, VolumeError> {
        let sc = storage_cluster(&self.client, name, backend, false).await?;
        let mut connection = StorageConnection::of(&sc);
        if let Some(r) = &sc.spec.secret_ref {
            // A StorageCluster is cluster-scoped and may name any Secret;
            // a node reads credentials only from its own namespace.
            if r.namespace != self.namespace {
                return Err(VolumeError::Refused(format!(
                    "StorageCluster {name} names Secret {}/{}, but agents read credentials only from their own namespace, {}",
                    r.namespace, r.name, self.namespace
                )));
            }
            connection.secrets = read_secret(&self.client, r, name).await?;
        }
        Ok(connection)
    }
}

impl StorageConnection {
    fn of(sc: &StorageCluster) -> StorageConnection {
        StorageConnection {
            endpoints: sc.spec.endpoints.clone(),
            parameters: sc.spec.parameters.clone(),
            secrets: Secrets::new(),
        }
    }

    /// As a Ceph client: the endpoints as monitors, the `user` parameter
    /// (default admin), and the key under the `secretKey` parameter
    /// (default "key") of the Secret.
    pub fn ceph_client(&self) -> crate::sys::rbd_export::CephClient {
        let param = |k: &str| self.parameters.get(k).map(String::as_str);
        crate::sys::rbd_export::CephClient {
            conf: None,
            monitors: Some(self.endpoints.join(",")),
            user: param("user").unwrap_or("admin").to_string(),
            keyring: None,
            key: self.secrets.get(param("secretKey").unwrap_or("key")).cloned(),
        }
    }
}

/// StorageCluster `name` of `backend`; one being deleted only when
/// `deleting_ok` (fencing still needs it, mounts do not).
async fn storage_cluster(
    client: &kube::Client,
    name: &str,
    backend: &str,
    deleting_ok: bool,
) -> Result<StorageCluster, VolumeError> {
    let clusters: Api<StorageCluster> = Api::all(client.clone());
    let what = format!("StorageCluster {name}");
    let sc = clusters
        .get_opt(name)
        .await
        .map_err(|source| VolumeError::Api { what: what.clone(), source })?
        .ok_or_else(|| VolumeError::Refused(format!("{what} does not exist")))?;
    if sc.spec.backend != backend {
        return Err(VolumeError::Refused(format!(
            "{what} is a {} cluster, not {backend}",
            sc.spec.backend
        )));
    }
    let deleting = sc.metadata.deletion_timestamp.is_some()
        || sc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Deleting");
    if deleting && !deleting_ok {
        return Err(VolumeError::Refused(format!(
            "{what} is being deleted: its volumes are being cleaned up, not mounted"
        )));
    }
    Ok(sc)
}

/// The values of Secret `r`, which StorageCluster `cluster` names.
async fn read_secret(
    client: &kube::Client,
    r: &SecretReference,
    cluster: &str,
) -> Result<Secrets, VolumeError> {
    let secrets: Api<KubeSecret> = Api::namespaced(client.clone(), &r.namespace);
    let secret_name =
        format!("Secret {}/{} (named by StorageCluster {cluster})", r.namespace, r.name);
    let found = match secrets.get_opt(&r.name).await {
        Ok(found) => found,
        Err(kube::Error::Api(s)) if s.code == 403 => {
            return Err(VolumeError::Refused(format!(
                "volagent may not read {secret_name}: {}",
                s.message
            )));
        }
        Err(source) => return Err(VolumeError::Api { what: secret_name, source }),
    };
    let secret =
        found.ok_or_else(|| VolumeError::Refused(format!("{secret_name} does not exist")))?;
    let mut out = Secrets::new();
    for (key, value) in secret.data.unwrap_or_default() {
        out.insert(key, Secret::new(value.0));
    }
    for (key, value) in secret.string_data.unwrap_or_default() {
        out.insert(key, Secret::new(value.into_bytes()));
    }
    if out.is_empty() {
        return Err(VolumeError::Refused(format!("{secret_name} holds no data")));
    }
    Ok(out)
}

/// What a volume provisioned on StorageCluster `name` of `backend` gets
/// from it as parameters: its parameters and its endpoints (`endpoints`).
/// Refused while the cluster is being deleted: nothing new is made on it.
pub async fn provisioning_parameters(
    client: &kube::Client,
    name: &str,
    backend: &str,
) -> Result<Vec<(String, String)>, VolumeError> {
    Ok(StorageConnection::of(&storage_cluster(client, name, backend, false).await?).options())
}

/// The controller's connection to StorageCluster `name` of `backend`
/// (also while it is being deleted): its endpoints and parameters, as the
/// user of its `controllerCredentials`, which may fence other nodes'
/// clients. A cluster without them cannot be fenced.
pub async fn controller_connection(
    client: &kube::Client,
    name: &str,
    backend: &str,
) -> Result<StorageConnection, VolumeError> {
    let sc = storage_cluster(client, name, backend, true).await?;
    let creds = sc.spec.controller_credentials.as_ref().ok_or_else(|| {
        VolumeError::Refused(format!("StorageCluster {name} has no controllerCredentials: the controller has no user to fence other nodes' clients with"))
    })?;
    let mut connection = StorageConnection::of(&sc);
    connection.parameters.insert("user".into(), creds.user.clone());
    connection.secrets = read_secret(client, &creds.secret_ref, name).await?;
    Ok(connection)
}

/// The endpoints of StorageCluster `name` of `backend` (also while it is
/// being deleted), for storage the controller reaches as any client
/// would, without credentials (Gluster's servers).
pub async fn cluster_endpoints(
    client: &kube::Client,
    name: &str,
    backend: &str,
) -> Result<Vec<String>, VolumeError> {
    let sc = storage_cluster(client, name, backend, true).await?;
    if sc.spec.endpoints.is_empty() {
        return Err(VolumeError::Refused(format!("StorageCluster {name} names no endpoints")));
    }
    Ok(sc.spec.endpoints)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_parameters_become_options() {
        let c = StorageConnection {
            endpoints: vec!["10.0.0.1:6789".into(), "10.0.0.2:6789".into()],
            parameters: [("pool".to_string(), "kube".to_string())].into(),
            secrets: Secrets::new(),
        };
        assert_eq!(
            c.options(),
            vec![
                ("pool".into(), "kube".into()),
                ("endpoints".into(), "10.0.0.1:6789,10.0.0.2:6789".into())
            ]
        );
        assert!(StorageConnection::default().options().is_empty());
    }
}
