//! The CSI Node service of one backend's driver.

use super::proto::csi::node_server::Node;
use super::proto::csi::*;
use super::request;
use crate::ops::Agent;
use crate::ops::FailureKind;
use crate::ops::csi::CsiError;
use std::path::Path;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct NodeService {
    pub agent: Arc<Agent>,
    pub backend: String,
}

/// The topology key each node's drivers report: volumes are node-local
/// until a backend says otherwise.
pub const TOPOLOGY_KEY: &str = "topology.volagent.io/node";

/// The gRPC status of a failed call, with the code the spec asks for.
pub fn status(e: CsiError) -> Status {
    match e {
        CsiError::Invalid(m) => Status::invalid_argument(m),
        CsiError::NotFound(m) => Status::not_found(m),
        CsiError::Exists(m) => Status::already_exists(m),
        CsiError::Precondition(m) => Status::failed_precondition(m),
        CsiError::OutOfRange(m) => Status::out_of_range(m),
        CsiError::Op(f) => match f.kind {
            FailureKind::BadRequest => Status::invalid_argument(f.message),
            FailureKind::Denied => Status::failed_precondition(f.message),
            FailureKind::Busy => Status::aborted(f.message),
            FailureKind::TimedOut => Status::deadline_exceeded(f.message),
            FailureKind::Unavailable | FailureKind::UnknownBackend => {
                Status::unavailable(f.message)
            }
            FailureKind::Failed => Status::internal(f.message),
        },
    }
}

/// Run a call's work on a task of its own ([`crate::ops::served`]):
/// kubelet cancelling the call at its deadline must not cut the pipeline
/// short half-way (a lock dropped, a record not rolled back), and a step
/// hanging past the plan deadline gets DEADLINE_EXCEEDED while it goes on.
/// Kubelet's retry finds the work done, or in progress (ABORTED).
async fn detached<T: Send + 'static>(
    agent: &Agent,
    work: impl std::future::Future<Output = Result<T, CsiError>> + Send + 'static,
) -> Result<T, CsiError> {
    crate::ops::served(agent.plan_deadline(), work).await?
}

fn result_label<T>(r: &Result<T, CsiError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(CsiError::Invalid(_)) => "bad_request",
        Err(CsiError::NotFound(_)) => "not_found",
        Err(CsiError::Exists(_)) => "exists",
        Err(CsiError::Precondition(_)) => "precondition",
        Err(CsiError::OutOfRange(_)) => "out_of_range",
        Err(CsiError::Op(f)) => match f.kind {
            FailureKind::Denied => "denied",
            FailureKind::Busy => "busy",
            FailureKind::TimedOut => "timed_out",
            FailureKind::BadRequest => "bad_request",
            FailureKind::Unavailable | FailureKind::UnknownBackend => "unavailable",
            FailureKind::Failed => "failed",
        },
    }
}

impl NodeService {
    fn roots(&self) -> [&Path; 2] {
        self.agent.node.config.kubelet_roots()
    }

