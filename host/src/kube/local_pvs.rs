//! The controller's half of local volumes: a PV for each volume an agent
//! discovered, and the release → wipe → delete cycle. It writes the
//! NodeLocalVolumes spec only (creates and removes operations); the agents
//! write the status.
//!
//! - A discovered volume without a PV and without an operation gets one:
//!   named by [`crate::local::pv_name`], bound to its node by
//!   `kubernetes.io/hostname`, with its StorageClass's reclaim policy, and
//!   with the wipe finalizer from the start, so that no deletion can skip
//!   the wipe.
//! - A PV released with reclaim policy Delete gets a `Delete` operation on
//!   its node. Once the agent reports it Complete, the finalizer goes and
//!   the PV is deleted; the next discovery round offers the volume as a new
//!   PV. Error stays: no PV is made for that volume until an admin removes
//!   the operation (after fixing the cause: it is then requested again).
//! - Retain PVs are never wiped; deleted, they are let go.

use super::controller::retry::{ReconcileError, api_error};
use super::crds::LOCAL_BACKEND;
use super::crds::{
    LOCAL_WIPE_FINALIZER, LocalOperation, LocalOperationKind, LocalOperationPhase, NodeLocalVolumes,
};
use k8s_openapi::api::core::v1::{
    FlexPersistentVolumeSource, Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    PersistentVolume, PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{
    Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions,
};
use std::collections::{BTreeMap, BTreeSet};

pub use super::crds::{CLASS_LABEL, NODE_LABEL, PROVISIONER};
const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";

/// What a round did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Synced {
    pub created: Vec<String>,
    pub requested: Vec<String>,
    pub deleted: Vec<String>,
    /// Reported volumes no PV was made for, and why.
    pub refused: Vec<String>,
}

/// One node's local volumes (`list`): its PVs made, wipes requested and
/// wiped ones deleted. Every local PV is read, of every node: no two may
/// offer the same device.
pub async fn sync(
    client: &kube::Client,
    list: &NodeLocalVolumes,
) -> Result<Synced, ReconcileError> {
    let node = list.metadata.name.clone().unwrap_or_default();
    let pv_api: Api<PersistentVolume> = Api::all(client.clone());
    let pvs: BTreeMap<String, PersistentVolume> = pv_api
        .list(&ListParams::default().labels(NODE_LABEL))
        .await
        .map_err(api_error("the local PersistentVolumes"))?
        .items
        .into_iter()
        .filter_map(|pv| Some((pv.metadata.name.clone()?, pv)))
        .collect();
    let classes: BTreeMap<String, StorageClass> = Api::<StorageClass>::all(client.clone())
        .list(&Default::default())
        .await
        .map_err(api_error("the StorageClasses"))?
        .items
        .into_iter()
        .filter_map(|c| Some((c.metadata.name.clone()?, c)))
        .collect();
    let hostname = Api::<Node>::all(client.clone())
        .get_opt(&node)
        .await
        .map_err(api_error(format!("Node {node}")))?
        .map(|n| {
            n.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubernetes.io/hostname").cloned())
                .unwrap_or_else(|| node.clone())
        });
    let mut out = Synced::default();
    sync_node(client, &pv_api, list, &pvs, &classes, hostname.as_ref(), &mut out).await?;
    Ok(out)
}

