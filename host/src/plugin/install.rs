//! Installing a backend's Flexvolume driver as
//! `<volume-plugin-dir>/volagent~<backend>/<backend>`, atomically (copy to a
//! dot-name, fsync, rename: kubelet ignores dot-files), with the config file
//! that tells the driver where the agent's socket is.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Where clusters put kubelet's volume plugin dir, most common first.
pub const KNOWN_VOLUME_PLUGIN_DIRS: &[&str] = &[
    "/usr/libexec/kubernetes/kubelet-plugins/volume/exec",
    "/var/lib/kubelet/volumeplugins",
    "/var/lib/kubelet/volume-plugins",
    "/home/kubernetes/flexvolume",
    "/etc/kubernetes/volumeplugins",
];

/// The file beside each driver, and what it says.
pub use volagent_protocol::{DRIVER_CONFIG, DriverConfig};

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("no volume plugin dir found (looked in {}); pass --volume-plugin-dir with kubelet's --volume-plugin-dir", KNOWN_VOLUME_PLUGIN_DIRS.join(", "))]
    NoPluginDir,
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// The configured dir, else the first known one that exists.
pub fn volume_plugin_dir(configured: Option<&Path>) -> Result<PathBuf, InstallError> {
    if let Some(dir) = configured {
        return Ok(dir.to_path_buf());
    }
    KNOWN_VOLUME_PLUGIN_DIRS
        .iter()
        .map(PathBuf::from)
        .find(|d| d.is_dir())
        .ok_or(InstallError::NoPluginDir)
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> InstallError + '_ {
    move |source| InstallError::Io { path: path.to_path_buf(), source }
}

/// Write `bytes` to `dir/name` through `dir/.name`, fsynced, then renamed.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> Result<PathBuf, InstallError> {
    let tmp = dir.join(format!(".{name}"));
    let dest = dir.join(name);
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, &dest).map_err(io(&dest))?;
    Ok(dest)
}

/// Install the driver for `config.backend`; returns the driver's path.
///
/// A new driver's dir is filled under a dot-name and renamed into place
/// whole: kubelet probes a plugin dir the moment it appears, and a dir
/// without its executable fails that probe — which makes kubelet 1.20 drop
/// every driver of the same probe round.
pub fn install_driver(
    volume_plugin_dir: &Path,
    driver_binary: &Path,
    config: &DriverConfig,
) -> Result<PathBuf, InstallError> {
    let name = format!("volagent~{}", config.backend);
    let dir = volume_plugin_dir.join(&name);
    let json = serde_json::to_vec_pretty(config).map_err(|e| io(&dir)(std::io::Error::other(e)))?;
    let binary = std::fs::read(driver_binary).map_err(io(driver_binary))?;
    if !dir.exists() {
        std::fs::create_dir_all(volume_plugin_dir).map_err(io(volume_plugin_dir))?;
        let staging = volume_plugin_dir.join(format!(".{name}.new"));
        match std::fs::remove_dir_all(&staging) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&staging)(e)),
            _ => {}
        }
        std::fs::create_dir(&staging).map_err(io(&staging))?;
        write_atomic(&staging, DRIVER_CONFIG, &json, 0o644)?;
        write_atomic(&staging, &config.backend, &binary, 0o755)?;
        match std::fs::rename(&staging, &dir) {
            Ok(()) => return Ok(dir.join(&config.backend)),
            // Someone made the dir meanwhile: update it in place below.
            Err(_) if dir.is_dir() => {
                let _ = std::fs::remove_dir_all(&staging);
            }
            Err(e) => return Err(io(&dir)(e)),
        }
    }
    // Config first: a driver that appears must find it.
    write_atomic(&dir, DRIVER_CONFIG, &json, 0o644)?;
    write_atomic(&dir, &config.backend, &binary, 0o755)
}

/// Remove `backend`'s driver dir (driver and config).
pub fn uninstall_driver(volume_plugin_dir: &Path, backend: &str) -> Result<(), InstallError> {
    let dir = volume_plugin_dir.join(format!("volagent~{backend}"));
    // The driver first: kubelet must not find a driver without its config.
    for f in [dir.join(backend), dir.join(DRIVER_CONFIG)] {
        match std::fs::remove_file(&f) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&f)(e)),
            _ => {}
        }
    }
    match std::fs::remove_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&dir)(e)),
        _ => Ok(()),
    }
}

