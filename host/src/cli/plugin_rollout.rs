//! `volagent plugin promote|rollback|trust`: the first two move versions
//! in a plugin dir ([`crate::plugin::rollout`]); `trust` lists versions in
//! an allow-list.

use crate::plugin::trust::{AllowList, TrustSources};
use crate::policy::{Plugin, Runtime};
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn promote(
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    dir: &Path,
    backend: &str,
) -> anyhow::Result<()> {
    for line in crate::plugin::rollout::promote(runtime, trust, dir, backend)? {
        println!("{line}");
    }
    Ok(())
}

pub fn rollback(
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    dir: &Path,
    backend: &str,
) -> anyhow::Result<()> {
    println!("{}", crate::plugin::rollout::rollback(runtime, trust, dir, backend)?);
    Ok(())
}

fn rename(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::rename(from, to)
        .with_context(|| format!("cannot rename {} to {}", from.display(), to.display()))
}

/// Each file's `<backend> <sha256>` line, after it loads as a policy;
/// added to the allow-list `list` when given and not there yet (the list
/// is kept as it is, comments too, and written whole, then renamed into
/// place, so an agent never reads half of it).
pub fn trust_files(
    runtime: &Arc<Runtime>,
    files: &[PathBuf],
    list: Option<&Path>,
) -> anyhow::Result<()> {
    let mut lines = Vec::new();
    for file in files {
        let bytes = crate::sys::beneath::read_file(file, runtime.limits.max_file_bytes)
            .with_context(|| format!("cannot read {}", file.display()))?;
        let plugin = Plugin::load_candidate(runtime, file, &bytes)
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        // The comment names the file as given, on one line whatever the
        // name holds.
        let shown: String = format!("{} {}", file.display(), plugin.info().version)
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        let line = format!("{} {}  # {shown}", plugin.name(), plugin.sha256());
        println!("{line}");
        lines.push((plugin.name().to_string(), plugin.sha256().to_string(), line));
    }
    let Some(list) = list else { return Ok(()) };
    let mut text = match std::fs::read_to_string(list) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", list.display())),
    };
    // A list that does not parse is mended by hand, not added to.
    let mut known = AllowList::parse(list, &text)?;
    let mut added = 0;
    for (backend, sha, line) in lines {
        if known.backends(&sha).is_some_and(|b| b.contains(&backend)) {
            continue;
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&line);
        text.push('\n');
        known.add(&backend, &sha);
        added += 1;
    }
    let tmp = list.with_file_name(format!(
        ".{}.new",
        list.file_name().and_then(|n| n.to_str()).unwrap_or("trusted-policies")
    ));
    std::fs::write(&tmp, &text).with_context(|| format!("cannot write {}", tmp.display()))?;
    // The list keeps its mode (an admin may have made it 0600).
    if let Ok(meta) = std::fs::metadata(list) {
        std::fs::set_permissions(&tmp, meta.permissions())
            .with_context(|| format!("cannot set the mode of {}", tmp.display()))?;
    }
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {}", tmp.display()))?;
    rename(&tmp, list)?;
    println!("{}: {} entries ({added} new)", list.display(), known.len());
    Ok(())
}
