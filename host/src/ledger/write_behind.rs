//! A node-private ledger's writes, stored behind the operations that make
//! them. A write is taken in memory (so every later read and write sees
//! it) and a flusher thread commits what gathered within [`GATHER`] in one
//! durable commit. A commit is a disk flush (~0.2 ms on a VM, more on a
//! busy disk) that would otherwise sit in every mount and unmount.
//!
//! What a crash can lose is the last [`GATHER`] of holder changes, which
//! the node itself still shows: start-up reconciliation records again a
//! holder whose mount and stash entry (on the runtime tmpfs) are there, and
//! drops one whose mount is gone. A reboot loses the mounts along with the
//! records of them. A commit that fails (a full disk) is tried again every
//! [`RETRY`]; meanwhile new writes are refused, naming why, so a node whose
//! state disk cannot take records stops taking volumes.

use super::Record;
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long writes gather before one commit stores them: a pod's volumes
/// mount in a burst.
pub const GATHER: Duration = Duration::from_millis(100);
/// How long after a failed commit the next one is tried.
pub const RETRY: Duration = Duration::from_millis(500);

/// A write not yet stored: the record at its new version, or its removal.
#[derive(Debug, Clone, PartialEq)]
pub enum Pending {
    Put { version: u64, record: Record },
    Gone { revision: u64 },
}

/// Pending writes, one per volume (its last): their number is bounded by
/// the volumes, however many writes are made.
pub type Batch = BTreeMap<String, Pending>;

/// Stores a batch durably; `revision` is the last version handed out.
pub type Commit = Box<dyn Fn(&Batch, u64) -> Result<(), String> + Send + Sync>;

struct State {
    pending: Batch,
    /// The last version handed out. None is handed out twice while the
    /// agent runs; after a crash, ones that never reached the disk may be
    /// again (nothing holds them any more).
    revision: u64,
    /// When the pending writes are to be committed.
    due: Option<Instant>,
    /// Why the last commit failed, until one succeeds.
    failed: Option<String>,
    /// Commits tried so far.
    attempts: u64,
    stopping: bool,
}

struct Inner {
    state: Mutex<State>,
    wake: Condvar,
    /// Told after every commit, stored or failed.
    committed: Condvar,
    commit: Commit,
}

pub struct WriteBehind {
    inner: Arc<Inner>,
    flusher: Option<std::thread::JoinHandle<()>>,
}

/// The pending writes, locked: a read of the store made while holding it
/// cannot miss a write being committed.
pub struct Locked<'a> {
    state: MutexGuard<'a, State>,
    wake: &'a Condvar,
}

impl WriteBehind {
    /// Start the flusher; `revision` is the last version the store holds.
    pub fn start(revision: u64, commit: Commit) -> std::io::Result<WriteBehind> {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                pending: Batch::new(),
                revision,
                due: None,
                failed: None,
                attempts: 0,
                stopping: false,
            }),
            wake: Condvar::new(),
            committed: Condvar::new(),
            commit,
        });
        let flusher = inner.clone();
        let flusher = std::thread::Builder::new()
            .name("volagent-ledger".into())
            .spawn(move || flusher.run())?;
        Ok(WriteBehind { inner, flusher: Some(flusher) })
    }

    /// Commit what is pending now and wait for the outcome (at shutdown:
    /// the flusher's next try would otherwise be up to [`GATHER`] away).
    pub fn flush(&self) -> Result<(), String> {
        let mut state = self.inner.lock();
        let before = state.attempts;
        loop {
            if state.pending.is_empty() {
                return Ok(());
            }
            if state.attempts != before
                && let Some(why) = &state.failed
            {
                return Err(why.clone());
            }
            state.due = Some(Instant::now());
            self.inner.wake.notify_all();
            state = self.inner.committed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub fn lock(&self) -> Locked<'_> {
        Locked { state: self.inner.lock(), wake: &self.inner.wake }
    }
}

