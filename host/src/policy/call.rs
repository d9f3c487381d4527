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
    #[error("backend {backend}: cannot start an instance for {function}: {message}")]
    Instantiate { backend: String, function: &'static str, message: String },
    #[error("backend {backend}: {function} not called: an earlier call of this operation failed")]
    Ended { backend: String, function: &'static str },
    #[error("backend {backend}: fence returned a take-over the host refuses: {reason}")]
    TakeOver { backend: String, reason: String },
}

impl CallError {
    /// True when the guest itself answered with a refusal (not a fault).
    pub fn is_policy_refusal(&self) -> bool {
        matches!(self, CallError::Policy { .. })
    }
}

/// One store and instance under the runtime's limits; the calls on it are
/// not checked (see [`Session`]).
pub(crate) struct RawSession<'p> {
    runtime: &'p Runtime,
    pre: &'p BackendPre<CallState>,
    backend: &'p Arc<str>,
    store: Store<CallState>,
    instance: Option<Backend>,
    ended: bool,
}

impl<'p> RawSession<'p> {
    pub(crate) fn new(runtime: &'p Runtime, pre: &'p BackendPre<CallState>, backend: &'p Arc<str>, queries: Arc<dyn Queries>) -> Self {
        let mut store = Store::new(&runtime.engine, CallState::new(backend.clone(), queries, runtime.limits.memory_bytes));
        store.limiter(|s| &mut s.memory);
        store.epoch_deadline_trap();
        RawSession { runtime, pre, backend, store, instance: None, ended: false }
    }

    /// Run `f` on the instance (instantiating it on first use) within the
    /// deadline.
    fn run<R>(&mut self, function: &'static str, f: impl FnOnce(&Backend, &mut Store<CallState>) -> wasmtime::Result<R>) -> Result<R, CallError> {
        if self.ended {
            return Err(CallError::Ended { backend: self.backend.to_string(), function });
        }
        self.store.set_epoch_deadline(self.runtime.limits.deadline_ticks());
        if self.instance.is_none() {
            match self.pre.instantiate(&mut self.store) {
                Ok(instance) => self.instance = Some(instance),
                // A start function that traps or loops is the guest's fault;
                // anything else (e.g. every pool slot in use) is the host's.
                Err(e) if e.downcast_ref::<Trap>().is_none() && !self.store.data().memory.refused => {
                    self.ended = true;
                    return Err(CallError::Instantiate { backend: self.backend.to_string(), function, message: format!("{e:#}") });
                }
                Err(e) => return Err(self.fault(function, e)),
            }
        }
        let Some(instance) = &self.instance else {
            return Err(CallError::Ended { backend: self.backend.to_string(), function });
        };
        let result = f(instance, &mut self.store);
        result.map_err(|e| self.fault(function, e))
    }

    /// Classify a failed call and end the session: a trapped instance may
    /// be in any state, so it is never called again.
    fn fault(&mut self, function: &'static str, e: wasmtime::Error) -> CallError {
        self.ended = true;
        self.instance = None;
        let limits = self.runtime.limits;
        let backend = self.backend.to_string();
        if self.store.data().memory.refused {
            CallError::Memory { backend, function, cap_mib: limits.memory_bytes >> 20 }
        } else if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            CallError::Deadline { backend, function, deadline_ms: limits.deadline.as_millis() }
        } else {
            CallError::Trap { backend, function, message: short(&format!("{e:#}")) }
        }
    }

    /// A call whose WIT result is `result<T, policy-error>`.
    fn call<R>(
        &mut self,
        function: &'static str,
        f: impl FnOnce(&Backend, &mut Store<CallState>) -> wasmtime::Result<Result<R, PolicyError>>,
    ) -> Result<R, CallError> {
        self.run(function, f)?
            .map_err(|error| CallError::Policy { backend: self.backend.to_string(), function, error })
    }

    pub fn info(&mut self) -> Result<BackendInfo, CallError> {
        self.run("info", |b, s| b.volagent_policy_policy().call_info(s))
    }
}

impl Drop for RawSession<'_> {
    fn drop(&mut self) {
        let dropped = self.store.data().dropped_log_lines();
        if dropped > 0 {
            tracing::warn!(backend = &**self.backend, dropped, "guest log lines over the per-call limit were dropped");
        }
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

/// One instance serving the calls of one operation on one volume (e.g. a
/// mount's fence and then its attach plan). A fresh one per operation, so
/// nothing leaks between volumes or operations; every call has its own
/// deadline; a call that traps ends the session and its instance. Every
/// answer is checked before it is returned. Each `Plugin` call method runs
/// in a session of its own.
pub struct Session<'p> {
    plugin: &'p Plugin,
    session: RawSession<'p>,
}

