//! Versions the cluster chose (a `BackendPolicy`), put in place in the
//! plugin dir by the same file operations an admin uses: a version from a
//! policy store is written as the backend's candidate, then promoted; a
//! version kept as the previous one is rolled back to. The agent's watch
//! then takes each change like any other, with every check.

use super::rollout;
use super::trust::TrustSources;
use crate::policy::Runtime;
use anyhow::Context;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

/// What should serve a backend, and run in its shadow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub backend: String,
    pub serve: String,
    pub candidate: Option<String>,
}

/// The `*.wasm` files of the policy stores, by sha256 (digests kept while
/// a file's size and time stay the same).
#[derive(Debug, Default)]
pub struct Stores {
    dirs: Vec<PathBuf>,
    seen: HashMap<PathBuf, (SystemTime, u64, String)>,
}

impl Stores {
    pub fn new(dirs: Vec<PathBuf>) -> Stores {
        Stores { dirs, seen: HashMap::new() }
    }

    /// A file of the stores holding `sha256`.
    fn find(&mut self, sha256: &str, max: u64) -> Option<PathBuf> {
        let mut found = None;
        let mut present = Vec::new();
        for dir in &self.dirs {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
                if path.extension().is_none_or(|e| e != "wasm") {
                    continue;
                }
                let Ok(meta) = std::fs::metadata(&path) else { continue };
                let (Ok(time), len) = (meta.modified(), meta.len()) else { continue };
                present.push(path.clone());
                let known = self.seen.get(&path).filter(|(t, l, _)| *t == time && *l == len);
                let sha = match known {
                    Some((_, _, sha)) => sha.clone(),
                    None => {
                        let Ok(bytes) = crate::sys::beneath::read_file(&path, max) else {
                            continue;
                        };
                        let sha = hex::encode(Sha256::digest(&bytes));
                        self.seen.insert(path.clone(), (time, len, sha.clone()));
                        sha
                    }
                };
                if found.is_none() && sha == sha256 {
                    found = Some(path);
                }
            }
        }
        self.seen.retain(|p, _| present.contains(p));
        found
    }
}

/// The sha256 of the plugin dir's file `name`, if it is there.
fn sha_of(dir: &Path, name: &str, max: u64) -> Option<String> {
    crate::sys::beneath::read_beneath(dir, Path::new(name), max)
        .ok()
        .map(|bytes| hex::encode(Sha256::digest(bytes)))
}

/// Write `bytes` as the plugin dir's file `name`, whole: a dot-file (which
/// the watch ignores), synced, then renamed into place.
fn place(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = dir.join(format!(".{name}.incoming"));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {}", tmp.display()))?;
    let to = dir.join(name);
    std::fs::rename(&tmp, &to)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), to.display()))
}

/// The version `sha256` from the stores, written as `name` in the plugin
/// dir; the bytes written are the ones checked.
fn fetch(
    stores: &mut Stores,
    dir: &Path,
    name: &str,
    sha256: &str,
    max: u64,
) -> anyhow::Result<()> {
    let from = stores.find(sha256, max).ok_or_else(|| Missing(sha256.to_string()))?;
    let bytes = crate::sys::beneath::read_file(&from, max)
        .with_context(|| format!("cannot read {}", from.display()))?;
    anyhow::ensure!(
        hex::encode(Sha256::digest(&bytes)) == sha256,
        "{} changed while it was read",
        from.display()
    );
    place(dir, name, &bytes)
}

/// A version no store holds: the node waits for it (a store filled later
/// is looked at again), which is not a failure of the version.
#[derive(Debug, thiserror::Error)]
#[error("version {0} is in no policy store of this node")]
pub struct Missing(pub String);

/// Bring `dir` in line with `wanted`: what was done (nothing when it
/// already is), or why not.
pub fn apply(
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    stores: &mut Stores,
    dir: &Path,
    wanted: &Wanted,
) -> anyhow::Result<Vec<String>> {
    let max = runtime.limits.max_file_bytes;
    let b = &wanted.backend;
    let serving = format!("{b}.wasm");
    let candidate = format!("{b}{}", super::reload::CANDIDATE);
    let previous = format!("{b}{}", super::reload::PREVIOUS);
    let mut done = Vec::new();
    if sha_of(dir, &serving, max).as_deref() != Some(&wanted.serve) {
        if sha_of(dir, &previous, max).as_deref() == Some(&wanted.serve) {
            done.push(rollout::rollback(runtime, trust, dir, b)?);
        } else {
            if sha_of(dir, &candidate, max).as_deref() != Some(&wanted.serve) {
                fetch(stores, dir, &candidate, &wanted.serve, max)?;
                done.push(format!("{candidate}: version {} from the policy store", wanted.serve));
            }
            done.extend(rollout::promote(runtime, trust, dir, b)?);
        }
    }
    let now = sha_of(dir, &candidate, max);
    match &wanted.candidate {
        Some(sha) if now.as_deref() != Some(sha) => {
            fetch(stores, dir, &candidate, sha, max)?;
            done.push(format!("{candidate}: version {sha} from the policy store, in the shadow"));
        }
        None if now.is_some() => {
            let path = dir.join(&candidate);
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
            done.push(format!("{candidate} removed: no candidate is wanted"));
        }
        _ => {}
    }
    Ok(done)
}
