//! What the agent does with its backends' calls besides serving them: it
//! records them (`--record DIR`, switched per backend at run time), and it
//! runs each against the backend's candidate version
//! (`<backend>.candidate.wasm`, the shadow) to count where the two differ.
//!
//! Both run on threads of their own, fed through bounded queues after the
//! call's own answer is taken: a slow disk or a candidate that loops delays
//! nothing a kubelet waits for; what a full queue cannot take is counted
//! and dropped. The shadow answers the candidate's queries from the
//! serving call's own answers (what the node said then), so the two are
//! compared on the same facts, and nothing the candidate answers is run.

use crate::policy::Plugin;
use crate::policy::differences::{self, Kind};
use crate::policy::recorded::{Decided, Tap};
use crate::socket::protocol::{ShadowExample, ShadowReport};
use crate::sys::recordings::RecordingStore;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Calls waiting for the recorder, and for the shadow.
const QUEUE: usize = 256;
/// Latest differences kept per backend for the status.
const EXAMPLES: usize = 8;
/// At most one Event per candidate and kind of difference this often.
const EVENT_EVERY: Duration = Duration::from_secs(300);

/// Where recordings go and how much is kept.
#[derive(Debug, Clone)]
pub struct RecordConfig {
    pub dir: PathBuf,
    /// Backends recorded from the start; empty: every backend.
    pub backends: Vec<String>,
    pub max_files: usize,
    pub max_bytes: u64,
}

/// Where the shadow's differences are told as Events.
#[derive(Clone)]
pub struct EventTarget {
    pub cluster: crate::kube::cluster::Cluster,
    pub pod: super::install::PodIdentity,
    pub rt: tokio::runtime::Handle,
}

/// One backend's switches: read on every call of it.
pub struct BackendTap {
    backend: String,
    recording: AtomicBool,
    shadowing: AtomicBool,
    observer: Arc<Shared>,
}

impl Tap for BackendTap {
    fn wants(&self) -> bool {
        self.recording.load(Ordering::Relaxed) || self.shadowing.load(Ordering::Relaxed)
    }

    fn seen(&self, decided: Decided) {
        let decided = Arc::new(decided);
        let o = &self.observer;
        if self.recording.load(Ordering::Relaxed)
            && let Some(tx) = &o.record_tx
            && let Err(e) = tx.try_send(decided.clone())
        {
            crate::metrics::get().recordings_dropped(&self.backend);
            if matches!(e, TrySendError::Disconnected(_))
                && !o.record_gone.swap(true, Ordering::Relaxed)
            {
                tracing::error!(
                    "the recorder's thread is gone: policy calls are not recorded any more"
                );
            }
        }
        if self.shadowing.load(Ordering::Relaxed)
            && let Err(e) = o.shadow_tx.try_send(decided)
        {
            crate::metrics::get().shadow_skipped(&self.backend);
            o.shadow_state(&self.backend, |s| s.skipped += 1);
            if matches!(e, TrySendError::Disconnected(_))
                && !o.shadow_gone.swap(true, Ordering::Relaxed)
            {
                tracing::error!("the shadow's thread is gone: candidates are not called any more");
            }
        }
    }
}

/// What the shadow saw of one backend's candidate.
#[derive(Default)]
struct ShadowState {
    candidate: Option<Arc<Plugin>>,
    file: String,
    sha256: String,
    version: String,
    compared: u64,
    skipped: u64,
    differences: BTreeMap<Kind, u64>,
    examples: VecDeque<ShadowExample>,
    /// When an Event last went out, per kind.
    told: BTreeMap<Kind, Instant>,
}

struct Shared {
    record_tx: Option<SyncSender<Arc<Decided>>>,
    /// Said once: the recorder's or the shadow's thread ended.
    record_gone: AtomicBool,
    shadow_gone: AtomicBool,
    shadow_tx: SyncSender<Arc<Decided>>,
    shadows: Mutex<BTreeMap<String, ShadowState>>,
    board: Arc<crate::socket::status::Board>,
    events: Option<EventTarget>,
}

impl Shared {
    fn candidate(&self, backend: &str) -> Option<Arc<Plugin>> {
        let all = self.shadows.lock().unwrap_or_else(|p| p.into_inner());
        all.get(backend).and_then(|s| s.candidate.clone())
    }

    fn shadow_state(&self, backend: &str, f: impl FnOnce(&mut ShadowState)) {
        let mut all = self.shadows.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = all.get_mut(backend) {
            f(s);
        }
    }

