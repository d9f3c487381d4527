//! The CSI Controller service of each provisioning backend's driver, for
//! clusters that run the upstream sidecars (external-provisioner,
//! -resizer, -snapshotter) in front of the controller: the same
//! [`Provisioner`] the controller's own claim watcher uses, behind the
//! CSI calls, with the spec's checks and error codes.

use super::{Code, Failure, MadeSnapshot, Provisioner};
use crate::csi::proto::csi::controller_server::{Controller, ControllerServer};
use crate::csi::proto::csi::identity_server::{Identity, IdentityServer};
use crate::csi::proto::csi::*;
use crate::model::{AccessMode, ContentSource, CreateRequest, Segment, VolumeMode};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

/// Most snapshots one ListSnapshots page holds when the caller names none.
const PAGE: usize = 256;
/// Most volume capabilities, parameters or topology segments one request
/// may carry: requests are small; a large one is refused, not walked.
const MAX_ENTRIES: usize = 128;

fn status(f: Failure) -> Status {
    match f.code {
        Code::InvalidArgument => Status::invalid_argument(f.message),
        Code::Unimplemented => Status::unimplemented(f.message),
        Code::NotFound => Status::not_found(f.message),
        Code::AlreadyExists => Status::already_exists(f.message),
        Code::OutOfRange => Status::out_of_range(f.message),
        Code::ResourceExhausted => Status::resource_exhausted(f.message),
        Code::FailedPrecondition => Status::failed_precondition(f.message),
        Code::Aborted => Status::aborted(f.message),
        Code::Unavailable => Status::unavailable(f.message),
        Code::Internal => Status::internal(f.message),
    }
}

fn invalid(m: impl Into<String>) -> Status {
    Status::invalid_argument(m.into())
}

/// Longest name or id a request may carry (what CSI asks plugins to support).
const MAX_NAME: usize = 128;

/// Field `field` is set, and at most [`MAX_NAME`] bytes.
fn present(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(invalid(format!("{field} is missing")));
    }
    if value.len() > MAX_NAME {
        return Err(invalid(format!("{field} is {} bytes, more than {MAX_NAME}", value.len())));
    }
    Ok(())
}

/// One backend's controller driver.
#[derive(Clone)]
pub struct ControllerService {
    pub provisioner: Arc<Provisioner>,
    pub backend: String,
}

/// What a list of volume capabilities asks: the access modes, the mode
/// (one for all) and the filesystem type.
fn shape(caps: &[VolumeCapability]) -> Result<(Vec<AccessMode>, VolumeMode, String), Status> {
    use volume_capability::access_mode::Mode;
    if caps.is_empty() {
        return Err(invalid("volume_capabilities is missing"));
    }
    if caps.len() > MAX_ENTRIES {
        return Err(invalid(format!("more than {MAX_ENTRIES} volume_capabilities")));
    }
    let mut modes = Vec::new();
    let mut mode = None;
    let mut fs_type = String::new();
    for cap in caps {
        let this = match &cap.access_type {
            Some(volume_capability::AccessType::Block(_)) => VolumeMode::Block,
            Some(volume_capability::AccessType::Mount(m)) => {
                if !m.fs_type.is_empty() {
                    fs_type = m.fs_type.clone();
                }
                VolumeMode::Filesystem
            }
            None => return Err(invalid("a volume capability has no access_type (block or mount)")),
        };
        if mode.is_some_and(|m| m != this) {
            return Err(invalid("volume capabilities ask for both block and mount access"));
        }
        mode = Some(this);
        let access = cap.access_mode.as_ref().map(|a| a.mode());
        modes.push(match access {
            Some(Mode::SingleNodeWriter | Mode::SingleNodeMultiWriter) => AccessMode::ReadWriteOnce,
            Some(Mode::SingleNodeSingleWriter) => AccessMode::ReadWriteOncePod,
            Some(Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly) => {
                AccessMode::ReadOnlyMany
            }
            Some(Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter) => {
                AccessMode::ReadWriteMany
            }
            Some(Mode::Unknown) | None => {
                return Err(invalid("a volume capability has no access_mode"));
            }
        });
    }
    Ok((modes, mode.unwrap_or_default(), fs_type))
}

