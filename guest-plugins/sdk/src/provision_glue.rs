//! Between the contract's provisioning interfaces and [`crate::provision`]:
//! requests read from the host's resources, plans built through its
//! `provision` resource and the backend interfaces' steps.

#[cfg(feature = "ceph")]
use crate::bindings::volagent::policy::ceph_provisioning as cp;
#[cfg(feature = "gluster")]
use crate::bindings::volagent::policy::gluster_provisioning as gp;
#[cfg(feature = "local-provisioning")]
use crate::bindings::volagent::policy::local_provisioning as lp;
use crate::bindings::volagent::policy::provisioning as pv;
use crate::bindings::volagent::policy::types as t;
use crate::provision::*;
use crate::{AccessMode, KeyValue, Policy, VolumeMode};

fn pairs(kvs: Vec<(String, String)>) -> Vec<KeyValue> {
    kvs.into_iter().map(|(key, value)| KeyValue { key, value }).collect()
}

fn create_request(r: &pv::CreateRequest) -> CreateRequest {
    CreateRequest {
        name: r.name(),
        required_bytes: r.required_bytes(),
        limit_bytes: r.limit_bytes(),
        parameters: pairs(r.parameters()),
        access_modes: r
            .access_modes()
            .into_iter()
            .map(|m| match m {
                t::AccessMode::ReadWriteOnce => AccessMode::ReadWriteOnce,
                t::AccessMode::ReadOnlyMany => AccessMode::ReadOnlyMany,
                t::AccessMode::ReadWriteMany => AccessMode::ReadWriteMany,
                t::AccessMode::ReadWriteOncePod => AccessMode::ReadWriteOncePod,
            })
            .collect(),
        mode: match r.mode() {
            t::VolumeMode::Filesystem => VolumeMode::Filesystem,
            t::VolumeMode::Block => VolumeMode::Block,
        },
        fs_type: r.fs_type(),
        requisite: r.requisite(),
        preferred: r.preferred(),
        source: r.source().map(|s| match s {
            pv::ContentSource::Snapshot(id) => ContentSource::Snapshot(id),
            pv::ContentSource::Volume(id) => ContentSource::Volume(id),
        }),
        local_volumes: local::free(r),
    }
}

/// The free local volumes a request may take, asked of the host only by a
/// policy built with `local-provisioning` (others do not import it).
mod local {
    use super::*;

    #[cfg(feature = "local-provisioning")]
    fn plain(volumes: Vec<lp::LocalVolume>) -> Vec<LocalVolume> {
        volumes
            .into_iter()
            .map(|v| LocalVolume {
                name: v.name,
                node: v.node,
                kind: match v.kind {
                    lp::LocalKind::Filesystem => LocalKind::Filesystem,
                    lp::LocalKind::Block => LocalKind::Block,
                    lp::LocalKind::File => LocalKind::File,
                },
                capacity_bytes: v.capacity_bytes,
            })
            .collect()
    }

    #[cfg(feature = "local-provisioning")]
    pub fn free(r: &pv::CreateRequest) -> Vec<LocalVolume> {
        plain(lp::free_volumes(r))
    }

    #[cfg(feature = "local-provisioning")]
    pub fn free_in(r: &pv::CapacityRequest) -> Vec<LocalVolume> {
        plain(lp::free_volumes_in(r))
    }

    #[cfg(not(feature = "local-provisioning"))]
    pub fn free(_: &pv::CreateRequest) -> Vec<LocalVolume> {
        Vec::new()
    }

    #[cfg(not(feature = "local-provisioning"))]
    pub fn free_in(_: &pv::CapacityRequest) -> Vec<LocalVolume> {
        Vec::new()
    }
}

fn target(t: &pv::Target) -> Target {
    Target {
        id: t.id(),
        name: t.name(),
        required_bytes: t.required_bytes(),
        limit_bytes: t.limit_bytes(),
        parameters: pairs(t.parameters()),
    }
}

fn error(e: ProvisionError) -> pv::ProvisionError {
    match e {
        ProvisionError::Invalid(m) => pv::ProvisionError::Invalid(m),
        ProvisionError::Unsupported(m) => pv::ProvisionError::Unsupported(m),
        ProvisionError::NotFound(m) => pv::ProvisionError::NotFound(m),
        ProvisionError::Exhausted(m) => pv::ProvisionError::Exhausted(m),
        ProvisionError::OutOfRange(m) => pv::ProvisionError::OutOfRange(m),
    }
}

/// `p`, built into the host's provision resource.
fn provision(p: Provision) -> pv::Provision {
    let plan = pv::Provision::new();
    for step in &p.steps {
        steps::add(&plan, step);
    }
    plan.set_id(&p.id);
    plan.set_capacity(p.capacity_bytes);
    for kv in &p.attributes {
        plan.set_attribute(&kv.key, &kv.value);
    }
    for segment in &p.topology {
        plan.add_topology(segment);
    }
    plan
}

fn answer(r: Result<Provision, ProvisionError>) -> Result<pv::Provision, pv::ProvisionError> {
    r.map(provision).map_err(error)
}

mod steps {
    use super::*;

