//! Calling a backend: a fresh store and instance per call, a deadline and a
//! memory cap, guest refusals kept apart from traps, and every returned plan
//! or take-over checked before anyone acts on it.

use super::bindings::{
    BackendInfo, BackendPre, CleanupItem, CleanupReason, Consumer, Decision, Holder, NodeFacts,
    NodePaths, Plan, PolicyError, Volume,
};
use super::imports::CallState;
use super::load::Plugin;
use super::queries::Queries;
use super::runtime::Runtime;
use super::validate::{self, PlanError, Roots};
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
    #[error("backend {backend}: fence returned a take-over the host refuses: {reason}")]
    TakeOver { backend: String, reason: String },
}

impl CallError {
    /// True when the guest itself answered with a refusal (not a fault).
    pub fn is_policy_refusal(&self) -> bool {
        matches!(self, CallError::Policy { .. })
    }
}

/// Run `f` against a fresh instance of `pre` under the runtime's limits.
pub(crate) fn run<R>(
    runtime: &Runtime,
    pre: &BackendPre<CallState>,
    backend: &Arc<str>,
    function: &'static str,
    queries: Arc<dyn Queries>,
    f: impl FnOnce(&super::bindings::Backend, &mut Store<CallState>) -> wasmtime::Result<R>,
) -> Result<R, CallError> {
    let limits = runtime.limits;
    let mut store = Store::new(&runtime.engine, CallState::new(backend.clone(), queries, limits.memory_bytes));
    store.limiter(|s| &mut s.memory);
    store.set_epoch_deadline(limits.deadline_ticks());
    store.epoch_deadline_trap();
    let result = pre.instantiate(&mut store).and_then(|instance| f(&instance, &mut store));
    let dropped = store.data().dropped_log_lines();
    if dropped > 0 {
        tracing::warn!(backend = &**backend, function, dropped, "guest log lines over the per-call limit were dropped");
    }
    // The store (and with it a trapped instance) is dropped here.
    result.map_err(|e| {
        let backend = backend.to_string();
        if store.data().memory.refused {
            CallError::Memory { backend, function, cap_mib: limits.memory_bytes >> 20 }
        } else if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            CallError::Deadline { backend, function, deadline_ms: limits.deadline.as_millis() }
        } else {
            CallError::Trap { backend, function, message: short(&format!("{e:#}")) }
        }
    })
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

pub(crate) fn info(runtime: &Runtime, pre: &BackendPre<CallState>, backend: &Arc<str>, queries: Arc<dyn Queries>) -> Result<BackendInfo, CallError> {
    run(runtime, pre, backend, "info", queries, |b, s| b.volagent_policy_policy().call_info(s))
}

impl Plugin {
    fn call<R>(
        &self,
        function: &'static str,
        queries: Arc<dyn Queries>,
        f: impl FnOnce(&super::bindings::Backend, &mut Store<CallState>) -> wasmtime::Result<Result<R, PolicyError>>,
    ) -> Result<R, CallError> {
        run(&self.runtime, &self.pre, &self.name, function, queries, f)?
            .map_err(|error| CallError::Policy { backend: self.name.to_string(), function, error })
    }

    fn checked(&self, function: &'static str, plan: Plan, roots: &Roots, secret_keys: &[String]) -> Result<Plan, CallError> {
        validate::plan(&plan, &self.info().capabilities, roots, secret_keys)
            .map_err(|error| CallError::Plan { backend: self.name.to_string(), function, error })?;
        Ok(plan)
    }

    /// `info` again (it was called once at load).
    pub fn call_info(&self, queries: Arc<dyn Queries>) -> Result<BackendInfo, CallError> {
        info(&self.runtime, &self.pre, &self.name, queries)
    }

    /// May `requester` use `volume`? A take-over is checked: its stale
    /// holders must be recorded holders on provably gone nodes, and its
    /// fence steps storage-level steps the backend declared.
    pub fn fence(
        &self,
        queries: Arc<dyn Queries>,
        volume: &Volume,
        requester: &Consumer,
        holders: &[Holder],
        nodes: &[NodeFacts],
    ) -> Result<Decision, CallError> {
        let decision = self.call("fence", queries, |b, s| {
            b.volagent_policy_policy().call_fence(s, volume, requester, holders, nodes)
        })?;
        if let Decision::TakeOver(take) = &decision {
            validate::take_over(take, holders, nodes, &self.info().capabilities, &volume.secret_keys)
                .map_err(|reason| CallError::TakeOver { backend: self.name.to_string(), reason })?;
        }
        Ok(decision)
    }

    /// The plan attaching `volume` for `requester`, checked.
    pub fn attach(
        &self,
        queries: Arc<dyn Queries>,
        volume: &Volume,
        requester: &Consumer,
        local_holders: &[Holder],
        paths: &NodePaths,
    ) -> Result<Plan, CallError> {
        let plan = self.call("attach", queries, |b, s| {
            b.volagent_policy_policy().call_attach(s, volume, requester, local_holders, paths)
        })?;
        let roots = Roots::for_consumer(paths, std::iter::once(requester));
        self.checked("attach", plan, &roots, &volume.secret_keys)
    }

    /// The plan detaching `volume` from `consumer`, checked.
    pub fn detach(
        &self,
        queries: Arc<dyn Queries>,
        volume: &Volume,
        consumer: &Consumer,
        local_holders: &[Holder],
        paths: &NodePaths,
    ) -> Result<Plan, CallError> {
        let plan = self.call("detach", queries, |b, s| {
            b.volagent_policy_policy().call_detach(s, volume, consumer, local_holders, paths)
        })?;
        let roots = Roots::for_consumer(paths, std::iter::once(consumer));
        self.checked("detach", plan, &roots, &volume.secret_keys)
    }

    /// The plan cleaning up `items`, checked against all their paths.
    pub fn cleanup(&self, queries: Arc<dyn Queries>, reason: CleanupReason, items: &[CleanupItem]) -> Result<Plan, CallError> {
        let plan = self.call("cleanup", queries, |b, s| b.volagent_policy_policy().call_cleanup(s, reason, items))?;
        let roots = Roots::for_cleanup(items);
        let keys: Vec<String> = items.iter().flat_map(|i| i.volume.secret_keys.iter().cloned()).collect();
        self.checked("cleanup", plan, &roots, &keys)
    }
}
