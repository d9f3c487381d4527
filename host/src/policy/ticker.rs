//! The epoch ticker: advances the engine's epoch while guest calls run, so
//! that a call past its deadline traps, and parks when none does.

use super::limits::EPOCH_TICK;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use wasmtime::Engine;

/// How long the ticker goes on after the last guest call ended. Calls come
/// in bursts (a pod's volumes, a node's drain): waking a parked ticker is
/// a futex wake and, on a small VM, an interrupt to an idle CPU on every
/// call's path; ticking on meanwhile costs 200 cheap wake-ups a second.
pub(super) const LINGER: Duration = Duration::from_secs(1);

/// Guest calls running, and whether the ticker is to stop.
#[derive(Default)]
struct TickerState {
    calls: usize,
    stop: bool,
    /// Waiting for a call (to be woken by the next one).
    parked: bool,
    /// When the last call ended.
    idle_since: Option<Instant>,
    /// Ticks so far (for the tests).
    ticks: u64,
}

/// Advances the engine's epoch every [`EPOCH_TICK`] while a guest call
/// runs (and for [`LINGER`] after), so that calls past their deadline
/// trap; parked otherwise.
pub(super) struct Ticker {
    handle: TickerHandle,
    thread: Option<JoinHandle<()>>,
}

/// Where guest calls are counted for the ticker.
#[derive(Clone)]
pub(crate) struct TickerHandle {
    state: Arc<(Mutex<TickerState>, Condvar)>,
}

/// A guest call, for the ticker: counted until dropped.
pub(crate) struct Calling {
    state: Arc<(Mutex<TickerState>, Condvar)>,
}

impl Drop for Calling {
    fn drop(&mut self) {
        let mut s = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
        s.calls = s.calls.saturating_sub(1);
        if s.calls == 0 {
            s.idle_since = Some(Instant::now());
        }
    }
}

impl TickerHandle {
    /// A call begins: the epoch advances until it ends.
    pub(crate) fn begin(&self) -> Calling {
        let (lock, wake) = &*self.state;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        s.calls += 1;
        if s.parked {
            wake.notify_one();
        }
        Calling { state: self.state.clone() }
    }
}

impl Ticker {
    pub(super) fn start(engine: Engine) -> std::io::Result<Self> {
        let state: Arc<(Mutex<TickerState>, Condvar)> = Arc::default();
        let shared = state.clone();
        let thread =
            std::thread::Builder::new().name("volagent-epoch".into()).spawn(move || {
                let (lock, wake) = &*shared;
                loop {
                    {
                        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
                        while s.calls == 0
                            && !s.stop
                            && s.idle_since.is_none_or(|t| t.elapsed() >= LINGER)
                        {
                            s.parked = true;
                            s = wake.wait(s).unwrap_or_else(|e| e.into_inner());
                            s.parked = false;
                        }
                        if s.stop {
                            return;
                        }
                    }
                    // A call that starts during this sleep counts its end as a
                    // tick: deadline_ticks' extra tick covers that.
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                    lock.lock().unwrap_or_else(|e| e.into_inner()).ticks += 1;
                }
            })?;
        Ok(Ticker { handle: TickerHandle { state }, thread: Some(thread) })
    }

    pub(super) fn handle(&self) -> TickerHandle {
        self.handle.clone()
    }

    /// Ticks so far.
    #[cfg(test)]
    pub(super) fn ticks(&self) -> u64 {
        self.handle.state.0.lock().unwrap_or_else(|e| e.into_inner()).ticks
    }

    /// A call begins: the epoch advances until it ends.
    pub(super) fn begin(&self) -> Calling {
        self.handle.begin()
    }

    pub(super) fn stop(&mut self) {
        let (lock, wake) = &*self.handle.state;
        lock.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
