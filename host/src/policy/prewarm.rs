//! Instances made before their calls. A call still gets a store and an
//! instance of its own, used once and then dropped; but making one (a pool
//! slot, the start functions, a fresh WASI context) and dropping it (the
//! slot's memory rewritten) cost more than most calls themselves, on the
//! path of every mount. So a thread of the runtime, the prewarmer, makes a
//! backend's next instances while nothing waits on them and drops the used
//! ones; a call takes one that is ready, or makes its own when none is.
//!
//! An instance made ahead ran its start functions with no queries to ask
//! and under a deadline of its own; the call gives it the call's queries
//! and deadline. A backend whose instance cannot be made ahead (a start
//! function that traps, loops or grows past the memory cap) gets none
//! again: its calls make their own, and fail as they would have.

use super::contract::{Guest, Linked};
use super::imports::CallState;
use super::limits::Limits;
use super::queries::{Queries, RecordedQueries};
use super::ticker::TickerHandle;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use wasmtime::{Engine, Store};

/// Instances ready per backend by default ([`Limits::instances_ahead`]):
/// enough for a stage's fence and attach plan, made in one go after the
/// previous stage.
#[cfg(test)]
const READY: usize = 2;

/// Instances made ahead, of all backends together, at most. They take
/// slots of the pool, which calls get back when they find it full
/// ([`super::Runtime::release_spares`]).
const BUDGET: u32 = 16;

/// Instances made ahead and not yet taken, of all backends.
#[derive(Default)]
struct Budget(std::sync::atomic::AtomicU32);

impl Budget {
    /// A place for one more, if any is left.
    fn reserve(self: &Arc<Self>) -> Option<Counted> {
        use std::sync::atomic::Ordering;
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < BUDGET).then_some(n + 1))
            .ok()?;
        Some(Counted(self.clone()))
    }
}

