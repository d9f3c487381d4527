//! Running a controller plan: each step against the storage, as the
//! controller's user of the StorageCluster the step names, with a deadline.
//! Every step is idempotent, so a plan that failed half-way is run again
//! from its start by the request's retry.

use super::{Code, Failure};
use crate::kube::volumes::VolumeError;
use crate::model::ControllerStep;
use crate::sys::rbd_export::{CephClient, RbdError};
use crate::sys::rbd_images::{ImageError, RbdImages, feature_bits};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

pub struct Executor {
    client: kube::Client,
    images: Arc<dyn RbdImages>,
    deadline: Duration,
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

impl Executor {
    pub fn new(client: kube::Client, images: Arc<dyn RbdImages>, deadline: Duration) -> Executor {
        Executor { client, images, deadline }
    }

    /// Run `steps` in order; the size the last sizing step left, if any.
    pub async fn run(
        &self,
        backend: &str,
        steps: &[ControllerStep],
    ) -> Result<Option<u64>, Failure> {
        let mut clients: BTreeMap<String, CephClient> = BTreeMap::new();
        let mut size = None;
        for (index, step) in steps.iter().enumerate() {
            let cluster = cluster_of(step);
            if !clients.contains_key(cluster) {
                let connection =
                    crate::kube::storage::controller_connection(&self.client, cluster, backend)
                        .await
                        .map_err(cluster_failure)?;
                clients.insert(cluster.to_string(), connection.ceph_client());
            }
            let client = clients[cluster].clone();
            let images = self.images.clone();
            let owned = step.clone();
            let started = std::time::Instant::now();
            let work = tokio::task::spawn_blocking(move || run_step(&*images, &client, &owned));
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

fn cluster_of(step: &ControllerStep) -> &str {
    match step {
        ControllerStep::CreateImage(c) => &c.image.cluster,
        ControllerStep::DeleteImage(i) => &i.cluster,
        ControllerStep::ResizeImage(r) => &r.image.cluster,
        ControllerStep::CreateSnapshot(s) | ControllerStep::DeleteSnapshot(s) => &s.image.cluster,
        ControllerStep::CloneImage(c) => &c.parent.image.cluster,
    }
}

/// One step; the image's size where the step knows it.
fn run_step(
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
    }
}