    fn publish(&self) {
        let all = self.shadows.lock().unwrap_or_else(|p| p.into_inner());
        let reports = all
            .iter()
            .map(|(backend, s)| ShadowReport {
                backend: backend.clone(),
                file: s.file.clone(),
                sha256: s.sha256.clone(),
                version: s.version.clone(),
                compared: s.compared,
                skipped: s.skipped,
                differences: s
                    .differences
                    .iter()
                    .map(|(k, n)| (k.name().to_string(), *n))
                    .collect(),
                examples: s.examples.iter().cloned().collect(),
            })
            .collect();
        self.board.set_shadows(reports);
    }
}

/// The agent's recorder and shadow, and each backend's tap.
pub struct Observer {
    shared: Arc<Shared>,
    taps: Mutex<BTreeMap<String, Arc<BackendTap>>>,
    /// Backends recorded when their tap is made; None: not recording.
    record: Option<Vec<String>>,
}

impl Observer {
    /// Start the shadow's thread, and the recorder's when `record` is set.
    pub fn start(
        record: Option<RecordConfig>,
        board: Arc<crate::socket::status::Board>,
        events: Option<EventTarget>,
    ) -> anyhow::Result<Arc<Observer>> {
        use anyhow::Context;
        let (record_tx, store) = match &record {
            Some(config) => {
                let store = RecordingStore::open(&config.dir, config.max_files, config.max_bytes)
                    .with_context(|| format!("recording dir {}", config.dir.display()))?;
                let (tx, rx) = sync_channel(QUEUE);
                (Some(tx), Some((store, rx)))
            }
            None => (None, None),
        };
        let (shadow_tx, shadow_rx) = sync_channel(QUEUE);
        let shared = Arc::new(Shared {
            record_tx,
            record_gone: AtomicBool::new(false),
            shadow_gone: AtomicBool::new(false),
            shadow_tx,
            shadows: Mutex::default(),
            board,
            events,
        });
        if let Some((store, rx)) = store {
            let (files, bytes) = store.usage();
            tracing::info!(dir = %store.dir().display(), files, bytes, "recording policy calls");
            std::thread::Builder::new()
                .name("volagent-record".into())
                .spawn(move || record_loop(store, rx))
                .context("starting the recorder's thread")?;
        }
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("volagent-shadow".into())
            .spawn(move || shadow_loop(weak, shadow_rx))
            .context("starting the shadow's thread")?;
        let record = record.map(|c| c.backends);
        Ok(Arc::new(Observer { shared, taps: Mutex::default(), record }))
    }

    /// `backend`'s tap (made on first use): what its served versions are
    /// given ([`Plugin::set_tap`]).
    pub fn tap(&self, backend: &str) -> Arc<BackendTap> {
        let mut taps = self.taps.lock().unwrap_or_else(|p| p.into_inner());
        taps.entry(backend.to_string())
            .or_insert_with(|| {
                let recording = self
                    .record
                    .as_ref()
                    .is_some_and(|b| b.is_empty() || b.iter().any(|n| n == backend));
                Arc::new(BackendTap {
                    backend: backend.to_string(),
                    recording: AtomicBool::new(recording),
                    shadowing: AtomicBool::new(false),
                    observer: self.shared.clone(),
                })
            })
            .clone()
    }

    /// Run `candidate` in the shadow of its backend from now on (None:
    /// stop); the counts start again with each new candidate.
    pub fn set_shadow(&self, backend: &str, candidate: Option<Arc<Plugin>>) {
        let tap = self.tap(backend);
        {
            let mut all = self.shared.shadows.lock().unwrap_or_else(|p| p.into_inner());
            match &candidate {
                Some(c) => {
                    all.insert(
                        backend.to_string(),
                        ShadowState {
                            candidate: Some(c.clone()),
                            file: c.path().display().to_string(),
                            sha256: c.sha256().to_string(),
                            version: c.info().version.clone(),
                            ..ShadowState::default()
                        },
                    );
                }
                None => {
                    all.remove(backend);
                }
            }
        }
        tap.shadowing.store(candidate.is_some(), Ordering::Relaxed);
        self.shared.publish();
    }

    /// The candidate in `backend`'s shadow, if any.
    pub fn shadow_of(&self, backend: &str) -> Option<Arc<Plugin>> {
        self.shared.candidate(backend)
    }