async fn sync_node(
    client: &kube::Client,
    pv_api: &Api<PersistentVolume>,
    list: &NodeLocalVolumes,
    pvs: &BTreeMap<String, PersistentVolume>,
    classes: &BTreeMap<String, StorageClass>,
    hostname: Option<&String>,
    out: &mut Synced,
) -> Result<(), ReconcileError> {
    let node = list.metadata.name.clone().unwrap_or_default();
    let status = list.status.clone().unwrap_or_default();
    let mut ops = list.spec.operations.clone();
    let before = ops.clone();
    let mine = pvs.values().filter(|pv| label(pv, NODE_LABEL) == Some(node.as_str()));
    for pv in mine {
        let name = pv.metadata.name.clone().unwrap_or_default();
        let uid = pv.metadata.uid.clone().unwrap_or_default();
        let ours = has_finalizer(pv);
        let deleting = pv.metadata.deletion_timestamp.is_some();
        if deleting && !ours {
            continue; // let go already
        }
        if needs_wipe(pv) {
            if !ours {
                set_finalizer(pv_api, pv, true).await?;
            }
            if !ops.iter().any(|o| o.volume == name && o.pv_uid == uid) {
                tracing::info!(pv = %name, node = %node, "local PV released: wipe requested");
                ops.push(LocalOperation {
                    volume: name.clone(),
                    kind: LocalOperationKind::Delete,
                    pv_uid: uid.clone(),
                    requested_at: crate::clock::now_rfc3339(),
                    pv: None,
                });
                out.requested.push(name.clone());
            }
        } else if deleting && lets_go(pv) && !ops.iter().any(|o| o.volume == name) {
            // Deleted holding no claim's data for us to wipe.
            set_finalizer(pv_api, pv, false).await?;
        }
    }
    // Wipes done: the PV goes (the next round offers the volume anew).
    let mut finished = BTreeSet::new();
    for op in &ops {
        if op.pv.is_some() {
            continue; // a provisioned volume's: the provisioner's to finish
        }
        let complete =
            status.operations.iter().any(|s| op.is(s) && s.phase == LocalOperationPhase::Complete);
        if !complete {
            continue;
        }
        if let Some(pv) =
            pvs.get(&op.volume).filter(|pv| pv.metadata.uid.as_deref() == Some(op.pv_uid.as_str()))
        {
            set_finalizer(pv_api, pv, false).await?;
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(op.pv_uid.clone()),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match pv_api.delete(&op.volume, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => return Err(api_error(format!("PersistentVolume {}", op.volume))(e)),
            }
            tracing::info!(pv = %op.volume, node = %node, "local volume wiped: its PV deleted");
            out.deleted.push(op.volume.clone());
        }
        finished.insert((op.volume.clone(), op.pv_uid.clone()));
    }
    ops.retain(|o| !finished.contains(&(o.volume.clone(), o.pv_uid.clone())));
    if ops != before {
        let lists: Api<NodeLocalVolumes> = Api::all(client.clone());
        // A compare-and-swap on what was read: on a conflict, the change
        // that caused it has the list reconciled again.
        let patch = serde_json::json!({ "metadata": { "resourceVersion": list.metadata.resource_version }, "spec": { "operations": ops } });
        match lists.patch(&node, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
            Err(e) => return Err(api_error(format!("NodeLocalVolumes {node}"))(e)),
        }
    }
    // New PVs: for volumes with none, and no operation pending on them. A
    // report is a claim: its names must be discovery's for that node, and
    // no path or device may be offered twice.
    let mut offers: Vec<(String, String, String, Option<String>)> =
        pvs.values().filter_map(offer_of).collect();
    for v in &status.volumes {
        if let Err(why) = super::local_claims::named_as_discovered(&node, v) {
            tracing::error!(node = %node, "no PV made: {why}");
            out.refused.push(why);
            continue;
        }
        if pvs.contains_key(&v.name) || ops.iter().any(|o| o.volume == v.name) {
            continue;
        }
        let offer = super::local_claims::Offer {
            pv: &v.name,
            node: &node,
            path: super::local_claims::offered_path(v),
            identity: v.identity.as_deref(),
        };
        let clash = offers.iter().find_map(|(pv, n, path, identity)| {
            super::local_claims::clash(
                &offer,
                &super::local_claims::Offer { pv, node: n, path, identity: identity.as_deref() },
            )
        });
        if let Some(why) = clash {
            let why = format!("node {node}'s volume {}: {why}", v.name);
            tracing::error!(node = %node, "no PV made: {why}");
            out.refused.push(why);
            continue;
        }
        offers.push((v.name.clone(), node.clone(), offer.path.to_string(), v.identity.clone()));
        let Some(class) = classes.get(&v.class) else {
            tracing::warn!(class = %v.class, volume = %v.path, node = %node, "no StorageClass of that name: no PV made");
            continue;
        };
        if provisioned(class) {
            continue; // handed out to claims by the provisioner, no PV ahead
        }
        let pv = pv_of(&node, hostname.map_or(node.as_str(), |h| h.as_str()), v, class);
        match pv_api.create(&PostParams::default(), &pv).await {
            Ok(_) => {
                tracing::info!(pv = %v.name, node = %node, path = %v.path, "local PV created");
                out.created.push(v.name.clone());
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(api_error(format!("PersistentVolume {}", v.name))(e)),
        }
    }
    Ok(())
}

/// Whether `class` has its discovered volumes provisioned to claims (its
/// provisioner is local-pv's CSI driver) rather than offered as PVs made
/// ahead.
pub fn provisioned(class: &StorageClass) -> bool {
    class.provisioner == crate::csi::driver_name(LOCAL_BACKEND)
}

/// What a local PV offers: its name, node, path and device identity.
fn offer_of(pv: &PersistentVolume) -> Option<(String, String, String, Option<String>)> {
    let options = pv.spec.as_ref()?.flex_volume.as_ref()?.options.as_ref()?;
    let identity = options.get(crate::local::discovery::IDENTITY_OPTION).cloned();
    Some((
        pv.metadata.name.clone()?,
        label(pv, NODE_LABEL)?.to_string(),
        options.get("path")?.clone(),
        identity,
    ))
}

fn label<'a>(pv: &'a PersistentVolume, key: &str) -> Option<&'a str> {
    pv.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn has_finalizer(pv: &PersistentVolume) -> bool {
    pv.metadata.finalizers.as_ref().is_some_and(|f| f.iter().any(|f| f == LOCAL_WIPE_FINALIZER))
}

