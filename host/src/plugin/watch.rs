//! Watching the plugin dir (inotify): a change to a `*.wasm` file that is
//! not a dot-file, or to its signature, starts a reload pass; so does any
//! change in the allow-list's dir (a ConfigMap's files change by a swap of
//! a link beside them, not by a write to the file). Events are coalesced: a
//! pass waits for 100 ms of quiet after a write (a copy not renamed into
//! place is written in many events), but only for a moment after an event
//! that leaves a file whole (a rename into place, a close after writing, a
//! removal), at most 1 s after the first event; passes run at most once
//! per second.
//! While a removal waits for volumes to be detached, a pass also runs every
//! few seconds without events.

use super::reload::Reloader;
use notify::{EventKind, RecursiveMode, Watcher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const WINDOW: Duration = Duration::from_secs(1);
const QUIET: Duration = Duration::from_millis(100);
/// After an event that leaves a file whole: time for the rest of a batch
/// (a signature renamed in beside its policy) to arrive.
const SETTLED: Duration = Duration::from_millis(5);

/// What an event says of the file it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// Being written: more may come.
    Writing,
    /// Whole: renamed into place, closed after writing, or removed (or
    /// a pass asked for by something else than the dir).
    Settled,
}

impl Change {
    fn of(kind: &EventKind) -> Change {
        use notify::event::{AccessKind, AccessMode, ModifyKind};
        match kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Modify(ModifyKind::Name(_))
            | EventKind::Remove(_) => Change::Settled,
            _ => Change::Writing,
        }
    }
}
const REMOVAL_RECHECK: Duration = Duration::from_secs(2);

/// What a pass is started for: the plugin dir's policies and signatures,
/// and the allow-list — its own file, or the `..data` link a ConfigMap
/// volume swaps to change its files (nothing else in the list's dir, which
/// may be a busy one).
#[derive(Debug, Clone)]
struct Relevant {
    plugin_dir: PathBuf,
    list: Option<PathBuf>,
}

/// The link a ConfigMap or Secret volume swaps to change its files.
const CONFIGMAP_DATA: &str = "..data";

impl Relevant {
    /// What `event` says, when it concerns a pass: reads do not, a close
    /// after writing does.
    fn relevant(&self, event: &notify::Event) -> Option<Change> {
        use notify::event::{AccessKind, AccessMode};
        let read = matches!(event.kind, EventKind::Access(_))
            && !matches!(event.kind, EventKind::Access(AccessKind::Close(AccessMode::Write)));
        (!read && event.paths.iter().any(|p| self.path(p))).then(|| Change::of(&event.kind))
    }

    fn path(&self, p: &Path) -> bool {
        if let Some(list) = &self.list
            && (p == list || p.parent() == list.parent() && p.ends_with(CONFIGMAP_DATA))
        {
            return true;
        }
        p.parent() == Some(&self.plugin_dir)
            && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                !n.starts_with('.')
                    && (n.ends_with(".wasm")
                        || n.strip_suffix(super::trust::SIGNATURE)
                            .is_some_and(|w| w.ends_with(".wasm")))
            })
    }
}

/// The plugin dir's inotify watch, started before the first pass so that no
/// change made after that pass begins can be missed.
pub struct DirWatch {
    _watcher: notify::RecommendedWatcher,
    tx: tokio::sync::mpsc::UnboundedSender<Change>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Change>,
}

/// Starts a pass as a whole file's change in the dir would.
#[derive(Clone)]
pub struct Poke(tokio::sync::mpsc::UnboundedSender<Change>);

impl Poke {
    pub fn send(&self) {
        let _ = self.0.send(Change::Settled);
    }
}

