//! Running a controller plan: each step against the storage, with a
//! deadline, on the mechanism of its kind — librbd as the controller's
//! user of the StorageCluster the step names for RBD images, libgfapi as a
//! client of its servers for directories of gluster volumes. Every step is
//! idempotent, so a plan that failed half-way is run again from its start
//! by the request's retry.

use super::{Code, Failure};
use crate::kube::volumes::VolumeError;
use crate::model::ControllerStep;
use crate::sys::gluster_dirs::{DirError, GlusterDirs, GlusterVolume, LibGfapiDirs};
use crate::sys::rbd_export::{CephClient, RbdError};
use crate::sys::rbd_images::{ImageError, LibRbdImages, RbdImages, feature_bits};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// The mechanisms controller steps run on, one per kind of storage.
#[derive(Clone)]
pub struct Mechanisms {
    pub images: Arc<dyn RbdImages>,
    pub dirs: Arc<dyn GlusterDirs>,
}

impl Mechanisms {
    /// librbd and libgfapi, each loaded when a step first needs it.
    pub fn real() -> Mechanisms {
        Mechanisms {
            images: Arc::new(LibRbdImages::default()),
            dirs: Arc::new(LibGfapiDirs::new()),
        }
    }
}

pub struct Executor {
    client: kube::Client,
    mechanisms: Mechanisms,
    deadline: Duration,
}

/// How the controller reaches one StorageCluster's storage for a step.
#[derive(Clone)]
enum Reach {
    /// As its controller user.
    Ceph(CephClient),
    /// As a client of its servers (Gluster has no users).
    Gluster(Vec<String>),
}

/// The mechanism a step runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Mechanism {
    Rbd,
    Gluster,
    Local,
}

fn mechanism(step: &ControllerStep) -> Mechanism {
    match step {
        ControllerStep::CreateImage(_)
        | ControllerStep::DeleteImage(_)
        | ControllerStep::ResizeImage(_)
        | ControllerStep::CreateSnapshot(_)
        | ControllerStep::DeleteSnapshot(_)
        | ControllerStep::CloneImage(_) => Mechanism::Rbd,
        ControllerStep::CreateDirectory(_)
        | ControllerStep::RemoveDirectory(_)
        | ControllerStep::SetQuota(_) => Mechanism::Gluster,
        // Never put to a mechanism: run through the API server.
        ControllerStep::TakeLocalVolume(_) | ControllerStep::ReleaseLocalVolume(_) => {
            Mechanism::Local
        }
    }
}

pub(super) fn cluster_failure(e: VolumeError) -> Failure {
    match e {
        VolumeError::Refused(m) => Failure::new(Code::FailedPrecondition, m),
        e @ VolumeError::Api { .. } => Failure::new(Code::Unavailable, e.to_string()),
    }
}

fn image_failure(e: ImageError) -> Failure {
    let code = match &e {
        ImageError::NotFound(_) => Code::NotFound,
        ImageError::Conflict(_) => Code::AlreadyExists,
        ImageError::Busy(_) => Code::FailedPrecondition,
        ImageError::Refused(_) => Code::OutOfRange,
        ImageError::Ceph(RbdError::Invalid { .. }) => Code::InvalidArgument,
        ImageError::Ceph(_) => Code::Unavailable,
    };
    Failure::new(code, e.to_string())
}

fn dir_failure(e: DirError) -> Failure {
    let code = match &e {
        DirError::NotFound(_) => Code::NotFound,
        DirError::Conflict(_) => Code::AlreadyExists,
        DirError::Unready(_) => Code::FailedPrecondition,
        DirError::Refused(_) => Code::OutOfRange,
        DirError::Invalid(_) => Code::InvalidArgument,
        DirError::Library(_) | DirError::Gluster { .. } => Code::Unavailable,
    };
    Failure::new(code, e.to_string())
}

impl Executor {
    pub fn new(client: kube::Client, mechanisms: Mechanisms, deadline: Duration) -> Executor {
        Executor { client, mechanisms, deadline }
    }

    /// How to reach `cluster` for steps on `mechanism`.
    async fn reach(
        &self,
        cluster: &str,
        backend: &str,
        mechanism: Mechanism,
    ) -> Result<Reach, Failure> {
        Ok(match mechanism {
            Mechanism::Rbd => Reach::Ceph(
                crate::kube::storage::controller_connection(&self.client, cluster, backend)
                    .await
                    .map_err(cluster_failure)?
                    .ceph_client(),
            ),
            Mechanism::Gluster => Reach::Gluster(
                crate::kube::storage::cluster_endpoints(&self.client, cluster, backend)
                    .await
                    .map_err(cluster_failure)?,
            ),
            Mechanism::Local => {
                return Err(Failure::new(Code::Internal, "a local step has no StorageCluster"));
            }
        })
    }

