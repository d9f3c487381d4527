//! Watching the plugin dir (inotify): a change to a `*.wasm` file that is
//! not a dot-file, or to its signature, starts a reload pass; so does any
//! change in the allow-list's dir (a ConfigMap's files change by a swap of
//! a link beside them, not by a write to the file). Events are coalesced:
//! while a file is being written (a copy not renamed into place is written
//! in many events) or was removed or renamed away (a replacement may
//! follow), a pass waits for 100 ms of quiet; once every such file is whole
//! again (renamed into place, closed after writing), only for a moment;
//! at most 1 s after the first event. Passes run at most once per second.
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
/// Once no file is being written: time for the rest of a batch (a
/// signature renamed in beside its policy) to arrive.
const SETTLED: Duration = Duration::from_millis(20);
const REMOVAL_RECHECK: Duration = Duration::from_secs(2);

/// What an event says of the files it names (those a pass is for).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Seen {
    /// Being written, or gone (removed, renamed away): more may come.
    unsettled: Vec<PathBuf>,
    /// Whole: renamed into place, or closed after writing.
    whole: Vec<PathBuf>,
}

/// The files a coming pass waits for.
#[derive(Default)]
struct Unsettled(std::collections::HashSet<PathBuf>);

impl Unsettled {
    fn note(&mut self, seen: Seen) {
        self.0.extend(seen.unsettled);
        for p in &seen.whole {
            self.0.remove(p);
        }
    }

    /// How long to wait for a next event before the pass.
    fn wait(&self) -> Duration {
        if self.0.is_empty() { SETTLED } else { QUIET }
    }
}

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
    /// What `event` says of the files a pass is for, when it names any:
    /// reads say nothing, a close after writing does.
    fn relevant(&self, event: &notify::Event) -> Option<Seen> {
        use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
        let ours = |p: &&PathBuf| self.path(p);
        let mut seen = Seen::default();
        match event.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {
                seen.whole.extend(event.paths.iter().filter(ours).cloned());
            }
            // From, then to.
            EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
                seen.unsettled.extend(event.paths.first().filter(ours).cloned());
                seen.whole.extend(event.paths.get(1).filter(ours).cloned());
            }
            EventKind::Access(_) => {}
            _ => seen.unsettled.extend(event.paths.iter().filter(ours).cloned()),
        }
        (seen != Seen::default()).then_some(seen)
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
    tx: tokio::sync::mpsc::UnboundedSender<Seen>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Seen>,
}

/// Starts a pass as a whole file's change in the dir would.
#[derive(Clone)]
pub struct Poke(tokio::sync::mpsc::UnboundedSender<Seen>);

impl Poke {
    pub fn send(&self) {
        let _ = self.0.send(Seen::default());
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
                    if let Some(seen) = relevant.relevant(&e) {
                        let _ = tx.send(seen);
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
        let mut unsettled = Unsettled::default();
        if let Some(Some(seen)) = event {
            unsettled.note(seen);
            settle(&mut rx, &mut unsettled).await;
        }
        tokio::time::sleep_until(last_pass + WINDOW).await;
        // What came meanwhile: a write begun since is waited for too.
        let mut more = false;
        while let Ok(seen) = rx.try_recv() {
            unsettled.note(seen);
            more = true;
        }
        if more {
            settle(&mut rx, &mut unsettled).await;
        }
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

/// Coalesce: until quiet while a file is unsettled, a moment once none
/// is, or the window ends.
async fn settle(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Seen>, unsettled: &mut Unsettled) {
    let first = Instant::now();
    loop {
        let left = (first + WINDOW).saturating_duration_since(Instant::now());
        match tokio::time::timeout(unsettled.wait().min(left), rx.recv()).await {
            Ok(Some(seen)) => unsettled.note(seen),
            _ => return,
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
    fn a_pass_waits_for_quiet_until_every_file_written_or_gone_is_whole() {
        use notify::event::*;
        let r = Relevant { plugin_dir: "/p".into(), list: None };
        let a = PathBuf::from("/p/a.wasm");
        let b = PathBuf::from("/p/b.wasm");
        let on = |kind, paths: &[&str]| {
            paths.iter().fold(notify::Event::new(kind), |e, p| e.add_path(p.into()))
        };
        let seen = |kind, paths: &[&str]| r.relevant(&on(kind, paths));
        let unsettled = |p: &PathBuf| Some(Seen { unsettled: vec![p.clone()], whole: vec![] });
        let whole = |p: &PathBuf| Some(Seen { unsettled: vec![], whole: vec![p.clone()] });
        for kind in [
            EventKind::Create(CreateKind::File),
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            EventKind::Remove(RemoveKind::File),
            EventKind::Modify(ModifyKind::Name(RenameMode::From)),
        ] {
            assert_eq!(seen(kind, &["/p/a.wasm"]), unsettled(&a), "{kind:?}");
        }
        for kind in [
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
        ] {
            assert_eq!(seen(kind, &["/p/a.wasm"]), whole(&a), "{kind:?}");
        }
        let both = EventKind::Modify(ModifyKind::Name(RenameMode::Both));
        assert_eq!(seen(both, &["/p/.a.wasm", "/p/a.wasm"]), whole(&a), "renamed into place");
        assert_eq!(seen(both, &["/p/a.wasm", "/p/a.bak"]), unsettled(&a), "renamed away");
        for kind in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
        ] {
            assert_eq!(seen(kind, &["/p/a.wasm"]), None, "{kind:?}");
        }
        assert_eq!(seen(EventKind::Create(CreateKind::File), &["/p/.a.wasm"]), None);

        // b still written when a is whole: quiet is waited for.
        let mut u = Unsettled::default();
        for s in [unsettled(&a), unsettled(&b), whole(&a)] {
            u.note(s.expect("relevant"));
        }
        assert_eq!(u.wait(), QUIET);
        u.note(whole(&b).expect("relevant"));
        assert_eq!(u.wait(), SETTLED);
        u.note(Seen::default()); // a poke
        assert_eq!(u.wait(), SETTLED);
    }
}
