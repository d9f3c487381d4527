//! CSI requests checked into the pipeline's terms: every field the spec
//! requires present, ids usable as record names, paths resolved beneath
//! kubelet's root. Anything else is refused here with INVALID_ARGUMENT,
//! before a lock, record or mount is touched.

use super::proto::csi::{VolumeCapability, volume_capability};
use crate::model::{AccessMode, VolumeMode};
use crate::ops::csi::{Access, CsiError, PublishRequest, Shape, StageRequest};
use crate::policy::validate::clean_absolute;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Keys kubelet adds to a volume's context (pod info, the ephemeral flag,
/// service account tokens) and the provisioner's identity: not the PV's
/// attributes, so not the backend's options.
const KUBELET_KEYS: &[&str] = &["csi.storage.k8s.io/", "storage.kubernetes.io/"];

/// Longest volume id: a Kubernetes object name (the ledger's records are named after volumes).
const MAX_ID: usize = 253;
/// Most attributes or secrets a request may carry.
const MAX_ENTRIES: usize = 128;

fn invalid(m: impl Into<String>) -> CsiError {
    CsiError::Invalid(m.into())
}

/// A volume id names the volume's record, staging dir and state dir: a
/// DNS subdomain (what a PV's name is), so it is one path component.
pub fn volume_id(id: &str) -> Result<String, CsiError> {
    if id.is_empty() {
        return Err(invalid("volume_id is missing"));
    }
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if id.len() > MAX_ID
        || !id.chars().all(ok_char)
        || !alnum(id.chars().next())
        || !alnum(id.chars().last())
    {
        return Err(invalid(format!(
            "volume_id {:?} is not a Kubernetes object name (lowercase letters, digits, '-' and '.', at most {MAX_ID}, starting and ending alphanumeric)",
            crate::text::bounded(id.to_string(), 300)
        )));
    }
    Ok(id.to_string())
}

/// `path` (the field `field`) checked and named under the resolved root.
pub fn kubelet_path(roots: &[&Path; 2], field: &str, path: &str) -> Result<PathBuf, CsiError> {
    if path.is_empty() {
        return Err(invalid(format!("{field} is missing")));
    }
    if path.len() > crate::ops::request::MAX_PATH {
        return Err(invalid(format!(
            "{field} of {} bytes is longer than {}",
            path.len(),
            crate::ops::request::MAX_PATH
        )));
    }
    clean_absolute(path).map_err(|e| invalid(format!("{field}: {e}")))?;
    let rest = roots
        .iter()
        .find_map(|root| Path::new(path).strip_prefix(root).ok())
        .filter(|rest| !rest.as_os_str().is_empty())
        .ok_or_else(|| {
            invalid(format!("{field} {path} is not under kubelet's root {}", roots[0].display()))
        })?;
    // The agent's own staging dirs are not kubelet's to name.
    if rest.starts_with("plugins/volagent") {
        return Err(invalid(format!("{field} {path} is inside volagent's own dirs")));
    }
    Ok(roots[0].join(rest))
}