    /// Record `backend`'s calls from now on, or not: a backend this agent
    /// has served.
    pub fn set_recording(&self, backend: &str, on: bool) -> Result<String, String> {
        if self.shared.record_tx.is_none() {
            return Err("this agent does not record: start it with --record DIR".into());
        }
        let tap = self.taps.lock().unwrap_or_else(|p| p.into_inner()).get(backend).cloned();
        let Some(tap) = tap else {
            return Err(format!("backend {backend:?} is not served by this agent"));
        };
        tap.recording.store(on, Ordering::Relaxed);
        tracing::info!(backend, on, "recording switched");
        Ok(format!("recording of backend {backend}: {}", if on { "on" } else { "off" }))
    }

    /// The backends whose calls are recorded now.
    pub fn recording(&self) -> Vec<String> {
        let taps = self.taps.lock().unwrap_or_else(|p| p.into_inner());
        taps.values()
            .filter(|t| t.recording.load(Ordering::Relaxed))
            .map(|t| t.backend.clone())
            .collect()
    }
}

impl crate::socket::status::RecordingSwitch for Observer {
    fn set(&self, backend: &str, on: bool) -> Result<String, String> {
        self.set_recording(backend, on)
    }
    fn recorded(&self) -> Vec<String> {
        self.recording()
    }
}

/// `20261129T010203.123456Z`: sorts as time does.
fn stamp(at: std::time::SystemTime) -> String {
    let text = humantime::format_rfc3339_micros(at).to_string();
    text.chars().filter(|c| !matches!(c, '-' | ':')).collect()
}

fn record_loop(mut store: RecordingStore, rx: Receiver<Arc<Decided>>) {
    crate::sys::yield_cpu();
    while let Ok(decided) = rx.recv() {
        // A call that failed on the host's side says nothing of the
        // policy, and its answers cannot replay it.
        if decided.answered.host_failed {
            continue;
        }
        // A host bug must not end the recording: one call is lost instead.
        let bytes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            serde_json::to_vec_pretty(&decided.scenario_file())
        }));
        let bytes = match bytes {
            // A recording must load as a scenario file.
            Ok(Ok(b)) if b.len() as u64 <= crate::policy::scenario::MAX_SCENARIO_BYTES => b,
            Ok(Ok(b)) => {
                crate::metrics::get().recordings_dropped(&decided.backend);
                tracing::warn!(
                    backend = &*decided.backend,
                    bytes = b.len(),
                    "recording not written: over the scenario file limit"
                );
                continue;
            }
            Ok(Err(e)) => {
                tracing::error!(backend = &*decided.backend, "recording not written: {e}");
                continue;
            }
            Err(_) => {
                tracing::error!(backend = &*decided.backend, "recording not written: it panicked");
                continue;
            }
        };
        let written =
            store.write(&decided.backend, &stamp(decided.at), decided.input.function(), &bytes);
        match written {
            Ok(_) => crate::metrics::get().recorded(&decided.backend),
            Err(e) => {
                crate::metrics::get().recordings_dropped(&decided.backend);
                tracing::warn!(backend = &*decided.backend, "recording not written: {e}");
            }
        }
    }
}

fn shadow_loop(shared: std::sync::Weak<Shared>, rx: Receiver<Arc<Decided>>) {
    // Nothing waits for the shadow: its calls get the CPUs no serving call
    // wants (on two cores, at full speed, it made serving calls 1.7 times
    // slower).
    crate::sys::yield_cpu();
    while let Ok(decided) = rx.recv() {
        let Some(shared) = shared.upgrade() else { return };
        if decided.answered.host_failed {
            continue;
        }
        // A host bug must not end the shadow: one call is lost instead.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compare(&shared, &decided)))
            .is_err()
        {
            tracing::error!(
                backend = &*decided.backend,
                "a call in the shadow panicked; it is not counted"
            );
        }
    }
}

