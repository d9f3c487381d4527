//! Where the agent's blocking work runs.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::runtime::{Handle, RuntimeFlavor};

/// Run short blocking work — a commit to a local database, a few syscalls
/// on local files — on this very thread, after the runtime has moved this
/// worker's other tasks to another thread. Handing it to a blocking thread
/// and back costs two thread wake-ups, 40–70 µs each on a small VM: more
/// than the work itself. Work that may hang (a mount, a path on a network
/// filesystem) still goes to a blocking thread, under a deadline. On a
/// current-thread runtime (the CSI threads, tests, one-shot commands) `f`
/// simply runs.
pub fn in_place<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        // Already blocking this worker on purpose (see [`on_worker`]).
        Ok(_) if HOLDING.get() => f(),
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Where a request's steps may run: on the calling task's thread (through
/// [`on_worker`], holding the guard meanwhile) or, when None, on a blocking
/// thread under the plan deadline. A CSI thread ([`crate::csi::threads`])
/// runs local steps itself while another CSI thread stays free to take
/// kubelet's next calls — a step the kernel holds keeps its thread, and no
/// timer of that thread fires meanwhile — and never steps that wait on a
/// network. Another current-thread runtime (tests, one-shot commands) runs
/// local steps itself too; a multi-thread runtime decides in [`on_worker`].
pub fn run_here(local: bool) -> Option<Here> {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::CurrentThread => {}
        _ => return Some(Here { csi: false }),
    }
    if !local {
        return None;
    }
    if !CSI_THREAD.get() {
        return Some(Here { csi: false });
    }
    let threads = CSI_THREADS.load(Ordering::Acquire);
    CSI_BUSY
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n + 1 < threads).then_some(n + 1))
        .ok()
        .map(|_| Here { csi: true })
}

/// Steps running on the thread of their request ([`run_here`]).
pub struct Here {
    csi: bool,
}