/// One instance counted in the [`Budget`] until dropped (taken by a call,
/// or dropped with its backend).
struct Counted(Arc<Budget>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// An instance and its store, not called yet.
pub(crate) struct Unused<I = Box<dyn Guest>> {
    pub store: Store<CallState>,
    pub instance: I,
}

/// Why an instance could not be made.
enum Refused {
    /// Its start functions trapped, looped or grew past the memory cap.
    Guest(wasmtime::Error),
    /// The host could not (the pool full).
    Host,
}

/// Whether a failed instantiation is the guest's doing: a trap (a start
/// function that traps or loops) or memory refused; otherwise the host's
/// (every pool slot in use).
pub(crate) fn guest_fault(store: &Store<CallState>, e: &wasmtime::Error) -> bool {
    e.downcast_ref::<wasmtime::Trap>().is_some() || store.data().memory.refused
}

/// A backend's instances made ahead.
pub(crate) struct Prewarmed {
    pre: Arc<dyn Linked>,
    name: Arc<str>,
    state: Mutex<PrewarmedState>,
    /// A refill is asked of the prewarmer and not begun yet.
    refill_asked: std::sync::atomic::AtomicBool,
    /// Never made ahead: a candidate's.
    cold: bool,
}

#[derive(Default)]
struct PrewarmedState {
    ready: Vec<(Unused, Counted)>,
    /// An instance could not be made ahead: calls make their own.
    given_up: bool,
    /// Instances calls took.
    taken: u64,
}

impl Prewarmed {
    pub(crate) fn new(pre: Arc<dyn Linked>, name: Arc<str>) -> Arc<Prewarmed> {
        Arc::new(Prewarmed {
            pre,
            name,
            state: Mutex::default(),
            refill_asked: Default::default(),
            cold: false,
        })
    }

    /// None made ahead, ever (a candidate in the shadow): its calls make
    /// their own, and never take a slot from a serving backend's.
    pub(crate) fn cold(pre: Arc<dyn Linked>, name: Arc<str>) -> Arc<Prewarmed> {
        let state = PrewarmedState { given_up: true, ..PrewarmedState::default() };
        Arc::new(Prewarmed {
            pre,
            name,
            state: Mutex::new(state),
            refill_asked: Default::default(),
            cold: true,
        })
    }

    /// Whether it is a candidate's, never made ahead (not one whose
    /// instances made ahead failed).
    pub(crate) fn is_cold(&self) -> bool {
        self.cold
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PrewarmedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ready instance, given `queries` for its call.
    pub(crate) fn take(&self, queries: &Arc<dyn Queries>, limits: &Limits) -> Option<Unused> {
        let made = {
            let mut state = self.state();
            let (made, _counted) = state.ready.pop()?;
            state.taken += 1;
            made
        };
        Some(made.for_call(queries, limits))
    }

    /// Make instances until [`Limits::instances_ahead`] wait, within the [`Budget`] (on the
    /// prewarmer's thread).
    fn refill(
        &self,
        engine: &Engine,
        limits: &Limits,
        ticker: &TickerHandle,
        budget: &Arc<Budget>,
        yields: &Yields,
    ) {
        loop {
            {
                let state = self.state();
                if state.given_up || state.ready.len() >= limits.instances_ahead {
                    return;
                }
            }
            // Instance and kept under the lock, so that a call that found the
            // pool full releases this one too, or none is made.
            let _making = yields.making();
            if yields.starved.load(std::sync::atomic::Ordering::Acquire) > 0 {
                return;
            }
            let Some(counted) = budget.reserve() else { return };
            let made = {
                let _calling = ticker.begin();
                self.make(engine, limits)
            };
            let mut state = self.state();
            match made {
                Ok(m) => state.ready.push((m, counted)),
                // The pool is full: calls need its slots more.
                Err(Refused::Host) => return,
                Err(Refused::Guest(e)) => {
                    tracing::debug!(
                        backend = &*self.name,
                        "instances are made per call from now on: one made ahead failed: {e:#}"
                    );
                    state.given_up = true;
                    return;
                }
            }
        }
    }

    /// Instances calls took so far.
    pub(crate) fn taken(&self) -> u64 {
        self.state().taken
    }

    /// Drop the instances ready.
    pub(crate) fn release(&self) {
        drop(std::mem::take(&mut self.state().ready));
    }

    fn make(&self, engine: &Engine, limits: &Limits) -> Result<Unused, Refused> {
        // No queries while it starts: a start function has nothing to ask.
        let mut store =
            new_store(engine, self.name.clone(), Arc::new(RecordedQueries::default()), limits);
        match self.pre.instantiate(&mut store) {
            Ok(instance) => Ok(Unused { store, instance }),
            Err(e) if guest_fault(&store, &e) => Err(Refused::Guest(e)),
            Err(_) => Err(Refused::Host),
        }
    }

    /// Instances ready, and instances calls took so far.
    #[cfg(test)]
    fn counts(&self) -> (usize, u64) {
        let state = self.state();
        (state.ready.len(), state.taken)
    }
}

impl<I> Unused<I> {
    fn for_call(mut self, queries: &Arc<dyn Queries>, limits: &Limits) -> Unused<I> {
        self.store.data_mut().begin_call(queries.clone());
        self.store.set_epoch_deadline(limits.deadline_ticks());
        self
    }
}

/// A fresh store for one call (or one instance made ahead), under the
/// runtime's limits: a memory cap, and a deadline counted from now.
pub(crate) fn new_store(
    engine: &Engine,
    backend: Arc<str>,
    queries: Arc<dyn Queries>,
    limits: &Limits,
) -> Store<CallState> {
    let mut store = Store::new(engine, CallState::new(backend, queries, *limits));
    store.limiter(|s| &mut s.memory);
    store.epoch_deadline_trap();
    store.set_epoch_deadline(limits.deadline_ticks());
    store
}

/// A used store, if any, to be dropped on the prewarmer's thread; then the
/// instances of a backend made up again, if asked.
struct Job {
    used: Option<Store<CallState>>,
    spares: Option<Weak<Prewarmed>>,
}

/// Used stores handed to the prewarmer and not dropped yet, at most: each
/// holds a pool slot. Past it, a call drops its store itself.
const MAX_PENDING: usize = 2;

/// How long a call that found the pool full waits for the prewarmer to drop
/// the stores it was handed.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(100);

/// How the prewarmer gives way to calls: the pool's slots are theirs first.
#[derive(Default)]
struct Yields {
    /// Calls that found the pool full and have not made their instance yet:
    /// meanwhile the prewarmer makes none.
    starved: std::sync::atomic::AtomicUsize,
    /// Held while the prewarmer makes an instance and keeps it.
    making: Mutex<()>,
}

impl Yields {
    fn making(&self) -> std::sync::MutexGuard<'_, ()> {
        self.making.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The prewarmer held off for a call that found the pool full, until dropped.
pub(crate) struct HeldOff(Arc<Yields>);

impl Drop for HeldOff {
    fn drop(&mut self) {
        self.0.starved.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The thread that drops used stores and makes backends' next instances.
pub(crate) struct Prewarmer {
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// Used stores handed over and not dropped yet.
    pending: Arc<(Mutex<usize>, std::sync::Condvar)>,
    yields: Arc<Yields>,
    thread: Option<JoinHandle<()>>,
}

impl Prewarmer {
    pub(crate) fn start(
        engine: Engine,
        limits: Limits,
        ticker: TickerHandle,
    ) -> std::io::Result<Prewarmer> {
        let (tx, rx) = mpsc::channel::<Job>();
        let pending: Arc<(Mutex<usize>, std::sync::Condvar)> = Arc::default();
        let dropped = pending.clone();
        let yields: Arc<Yields> = Arc::default();
        let gives_way = yields.clone();
        let thread =
            std::thread::Builder::new().name("volagent-guests".into()).spawn(move || {
                let budget = Arc::new(Budget::default());
                while let Ok(Job { used, spares }) = rx.recv() {
                    if let Some(store) = used {
                        drop(store);
                        let (count, settled) = &*dropped;
                        let mut n = count.lock().unwrap_or_else(|p| p.into_inner());
                        *n = n.saturating_sub(1);
                        settled.notify_all();
                    }
                    if let Some(spares) = spares.and_then(|s| s.upgrade()) {
                        spares.refill_asked.store(false, std::sync::atomic::Ordering::Release);
                        spares.refill(&engine, &limits, &ticker, &budget, &gives_way);
                    }
                }
            })?;
        Ok(Prewarmer { jobs: Mutex::new(Some(tx)), pending, yields, thread: Some(thread) })
    }

    /// Hand over a used store (none: a backend just loaded) and have
    /// `spares` made up again. Past [`MAX_PENDING`] stores waiting, or with
    /// the prewarmer gone (the runtime stopping), the store is dropped here.
    pub(crate) fn retire(&self, mut used: Option<Store<CallState>>, spares: &Arc<Prewarmed>) {
        if used.is_some() {
            let mut n = self.pending.0.lock().unwrap_or_else(|p| p.into_inner());
            if *n >= MAX_PENDING {
                drop(n);
                used = None;
            } else {
                *n += 1;
            }
        }
        let had_store = used.is_some();
        // One refill asked at a time per backend.
        let refill = !spares.refill_asked.swap(true, std::sync::atomic::Ordering::AcqRel);
        if !had_store && !refill {
            return;
        }
        let job = Job { used, spares: refill.then(|| Arc::downgrade(spares)) };
        let sent =
            self.jobs.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|tx| tx.send(job));
        if !matches!(sent, Some(Ok(()))) {
            // No prewarmer: the store came back and was dropped here.
            spares.refill_asked.store(false, std::sync::atomic::Ordering::Release);
            if had_store {
                let mut n = self.pending.0.lock().unwrap_or_else(|p| p.into_inner());
                *n = n.saturating_sub(1);
            }
        }
    }

    /// For a call that found the pool full: hold the prewarmer off, have
    /// `release` drop instances made ahead (none is being made meanwhile),
    /// and wait for the used stores handed over to be dropped. The hold, to
    /// keep until the call has its own instance.
    pub(crate) fn give_way(&self, release: impl FnOnce()) -> HeldOff {
        self.yields.starved.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let held = HeldOff(self.yields.clone());
        {
            let _making = self.yields.making();
            release();
        }
        self.settle();
        held
    }

    /// Wait (at most [`SETTLE`]) until the stores handed over are dropped
    /// and their pool slots free.
    fn settle(&self) {
        let (count, settled) = &*self.pending;
        let n = count.lock().unwrap_or_else(|p| p.into_inner());
        drop(settled.wait_timeout_while(n, SETTLE, |n| *n > 0).unwrap_or_else(|p| p.into_inner()));
    }

    pub(crate) fn stop(&mut self) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Consumer, Decision, Plugin, Runtime, Step, Volume, VolumeMode};
    use std::path::Path;
    use std::time::{Duration, Instant};

    fn load(rt: &Arc<Runtime>) -> Plugin {
        Plugin::load_file(rt, Path::new(volagent_test_artifacts::LOCAL_PV)).expect("local-pv loads")
    }

    /// Wait until `plugin` has `n` instances ready.
    fn until_ready(plugin: &Plugin, n: usize) {
        let start = Instant::now();
        while plugin.spares.counts().0 != n {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{n} instances were not made ahead: {:?}",
                plugin.spares.counts()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn volume() -> Volume {
        Volume {
            name: "pv1".into(),
            backend: "local-pv".into(),
            access_mode: crate::policy::AccessMode::ReadWriteOnce,
            fs_type: "ext4".into(),
            mode: VolumeMode::Filesystem,
            mount_flags: vec![],
            options: vec![
                crate::policy::KeyValue { key: "path".into(), value: "/mnt/disks/vol1.img".into() },
                crate::policy::KeyValue { key: "node".into(), value: "n1".into() },
            ],
            secret_keys: vec![],
        }
    }

    fn consumer() -> Consumer {
        Consumer {
            node: "n1".into(),
            pod_namespace: "default".into(),
            pod: "web".into(),
            pod_uid: "uid-1".into(),
            mount_dir: "/var/lib/kubelet/pods/uid-1/volumes/volagent~local-pv/pv1".into(),
            read_only: false,
            mount_group: None,
        }
    }

    /// The queries of a node where the volume's file is there.
    fn with_file() -> Arc<dyn Queries> {
        let mut q = RecordedQueries::default();
        q.paths.insert("/mnt/disks/vol1.img".into(), crate::policy::PathKind::RegularFile);
        Arc::new(q)
    }

    #[test]
    fn calls_take_instances_made_ahead_and_each_asks_its_own_queries() {
        let rt = Runtime::new(crate::policy::Limits::default()).unwrap();
        let plugin = load(&rt);
        until_ready(&plugin, READY);
        let paths = crate::policy::NodePaths {
            kubelet_root: "/var/lib/kubelet".into(),
            staging_dir: "/var/lib/kubelet/plugins/volagent/local-pv/mounts/pv1".into(),
            state_dir: "/var/lib/volagent/volumes/pv1".into(),
            discovery_dirs: vec!["/mnt/disks".into()],
        };
        for round in 1..=3u64 {
            assert_eq!(
                plugin.fence(with_file(), &volume(), &consumer(), &[], &[]).unwrap(),
                Decision::Grant
            );
            // The attach plan depends on what the call's queries say of the
            // file: an instance made ahead asked none of its own.
            let plan = plugin.attach(with_file(), &volume(), &consumer(), &[], &paths).unwrap();
            assert!(matches!(plan.first(), Some(Step::AttachDevice(_))), "{plan:?}");
            until_ready(&plugin, READY);
            let missing = plugin
                .attach(Arc::new(RecordedQueries::default()), &volume(), &consumer(), &[], &paths)
                .unwrap_err();
            assert!(missing.to_string().contains("does not exist on this node"), "{missing}");
            // Every call took an instance made ahead, and they are made up.
            until_ready(&plugin, READY);
            assert_eq!(plugin.spares.counts().1, 3 * round, "every call took one");
        }
    }

    #[test]
    fn instances_made_ahead_give_their_slots_to_calls() {
        // Two slots: the first backend's instances made ahead take both.
        let rt = Runtime::new(crate::policy::Limits { concurrent_calls: 2, ..Default::default() })
            .unwrap();
        let first = load(&rt);
        until_ready(&first, READY);
        // Another backend's call finds the pool full, and gets a slot back.
        let second =
            Plugin::load_file(&rt, Path::new(volagent_test_artifacts::RBD)).expect("rbd loads");
        let mut rbd = volume();
        rbd.backend = "rbd".into();
        rbd.options = ["monitors=10.0.0.1:6789", "pool=rbd", "image=img1"]
            .iter()
            .map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| crate::policy::KeyValue { key: k.into(), value: v.into() })
                    .unwrap()
            })
            .collect();
        let decided =
            second.fence(Arc::new(RecordedQueries::default()), &rbd, &consumer(), &[], &[]);
        assert!(decided.is_ok(), "{decided:?}");
        // Calls one after another, each while the prewarmer makes the other
        // backend's instances ahead: every call gets a slot.
        for round in 0..40 {
            let decided = first.fence(with_file(), &volume(), &consumer(), &[], &[]);
            assert!(matches!(decided, Ok(Decision::Grant)), "round {round}: {decided:?}");
            let decided =
                second.fence(Arc::new(RecordedQueries::default()), &rbd, &consumer(), &[], &[]);
            assert!(decided.is_ok(), "round {round}: {decided:?}");
        }
    }
}