    /// Run `steps` in order; the size the last sizing step left, if any.
    pub async fn run(
        &self,
        backend: &str,
        steps: &[ControllerStep],
    ) -> Result<Option<u64>, Failure> {
        let mut reached: BTreeMap<(String, Mechanism), Reach> = BTreeMap::new();
        let mut size = None;
        for (index, step) in steps.iter().enumerate() {
            let Some(cluster) = step.cluster() else {
                // A local volume's: settled through the API server.
                self.run_local(backend, step).await.map_err(|f| Failure {
                    code: f.code,
                    message: format!("step {} ({}): {}", index + 1, step.kind().name(), f.message),
                })?;
                continue;
            };
            let key = (cluster.to_string(), mechanism(step));
            if !reached.contains_key(&key) {
                let reach = self.reach(&key.0, backend, key.1).await?;
                reached.insert(key.clone(), reach);
            }
            let reach = reached[&key].clone();
            let mechanisms = self.mechanisms.clone();
            let owned = step.clone();
            let started = std::time::Instant::now();
            let work = tokio::task::spawn_blocking(move || match reach {
                Reach::Ceph(client) => run_rbd_step(&*mechanisms.images, &client, &owned),
                Reach::Gluster(servers) => run_gluster_step(&*mechanisms.dirs, servers, &owned),
            });
            let done = tokio::time::timeout(self.deadline, work).await.map_err(|_| {
                Failure::new(
                    Code::Unavailable,
                    format!(
                        "step {} ({}) did not finish within {} s; it is retried with the request",
                        index + 1,
                        step.kind().name(),
                        self.deadline.as_secs()
                    ),
                )
            })?;
            let done =
                done.map_err(|e| Failure::new(Code::Internal, format!("step {}: {e}", index + 1)))?;
            let step_size = done.map_err(|f| Failure {
                code: f.code,
                message: format!("step {} ({}): {}", index + 1, step.kind().name(), f.message),
            })?;
            tracing::info!(
                backend,
                step = step.kind().name(),
                ms = started.elapsed().as_millis() as u64,
                "controller step done"
            );
            if step_size.is_some() {
                size = step_size;
            }
        }
        Ok(size)
    }
}

impl Executor {
    /// A local volume's step: taking one is settled by the request's
    /// record (written before the plan runs); giving one back asks its
    /// node's agent to wipe it.
    async fn run_local(&self, backend: &str, step: &ControllerStep) -> Result<(), Failure> {
        match step {
            ControllerStep::TakeLocalVolume(_) => Ok(()),
            ControllerStep::ReleaseLocalVolume(volume) => {
                super::local::release(&self.client, backend, volume).await
            }
            other => Err(wrong_mechanism(other, "the API server")),
        }
    }
}

/// One RBD step; the image's size where the step knows it.
fn run_rbd_step(
    images: &dyn RbdImages,
    client: &CephClient,
    step: &ControllerStep,
) -> Result<Option<u64>, Failure> {
    let features =
        |names: &[String]| feature_bits(names).map_err(|m| Failure::new(Code::InvalidArgument, m));
    match step {
        ControllerStep::CreateImage(c) => {
            let i = &c.image;
            images
                .create(
                    client,
                    &i.pool,
                    &i.image,
                    c.size_bytes,
                    c.data_pool.as_deref(),
                    features(&c.features)?,
                )
                .map_err(image_failure)?;
            Ok(Some(c.size_bytes))
        }
        ControllerStep::DeleteImage(i) => {
            images.remove(client, &i.pool, &i.image).map_err(image_failure)?;
            Ok(None)
        }
        ControllerStep::ResizeImage(r) => {
            let i = &r.image;
            let have = images.size(client, &i.pool, &i.image).map_err(image_failure)?.ok_or_else(
                || {
                    Failure::new(
                        Code::NotFound,
                        format!("rbd image {}/{} does not exist", i.pool, i.image),
                    )
                },
            )?;
            if have > r.size_bytes {
                return Err(Failure::new(
                    Code::OutOfRange,
                    format!(
                        "rbd image {}/{} has {have} bytes, more than the {} asked for: images are never shrunk",
                        i.pool, i.image, r.size_bytes
                    ),
                ));
            }
            Ok(Some(images.grow(client, &i.pool, &i.image, r.size_bytes).map_err(image_failure)?))
        }
        ControllerStep::CreateSnapshot(s) => {
            let i = &s.image;
            Ok(Some(
                images.snapshot(client, &i.pool, &i.image, &s.snapshot).map_err(image_failure)?,
            ))
        }
        ControllerStep::DeleteSnapshot(s) => {
            let i = &s.image;
            images
                .remove_snapshot(client, &i.pool, &i.image, &s.snapshot)
                .map_err(image_failure)?;
            Ok(None)
        }
        ControllerStep::CloneImage(c) => {
            let p = &c.parent.image;
            let size = images
                .clone_image(
                    client,
                    &p.pool,
                    &p.image,
                    &c.parent.snapshot,
                    &c.image,
                    features(&c.features)?,
                    c.max_depth,
                )
                .map_err(image_failure)?;
            Ok(Some(size))
        }
        other => Err(wrong_mechanism(other, "librbd")),
    }
}

fn wrong_mechanism(step: &ControllerStep, mechanism: &str) -> Failure {
    Failure::new(
        Code::Internal,
        format!("step {} put to {mechanism}, which does not run it", step.kind().name()),
    )
}

/// One gluster step, on the volume it names at `servers`; the volume's
/// size (its quota) where the step sets one.
fn run_gluster_step(
    dirs: &dyn GlusterDirs,
    servers: Vec<String>,
    step: &ControllerStep,
) -> Result<Option<u64>, Failure> {
    let at = |volume: &str| GlusterVolume { servers: servers.clone(), volume: volume.to_string() };
    match step {
        ControllerStep::CreateDirectory(c) => {
            dirs.create(&at(&c.dir.volume), &c.dir.path, c.quota_bytes).map_err(dir_failure)?;
            Ok((c.quota_bytes > 0).then_some(c.quota_bytes))
        }
        ControllerStep::RemoveDirectory(d) => {
            dirs.remove(&at(&d.volume), &d.path).map_err(dir_failure)?;
            Ok(None)
        }
        ControllerStep::SetQuota(q) => {
            dirs.raise_quota(&at(&q.dir.volume), &q.dir.path, q.bytes).map_err(dir_failure)
        }
        other => Err(wrong_mechanism(other, "libgfapi")),
    }
}
