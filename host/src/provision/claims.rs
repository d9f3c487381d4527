//! Claims of the volagent StorageClasses, provisioned without sidecars:
//! a PersistentVolumeClaim on a class whose provisioner is
//! `<backend>.csi.volagent.io` gets a volume from the backend's policy
//! ([`crate::provision`]) and a PV bound to it (named `pvc-<claim uid>`, as
//! the upstream external-provisioner names them); a released PV of such a
//! class with reclaim policy Delete has its volume removed, then goes.
//! WaitForFirstConsumer classes wait for the scheduler's choice of node.
//! Bound claims that grow are grown by [`super::resize`]; VolumeSnapshots are
//! served by [`super::snapshots`].

use super::objects::{Context, DRIVER_SUFFIX, backend_of, failed, quantity_bytes, volume_mode};
use super::{Code, MadeVolume, Provisioner};
use crate::kube::controller::drive;
use crate::kube::controller::retry::{ReconcileError, Retries, api_error};
use crate::model::{AccessMode, ContentSource, CreateRequest, VolumeMode};
use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    PersistentVolume, PersistentVolumeClaim, PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Set by the scheduler on a claim of a WaitForFirstConsumer class.
const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// On every PV this controller makes, as the external-provisioner marks its own.
const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// Held on a provisioned PV until its volume is removed.
pub const PV_FINALIZER: &str = "volagent.io/provisioned-volume";
/// The topology key of a node, as a volume's segments name it.
const NODE_KEY: &str = "kubernetes.io/hostname";
/// How soon a claim whose volume could not be made yet is tried again.
const RETRY: Duration = Duration::from_secs(10);

/// While this replica leads: clear what unfinished creates left, then
/// provision claims, grow them, remove released volumes and serve
/// VolumeSnapshots until cancelled. `identity` names this replica in the
/// Events it writes.
pub async fn run(
    client: kube::Client,
    provisioner: Arc<Provisioner>,
    identity: String,
    namespace: String,
) {
    let events = crate::kube::cluster::Cluster {
        client: client.clone(),
        component: "volagent-controller".into(),
        node: identity,
        namespace: String::new(),
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        provisioner: provisioner.clone(),
        retries: Retries::default(),
        events,
    });
    clear_orphans(&ctx).await;
    tokio::join!(
        super::snapshots::run(ctx.clone()),
        super::capacity::run(client.clone(), provisioner, namespace),
        drive(
            Controller::new(
                Api::<PersistentVolumeClaim>::all(client.clone()),
                watcher::Config::default()
            ),
            reconcile_claim,
            ctx.clone(),
        ),
        drive(
            Controller::new(Api::<PersistentVolume>::all(client), watcher::Config::default()),
            reconcile_volume,
            ctx.clone(),
        ),
    );
}

fn access_modes(claim: &PersistentVolumeClaim) -> Vec<AccessMode> {
    let spec = claim.spec.as_ref();
    spec.and_then(|s| s.access_modes.clone())
        .unwrap_or_default()
        .iter()
        .filter_map(|m| match m.as_str() {
            "ReadWriteOnce" => Some(AccessMode::ReadWriteOnce),
            "ReadOnlyMany" => Some(AccessMode::ReadOnlyMany),
            "ReadWriteMany" => Some(AccessMode::ReadWriteMany),
            "ReadWriteOncePod" => Some(AccessMode::ReadWriteOncePod),
            _ => None,
        })
        .collect()
}

