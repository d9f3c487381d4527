//! Fencing another node's storage client, which no node may do itself: a
//! node's credentials reach only its own volumes' storage. The agent that
//! takes a gone node's volume over asks with a [`FenceRequest`]; the
//! controller checks it against the volume's Attachment (the client is one
//! the gone node recorded there) and the gone node's Node (deleted, or
//! tainted out-of-service), fences with the StorageCluster's
//! `controllerCredentials`, and answers in the request's status. The agent
//! waits for the answer, then deletes the request.

use super::cluster::Cluster;
use super::controller::retry::{ReconcileError, api_error};
use super::crds::{Attachment, FencePhase, FenceRequest, FenceRequestSpec, FenceRequestStatus};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use std::time::{Duration, Instant};

/// How long a blocklist call to the storage may take.
const FENCE_TIMEOUT: Duration = Duration::from_secs(60);
/// Answered requests their requester did not delete (it died) go after this.
const ANSWERED_KEPT: Duration = Duration::from_secs(600);

impl Cluster {
    /// Ask the controller to fence `node`'s client at `address` of `volume`,
    /// and wait up to `deadline` for its answer: Ok once fenced, the
    /// controller's reason when it refused.
    pub async fn fence_client(
        &self,
        volume: &str,
        node: &str,
        address: &str,
        deadline: Duration,
    ) -> Result<(), String> {
        let api: Api<FenceRequest> = Api::all(self.client.clone());
        let name = FenceRequest::name_for(volume, address);
        let request = FenceRequest {
            metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
            spec: FenceRequestSpec {
                volume: volume.into(),
                requester: self.node.clone(),
                node: node.into(),
                address: address.into(),
            },
            status: None,
        };
        let what = format!("FenceRequest {name} (volume {volume}, node {node}'s client {address})");
        let start = Instant::now();
        let mut asked = false;
        loop {
            if start.elapsed() > deadline {
                return Err(format!(
                    "{what}: no answer from the controller within {deadline:?} (is volagent controller running?)"
                ));
            }
            match api.get_opt(&name).await {
                Ok(Some(found)) => {
                    if let Some(status) = &found.status {
                        if found.spec.requester == self.node {
                            let _ = api.delete(&name, &DeleteParams::default()).await;
                        }
                        return match status.phase {
                            FencePhase::Fenced => Ok(()),
                            FencePhase::Refused => Err(format!(
                                "the controller refused to fence node {node}'s client {address}: {}",
                                status.message.clone().unwrap_or_default()
                            )),
                        };
                    }
                }
                // Not there: ask (again, if another node's request for the
                // same client was answered and deleted meanwhile).
                Ok(None) => match api.create(&PostParams::default(), &request).await {
                    Ok(_) => {
                        if !asked {
                            tracing::warn!(
                                volume,
                                node,
                                address,
                                "asked the controller to fence a gone node's storage client"
                            );
                        }
                        asked = true;
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => {}
                    Err(e) => return Err(format!("{what}: {e}")),
                },
                Err(e) if crate::kube::ledger::is_transient(&e) => {}
                Err(e) => return Err(format!("{what}: {e}")),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The controller's side, for each request as it comes: answer it, or
/// delete it once answered long ago (its requester died). Ok(Some): look
/// again after that long.
pub async fn tend(
    client: &kube::Client,
    request: &FenceRequest,
) -> Result<Option<Duration>, ReconcileError> {
    let api: Api<FenceRequest> = Api::all(client.clone());
    let name = request.metadata.name.clone().unwrap_or_default();
    let object = format!("FenceRequest {name}");
    let Some(status) = &request.status else {
        let status = answer(client, &request.spec).await;
        let s = &request.spec;
        match status.phase {
            FencePhase::Fenced => {
                tracing::warn!(request = %name, volume = %s.volume, node = %s.node, address = %s.address, requester = %s.requester, "fenced a gone node's storage client");
            }
            FencePhase::Refused => {
                tracing::error!(request = %name, volume = %s.volume, requester = %s.requester, "refused to fence: {}", status.message.as_deref().unwrap_or(""));
            }
        }
        let patch = serde_json::json!({ "status": status });
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(format!("{object} (answering it)")))?;
        // The answer comes back as a change: kept or deleted then.
        return Ok(None);
    };
    let age = humantime::parse_rfc3339(&status.answered_at).ok().and_then(|t| t.elapsed().ok());
    if let Some(left) = age.and_then(|age| ANSWERED_KEPT.checked_sub(age)) {
        return Ok(Some(left));
    }
    match api.delete(&name, &DeleteParams::default()).await {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(api_error(object)(e)),
    }
}

/// Check `request` and fence, or say why not.
pub async fn answer(client: &kube::Client, request: &FenceRequestSpec) -> FenceRequestStatus {
    let status = |phase, message: String| FenceRequestStatus {
        phase,
        message: Some(crate::text::bounded(message, 1024)),
        answered_at: crate::clock::now_rfc3339(),
    };
    match check_and_fence(client, request).await {
        Ok(done) => status(FencePhase::Fenced, done),
        Err(why) => status(FencePhase::Refused, why),
    }
}

async fn check_and_fence(client: &kube::Client, r: &FenceRequestSpec) -> Result<String, String> {
    if r.node == r.requester {
        return Err(format!("node {} asks to fence its own client", r.node));
    }
    let record = Api::<Attachment>::all(client.clone())
        .get_opt(&r.volume)
        .await
        .map_err(|e| format!("Attachment {}: {e}", r.volume))?
        .ok_or_else(|| format!("no Attachment {} records the volume", r.volume))?;
    if !record.spec.storage_clients.iter().any(|c| c.node == r.node && c.address == r.address) {
        return Err(format!(
            "Attachment {} records no client {} of node {}",
            r.volume, r.address, r.node
        ));
    }
    let node = Api::<Node>::all(client.clone())
        .get_opt(&r.node)
        .await
        .map_err(|e| format!("Node {}: {e}", r.node))?;
    let facts = super::cluster::facts_of(&r.node, node.as_ref());
    if facts.exists && !facts.out_of_service {
        return Err(format!(
            "node {} is not gone (neither deleted nor tainted {})",
            r.node,
            super::cluster::OUT_OF_SERVICE_TAINT
        ));
    }
    fence(client, &record, &r.address).await
}

/// The image of an Attachment's volume, as its recorded options name it
/// (the rbd policy's `pool`, default rbd, and `image`).
fn image_of(record: &Attachment) -> Option<(String, String)> {
    let options = record.spec.source.as_ref()?.options.as_ref()?;
    let image = options.get("image")?.clone();
    Some((options.get("pool").cloned().unwrap_or_else(|| "rbd".into()), image))
}

/// Blocklist the client at `address` of `record`'s volume at its
/// StorageCluster with the controller's credentials, then break the
/// exclusive lock it held on the volume's image, so that the next writer
/// need not fence it again (a node's user may not); what was done.
pub async fn fence(
    client: &kube::Client,
    record: &Attachment,
    address: &str,
) -> Result<String, String> {
    let volume = record.metadata.name.clone().unwrap_or_default();
    let cluster = record.spec.storage_cluster.clone().ok_or_else(|| format!("volume {volume} names no StorageCluster, whose controller credentials could fence its clients"))?;
    let ceph = super::storage::controller_connection(client, &cluster, &record.spec.backend)
        .await
        .map_err(|e| e.to_string())?
        .ceph_client();
    let (owned, image) = (address.to_string(), image_of(record));
    let work = move || {
        let storage = crate::sys::rbd_export::LibCeph;
        crate::sys::Storage::blocklist(&storage, &ceph, &owned)
            .map_err(|e| format!("blocklisting {owned}: {e}"))?;
        let Some((pool, image)) = image else { return Ok(false) };
        crate::sys::Storage::break_lock(&storage, &ceph, &pool, &image, &owned).map_err(|e| {
            format!("blocklisted {owned}, but breaking its lock on {pool}/{image}: {e}")
        })
    };
    match tokio::time::timeout(FENCE_TIMEOUT, tokio::task::spawn_blocking(work)).await {
        Ok(Ok(Ok(broke))) => Ok(format!(
            "blocklisted {address} at StorageCluster {cluster}{}",
            if broke { " and broke its lock on the volume's image" } else { "" }
        )),
        Ok(Ok(Err(e))) => Err(e),
        Ok(Err(e)) => Err(format!("blocklisting {address}: {e}")),
        Err(_) => Err(format!("blocklisting {address}: no answer within {FENCE_TIMEOUT:?}")),
    }
}
