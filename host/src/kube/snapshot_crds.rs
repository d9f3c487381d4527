//! The CSI snapshot API, `snapshot.storage.k8s.io/v1`: VolumeSnapshot (a
//! user's request, namespaced), VolumeSnapshotContent (the snapshot as
//! made, cluster-scoped) and VolumeSnapshotClass (a driver's parameters).
//! Kubernetes does not ship these kinds; a cluster gets them from the
//! upstream snapshot controller's CRDs or from ours (`volagent crds
//! --snapshots`), which declare the same fields this controller reads and
//! writes, so either set serves it.

use kube::CustomResource;
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const GROUP: &str = "snapshot.storage.k8s.io";
pub const API_VERSION: &str = "snapshot.storage.k8s.io/v1";
/// A class with this annotation set to "true" is its driver's default.
pub const DEFAULT_CLASS: &str = "snapshot.storage.k8s.io/is-default-class";
/// A `*.k8s.io` group's CRDs must name the review that approved their API
/// (the API server refuses them otherwise): this API's v1 schema review.
const APPROVAL: &str = "https://github.com/kubernetes-csi/external-snapshotter/pull/665";

/// A quantity, as Kubernetes accepts it: a number or a string ("1Gi").
fn int_or_string(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "x-kubernetes-int-or-string": true })
}

/// What a VolumeSnapshot is of: a claim to snapshot now, or a content
/// made before (by an admin, or restored from elsewhere). Exactly one.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_content_name: Option<String>,
}

/// Why the last attempt failed; cleared on success.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct SnapshotError {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
}

/// A request for a snapshot of a claim's volume.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "snapshot.storage.k8s.io",
    version = "v1",
    kind = "VolumeSnapshot",
    plural = "volumesnapshots",
    shortname = "vs",
    namespaced,
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-csi/external-snapshotter/pull/665"
    ),
    status = "VolumeSnapshotStatus",
    printcolumn = r#"{"name":"ReadyToUse","type":"boolean","jsonPath":".status.readyToUse"}"#,
    printcolumn = r#"{"name":"SourcePVC","type":"string","jsonPath":".spec.source.persistentVolumeClaimName"}"#,
    printcolumn = r#"{"name":"RestoreSize","type":"string","jsonPath":".status.restoreSize"}"#,
    printcolumn = r#"{"name":"SnapshotClass","type":"string","jsonPath":".spec.volumeSnapshotClassName"}"#,
    printcolumn = r#"{"name":"SnapshotContent","type":"string","jsonPath":".status.boundVolumeSnapshotContentName"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSpec {
    pub source: VolumeSnapshotSource,
    /// None: the default class of the source volume's driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_volume_snapshot_content_name: Option<String>,
    /// RFC 3339: when the storage took the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    /// The smallest volume it restores into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "int_or_string")]
    pub restore_size: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
}

/// What a content was made from: a volume (to snapshot) or a snapshot
/// that exists (pre-provisioned). Exactly one.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_handle: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_handle: Option<String>,
}

/// The VolumeSnapshot a content is bound to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotReference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
}

/// A snapshot as made on the storage.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "snapshot.storage.k8s.io",
    version = "v1",
    kind = "VolumeSnapshotContent",
    plural = "volumesnapshotcontents",
    shortname = "vsc",
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-csi/external-snapshotter/pull/665"
    ),
    status = "VolumeSnapshotContentStatus",
    printcolumn = r#"{"name":"ReadyToUse","type":"boolean","jsonPath":".status.readyToUse"}"#,
    printcolumn = r#"{"name":"RestoreSize","type":"integer","jsonPath":".status.restoreSize"}"#,
    printcolumn = r#"{"name":"DeletionPolicy","type":"string","jsonPath":".spec.deletionPolicy"}"#,
    printcolumn = r#"{"name":"Driver","type":"string","jsonPath":".spec.driver"}"#,
    printcolumn = r#"{"name":"VolumeSnapshot","type":"string","jsonPath":".spec.volumeSnapshotRef.name"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentSpec {
    /// `Delete`: the snapshot goes with its VolumeSnapshot; `Retain`: it stays.
    pub deletion_policy: String,
    pub driver: String,
    pub source: VolumeSnapshotContentSource,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
    pub volume_snapshot_ref: SnapshotReference,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_volume_mode: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotContentStatus {
    /// Nanoseconds since the epoch, as CSI reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    /// Bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_size: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_handle: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
}