impl Plugin {
    /// A session for one operation's calls (see [`RawSession`]).
    pub fn session(&self, queries: Arc<dyn Queries>) -> Session<'_> {
        Session { plugin: self, session: RawSession::new(&self.runtime, &self.pre, &self.name, queries) }
    }

    pub fn call_info(&self, queries: Arc<dyn Queries>) -> Result<BackendInfo, CallError> {
        self.session(queries).session.info()
    }

    pub fn fence(&self, q: Arc<dyn Queries>, volume: &Volume, requester: &Consumer, holders: &[Holder], nodes: &[NodeFacts]) -> Result<Decision, CallError> {
        self.session(q).fence(volume, requester, holders, nodes)
    }

    pub fn attach(&self, q: Arc<dyn Queries>, volume: &Volume, requester: &Consumer, local_holders: &[Holder], paths: &NodePaths) -> Result<Plan, CallError> {
        self.session(q).attach(volume, requester, local_holders, paths)
    }

    pub fn detach(&self, q: Arc<dyn Queries>, volume: &Volume, consumer: &Consumer, local_holders: &[Holder], paths: &NodePaths) -> Result<Plan, CallError> {
        self.session(q).detach(volume, consumer, local_holders, paths)
    }

    pub fn cleanup(&self, q: Arc<dyn Queries>, reason: CleanupReason, items: &[CleanupItem]) -> Result<Plan, CallError> {
        self.session(q).cleanup(reason, items)
    }
}

impl Session<'_> {
    fn checked(&self, function: &'static str, plan: Plan, roots: &Roots, secret_keys: &[String]) -> Result<Plan, CallError> {
        validate::plan(&plan, &self.plugin.info().capabilities, roots, secret_keys)
            .map_err(|error| CallError::Plan { backend: self.plugin.name().to_string(), function, error })?;
        Ok(plan)
    }

    /// May `requester` use `volume`? A take-over is checked: its stale
    /// holders must be recorded holders on provably gone nodes, and its
    /// fence steps storage-level steps the backend declared.
    pub fn fence(&mut self, volume: &Volume, requester: &Consumer, holders: &[Holder], nodes: &[NodeFacts]) -> Result<Decision, CallError> {
        let decision = self
            .session
            .call("fence", |b, s| b.volagent_policy_policy().call_fence(s, volume, requester, holders, nodes))?;
        if let Decision::TakeOver(take) = &decision {
            validate::take_over(take, holders, nodes, &self.plugin.info().capabilities, &volume.secret_keys)
                .map_err(|reason| CallError::TakeOver { backend: self.plugin.name().to_string(), reason })?;
        }
        Ok(decision)
    }

    /// The plan attaching `volume` for `requester`, checked.
    pub fn attach(&mut self, volume: &Volume, requester: &Consumer, local_holders: &[Holder], paths: &NodePaths) -> Result<Plan, CallError> {
        let plan = self
            .session
            .call("attach", |b, s| b.volagent_policy_policy().call_attach(s, volume, requester, local_holders, paths))?;
        self.checked("attach", plan, &Roots::for_consumer(paths, std::iter::once(requester)), &volume.secret_keys)
    }

    /// The plan detaching `volume` from `consumer`, checked.
    pub fn detach(&mut self, volume: &Volume, consumer: &Consumer, local_holders: &[Holder], paths: &NodePaths) -> Result<Plan, CallError> {
        let plan = self
            .session
            .call("detach", |b, s| b.volagent_policy_policy().call_detach(s, volume, consumer, local_holders, paths))?;
        self.checked("detach", plan, &Roots::for_consumer(paths, std::iter::once(consumer)), &volume.secret_keys)
    }

    /// The plan cleaning up `items`, checked against all their paths.
    pub fn cleanup(&mut self, reason: CleanupReason, items: &[CleanupItem]) -> Result<Plan, CallError> {
        let plan = self.session.call("cleanup", |b, s| b.volagent_policy_policy().call_cleanup(s, reason, items))?;
        let keys: Vec<String> = items.iter().flat_map(|i| i.volume.secret_keys.iter().cloned()).collect();
        self.checked("cleanup", plan, &Roots::for_cleanup(items), &keys)
    }
}
