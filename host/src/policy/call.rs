//! Calling a backend: a fresh store and instance per call, a deadline and a
//! memory cap, guest refusals kept apart from traps, and every returned plan
//! or take-over checked before anyone acts on it.

use super::bindings::{
    Backend, BackendInfo, BackendPre, CleanupItem, CleanupReason, Consumer, Decision, Holder, NodeFacts,
    NodePaths, Plan, PolicyError, Volume,
};
use super::imports::CallState;
use super::load::Plugin;
use super::queries::Queries;
use super::runtime::Runtime;
use super::validate::{self, Operation, PlanError};
use std::sync::Arc;
use wasmtime::{Store, Trap};

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("backend {backend}: {function} ran past its deadline of {deadline_ms} ms and was stopped")]
    Deadline { backend: String, function: &'static str, deadline_ms: u128 },
    #[error("backend {backend}: {function} tried to grow its memory past the cap of {cap_mib} MiB and was stopped")]
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
pub(crate) fn invoke<R>(
    runtime: &Runtime,
    pre: &BackendPre<CallState>,
    backend: &Arc<str>,
    queries: Arc<dyn Queries>,
    function: &'static str,
    f: impl FnOnce(&Backend, &mut Store<CallState>) -> wasmtime::Result<R>,
) -> Result<R, CallError> {
    let limits = runtime.limits;
    let mut store = Store::new(&runtime.engine, CallState::new(backend.clone(), queries, limits));
    store.limiter(|s| &mut s.memory);
    store.epoch_deadline_trap();
    store.set_epoch_deadline(limits.deadline_ticks());
    let instance = match pre.instantiate(&mut store) {
        Ok(instance) => instance,
        // A start function that traps or loops is the guest's fault;
        // anything else (e.g. every pool slot in use) is the host's.
        Err(e) if e.downcast_ref::<Trap>().is_none() && !store.data().memory.refused => {
            return Err(CallError::Instantiate { backend: backend.to_string(), function, message: format!("{e:#}") });
        }
        Err(e) => return Err(fault(&store, backend, function, e)),
    };
    let result = f(&instance, &mut store);
    let dropped = store.data().dropped_log_lines();
    if dropped > 0 {
        tracing::warn!(backend = &**backend, function, dropped, "guest log lines over the per-call limit were dropped");
    }
    result.map_err(|e| fault(&store, backend, function, e))
}

fn fault(store: &Store<CallState>, backend: &str, function: &'static str, e: wasmtime::Error) -> CallError {
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

/// The calls of a loaded backend. Each runs on a fresh instance, and every
/// answer is checked before it is returned.
impl Plugin {
    fn invoke<R>(
        &self,
        queries: Arc<dyn Queries>,
        function: &'static str,
        f: impl FnOnce(&Backend, &mut Store<CallState>) -> wasmtime::Result<Result<R, PolicyError>>,
    ) -> Result<R, CallError> {
        let start = std::time::Instant::now();
        let result = invoke(&self.runtime, &self.pre, &self.name, queries, function, f)
            .and_then(|r| r.map_err(|error| CallError::Policy { backend: self.name.to_string(), function, error }));
        let outcome = match &result {
            Ok(_) => "ok",
            Err(CallError::Policy { .. }) => "refused",
            Err(CallError::Deadline { .. }) => "deadline",
            Err(CallError::Memory { .. }) => "memory",
            Err(CallError::Query { .. }) => "query",
            Err(_) => "fault",
        };
        crate::metrics::get().plugin_call(&self.name, function, outcome, start.elapsed());
        result
    }

    fn checked(&self, function: &'static str, plan: Plan, op: &Operation) -> Result<Plan, CallError> {
        validate::plan(&plan, &self.info().capabilities, op)
            .map_err(|error| CallError::Plan { backend: self.name.to_string(), function, error })?;
        Ok(plan)
    }

    /// `info` again (it was called once at load).
    pub fn call_info(&self, queries: Arc<dyn Queries>) -> Result<BackendInfo, CallError> {
        invoke(&self.runtime, &self.pre, &self.name, queries, "info", |b, s| b.volagent_policy_policy().call_info(s))
    }

    /// May `requester` use `volume`? A take-over is checked: its stale
    /// holders must be recorded holders on provably gone nodes, and its
    /// fence steps storage-level steps the backend declared.
    pub fn fence(&self, q: Arc<dyn Queries>, volume: &Volume, requester: &Consumer, holders: &[Holder], nodes: &[NodeFacts]) -> Result<Decision, CallError> {
        let decision = self.invoke(q, "fence", |b, s| b.volagent_policy_policy().call_fence(s, volume, requester, holders, nodes))?;
        if let Decision::TakeOver(take) = &decision {
            validate::take_over(take, holders, nodes, &self.info().capabilities, volume)
                .map_err(|reason| CallError::TakeOver { backend: self.name.to_string(), reason })?;
        }
        Ok(decision)
    }

    /// The plan attaching `volume` for `requester`, checked.
    pub fn attach(&self, q: Arc<dyn Queries>, volume: &Volume, requester: &Consumer, local_holders: &[Holder], paths: &NodePaths) -> Result<Plan, CallError> {
        let plan = self.invoke(q, "attach", |b, s| b.volagent_policy_policy().call_attach(s, volume, requester, local_holders, paths))?;
        self.checked("attach", plan, &Operation::Attach { volume, consumer: requester, paths })
    }

    /// The plan detaching `volume` from `consumer`, checked.
    pub fn detach(&self, q: Arc<dyn Queries>, volume: &Volume, consumer: &Consumer, local_holders: &[Holder], paths: &NodePaths) -> Result<Plan, CallError> {
        let plan = self.invoke(q, "detach", |b, s| b.volagent_policy_policy().call_detach(s, volume, consumer, local_holders, paths))?;
        self.checked("detach", plan, &Operation::Detach { volume, consumer, paths })
    }

    /// The plan cleaning up `items`, checked against all their paths.
    pub fn cleanup(&self, q: Arc<dyn Queries>, reason: CleanupReason, items: &[CleanupItem]) -> Result<Plan, CallError> {
        let plan = self.invoke(q, "cleanup", |b, s| b.volagent_policy_policy().call_cleanup(s, reason, items))?;
        self.checked("cleanup", plan, &Operation::Cleanup { reason, items })
    }
}
