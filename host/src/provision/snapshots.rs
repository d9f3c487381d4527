//! VolumeSnapshots of volagent's volumes, served without the upstream
//! snapshot controller and sidecar: a VolumeSnapshot of a claim whose
//! class (VolumeSnapshotClass) names a volagent driver gets a snapshot
//! from the backend's policy ([`crate::provision`]), a
//! VolumeSnapshotContent `snapcontent-<uid>` recording it, and its status
//! ready; one that names an existing content (pre-provisioned) is bound to
//! it. Deleting the VolumeSnapshot deletes its content when the class said
//! Delete, and deleting such a content removes the snapshot from the
//! storage first (never while it cannot be: it is retried). Claims restore
//! from a ready one ([`restorable`]).

use super::Code;
use super::objects::{Context, backend_of, failed, volume_mode};
use crate::kube::controller::drive;
use crate::kube::controller::retry::{ReconcileError, api_error};
use crate::kube::snapshot_crds::{
    API_VERSION, DEFAULT_CLASS, SnapshotReference, VolumeSnapshot, VolumeSnapshotClass,
    VolumeSnapshotContent, VolumeSnapshotContentSource, VolumeSnapshotContentSpec,
};
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use std::sync::Arc;
use std::time::Duration;

/// Held on a VolumeSnapshot this controller serves until its content is
/// dealt with.
pub const SNAPSHOT_FINALIZER: &str = "volagent.io/volumesnapshot";
/// Held on a content of a volagent driver until its snapshot is removed
/// (or retained).
pub const CONTENT_FINALIZER: &str = "volagent.io/volumesnapshotcontent";
/// How soon a snapshot that waits (for its claim, its content) is looked
/// at again.
const RETRY: Duration = Duration::from_secs(5);

/// Serve VolumeSnapshots and their contents until cancelled; nothing when
/// the cluster has no snapshot API (its CRDs not installed).
pub async fn run(ctx: Arc<Context>) {
    let probe: Api<VolumeSnapshotContent> = Api::all(ctx.client.clone());
    match probe.list(&ListParams::default().limit(1)).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {
            tracing::info!(
                "no snapshot.storage.k8s.io/v1 API in this cluster: VolumeSnapshots are not served (install its CRDs and restart the controller)"
            );
            return;
        }
        Err(e) => {
            // Not known to be missing: serve, and let the watchers retry.
            tracing::warn!("checking for the snapshot API: {e}");
        }
    }
    tokio::join!(
        drive(
            Controller::new(
                Api::<VolumeSnapshot>::all(ctx.client.clone()),
                watcher::Config::default()
            ),
            reconcile_snapshot,
            ctx.clone(),
        ),
        drive(
            Controller::new(
                Api::<VolumeSnapshotContent>::all(ctx.client.clone()),
                watcher::Config::default()
            ),
            reconcile_content,
            ctx.clone(),
        ),
    );
}

/// Whether a claim can be restored from a VolumeSnapshot now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restorable {
    /// The snapshot's id.
    Ready(String),
    /// Not yet (not ready, not bound): tried again.
    Waiting(String),
    /// Never, as it stands: another driver's, another mode's.
    Refused(String),
}

/// An annotation an admin sets on a content to let claims of another
/// volume mode restore from it (a block volume's bytes mounted as a
/// filesystem are a filesystem its author crafted).
pub const ALLOW_MODE_CHANGE: &str = "snapshot.storage.k8s.io/allow-volume-mode-change";

/// Whether `content` is bound to exactly `vs`: its reference names the
/// snapshot's namespace, name and uid.
fn bound_to(content: &VolumeSnapshotContent, vs: &VolumeSnapshot) -> bool {
    let r = &content.spec.volume_snapshot_ref;
    r.namespace == vs.namespace()
        && r.name.as_deref() == Some(vs.name_any().as_str())
        && r.uid.is_some()
        && r.uid == vs.uid()
}

