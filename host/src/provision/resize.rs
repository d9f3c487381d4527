//! Growing a bound claim's volume when its requested size grows, as the
//! upstream external-resizer does, without it: the claim is marked
//! Resizing, the backend's policy grows the volume on the storage, the PV
//! takes the new capacity, and then either the claim takes it too (a block
//! volume: nothing to grow on the node) or it waits for kubelet's node
//! expansion (`FileSystemResizePending`; kubelet grows the filesystem
//! where the volume is mounted, through the agent's NodeExpandVolume, and
//! sets the claim's capacity). A failed growth is an Event and a status
//! the claim shows; it is tried again.

use super::Code;
use super::objects::{Context, backend_of, failed, quantity_bytes};
use crate::kube::controller::retry::{ReconcileError, api_error};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;

/// The claim's condition while the storage grows.
const RESIZING: &str = "Resizing";
/// The claim's condition while its filesystem waits for kubelet.
const FS_RESIZE_PENDING: &str = "FileSystemResizePending";
/// On a claim whose growth to this many bytes the policy refused.
const INFEASIBLE: &str = "volagent.io/resize-infeasible";

/// Bytes of a `storage` quantity in a resource map.
fn storage_bytes(
    map: Option<
        &std::collections::BTreeMap<
            String,
            k8s_openapi::apimachinery::pkg::api::resource::Quantity,
        >,
    >,
) -> Option<u64> {
    map.and_then(|m| m.get("storage")).and_then(|q| quantity_bytes(&q.0))
}

/// A bound claim (to PV `pv_name`): grow its volume when it asks for more
/// than the PV has.
pub async fn reconcile(
    claim: &PersistentVolumeClaim,
    pv_name: &str,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let spec = claim.spec.clone().unwrap_or_default();
    let Some(requested) = storage_bytes(spec.resources.as_ref().and_then(|r| r.requests.as_ref()))
    else {
        return Ok(Action::await_change());
    };
    // Most bound claims (of every driver) ask for no more than they have
    // and are not mid-growth: answered from the claim alone, no PV read.
    let status = claim.status.clone().unwrap_or_default();
    let in_progress =
        status.conditions.as_ref().is_some_and(|cs| cs.iter().any(|c| c.type_ == RESIZING))
            || status
                .allocated_resource_statuses
                .as_ref()
                .and_then(|m| m.get("storage"))
                .map(String::as_str)
                == Some("ControllerResizeInProgress");
    if !in_progress && storage_bytes(status.capacity.as_ref()).is_some_and(|has| requested <= has) {
        return Ok(Action::await_change());
    }
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let Some(pv) = pvs.get_opt(pv_name).await.map_err(api_error(&format!("PV {pv_name}")))? else {
        return Ok(Action::await_change());
    };
    let pv_spec = pv.spec.clone().unwrap_or_default();
    let Some(csi) = pv_spec.csi.as_ref() else {
        return Ok(Action::await_change());
    };
    let Some(backend) = backend_of(&csi.driver) else {
        return Ok(Action::await_change());
    };
    // Only the claim the PV is bound to may grow it.
    if pv_spec.claim_ref.as_ref().and_then(|r| r.uid.as_deref()) != claim.uid().as_deref() {
        return Ok(Action::await_change());
    }
    let has = storage_bytes(pv_spec.capacity.as_ref()).unwrap_or(0);
    let ns = claim.namespace().unwrap_or_default();
    let object = format!("PVC {ns}/{}", claim.name_any());
    let phase = status.allocated_resource_statuses.as_ref().and_then(|m| m.get("storage")).cloned();
    let allocated = storage_bytes(status.allocated_resources.as_ref());
    let resizing = status
        .conditions
        .as_ref()
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == RESIZING && c.status == "True"));
    let mark = format!("growing volume {pv_name} to {requested} bytes");
    // What the claim says already, read from what every API server keeps
    // (one before 1.24 drops allocatedResources and its statuses).
    let marked = status.conditions.as_ref().is_some_and(|cs| {
        cs.iter().any(|c| c.type_ == RESIZING && c.message.as_deref() == Some(mark.as_str()))
    });
    let refused_before = claim.annotations().get(INFEASIBLE).map(String::as_str)
        == Some(requested.to_string().as_str());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let patch_status = |patch: serde_json::Value| {
        let (claims, name, object) = (claims.clone(), claim.name_any(), object.clone());
        async move {
            claims
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(drop)
                .map_err(api_error(&object))
        }
    };
    let now = crate::clock::now_rfc3339();
    let condition = |kind: &str, message: &str| serde_json::json!([{ "type": kind, "status": "True", "lastTransitionTime": now, "message": message }]);
    let block = spec.volume_mode.as_deref() == Some("Block");
    if requested <= has {
        // Grown on the storage already: a growth a stopped controller left
        // half-recorded is finished; otherwise there is nothing to do.
        if resizing || phase.as_deref() == Some("ControllerResizeInProgress") {
            finish(claim, ctx, pv_name, has, block, &patch_status, &condition).await?;
        }
        return Ok(Action::await_change());
    }
    if refused_before
        || (phase.as_deref() == Some("ControllerResizeInfeasible") && allocated == Some(requested))
    {
        // Refused for this very size: only a new request is tried.
        return Ok(Action::await_change());
    }
    // Marked once per size: a write that changes nothing would wake this
    // reconcile at once, past the retry's backoff.
    if !marked {
        patch_status(serde_json::json!({ "status": {
            "conditions": condition(RESIZING, &mark),
            "allocatedResources": { "storage": requested.to_string() },
            "allocatedResourceStatuses": { "storage": "ControllerResizeInProgress" },
        }}))
        .await?;
    }
    let size = match ctx.provisioner.expand_volume(backend, &csi.volume_handle, requested, 0).await
    {
        Ok(size) => size,
        Err(f)
            if matches!(f.code, Code::InvalidArgument | Code::OutOfRange | Code::Unimplemented) =>
        {
            // For good, as asked: the claim says so and waits for another
            // size (the annotation, for API servers that drop the status).
            let note = serde_json::json!({ "metadata": { "annotations": { INFEASIBLE: requested.to_string() } } });
            claims
                .patch(&claim.name_any(), &PatchParams::default(), &Patch::Merge(&note))
                .await
                .map_err(api_error(&object))?;
            patch_status(serde_json::json!({ "status": {
                "conditions": [],
                "allocatedResourceStatuses": { "storage": "ControllerResizeInfeasible" },
            }}))
            .await?;
            ctx.claim_event(claim, true, "VolumeResizeFailed", &f.message).await;
            return Ok(Action::await_change());
        }
        Err(f) => {
            // Retried with backoff; the claim stays marked as growing.
            ctx.claim_event(claim, true, "VolumeResizeFailed", &f.message).await;
            return Err(failed(object, f));
        }
    };
    let patch = serde_json::json!({ "spec": { "capacity": { "storage": size.to_string() } } });
    pvs.patch(pv_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(api_error(&format!("PV {pv_name}")))?;
    finish(claim, ctx, pv_name, size, block, &patch_status, &condition).await?;
    tracing::info!(claim = %object, pv = pv_name, size, "volume grown");
    Ok(Action::await_change())
}

