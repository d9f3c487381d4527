//! Installing a backend's Flexvolume driver as
//! `<volume-plugin-dir>/volagent~<backend>/<backend>`, atomically (copy to a
//! dot-name, fsync, rename: kubelet ignores dot-files), with the config file
//! that tells the driver where the agent's socket is.

use serde::{Deserialize, Serialize};
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

/// The file beside each driver.
pub const DRIVER_CONFIG: &str = "volagent.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriverConfig {
    pub socket: PathBuf,
    pub backend: String,
}

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
    KNOWN_VOLUME_PLUGIN_DIRS.iter().map(PathBuf::from).find(|d| d.is_dir()).ok_or(InstallError::NoPluginDir)
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
pub fn install_driver(volume_plugin_dir: &Path, driver_binary: &Path, config: &DriverConfig) -> Result<PathBuf, InstallError> {
    let dir = volume_plugin_dir.join(format!("volagent~{}", config.backend));
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let json = serde_json::to_vec_pretty(config).map_err(|e| io(&dir)(std::io::Error::other(e)))?;
    // Config first: a driver that appears must find it.
    write_atomic(&dir, DRIVER_CONFIG, &json, 0o644)?;
    let binary = std::fs::read(driver_binary).map_err(io(driver_binary))?;
    write_atomic(&dir, &config.backend, &binary, 0o755)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_driver_and_config_atomically() {
        let vpd = tempfile::tempdir().unwrap();
        let bin = vpd.path().join("fake-driver");
        std::fs::write(&bin, b"#!/bin/sh\n").unwrap();
        let config = DriverConfig { socket: "/run/volagent/agent.sock".into(), backend: "local-pv".into() };
        let path = install_driver(vpd.path(), &bin, &config).unwrap();
        assert_eq!(path, vpd.path().join("volagent~local-pv/local-pv"));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o755);
        let back: DriverConfig = serde_json::from_slice(&std::fs::read(vpd.path().join("volagent~local-pv/volagent.json")).unwrap()).unwrap();
        assert_eq!(back, config);
        let leftovers: Vec<_> = std::fs::read_dir(vpd.path().join("volagent~local-pv"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "no dot-files left behind");
        // Reinstalling replaces in place.
        install_driver(vpd.path(), &bin, &config).unwrap();
    }

    #[test]
    fn a_configured_dir_wins_and_none_found_says_what_to_do() {
        assert_eq!(volume_plugin_dir(Some(Path::new("/x"))).unwrap(), PathBuf::from("/x"));
        let msg = InstallError::NoPluginDir.to_string();
        assert!(msg.contains("--volume-plugin-dir") && msg.contains("/var/lib/kubelet/volumeplugins"));
    }
}