/// Released (a claim used it and let go) under reclaim policy Delete.
pub fn needs_wipe(pv: &PersistentVolume) -> bool {
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    let spec = pv.spec.as_ref();
    let was_claimed = spec.is_some_and(|s| s.claim_ref.is_some());
    let delete =
        spec.and_then(|s| s.persistent_volume_reclaim_policy.as_deref()).unwrap_or("Delete")
            == "Delete";
    was_claimed && delete && matches!(phase, Some("Released" | "Failed"))
}

/// A deleted PV that needs no wipe: no claim ever used it, or its data is
/// the admin's to keep (Retain). A claimed Delete PV keeps the finalizer
/// until it is released and wiped, deleted or not.
fn lets_go(pv: &PersistentVolume) -> bool {
    let spec = pv.spec.as_ref();
    let claimed = spec.is_some_and(|s| s.claim_ref.is_some());
    let retain = spec.and_then(|s| s.persistent_volume_reclaim_policy.as_deref()) == Some("Retain");
    !claimed || retain
}

async fn set_finalizer(
    api: &Api<PersistentVolume>,
    pv: &PersistentVolume,
    on: bool,
) -> Result<(), ReconcileError> {
    let name = pv.metadata.name.clone().unwrap_or_default();
    let mut finalizers: Vec<String> = pv
        .metadata
        .finalizers
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f != LOCAL_WIPE_FINALIZER)
        .collect();
    if on {
        finalizers.push(LOCAL_WIPE_FINALIZER.into());
    }
    let patch = serde_json::json!({ "metadata": { "finalizers": finalizers, "resourceVersion": pv.metadata.resource_version } });
    match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(api_error(format!("PersistentVolume {name}"))(e)),
    }
}

