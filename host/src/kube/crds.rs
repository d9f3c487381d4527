//! The custom resources of group `volagent.io`: attachment records (the
//! ledger), per-node cleanup lists, and storage clusters.

use kube::CustomResource;
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const GROUP: &str = "volagent.io";
/// Held on a StorageCluster until no attachment record refers to it.
pub const CLEANUP_FINALIZER: &str = "volagent.io/node-cleanup";

/// A volume's access mode, spelled as Kubernetes spells it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum AccessMode {
    ReadWriteOnce,
    ReadOnlyMany,
    ReadWriteMany,
    ReadWriteOncePod,
}

/// One pod using the volume.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerEntry {
    pub node: String,
    pub pod_namespace: String,
    pub pod: String,
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    /// The pod's mount dir, as kubelet gave it.
    pub mount_dir: String,
    #[serde(default)]
    pub read_only: bool,
    /// RFC 3339 time the consumer was recorded.
    pub since: String,
}

/// Who uses a volume: the ledger's record, named after the PV. Agents
/// settle races on it with create (AlreadyExists) and resourceVersion
/// (Conflict) alone.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "Attachment",
    plural = "attachments",
    shortname = "vatt",
    printcolumn = r#"{"name":"Nodes","type":"string","jsonPath":".spec.consumers[*].node"}"#,
    printcolumn = r#"{"name":"Pods","type":"string","jsonPath":".spec.consumers[*].pod"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.accessMode"}"#,
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AttachmentSpec {
    pub backend: String,
    pub access_mode: AccessMode,
    /// The StorageCluster the volume lives on, if it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_cluster: Option<String>,
    /// What the volume is: its filesystem type and the backend's options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<VolumeSourceSpec>,
    #[serde(default)]
    pub consumers: Vec<ConsumerEntry>,
    /// Each node's client of the storage system for the volume (an RBD
    /// helper's Ceph client): how other nodes place the image's watchers,
    /// and what a take-over blocklists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storage_clients: Vec<StorageClientEntry>,
}

/// A node's storage client, as the storage system names it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageClientEntry {
    pub node: String,
    /// Its global id ("client.<id>" in Ceph; int64 as librbd reports it,
    /// and a schema without the minimum an unsigned field would add).
    pub id: i64,
    /// Its address, as blocklisting takes it ("ip:port/nonce").
    pub address: String,
}

/// A volume's filesystem type and backend options, as the PV gives them.
/// (Absent rather than empty: kube-apiserver 1.20 reads `""` as null.)
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSourceSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub options: Option<BTreeMap<String, String>>,
}

/// Why an attachment was put on a node's cleanup list.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum CleanupReason {
    /// The Node object was deleted.
    NodeGone,
}

/// An attachment taken from the ledger that its node must still undo.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CleanupEntry {
    pub volume: String,
    pub backend: String,
    pub access_mode: AccessMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_cluster: Option<String>,
    pub consumer: ConsumerEntry,
    pub reason: CleanupReason,
    /// RFC 3339 time the entry was moved here.
    pub moved_at: String,
}

/// The attachments a node must clean up when its agent runs again, named
/// after the node. The controller appends; the node's agent works them off.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "NodeCleanup",
    plural = "nodecleanups",
    shortname = "vnc",
    printcolumn = r#"{"name":"Entries","type":"string","jsonPath":".spec.entries[*].volume"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeCleanupSpec {
    #[serde(default)]
    pub entries: Vec<CleanupEntry>,
}

/// A secret holding a backend's credentials.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretReference {
    pub namespace: String,
    pub name: String,
}

/// A storage system volumes live on (a Ceph cluster, Gluster servers, an
/// NBD server), named by volumes in their `storageCluster` option.
/// Deleting one makes every node force-clean its volumes; the finalizer
/// goes when no attachment record names it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "volagent.io",
    version = "v1alpha1",
    kind = "StorageCluster",
    plural = "storageclusters",
    shortname = "vsc",
    status = "StorageClusterStatus",
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.backend"}"#,
    printcolumn = r#"{"name":"Endpoints","type":"string","jsonPath":".spec.endpoints"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct StorageClusterSpec {
    /// The backend serving its volumes, e.g. "rbd".
    pub backend: String,
    /// Ceph monitors, Gluster servers, the NBD server: host[:port] each.
    #[serde(default)]
    pub endpoints: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretReference>,
    /// Backend-specific settings.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageClusterStatus {
    /// Active, or Deleting while nodes clean up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Nodes that still hold volumes of a deleted cluster.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending_nodes: Vec<String>,
}

/// Every CRD with the file name `deploy/crds/` keeps it under.
pub fn all() -> Vec<(String, String)> {
    [Attachment::crd(), NodeCleanup::crd(), StorageCluster::crd()]
        .into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            // Serialising a derived CRD cannot fail: it is plain data.
            let yaml = serde_norway::to_string(&crd).unwrap_or_default();
            (format!("{name}.yaml"), yaml)
        })
        .collect()
}

/// All CRDs as one YAML stream.
pub fn yaml_stream() -> String {
    all().into_iter().map(|(_, y)| format!("---\n{y}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deploy_crds_are_the_generated_ones() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
        for (file, yaml) in all() {
            let committed = std::fs::read_to_string(dir.join(&file))
                .unwrap_or_else(|e| panic!("deploy/crds/{file}: {e}; regenerate with `volagent crds --dir deploy/crds`"));
            assert_eq!(committed, yaml, "deploy/crds/{file} is stale; regenerate with `volagent crds --dir deploy/crds`");
        }
        let mut files: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        files.sort();
        let mut expected: Vec<String> = all().into_iter().map(|(f, _)| f).collect();
        expected.sort();
        assert_eq!(files, expected, "deploy/crds/ holds exactly the generated CRDs");
    }

    #[test]
    fn records_serialise_with_kubernetes_spelling() {
        let spec = AttachmentSpec {
            backend: "rbd".into(),
            access_mode: AccessMode::ReadWriteOnce,
            storage_cluster: None,
            source: Some(VolumeSourceSpec { fs_type: Some("ext4".into()), options: Some([("pool".into(), "rbd".into())].into()) }),
            consumers: vec![ConsumerEntry {
                node: "n1".into(),
                pod_namespace: "default".into(),
                pod: "web-0".into(),
                pod_uid: "u1".into(),
                mount_dir: "/var/lib/kubelet/pods/u1/volumes/volagent~rbd/pv1".into(),
                read_only: false,
                since: "2026-01-01T00:00:00Z".into(),
            }],
            storage_clients: vec![],
        };
        let v = serde_json::to_value(&spec).unwrap();
        assert_eq!(v["accessMode"], "ReadWriteOnce");
        assert_eq!(v["source"]["fsType"], "ext4");
        assert_eq!(v["source"]["options"]["pool"], "rbd");
        assert_eq!(v["consumers"][0]["podUID"], "u1");
        assert_eq!(v["consumers"][0]["mountDir"], "/var/lib/kubelet/pods/u1/volumes/volagent~rbd/pv1");
    }
}
