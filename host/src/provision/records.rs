//! The controller's [`ProvisionRecord`]s: one per volume or snapshot it
//! provisions, found by backend, kind and name, or by id (a label carries
//! a digest of it).

use super::{Code, Failure, MadeSnapshot};
use crate::kube::crds::{ProvisionKind, ProvisionPhase, ProvisionRecord, ProvisionRecordSpec};
use crate::model::{AccessMode, ContentSource, CreateRequest, VolumeMode};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use sha2::{Digest, Sha256};

const BACKEND_LABEL: &str = "volagent.io/backend";
const ID_LABEL: &str = "volagent.io/id-digest";

pub struct Records {
    api: Api<ProvisionRecord>,
}

fn api_failure(what: String) -> impl Fn(kube::Error) -> Failure {
    move |e| Failure::new(Code::Unavailable, format!("{what}: the Kubernetes API: {e}"))
}

/// A label value for `id`: ids may hold '/' and '@', labels may not.
fn id_digest(id: &str) -> String {
    hex::encode(&Sha256::digest(id.as_bytes())[..20])
}

/// i64 for the record (the API's integers); sizes past it do not exist.
pub fn signed(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// A fingerprint of what a create asks beyond its name and size: the same
/// name asked with another fingerprint is another volume.
pub fn digest(r: &CreateRequest) -> String {
    let mut parameters: Vec<(&str, &str)> =
        r.parameters.iter().map(|kv| (kv.key.as_str(), kv.value.as_str())).collect();
    parameters.sort();
    let mut modes: Vec<&str> = r
        .access_modes
        .iter()
        .map(|m| match m {
            AccessMode::ReadWriteOnce => "RWO",
            AccessMode::ReadOnlyMany => "ROX",
            AccessMode::ReadWriteMany => "RWX",
            AccessMode::ReadWriteOncePod => "RWOP",
        })
        .collect();
    modes.sort_unstable();
    modes.dedup();
    let source = match &r.source {
        None => String::new(),
        Some(ContentSource::Snapshot(id)) => format!("snapshot:{id}"),
        Some(ContentSource::Volume(id)) => format!("volume:{id}"),
    };
    let mode = match r.mode {
        VolumeMode::Filesystem => "filesystem",
        VolumeMode::Block => "block",
    };
    let text = serde_json::json!([parameters, modes, mode, r.fs_type, source]).to_string();
    hex::encode(&Sha256::digest(text.as_bytes())[..16])
}

pub fn snapshot_of(spec: &ProvisionRecordSpec) -> MadeSnapshot {
    MadeSnapshot {
        id: spec.id.clone(),
        source_volume_id: spec.source.clone().unwrap_or_default(),
        size_bytes: u64::try_from(spec.capacity_bytes).unwrap_or(0),
        created: spec.created.clone(),
    }
}

impl Records {
    pub fn new(client: kube::Client) -> Records {
        Records { api: Api::all(client) }
    }

    pub async fn get(
        &self,
        backend: &str,
        kind: ProvisionKind,
        name: &str,
    ) -> Result<Option<ProvisionRecord>, Failure> {
        let object = ProvisionRecord::name_for(backend, kind, name);
        self.api
            .get_opt(&object)
            .await
            .map_err(api_failure(format!("reading ProvisionRecord {object} ({kind:?} {name})")))
    }

    pub async fn by_id(
        &self,
        backend: &str,
        kind: ProvisionKind,
        id: &str,
    ) -> Result<Option<ProvisionRecord>, Failure> {
        let selector = format!("{BACKEND_LABEL}={backend},{ID_LABEL}={}", id_digest(id));
        let list = self
            .api
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(api_failure(format!("listing the ProvisionRecords of {id}")))?;
        Ok(list.items.into_iter().find(|r| r.spec.kind == kind && r.spec.id == id))
    }

    pub async fn list(
        &self,
        backend: &str,
        kind: ProvisionKind,
    ) -> Result<Vec<ProvisionRecord>, Failure> {
        let selector = format!("{BACKEND_LABEL}={backend}");
        let list = self
            .api
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(api_failure(format!("listing backend {backend}'s ProvisionRecords")))?;
        Ok(list.items.into_iter().filter(|r| r.spec.kind == kind).collect())
    }

    /// Write a new record; one written meanwhile by another replica's
    /// request is a conflict the caller retries.
    pub async fn create(&self, spec: ProvisionRecordSpec) -> Result<(), Failure> {
        let object = ProvisionRecord::name_for(&spec.backend, spec.kind, &spec.name);
        let record = ProvisionRecord {
            metadata: ObjectMeta {
                name: Some(object.clone()),
                labels: Some(
                    [
                        (BACKEND_LABEL.to_string(), spec.backend.clone()),
                        (ID_LABEL.to_string(), id_digest(&spec.id)),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec,
        };
        match self.api.create(&PostParams::default(), &record).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Failure::new(
                Code::Aborted,
                format!("ProvisionRecord {object} was written meanwhile; try again"),
            )),
            Err(e) => Err(api_failure(format!("writing ProvisionRecord {object}"))(e)),
        }
    }

    pub async fn set_phase(
        &self,
        backend: &str,
        kind: ProvisionKind,
        name: &str,
        phase: ProvisionPhase,
        capacity: u64,
    ) -> Result<(), Failure> {
        let object = ProvisionRecord::name_for(backend, kind, name);
        let mut patch = serde_json::json!({ "spec": { "phase": phase } });
        if capacity > 0 {
            patch["spec"]["capacityBytes"] = serde_json::json!(signed(capacity));
        }
        self.api
            .patch(&object, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(api_failure(format!("updating ProvisionRecord {object}")))
    }

    pub async fn delete(
        &self,
        backend: &str,
        kind: ProvisionKind,
        name: &str,
    ) -> Result<(), Failure> {
        let object = ProvisionRecord::name_for(backend, kind, name);
        match self.api.delete(&object, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(api_failure(format!("deleting ProvisionRecord {object}"))(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::KeyValue;

    #[test]
    fn the_digest_ignores_order_and_sees_every_difference() {
        let kv = |k: &str, v: &str| KeyValue { key: k.into(), value: v.into() };
        let a = CreateRequest {
            name: "pvc-1".into(),
            parameters: vec![kv("pool", "rbd"), kv("storageCluster", "c")],
            access_modes: vec![AccessMode::ReadWriteOnce],
            ..Default::default()
        };
        let mut b = a.clone();
        b.parameters.reverse();
        b.required_bytes = 5;
        assert_eq!(digest(&a), digest(&b), "order and size are not the fingerprint");
        for change in [
            (|r: &mut CreateRequest| r.parameters[0].value = "kube".into())
                as fn(&mut CreateRequest),
            |r| r.access_modes = vec![AccessMode::ReadOnlyMany],
            |r| r.mode = VolumeMode::Block,
            |r| r.fs_type = "xfs".into(),
            |r| r.source = Some(ContentSource::Snapshot("s".into())),
        ] {
            let mut c = a.clone();
            change(&mut c);
            assert_ne!(digest(&a), digest(&c), "{c:?}");
        }
        assert_eq!(id_digest("c/p/i@s").len(), 40);
    }
}
