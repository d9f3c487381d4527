//! What the watchers of Kubernetes objects share ([`super::claims`],
//! [`super::resize`], [`super::snapshots`]): the context each reconcile
//! reads, the Events it writes, and how a driver name, a size and a
//! failure read.

use super::{Code, Failure, Provisioner};
use crate::kube::controller::Retrying;
use crate::kube::controller::retry::api_error;
use crate::kube::controller::retry::{ReconcileError, Retries};
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::api::Api;
use std::sync::Arc;

/// The suffix of the provisioner names of volagent's classes.
pub const DRIVER_SUFFIX: &str = ".csi.volagent.io";

/// What every reconcile here reads.
pub struct Context {
    pub client: kube::Client,
    pub provisioner: Arc<Provisioner>,
    pub retries: Retries,
    /// Writes the Events users see on their claims and snapshots.
    pub events: crate::kube::cluster::Cluster,
}

impl Context {
    /// An Event about `claim`, in its namespace (best effort).
    pub async fn claim_event(
        &self,
        claim: &PersistentVolumeClaim,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        let ns = claim.namespace().unwrap_or_default();
        self.events.event(&ns, claim_reference(claim), warning, reason, message).await;
    }

    /// An Event about `about` in `namespace` (best effort).
    pub async fn event(
        &self,
        namespace: &str,
        about: ObjectReference,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        self.events.event(namespace, about, warning, reason, message).await;
    }
}

impl Retrying for Context {
    fn retries(&self) -> &Retries {
        &self.retries
    }
}

/// The backend of a class's provisioner name, if it is one of ours.
pub fn backend_of(provisioner: &str) -> Option<&str> {
    provisioner.strip_suffix(DRIVER_SUFFIX).filter(|b| !b.is_empty())
}

/// Bytes in a Kubernetes quantity ("1Gi", "500M", "1.5Gi", "1e9").
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q.find(|c: char| c.is_ascii_alphabetic() && c != 'e').unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let factor: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        _ => return None,
    };
    let n: f64 = number.parse().ok()?;
    let bytes = (n * factor).ceil();
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

pub fn failed(object: String, f: Failure) -> ReconcileError {
    let transient = matches!(
        f.code,
        Code::Unavailable | Code::Aborted | Code::FailedPrecondition | Code::Internal
    );
    ReconcileError::Provisioning { object, message: f.message, transient }
}

/// The PV claim `namespace/name` is bound to — only when the binding is
/// whole both ways: the claim Bound and naming the PV, the PV's claimRef
/// naming this claim (its namespace, name and uid). A claim's
/// `volumeName` alone is what its author wrote: trusted, it would let a
/// user of one namespace snapshot or clone another's volume.
pub async fn bound_volume(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<Option<(PersistentVolumeClaim, PersistentVolume)>, ReconcileError> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let object = format!("PVC {namespace}/{name}");
    let Some(claim) = claims.get_opt(name).await.map_err(api_error(&object))? else {
        return Ok(None);
    };
    let bound = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let Some(pv_name) = claim.spec.as_ref().and_then(|s| s.volume_name.clone()) else {
        return Ok(None);
    };
    if !bound || pv_name.is_empty() {
        return Ok(None);
    }
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let Some(pv) = pvs.get_opt(&pv_name).await.map_err(api_error(&format!("PV {pv_name}")))? else {
        return Ok(None);
    };
    let reference = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
    let names_it = reference.is_some_and(|r| {
        r.namespace.as_deref() == Some(namespace)
            && r.name.as_deref() == Some(name)
            && r.uid.is_some()
            && r.uid == claim.uid()
    });
    Ok(names_it.then_some((claim, pv)))
}

/// A reference to `claim` (a PV's claimRef, an Event's object).
pub fn claim_reference(claim: &PersistentVolumeClaim) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        namespace: claim.namespace(),
        name: Some(claim.name_any()),
        uid: claim.uid(),
        ..Default::default()
    }
}

/// A claim's volume mode, as Kubernetes defaults it.
pub fn volume_mode(mode: Option<&str>) -> &str {
    match mode {
        Some("Block") => "Block",
        _ => "Filesystem",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_in_bytes() {
        assert_eq!(quantity_bytes("1Gi"), Some(1 << 30));
        assert_eq!(quantity_bytes("500M"), Some(500_000_000));
        assert_eq!(quantity_bytes("1.5Ki"), Some(1536));
        assert_eq!(quantity_bytes("1e3"), Some(1000));
        assert_eq!(quantity_bytes("10"), Some(10));
        assert_eq!(quantity_bytes("1Zi"), None);
        assert_eq!(quantity_bytes("-1Gi"), None);
        assert_eq!(quantity_bytes("lots"), None);
    }

    #[test]
    fn only_volagent_drivers_are_ours() {
        assert_eq!(backend_of("rbd.csi.volagent.io"), Some("rbd"));
        assert_eq!(backend_of(".csi.volagent.io"), None);
        assert_eq!(backend_of("rbd.csi.ceph.com"), None);
    }
}