/// Run one call on the candidate and count how it differs.
fn compare(shared: &Shared, decided: &Decided) {
    let Some(candidate) = shared.candidate(&decided.backend) else { return };
    let queries = Arc::new(crate::policy::queries::ReplayQueries(decided.host.clone()));
    let shadow = decided.input.answer(&candidate, queries);
    if shadow.host_failed {
        // No instance for it (the pool full): nothing learnt of it.
        crate::metrics::get().shadow_skipped(&decided.backend);
        shared.shadow_state(&decided.backend, |s| s.skipped += 1);
        return;
    }
    let difference =
        differences::classify(&decided.answered.answer.to_value(), &shadow.answer.to_value());
    let backend = &*decided.backend;
    let mut tell = None;
    let mut counted = false;
    shared.shadow_state(backend, |s| {
        if s.sha256 != candidate.sha256() {
            return; // replaced meanwhile
        }
        counted = true;
        s.compared += 1;
        let Some(d) = &difference else { return };
        *s.differences.entry(d.kind).or_default() += 1;
        if s.examples.len() == EXAMPLES {
            s.examples.pop_front();
        }
        s.examples.push_back(ShadowExample {
            kind: d.kind.name().to_string(),
            call: decided.input.summary(),
            at: humantime::format_rfc3339_seconds(decided.at).to_string(),
            serving: d.before.clone(),
            candidate: d.after.clone(),
        });
        let due = s.told.get(&d.kind).is_none_or(|t| t.elapsed() >= EVENT_EVERY);
        if due {
            s.told.insert(d.kind, Instant::now());
            tell = Some(format!(
                "candidate {} (version {}, sha256 {}) differs from the serving {} {} on {}: {} ({} so far): serving {}, candidate {}",
                s.file,
                s.version,
                s.sha256,
                backend,
                decided.version,
                decided.input.summary(),
                d.kind,
                s.differences[&d.kind],
                d.before,
                d.after
            ));
        }
    });
    if !counted {
        return;
    }
    crate::metrics::get().shadow_compared(backend);
    if let Some(d) = &difference {
        crate::metrics::get().shadow_difference(backend, d.kind.name());
        tracing::warn!(backend, kind = %d.kind, call = %decided.input.summary(), serving = %d.before, candidate = %d.after, "the candidate policy differs from the serving one");
    }
    shared.publish();
    if let (Some(message), Some(events)) = (tell, &shared.events) {
        let events = events.clone();
        events.rt.spawn(async move {
            let pod = &events.pod;
            events
                .cluster
                .pod_event(
                    &pod.pod_namespace,
                    &pod.pod_name,
                    &pod.pod_uid,
                    true,
                    "PolicyShadowDifference",
                    &message,
                )
                .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{AccessMode, Consumer, KeyValue, NodePaths, PathKind, Volume};
    use crate::policy::{Limits, RecordedQueries, Runtime, scenario};
    use std::path::Path;

    fn volume(name: &str, mode: AccessMode) -> Volume {
        Volume {
            name: name.into(),
            backend: "local-pv".into(),
            access_mode: mode,
            fs_type: "ext4".into(),
            mode: Default::default(),
            mount_flags: vec![],
            options: vec![
                KeyValue { key: "path".into(), value: "/mnt/disks/a.img".into() },
                KeyValue { key: "node".into(), value: "node-a".into() },
            ],
            secret_keys: vec!["password".into()],
        }
    }

    fn consumer(pod: &str) -> Consumer {
        Consumer {
            node: "node-a".into(),
            pod_namespace: "default".into(),
            pod: pod.into(),
            pod_uid: format!("uid-{pod}"),
            mount_dir: format!("/var/lib/kubelet/pods/uid-{pod}/volumes/v"),
            read_only: false,
            mount_group: None,
        }
    }

    fn reader(pod: &str) -> Consumer {
        Consumer { read_only: true, ..consumer(pod) }
    }

    fn paths() -> NodePaths {
        NodePaths {
            kubelet_root: "/var/lib/kubelet".into(),
            staging_dir: "/var/lib/kubelet/plugins/volagent/local-pv/mounts/v".into(),
            state_dir: "/var/lib/volagent/local-pv".into(),
            discovery_dirs: vec!["/mnt/disks".into()],
        }
    }

    fn node() -> Arc<RecordedQueries> {
        let mut q = RecordedQueries::default();
        q.paths.insert("/mnt/disks/a.img".into(), PathKind::RegularFile);
        Arc::new(q)
    }

    fn load(rt: &Arc<Runtime>, path: &str, candidate: bool) -> Arc<Plugin> {
        let bytes = std::fs::read(path).unwrap();
        let plugin = if candidate {
            Plugin::load_candidate(rt, Path::new(path), &bytes)
        } else {
            Plugin::load_bytes(rt, Path::new(path), &bytes)
        };
        Arc::new(plugin.unwrap())
    }

    fn shadow(board: &crate::socket::status::Board) -> ShadowReport {
        board.shadows_now().into_iter().next().expect("a shadow is reported")
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(20), "waited in vain for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn each_call_is_recorded_as_a_scenario_that_replays_to_the_same_outcome() {
        let rt = Runtime::new(Limits::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let board = Arc::new(crate::socket::status::Board::default());
        let record = RecordConfig {
            dir: dir.path().join("rec"),
            backends: vec![],
            max_files: 100,
            max_bytes: 1 << 20,
        };
        let observer = Observer::start(Some(record), board, None).unwrap();
        let serving = load(&rt, volagent_test_artifacts::LOCAL_PV, false);
        assert!(serving.set_tap(observer.tap("local-pv")));
        let v = volume("pv-1", AccessMode::ReadWriteOnce);
        assert!(serving.fence(node(), &v, &consumer("p1"), &[], &[]).is_ok());
        assert!(serving.attach(node(), &v, &consumer("p1"), &[], &paths()).is_ok());
        let dir = dir.path().join("rec/local-pv");
        let done = || scenario::files(&dir).is_ok_and(|f| f.len() == 2);
        wait_for("two recordings", done);
        let mut files = scenario::files(&dir).unwrap();
        files.sort();
        // Replayed on a version no tap sees (the tapped one would record
        // its replays too).
        let untapped = load(&rt, volagent_test_artifacts::LOCAL_PV, false);
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            assert!(text.contains("\"password\""), "the key's name is recorded: {text}");
            // Each file is a scenario the policy passes as recorded.
            let outcomes = scenario::run_file(&untapped, f).unwrap();
            assert_eq!(outcomes.len(), 1);
            assert!(outcomes[0].failure.is_none(), "{:?}", outcomes[0].failure);
        }
        // The attach asked where the file is: the answer was kept.
        let attach = std::fs::read_to_string(&files[1]).unwrap();
        assert!(attach.contains("\"/mnt/disks/a.img\": \"RegularFile\""), "{attach}");
        // Switched off, nothing more is written.
        observer.set_recording("local-pv", false).unwrap();
        assert!(serving.fence(node(), &v, &consumer("p1"), &[], &[]).is_ok());
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(scenario::files(&dir).unwrap().len(), 2);
    }

    #[test]
    fn a_candidate_that_denies_is_counted_and_one_that_loops_or_hogs_delays_nothing() {
        let rt = Runtime::new(Limits::default()).unwrap();
        let board = Arc::new(crate::socket::status::Board::default());
        let observer = Observer::start(None, board.clone(), None).unwrap();
        let serving = load(&rt, volagent_test_artifacts::LOCAL_PV, false);
        serving.set_tap(observer.tap("local-pv"));

        // Not tapped while nothing is in the shadow: no call is seen.
        assert!(!observer.tap("local-pv").wants());
        let strict = load(&rt, volagent_test_artifacts::LOCAL_PV_STRICT, true);
        observer.set_shadow("local-pv", Some(strict.clone()));
        let rox = volume("pv-rox", AccessMode::ReadOnlyMany);
        let rwo = volume("pv-rwo", AccessMode::ReadWriteOnce);
        assert_eq!(
            serving.fence(node(), &rox, &reader("p1"), &[], &[]).unwrap(),
            crate::model::Decision::Grant,
            "the serving answer is what the call gets"
        );
        serving.fence(node(), &rwo, &consumer("p1"), &[], &[]).unwrap();
        wait_for("two calls compared", || shadow(&board).compared == 2);
        let report = shadow(&board);
        assert_eq!(report.sha256, strict.sha256());
        assert_eq!(report.differences.get("became-refused"), Some(&1), "{report:?}");
        assert_eq!(report.differences.len(), 1, "{report:?}");
        let example = &report.examples[0];
        assert!(example.call.starts_with("fence pv-rox for default/p1 on node-a"), "{example:?}");
        assert!(example.candidate.contains("refuses ReadOnlyMany"), "{example:?}");
        let text = crate::metrics::get().encode();
        assert!(
            text.contains(r#"volagent_policy_shadow_differences_total{backend="local-pv",kind="became-refused"} 1"#),
            "{text}"
        );

        // A candidate that loops (misbehave's `spin`) or grows without bound
        // (`hog`) is stopped in its own thread: the serving calls answer
        // at once, and the faults are counted.
        let misbehave = load(&rt, volagent_test_artifacts::MISBEHAVE, true);
        observer.set_shadow("local-pv", Some(misbehave));
        for name in ["spin", "hog"] {
            let start = Instant::now();
            let d = serving.fence(
                node(),
                &volume(name, AccessMode::ReadWriteOnce),
                &consumer("p1"),
                &[],
                &[],
            );
            assert!(d.is_ok());
            assert!(
                start.elapsed() < Duration::from_millis(400),
                "the serving call waited for the shadow: {:?}",
                start.elapsed()
            );
        }
        wait_for("both faults compared", || shadow(&board).compared == 2);
        assert_eq!(shadow(&board).differences.get("fault"), Some(&2), "{:?}", shadow(&board));
        // Ended: not tapped any more.
        observer.set_shadow("local-pv", None);
        assert!(board.shadows_now().is_empty());
        assert!(!observer.tap("local-pv").wants());
    }
}