/// A VolumeSnapshotClass: which driver makes a class's snapshots, with
/// which parameters, and what becomes of them. Its fields sit at the top
/// level (it has no spec), so it is read as this and served by its own CRD.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotClass {
    /// Always this API's; written out so that a class made here is accepted.
    #[serde(default = "api_version")]
    pub api_version: String,
    #[serde(default = "class_kind")]
    pub kind: String,
    pub metadata: kube::api::ObjectMeta,
    pub driver: String,
    pub deletion_policy: String,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

fn api_version() -> String {
    API_VERSION.into()
}

fn class_kind() -> String {
    "VolumeSnapshotClass".into()
}

impl kube::Resource for VolumeSnapshotClass {
    type DynamicType = ();
    type Scope = kube::core::ClusterResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "VolumeSnapshotClass".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        GROUP.into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "volumesnapshotclasses".into()
    }
    fn meta(&self) -> &kube::api::ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut kube::api::ObjectMeta {
        &mut self.metadata
    }
}

/// The class's CRD, written out: schemars derives a spec'd kind only.
fn class_crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    let crd = serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": "volumesnapshotclasses.snapshot.storage.k8s.io",
            "annotations": { "api-approved.kubernetes.io": APPROVAL },
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": "VolumeSnapshotClass",
                "listKind": "VolumeSnapshotClassList",
                "plural": "volumesnapshotclasses",
                "singular": "volumesnapshotclass",
                "shortNames": ["vsclass", "vsclasses"],
            },
            "scope": "Cluster",
            "versions": [{
                "name": "v1",
                "served": true,
                "storage": true,
                "additionalPrinterColumns": [
                    { "name": "Driver", "type": "string", "jsonPath": ".driver" },
                    { "name": "DeletionPolicy", "type": "string", "jsonPath": ".deletionPolicy" },
                    { "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp" },
                ],
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "required": ["driver", "deletionPolicy"],
                    "properties": {
                        "apiVersion": { "type": "string" },
                        "kind": { "type": "string" },
                        "metadata": { "type": "object" },
                        "driver": { "type": "string", "description": "The CSI driver that makes this class's snapshots." },
                        "deletionPolicy": { "type": "string", "enum": ["Delete", "Retain"], "description": "What becomes of a snapshot when its VolumeSnapshot goes." },
                        "parameters": { "type": "object", "additionalProperties": { "type": "string" }, "description": "Given to the driver with each snapshot." },
                    },
                }},
            }],
        },
    });
    // A literal of the right shape: deserialising it cannot fail.
    serde_json::from_value(crd).unwrap_or_default()
}

/// The three CRDs with the file names `deploy/snapshot-crds/` keeps them under.
pub fn all() -> Vec<(String, String)> {
    [VolumeSnapshot::crd(), VolumeSnapshotContent::crd(), class_crd()]
        .into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            // Serialising plain data cannot fail.
            (format!("{name}.yaml"), serde_norway::to_string(&crd).unwrap_or_default())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deploy_snapshot_crds_are_the_generated_ones() {
        crate::kube::crds::tests::assert_generated(
            "snapshot-crds",
            all(),
            "volagent crds --snapshots --dir deploy/snapshot-crds",
        );
        assert_eq!(class_crd().spec.names.kind, "VolumeSnapshotClass", "the class CRD parses");
        for crd in [VolumeSnapshot::crd(), VolumeSnapshotContent::crd(), class_crd()] {
            let approval = crd.metadata.annotations.unwrap_or_default();
            assert_eq!(
                approval.get("api-approved.kubernetes.io").map(String::as_str),
                Some(APPROVAL)
            );
        }
    }

    #[test]
    fn snapshot_objects_read_as_the_upstream_controller_writes_them() {
        let vs: VolumeSnapshot = serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "VolumeSnapshot",
            "metadata": { "name": "s", "namespace": "default" },
            "spec": { "source": { "persistentVolumeClaimName": "data" }, "volumeSnapshotClassName": "c" },
            "status": { "readyToUse": true, "restoreSize": "1Gi", "boundVolumeSnapshotContentName": "snapcontent-1" },
        }))
        .unwrap();
        assert_eq!(vs.spec.source.persistent_volume_claim_name.as_deref(), Some("data"));
        assert_eq!(vs.status.unwrap().restore_size, Some(serde_json::json!("1Gi")));
        let class: VolumeSnapshotClass = serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "VolumeSnapshotClass",
            "metadata": { "name": "c" }, "driver": "rbd.csi.volagent.io", "deletionPolicy": "Delete",
        }))
        .unwrap();
        assert_eq!((class.driver.as_str(), class.parameters.len()), ("rbd.csi.volagent.io", 0));
    }
}