/// kubelet's name of the plugin-containers registration of `backend`:
/// the plugin name `volagent/<backend>` with its slash replaced by `~`.
pub fn registration_path(kubelet_root: &Path, backend: &str) -> PathBuf {
    kubelet_root.join("plugin-containers").join(format!("volagent~{backend}.json"))
}

/// Tell kubelet which container carries this backend's mount utilities
/// (the containerized mount utilities convention), atomically.
pub fn register_container(
    kubelet_root: &Path,
    backend: &str,
    pod: &PodIdentity,
) -> Result<PathBuf, InstallError> {
    let path = registration_path(kubelet_root, backend);
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let json = serde_json::to_vec_pretty(pod).map_err(|e| io(&dir)(std::io::Error::other(e)))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
    write_atomic(&dir, &name, &json, 0o644)
}

pub fn unregister_container(kubelet_root: &Path, backend: &str) -> Result<(), InstallError> {
    let path = registration_path(kubelet_root, backend);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&path)(e)),
        _ => Ok(()),
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodIdentity {
    pub pod_namespace: String,
    pub pod_name: String,
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    pub container_name: String,
}

impl PodIdentity {
    /// From POD_NAMESPACE, POD_NAME, POD_UID and CONTAINER_NAME, when all are set.
    pub fn from_env() -> Option<PodIdentity> {
        let pod = crate::sys::launch::wire::PodName::from_env()?;
        Some(PodIdentity {
            pod_namespace: pod.namespace,
            pod_name: pod.name,
            pod_uid: pod.uid,
            container_name: std::env::var("CONTAINER_NAME").ok().filter(|v| !v.is_empty())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_driver_and_config_atomically() {
        let vpd = tempfile::tempdir().unwrap();
        let bin = vpd.path().join("fake-driver");
        std::fs::write(&bin, b"#!/bin/sh\n").unwrap();
        let config =
            DriverConfig { socket: "/run/volagent/agent.sock".into(), backend: "local-pv".into() };
        let path = install_driver(vpd.path(), &bin, &config).unwrap();
        assert_eq!(path, vpd.path().join("volagent~local-pv/local-pv"));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o755);
        let back: DriverConfig = serde_json::from_slice(
            &std::fs::read(vpd.path().join("volagent~local-pv/volagent.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(back, config);
        let leftovers: Vec<_> = std::fs::read_dir(vpd.path().join("volagent~local-pv"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "no dot-files left behind");
        let staged: Vec<_> = std::fs::read_dir(vpd.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(
            staged.is_empty(),
            "the new driver's dir was staged under a dot-name and renamed: {staged:?}"
        );
        // Reinstalling replaces in place.
        install_driver(vpd.path(), &bin, &config).unwrap();
    }

    #[test]
    fn uninstall_and_registration_round_trip() {
        let vpd = tempfile::tempdir().unwrap();
        let bin = vpd.path().join("fake-driver");
        std::fs::write(&bin, b"#!/bin/sh\n").unwrap();
        let config =
            DriverConfig { socket: "/run/volagent/agent.sock".into(), backend: "nbd".into() };
        install_driver(vpd.path(), &bin, &config).unwrap();
        uninstall_driver(vpd.path(), "nbd").unwrap();
        assert!(!vpd.path().join("volagent~nbd").exists());
        uninstall_driver(vpd.path(), "nbd").expect("uninstalling twice is fine");

        let root = tempfile::tempdir().unwrap();
        let pod = super::PodIdentity {
            pod_namespace: "volagent-system".into(),
            pod_name: "agent-x".into(),
            pod_uid: "u-1".into(),
            container_name: "agent".into(),
        };
        let path = register_container(root.path(), "nbd", &pod).unwrap();
        assert_eq!(path, root.path().join("plugin-containers/volagent~nbd.json"));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"podNamespace": "volagent-system", "podName": "agent-x", "podUID": "u-1", "containerName": "agent"})
        );
        unregister_container(root.path(), "nbd").unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn a_configured_dir_wins_and_none_found_says_what_to_do() {
        assert_eq!(volume_plugin_dir(Some(Path::new("/x"))).unwrap(), PathBuf::from("/x"));
        let msg = InstallError::NoPluginDir.to_string();
        assert!(
            msg.contains("--volume-plugin-dir") && msg.contains("/var/lib/kubelet/volumeplugins")
        );
    }
}