fn bytes(field: &str, value: i64) -> Result<u64, Status> {
    u64::try_from(value).map_err(|_| invalid(format!("{field} is negative ({value})")))
}

fn range(r: Option<&CapacityRange>) -> Result<(u64, u64), Status> {
    let Some(r) = r else { return Ok((0, 0)) };
    let (required, limit) =
        (bytes("required_bytes", r.required_bytes)?, bytes("limit_bytes", r.limit_bytes)?);
    if limit != 0 && limit < required {
        return Err(Status::out_of_range(format!(
            "limit_bytes ({limit}) is below required_bytes ({required})"
        )));
    }
    Ok((required, limit))
}

fn segment(t: &Topology) -> Segment {
    let mut s: Segment = t.segments.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    s.sort();
    s
}

fn topology(s: &Segment) -> Topology {
    Topology { segments: s.iter().cloned().collect() }
}

fn parameters(
    p: &HashMap<String, String>,
) -> Result<std::collections::BTreeMap<String, String>, Status> {
    if p.len() > MAX_ENTRIES {
        return Err(invalid(format!("more than {MAX_ENTRIES} parameters")));
    }
    Ok(p.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

fn content_source(s: &ContentSource) -> VolumeContentSource {
    use volume_content_source::{SnapshotSource, Type, VolumeSource};
    VolumeContentSource {
        r#type: Some(match s {
            ContentSource::Snapshot(id) => {
                Type::Snapshot(SnapshotSource { snapshot_id: id.clone() })
            }
            ContentSource::Volume(id) => Type::Volume(VolumeSource { volume_id: id.clone() }),
        }),
    }
}

fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn snapshot(s: &MadeSnapshot) -> Snapshot {
    let created = humantime::parse_rfc3339(&s.created)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| prost_types::Timestamp {
            seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
        });
    Snapshot {
        size_bytes: signed(s.size_bytes),
        snapshot_id: s.id.clone(),
        source_volume_id: s.source_volume_id.clone(),
        creation_time: created,
        ready_to_use: true,
        group_snapshot_id: String::new(),
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        present("name", &r.name)?;
        let (access_modes, mode, fs_type) = shape(&r.volume_capabilities)?;
        let (required, limit) = range(r.capacity_range.as_ref())?;
        let source = match r.volume_content_source.and_then(|s| s.r#type) {
            None => None,
            Some(volume_content_source::Type::Snapshot(s)) => {
                present("volume_content_source.snapshot.snapshot_id", &s.snapshot_id)?;
                Some(ContentSource::Snapshot(s.snapshot_id))
            }
            Some(volume_content_source::Type::Volume(v)) => {
                present("volume_content_source.volume.volume_id", &v.volume_id)?;
                Some(ContentSource::Volume(v.volume_id))
            }
        };
        let topology_req = r.accessibility_requirements.unwrap_or_default();
        if topology_req.requisite.len() + topology_req.preferred.len() > MAX_ENTRIES {
            return Err(invalid(format!("more than {MAX_ENTRIES} topology segments")));
        }
        let request = CreateRequest {
            name: r.name,
            required_bytes: required,
            limit_bytes: limit,
            parameters: Vec::new(),
            access_modes,
            mode,
            fs_type,
            requisite: topology_req.requisite.iter().map(segment).collect(),
            preferred: topology_req.preferred.iter().map(segment).collect(),
            source,
            local_volumes: Vec::new(),
        };
        let made = self
            .provisioner
            .create_volume(&self.backend, request, &parameters(&r.parameters)?, None)
            .await
            .map_err(status)?;
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: signed(made.capacity_bytes),
                volume_id: made.id,
                volume_context: made.attributes.into_iter().collect(),
                content_source: made.source.as_ref().map(content_source),
                accessible_topology: made.topology.iter().map(topology).collect(),
            }),
        }))
    }

    async fn delete_volume(
        &self,
        req: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let r = req.into_inner();
        present("volume_id", &r.volume_id)?;
        self.provisioner.delete_volume(&self.backend, &r.volume_id).await.map_err(status)?;
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let r = req.into_inner();
        present("volume_id", &r.volume_id)?;
        shape(&r.volume_capabilities)?;
        if !self.provisioner.volume_exists(&self.backend, &r.volume_id).await.map_err(status)? {
            return Err(Status::not_found(format!(
                "volume {} was not made by this driver",
                r.volume_id
            )));
        }
        // The policy decides who may use a volume when a pod attaches it;
        // what can be asked of it here is confirmed as asked.
        Ok(Response::new(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(validate_volume_capabilities_response::Confirmed {
                volume_context: r.volume_context,
                volume_capabilities: r.volume_capabilities,
                parameters: r.parameters,
                mutable_parameters: HashMap::new(),
            }),
            message: String::new(),
        }))
    }

    async fn get_capacity(
        &self,
        req: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let r = req.into_inner();
        let available = self
            .provisioner
            .capacity(
                &self.backend,
                &parameters(&r.parameters)?,
                None,
                r.accessible_topology.as_ref().map(segment),
            )
            .await
            .map_err(status)?;
        Ok(Response::new(GetCapacityResponse {
            available_capacity: available.map_or(0, signed),
            maximum_volume_size: None,
            minimum_volume_size: None,
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        use controller_service_capability::rpc::Type;
        if !self.provisioner.provisions(&self.backend) {
            return Ok(Response::new(ControllerGetCapabilitiesResponse {
                capabilities: Vec::new(),
            }));
        }
        let capabilities = [
            Type::CreateDeleteVolume,
            Type::CreateDeleteSnapshot,
            Type::ListSnapshots,
            Type::CloneVolume,
            Type::ExpandVolume,
            Type::GetCapacity,
        ]
        .into_iter()
        .map(|t| ControllerServiceCapability {
            r#type: Some(controller_service_capability::Type::Rpc(
                controller_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse { capabilities }))
    }

    async fn create_snapshot(
        &self,
        req: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let r = req.into_inner();
        present("name", &r.name)?;
        present("source_volume_id", &r.source_volume_id)?;
        let made = self
            .provisioner
            .create_snapshot(
                &self.backend,
                &r.source_volume_id,
                &r.name,
                &parameters(&r.parameters)?,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(CreateSnapshotResponse { snapshot: Some(snapshot(&made)) }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let r = req.into_inner();
        present("snapshot_id", &r.snapshot_id)?;
        self.provisioner.delete_snapshot(&self.backend, &r.snapshot_id).await.map_err(status)?;
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let max = match r.max_entries {
            n if n < 0 => return Err(invalid(format!("max_entries is negative ({n})"))),
            0 => PAGE,
            n => usize::try_from(n).unwrap_or(PAGE),
        };
        let start = if r.starting_token.is_empty() {
            0
        } else {
            r.starting_token.parse::<usize>().map_err(|_| {
                Status::aborted(format!(
                    "starting_token {:?} is not one this driver gave",
                    r.starting_token
                ))
            })?
        };
        for (field, value) in
            [("snapshot_id", &r.snapshot_id), ("source_volume_id", &r.source_volume_id)]
        {
            if value.len() > MAX_NAME {
                return Err(invalid(format!(
                    "{field} is {} bytes, more than {MAX_NAME}",
                    value.len()
                )));
            }
        }
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let all = self
            .provisioner
            .snapshots(
                &self.backend,
                non_empty(&r.snapshot_id).as_deref(),
                non_empty(&r.source_volume_id).as_deref(),
            )
            .await
            .map_err(status)?;
        if start > all.len() {
            return Err(Status::aborted(format!(
                "starting_token {start} is past the {} snapshots listed",
                all.len()
            )));
        }
        let end = (start + max).min(all.len());
        Ok(Response::new(ListSnapshotsResponse {
            entries: all[start..end]
                .iter()
                .map(|s| list_snapshots_response::Entry { snapshot: Some(snapshot(s)) })
                .collect(),
            next_token: if end < all.len() { end.to_string() } else { String::new() },
        }))
    }

    async fn controller_expand_volume(
        &self,
        req: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        present("volume_id", &r.volume_id)?;
        let Some(capacity) = r.capacity_range.as_ref() else {
            return Err(invalid("capacity_range is missing"));
        };
        let (required, limit) = range(Some(capacity))?;
        let size = self
            .provisioner
            .expand_volume(&self.backend, &r.volume_id, required, limit)
            .await
            .map_err(status)?;
        // A block volume has no filesystem on the node to grow.
        let block = matches!(
            r.volume_capability.and_then(|c| c.access_type),
            Some(volume_capability::AccessType::Block(_))
        );
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: signed(size),
            node_expansion_required: !block,
        }))
    }
}

/// The Identity service of a controller driver.
#[derive(Clone)]
pub struct ControllerIdentity {
    pub provisioner: Arc<Provisioner>,
    pub backend: String,
}

#[tonic::async_trait]
impl Identity for ControllerIdentity {
    async fn get_plugin_info(
        &self,
        _req: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: crate::csi::driver_name(&self.backend),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: HashMap::from([("backend".to_string(), self.backend.clone())]),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::service::Type;
        let service = |t: Type| PluginCapability {
            r#type: Some(plugin_capability::Type::Service(plugin_capability::Service {
                r#type: t as i32,
            })),
        };
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![
                service(Type::ControllerService),
                service(Type::VolumeAccessibilityConstraints),
                PluginCapability {
                    r#type: Some(plugin_capability::Type::VolumeExpansion(
                        plugin_capability::VolumeExpansion {
                            r#type: plugin_capability::volume_expansion::Type::Online as i32,
                        },
                    )),
                },
            ],
        }))
    }

    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}

