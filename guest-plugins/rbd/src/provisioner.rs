//! rbd's provisioner: one RBD image per volume, named by the volume's name,
//! on the pool of a StorageCluster, made by the controller's Ceph user of
//! that cluster.
//!
//! Class parameters: `storageCluster` (required: the cluster, whose
//! endpoints and node credentials the volume's nodes use), `pool` (default
//! "rbd"), `dataPool`, `imageFeatures` (comma-separated; default
//! "layering"), `maxCloneDepth` (a clone whose chain of parents is deeper
//! is flattened; default 4, as ceph-csi's soft limit), `attach` (passed to
//! the nodes). A volume's id is `<cluster>.<pool>.<image>`; a snapshot's
//! `<cluster>.<pool>.<image>.<snapshot>`: each part a DNS label, so an id
//! is a Kubernetes object name, as nodes name their records after it.

use volagent_guest_sdk::provision::{
    ContentSource, ControllerStep, ControllerStepKind, CreateRequest, ImageRef, Provision,
    ProvisionError, Provisioner, Target, parameter, size_for,
};
use volagent_guest_sdk::provision::{DNS_LABEL_RULE as NAME_RULE, dns_label as name_ok};
use volagent_guest_sdk::{AccessMode, KeyValue, VolumeMode};

const MIB: u64 = 1 << 20;
/// What a claim that names no size gets.
const DEFAULT_SIZE: u64 = 1 << 30;
/// The largest image made or grown: 1 PiB. librbd takes far larger sizes,
/// but an image without object-map is removed object by object over its
/// whole size, and one of exabytes would never go.
const MAX_SIZE: u64 = 1 << 50;

/// `size`, unless it passes [`MAX_SIZE`].
fn bounded(size: u64) -> Result<u64, ProvisionError> {
    if size > MAX_SIZE {
        return Err(ProvisionError::OutOfRange(format!(
            "{size} bytes is more than the {MAX_SIZE} bytes (1 PiB) an rbd volume may have"
        )));
    }
    Ok(size)
}
const DEFAULT_MAX_CLONE_DEPTH: u32 = 4;

/// A volume's or snapshot's place, as its id names it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Place {
    image: ImageRef,
    snapshot: Option<String>,
}

fn parse(id: &str) -> Result<Place, ProvisionError> {
    let parts: Vec<&str> = id.split('.').collect();
    if !(3..=4).contains(&parts.len()) || !parts.iter().all(|p| name_ok(p)) {
        return Err(ProvisionError::NotFound(format!(
            "{id:?} is not an rbd volume or snapshot id of volagent"
        )));
    }
    Ok(Place {
        image: ImageRef { cluster: parts[0].into(), pool: parts[1].into(), image: parts[2].into() },
        snapshot: parts.get(3).map(|s| s.to_string()),
    })
}

fn id_of(i: &ImageRef) -> String {
    format!("{}.{}.{}", i.cluster, i.pool, i.image)
}

fn features(parameters: &[KeyValue]) -> Vec<String> {
    let list = parameter(parameters, "imageFeatures").unwrap_or("layering");
    list.split(',').map(str::trim).filter(|f| !f.is_empty()).map(String::from).collect()
}

fn max_depth(parameters: &[KeyValue]) -> Result<u32, ProvisionError> {
    match parameter(parameters, "maxCloneDepth") {
        None => Ok(DEFAULT_MAX_CLONE_DEPTH),
        Some(v) => v.parse().ok().filter(|d| *d <= 16).ok_or_else(|| {
            ProvisionError::Invalid(format!("maxCloneDepth {v:?} is not a number from 0 to 16"))
        }),
    }
}

fn check_modes(r: &CreateRequest) -> Result<(), ProvisionError> {
    for mode in &r.access_modes {
        // Many writers of one image only as a raw block device: a
        // filesystem on it would be corrupted by the second.
        if *mode == AccessMode::ReadWriteMany && r.mode == VolumeMode::Filesystem {
            return Err(ProvisionError::Unsupported(
                "ReadWriteMany filesystem volumes: an RBD image has one writer's filesystem; use volumeMode Block".into(),
            ));
        }
    }
    Ok(())
}

