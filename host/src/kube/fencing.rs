//! Fencing another node's storage client, which no node may do itself: a
//! node's credentials reach only its own volumes' storage. The agent that
//! takes a gone node's volume over asks with a [`FenceRequest`]; the
//! controller checks it against the volume's Attachment (the client is one
//! the gone node recorded there) and the gone node's Node (deleted, or
//! tainted out-of-service), fences with the StorageCluster's
//! `controllerCredentials`, and answers in the request's status. The agent
//! waits for the answer, then deletes the request.

use super::cluster::Cluster;
use super::crds::{Attachment, FencePhase, FenceRequest, FenceRequestSpec, FenceRequestStatus};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
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

/// The controller's side: answer every request as it comes, and delete
/// answered ones their requester left behind (checked every minute too,
/// since an answered request sees no more changes). Runs until cancelled.
pub async fn serve(client: kube::Client) {
    let api: Api<FenceRequest> = Api::all(client.clone());
    let requests =
        watcher(api.clone(), watcher::Config::default()).default_backoff().applied_objects();
    let mut requests = std::pin::pin!(requests);
    let mut sweep = tokio::time::interval(Duration::from_secs(60));
    loop {
        tokio::select! {
            Some(request) = requests.next() => {
                if let Ok(request) = request {
                    tend(&client, &api, request).await;
                }
            }
            _ = sweep.tick() => {
                if let Ok(list) = api.list(&Default::default()).await {
                    for request in list.items.into_iter().filter(|r| r.status.is_some()) {
                        tend(&client, &api, request).await;
                    }
                }
            }
        }
    }
}

/// Answer `request`, or delete it when it was answered long ago.
async fn tend(client: &kube::Client, api: &Api<FenceRequest>, request: FenceRequest) {
    let name = request.metadata.name.clone().unwrap_or_default();
    match &request.status {
        None => {
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
            if let Err(e) =
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await
            {
                tracing::error!(request = %name, "answering a fence request: {e}");
            }
        }
        Some(status) => {
            let old = humantime::parse_rfc3339(&status.answered_at)
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age > ANSWERED_KEPT);
            if old {
                let _ = api.delete(&name, &DeleteParams::default()).await;
            }
        }
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