impl Drop for Here {
    fn drop(&mut self) {
        if self.csi {
            CSI_BUSY.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// CSI threads running, and how many of them run steps right now.
static CSI_THREADS: AtomicUsize = AtomicUsize::new(0);
static CSI_BUSY: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static CSI_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// The calling thread serves CSI calls from now on ([`crate::csi::threads`]);
/// the returned guard counts it until the thread ends.
pub fn csi_thread() -> CsiThread {
    CSI_THREAD.set(true);
    CSI_THREADS.fetch_add(1, Ordering::AcqRel);
    CsiThread
}

pub struct CsiThread;

impl Drop for CsiThread {
    fn drop(&mut self) {
        CSI_THREAD.set(false);
        CSI_THREADS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Workers blocked right now by [`on_worker`].
static HELD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread is a worker that [`on_worker`] keeps blocked.
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

/// Run blocking work that only waits on this node's own disks (a volume's
/// steps on loop devices, local filesystems, bind mounts) right on this
/// worker, keeping it: no other thread takes its place, and the answer
/// does not cross to one, which saves 10–60 µs of a CSI stage + publish
/// over [`in_place`] on a small VM (measured in one run, the two ways
/// alternating) — the thread hand-overs on an idle vCPU, not the work,
/// were the cost. The runtime has one worker less meanwhile,
/// so at most all but one worker do this at once (none on a one-worker
/// runtime; the count is the process's, which runs one such runtime); the
/// rest, and work that is not `local`, go through [`in_place`]. A piece
/// that may take long after all (a tool run, see [`may_take_long`]) hands
/// the worker over first.
///
/// What this gives up: a task woken by this thread just before (the
/// runtime's unstealable next-task slot) waits until the work ends — as
/// long as a local disk takes to answer, not more; and for up to
/// [`HOLD_GRACE`] no other worker may be driving the runtime's I/O and
/// timers (see [`watch_hold`]).
pub fn on_worker<R>(local: bool, f: impl FnOnce() -> R) -> R {
    let workers = match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => h.metrics().num_workers(),
        _ => return f(),
    };
    if !local || HOLDING.get() || !take_worker(workers) {
        return in_place(f);
    }
    HOLDING.set(true);
    let _held = Held;
    watch_hold();
    f()
}

/// How long a held worker may run before another worker is woken to drive
/// the runtime's I/O and timers. Local work mostly ends well within it (a
/// loop device and an ext4 mount take about 0.6 ms); one that hangs gets
/// its deadline answered at most this much late.
const HOLD_GRACE: std::time::Duration = std::time::Duration::from_millis(2);

/// The runtime's I/O and timers are driven by whichever worker parks on
/// them; the others park waiting to be told of work. A worker that found
/// this one driving them when it parked waits there even after this one
/// left to run tasks — and this one will not park while its work runs: no
/// timer would fire (a request's deadline) and no socket be read. So a
/// hold arms [`Watch`]'s timer, and if the hold outlasts [`HOLD_GRACE`]
/// another worker is woken. Waking one at once cost a CSI stage + publish
/// up to ~30 µs more on a small VM (three runs, the two ways alternating
/// in each: −3, 24, 29 µs; the wake, and the tasks then moving between
/// the two workers), for work that usually ends before it would matter. With no
/// watcher (it could not be started), another worker is woken at once.
fn watch_hold() {
    match Watch::get() {
        Some(w) if w.arm() => {}
        _ => wake_another_worker(),
    }
}

/// Two empty tasks spawned here wake another worker: the second pushes the
/// first out of this worker's next-task slot into its queue, which wakes
/// an idle worker to take it; that one then parks driving I/O and timers.
fn wake_another_worker() {
    for _ in 0..2 {
        drop(tokio::spawn(async {}));
    }
}

/// A thread that sleeps on a timer armed while workers are held, and when
/// a hold has lasted [`HOLD_GRACE`] spawns an empty task from outside the
/// runtime — which wakes an idle worker, as a task from outside always
/// does. The timer is armed once for holds that follow each other closely
/// (a stage, then its publish) and never disarmed: a syscall costs a few
/// µs on a VM. When it fires with no hold running, nothing is woken.
struct Watch {
    timer: nix::sys::timerfd::TimerFd,
    state: std::sync::Mutex<WatchState>,
    /// The thread stopped (its timer failed): holds wake a worker at once.
    dead: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct WatchState {
    /// The timer will fire.
    armed: bool,
    /// Since when a worker has been held, without a break (None: none is).
    since: Option<std::time::Instant>,
    /// The runtime of the holds being watched.
    runtime: Option<Handle>,
}

static WATCH: std::sync::OnceLock<Option<Watch>> = std::sync::OnceLock::new();
static WATCHER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

impl Watch {
    /// The process's watcher, started on first use; None if it cannot run.
    fn get() -> Option<&'static Watch> {
        let watch = WATCH
            .get_or_init(|| {
                use nix::sys::timerfd::{ClockId, TimerFd, TimerFlags};
                match TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_CLOEXEC) {
                    Ok(timer) => {
                        Some(Watch { timer, state: Default::default(), dead: Default::default() })
                    }
                    Err(e) => {
                        tracing::warn!(
                            "no timer for held workers ({e}); another worker is woken at every hold"
                        );
                        None
                    }
                }
            })
            .as_ref()?;
        let running = *WATCHER.get_or_init(|| match std::thread::Builder::new().name("volagent-hold".into()).spawn(|| watch_loop(watch)) {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!("no thread to watch held workers ({e}); another worker is woken at every hold");
                false
            }
        });
        (running && !watch.dead.load(Ordering::Acquire)).then_some(watch)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watch a hold just taken (counted in [`HELD`] already). False: the
    /// timer could not be armed.
    fn arm(&self) -> bool {
        let mut state = self.state();
        state.runtime = Handle::try_current().ok();
        let since = *state.since.get_or_insert_with(std::time::Instant::now);
        if !state.armed {
            if self.set(HOLD_GRACE.saturating_sub(since.elapsed())).is_err() {
                return false;
            }
            state.armed = true;
        }
        true
    }

    fn set(&self, after: std::time::Duration) -> nix::Result<()> {
        use nix::sys::timerfd::{Expiration, TimerSetTimeFlags};
        // Zero would disarm it.
        let after = after.max(std::time::Duration::from_micros(1));
        self.timer.set(
            Expiration::OneShot(nix::sys::time::TimeSpec::from_duration(after)),
            TimerSetTimeFlags::empty(),
        )
    }

    /// No worker is held any more (checked under the lock: a hold taken
    /// meanwhile was counted before it locks).
    fn idle(&self) {
        let mut state = self.state();
        if HELD.load(Ordering::Acquire) == 0 {
            state.since = None;
            state.runtime = None;
        }
    }

    /// The timer fired: the runtime to wake a worker of, if a hold has
    /// lasted the grace; a hold younger than that is watched on.
    fn fired(&self) -> Option<Handle> {
        let mut state = self.state();
        state.armed = false;
        let since = state.since?;
        let left = HOLD_GRACE.saturating_sub(since.elapsed());
        if left.is_zero() {
            // Woken once for this run of holds; a hold taken from now on
            // arms the timer again.
            state.since = Some(std::time::Instant::now());
            return state.runtime.clone();
        }
        if self.set(left).is_ok() {
            state.armed = true;
            return None;
        }
        // Cannot wait on: wake one now.
        state.runtime.clone()
    }
}

fn watch_loop(watch: &'static Watch) {
    loop {
        match watch.timer.wait() {
            Ok(()) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                watch.dead.store(true, Ordering::Release);
                tracing::error!(
                    "the timer of held workers failed ({e}); another worker is woken at every hold from now on"
                );
                // A hold may be running now: wake a worker for it.
                if let Some(runtime) = watch.state().runtime.take() {
                    drop(runtime.spawn(async {}));
                }
                return;
            }
        }
        if let Some(runtime) = watch.fired() {
            drop(runtime.spawn(async {}));
        }
    }
}

/// One more worker blocked, if another stays free.
fn take_worker(workers: usize) -> bool {
    HELD.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n + 1 < workers).then_some(n + 1))
        .is_ok()
}

