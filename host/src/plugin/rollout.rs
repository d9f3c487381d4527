//! Promote and roll back: a backend's versions moved by renames in the
//! plugin dir, which the agent's watch takes like any change (`volagent
//! plugin promote|rollback`, and an agent applying a `BackendPolicy`). A
//! file serving the backend is there at every moment: each step is one
//! atomic rename within the dir. A version's scenarios and signature move
//! with it, and are put back when a later step fails.

use super::reload::{CANDIDATE, PREVIOUS, check_file};
use super::trust::{self, SIGNATURE, TrustSources};
use crate::policy::{Plugin, Runtime};
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Backend names are DNS labels; anything else could name a path.
fn checked_backend(backend: &str) -> anyhow::Result<()> {
    let ok = !backend.is_empty()
        && backend.len() <= 63
        && backend.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    anyhow::ensure!(ok, "{backend:?} is not a backend name (a DNS label)");
    Ok(())
}

/// A regular file, not a link that could point anywhere.
fn regular(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// Whether `path` loads as `backend` (no instances made ahead: only a look).
fn is_backend(runtime: &Arc<Runtime>, path: &Path, backend: &str) -> bool {
    regular(path)
        && crate::sys::beneath::read_file(path, runtime.limits.max_file_bytes)
            .ok()
            .and_then(|bytes| Plugin::load_candidate(runtime, path, &bytes).ok())
            .is_some_and(|plugin| plugin.name() == backend)
}

/// The file of `dir` serving `backend`: `<backend>.wasm` when it is that
/// backend, else the other served file whose `info` names it.
fn serving_file(runtime: &Arc<Runtime>, dir: &Path, backend: &str) -> Option<PathBuf> {
    let usual = dir.join(format!("{backend}.wasm"));
    if is_backend(runtime, &usual, backend) {
        return Some(usual);
    }
    let mut others: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.ends_with(".wasm")
                && !name.starts_with('.')
                && !name.ends_with(CANDIDATE)
                && !name.ends_with(PREVIOUS)
        })
        .collect();
    others.sort();
    others.into_iter().find(|p| is_backend(runtime, p, backend))
}

/// Where the version that will serve goes: the serving file, or, when none
/// serves, `<backend>.wasm`, which must then not be there (it is another
/// backend's, or a file that does not load).
fn target(runtime: &Arc<Runtime>, dir: &Path, backend: &str) -> anyhow::Result<(PathBuf, bool)> {
    if let Some(serving) = serving_file(runtime, dir, backend) {
        return Ok((serving, true));
    }
    let usual = dir.join(format!("{backend}.wasm"));
    anyhow::ensure!(
        std::fs::symlink_metadata(&usual).is_err(),
        "{} is there but is not backend {backend} (another backend, or a file that does not load): move it away first",
        usual.display()
    );
    Ok((usual, false))
}

/// The scenarios shipped beside a file of stem `stem`, as the agent finds
/// them: `<stem>.scenarios.yaml` or the dir `<stem>.scenarios`.
fn scenarios_of(dir: &Path, stem: &str) -> Option<PathBuf> {
    [dir.join(format!("{stem}.scenarios.yaml")), dir.join(format!("{stem}.scenarios"))]
        .into_iter()
        .find(|p| std::fs::symlink_metadata(p).is_ok())
}

/// `path`'s form (a file or a dir of scenarios) under stem `stem`.
fn same_form(dir: &Path, path: &Path, stem: &str) -> PathBuf {
    if path.extension().is_some_and(|e| e == "yaml") {
        dir.join(format!("{stem}.scenarios.yaml"))
    } else {
        dir.join(format!("{stem}.scenarios"))
    }
}

fn stem(path: &Path) -> String {
    path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string()
}

/// The checks the agent makes of a new file, as it will be named: trusted
/// (listed, or signed by the signature beside it, which moves with it),
/// loaded, and passing the scenarios it will have.
fn check(
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    file: &Path,
    named: &Path,
    backend: &str,
) -> anyhow::Result<String> {
    let bytes = crate::sys::beneath::read_file(file, runtime.limits.max_file_bytes)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&bytes))
    };
    let dir = file.parent().unwrap_or(Path::new("."));
    let name = file.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let signature = trust::signature_beside(dir, name);
    let grant = trust
        .now()
        .check(&sha, &bytes, signature.as_ref().map(|(n, r)| (n.as_str(), r.clone())))
        .map_err(|why| anyhow::anyhow!("{}: {why}", file.display()))?;
    let plugin = check_file(runtime, named, &bytes)
        .map_err(|why| anyhow::anyhow!("{}: {why}", file.display()))?;
    anyhow::ensure!(
        plugin.name() == backend,
        "{} is backend {}, not {backend}",
        file.display(),
        plugin.name()
    );
    grant.covers(backend, &sha).map_err(|why| anyhow::anyhow!("{}: {why}", file.display()))?;
    Ok(format!("{} {} (sha256 {})", plugin.name(), plugin.info().version, plugin.sha256()))
}

fn rename(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::rename(from, to)
        .with_context(|| format!("cannot rename {} to {}", from.display(), to.display()))
}

/// `a` and `b` swap names in one step: both are there at every moment.
fn exchange(a: &Path, b: &Path) -> anyhow::Result<()> {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    renameat2(AT_FDCWD, a, AT_FDCWD, b, RenameFlags::RENAME_EXCHANGE)
        .with_context(|| format!("cannot exchange {} and {}", a.display(), b.display()))
}