async fn reconcile_claim(
    claim: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let provisioner = &ctx.provisioner;
    let spec = claim.spec.clone().unwrap_or_default();
    if claim.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    if let Some(pv) = spec.volume_name.as_deref().filter(|v| !v.is_empty()) {
        return super::resize::reconcile(&claim, pv, &ctx).await;
    }
    let Some(class_name) = spec.storage_class_name.clone().filter(|c| !c.is_empty()) else {
        return Ok(Action::await_change());
    };
    let classes: Api<StorageClass> = Api::all(ctx.client.clone());
    let Some(class) = classes
        .get_opt(&class_name)
        .await
        .map_err(api_error(&format!("StorageClass {class_name}")))?
    else {
        return Ok(Action::await_change());
    };
    let Some(backend) = backend_of(&class.provisioner).map(str::to_string) else {
        return Ok(Action::await_change());
    };
    let annotations = claim.annotations();
    let selected = annotations.get(SELECTED_NODE).cloned();
    if class.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer") && selected.is_none() {
        // The scheduler picks the node first, then annotates the claim.
        return Ok(Action::await_change());
    }
    let uid = claim.uid().unwrap_or_default();
    let pv_name = format!("pvc-{uid}");
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    if pvs.get_opt(&pv_name).await.map_err(api_error(&format!("PV {pv_name}")))?.is_some() {
        return Ok(Action::await_change());
    }
    let requests = spec.resources.as_ref().and_then(|r| r.requests.clone()).unwrap_or_default();
    let limits = spec.resources.as_ref().and_then(|r| r.limits.clone()).unwrap_or_default();
    let bytes = |m: &BTreeMap<String, Quantity>| {
        m.get("storage").map(|q| quantity_bytes(&q.0).ok_or_else(|| q.0.clone())).transpose()
    };
    let (Ok(required), Ok(limit)) = (bytes(&requests), bytes(&limits)) else {
        tracing::warn!(claim = %claim.name_any(), "a size that is not a quantity");
        return Ok(Action::await_change());
    };
    let parameters: BTreeMap<String, String> = class.parameters.clone().unwrap_or_default();
    let source = match &spec.data_source {
        Some(s)
            if s.kind == "PersistentVolumeClaim"
                && s.api_group.as_deref().is_none_or(str::is_empty) =>
        {
            let ns = claim.namespace().unwrap_or_default();
            // Only a claim bound to its PV both ways, of this class's driver,
            // in the same volume mode.
            let Some((_, source_pv)) =
                super::objects::bound_volume(&ctx.client, &ns, &s.name).await?
            else {
                return Ok(Action::requeue(RETRY)); // its source is not bound yet
            };
            let source_spec = source_pv.spec.unwrap_or_default();
            let Some(csi) = source_spec.csi.filter(|c| c.driver == class.provisioner) else {
                let message = format!(
                    "claim {} is not a volume of {}: a claim is cloned from its own driver's volumes",
                    s.name, class.provisioner
                );
                ctx.claim_event(&claim, true, "ProvisioningFailed", &message).await;
                return Ok(Action::await_change());
            };
            let (from, to) = (
                volume_mode(source_spec.volume_mode.as_deref()),
                volume_mode(spec.volume_mode.as_deref()),
            );
            if from != to {
                let message = format!(
                    "claim {} is a {from} volume; a {to} claim cannot be cloned from it",
                    s.name
                );
                ctx.claim_event(&claim, true, "ProvisioningFailed", &message).await;
                return Ok(Action::await_change());
            }
            Some(ContentSource::Volume(csi.volume_handle))
        }
        Some(s)
            if s.kind == "VolumeSnapshot"
                && s.api_group.as_deref() == Some(crate::kube::snapshot_crds::GROUP) =>
        {
            let ns = claim.namespace().unwrap_or_default();
            let mode = volume_mode(spec.volume_mode.as_deref());
            match super::snapshots::restorable(&ctx.client, &ns, &s.name, &class.provisioner, mode)
                .await?
            {
                super::snapshots::Restorable::Ready(handle) => {
                    Some(ContentSource::Snapshot(handle))
                }
                super::snapshots::Restorable::Waiting(why) => {
                    tracing::info!(claim = %claim.name_any(), "{why}");
                    return Ok(Action::requeue(RETRY));
                }
                super::snapshots::Restorable::Refused(why) => {
                    ctx.claim_event(&claim, true, "ProvisioningFailed", &why).await;
                    return Ok(Action::await_change());
                }
            }
        }
        Some(s) => {
            let message = format!(
                "a data source this provisioner does not restore from: {} {}",
                s.kind, s.name
            );
            ctx.claim_event(&claim, true, "ProvisioningFailed", &message).await;
            return Ok(Action::await_change());
        }
        None if spec.data_source_ref.is_some() => {
            // Set alone, it is a populator's or another namespace's source:
            // not one this provisioner restores from, and never an empty volume.
            let message = "a dataSourceRef this provisioner does not restore from";
            ctx.claim_event(&claim, true, "ProvisioningFailed", message).await;
            return Ok(Action::await_change());
        }
        None => None,
    };
    let request = CreateRequest {
        name: pv_name.clone(),
        required_bytes: required.unwrap_or(0),
        limit_bytes: limit.unwrap_or(0),
        parameters: Vec::new(),
        access_modes: access_modes(&claim),
        mode: if spec.volume_mode.as_deref() == Some("Block") {
            VolumeMode::Block
        } else {
            VolumeMode::Filesystem
        },
        fs_type: parameters.get("csi.storage.k8s.io/fstype").cloned().unwrap_or_default(),
        requisite: selected.iter().map(|n| vec![(NODE_KEY.to_string(), n.clone())]).collect(),
        preferred: selected.iter().map(|n| vec![(NODE_KEY.to_string(), n.clone())]).collect(),
        source,
        local_volumes: Vec::new(),
    };
    let made = match provisioner
        .create_volume(&backend, request.clone(), &parameters, Some(&class.name_any()))
        .await
    {
        Ok(made) => made,
        // The scheduler chose a node that cannot serve the claim: it chooses again.
        Err(f) if f.code == Code::ResourceExhausted && selected.is_some() => {
            tracing::warn!(claim = %claim.name_any(), "{}", f.message);
            let ns = claim.namespace().unwrap_or_default();
            let api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
            let patch =
                serde_json::json!({ "metadata": { "annotations": { SELECTED_NODE: null } } });
            api.patch(&claim.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(api_error(&format!("PVC {ns}/{}", claim.name_any())))?;
            return Ok(Action::await_change());
        }
        Err(f) => {
            ctx.claim_event(&claim, true, "ProvisioningFailed", &f.message).await;
            return Err(failed(
                format!("PVC {}/{}", claim.namespace().unwrap_or_default(), claim.name_any()),
                f,
            ));
        }
    };
    let pv = persistent_volume(&claim, &class, &backend, &pv_name, &request, &made);
    match pvs.create(&PostParams::default(), &pv).await {
        Ok(_) => {
            tracing::info!(claim = %claim.name_any(), pv = %pv_name, id = %made.id, "provisioned");
            let message = format!("volume {pv_name} ({}) made", made.id);
            ctx.claim_event(&claim, false, "ProvisioningSucceeded", &message).await;
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(api_error(&format!("PV {pv_name}"))(e)),
    }
    Ok(Action::await_change())
}

/// The PV of a provisioned claim, bound to it.
fn persistent_volume(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    backend: &str,
    name: &str,
    request: &CreateRequest,
    made: &MadeVolume,
) -> PersistentVolume {
    let driver = format!("{backend}{DRIVER_SUFFIX}");
    let spec = claim.spec.clone().unwrap_or_default();
    let affinity = (!made.topology.is_empty()).then(|| VolumeNodeAffinity {
        required: Some(NodeSelector {
            node_selector_terms: made
                .topology
                .iter()
                .map(|segment| NodeSelectorTerm {
                    match_expressions: Some(
                        segment
                            .iter()
                            .map(|(k, v)| NodeSelectorRequirement {
                                key: k.clone(),
                                operator: "In".into(),
                                values: Some(vec![v.clone()]),
                            })
                            .collect(),
                    ),
                    ..Default::default()
                })
                .collect(),
        }),
    });
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            annotations: Some([(PROVISIONED_BY.to_string(), driver.clone())].into()),
            finalizers: Some(vec![PV_FINALIZER.to_string()]),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(
                [("storage".to_string(), Quantity(made.capacity_bytes.to_string()))].into(),
            ),
            access_modes: spec.access_modes.clone(),
            volume_mode: spec.volume_mode.clone(),
            persistent_volume_reclaim_policy: Some(
                class.reclaim_policy.clone().unwrap_or_else(|| "Delete".into()),
            ),
            storage_class_name: Some(class.name_any()),
            mount_options: class.mount_options.clone(),
            claim_ref: Some(super::objects::claim_reference(claim)),
            csi: Some(CSIPersistentVolumeSource {
                driver,
                volume_handle: made.id.clone(),
                fs_type: (!request.fs_type.is_empty()).then(|| request.fs_type.clone()),
                volume_attributes: Some(made.attributes.clone()),
                ..Default::default()
            }),
            node_affinity: affinity,
            ..Default::default()
        }),
        status: None,
    }
}

