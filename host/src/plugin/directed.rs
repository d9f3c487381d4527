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
/// the watch ignores, made new and never through a link), synced, then
/// renamed into place, and the dir synced.
fn place(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join(format!(".{name}.incoming"));
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("cannot remove {}", tmp.display()));
        }
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(&tmp)
        .with_context(|| format!("cannot make {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    let to = dir.join(name);
    std::fs::rename(&tmp, &to)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), to.display()))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync {}", dir.display()))
}

/// The bytes of version `sha256`: the plugin dir's kept previous version
/// when it is that one, else a store's file; checked against the digest.
fn version(
    stores: &mut Stores,
    dir: &Path,
    previous: &str,
    sha256: &str,
    max: u64,
) -> anyhow::Result<Vec<u8>> {
    let digest = |b: &[u8]| hex::encode(Sha256::digest(b));
    if let Ok(bytes) = crate::sys::beneath::read_beneath(dir, Path::new(previous), max)
        && digest(&bytes) == sha256
    {
        return Ok(bytes);
    }
    let from = stores.find(sha256, max).ok_or_else(|| Missing(sha256.to_string()))?;
    let bytes = crate::sys::beneath::read_file(&from, max)
        .with_context(|| format!("cannot read {}", from.display()))?;
    anyhow::ensure!(digest(&bytes) == sha256, "{} changed while it was read", from.display());
    Ok(bytes)
}

/// The candidate's file, signature and scenarios go: what comes next (or
/// nothing) must not be checked against, or signed by, what went.
fn drop_candidate(dir: &Path, backend: &str) -> anyhow::Result<bool> {
    let candidate = format!("{backend}{}", super::reload::CANDIDATE);
    let stem = format!("{backend}.candidate");
    let mut gone = false;
    for name in [
        candidate.clone(),
        format!("{candidate}{}", super::trust::SIGNATURE),
        format!("{stem}.scenarios.yaml"),
    ] {
        let path = dir.join(&name);
        match std::fs::remove_file(&path) {
            Ok(()) => gone |= name == candidate,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("cannot remove {}", path.display())),
        }
    }
    let scenarios = dir.join(format!("{stem}.scenarios"));
    if std::fs::symlink_metadata(&scenarios).is_ok() {
        std::fs::remove_dir_all(&scenarios)
            .with_context(|| format!("cannot remove {}", scenarios.display()))?;
    }
    Ok(gone)
}

/// A version no store holds: the node waits for it (a store filled later
/// is looked at again), which is not a failure of the version.
#[derive(Debug, thiserror::Error)]
#[error("version {0} is in no policy store of this node")]
pub struct Missing(pub String);

/// Bring `dir` in line with `wanted`: what was done (nothing when it
/// already is), or why not. `loaded` is the digest the agent serves the
/// backend with (from whatever file), which counts when `<backend>.wasm`
/// is not there.
pub fn apply(
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    stores: &mut Stores,
    dir: &Path,
    wanted: &Wanted,
    loaded: Option<&str>,
) -> anyhow::Result<Vec<String>> {
    let max = runtime.limits.max_file_bytes;
    let b = &wanted.backend;
    let serving = format!("{b}.wasm");
    let candidate = format!("{b}{}", super::reload::CANDIDATE);
    let previous = format!("{b}{}", super::reload::PREVIOUS);
    let mut done = Vec::new();
    let serving_now = sha_of(dir, &serving, max).or_else(|| loaded.map(str::to_string));
    if serving_now.as_deref() != Some(&wanted.serve) {
        if sha_of(dir, &previous, max).as_deref() == Some(&wanted.serve) {
            done.push(rollout::rollback(runtime, trust, dir, b)?);
        } else {
            if sha_of(dir, &candidate, max).as_deref() != Some(&wanted.serve) {
                let bytes = version(stores, dir, &previous, &wanted.serve, max)?;
                drop_candidate(dir, b)?;
                place(dir, &candidate, &bytes)?;
                done.push(format!("{candidate}: version {}, to serve", wanted.serve));
            }
            done.extend(rollout::promote(runtime, trust, dir, b)?);
        }
    }
    let now = sha_of(dir, &candidate, max);
    match &wanted.candidate {
        Some(sha) if now.as_deref() != Some(sha) => {
            let bytes = version(stores, dir, &previous, sha, max)?;
            drop_candidate(dir, b)?;
            place(dir, &candidate, &bytes)?;
            done.push(format!("{candidate}: version {sha}, in the shadow"));
        }
        None if now.is_some() => {
            drop_candidate(dir, b)?;
            done.push(format!("{candidate} removed: no candidate is wanted"));
        }
        _ => {}
    }
    Ok(done)
}
