//! Watching the plugin dir (inotify): a change to a `*.wasm` file that is
//! not a dot-file starts a reload pass. Events are coalesced: a pass waits
//! for 100 ms of quiet (an unrenamed copy is written in many events), at
//! most 1 s after the first event, and passes run at most once per second.
//! While a removal waits for volumes to be detached, a pass also runs every
//! few seconds without events.

use super::reload::Reloader;
use notify::{EventKind, RecursiveMode, Watcher};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const WINDOW: Duration = Duration::from_secs(1);
const QUIET: Duration = Duration::from_millis(100);
const REMOVAL_RECHECK: Duration = Duration::from_secs(2);

fn relevant(event: &notify::Event) -> bool {
    !matches!(event.kind, EventKind::Access(_))
        && event.paths.iter().any(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.') && n.ends_with(".wasm"))
        })
}

/// The plugin dir's inotify watch, started before the first pass so that no
/// change made after that pass begins can be missed.
pub struct DirWatch {
    _watcher: notify::RecommendedWatcher,
    rx: tokio::sync::mpsc::UnboundedReceiver<()>,
}

impl DirWatch {
    pub fn start(dir: &std::path::Path) -> anyhow::Result<DirWatch> {
        use anyhow::Context;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut watcher =
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
                Ok(e) if relevant(&e) => {
                    let _ = tx.send(());
                }
                Ok(_) => {}
                Err(e) => tracing::error!("plugin dir watch: {e}"),
            })
            .context("inotify watch of the plugin dir")?;
        watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .with_context(|| format!("watching {}", dir.display()))?;
        tracing::info!(dir = %dir.display(), "watching the plugin dir for backends added, updated and removed");
        Ok(DirWatch { _watcher: watcher, rx })
    }
}

/// Reload on the watch's events until cancelled.
pub async fn run(watch: DirWatch, reloader: Reloader) -> anyhow::Result<()> {
    let DirWatch { _watcher, mut rx } = watch;
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
        if event.is_some() {
            // Coalesce: until quiet, or the window after the first event ends.
            let first = Instant::now();
            while let Ok(Some(())) = tokio::time::timeout(
                QUIET.min((first + WINDOW).saturating_duration_since(Instant::now())),
                rx.recv(),
            )
            .await
            {}
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