/// A provisioned PV: once released (its claim gone) with reclaim policy
/// Delete, or deleted while unbound, its volume is removed, then its
/// finalizer. A volume still in use is waited for, never forced.
async fn reconcile_volume(
    pv: Arc<PersistentVolume>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let provisioner = &ctx.provisioner;
    let Some(backend) = pv.annotations().get(PROVISIONED_BY).and_then(|d| backend_of(d)) else {
        return Ok(Action::await_change());
    };
    let backend = backend.to_string();
    let has_finalizer = pv.finalizers().iter().any(|f| f == PV_FINALIZER);
    let spec = pv.spec.clone().unwrap_or_default();
    let phase = pv.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
    let delete_policy = spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete");
    let released = phase == "Released" && delete_policy;
    let deleting = pv.metadata.deletion_timestamp.is_some() && phase != "Bound";
    if !released && !deleting {
        return Ok(Action::await_change());
    }
    // Being deleted without our finalizer: its volume was removed before
    // the finalizer went. The PV lingers for others' finalizers
    // (pv-protection), and a release asked again now would request a new
    // wipe of a volume already given back.
    if pv.metadata.deletion_timestamp.is_some() && !has_finalizer {
        return Ok(Action::await_change());
    }
    let name = pv.name_any();
    if delete_policy {
        let Some(handle) = spec.csi.as_ref().map(|c| c.volume_handle.clone()) else {
            return Ok(Action::await_change());
        };
        match provisioner.delete_volume(&backend, &handle).await {
            Ok(()) => tracing::info!(pv = %name, id = %handle, "volume removed"),
            Err(f) if matches!(f.code, Code::FailedPrecondition | Code::Aborted) => {
                tracing::info!(pv = %name, "not removed yet: {}", f.message);
                return Ok(Action::requeue(RETRY));
            }
            Err(f) => return Err(failed(format!("PV {name}"), f)),
        }
    }
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    if has_finalizer {
        let kept: Vec<String> =
            pv.finalizers().iter().filter(|f| *f != PV_FINALIZER).cloned().collect();
        let patch = serde_json::json!({ "metadata": { "finalizers": kept } });
        pvs.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(&format!("PV {name}")))?;
    }
    if released {
        match pvs.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(api_error(&format!("PV {name}"))(e)),
        }
    }
    Ok(Action::await_change())
}