/// The access and shape a capability asks for. A volume mount group is not
/// served: the driver does not offer VOLUME_MOUNT_GROUP, so kubelet applies
/// the pod's fsGroup itself.
pub fn access(capability: Option<&VolumeCapability>) -> Result<Shape, CsiError> {
    use volume_capability::access_mode::Mode;
    let cap = capability.ok_or_else(|| invalid("volume_capability is missing"))?;
    let (fs_type, volume_mode, mount_flags) = match &cap.access_type {
        None => return Err(invalid("volume_capability has no access type (mount or block)")),
        Some(volume_capability::AccessType::Block(_)) => {
            (String::new(), VolumeMode::Block, Vec::new())
        }
        Some(volume_capability::AccessType::Mount(m)) => {
            if m.mount_flags.len() > crate::policy::validate::MAX_LIST {
                return Err(invalid(format!(
                    "{} mount flags, more than {}",
                    m.mount_flags.len(),
                    crate::policy::validate::MAX_LIST
                )));
            }
            if let Some(f) = m.mount_flags.iter().find(|f| {
                f.is_empty()
                    || f.len() > crate::policy::validate::MAX_TEXT
                    || f.contains(['\0', ','])
            }) {
                return Err(invalid(format!(
                    "mount flag {:?} is empty, too long or holds a ',' (one flag per entry)",
                    crate::text::bounded(f.clone(), 64)
                )));
            }
            if !m.volume_mount_group.is_empty() {
                return Err(invalid(
                    "volume_mount_group is not served (the driver does not offer VOLUME_MOUNT_GROUP)",
                ));
            }
            (m.fs_type.clone(), VolumeMode::Filesystem, m.mount_flags.clone())
        }
    };
    let mode = cap.access_mode.as_ref().map(|m| m.mode()).unwrap_or(Mode::Unknown);
    let (mode, read_only, single_pod) = match mode {
        Mode::SingleNodeWriter | Mode::SingleNodeMultiWriter => {
            (AccessMode::ReadWriteOnce, false, false)
        }
        Mode::SingleNodeReaderOnly => (AccessMode::ReadWriteOnce, true, false),
        Mode::SingleNodeSingleWriter => (AccessMode::ReadWriteOncePod, false, true),
        Mode::MultiNodeReaderOnly => (AccessMode::ReadOnlyMany, true, false),
        Mode::MultiNodeMultiWriter => (AccessMode::ReadWriteMany, false, false),
        Mode::MultiNodeSingleWriter => {
            return Err(invalid(
                "access mode MULTI_NODE_SINGLE_WRITER is not served (Kubernetes has no such mode)",
            ));
        }
        Mode::Unknown => return Err(invalid("volume_capability has no access mode")),
    };
    Ok(Shape {
        access: Access { mode, read_only, single_pod },
        fs_type,
        mode: volume_mode,
        mount_flags,
    })
}

fn bounded_map(
    field: &str,
    map: &std::collections::HashMap<String, String>,
) -> Result<(), CsiError> {
    if map.len() > MAX_ENTRIES {
        return Err(invalid(format!("{field} has {} entries, more than {MAX_ENTRIES}", map.len())));
    }
    Ok(())
}