impl Locked<'_> {
    /// The pending write of `volume`, if there is one: `Some(None)` is a
    /// removal.
    pub fn get(&self, volume: &str) -> Option<Option<(&Record, u64)>> {
        self.state.pending.get(volume).map(|p| match p {
            Pending::Put { version, record } => Some((record, *version)),
            Pending::Gone { .. } => None,
        })
    }

    /// Every pending write.
    pub fn all(&self) -> &Batch {
        &self.state.pending
    }

    /// Take a write of `volume` (`None`: its removal), to be committed
    /// within [`GATHER`]; its version. Refused while commits fail.
    pub fn put(&mut self, volume: &str, record: Option<Record>) -> Result<u64, String> {
        if let Some(why) = &self.state.failed {
            return Err(format!("records are not reaching the disk ({why}); retry once they do"));
        }
        self.state.revision += 1;
        let revision = self.state.revision;
        let pending = match record {
            Some(record) => Pending::Put { version: revision, record },
            None => Pending::Gone { revision },
        };
        self.state.pending.insert(volume.to_string(), pending);
        if self.state.due.is_none() {
            self.state.due = Some(Instant::now() + GATHER);
            self.wake.notify_all();
        }
        Ok(revision)
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Commit what is pending when it is due, until stopped; stopping
    /// commits what is left first (once: a failure then is logged).
    fn run(&self) {
        let mut state = self.lock();
        loop {
            match state.due {
                None if state.stopping => return,
                None => {
                    state = self.wake.wait(state).unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                Some(due) if !state.stopping => {
                    let now = Instant::now();
                    if now < due {
                        state = self
                            .wake
                            .wait_timeout(state, due - now)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                        continue;
                    }
                }
                Some(_) => {}
            }
            let (batch, revision) = (state.pending.clone(), state.revision);
            drop(state);
            let result = (self.commit)(&batch, revision);
            state = self.lock();
            state.attempts += 1;
            // Whoever waits for this commit reads its outcome once this
            // guard is gone.
            self.committed.notify_all();
            match result {
                Ok(()) => {
                    // Writes taken during the commit stay for the next.
                    state.pending.retain(|volume, p| batch.get(volume) != Some(p));
                    if state.failed.take().is_some() {
                        tracing::info!("attachment records reach the disk again");
                    }
                    state.due = (!state.pending.is_empty()).then(|| Instant::now() + GATHER);
                }
                Err(why) => {
                    let records = batch.len();
                    if state.stopping {
                        tracing::error!(
                            records,
                            "attachment records were not stored at shutdown: {why}"
                        );
                        return;
                    }
                    tracing::error!(
                        records,
                        "attachment records could not be stored; new writes are refused until they are: {why}"
                    );
                    state.failed = Some(why);
                    state.due = Some(Instant::now() + RETRY);
                }
            }
        }
    }
}

impl Drop for WriteBehind {
    /// What is pending is committed before the ledger closes.
    fn drop(&mut self) {
        {
            let mut state = self.inner.lock();
            state.stopping = true;
            if !state.pending.is_empty() {
                state.due = Some(Instant::now());
            }
        }
        self.inner.wake.notify_all();
        if let Some(flusher) = self.flusher.take()
            && flusher.join().is_err()
        {
            tracing::error!("the ledger's flusher thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn record(volume: &str) -> Record {
        crate::ledger::conformance::record(volume, &[("n1", "a")])
    }

    /// The batches a store was given, with their revisions.
    type Stored = Arc<Mutex<Vec<(Batch, u64)>>>;

    /// A store that keeps what it is given, and fails while `failing`.
    fn store() -> (Stored, Arc<AtomicBool>, Commit) {
        let (stored, failing) =
            (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
        let (s, f) = (stored.clone(), failing.clone());
        let commit: Commit = Box::new(move |batch: &Batch, revision| {
            if f.load(Ordering::SeqCst) {
                return Err("No space left on device".into());
            }
            s.lock().unwrap().push((batch.clone(), revision));
            Ok(())
        });
        (stored, failing, commit)
    }

    fn wait_until(what: &str, done: impl Fn() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(5), "{what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn writes_are_seen_at_once_and_stored_together_with_fresh_versions() {
        let (stored, _, commit) = store();
        let behind = WriteBehind::start(41, commit).unwrap();
        let (a, b) = {
            let mut locked = behind.lock();
            let a = locked.put("pv-a", Some(record("pv-a"))).unwrap();
            let b = locked.put("pv-b", Some(record("pv-b"))).unwrap();
            assert_eq!(locked.get("pv-a"), Some(Some((&record("pv-a"), a))));
            (a, b)
        };
        assert_eq!((a, b), (42, 43));
        wait_until("the writes are committed", || behind.lock().all().is_empty());
        let stored = stored.lock().unwrap();
        assert_eq!(stored.len(), 1, "one commit for writes made together");
        assert_eq!(stored[0].1, 43);
        assert_eq!(stored[0].0.keys().collect::<Vec<_>>(), ["pv-a", "pv-b"]);
    }

    #[test]
    fn a_removal_is_pending_until_stored_and_the_last_write_wins() {
        let (stored, _, commit) = store();
        let behind = WriteBehind::start(0, commit).unwrap();
        {
            let mut locked = behind.lock();
            locked.put("pv-a", Some(record("pv-a"))).unwrap();
            locked.put("pv-a", None).unwrap();
            assert_eq!(locked.get("pv-a"), Some(None), "removed, not unknown");
        }
        wait_until("committed", || behind.lock().all().is_empty());
        assert_eq!(stored.lock().unwrap()[0].0["pv-a"], Pending::Gone { revision: 2 });
    }

    #[test]
    fn while_commits_fail_writes_are_refused_and_nothing_pending_is_lost() {
        let (stored, failing, commit) = store();
        failing.store(true, Ordering::SeqCst);
        let behind = WriteBehind::start(0, commit).unwrap();
        behind.lock().put("pv-a", Some(record("pv-a"))).unwrap();
        wait_until("a write is refused", || {
            behind.lock().put("pv-b", Some(record("pv-b"))).is_err()
        });
        let refused = behind.lock().put("pv-b", Some(record("pv-b"))).unwrap_err();
        assert!(refused.contains("No space left on device"), "{refused}");
        assert!(behind.lock().get("pv-a").is_some(), "the write taken before still reads back");

        failing.store(false, Ordering::SeqCst);
        wait_until("writes are taken again", || {
            behind.lock().put("pv-b", Some(record("pv-b"))).is_ok()
        });
        wait_until("all committed", || behind.lock().all().is_empty());
        let stored = stored.lock().unwrap();
        assert!(
            stored.iter().any(|(b, _)| b.contains_key("pv-a")),
            "the early write was stored once there was room"
        );
    }

    #[test]
    fn a_flush_stores_at_once_or_says_why_not() {
        let (stored, failing, commit) = store();
        let behind = WriteBehind::start(0, commit).unwrap();
        assert_eq!(behind.flush(), Ok(()), "nothing to store");
        behind.lock().put("pv-a", Some(record("pv-a"))).unwrap();
        assert_eq!(behind.flush(), Ok(()));
        assert_eq!(stored.lock().unwrap().len(), 1);
        assert!(behind.lock().all().is_empty());
        failing.store(true, Ordering::SeqCst);
        behind.lock().put("pv-b", Some(record("pv-b"))).unwrap();
        assert_eq!(behind.flush(), Err("No space left on device".to_string()));
        assert!(behind.lock().get("pv-b").is_some(), "kept for the next try");
    }

    #[test]
    fn closing_stores_what_is_pending() {
        let (stored, _, commit) = store();
        let behind = WriteBehind::start(0, commit).unwrap();
        behind.lock().put("pv-a", Some(record("pv-a"))).unwrap();
        drop(behind);
        assert_eq!(stored.lock().unwrap().len(), 1, "stored at close, not lost");
    }
}