/// The storage has grown to `size`: a block claim takes the size; a
/// filesystem claim waits for kubelet to grow its filesystem on the node
/// (kubelet acts on `NodeResizePending`, and, before 1.32, on a PV larger
/// than the claim's capacity; it then sets the capacity itself).
async fn finish<F, Fut>(
    claim: &PersistentVolumeClaim,
    ctx: &Context,
    pv_name: &str,
    size: u64,
    block: bool,
    patch_status: &F,
    condition: &impl Fn(&str, &str) -> serde_json::Value,
) -> Result<(), ReconcileError>
where
    F: Fn(serde_json::Value) -> Fut,
    Fut: std::future::Future<Output = Result<(), ReconcileError>>,
{
    if block {
        patch_status(serde_json::json!({ "status": {
            "capacity": { "storage": size.to_string() },
            "conditions": [],
            "allocatedResourceStatuses": null,
        }}))
        .await?;
        let message = format!("volume {pv_name} grew to {size} bytes");
        ctx.claim_event(claim, false, "VolumeResizeSuccessful", &message).await;
    } else {
        patch_status(serde_json::json!({ "status": {
            "conditions": condition(
                FS_RESIZE_PENDING,
                "waiting for the node to grow the filesystem where the volume is mounted",
            ),
            "allocatedResourceStatuses": { "storage": "NodeResizePending" },
        }}))
        .await?;
        let message = format!(
            "volume {pv_name} grew to {size} bytes on the storage; its filesystem grows on the node"
        );
        ctx.claim_event(claim, false, "FileSystemResizeRequired", &message).await;
    }
    Ok(())
}
