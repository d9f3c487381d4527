//! An attachment record's write on a node-private ledger, run alongside the
//! steps it records: started as they start (a plan refused, or a stash
//! entry that could not be written, writes nothing), and always ended
//! before the operation answers or rolls back — a write still under way
//! could otherwise land after the rollback removed its holder.

use std::future::Future;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

pub(super) struct RecordWrite<F: Future> {
    runtime: Handle,
    /// The volume, for the error.
    volume: String,
    state: State<F>,
}

enum State<F: Future> {
    NotStarted(F),
    Running(JoinHandle<F::Output>),
    Ended(Result<(), String>),
}

impl<F, V, E> RecordWrite<F>
where
    F: Future<Output = Result<V, E>> + Send + 'static,
    V: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    pub(super) fn new(runtime: Handle, volume: &str, write: F) -> Self {
        RecordWrite { runtime, volume: volume.to_string(), state: State::NotStarted(write) }
    }

    /// Start the write on the runtime (once), to run while this thread goes
    /// on with the steps.
    pub(super) fn start(&mut self) {
        self.state = match std::mem::replace(&mut self.state, State::Ended(Ok(()))) {
            State::NotStarted(write) => State::Running(self.runtime.spawn(write)),
            other => other,
        };
    }

    /// The write's result, waiting for it (started now if it was not): the
    /// record must be stored before the operation reports success. Blocks
    /// the thread: call it from the steps' thread.
    pub(super) fn wait(&mut self) -> Result<(), String> {
        self.start();
        self.state = match std::mem::replace(&mut self.state, State::Ended(Ok(()))) {
            State::Running(task) => State::Ended(match self.runtime.block_on(task) {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("recording the attachment of volume {} failed: {e}", self.volume)),
                Err(e) => Err(format!("recording the attachment of volume {} failed: agent task failed: {e}", self.volume)),
            }),
            other => other,
        };
        match &self.state {
            State::Ended(r) => r.clone(),
            State::NotStarted(_) | State::Running(_) => Err(format!("recording the attachment of volume {} did not end", self.volume)),
        }
    }

    /// Before a rollback removes the holder the record adds: a write under
    /// way ends first (else it could land after the removal and leave a
    /// holder that is not there); one never started is dropped unwritten.
    pub(super) fn settle(&mut self) {
        match &self.state {
            State::NotStarted(_) => self.state = State::Ended(Ok(())),
            State::Running(_) => {
                let _ = self.wait();
            }
            State::Ended(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counted(writes: &Arc<AtomicUsize>, fail: bool) -> impl Future<Output = Result<u64, String>> + Send + 'static {
        let writes = writes.clone();
        async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            writes.fetch_add(1, Ordering::SeqCst);
            if fail { Err("the store is down".to_string()) } else { Ok(7) }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_runs_once_and_its_result_is_kept() {
        let writes = Arc::new(AtomicUsize::new(0));
        let mut w = RecordWrite::new(Handle::current(), "pv1", counted(&writes, false));
        let result = tokio::task::spawn_blocking(move || {
            w.start();
            w.start();
            (w.wait(), w.wait())
        })
        .await
        .unwrap();
        assert_eq!(result, (Ok(()), Ok(())));
        assert_eq!(writes.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_write_is_an_error_naming_the_volume() {
        let writes = Arc::new(AtomicUsize::new(0));
        let mut w = RecordWrite::new(Handle::current(), "pv1", counted(&writes, true));
        let (e, again) = tokio::task::spawn_blocking(move || (w.wait(), w.wait())).await.unwrap();
        let e = e.unwrap_err();
        assert!(e.contains("volume pv1") && e.contains("the store is down"), "{e}");
        assert_eq!(again, Err(e), "asked again, the write still failed");
        assert_eq!(writes.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn settling_ends_a_running_write_and_drops_one_never_started() {
        let writes = Arc::new(AtomicUsize::new(0));
        let mut running = RecordWrite::new(Handle::current(), "pv1", counted(&writes, false));
        let mut unstarted = RecordWrite::new(Handle::current(), "pv2", counted(&writes, false));
        tokio::task::spawn_blocking(move || {
            running.start();
            running.settle();
            unstarted.settle();
        })
        .await
        .unwrap();
        // The running one has landed by the time settle returned; the other
        // never will.
        assert_eq!(writes.load(Ordering::SeqCst), 1);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(writes.load(Ordering::SeqCst), 1);
    }
}