impl DirWatch {
    /// Watch `dir`, and the dir of the allow-list `list` when there is one.
    pub fn start(dir: &Path, list: Option<&Path>) -> anyhow::Result<DirWatch> {
        use anyhow::Context;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        // Events name paths as the watch was given them: absolute, both.
        let dir = std::path::absolute(dir).with_context(|| format!("{}", dir.display()))?;
        let list = list.and_then(|l| std::path::absolute(l).ok());
        let relevant = Relevant { plugin_dir: dir.clone(), list: list.clone() };
        let poke = tx.clone();
        let mut watcher =
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
                Ok(e) => {
                    if let Some(change) = relevant.relevant(&e) {
                        let _ = tx.send(change);
                    }
                }
                Err(e) => tracing::error!("plugin dir watch: {e}"),
            })
            .context("inotify watch of the plugin dir")?;
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .with_context(|| format!("watching {}", dir.display()))?;
        if let Some(list) = &list
            && let Some(list_dir) = list.parent().filter(|d| *d != dir)
        {
            // Not being able to watch the list loses its changes until the
            // next change in the plugin dir, not the plugin dir's watch.
            if let Err(e) = watcher.watch(list_dir, RecursiveMode::NonRecursive) {
                tracing::warn!(list = %list.display(), "the allow-list's dir cannot be watched ({e}): a change to the list counts from the next change in the plugin dir");
            }
        }
        tracing::info!(dir = %dir.display(), "watching the plugin dir for backends added, updated and removed");
        Ok(DirWatch { _watcher: watcher, tx: poke, rx })
    }

    /// Starts a pass as a change in the dir would (what is trusted changed
    /// elsewhere).
    pub fn poke(&self) -> Poke {
        Poke(self.tx.clone())
    }
}

/// Reload on the watch's events until cancelled.
pub async fn run(watch: DirWatch, reloader: Reloader) -> anyhow::Result<()> {
    let DirWatch { _watcher, tx: _, mut rx } = watch;
    let reloader = Arc::new(Mutex::new(reloader));
    let mut last_pass = Instant::now() - WINDOW;
    loop {
        let pending = reloader.lock().unwrap_or_else(|p| p.into_inner()).removal_pending();
        let event = if pending {
            tokio::time::timeout(REMOVAL_RECHECK, rx.recv()).await.ok()
        } else {
            Some(rx.recv().await)
        };
        if event == Some(None) {
            anyhow::bail!("the plugin dir watch stopped");
        }
        if let Some(Some(mut last)) = event {
            // Coalesce: until quiet (after a write) or a moment after the
            // last event left its file whole, or the window after the
            // first event ends.
            let first = Instant::now();
            loop {
                let wait = if last == Change::Writing { QUIET } else { SETTLED };
                let left = (first + WINDOW).saturating_duration_since(Instant::now());
                match tokio::time::timeout(wait.min(left), rx.recv()).await {
                    Ok(Some(change)) => last = change,
                    _ => break,
                }
            }
        }
        tokio::time::sleep_until(last_pass + WINDOW).await;
        while rx.try_recv().is_ok() {}
        let r = reloader.clone();
        let report =
            tokio::task::spawn_blocking(move || r.lock().unwrap_or_else(|p| p.into_inner()).pass())
                .await;
        last_pass = Instant::now();
        match report {
            Ok(report) => tracing::debug!(?report, "plugin dir pass"),
            Err(e) => tracing::error!("plugin dir pass failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_starts_for_policies_signatures_and_the_list_only() {
        let r = Relevant { plugin_dir: "/p".into(), list: Some("/e/trusted".into()) };
        for (path, wanted) in [
            ("/p/a.wasm", true),
            ("/p/a.candidate.wasm.minisig", true),
            ("/p/.a.wasm", false),
            ("/p/a.scenarios.yaml", false),
            ("/p/sub/a.wasm", false),
            ("/e/trusted", true),
            ("/e/..data", true),
            ("/e/ledger.redb", false),
            ("/e/other.wasm", false),
        ] {
            assert_eq!(r.path(Path::new(path)), wanted, "{path}");
        }
    }

    #[test]
    fn a_file_left_whole_starts_a_pass_at_once_and_one_written_after_quiet() {
        use notify::event::*;
        let r = Relevant { plugin_dir: "/p".into(), list: None };
        let event = |kind| notify::Event::new(kind).add_path("/p/a.wasm".into());
        for (kind, wanted) in [
            (EventKind::Create(CreateKind::File), Some(Change::Writing)),
            (EventKind::Modify(ModifyKind::Data(DataChange::Any)), Some(Change::Writing)),
            (EventKind::Access(AccessKind::Close(AccessMode::Write)), Some(Change::Settled)),
            (EventKind::Modify(ModifyKind::Name(RenameMode::To)), Some(Change::Settled)),
            (EventKind::Remove(RemoveKind::File), Some(Change::Settled)),
            (EventKind::Access(AccessKind::Open(AccessMode::Any)), None),
            (EventKind::Access(AccessKind::Close(AccessMode::Read)), None),
        ] {
            assert_eq!(r.relevant(&event(kind)), wanted, "{kind:?}");
        }
    }
}
