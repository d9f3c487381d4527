//! The threads CSI calls are served on. Each runs a runtime of its own
//! (tokio's current-thread flavour) and accepts on every driver's socket,
//! so a call — its gRPC frames, its checks, a local volume's steps — runs
//! from start to end on the thread that accepted its connection: no task
//! crosses to another thread, and the agent's other work (its socket for
//! the Flexvolume driver, reconciliation, the cluster's watches) never
//! stands in a call's way.
//!
//! A thread runs a volume's local steps itself, so a step the kernel holds
//! (a local disk that stops answering) or a tool it runs (mkfs of a new
//! volume) keeps that thread until it returns. One thread always stays
//! free of steps ([`crate::workers::run_here`]): kubelet connects anew for
//! every call, and that thread takes it; while the others are busy, its
//! own calls' steps go to a blocking thread under the plan deadline, as do
//! steps that wait on a network.

use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// How many threads serve CSI calls: one may be busy with steps while the
/// other takes the next call.
pub const THREADS: usize = 2;

pub struct CsiThreads {
    handles: Vec<Handle>,
    /// Set when the threads are to stop: how long each waits for the steps
    /// it handed to blocking threads.
    stop: tokio::sync::watch::Sender<Option<Duration>>,
    ended: mpsc::Receiver<()>,
}

impl CsiThreads {
    /// Start `n` threads, each with its runtime ready.
    pub fn start(n: usize) -> std::io::Result<CsiThreads> {
        let (stop, stopped) = tokio::sync::watch::channel(None);
        let (ended_tx, ended) = mpsc::channel();
        let mut handles = Vec::with_capacity(n);
        for i in 0..n {
            let (ready_tx, ready) = mpsc::channel();
            let (mut stopped, ended_tx) = (stopped.clone(), ended_tx.clone());
            std::thread::Builder::new().name(format!("volagent-csi-{i}")).spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let counted = crate::workers::csi_thread();
                let _ = ready_tx.send(Ok(rt.handle().clone()));
                // The sender dropped stops the thread too, at once.
                let grace = rt.block_on(async move {
                    stopped
                        .wait_for(Option::is_some)
                        .await
                        .ok()
                        .and_then(|g| *g)
                        .unwrap_or_default()
                });
                // Calls cut here are settled as on the main runtime: by
                // kubelet's retry, or the next start's reconciliation.
                rt.shutdown_timeout(grace);
                drop(counted);
                let _ = ended_tx.send(());
            })?;
            let handle = ready.recv().map_err(|_| {
                std::io::Error::other("a CSI thread ended before its runtime was ready")
            })??;
            handles.push(handle);
        }
        Ok(CsiThreads { handles, stop, ended })
    }

    pub fn handles(&self) -> &[Handle] {
        &self.handles
    }

    /// Stop the threads, waiting up to `grace` for them to end (and each
    /// for its steps on blocking threads): a thread in a step the kernel
    /// holds is left behind, as the main runtime's are.
    pub fn stop(self, grace: Duration) {
        let _ = self.stop.send(Some(grace));
        let deadline = Instant::now() + grace;
        for _ in 0..self.handles.len() {
            if self.ended.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err()
            {
                tracing::warn!("a CSI thread is still in a step at exit; it is left behind");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `f` as a task on the thread of `h`, and wait for its answer.
    fn on<T: Send + 'static>(
        h: &Handle,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        let (tx, rx) = mpsc::channel();
        h.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("the thread runs tasks")
    }

    // The CSI threads are counted process-wide: one test walks every case.
    #[test]
    fn calls_stay_on_their_thread_which_runs_local_steps_while_another_is_free() {
        let threads = CsiThreads::start(2).unwrap();
        let [a, b] = threads.handles() else { panic!("two threads") };
        let names: Vec<String> = [a, b]
            .iter()
            .map(|h| {
                on(h, async {
                    // A task and what it spawns run on that one thread.
                    let outer = std::thread::current().name().map(str::to_string);
                    let inner =
                        tokio::spawn(async { std::thread::current().name().map(str::to_string) })
                            .await
                            .unwrap();
                    assert_eq!(outer, inner);
                    assert_eq!(
                        Handle::current().runtime_flavor(),
                        tokio::runtime::RuntimeFlavor::CurrentThread
                    );
                    inner.unwrap()
                })
            })
            .collect();
        assert_eq!(names, ["volagent-csi-0", "volagent-csi-1"]);

        // Local steps run here while the other thread is free; steps that
        // wait on a network never do.
        assert!(on(a, async { crate::workers::run_here(true).is_some() }));
        assert!(on(a, async { crate::workers::run_here(false).is_none() }));
        // While thread a runs steps, b's go to a blocking thread: one
        // thread stays free for kubelet's next call.
        let (inside, release) = (mpsc::channel(), mpsc::channel::<()>());
        a.spawn(async move {
            let here = crate::workers::run_here(true);
            inside.0.send(here.is_some()).unwrap();
            release.1.recv().unwrap();
            drop(here);
        });
        assert!(inside.1.recv_timeout(Duration::from_secs(10)).unwrap(), "a runs its steps itself");
        assert!(on(b, async { crate::workers::run_here(true).is_none() }), "b must stay free");
        release.0.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !on(b, async { crate::workers::run_here(true).is_some() }) {
            assert!(Instant::now() < deadline, "b runs steps again once a is done");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Off the CSI threads nothing changes: a current-thread runtime
        // runs local steps itself, and no multi-thread one is limited here.
        let current = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(
            current.block_on(async {
                (
                    crate::workers::run_here(true).is_some(),
                    crate::workers::run_here(false).is_some(),
                )
            }),
            (true, false)
        );
        let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
        assert!(multi.block_on(async { crate::workers::run_here(false).is_some() }));

        let start = Instant::now();
        threads.stop(Duration::from_secs(10));
        assert!(start.elapsed() < Duration::from_secs(5), "the threads ended when told");
    }
}