/// This thread stops holding its worker (at the end, or when handing it
/// over), also when the work panics.
struct Held;

impl Drop for Held {
    fn drop(&mut self) {
        release();
    }
}

fn release() {
    if HOLDING.replace(false)
        && HELD.fetch_sub(1, Ordering::AcqRel) == 1
        && let Some(watch) = WATCH.get().and_then(Option::as_ref)
    {
        watch.idle();
    }
}

/// Run `f`, which may take long (a tool: mkfs, blkid, resize2fs), without
/// keeping a worker for it: inside [`on_worker`] the worker is handed over
/// first. Elsewhere `f` simply runs: the caller already chose its thread.
///
/// When `f` ends before another thread has picked the handed-over worker
/// up, this thread takes it back, and the rest of the work blocks that
/// worker again: it is held again, watched as any hold is — unwatched, a
/// step hanging after a quick tool (a mount after mkfs) kept every timer
/// from firing, the request's deadline among them, when the other worker
/// was parked waiting to be told of work (CI saw a mount hang 120 s).
pub fn may_take_long<R>(f: impl FnOnce() -> R) -> R {
    if !HOLDING.get() {
        return f();
    }
    release();
    let r = tokio::task::block_in_place(f);
    hold_again();
    r
}

/// After a hand-over, hold the worker this thread may have taken back —
/// or, if no worker may be held now, wake another one at once. Counted
/// even when the thread did not get it back: the watch then wakes a worker
/// that was not needed, which costs a wake-up, not a deadline.
fn hold_again() {
    let workers = match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => h.metrics().num_workers(),
        _ => return,
    };
    if take_worker(workers) {
        HOLDING.set(true);
        watch_hold();
    } else {
        wake_another_worker();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A runtime, and how many threads it has started (workers included).
    fn runtime(workers: usize) -> (tokio::runtime::Runtime, std::sync::Arc<AtomicUsize>) {
        let started = std::sync::Arc::new(AtomicUsize::new(0));
        let count = started.clone();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .on_thread_start(move || {
                count.fetch_add(1, Ordering::AcqRel);
            })
            .enable_all()
            .build()
            .unwrap();
        // The workers' threads start on their own time.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while started.load(Ordering::Acquire) < workers {
            assert!(std::time::Instant::now() < deadline, "the runtime's workers did not start");
            std::thread::sleep(Duration::from_millis(1));
        }
        (rt, started)
    }

    /// Whether a thread beyond the first `threads` starts within `wait`:
    /// a worker handed over starts one (on a runtime that has no idle
    /// blocking thread yet).
    fn starts_another(started: &AtomicUsize, threads: usize, wait: Duration) -> bool {
        let deadline = std::time::Instant::now() + wait;
        while std::time::Instant::now() < deadline {
            if started.load(Ordering::Acquire) > threads {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    fn held() -> usize {
        HELD.load(Ordering::Acquire)
    }

    /// On a fresh two-worker runtime, whether a 200 ms timer fires while
    /// the worker a socket woke is held: `first` runs in the hold, then
    /// the hold waits for the timer (5 s at most). Both workers are parked
    /// when the socket is written, one of them driving it.
    fn timer_fires_while_held(first: impl FnOnce() + Send + 'static) -> bool {
        let (rt, _) = runtime(2);
        rt.block_on(async {
            let (mut tx, mut rx) = tokio::net::UnixStream::pair().unwrap();
            let timer = tokio::spawn(async {
                tokio::time::sleep(Duration::from_millis(200)).await;
            });
            let held = tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut byte = [0u8];
                rx.read_exact(&mut byte).await.unwrap();
                on_worker(true, || {
                    first();
                    let deadline = std::time::Instant::now() + Duration::from_secs(5);
                    while !timer.is_finished() && std::time::Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    timer.is_finished()
                })
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            use tokio::io::AsyncWriteExt;
            tx.write_all(b"x").await.unwrap();
            held.await.unwrap()
        })
    }

    // The tests share HELD: one test walks through every case in turn.
    #[test]
    fn local_work_keeps_its_worker_while_another_is_free() {
        // Two workers: local work stays on its worker — no blocking
        // thread is started for it — and holds it until it ends.
        let (rt, started) = runtime(2);
        let s = started.clone();
        let (during, moved) = rt.block_on(async move {
            let during = tokio::spawn(async move {
                on_worker(true, move || (held(), starts_another(&s, 2, Duration::from_millis(200))))
            });
            during.await.unwrap()
        });
        assert_eq!((during, moved, held()), (1, false, 0), "held while it ran, by no other thread");

        // Work that is not local, and a second local one while the first
        // holds a worker, go through in_place: the worker is handed over.
        let s = started.clone();
        let moved = rt.block_on(async move {
            let work = move || (held(), starts_another(&s, 2, Duration::from_secs(10)));
            tokio::spawn(async move { on_worker(false, work) }).await.unwrap()
        });
        assert_eq!(moved, (0, true), "not local: handed over");
        rt.block_on(async {
            let (inside, release) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
            let first = tokio::spawn(async move {
                on_worker(true, move || {
                    inside.0.send(()).unwrap();
                    release.1.recv().unwrap();
                });
            });
            inside.1.recv_timeout(Duration::from_secs(10)).expect("the first holds its worker");
            // The other worker runs this one, and must not be held too.
            let second = tokio::spawn(async { on_worker(true, held) }).await.unwrap();
            assert_eq!(second, 1, "only the first holds a worker");
            release.0.send(()).unwrap();
            first.await.unwrap();
        });
        assert_eq!(held(), 0);

        // A piece that may take long hands the worker over; the count
        // follows, and a panic inside gives the worker back too.
        rt.block_on(async {
            tokio::spawn(async {
                on_worker(true, || {
                    assert_eq!(held(), 1);
                    may_take_long(|| assert_eq!(held(), 0));
                    assert!(HOLDING.get() && held() == 1, "held again after the tool");
                });
            })
            .await
            .unwrap();
            let panicked =
                tokio::spawn(async { on_worker(true, || panic!("a step panicked")) }).await;
            assert!(panicked.is_err());
        });
        assert_eq!(held(), 0, "every worker given back");

        // I/O and timers go on while a worker is held: here the worker
        // that drove them is woken by a socket and held, the other one
        // parked while it drove them.
        assert!(timer_fires_while_held(|| {}), "the timer fired while a worker was held");
        // Likewise after a tool's hand-over: a quick one ends before
        // another thread picks the worker up, this thread takes it back,
        // and the work blocking it afterwards is watched again.
        let after_a_tool = timer_fires_while_held(|| {
            may_take_long(|| ());
            assert_eq!(held(), 1, "held again");
        });
        assert!(after_a_tool, "the timer fired while the worker was held again after a tool");
        assert_eq!(held(), 0, "given back at the end");

        // A hold that ends within the grace wakes no other worker: only
        // the one woken by a socket to run it unparks (and parks again).
        let (rt, _) = runtime(2);
        let metrics = rt.metrics();
        let parks = || (0..2).map(|w| metrics.worker_park_unpark_count(w)).collect::<Vec<u64>>();
        let (socket, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
        socket.set_nonblocking(true).unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        rt.spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut socket = tokio::net::UnixStream::from_std(socket).unwrap();
            socket.read_exact(&mut [0u8]).await.unwrap();
            done.send(on_worker(true, held)).unwrap();
        });
        // Both workers parked by now, one of them driving the socket.
        std::thread::sleep(Duration::from_millis(100));
        let before = parks();
        std::io::Write::write_all(&mut peer, b"x").unwrap();
        assert_eq!(finished.recv_timeout(Duration::from_secs(10)).unwrap(), 1, "held while it ran");
        std::thread::sleep(Duration::from_millis(100));
        let woke: Vec<u64> =
            parks().iter().zip(&before).map(|(after, before)| after - before).collect();
        assert_eq!(
            woke.iter().filter(|&&n| n > 0).count(),
            1,
            "only the worker that ran the hold woke: {woke:?}"
        );

        // One worker: never held, local or not; current-thread runtimes
        // and plain threads simply run the work.
        let (one, started) = runtime(1);
        let work = move || (held(), starts_another(&started, 1, Duration::from_secs(10)));
        let moved = one.block_on(async move {
            tokio::spawn(async move { on_worker(true, work) }).await.unwrap()
        });
        assert_eq!(moved, (0, true), "one worker: handed over");
        let current = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(current.block_on(async { on_worker(true, held) }), 0);
        assert_eq!(on_worker(true, held), 0);
        assert_eq!(may_take_long(|| 7), 7);
    }
}
