//! How a volume reaches its storage system, from the StorageCluster it
//! names: the endpoints (Ceph monitors, Gluster servers), the backend's
//! parameters, and the credentials in the Secret the cluster references.
//! The values stay host-side; the guest learns the endpoints and
//! parameters as options, and the Secret's keys, never its values.

use super::cluster::Cluster;
use super::crds::StorageCluster;
use super::volumes::VolumeError;
use crate::secret::{Secret, Secrets};
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use kube::api::Api;
use std::collections::BTreeMap;

/// The option a guest finds a StorageCluster's endpoints in (comma-separated).
pub const ENDPOINTS_OPTION: &str = "endpoints";

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
        let mut options: Vec<(String, String)> = self.parameters.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if !self.endpoints.is_empty() {
            options.push((ENDPOINTS_OPTION.to_string(), self.endpoints.join(",")));
        }
        options
    }
}

impl Cluster {
    /// The connection of StorageCluster `name`, which must serve `backend`
    /// and not be being deleted.
    pub async fn storage_connection(&self, name: &str, backend: &str) -> Result<StorageConnection, VolumeError> {
        connection(&self.client, name, backend, false).await
    }
}

impl StorageConnection {
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

/// The connection of StorageCluster `name` of `backend`; of one being
/// deleted only when `deleting_ok` (fencing still needs it, mounts do not).
pub async fn connection(client: &kube::Client, name: &str, backend: &str, deleting_ok: bool) -> Result<StorageConnection, VolumeError> {
    let clusters: Api<StorageCluster> = Api::all(client.clone());
    let what = format!("StorageCluster {name}");
    let sc = clusters
        .get_opt(name)
        .await
        .map_err(|source| VolumeError::Api { what: what.clone(), source })?
        .ok_or_else(|| VolumeError::Refused(format!("{what} does not exist")))?;
    if sc.spec.backend != backend {
        return Err(VolumeError::Refused(format!("{what} is a {} cluster, not {backend}", sc.spec.backend)));
    }
    let deleting = sc.metadata.deletion_timestamp.is_some() || sc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Deleting");
    if deleting && !deleting_ok {
        return Err(VolumeError::Refused(format!("{what} is being deleted: its volumes are being cleaned up, not mounted")));
    }
    let mut connection = StorageConnection { endpoints: sc.spec.endpoints.clone(), parameters: sc.spec.parameters.clone(), secrets: Secrets::new() };
    if let Some(r) = &sc.spec.secret_ref {
        let secrets: Api<KubeSecret> = Api::namespaced(client.clone(), &r.namespace);
        let secret_name = format!("Secret {}/{} (named by {what})", r.namespace, r.name);
        let found = match secrets.get_opt(&r.name).await {
            Ok(found) => found,
            Err(kube::Error::Api(s)) if s.code == 403 => {
                return Err(VolumeError::Refused(format!("volagent may not read {secret_name}: {}", s.message)));
            }
            Err(source) => return Err(VolumeError::Api { what: secret_name, source }),
        };
        let secret = found.ok_or_else(|| VolumeError::Refused(format!("{secret_name} does not exist")))?;
        for (key, value) in secret.data.unwrap_or_default() {
            connection.secrets.insert(key, Secret::new(value.0));
        }
        for (key, value) in secret.string_data.unwrap_or_default() {
            connection.secrets.insert(key, Secret::new(value.into_bytes()));
        }
        if connection.secrets.is_empty() {
            return Err(VolumeError::Refused(format!("{secret_name} holds no data")));
        }
    }
    Ok(connection)
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
        assert_eq!(c.options(), vec![("pool".into(), "kube".into()), ("endpoints".into(), "10.0.0.1:6789,10.0.0.2:6789".into())]);
        assert!(StorageConnection::default().options().is_empty());
    }
}
