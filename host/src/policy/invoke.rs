//! One call into a guest: a fresh (or made-ahead) store and instance, a
//! deadline and a memory cap, guest refusals kept apart from traps and host
//! faults. Below the backend's calls ([`super::call`]) and the load's `info`.

use super::contract::Linked;
use super::imports::CallState;
use super::prewarm::{self, Prewarmed, Unused};
use super::queries::Queries;
use super::runtime::Runtime;
use super::validate::PlanError;
use crate::model::{BackendInfo, PolicyError};
use std::sync::Arc;
use wasmtime::{Store, Trap};

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(
        "backend {backend}: {function} ran past its deadline of {deadline_ms} ms and was stopped"
    )]
    Deadline { backend: String, function: &'static str, deadline_ms: u128 },
    #[error(
        "backend {backend}: {function} tried to grow its memory past the cap of {cap_mib} MiB and was stopped"
    )]
    Memory { backend: String, function: &'static str, cap_mib: usize },
    #[error("backend {backend}: {function} trapped: {message}")]
    Trap { backend: String, function: &'static str, message: String },
    #[error("backend {backend}: {function} refused: {}", error.describe())]
    Policy { backend: String, function: &'static str, error: PolicyError },
    #[error("backend {backend}: {function} returned a plan the host refuses: {error}")]
    Plan { backend: String, function: &'static str, error: PlanError },
    #[error("backend {backend}: cannot start an instance for {function}: {message}")]
    Instantiate { backend: String, function: &'static str, message: String },
    #[error("backend {backend}: fence returned a take-over the host refuses: {reason}")]
    TakeOver { backend: String, reason: String },
    #[error("backend {backend}: {function} asked the host a query it refuses to answer: {error}")]
    Query { backend: String, function: &'static str, error: Box<super::queries::QueryError> },
}

impl CallError {
    /// True when the guest itself answered with a refusal (not a fault).
    pub fn is_policy_refusal(&self) -> bool {
        matches!(self, CallError::Policy { .. })
    }
}

/// One call on a fresh store and instance, under the runtime's limits: a
/// deadline and a memory cap. Nothing survives the call, so nothing leaks
/// between calls, volumes or operations, and a trapped instance is gone.
/// The instance is `ready` when it was made ahead of the call
/// ([`super::spare`]); the store then goes back to the prewarmer, which
/// drops it and makes up `spares`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn invoke<I, R>(
    runtime: &Runtime,
    backend: &Arc<str>,
    queries: Arc<dyn Queries>,
    function: &'static str,
    ready: Option<Unused<I>>,
    spares: Option<&Arc<Prewarmed>>,
    instantiate: impl Fn(&mut Store<CallState>) -> wasmtime::Result<I>,
    f: impl FnOnce(&I, &mut Store<CallState>) -> wasmtime::Result<R>,
) -> Result<R, CallError> {
    let limits = runtime.limits;
    let _calling = runtime.calling();
    let (mut store, instance) = match ready {
        Some(Unused { store, instance }) => (store, instance),
        None => {
            let mut store =
                prewarm::new_store(&runtime.engine, backend.clone(), queries.clone(), &limits);
            let mut made = instantiate(&mut store);
            // Every slot in use: those of instances made ahead, and of used
            // ones not dropped yet, go to calls.
            // Tried again whether or not this call saw a slot freed: one
            // may have been freed between the first try and the hold.
            // A cold backend (a candidate in the shadow) does not: it
            // would take instances made ahead from serving backends.
            if matches!(&made, Err(e) if !prewarm::guest_fault(&store, e))
                && spares.is_none_or(|s| !s.is_cold())
            {
                let _held = runtime.prewarmer.give_way(|| {
                    runtime.release_spares();
                });
                store = prewarm::new_store(&runtime.engine, backend.clone(), queries, &limits);
                made = instantiate(&mut store);
            }
            match made {
                Ok(instance) => (store, instance),
                // A start function that traps or loops is the guest's fault;
                // anything else (e.g. every pool slot in use) is the host's.
                Err(e) if !prewarm::guest_fault(&store, &e) => {
                    return Err(CallError::Instantiate {
                        backend: backend.to_string(),
                        function,
                        message: format!("{e:#}"),
                    });
                }
                Err(e) => return Err(fault(&store, backend, function, e)),
            }
        }
    };
    let result = f(&instance, &mut store);
    let dropped = store.data().dropped_log_lines();
    if dropped > 0 {
        tracing::warn!(
            backend = &**backend,
            function,
            dropped,
            "guest log lines over the per-call limit were dropped"
        );
    }
    let result = result.map_err(|e| fault(&store, backend, function, e));
    drop(instance);
    if let Some(spares) = spares {
        runtime.prewarmer.retire(Some(store), spares);
    }
    result
}

/// `info`, of a guest of any contract.
pub(crate) fn call_info(
    runtime: &Runtime,
    pre: &Arc<dyn Linked>,
    backend: &Arc<str>,
    queries: Arc<dyn Queries>,
) -> Result<BackendInfo, CallError> {
    invoke(runtime, backend, queries, "info", None, None, |s| pre.instantiate(s), |g, s| g.info(s))
}

fn fault(
    store: &Store<CallState>,
    backend: &str,
    function: &'static str,
    e: wasmtime::Error,
) -> CallError {
    let limits = store.data().limits;
    let backend = backend.to_string();
    if store.data().memory.refused {
        CallError::Memory { backend, function, cap_mib: limits.memory_bytes >> 20 }
    } else if let Some(error) = e.downcast_ref::<super::queries::QueryError>() {
        CallError::Query { backend, function, error: Box::new(error.clone()) }
    } else if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
        CallError::Deadline { backend, function, deadline_ms: limits.deadline.as_millis() }
    } else {
        CallError::Trap { backend, function, message: short(&format!("{e:#}")) }
    }
}

/// Trap messages carry a wasm backtrace; keep them readable in one event.
fn short(message: &str) -> String {
    const MAX: usize = 2000;
    if message.len() <= MAX {
        return message.to_string();
    }
    let mut cut = MAX;
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &message[..cut])
}