/// The scenarios of stems `a` and `b` swap names, each keeping its form
/// (a file or a dir); a stem with none gets none.
fn swap_scenarios(dir: &Path, a: &str, b: &str) -> anyhow::Result<()> {
    match (scenarios_of(dir, a), scenarios_of(dir, b)) {
        (Some(x), Some(y)) if same_form(dir, &x, b) == y => exchange(&x, &y),
        (Some(x), Some(y)) => {
            rename(&y, &same_form(dir, &y, a))?;
            rename(&x, &same_form(dir, &x, b))
        }
        (Some(x), None) => rename(&x, &same_form(dir, &x, b)),
        (None, Some(y)) => rename(&y, &same_form(dir, &y, a)),
        (None, None) => Ok(()),
    }
}

/// The signatures of files `a` and `b` of `dir` swap names; a file with
/// none gets none.
fn swap_signatures(dir: &Path, a: &Path, b: &Path) -> anyhow::Result<()> {
    let sig = |p: &Path| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        dir.join(format!("{name}{SIGNATURE}"))
    };
    let (x, y) = (sig(a), sig(b));
    match (std::fs::symlink_metadata(&x).is_ok(), std::fs::symlink_metadata(&y).is_ok()) {
        (true, true) => exchange(&x, &y),
        (true, false) => rename(&x, &y),
        (false, true) => rename(&y, &x),
        (false, false) => Ok(()),
    }
}

/// The scenarios of stem `stem` go (a version being replaced takes its
/// own with it).
fn drop_scenarios(dir: &Path, stem: &str) -> anyhow::Result<()> {
    while let Some(old) = scenarios_of(dir, stem) {
        let removed =
            if old.is_dir() { std::fs::remove_dir_all(&old) } else { std::fs::remove_file(&old) };
        removed.with_context(|| format!("cannot remove {}", old.display()))?;
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync {}", dir.display()))
}

/// The candidate serves; what served is kept as the previous version. The
/// candidate's own scenarios, when shipped beside it, go with it (the old
/// ones are kept as the previous version's); else it must pass those
/// beside the serving file. What was done, line by line.
pub fn promote(
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    dir: &Path,
    backend: &str,
) -> anyhow::Result<Vec<String>> {
    checked_backend(backend)?;
    let candidate = dir.join(format!("{backend}{CANDIDATE}"));
    anyhow::ensure!(
        regular(&candidate),
        "{} is not there: nothing to promote",
        candidate.display()
    );
    let (target, serves) = target(runtime, dir, backend)?;
    let (candidate_stem, target_stem) = (stem(&candidate), stem(&target));
    let own = scenarios_of(dir, &candidate_stem).is_some();
    let named = if own { candidate.clone() } else { target.clone() };
    let what = check(runtime, trust, &candidate, &named, backend)?;
    let previous_stem = format!("{backend}.previous");
    let previous = dir.join(format!("{backend}{PREVIOUS}"));
    let mut done = Vec::new();
    if serves {
        // The version kept until now is replaced, and its scenarios and
        // signature with it.
        drop_scenarios(dir, &previous_stem)?;
        let old_signature = dir.join(format!("{backend}{PREVIOUS}{SIGNATURE}"));
        if std::fs::symlink_metadata(&old_signature).is_ok() {
            std::fs::remove_file(&old_signature)
                .with_context(|| format!("cannot remove {}", old_signature.display()))?;
        }
    }
    // Scenarios and signature first: the agent reads them when the
    // component changes.
    if own {
        swap_scenarios(dir, &candidate_stem, &target_stem)?;
    }
    let moved = swap_signatures(dir, &candidate, &target).and_then(|()| {
        if serves { exchange(&candidate, &target) } else { rename(&candidate, &target) }
    });
    if let Err(e) = moved {
        // Put back what moved: each version keeps its own.
        let _ = swap_signatures(dir, &candidate, &target);
        if own {
            let _ = swap_scenarios(dir, &candidate_stem, &target_stem);
        }
        return Err(e);
    }
    if serves {
        // The version that served is under the candidate's name now, with
        // its signature and scenarios: kept as the previous version.
        rename(&candidate, &previous)?;
        swap_signatures(dir, &candidate, &previous)?;
        if own {
            swap_scenarios(dir, &candidate_stem, &previous_stem)?;
        }
        done.push(format!("kept the version that served as {}", previous.display()));
    }
    sync_dir(dir)?;
    done.push(format!("promoted {what}: {} now serves", target.display()));
    Ok(done)
}

/// The previous version serves again, and what served becomes the previous
/// version, each with its own scenarios and signature: a second rollback
/// rolls forward. What was done.
pub fn rollback(
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    dir: &Path,
    backend: &str,
) -> anyhow::Result<String> {
    checked_backend(backend)?;
    let previous = dir.join(format!("{backend}{PREVIOUS}"));
    anyhow::ensure!(
        regular(&previous),
        "{} is not there: no version to roll back to",
        previous.display()
    );
    let (target, serves) = target(runtime, dir, backend)?;
    // Checked against its own scenarios (none, when none were kept).
    let what = check(runtime, trust, &previous, &previous, backend)?;
    let (previous_stem, target_stem) = (stem(&previous), stem(&target));
    swap_scenarios(dir, &previous_stem, &target_stem)?;
    let moved = swap_signatures(dir, &previous, &target).and_then(|()| {
        if serves { exchange(&previous, &target) } else { rename(&previous, &target) }
    });
    if let Err(e) = moved {
        let _ = swap_signatures(dir, &previous, &target);
        let _ = swap_scenarios(dir, &previous_stem, &target_stem);
        return Err(e);
    }
    sync_dir(dir)?;
    Ok(format!("rolled back to {what}: {} serves it again", target.display()))
}