/// Can a claim of volume mode `mode` and `driver` be restored from
/// VolumeSnapshot `namespace/name`? Only from a ready snapshot whose
/// content is bound back to it, of the same driver and mode.
pub async fn restorable(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    driver: &str,
    mode: &str,
) -> Result<Restorable, ReconcileError> {
    let object = format!("VolumeSnapshot {namespace}/{name}");
    let snapshots: Api<VolumeSnapshot> = Api::namespaced(client.clone(), namespace);
    let Some(vs) = snapshots.get_opt(name).await.map_err(api_error(&object))? else {
        return Ok(Restorable::Waiting(format!("{object} does not exist")));
    };
    let status = vs.status.clone().unwrap_or_default();
    let (Some(true), Some(content)) =
        (status.ready_to_use, status.bound_volume_snapshot_content_name)
    else {
        return Ok(Restorable::Waiting(format!("{object} is not ready to use")));
    };
    let contents: Api<VolumeSnapshotContent> = Api::all(client.clone());
    let Some(content) = contents
        .get_opt(&content)
        .await
        .map_err(api_error(&format!("VolumeSnapshotContent {content}")))?
    else {
        return Ok(Restorable::Waiting(format!("{object}'s content {content} does not exist")));
    };
    if !bound_to(&content, &vs) {
        return Ok(Restorable::Refused(format!(
            "{object} names content {}, which is not bound to it",
            content.name_any()
        )));
    }
    if content.spec.driver != driver {
        return Ok(Restorable::Refused(format!(
            "{object} was made by {}, not {driver}: a claim restores from its own driver's snapshots",
            content.spec.driver
        )));
    }
    let from = volume_mode(content.spec.source_volume_mode.as_deref());
    let allowed = content.annotations().get(ALLOW_MODE_CHANGE).is_some_and(|v| v == "true");
    if content.spec.source_volume_mode.is_some() && from != mode && !allowed {
        return Ok(Restorable::Refused(format!(
            "{object} is of a {from} volume; a {mode} claim is restored from it only when its content is annotated {ALLOW_MODE_CHANGE}: \"true\""
        )));
    }
    let handle = handle_of(&content);
    Ok(handle.map(Restorable::Ready).unwrap_or_else(|| {
        Restorable::Waiting(format!("{object}'s content has no snapshot handle yet"))
    }))
}

/// Set on the contents this controller makes: the snapshot's id, there
/// from the content's creation (its status may never be written).
const HANDLE_ANNOTATION: &str = "volagent.io/snapshot-handle";

/// The snapshot id a content records: in its status, its creation
/// annotation, or (pre-provisioned) its spec.
fn handle_of(content: &VolumeSnapshotContent) -> Option<String> {
    content
        .status
        .as_ref()
        .and_then(|s| s.snapshot_handle.clone())
        .or_else(|| content.annotations().get(HANDLE_ANNOTATION).cloned())
        .or_else(|| content.spec.source.snapshot_handle.clone())
        .filter(|h| !h.is_empty())
}

fn reference(vs: &VolumeSnapshot) -> ObjectReference {
    ObjectReference {
        api_version: Some(API_VERSION.into()),
        kind: Some("VolumeSnapshot".into()),
        namespace: vs.namespace(),
        name: Some(vs.name_any()),
        uid: vs.uid(),
        ..Default::default()
    }
}

/// The class a snapshot asks for, or its driver's default one.
async fn class_of(
    ctx: &Context,
    vs: &VolumeSnapshot,
    driver: &str,
) -> Result<Result<VolumeSnapshotClass, String>, ReconcileError> {
    let classes: Api<VolumeSnapshotClass> = Api::all(ctx.client.clone());
    if let Some(name) = vs.spec.volume_snapshot_class_name.as_deref().filter(|n| !n.is_empty()) {
        let object = format!("VolumeSnapshotClass {name}");
        return Ok(classes
            .get_opt(name)
            .await
            .map_err(api_error(&object))?
            .ok_or_else(|| format!("{object} does not exist")));
    }
    let list =
        classes.list(&ListParams::default()).await.map_err(api_error("VolumeSnapshotClasses"))?;
    let defaults: Vec<VolumeSnapshotClass> = list
        .items
        .into_iter()
        .filter(|c| c.driver == driver)
        .filter(|c| c.annotations().get(DEFAULT_CLASS).is_some_and(|v| v == "true"))
        .collect();
    match <[VolumeSnapshotClass; 1]>::try_from(defaults) {
        Ok([class]) => Ok(Ok(class)),
        Err(d) if d.is_empty() => {
            Ok(Err(format!("no VolumeSnapshotClass named, and {driver} has no default one")))
        }
        Err(_) => {
            Ok(Err(format!("no VolumeSnapshotClass named, and {driver} has several default ones")))
        }
    }
}