    /// Count, time and log a call; its error as a gRPC status.
    fn finish<T>(
        &self,
        op: &'static str,
        volume: &str,
        start: std::time::Instant,
        r: Result<T, CsiError>,
    ) -> Result<Response<T>, Status> {
        let elapsed = start.elapsed();
        crate::metrics::get().operation(op, &self.backend, result_label(&r), elapsed);
        match &r {
            Ok(_) => {
                tracing::info!(op, backend = %self.backend, volume, took_ms = elapsed.as_secs_f64() * 1e3, "csi call done");
            }
            Err(e) => {
                tracing::warn!(op, backend = %self.backend, volume, took_ms = elapsed.as_secs_f64() * 1e3, "csi call failed: {e:?}");
            }
        }
        r.map(Response::new).map_err(status)
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        req: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let start = std::time::Instant::now();
        let r = req.into_inner();
        let id = r.volume_id.clone();
        let (agent, backend) = (self.agent.clone(), self.backend.clone());
        let result = detached(&self.agent, async move {
            let staged = request::stage(&agent.node.config.kubelet_roots(), r)?;
            agent.csi_stage(&backend, staged).await
        })
        .await;
        self.finish("csi_stage", &id, start, result.map(|()| NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        req: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let start = std::time::Instant::now();
        let r = req.into_inner();
        let (agent, backend, asked) = (self.agent.clone(), self.backend.clone(), r.clone());
        let result = detached(&self.agent, async move {
            let id = request::volume_id(&asked.volume_id)?;
            let staging = request::kubelet_path(
                &agent.node.config.kubelet_roots(),
                "staging_target_path",
                &asked.staging_target_path,
            )?;
            agent.csi_unstage(&backend, &id, &staging).await
        })
        .await;
        self.finish(
            "csi_unstage",
            &r.volume_id,
            start,
            result.map(|()| NodeUnstageVolumeResponse {}),
        )
    }

    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let start = std::time::Instant::now();
        let r = req.into_inner();
        let (agent, backend, asked) = (self.agent.clone(), self.backend.clone(), r.clone());
        let result = detached(&self.agent, async move {
            let p = request::publish(&agent.node.config.kubelet_roots(), &asked)?;
            agent.csi_publish(&backend, p).await
        })
        .await;
        self.finish(
            "csi_publish",
            &r.volume_id,
            start,
            result.map(|()| NodePublishVolumeResponse {}),
        )
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let start = std::time::Instant::now();
        let r = req.into_inner();
        let (agent, asked) = (self.agent.clone(), r.clone());
        let result = detached(&self.agent, async move {
            let id = request::volume_id(&asked.volume_id)?;
            let target = request::kubelet_path(
                &agent.node.config.kubelet_roots(),
                "target_path",
                &asked.target_path,
            )?;
            agent.csi_unpublish(&id, &target).await
        })
        .await;
        self.finish(
            "csi_unpublish",
            &r.volume_id,
            start,
            result.map(|()| NodeUnpublishVolumeResponse {}),
        )
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is missing"));
        }
        // An id that cannot name a volume of ours names none.
        let id = request::volume_id(&r.volume_id).map_err(|_| {
            Status::not_found(format!(
                "no volume {:?} on this node",
                crate::text::bounded(r.volume_id.clone(), 300)
            ))
        })?;
        if r.volume_path.is_empty() {
            return Err(Status::invalid_argument("volume_path is missing"));
        }
        // A path outside kubelet's root holds no volume of ours.
        let path = request::kubelet_path(&self.roots(), "volume_path", &r.volume_path)
            .map_err(|_| Status::not_found(format!("volume {id} is not at {}", r.volume_path)))?;
        let stats = self.agent.csi_volume_stats(&id, &path).await.map_err(status)?;
        let usage = stats
            .usage
            .map(|u| {
                let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                vec![
                    VolumeUsage {
                        available: n(u.bytes_available),
                        total: n(u.bytes_total),
                        used: n(u.bytes_used),
                        unit: volume_usage::Unit::Bytes as i32,
                    },
                    VolumeUsage {
                        available: n(u.inodes_free),
                        total: n(u.inodes_total),
                        used: n(u.inodes_used),
                        unit: volume_usage::Unit::Inodes as i32,
                    },
                ]
            })
            .unwrap_or_default();
        let volume_condition = Some(match stats.abnormal {
            Some(message) => VolumeCondition { abnormal: true, message },
            None => VolumeCondition { abnormal: false, message: "mounted".into() },
        });
        Ok(Response::new(NodeGetVolumeStatsResponse { usage, volume_condition }))
    }

    async fn node_expand_volume(
        &self,
        req: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let start = std::time::Instant::now();
        let r = req.into_inner();
        let (agent, asked) = (self.agent.clone(), r.clone());
        let result = detached(&self.agent, async move {
            if asked.volume_id.is_empty() {
                return Err(CsiError::Invalid("volume_id is missing".into()));
            }
            let id = request::volume_id(&asked.volume_id).map_err(|_| CsiError::NotFound(format!("no volume {:?} on this node", crate::text::bounded(asked.volume_id.clone(), 300))))?;
            if asked.volume_path.is_empty() {
                return Err(CsiError::Invalid("volume_path is missing".into()));
            }
            if let Some(cap) = &asked.volume_capability
                && matches!(cap.access_type, Some(volume_capability::AccessType::Block(_)))
            {
                return Err(CsiError::Invalid("block volumes are not served by this driver yet".into()));
            }
            let path = request::kubelet_path(&agent.node.config.kubelet_roots(), "volume_path", &asked.volume_path)
                .map_err(|_| CsiError::NotFound(format!("volume {id} is not at {}", asked.volume_path)))?;
            let size = agent.csi_expand(&id, &path).await?;
            let required = asked.capacity_range.as_ref().map(|c| c.required_bytes).unwrap_or(0);
            if required > 0 && i128::from(size) < i128::from(required) {
                return Err(CsiError::OutOfRange(format!("volume {id} grew to its device's {size} bytes, less than the {required} asked: the storage under it has not grown enough")));
            }
            Ok(size)
        })
        .await;
        self.finish(
            "csi_expand",
            &r.volume_id,
            start,
            result.map(|size| NodeExpandVolumeResponse {
                capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
            }),
        )
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::rpc::Type;
        let rpc = |t: Type| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(node_service_capability::Rpc {
                r#type: t as i32,
            })),
        };
        let capabilities = vec![
            rpc(Type::StageUnstageVolume),
            rpc(Type::GetVolumeStats),
            rpc(Type::ExpandVolume),
            rpc(Type::VolumeCondition),
            rpc(Type::SingleNodeMultiWriter),
        ];
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _req: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        let node = self.agent.node.config.node.clone();
        Ok(Response::new(NodeGetInfoResponse {
            node_id: node.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(Topology {
                segments: [(TOPOLOGY_KEY.to_string(), node)].into(),
            }),
        }))
    }
}
