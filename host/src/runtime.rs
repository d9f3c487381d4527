//! Where the agent's blocking work runs.

/// Run short blocking work — a commit to a local database, a few syscalls
/// on local files — on this very thread, after the runtime has moved this
/// worker's other tasks to another thread. Handing it to a blocking thread
/// and back costs two thread wake-ups, 40–70 µs each on a small VM: more
/// than the work itself. Work that may hang (a mount, a path on a network
/// filesystem) still goes to a blocking thread, under a deadline. On a
/// current-thread runtime (tests, one-shot commands) `f` simply runs.
pub fn in_place<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}