/// Patch `finalizer` into or out of an object's list. The list is
/// replaced whole, from what was read, so the patch holds only on that
/// version (`resource_version`): another controller's finalizer added
/// meanwhile makes it a conflict, retried, never lost.
fn finalizers_patch(
    current: &[String],
    resource_version: Option<&str>,
    finalizer: &str,
    keep: bool,
) -> serde_json::Value {
    let mut list: Vec<String> = current.iter().filter(|f| *f != finalizer).cloned().collect();
    if keep {
        list.push(finalizer.to_string());
    }
    serde_json::json!({ "metadata": { "finalizers": list, "resourceVersion": resource_version } })
}

/// Nanoseconds since the epoch of an RFC 3339 time.
fn nanos(rfc3339: &str) -> Option<i64> {
    let t: k8s_openapi::jiff::Timestamp = rfc3339.parse().ok()?;
    i64::try_from(t.as_nanosecond()).ok()
}

fn rfc3339(nanos: i64) -> Option<String> {
    k8s_openapi::jiff::Timestamp::from_nanosecond(i128::from(nanos)).ok().map(|t| t.to_string())
}

/// Tell the snapshot's owner why it is not ready (status and Event) —
/// once per reason: the same one again writes nothing, so that a retry
/// is not a change that wakes the snapshot's reconcile at once.
async fn not_ready(ctx: &Context, vs: &VolumeSnapshot, warning: bool, reason: &str, message: &str) {
    let said = vs.status.as_ref().and_then(|s| s.error.as_ref()).and_then(|e| e.message.as_deref());
    if said == Some(message) {
        return;
    }
    let api: Api<VolumeSnapshot> =
        Api::namespaced(ctx.client.clone(), &vs.namespace().unwrap_or_default());
    let patch = serde_json::json!({ "status": {
        "readyToUse": false,
        "error": { "message": message, "time": crate::clock::now_rfc3339() },
    }});
    if let Err(e) =
        api.patch_status(&vs.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await
    {
        tracing::warn!(snapshot = %vs.name_any(), "cannot set its status: {e}");
    }
    let ns = vs.namespace().unwrap_or_default();
    ctx.event(&ns, reference(vs), warning, reason, message).await;
}

/// The content a VolumeSnapshot of this controller's gets (upstream's
/// snapshot controller names its own alike).
fn content_name(vs: &VolumeSnapshot) -> String {
    format!("snapcontent-{}", vs.uid().unwrap_or_default())
}

/// A deleted VolumeSnapshot: held while a claim still waits to be restored
/// from it; then its content goes when the policy says Delete (whose own
/// deletion removes the storage's snapshot), then its finalizer.
async fn release_snapshot(vs: &VolumeSnapshot, ctx: &Context) -> Result<Action, ReconcileError> {
    let ns = vs.namespace().unwrap_or_default();
    let name = vs.name_any();
    let object = format!("VolumeSnapshot {ns}/{name}");
    // A restore in progress keeps its source.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let waiting = claims
        .list(&ListParams::default())
        .await
        .map_err(api_error(&format!("the PVCs of namespace {ns}")))?
        .items
        .into_iter()
        .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Bound"))
        .filter(|c| c.metadata.deletion_timestamp.is_none())
        .any(|c| {
            c.spec.and_then(|s| s.data_source).is_some_and(|d| {
                d.kind == "VolumeSnapshot"
                    && d.api_group.as_deref() == Some(crate::kube::snapshot_crds::GROUP)
                    && d.name == name
            })
        });
    if waiting {
        return Ok(Action::requeue(RETRY));
    }
    let contents: Api<VolumeSnapshotContent> = Api::all(ctx.client.clone());
    let bound = vs.status.as_ref().and_then(|s| s.bound_volume_snapshot_content_name.clone());
    // Its own content by its fixed name too: the status may never have
    // been written (a controller stopped between the two).
    let mut names = vec![content_name(vs)];
    names.extend(bound.filter(|b| *b != names[0]));
    let mut content_found = false;
    for content_name in &names {
        let content_object = format!("VolumeSnapshotContent {content_name}");
        let Some(content) =
            contents.get_opt(content_name).await.map_err(api_error(&content_object))?
        else {
            continue;
        };
        if !bound_to(&content, vs) || backend_of(&content.spec.driver).is_none() {
            continue;
        }
        content_found = true;
        if content.spec.deletion_policy == "Delete" {
            if content.metadata.deletion_timestamp.is_none() {
                contents
                    .delete(content_name, &Default::default())
                    .await
                    .map_err(api_error(&content_object))?;
            }
            // Its snapshot goes first; this one once it has.
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
    }
    if !content_found {
        // Made on the storage but no content written: what the record of
        // `snapshot-<uid>` names goes with it.
        let snapshot = format!("snapshot-{}", vs.uid().unwrap_or_default());
        match ctx.provisioner.forget_snapshot(&snapshot).await {
            Ok(()) => {}
            Err(f) if matches!(f.code, Code::FailedPrecondition | Code::Aborted) => {
                return Ok(Action::requeue(RETRY));
            }
            Err(f) => return Err(failed(object, f)),
        }
    }
    let api: Api<VolumeSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = finalizers_patch(
        vs.finalizers(),
        vs.resource_version().as_deref(),
        SNAPSHOT_FINALIZER,
        false,
    );
    api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(api_error(&object))?;
    Ok(Action::await_change())
}

async fn reconcile_snapshot(
    vs: Arc<VolumeSnapshot>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let ns = vs.namespace().unwrap_or_default();
    let name = vs.name_any();
    let object = format!("VolumeSnapshot {ns}/{name}");
    let api: Api<VolumeSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let contents: Api<VolumeSnapshotContent> = Api::all(ctx.client.clone());
    let held = vs.finalizers().iter().any(|f| f == SNAPSHOT_FINALIZER);
    let status = vs.status.clone().unwrap_or_default();
    if vs.metadata.deletion_timestamp.is_some() {
        if !held {
            return Ok(Action::await_change());
        }
        return release_snapshot(&vs, &ctx).await;
    }
    if status.ready_to_use == Some(true) && status.bound_volume_snapshot_content_name.is_some() {
        return Ok(Action::await_change());
    }
    if let Some(content) = vs.spec.source.volume_snapshot_content_name.as_deref() {
        return bind_existing(&vs, content, &ctx).await;
    }
    let Some(claim_name) = vs.spec.source.persistent_volume_claim_name.as_deref() else {
        return Ok(Action::await_change());
    };
    // The claim's volume — only one bound to it both ways: a claim's
    // volumeName alone is its author's word — and whether it is ours.
    let Some((_, pv)) = super::objects::bound_volume(&ctx.client, &ns, claim_name).await? else {
        // Unbound or not there (yet): it may be ours once bound.
        return Ok(Action::requeue(RETRY));
    };
    let pv_spec = pv.spec.clone().unwrap_or_default();
    let Some(csi) = pv_spec.csi.clone() else {
        return Ok(Action::await_change());
    };
    let Some(backend) = backend_of(&csi.driver).map(str::to_string) else {
        return Ok(Action::await_change());
    };
    let class = match class_of(&ctx, &vs, &csi.driver).await? {
        Ok(class) => class,
        Err(why) => {
            not_ready(&ctx, &vs, true, "SnapshotCreationFailed", &why).await;
            return Ok(Action::requeue(RETRY));
        }
    };
    if class.driver != csi.driver {
        let why = format!(
            "VolumeSnapshotClass {} is {}'s, but claim {claim_name}'s volume is {}'s",
            class.name_any(),
            class.driver,
            csi.driver
        );
        not_ready(&ctx, &vs, true, "SnapshotCreationFailed", &why).await;
        return Ok(Action::await_change());
    }
    if !held {
        let patch = finalizers_patch(
            vs.finalizers(),
            vs.resource_version().as_deref(),
            SNAPSHOT_FINALIZER,
            true,
        );
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(&object))?;
        // The finalizer's change brings this snapshot back, held.
        return Ok(Action::await_change());
    }
    let uid = vs.uid().unwrap_or_default();
    let snapshot_name = format!("snapshot-{uid}");
    let made = match ctx
        .provisioner
        .create_snapshot(&backend, &csi.volume_handle, &snapshot_name, &class.parameters)
        .await
    {
        Ok(made) => made,
        Err(f) => {
            not_ready(&ctx, &vs, true, "SnapshotCreationFailed", &f.message).await;
            if matches!(f.code, Code::InvalidArgument | Code::Unimplemented) {
                return Ok(Action::await_change());
            }
            return Err(failed(object, f));
        }
    };
    let content_name = content_name(&vs);
    let mut content = VolumeSnapshotContent::new(
        &content_name,
        VolumeSnapshotContentSpec {
            deletion_policy: class.deletion_policy.clone(),
            driver: csi.driver.clone(),
            source: VolumeSnapshotContentSource {
                volume_handle: Some(csi.volume_handle.clone()),
                snapshot_handle: None,
            },
            volume_snapshot_class_name: Some(class.name_any()),
            volume_snapshot_ref: SnapshotReference {
                api_version: Some(API_VERSION.into()),
                kind: Some("VolumeSnapshot".into()),
                namespace: Some(ns.clone()),
                name: Some(name.clone()),
                uid: Some(uid.clone()),
                resource_version: None,
            },
            source_volume_mode: Some(volume_mode(pv_spec.volume_mode.as_deref()).to_string()),
        },
    );
    content.metadata.finalizers = Some(vec![CONTENT_FINALIZER.to_string()]);
    content.metadata.annotations = Some([(HANDLE_ANNOTATION.to_string(), made.id.clone())].into());
    let content_object = format!("VolumeSnapshotContent {content_name}");
    match contents.create(&PostParams::default(), &content).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {
            // Ours from an earlier attempt, or someone else's: only ours is
            // written to.
            let found = contents.get(&content_name).await.map_err(api_error(&content_object))?;
            if !bound_to(&found, &vs) || found.spec.driver != csi.driver {
                let why = format!("{content_object} exists and is not this snapshot's");
                not_ready(&ctx, &vs, true, "SnapshotContentCreationFailed", &why).await;
                return Ok(Action::await_change());
            }
        }
        Err(e) => return Err(api_error(&content_object)(e)),
    }
    let size = i64::try_from(made.size_bytes).unwrap_or(i64::MAX);
    let content_status = serde_json::json!({ "status": {
        "snapshotHandle": made.id,
        "readyToUse": true,
        "restoreSize": size,
        "creationTime": nanos(&made.created),
    }});
    contents
        .patch_status(&content_name, &PatchParams::default(), &Patch::Merge(&content_status))
        .await
        .map_err(api_error(&content_object))?;
    let ready = serde_json::json!({ "status": {
        "boundVolumeSnapshotContentName": content_name,
        "readyToUse": true,
        "restoreSize": made.size_bytes.to_string(),
        "creationTime": made.created,
        "error": null,
    }});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&ready))
        .await
        .map_err(api_error(&object))?;
    let message = format!("snapshot {} of {claim_name} ready ({} bytes)", made.id, made.size_bytes);
    ctx.event(&ns, reference(&vs), false, "SnapshotReady", &message).await;
    tracing::info!(snapshot = %object, id = %made.id, "snapshot made");
    Ok(Action::await_change())
}