/// On taking the lease: a create a controller did not finish (killed
/// between making the volume and its PV) whose claim is gone has what it
/// made removed; one whose claim is still there is finished by the claim's
/// own reconcile (the same name, the same volume).
async fn clear_orphans(ctx: &Context) {
    let provisioner = &ctx.provisioner;
    let unfinished = match provisioner.unfinished().await {
        Ok(u) => u,
        Err(f) => {
            tracing::warn!("unfinished provisioning not checked: {}", f.message);
            return;
        }
    };
    if unfinished.is_empty() {
        return;
    }
    let claims: Api<PersistentVolumeClaim> = Api::all(ctx.client.clone());
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let live: std::collections::BTreeSet<String> = match claims.list(&Default::default()).await {
        Ok(list) => list.items.iter().filter_map(|c| c.uid()).map(|u| format!("pvc-{u}")).collect(),
        Err(e) => {
            tracing::warn!("unfinished provisioning not checked: listing the claims: {e}");
            return;
        }
    };
    for (backend, name, id) in unfinished {
        if live.contains(&name) {
            continue;
        }
        match pvs.get_opt(&name).await {
            Ok(None) => {}
            Ok(Some(_)) => continue,
            Err(e) => {
                tracing::warn!(volume = %name, "not checked: {e}");
                continue;
            }
        }
        match provisioner.abandon(&backend, &name, &id).await {
            Ok(()) => {
                tracing::warn!(backend, volume = %name, id = %id, "removed what an unfinished create left, its claim gone");
            }
            Err(f) => {
                tracing::warn!(backend, volume = %name, id = %id, "an unfinished create's volume stays: {}", f.message);
            }
        }
    }
}