/// The PV's attributes: kubelet's own keys dropped, inline ephemeral
/// volumes refused (their attributes are the pod author's to write).
fn attributes(
    context: &std::collections::HashMap<String, String>,
) -> Result<BTreeMap<String, String>, CsiError> {
    bounded_map("volume_context", context)?;
    if context.get("csi.storage.k8s.io/ephemeral").is_some_and(|v| v == "true") {
        return Err(CsiError::Precondition("inline ephemeral CSI volumes are not served: their attributes are written by the pod's author".into()));
    }
    Ok(context
        .iter()
        .filter(|(k, _)| !KUBELET_KEYS.iter().any(|p| k.starts_with(p)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect())
}

pub fn stage(
    roots: &[&Path; 2],
    r: super::proto::csi::NodeStageVolumeRequest,
) -> Result<StageRequest, CsiError> {
    let volume_id = volume_id(&r.volume_id)?;
    let staging = kubelet_path(roots, "staging_target_path", &r.staging_target_path)?;
    let shape = access(r.volume_capability.as_ref())?;
    bounded_map("secrets", &r.secrets)?;
    let secrets = r
        .secrets
        .into_iter()
        .map(|(k, v)| (k, crate::secret::Secret::new(v.into_bytes())))
        .collect();
    Ok(StageRequest {
        volume_id,
        staging,
        shape,
        attributes: attributes(&r.volume_context)?,
        secrets,
    })
}

pub fn publish(
    roots: &[&Path; 2],
    r: &super::proto::csi::NodePublishVolumeRequest,
) -> Result<PublishRequest, CsiError> {
    let volume_id = volume_id(&r.volume_id)?;
    let target = kubelet_path(roots, "target_path", &r.target_path)?;
    let staging = kubelet_path(roots, "staging_target_path", &r.staging_target_path)?;
    let shape = access(r.volume_capability.as_ref())?;
    attributes(&r.volume_context)?;
    let get = |k: &str| r.volume_context.get(k).map(String::as_str).unwrap_or("");
    let pod = match (get("csi.storage.k8s.io/pod.namespace"), get("csi.storage.k8s.io/pod.name")) {
        ("", _) | (_, "") => String::new(),
        (ns, name) => format!("{ns}/{name}"),
    };
    if target == staging {
        return Err(invalid("target_path is the staging_target_path"));
    }
    Ok(PublishRequest {
        volume_id,
        staging,
        target,
        read_only: r.readonly || shape.access.read_only,
        access: shape.access,
        mode: shape.mode,
        pod,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::proto::csi::{NodePublishVolumeRequest, NodeStageVolumeRequest};
    use volume_capability::{AccessMode as Am, AccessType, MountVolume, access_mode::Mode};

    const R: [&str; 2] = ["/var/lib/kubelet", "/k"];

    fn roots() -> [&'static Path; 2] {
        [Path::new(R[0]), Path::new(R[1])]
    }

    fn mount(mode: Mode) -> Option<VolumeCapability> {
        Some(VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: "ext4".into(),
                ..Default::default()
            })),
            access_mode: Some(Am { mode: mode as i32 }),
        })
    }

    fn staged(id: &str, path: &str) -> NodeStageVolumeRequest {
        NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: path.into(),
            volume_capability: mount(Mode::SingleNodeWriter),
            ..Default::default()
        }
    }

    fn code(r: Result<StageRequest, CsiError>) -> String {
        match r {
            Err(CsiError::Invalid(m)) => m,
            other => panic!("not INVALID_ARGUMENT: {other:?}"),
        }
    }

    #[test]
    fn ids_are_object_names() {
        assert_eq!(volume_id("pv-1.a").unwrap(), "pv-1.a");
        for bad in ["", "PV", "a/b", "..", "-a", "a-", "a_b", &"a".repeat(254), "a\u{e9}"] {
            assert!(matches!(volume_id(bad), Err(CsiError::Invalid(_))), "{bad:?}");
        }
    }

    #[test]
    fn paths_are_kubelets_and_named_under_the_resolved_root() {
        let ok =
            kubelet_path(&roots(), "p", "/k/plugins/kubernetes.io/csi/pv/pv1/globalmount").unwrap();
        assert_eq!(ok, Path::new("/var/lib/kubelet/plugins/kubernetes.io/csi/pv/pv1/globalmount"));
        for bad in [
            "",
            "relative/x",
            "/etc/passwd",
            "/var/lib/kubelet",
            "/var/lib/kubelet/pods/../../../../etc",
            "/var/lib/kubelet/plugins/volagent/local-pv/mounts/pv1",
            "/var/lib/kubeletX/a",
        ] {
            assert!(
                matches!(kubelet_path(&roots(), "p", bad), Err(CsiError::Invalid(_))),
                "{bad:?}"
            );
        }
        let long = format!("/var/lib/kubelet/{}", "a/".repeat(3000));
        assert!(kubelet_path(&roots(), "p", &long).is_err());
    }

    #[test]
    fn stage_requests_need_every_field() {
        let path = "/var/lib/kubelet/plugins/kubernetes.io/csi/pv/pv1/globalmount";
        assert!(code(stage(&roots(), staged("", path))).contains("volume_id is missing"));
        assert!(
            code(stage(&roots(), staged("pv1", ""))).contains("staging_target_path is missing")
        );
        let mut r = staged("pv1", path);
        r.volume_capability = None;
        assert!(code(stage(&roots(), r)).contains("volume_capability is missing"));
        let mut r = staged("pv1", path);
        r.volume_capability = mount(Mode::Unknown);
        assert!(code(stage(&roots(), r)).contains("no access mode"));
        let mut r = staged("pv1", path);
        r.volume_capability.as_mut().unwrap().access_type =
            Some(AccessType::Block(Default::default()));
        assert_eq!(
            stage(&roots(), r).unwrap().shape.mode,
            VolumeMode::Block,
            "block volumes are served"
        );
        let mut r = staged("pv1", path);
        if let Some(AccessType::Mount(m)) = &mut r.volume_capability.as_mut().unwrap().access_type {
            m.mount_flags = vec!["noatime".into(), "ro,remount".into()];
        }
        assert!(code(stage(&roots(), r)).contains("holds a ','"), "one flag per entry");
        let mut r = staged("pv1", path);
        r.volume_context.insert("csi.storage.k8s.io/ephemeral".into(), "true".into());
        assert!(
            matches!(stage(&roots(), r), Err(CsiError::Precondition(_))),
            "inline ephemeral volumes are refused"
        );
        let mut r = staged("pv1", path);
        r.volume_context.insert("path".into(), "/mnt/disks/a".into());
        r.volume_context.insert("csi.storage.k8s.io/pod.name".into(), "web".into());
        r.secrets.insert("key".into(), "s3cret".into());
        let ok = stage(&roots(), r).unwrap();
        assert_eq!(
            ok.attributes.keys().collect::<Vec<_>>(),
            ["path"],
            "kubelet's keys are not the backend's options"
        );
        assert_eq!(ok.secrets["key"].expose(), b"s3cret");
        assert!(!format!("{ok:?}").contains("s3cret"), "secrets stay out of Debug output");
        assert_eq!(
            (ok.shape.access.mode, ok.shape.access.read_only, ok.shape.fs_type.as_str()),
            (AccessMode::ReadWriteOnce, false, "ext4")
        );
    }

    #[test]
    fn access_modes() {
        let a = |m: Mode| {
            access(mount(m).as_ref())
                .map(|s| (s.access.mode, s.access.read_only, s.access.single_pod))
        };
        assert_eq!(
            a(Mode::SingleNodeSingleWriter).unwrap(),
            (AccessMode::ReadWriteOncePod, false, true)
        );
        assert_eq!(a(Mode::MultiNodeReaderOnly).unwrap(), (AccessMode::ReadOnlyMany, true, false));
        assert_eq!(
            a(Mode::MultiNodeMultiWriter).unwrap(),
            (AccessMode::ReadWriteMany, false, false)
        );
        assert_eq!(
            a(Mode::SingleNodeReaderOnly).unwrap(),
            (AccessMode::ReadWriteOnce, true, false)
        );
        assert!(a(Mode::MultiNodeSingleWriter).is_err());
    }

    #[test]
    fn publish_requests() {
        let r = NodePublishVolumeRequest {
            volume_id: "pv1".into(),
            staging_target_path: "/var/lib/kubelet/plugins/kubernetes.io/csi/pv/pv1/globalmount"
                .into(),
            target_path: "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pv1/mount".into(),
            volume_capability: mount(Mode::SingleNodeSingleWriter),
            volume_context: [
                ("csi.storage.k8s.io/pod.name".to_string(), "web".to_string()),
                ("csi.storage.k8s.io/pod.namespace".to_string(), "shop".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let p = publish(&roots(), &r).unwrap();
        assert_eq!((p.pod.as_str(), p.access.single_pod, p.read_only), ("shop/web", true, false));
        let mut same = r.clone();
        same.target_path = same.staging_target_path.clone();
        assert!(publish(&roots(), &same).is_err());
        let mut no_staging = r.clone();
        no_staging.staging_target_path.clear();
        assert!(
            matches!(publish(&roots(), &no_staging), Err(CsiError::Invalid(m)) if m.contains("staging_target_path"))
        );
        let mut no_target = r;
        no_target.target_path.clear();
        assert!(
            matches!(publish(&roots(), &no_target), Err(CsiError::Invalid(m)) if m.contains("target_path"))
        );
    }
}
