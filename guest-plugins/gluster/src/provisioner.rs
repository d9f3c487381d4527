//! gluster's provisioner: one directory per volume, `<baseDir>/<name>`
//! beneath the root of a gluster volume of a StorageCluster, made and
//! removed by the controller as a client of the cluster's servers, its
//! size held by the gluster volume's directory quota. Nodes mount the
//! directory itself (`server:/volume/<baseDir>/<name>`).
//!
//! Class parameters: `storageCluster` (required: the cluster whose
//! endpoints are the gluster servers), `volume` (required: the gluster
//! volume), `baseDir` (default "volagent": the directory at the volume's
//! root the volumes' directories are made in), `quota` ("true", the
//! default: each directory is limited to its volume's capacity, which
//! needs the gluster volume's quota enabled by its admin; "false": no
//! limit, the capacity is then not enforced).
//!
//! A volume's id is `<cluster>.<volume>.<name>`, or
//! `<cluster>.<volume>.<baseDir>.<name>` with another base dir: each part
//! a DNS label, so an id is a Kubernetes object name, as nodes name their
//! records after it; and the id carries all that removing or growing the
//! volume needs, as those calls get nothing else.

use volagent_guest_sdk::provision::{
    ControllerStep, ControllerStepKind, CreateRequest, DirectoryRef, Provision, ProvisionError,
    Provisioner, Target, parameter, size_for,
};
use volagent_guest_sdk::provision::{DNS_LABEL_RULE as NAME_RULE, dns_label as name_ok};
use volagent_guest_sdk::{KeyValue, VolumeMode};

const MIB: u64 = 1 << 20;
/// What a claim that names no size gets.
const DEFAULT_SIZE: u64 = 1 << 30;
const DEFAULT_BASE_DIR: &str = "volagent";

/// The directory an id names.
fn parse(id: &str) -> Result<DirectoryRef, ProvisionError> {
    let parts: Vec<&str> = id.split('.').collect();
    let (cluster, volume, base, name) = match parts[..] {
        [c, v, n] => (c, v, DEFAULT_BASE_DIR, n),
        [c, v, b, n] => (c, v, b, n),
        _ => ("", "", "", ""),
    };
    if ![cluster, volume, base, name].iter().all(|p| name_ok(p)) {
        return Err(ProvisionError::NotFound(format!(
            "{id:?} is not a gluster volume id of volagent"
        )));
    }
    Ok(DirectoryRef {
        cluster: cluster.into(),
        volume: volume.into(),
        path: format!("{base}/{name}"),
    })
}

/// The id of `name`'s directory in `base`.
fn id_of(cluster: &str, volume: &str, base: &str, name: &str) -> String {
    if base == DEFAULT_BASE_DIR {
        format!("{cluster}.{volume}.{name}")
    } else {
        format!("{cluster}.{volume}.{base}.{name}")
    }
}

fn quota(parameters: &[KeyValue]) -> Result<bool, ProvisionError> {
    match parameter(parameters, "quota") {
        None | Some("true") => Ok(true),
        Some("false") => Ok(false),
        Some(other) => Err(ProvisionError::Invalid(format!(
            "quota {other:?} is neither \"true\" nor \"false\""
        ))),
    }
}

fn no_snapshots(what: &str) -> ProvisionError {
    ProvisionError::Unsupported(format!(
        "{what}: a gluster volume's directory has no snapshots of its own (GlusterFS snapshots whole volumes, on thinly provisioned LVM bricks)"
    ))
}

