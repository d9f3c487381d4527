//! What kubelet asked over Flexvolume, parsed from the mount dir and
//! options into `ops`' typed requests; anything malformed is refused here,
//! before any lock, record or device is touched.

use crate::model::{AccessMode, Consumer, KeyValue, Volume};
use crate::ops::request::{MAX_PATH, MountDir, MountRequest};
use crate::policy::validate::clean_absolute;
use std::collections::BTreeMap;
use std::path::Path;

/// Check `dir` has kubelet's shape under one of `kubelet_roots` (kubelet's
/// root resolved, then as configured: kubelet spells dirs its own way), and
/// name it under the first.
pub fn parse_mount_dir(
    kubelet_roots: &[&Path],
    backend: &str,
    dir: &str,
) -> Result<MountDir, String> {
    if dir.len() > MAX_PATH {
        return Err(format!("mount dir of {} bytes is longer than {MAX_PATH}", dir.len()));
    }
    clean_absolute(dir).map_err(|e| format!("mount dir: {e}"))?;
    let resolved = kubelet_roots.first().ok_or("no kubelet root configured")?;
    let rest =
        kubelet_roots.iter().find_map(|root| Path::new(dir).strip_prefix(root).ok()).ok_or_else(
            || format!("mount dir {dir} is not under the kubelet root {}", resolved.display()),
        )?;
    let parts: Vec<&str> = rest.iter().filter_map(|c| c.to_str()).collect();
    let driver = format!("volagent~{backend}");
    match parts.as_slice() {
        ["pods", uid, "volumes", d, name]
            if *d == driver && !uid.is_empty() && !name.is_empty() =>
        {
            Ok(MountDir {
                dir: resolved.join(rest),
                pod_uid: uid.to_string(),
                name: name.to_string(),
            })
        }
        _ => Err(format!(
            "mount dir {dir} does not have kubelet's shape {}/pods/<pod-uid>/volumes/{driver}/<volume>",
            resolved.display()
        )),
    }
}

const K8S: &str = "kubernetes.io/";

fn access_mode(value: &str) -> Result<AccessMode, String> {
    crate::model::AccessMode::parse(value)
        .ok_or_else(|| format!("accessMode {value:?} is not a Kubernetes access mode"))
}