/// The PV of discovered volume `v` on `node` (whose hostname label is
/// `hostname`), of StorageClass `class`. Class parameters: `fsType` for
/// block and file volumes (ext4 unless set), `wipe` (the local-pv policy's
/// wipe method).
pub fn pv_of(
    node: &str,
    hostname: &str,
    v: &super::crds::DiscoveredVolume,
    class: &StorageClass,
) -> PersistentVolume {
    let params = class.parameters.clone().unwrap_or_default();
    let fs_type = match v.kind.as_str() {
        "Filesystem" => v.fs_type.clone().unwrap_or_default(),
        _ => params.get("fsType").cloned().unwrap_or_else(|| "ext4".into()),
    };
    let mut options = BTreeMap::from([
        ("path".to_string(), v.device.clone().unwrap_or_else(|| v.path.clone())),
        ("node".to_string(), node.to_string()),
    ]);
    if let Some(identity) = &v.identity {
        options.insert(crate::local::discovery::IDENTITY_OPTION.into(), identity.clone());
    }
    if let Some(wipe) = params.get("wipe") {
        options.insert("wipe".into(), wipe.clone());
    }
    let labels = BTreeMap::from([
        (NODE_LABEL.to_string(), node.to_string()),
        (CLASS_LABEL.to_string(), v.class.clone()),
    ]);
    let annotations = BTreeMap::from([
        (PROVISIONED_BY.to_string(), PROVISIONER.to_string()),
        ("volagent.io/local-path".to_string(), v.path.clone()),
    ]);
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(v.name.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            finalizers: Some(vec![LOCAL_WIPE_FINALIZER.into()]),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".to_string(), Quantity(v.capacity.clone()))])),
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            persistent_volume_reclaim_policy: Some(
                class.reclaim_policy.clone().unwrap_or_else(|| "Delete".into()),
            ),
            storage_class_name: Some(v.class.clone()),
            volume_mode: Some("Filesystem".into()),
            flex_volume: Some(FlexPersistentVolumeSource {
                driver: super::volumes::driver_name(LOCAL_BACKEND),
                fs_type: Some(fs_type).filter(|f| !f.is_empty()),
                options: Some(options),
                ..Default::default()
            }),
            node_affinity: Some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: "kubernetes.io/hostname".into(),
                            operator: "In".into(),
                            values: Some(vec![hostname.to_string()]),
                        }]),
                        ..Default::default()
                    }],
                }),
            }),
            ..Default::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::crds::DiscoveredVolume;
    use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeStatus};

    fn discovered(kind: &str) -> DiscoveredVolume {
        DiscoveredVolume {
            name: "local-0123".into(),
            class: "fast".into(),
            path: "/mnt/fast/disk1".into(),
            kind: kind.into(),
            fs_type: (kind == "Filesystem").then(|| "xfs".into()),
            device: (kind == "Block").then(|| "/dev/sdb".into()),
            identity: (kind == "Block").then(|| "wwid:naa.5000".into()),
            capacity: "100Gi".into(),
        }
    }

    fn class(reclaim: Option<&str>, params: &[(&str, &str)]) -> StorageClass {
        StorageClass {
            metadata: ObjectMeta { name: Some("fast".into()), ..Default::default() },
            provisioner: "kubernetes.io/no-provisioner".into(),
            reclaim_policy: reclaim.map(String::from),
            parameters: Some(params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn a_pv_states_node_class_capacity_and_how_to_reach_the_device() {
        let pv = pv_of(
            "node-a",
            "host-a",
            &discovered("Block"),
            &class(None, &[("fsType", "xfs"), ("wipe", "zero")]),
        );
        let spec = pv.spec.clone().unwrap();
        assert_eq!(pv.metadata.name.as_deref(), Some("local-0123"));
        assert_eq!(
            pv.metadata.finalizers,
            Some(vec![LOCAL_WIPE_FINALIZER.to_string()]),
            "no deletion can skip the wipe"
        );
        assert_eq!(label(&pv, NODE_LABEL), Some("node-a"));
        assert_eq!(spec.persistent_volume_reclaim_policy.as_deref(), Some("Delete"));
        assert_eq!(spec.capacity.unwrap()["storage"], Quantity("100Gi".into()));
        let term = &spec.node_affinity.unwrap().required.unwrap().node_selector_terms[0];
        let req = &term.match_expressions.as_ref().unwrap()[0];
        assert_eq!(
            (req.key.as_str(), req.values.clone().unwrap()),
            ("kubernetes.io/hostname", vec!["host-a".to_string()])
        );
        let flex = spec.flex_volume.unwrap();
        assert_eq!(flex.driver, "volagent/local-pv");
        assert_eq!(flex.fs_type.as_deref(), Some("xfs"));
        let o = flex.options.unwrap();
        assert_eq!(
            (o["path"].as_str(), o["identity"].as_str(), o["wipe"].as_str(), o["node"].as_str()),
            ("/dev/sdb", "wwid:naa.5000", "zero", "node-a")
        );
        let fs = pv_of("node-a", "node-a", &discovered("Filesystem"), &class(Some("Retain"), &[]));
        let spec = fs.spec.unwrap();
        assert_eq!(spec.persistent_volume_reclaim_policy.as_deref(), Some("Retain"));
        let flex = spec.flex_volume.unwrap();
        assert_eq!(flex.fs_type.as_deref(), Some("xfs"), "a mount point's own filesystem");
        assert_eq!(flex.options.unwrap()["path"], "/mnt/fast/disk1");
    }

    #[test]
    fn only_a_released_delete_pv_that_a_claim_used_is_wiped() {
        let pv = |phase: &str, claimed: bool, policy: &str| PersistentVolume {
            spec: Some(PersistentVolumeSpec {
                claim_ref: claimed.then(ObjectReference::default),
                persistent_volume_reclaim_policy: Some(policy.into()),
                ..Default::default()
            }),
            status: Some(PersistentVolumeStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(needs_wipe(&pv("Released", true, "Delete")));
        assert!(needs_wipe(&pv("Failed", true, "Delete")));
        assert!(!needs_wipe(&pv("Released", true, "Retain")));
        assert!(!needs_wipe(&pv("Bound", true, "Delete")));
        assert!(!needs_wipe(&pv("Available", false, "Delete")));
    }
}
