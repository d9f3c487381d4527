//! The execute step, and where an operation's work runs: a plan's steps
//! under the plan deadline, stash writes on this worker, a kubelet
//! request's whole operation on a task of its own ([`served`]).

use super::mount_records::{MountRecords, MountRecordsError};
use super::node::{LockGuard, Node};
use super::{Failure, FailureKind, internal};
use crate::exec::{Executor, Outcome};
use crate::model::Step;
use crate::secret::Secrets;
use std::sync::Arc;
use std::time::Duration;

/// Run `plan`, waiting at most the plan deadline. A step that hangs
/// (a mount of an unreachable filesystem, say) cannot be cancelled: at
/// the deadline the request fails with `timed_out`, and the volume's lock
/// passes to a task that holds it until the steps end, so no other
/// operation on the volume starts meanwhile. Records stay as they are:
/// kubelet's retry (or, after a restart, reconciliation) settles them.
/// `local`: the plan waits on this node's own disks only
/// ([`crate::exec::runs_locally`]).
pub(crate) async fn run_plan(
    node: &Node,
    plan: Vec<Step>,
    local: bool,
    lock: &mut Option<LockGuard>,
) -> Result<Outcome, Failure> {
    run_plan_with(node, plan, local, lock, Arc::default()).await
}

/// [`run_plan`] with the volume's secret values.
pub(crate) async fn run_plan_with(
    node: &Node,
    plan: Vec<Step>,
    local: bool,
    lock: &mut Option<LockGuard>,
    secrets: Arc<Secrets>,
) -> Result<Outcome, Failure> {
    on_plan_thread(node, lock, local, secrets, move |exec| exec.run(&plan).map_err(internal)).await
}

/// Run `job` with an executor on a blocking thread, under the plan
/// deadline: steps can hang in the kernel. When the deadline passes, the
/// volume's `lock` goes with the job, which holds it until it ends.
/// In a request [`served`] with its answer bounded, the job runs right
/// here instead (see there), on this very worker when it is `local`
/// ([`crate::workers::on_worker`]); on a CSI thread, a `local` one
/// while another CSI thread is free ([`crate::workers::run_here`]).
pub(crate) async fn on_plan_thread<R: Send + 'static, E: From<Failure> + Send + 'static>(
    node: &Node,
    lock: &mut Option<LockGuard>,
    local: bool,
    secrets: Arc<Secrets>,
    job: impl FnOnce(&Executor) -> Result<R, E> + Send + 'static,
) -> Result<R, E> {
    let exec = Executor::new(node.sys.clone()).with_secrets(secrets);
    if STEPS_IN_PLACE.try_with(|_| ()).is_ok()
        && let Some(_here) = crate::workers::run_here(local)
    {
        return crate::workers::on_worker(local, || job(&exec));
    }
    let mut task = tokio::task::spawn_blocking(move || job(&exec));
    match tokio::time::timeout(node.plan_deadline, &mut task).await {
        Ok(joined) => joined.map_err(|e| internal(format!("agent task failed: {e}")))?,
        Err(_) => {
            let guard = lock.take();
            tokio::spawn(async move {
                let _ = task.await;
                drop(guard);
            });
            Err(Failure::new(
                FailureKind::TimedOut,
                format!(
                    "the volume's steps were still running after {:?}; they go on, and the volume stays locked until they end; retry",
                    node.plan_deadline
                ),
            )
            .into())
        }
    }
}

/// A stash write, on this worker: a file written and renamed in the
/// runtime dir (a tmpfs on a node), local work of a few syscalls.
pub(crate) fn write_mounts<R>(
    node: &Node,
    f: impl FnOnce(&MountRecords) -> Result<R, MountRecordsError>,
) -> Result<R, Failure> {
    crate::workers::on_worker(true, || f(&node.mount_records)).map_err(internal)
}

/// A stash read, inline: the stash answers from memory.
pub(crate) fn read_mounts<R>(
    node: &Node,
    f: impl FnOnce(&MountRecords) -> Result<R, MountRecordsError>,
) -> Result<R, Failure> {
    f(&node.mount_records).map_err(internal)
}

tokio::task_local! {
    /// Set on the task of a request [`served`] with a bounded answer.
    static STEPS_IN_PLACE: ();
}

/// A kubelet request's operation, on a task of its own, answered within
/// `deadline`. Its steps run on that task's own thread, not on a blocking
/// thread: the hand-off there and back is two thread wake-ups, ~100 µs on
/// a small VM, on every stage, publish and mount; a plan on local disks
/// only keeps the worker too ([`crate::workers::on_worker`]). A step can
/// still hang in the kernel: at the deadline the request is answered
/// `timed_out` (by another worker), and the operation goes on, holding the
/// volume's lock until it ends; it then finishes or rolls back as it would
/// have, and kubelet's retry finds the volume done or the operation in
/// progress. Kubelet cancelling the call cannot cut the operation short
/// half-way either. On a CSI thread ([`crate::csi::threads`]) nothing
/// answers for a local step the kernel holds: the thread is the step's
/// until it returns, and kubelet's next call goes to the other thread.
///
/// The operation's own result, or why it has none: still running at the
/// deadline (or its task failed).
pub async fn served<R: Send + 'static>(
    deadline: Duration,
    work: impl std::future::Future<Output = R> + Send + 'static,
) -> Result<R, Failure> {
    let mut task = tokio::spawn(STEPS_IN_PLACE.scope((), work));
    match tokio::time::timeout(deadline, &mut task).await {
        Ok(joined) => joined.map_err(|e| internal(format!("agent task failed: {e}"))),
        Err(_) => Err(Failure::new(
            FailureKind::TimedOut,
            format!(
                "the operation was still running after {deadline:?} (a step hanging?); it goes on, and the volume stays locked until it ends; retry"
            ),
        )),
    }
}

/// Run blocking work (syscalls, tools, fsync) off the async workers.
pub(crate) async fn blocking<R: Send + 'static>(
    f: impl FnOnce() -> R + Send + 'static,
) -> Result<R, Failure> {
    tokio::task::spawn_blocking(f).await.map_err(|e| internal(format!("agent task failed: {e}")))
}