    /// Each step through its backend interface. A policy imports only the
    /// interfaces of the SDK features it is built with, so a step of
    /// another is a build mistake, named.
    pub fn add(p: &pv::Provision, step: &ControllerStep) {
        match step {
            ControllerStep::CreateImage { .. }
            | ControllerStep::DeleteImage(_)
            | ControllerStep::ResizeImage { .. }
            | ControllerStep::CreateSnapshot { .. }
            | ControllerStep::DeleteSnapshot { .. }
            | ControllerStep::CloneImage { .. } => ceph(p, step),
            ControllerStep::CreateDirectory { .. }
            | ControllerStep::RemoveDirectory(_)
            | ControllerStep::SetQuota { .. } => gluster(p, step),
            ControllerStep::TakeVolume(_) | ControllerStep::ReleaseVolume(_) => local(p, step),
        }
    }

    #[cfg(feature = "local-provisioning")]
    fn local(p: &pv::Provision, step: &ControllerStep) {
        match step {
            ControllerStep::TakeVolume(v) => lp::take_volume(p, v),
            ControllerStep::ReleaseVolume(v) => lp::release_volume(p, v),
            other => unreachable!("{:?} is not a local volume's step", other.kind()),
        }
    }

    #[cfg(not(feature = "local-provisioning"))]
    fn local(_: &pv::Provision, step: &ControllerStep) {
        missing(step, "local-provisioning")
    }

    #[cfg(feature = "ceph")]
    fn ceph(p: &pv::Provision, step: &ControllerStep) {
        match step {
            ControllerStep::CreateImage { image: i, size_bytes, data_pool, features } => {
                cp::create_image(
                    p,
                    &i.cluster,
                    &i.pool,
                    &i.image,
                    *size_bytes,
                    data_pool.as_deref(),
                    features,
                )
            }
            ControllerStep::DeleteImage(i) => cp::delete_image(p, &i.cluster, &i.pool, &i.image),
            ControllerStep::ResizeImage { image: i, size_bytes } => {
                cp::resize_image(p, &i.cluster, &i.pool, &i.image, *size_bytes)
            }
            ControllerStep::CreateSnapshot { image: i, snapshot } => {
                cp::create_snapshot(p, &i.cluster, &i.pool, &i.image, snapshot)
            }
            ControllerStep::DeleteSnapshot { image: i, snapshot } => {
                cp::delete_snapshot(p, &i.cluster, &i.pool, &i.image, snapshot)
            }
            ControllerStep::CloneImage { parent, snapshot, image, features, max_depth } => {
                cp::clone_image(
                    p,
                    &parent.cluster,
                    &parent.pool,
                    &parent.image,
                    snapshot,
                    image,
                    features,
                    *max_depth,
                )
            }
            other => unreachable!("{:?} is not a ceph step", other.kind()),
        }
    }

    #[cfg(feature = "gluster")]
    fn gluster(p: &pv::Provision, step: &ControllerStep) {
        match step {
            ControllerStep::CreateDirectory { dir: d, quota_bytes } => {
                gp::create_directory(p, &d.cluster, &d.volume, &d.path, *quota_bytes)
            }
            ControllerStep::RemoveDirectory(d) => {
                gp::remove_directory(p, &d.cluster, &d.volume, &d.path)
            }
            ControllerStep::SetQuota { dir: d, bytes } => {
                gp::set_quota(p, &d.cluster, &d.volume, &d.path, *bytes)
            }
            other => unreachable!("{:?} is not a gluster step", other.kind()),
        }
    }

    #[cfg(not(feature = "ceph"))]
    fn ceph(_: &pv::Provision, step: &ControllerStep) {
        missing(step, "ceph")
    }

    #[cfg(not(feature = "gluster"))]
    fn gluster(_: &pv::Provision, step: &ControllerStep) {
        missing(step, "gluster")
    }

    #[cfg(not(all(feature = "ceph", feature = "gluster", feature = "local-provisioning")))]
    fn missing(step: &ControllerStep, feature: &str) {
        panic!(
            "{:?}: the policy was built without the volagent-guest-sdk feature `{feature}`",
            step.kind()
        )
    }
}

/// What `export_policy!(Type, provisioner)` calls.
pub mod export {
    use super::*;

    /// `info`, with the provisioner's controller steps among the steps.
    pub fn info<P: Policy + Provisioner>() -> t::BackendInfo {
        let mut info = crate::__export::info::<P>();
        info.steps.extend(P::CONTROLLER_STEPS.iter().map(|k| k.name().to_string()));
        info
    }

    pub fn create<P: Provisioner>(
        r: &pv::CreateRequest,
    ) -> Result<pv::Provision, pv::ProvisionError> {
        answer(P::create(create_request(r)))
    }
    pub fn delete<P: Provisioner>(v: &pv::Target) -> Result<pv::Provision, pv::ProvisionError> {
        answer(P::delete(target(v)))
    }
    pub fn expand<P: Provisioner>(v: &pv::Target) -> Result<pv::Provision, pv::ProvisionError> {
        answer(P::expand(target(v)))
    }
    pub fn snapshot<P: Provisioner>(v: &pv::Target) -> Result<pv::Provision, pv::ProvisionError> {
        answer(P::snapshot(target(v)))
    }
    pub fn delete_snapshot<P: Provisioner>(
        s: &pv::Target,
    ) -> Result<pv::Provision, pv::ProvisionError> {
        answer(P::delete_snapshot(target(s)))
    }
    pub fn capacity<P: Provisioner>(
        r: &pv::CapacityRequest,
    ) -> Result<Option<u64>, pv::ProvisionError> {
        P::capacity(CapacityRequest {
            parameters: pairs(r.parameters()),
            segment: r.segment(),
            local_volumes: local::free_in(r),
        })
        .map_err(error)
    }
}
