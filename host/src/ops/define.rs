//! What a mounted volume is: in a cluster, its PV (or the pod's inline
//! volume where an admin allows those) and the StorageCluster it names —
//! never the options a pod's author could write. Then the attach pipeline.

use super::execute::{blocking, read_mounts};
use super::mount_records::MountRecord;
use super::record::{self, storage_cluster};
use super::request::{MountDir, MountRequest};
use super::{Agent, Done, Failure, FailureKind, cluster, cluster_failure, internal};
use crate::model::{KeyValue, Volume};
use crate::secret::Secrets;

impl Agent {
    /// The volume of a parsed Flexvolume mount as the cluster defines it;
    /// as asked without a cluster. Refused for a backend not loaded here.
    pub async fn define_volume(
        &self,
        backend: &str,
        req: &mut MountRequest,
    ) -> Result<(), Failure> {
        self.plugin(backend)?;
        let Some(cluster) = &self.node.cluster else { return Ok(()) };
        let (volume, me) = (&mut req.volume, &mut req.consumer);
        let asked = cluster::VolumeRequest {
            backend,
            name: &volume.name,
            namespace: &me.pod_namespace,
            pod: &me.pod,
            pod_uid: &me.pod_uid,
            node: &self.node.config.node,
            inline_allowed: self.node.config.inline_backends.iter().any(|b| b == backend),
        };
        let defined = cluster
            .volume(&asked)
            .await
            .map_err(|e| cluster_failure(&format!("volume {}", asked.name), e))?;
        volume.name = defined.key;
        volume.access_mode = defined.access_mode;
        volume.fs_type = defined.fs_type;
        volume.options = defined.options;
        me.read_only |= defined.read_only;
        Ok(())
    }

    /// kubelet's Flexvolume `mount`, its volume defined: connected to its
    /// StorageCluster, then attached.
    pub async fn mount(&self, backend: &str, req: MountRequest) -> Result<Done, Failure> {
        let MountRequest { mut volume, consumer, mut secrets } = req;
        self.connect_storage_cluster(backend, &mut volume, &mut secrets).await?;
        let paths = self.node.config.paths(backend, &volume.name);
        self.attach(backend, volume, consumer, secrets, paths).await
    }

    /// A volume that names a StorageCluster: where the storage is and the
    /// credentials to reach it come from the StorageCluster (and the Secret
    /// it names). Options and secrets the volume has win. Nothing to do
    /// without a cluster or a StorageCluster.
    pub(crate) async fn connect_storage_cluster(
        &self,
        backend: &str,
        volume: &mut Volume,
        secrets: &mut Secrets,
    ) -> Result<(), Failure> {
        let (Some(cluster), Some(name)) = (&self.node.cluster, storage_cluster(volume)) else {
            return Ok(());
        };
        let connection = cluster
            .storage_connection(&name, backend)
            .await
            .map_err(|e| cluster_failure(&format!("volume {}", volume.name), e))?;
        for (key, value) in connection.options {
            if !volume.options.iter().any(|kv| kv.key == key) {
                volume.options.push(KeyValue { key, value });
            }
        }
        for (key, value) in connection.secrets {
            // A value kubelet passed (the PV's own secret) wins.
            secrets.entry(key).or_insert(value);
        }
        volume.secret_keys = secrets.keys().cloned().collect();
        Ok(())
    }

    /// What was mounted at the Flexvolume mount dir `dir`, to be unmounted:
    /// the stash entry; without one (a lost or damaged stash), the ledger's
    /// record of the mounted dir. None when nothing is mounted there (a
    /// retry after success, or never mounted).
    pub async fn mounted_entry(
        &self,
        backend: &str,
        dir: &MountDir,
    ) -> Result<Option<MountRecord>, Failure> {
        let mount_dir = dir.dir.display().to_string();
        if let Some(entry) = read_mounts(&self.node, |s| s.get(&mount_dir))? {
            return Ok(Some(entry));
        }
        let sys = self.node.sys.clone();
        let target = dir.dir.clone();
        let mounted = blocking(move || sys.mount_at(&target)).await?.map_err(internal)?;
        let Some(m) = mounted else { return Ok(None) };
        match record::entry_from_ledger(&self.node, backend, dir).await? {
            Some(entry) => {
                tracing::warn!(mount_dir, volume = %entry.volume.name, "no stash entry for a mounted dir: unmounting it as the ledger records it");
                Ok(Some(entry))
            }
            None => Err(Failure::new(
                FailureKind::Failed,
                format!(
                    "{mount_dir} is mounted from {}, but this agent has no record of mounting it; refusing to guess",
                    m.source
                ),
            )),
        }
    }
}