impl Provisioner for crate::Rbd {
    const CONTROLLER_STEPS: &'static [ControllerStepKind] = &[
        ControllerStepKind::CreateImage,
        ControllerStepKind::DeleteImage,
        ControllerStepKind::ResizeImage,
        ControllerStepKind::CreateSnapshot,
        ControllerStepKind::DeleteSnapshot,
        ControllerStepKind::CloneImage,
    ];

    fn create(r: CreateRequest) -> Result<Provision, ProvisionError> {
        check_modes(&r)?;
        let p = &r.parameters;
        let cluster = parameter(p, "storageCluster").ok_or_else(|| {
            ProvisionError::Invalid(
                "parameter \"storageCluster\" is required: the StorageCluster the image is made on"
                    .into(),
            )
        })?;
        let pool = parameter(p, "pool").unwrap_or("rbd");
        if !name_ok(&r.name) || !name_ok(cluster) || !name_ok(pool) {
            return Err(ProvisionError::Invalid(format!(
                "name {:?}, storageCluster {cluster:?} and pool {pool:?} must each be {NAME_RULE}",
                r.name
            )));
        }
        let image = ImageRef { cluster: cluster.into(), pool: pool.into(), image: r.name.clone() };
        let id = id_of(&image);
        if id.len() > 128 {
            return Err(ProvisionError::Invalid(format!(
                "the volume id {id} would be longer than 128 bytes"
            )));
        }
        let size = bounded(size_for(r.required_bytes, r.limit_bytes, MIB, DEFAULT_SIZE)?)?;
        let features = features(p);
        let mut steps = Vec::new();
        let clone_from = |parent: &Place,
                          snapshot: String,
                          steps: &mut Vec<ControllerStep>|
         -> Result<(), ProvisionError> {
            if parent.image.cluster != image.cluster || parent.image.pool != image.pool {
                return Err(ProvisionError::Unsupported(format!(
                    "a clone from {} into {}: sources must be on the same cluster and pool",
                    id_of(&parent.image),
                    id
                )));
            }
            steps.push(ControllerStep::CloneImage {
                parent: parent.image.clone(),
                snapshot,
                image: image.image.clone(),
                features: features.clone(),
                max_depth: max_depth(p)?,
            });
            Ok(())
        };
        match &r.source {
            None => steps.push(ControllerStep::CreateImage {
                image: image.clone(),
                size_bytes: size,
                data_pool: parameter(p, "dataPool").map(String::from),
                features: features.clone(),
            }),
            Some(ContentSource::Snapshot(sid)) => {
                let snap = parse(sid)?;
                let Some(name) = snap.snapshot.clone() else {
                    return Err(ProvisionError::NotFound(format!(
                        "{sid:?} is a volume id, not a snapshot's"
                    )));
                };
                clone_from(&snap, name, &mut steps)?;
            }
            Some(ContentSource::Volume(vid)) => {
                let source = parse(vid)?;
                if source.snapshot.is_some() {
                    return Err(ProvisionError::NotFound(format!(
                        "{vid:?} is a snapshot id, not a volume's"
                    )));
                }
                // A snapshot of the source for the clone alone: removed once
                // the clone is made (kept in the trash while it needs it).
                let snapshot = format!("clone-{}", r.name);
                steps.push(ControllerStep::CreateSnapshot {
                    image: source.image.clone(),
                    snapshot: snapshot.clone(),
                });
                clone_from(&source, snapshot.clone(), &mut steps)?;
                steps
                    .push(ControllerStep::DeleteSnapshot { image: source.image.clone(), snapshot });
            }
        }
        if r.source.is_some() && r.required_bytes > 0 {
            // A restore as large as asked; smaller than its source is refused.
            steps.push(ControllerStep::ResizeImage { image: image.clone(), size_bytes: size });
        }
        let mut attributes = vec![
            KeyValue { key: "storageCluster".into(), value: cluster.into() },
            KeyValue { key: "pool".into(), value: pool.into() },
            KeyValue { key: "image".into(), value: r.name.clone() },
        ];
        if let Some(attach) = parameter(p, "attach") {
            attributes.push(KeyValue { key: "attach".into(), value: attach.into() });
        }
        Ok(Provision {
            steps,
            id,
            capacity_bytes: if r.source.is_some() && r.required_bytes == 0 { 0 } else { size },
            attributes,
            topology: Vec::new(),
        })
    }

    fn delete(v: Target) -> Result<Provision, ProvisionError> {
        let place = parse(&v.id)?;
        if place.snapshot.is_some() {
            return Err(ProvisionError::NotFound(format!(
                "{:?} is a snapshot id, not a volume's",
                v.id
            )));
        }
        Ok(Provision {
            steps: vec![ControllerStep::DeleteImage(place.image)],
            ..Default::default()
        })
    }

    fn expand(v: Target) -> Result<Provision, ProvisionError> {
        let place = parse(&v.id)?;
        if place.snapshot.is_some() {
            return Err(ProvisionError::NotFound(format!(
                "{:?} is a snapshot id, not a volume's",
                v.id
            )));
        }
        let size = bounded(size_for(v.required_bytes, v.limit_bytes, MIB, DEFAULT_SIZE)?)?;
        Ok(Provision {
            steps: vec![ControllerStep::ResizeImage { image: place.image, size_bytes: size }],
            capacity_bytes: 0,
            ..Default::default()
        })
    }

    fn snapshot(v: Target) -> Result<Provision, ProvisionError> {
        let place = parse(&v.id)?;
        if place.snapshot.is_some() {
            return Err(ProvisionError::NotFound(format!(
                "{:?} is a snapshot id, not a volume's",
                v.id
            )));
        }
        if !name_ok(&v.name) {
            return Err(ProvisionError::Invalid(format!(
                "snapshot name {:?}: it must be {NAME_RULE}",
                v.name
            )));
        }
        let id = format!("{}.{}", id_of(&place.image), v.name);
        if id.len() > 128 {
            return Err(ProvisionError::Invalid(format!(
                "the snapshot id {id} would be longer than 128 bytes"
            )));
        }
        Ok(Provision {
            steps: vec![ControllerStep::CreateSnapshot { image: place.image, snapshot: v.name }],
            id,
            ..Default::default()
        })
    }

    fn delete_snapshot(s: Target) -> Result<Provision, ProvisionError> {
        let place = parse(&s.id)?;
        let Some(snapshot) = place.snapshot else {
            return Err(ProvisionError::NotFound(format!(
                "{:?} is a volume id, not a snapshot's",
                s.id
            )));
        };
        Ok(Provision {
            steps: vec![ControllerStep::DeleteSnapshot { image: place.image, snapshot }],
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::provision::Target;

    fn kv(k: &str, v: &str) -> KeyValue {
        KeyValue { key: k.into(), value: v.into() }
    }

    fn request() -> CreateRequest {
        CreateRequest {
            name: "pvc-1".into(),
            required_bytes: 10 * MIB + 1,
            parameters: vec![kv("storageCluster", "ceph"), kv("pool", "kube")],
            access_modes: vec![AccessMode::ReadWriteOnce],
            ..Default::default()
        }
    }

    #[test]
    fn a_claim_becomes_an_image_named_after_it_rounded_to_a_mebibyte() {
        let p = crate::Rbd::create(request()).unwrap();
        let image = ImageRef { cluster: "ceph".into(), pool: "kube".into(), image: "pvc-1".into() };
        assert_eq!(
            p.steps,
            vec![ControllerStep::CreateImage {
                image,
                size_bytes: 11 * MIB,
                data_pool: None,
                features: vec!["layering".into()],
            }]
        );
        assert_eq!(p.id, "ceph.kube.pvc-1");
        assert_eq!(p.capacity_bytes, 11 * MIB);
        assert!(p.attributes.contains(&kv("storageCluster", "ceph")));
        assert!(p.attributes.contains(&kv("image", "pvc-1")));
    }

    #[test]
    fn no_image_is_made_or_grown_past_a_pebibyte() {
        let mut r = request();
        r.required_bytes = MAX_SIZE;
        assert!(crate::Rbd::create(r.clone()).is_ok());
        r.required_bytes = MAX_SIZE + 1;
        assert!(
            matches!(crate::Rbd::create(r), Err(ProvisionError::OutOfRange(m)) if m.contains("1 PiB"))
        );
        let grow = |bytes| Target {
            id: "ceph.kube.pvc-1".into(),
            required_bytes: bytes,
            ..Default::default()
        };
        assert!(crate::Rbd::expand(grow(MAX_SIZE)).is_ok());
        assert!(matches!(
            crate::Rbd::expand(grow(2 * MAX_SIZE)),
            Err(ProvisionError::OutOfRange(_))
        ));
    }

    #[test]
    fn bad_requests_are_refused_with_the_reason() {
        let mut r = request();
        r.parameters.retain(|kv| kv.key != "storageCluster");
        assert!(
            matches!(crate::Rbd::create(r), Err(ProvisionError::Invalid(m)) if m.contains("storageCluster"))
        );
        let mut r = request();
        r.access_modes = vec![AccessMode::ReadWriteMany];
        assert!(matches!(crate::Rbd::create(r.clone()), Err(ProvisionError::Unsupported(_))));
        r.mode = VolumeMode::Block;
        assert!(crate::Rbd::create(r).is_ok(), "many writers of a raw block image are allowed");
        let mut r = request();
        r.limit_bytes = 10 * MIB;
        assert!(matches!(crate::Rbd::create(r), Err(ProvisionError::OutOfRange(_))));
        let mut r = request();
        r.parameters.push(kv("maxCloneDepth", "x"));
        r.source = Some(ContentSource::Snapshot("ceph.kube.a.s".into()));
        assert!(
            matches!(crate::Rbd::create(r), Err(ProvisionError::Invalid(m)) if m.contains("maxCloneDepth"))
        );
    }

    #[test]
    fn a_restore_clones_the_snapshot_and_a_volume_clone_snapshots_its_source_first() {
        let mut r = request();
        r.source = Some(ContentSource::Snapshot("ceph.kube.pvc-0.snap-1".into()));
        let p = crate::Rbd::create(r.clone()).unwrap();
        assert!(
            matches!(&p.steps[0], ControllerStep::CloneImage { snapshot, max_depth: 4, .. } if snapshot == "snap-1")
        );
        assert!(
            matches!(&p.steps[1], ControllerStep::ResizeImage { size_bytes, .. } if *size_bytes == 11 * MIB)
        );
        r.required_bytes = 0;
        let p = crate::Rbd::create(r.clone()).unwrap();
        assert_eq!(p.steps.len(), 1, "no size asked: the snapshot's");
        assert_eq!(p.capacity_bytes, 0);
        r.source = Some(ContentSource::Volume("ceph.kube.pvc-0".into()));
        let kinds: Vec<_> =
            crate::Rbd::create(r.clone()).unwrap().steps.iter().map(|s| s.kind()).collect();
        assert_eq!(
            kinds,
            [
                ControllerStepKind::CreateSnapshot,
                ControllerStepKind::CloneImage,
                ControllerStepKind::DeleteSnapshot
            ]
        );
        r.source = Some(ContentSource::Volume("other.kube.pvc-0".into()));
        assert!(matches!(crate::Rbd::create(r.clone()), Err(ProvisionError::Unsupported(_))));
        r.source = Some(ContentSource::Snapshot("ceph.kube.pvc-0".into()));
        assert!(matches!(crate::Rbd::create(r), Err(ProvisionError::NotFound(_))));
    }

    #[test]
    fn ids_round_trip_and_foreign_ones_are_not_found() {
        let t = |id: &str| Target {
            id: id.into(),
            name: "snap-1".into(),
            required_bytes: 2 * MIB,
            ..Default::default()
        };
        assert_eq!(crate::Rbd::delete(t("ceph.kube.pvc-1")).unwrap().steps.len(), 1);
        for bad in ["", "pvc-1", "a.b", "a.b.c.d.e", "a..c", "a.b.c.", "A.b.c", "a/b/c"] {
            assert!(
                matches!(crate::Rbd::delete(t(bad)), Err(ProvisionError::NotFound(_))),
                "{bad:?}"
            );
        }
        let s = crate::Rbd::snapshot(t("ceph.kube.pvc-1")).unwrap();
        assert_eq!(s.id, "ceph.kube.pvc-1.snap-1");
        let d = crate::Rbd::delete_snapshot(t(&s.id)).unwrap();
        assert!(
            matches!(&d.steps[0], ControllerStep::DeleteSnapshot { snapshot, .. } if snapshot == "snap-1")
        );
        assert!(matches!(
            crate::Rbd::delete_snapshot(t("ceph.kube.pvc-1")),
            Err(ProvisionError::NotFound(_))
        ));
        let e = crate::Rbd::expand(t("ceph.kube.pvc-1")).unwrap();
        assert!(
            matches!(&e.steps[0], ControllerStep::ResizeImage { size_bytes, .. } if *size_bytes == 2 * MIB)
        );
    }
}