/// Where the controller driver of `backend` listens under `dir`.
pub fn socket_path(dir: &Path, backend: &str) -> PathBuf {
    dir.join(format!("{}.sock", crate::csi::driver_name(backend)))
}

/// Serve the controller driver of every provisioning backend on its socket
/// in `dir`, to peers of the uids in `allowed` only; until the task ends.
pub async fn serve(
    provisioner: Arc<Provisioner>,
    dir: &Path,
    allowed: Vec<u32>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tasks = tokio::task::JoinSet::new();
    // Every loaded backend: one without a provisioner answers that it has
    // none (UNIMPLEMENTED, with the reason) rather than not being there.
    for backend in provisioner.backends() {
        let path = socket_path(dir, &backend);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("removing the old {}", path.display()));
            }
        }
        let listener = tokio::net::UnixListener::bind(&path)
            .with_context(|| format!("listening on {}", path.display()))?;
        tracing::info!(backend, socket = %path.display(), "serving the CSI controller driver");
        let controller = ControllerServer::new(ControllerService {
            provisioner: provisioner.clone(),
            backend: backend.clone(),
        })
        .max_decoding_message_size(crate::csi::MAX_MESSAGE);
        let identity = IdentityServer::new(ControllerIdentity {
            provisioner: provisioner.clone(),
            backend: backend.clone(),
        })
        .max_decoding_message_size(crate::csi::MAX_MESSAGE);
        let uids = allowed.clone();
        let incoming =
            tokio_stream::wrappers::UnixListenerStream::new(listener).filter(move |c| match c {
                Ok(stream) => match stream.peer_cred() {
                    Ok(cred) if uids.contains(&cred.uid()) => true,
                    Ok(cred) => {
                        tracing::warn!(
                            uid = cred.uid(),
                            "refused a CSI controller connection from a peer that is not allowed"
                        );
                        false
                    }
                    Err(e) => {
                        tracing::warn!(
                            "refused a CSI controller connection whose peer is unknown: {e}"
                        );
                        false
                    }
                },
                Err(_) => true,
            });
        let router =
            tonic::transport::Server::builder().add_service(identity).add_service(controller);
        tasks.spawn(async move {
            router
                .serve_with_incoming(incoming)
                .await
                .with_context(|| format!("CSI controller driver of {backend}"))
        });
    }
    match tasks.join_next().await {
        None => std::future::pending().await,
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(anyhow::anyhow!("CSI controller task: {e}")),
    }
}