/// Build the request from kubelet's options (all strings; see the
/// Flexvolume contract). The access mode comes from the volume's own
/// `accessMode` option (default ReadWriteOnce) until the PV is read.
pub fn parse_mount(
    node: &str,
    backend: &str,
    dir: &MountDir,
    options: &BTreeMap<String, String>,
) -> Result<MountRequest, String> {
    let get = |key: &str| options.get(&format!("{K8S}{key}")).map(String::as_str);
    let required = |key: &str| {
        get(key).filter(|v| !v.is_empty()).ok_or_else(|| format!("option {K8S}{key} is missing"))
    };
    let volume_name = required("pvOrVolumeName")?;
    // kubelet names a volume's dir after it: a request whose dir is another
    // volume's is not kubelet's.
    if volume_name != dir.name {
        return Err(format!(
            "volume {volume_name:?} does not match the mount dir's last component {:?}",
            dir.name
        ));
    }
    let pod_uid = get("pod.uid")
        .or(get("pod.UID"))
        .filter(|v| !v.is_empty())
        .ok_or("option kubernetes.io/pod.uid is missing")?;
    if pod_uid != dir.pod_uid {
        return Err(format!("pod uid {pod_uid} does not match the mount dir's {}", dir.pod_uid));
    }
    let read_only = match get("readwrite").unwrap_or("rw") {
        "rw" => false,
        "ro" => true,
        other => return Err(format!("option {K8S}readwrite is {other:?}, not rw or ro")),
    };
    let secrets = crate::secret::from_options(options)?;
    let secret_keys = secrets.keys().cloned().collect();
    let user: Vec<KeyValue> = options
        .iter()
        .filter(|(k, _)| !k.starts_with(K8S))
        .map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() })
        .collect();
    let mode = match options.get("accessMode") {
        Some(m) => access_mode(m)?,
        None => AccessMode::ReadWriteOnce,
    };
    Ok(MountRequest {
        volume: Volume {
            name: volume_name.to_string(),
            backend: backend.to_string(),
            access_mode: mode,
            fs_type: get("fsType").unwrap_or("").to_string(),
            mode: crate::policy::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: user,
            secret_keys,
        },
        consumer: Consumer {
            node: node.to_string(),
            pod_namespace: required("pod.namespace")?.to_string(),
            pod: required("pod.name")?.to_string(),
            pod_uid: pod_uid.to_string(),
            mount_dir: dir.dir.display().to_string(),
            read_only,
            mount_group: None,
        },
        secrets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: &str = "/var/lib/kubelet";

    fn dir(d: &str) -> Result<MountDir, String> {
        parse_mount_dir(&[Path::new(ROOT)], "local-pv", d)
    }

    #[test]
    fn mount_dirs() {
        let ok = dir("/var/lib/kubelet/pods/u-1/volumes/volagent~local-pv/pv1").unwrap();
        assert_eq!((ok.pod_uid.as_str(), ok.name.as_str()), ("u-1", "pv1"));
        for bad in [
            "/etc/passwd",
            "/var/lib/kubelet/pods/u-1/volumes/volagent~local-pv/pv1/../../../../../../etc",
            "/var/lib/kubelet/pods/u-1/volumes/volagent~rbd/pv1",
            "/var/lib/kubelet/pods/u-1/volumes/volagent~local-pv",
            "/var/lib/kubelet/pods/u-1/volumes/volagent~local-pv/pv1/extra",
            "relative/pods/u/volumes/volagent~local-pv/pv",
            "/var/lib/kubeletX/pods/u-1/volumes/volagent~local-pv/pv1",
        ] {
            assert!(dir(bad).is_err(), "{bad}");
        }
    }

    fn opts(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn options_as_kubelet_sends_them() {
        let d = dir("/var/lib/kubelet/pods/u-1/volumes/volagent~local-pv/pv1").unwrap();
        let base = [
            ("kubernetes.io/fsType", "xfs"),
            ("kubernetes.io/readwrite", "ro"),
            ("kubernetes.io/pvOrVolumeName", "pv1"),
            ("kubernetes.io/pod.name", "web-0"),
            ("kubernetes.io/pod.namespace", "shop"),
            ("kubernetes.io/pod.uid", "u-1"),
            ("kubernetes.io/serviceAccount.name", "default"),
            ("kubernetes.io/secret/key", "c2VjcmV0"),
            ("path", "/mnt/disks/a.img"),
            ("accessMode", "ReadWriteMany"),
        ];
        let r = parse_mount("n1", "local-pv", &d, &opts(&base)).unwrap();
        assert_eq!(r.volume.fs_type, "xfs");
        assert_eq!(r.volume.access_mode, AccessMode::ReadWriteMany);
        assert_eq!(r.volume.secret_keys, vec!["key"]);
        assert!(r.volume.options.iter().all(|kv| !kv.key.starts_with("kubernetes.io/")));
        assert!(
            r.volume.options.iter().all(|kv| kv.value != "c2VjcmV0"),
            "secret values never reach guests"
        );
        assert_eq!(r.secrets["key"].expose(), b"secret", "they stay host-side, decoded");
        assert!(
            !format!("{r:?}").contains("c2VjcmV0") && !format!("{r:?}").contains("\"secret\""),
            "and never in Debug output"
        );
        let mut bad = opts(&base);
        bad.insert("kubernetes.io/secret/key".into(), "%%%".into());
        assert!(parse_mount("n1", "local-pv", &d, &bad).unwrap_err().contains("not base64"));
        assert!(r.consumer.read_only);
        assert_eq!((r.consumer.pod_namespace.as_str(), r.consumer.pod.as_str()), ("shop", "web-0"));
        // Older kubelets spell pod.UID.
        let mut old = opts(&base);
        let uid = old.remove("kubernetes.io/pod.uid").unwrap();
        old.insert("kubernetes.io/pod.UID".into(), uid);
        assert!(parse_mount("n1", "local-pv", &d, &old).is_ok());
        let mut other = opts(&base);
        other.insert("kubernetes.io/pod.uid".into(), "u-2".into());
        assert!(parse_mount("n1", "local-pv", &d, &other).unwrap_err().contains("does not match"));
        let mut bad = opts(&base);
        bad.insert("kubernetes.io/readwrite".into(), "rx".into());
        assert!(parse_mount("n1", "local-pv", &d, &bad).is_err());
        let mut missing = opts(&base);
        missing.remove("kubernetes.io/pvOrVolumeName");
        assert!(
            parse_mount("n1", "local-pv", &d, &missing).unwrap_err().contains("pvOrVolumeName")
        );
        // The dir is the volume's: another volume's name is refused.
        let mut other = opts(&base);
        other.insert("kubernetes.io/pvOrVolumeName".into(), "pv2".into());
        assert!(
            parse_mount("n1", "local-pv", &d, &other)
                .unwrap_err()
                .contains("does not match the mount dir")
        );
    }

    #[test]
    fn mount_dirs_in_kubelets_spelling_are_named_under_the_resolved_root() {
        let d = parse_mount_dir(
            &[Path::new("/data/kubelet"), Path::new(ROOT)],
            "local-pv",
            "/var/lib/kubelet/pods/u-1/volumes/volagent~local-pv/pv1",
        )
        .unwrap();
        assert_eq!(d.dir, Path::new("/data/kubelet/pods/u-1/volumes/volagent~local-pv/pv1"));
        let long = format!("{ROOT}/pods/u/volumes/volagent~local-pv/{}", "x".repeat(5000));
        assert!(dir(&long).unwrap_err().contains("longer than"));
    }
}