/// A VolumeSnapshot of an existing content (pre-provisioned by an
/// admin): bound once the content, of a volagent driver, names it back
/// and is ready; the content then records the snapshot's uid.
async fn bind_existing(
    vs: &VolumeSnapshot,
    content_name: &str,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let ns = vs.namespace().unwrap_or_default();
    let object = format!("VolumeSnapshot {ns}/{}", vs.name_any());
    let contents: Api<VolumeSnapshotContent> = Api::all(ctx.client.clone());
    let content_object = format!("VolumeSnapshotContent {content_name}");
    let Some(content) = contents.get_opt(content_name).await.map_err(api_error(&content_object))?
    else {
        // Whose it will be is not known yet: nothing is written.
        return Ok(Action::requeue(RETRY));
    };
    if backend_of(&content.spec.driver).is_none() {
        return Ok(Action::await_change());
    }
    let r = &content.spec.volume_snapshot_ref;
    if r.name.as_deref() != Some(&vs.name_any())
        || r.namespace.as_deref() != Some(&ns)
        || r.uid.as_deref().is_some_and(|u| Some(u) != vs.uid().as_deref())
    {
        let why = format!("{content_object} is bound to another VolumeSnapshot");
        not_ready(ctx, vs, true, "SnapshotBindFailed", &why).await;
        return Ok(Action::await_change());
    }
    let cs = content.status.clone().unwrap_or_default();
    if cs.ready_to_use != Some(true) {
        return Ok(Action::requeue(Duration::from_secs(2)));
    }
    if r.uid.is_none() {
        // Bound to this snapshot only, from now on.
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": content.resource_version() },
            "spec": { "volumeSnapshotRef": { "uid": vs.uid() } },
        });
        contents
            .patch(content_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(&content_object))?;
    }
    let api: Api<VolumeSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
    if !vs.finalizers().iter().any(|f| f == SNAPSHOT_FINALIZER) {
        let patch = finalizers_patch(
            vs.finalizers(),
            vs.resource_version().as_deref(),
            SNAPSHOT_FINALIZER,
            true,
        );
        api.patch(&vs.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(&object))?;
        return Ok(Action::await_change());
    }
    let ready = serde_json::json!({ "status": {
        "boundVolumeSnapshotContentName": content_name,
        "readyToUse": true,
        "restoreSize": cs.restore_size.map(|b| b.to_string()),
        "creationTime": cs.creation_time.and_then(rfc3339),
        "error": null,
    }});
    api.patch_status(&vs.name_any(), &PatchParams::default(), &Patch::Merge(&ready))
        .await
        .map_err(api_error(&object))?;
    Ok(Action::await_change())
}

