//! Backends on this node: loading the plugin dir and installing each
//! backend's Flexvolume driver where kubelet looks for it.

pub mod install;
pub mod reload;
pub mod watch;

use crate::policy::{Plugin, Runtime};
use std::path::Path;
use std::sync::Arc;

/// Load every `*.wasm` in `dir` (dot-files are installs in progress). A file
/// that fails to load is reported and skipped: one bad file must not keep
/// the other backends from serving.
pub fn load_dir(runtime: &Arc<Runtime>, dir: &Path) -> std::io::Result<Vec<Plugin>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "wasm"))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !n.starts_with('.')))
        .collect();
    files.sort();
    let mut plugins: Vec<Plugin> = Vec::new();
    for file in files {
        match Plugin::load_file(runtime, &file) {
            Ok(p) if plugins.iter().any(|q| q.name() == p.name()) => {
                tracing::error!(file = %file.display(), backend = p.name(), "a second file for the same backend is ignored");
            }
            Ok(p) => {
                tracing::info!(backend = p.name(), version = %p.info().version, file = %file.display(), sha256 = p.sha256(), "backend loaded");
                plugins.push(p);
            }
            Err(e) => tracing::error!("backend not loaded: {e}"),
        }
    }
    Ok(plugins)
}