impl Provisioner for crate::Gluster {
    const CONTROLLER_STEPS: &'static [ControllerStepKind] = &[
        ControllerStepKind::CreateDirectory,
        ControllerStepKind::RemoveDirectory,
        ControllerStepKind::SetQuota,
    ];

    fn create(r: CreateRequest) -> Result<Provision, ProvisionError> {
        // Every access mode: a directory of a gluster volume takes many
        // writers on many nodes. A filesystem only.
        if r.mode == VolumeMode::Block {
            return Err(ProvisionError::Unsupported(
                "block volumes: a gluster volume's directory is a filesystem, mounted; use volumeMode Filesystem".into(),
            ));
        }
        if r.source.is_some() {
            return Err(ProvisionError::Unsupported(
                "a gluster volume made from a snapshot or another volume: gluster volumes are made empty".into(),
            ));
        }
        let p = &r.parameters;
        let cluster = parameter(p, "storageCluster").ok_or_else(|| {
            ProvisionError::Invalid(
                "parameter \"storageCluster\" is required: the StorageCluster whose servers serve the gluster volume".into(),
            )
        })?;
        let volume = parameter(p, "volume").ok_or_else(|| {
            ProvisionError::Invalid(
                "parameter \"volume\" is required: the gluster volume the directories are made in"
                    .into(),
            )
        })?;
        let base = parameter(p, "baseDir").unwrap_or(DEFAULT_BASE_DIR);
        for (what, value) in [
            ("name", r.name.as_str()),
            ("storageCluster", cluster),
            ("volume", volume),
            ("baseDir", base),
        ] {
            if !name_ok(value) {
                return Err(ProvisionError::Invalid(format!(
                    "{what} {value:?}: it must be {NAME_RULE}"
                )));
            }
        }
        let id = id_of(cluster, volume, base, &r.name);
        if id.len() > 128 {
            return Err(ProvisionError::Invalid(format!(
                "the volume id {id} would be longer than 128 bytes"
            )));
        }
        let size = size_for(r.required_bytes, r.limit_bytes, MIB, DEFAULT_SIZE)?;
        let dir = DirectoryRef {
            cluster: cluster.into(),
            volume: volume.into(),
            path: format!("{base}/{}", r.name),
        };
        let quota_bytes = if quota(p)? { size } else { 0 };
        let attributes = vec![
            KeyValue { key: "storageCluster".into(), value: cluster.into() },
            KeyValue { key: "volume".into(), value: volume.into() },
            KeyValue { key: "subdir".into(), value: dir.path.clone() },
        ];
        Ok(Provision {
            steps: vec![ControllerStep::CreateDirectory { dir, quota_bytes }],
            id,
            capacity_bytes: size,
            attributes,
            topology: Vec::new(),
        })
    }

    fn delete(v: Target) -> Result<Provision, ProvisionError> {
        Ok(Provision {
            steps: vec![ControllerStep::RemoveDirectory(parse(&v.id)?)],
            ..Default::default()
        })
    }

    /// A limit raised to the size asked for; a directory without one is
    /// already as large as any.
    fn expand(v: Target) -> Result<Provision, ProvisionError> {
        let dir = parse(&v.id)?;
        let size = size_for(v.required_bytes, v.limit_bytes, MIB, DEFAULT_SIZE)?;
        Ok(Provision {
            steps: vec![ControllerStep::SetQuota { dir, bytes: size }],
            capacity_bytes: size,
            ..Default::default()
        })
    }

    fn snapshot(v: Target) -> Result<Provision, ProvisionError> {
        Err(no_snapshots(&format!("snapshot {} of volume {}", v.name, v.id)))
    }

    fn delete_snapshot(s: Target) -> Result<Provision, ProvisionError> {
        Err(no_snapshots(&format!("snapshot {}", s.id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::AccessMode;
    use volagent_guest_sdk::provision::ContentSource;

    fn kv(k: &str, v: &str) -> KeyValue {
        KeyValue { key: k.into(), value: v.into() }
    }

    fn request() -> CreateRequest {
        CreateRequest {
            name: "pvc-1".into(),
            required_bytes: 10 * MIB + 1,
            parameters: vec![kv("storageCluster", "gluster-a"), kv("volume", "gv0")],
            access_modes: vec![AccessMode::ReadWriteMany],
            ..Default::default()
        }
    }

    fn dir(path: &str) -> DirectoryRef {
        DirectoryRef { cluster: "gluster-a".into(), volume: "gv0".into(), path: path.into() }
    }

    #[test]
    fn a_claim_becomes_a_directory_limited_to_its_size_and_nodes_mount_it() {
        let p = crate::Gluster::create(request()).unwrap();
        assert_eq!(
            p.steps,
            vec![ControllerStep::CreateDirectory {
                dir: dir("volagent/pvc-1"),
                quota_bytes: 11 * MIB
            }]
        );
        assert_eq!(p.id, "gluster-a.gv0.pvc-1");
        assert_eq!(p.capacity_bytes, 11 * MIB);
        assert_eq!(
            p.attributes,
            vec![
                kv("storageCluster", "gluster-a"),
                kv("volume", "gv0"),
                kv("subdir", "volagent/pvc-1")
            ]
        );
        // Every access mode: many writers on many nodes.
        for mode in
            [AccessMode::ReadWriteOnce, AccessMode::ReadOnlyMany, AccessMode::ReadWriteOncePod]
        {
            let mut r = request();
            r.access_modes = vec![mode];
            assert!(crate::Gluster::create(r).is_ok(), "{mode:?}");
        }
        // Another base dir is in the id; no quota is a limit of 0; no size is 1 GiB.
        let mut r = request();
        r.required_bytes = 0;
        r.parameters.extend([kv("baseDir", "k8s"), kv("quota", "false")]);
        let p = crate::Gluster::create(r).unwrap();
        assert_eq!(p.id, "gluster-a.gv0.k8s.pvc-1");
        assert_eq!(
            p.steps,
            vec![ControllerStep::CreateDirectory { dir: dir("k8s/pvc-1"), quota_bytes: 0 }]
        );
        assert_eq!(p.capacity_bytes, 1 << 30);
    }

    #[test]
    fn bad_requests_are_refused_with_the_reason() {
        let refused = |change: &dyn Fn(&mut CreateRequest)| {
            let mut r = request();
            change(&mut r);
            crate::Gluster::create(r).unwrap_err()
        };
        let e = refused(&|r| r.parameters.retain(|kv| kv.key != "storageCluster"));
        assert!(matches!(&e, ProvisionError::Invalid(m) if m.contains("storageCluster")), "{e:?}");
        let e = refused(&|r| r.parameters.retain(|kv| kv.key != "volume"));
        assert!(matches!(&e, ProvisionError::Invalid(m) if m.contains("\"volume\"")), "{e:?}");
        for (key, bad) in
            [("baseDir", "../x"), ("baseDir", "a/b"), ("volume", "GV_0"), ("quota", "yes")]
        {
            let e = refused(&|r| r.parameters.push(kv(key, bad)));
            assert!(
                matches!(&e, ProvisionError::Invalid(m) if m.contains(bad)),
                "{key}={bad}: {e:?}"
            );
        }
        let e = refused(&|r| r.name = "PVC 1".into());
        assert!(matches!(&e, ProvisionError::Invalid(m) if m.contains("name")), "{e:?}");
        let e = refused(&|r| r.mode = VolumeMode::Block);
        assert!(matches!(&e, ProvisionError::Unsupported(m) if m.contains("block")), "{e:?}");
        let e = refused(&|r| r.source = Some(ContentSource::Volume("gluster-a.gv0.pvc-0".into())));
        assert!(matches!(e, ProvisionError::Unsupported(_)), "{e:?}");
        let e = refused(&|r| r.limit_bytes = 10 * MIB);
        assert!(matches!(e, ProvisionError::OutOfRange(_)), "{e:?}");
    }

    #[test]
    fn ids_round_trip_foreign_ones_are_not_found_and_snapshots_are_unsupported() {
        let t = |id: &str| Target {
            id: id.into(),
            name: "snap-1".into(),
            required_bytes: 2 * MIB,
            ..Default::default()
        };
        assert_eq!(
            crate::Gluster::delete(t("gluster-a.gv0.pvc-1")).unwrap().steps,
            vec![ControllerStep::RemoveDirectory(dir("volagent/pvc-1"))]
        );
        assert_eq!(
            crate::Gluster::delete(t("gluster-a.gv0.k8s.pvc-1")).unwrap().steps,
            vec![ControllerStep::RemoveDirectory(dir("k8s/pvc-1"))]
        );
        for bad in ["", "pvc-1", "a.b", "a.b.c.d.e", "a..c", "a.b.c.", "A.b.c", "a/b/c", "a.b.../c"]
        {
            assert!(
                matches!(crate::Gluster::delete(t(bad)), Err(ProvisionError::NotFound(_))),
                "{bad:?}"
            );
            assert!(matches!(crate::Gluster::expand(t(bad)), Err(ProvisionError::NotFound(_))));
        }
        let e = crate::Gluster::expand(t("gluster-a.gv0.pvc-1")).unwrap();
        assert_eq!(
            e.steps,
            vec![ControllerStep::SetQuota { dir: dir("volagent/pvc-1"), bytes: 2 * MIB }]
        );
        assert_eq!(e.capacity_bytes, 2 * MIB);
        let s = crate::Gluster::snapshot(t("gluster-a.gv0.pvc-1")).unwrap_err();
        assert!(
            matches!(&s, ProvisionError::Unsupported(m) if m.contains("no snapshots")),
            "{s:?}"
        );
        assert!(matches!(
            crate::Gluster::delete_snapshot(t("gluster-a.gv0.pvc-1.snap-1")),
            Err(ProvisionError::Unsupported(_))
        ));
    }
}