/// A content of a volagent driver: a pre-provisioned one is made ready as
/// given; a deleted one with policy Delete has its snapshot removed first.
async fn reconcile_content(
    content: Arc<VolumeSnapshotContent>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let Some(backend) = backend_of(&content.spec.driver).map(str::to_string) else {
        return Ok(Action::await_change());
    };
    let name = content.name_any();
    let object = format!("VolumeSnapshotContent {name}");
    let contents: Api<VolumeSnapshotContent> = Api::all(ctx.client.clone());
    let held = content.finalizers().iter().any(|f| f == CONTENT_FINALIZER);
    let status = content.status.clone().unwrap_or_default();
    let rv = content.resource_version();
    if content.metadata.deletion_timestamp.is_some() {
        if !held {
            return Ok(Action::await_change());
        }
        if let (true, Some(handle)) =
            (content.spec.deletion_policy == "Delete", handle_of(&content))
        {
            match ctx.provisioner.delete_snapshot(&backend, &handle).await {
                Ok(()) => tracing::info!(content = %name, id = %handle, "snapshot removed"),
                Err(f) if matches!(f.code, Code::FailedPrecondition | Code::Aborted) => {
                    tracing::info!(content = %name, "not removed yet: {}", f.message);
                    return Ok(Action::requeue(RETRY));
                }
                Err(f) => return Err(failed(object, f)),
            }
        }
        let patch = finalizers_patch(content.finalizers(), rv.as_deref(), CONTENT_FINALIZER, false);
        contents
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(&object))?;
        return Ok(Action::await_change());
    }
    if !held {
        let patch = finalizers_patch(content.finalizers(), rv.as_deref(), CONTENT_FINALIZER, true);
        contents
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(&object))?;
        return Ok(Action::await_change());
    }
    // Pre-provisioned: the admin (trusted) names a snapshot that exists.
    if let (Some(given), None) = (&content.spec.source.snapshot_handle, &status.snapshot_handle) {
        let patch =
            serde_json::json!({ "status": { "snapshotHandle": given, "readyToUse": true } });
        contents
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(&object))?;
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creation_times_convert_both_ways() {
        let n = nanos("2026-11-27T10:00:00Z").unwrap();
        assert_eq!(n, 1_795_773_600_000_000_000);
        assert_eq!(rfc3339(n).as_deref(), Some("2026-11-27T10:00:00Z"));
        assert_eq!(nanos("yesterday"), None);
    }

    #[test]
    fn a_finalizer_is_added_once_and_removed_alone() {
        let current = vec!["other".to_string(), SNAPSHOT_FINALIZER.to_string()];
        assert_eq!(
            finalizers_patch(&current, None, SNAPSHOT_FINALIZER, true)["metadata"]["finalizers"],
            serde_json::json!(["other", SNAPSHOT_FINALIZER])
        );
        assert_eq!(
            finalizers_patch(&current, None, SNAPSHOT_FINALIZER, false)["metadata"]["finalizers"],
            serde_json::json!(["other"])
        );
    }
}
