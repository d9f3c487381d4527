//! Calling a backend: each of its functions by the guest's contract, and
//! every returned plan or take-over checked before anyone acts on it.

use super::bindings::{
    Backend, BackendInfo, CleanupItem, CleanupReason, Consumer, Decision, Holder, NodeFacts,
    NodePaths, Plan, PolicyError, Volume,
};
use super::compat::v0_4::volagent::policy::types as old;
use super::compat::{self, convert, v0_4};
use super::imports::CallState;
use super::invoke::{CallError, call_info, invoke, up};
use super::load::Plugin;
use super::pre::Pre;
use super::queries::Queries;
use super::validate::{self, Operation};
use std::sync::Arc;
use wasmtime::Store;

/// The calls of a loaded backend. Each runs on a fresh instance, and every
/// answer is checked before it is returned.
impl Plugin {
    /// One call, by the guest's contract: `current` for a 0.5 guest,
    /// `v0_4` for a 0.4 one (which cannot be asked `unaskable`).
    fn call<R>(
        &self,
        queries: Arc<dyn Queries>,
        function: &'static str,
        unaskable: Option<PolicyError>,
        current: impl FnOnce(
            &Backend,
            &mut Store<CallState>,
        ) -> wasmtime::Result<Result<R, PolicyError>>,
        v0_4: impl FnOnce(
            &v0_4::Backend,
            &mut Store<CallState>,
        ) -> wasmtime::Result<Result<R, PolicyError>>,
    ) -> Result<R, CallError> {
        let start = std::time::Instant::now();
        let result = match (&self.pre, unaskable) {
            (Pre::Current(pre), _) => {
                let ready = self.spares.take(&queries, &self.runtime.limits);
                invoke(
                    &self.runtime,
                    &self.name,
                    queries,
                    function,
                    ready,
                    Some(&self.spares),
                    |s| pre.instantiate(s),
                    current,
                )
            }
            (Pre::V0_4(_), Some(refusal)) => Ok(Err(refusal)),
            (Pre::V0_4(pre), None) => {
                let ready = self.spares.take(&queries, &self.runtime.limits);
                invoke(
                    &self.runtime,
                    &self.name,
                    queries,
                    function,
                    ready,
                    Some(&self.spares),
                    |s| pre.instantiate(s),
                    v0_4,
                )
            }
        }
        .and_then(|r| {
            r.map_err(|error| CallError::Policy { backend: self.name.to_string(), function, error })
        });
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

    fn checked(
        &self,
        function: &'static str,
        plan: Plan,
        op: &Operation,
    ) -> Result<Plan, CallError> {
        validate::plan(&plan, &self.info().capabilities, op).map_err(|error| CallError::Plan {
            backend: self.name.to_string(),
            function,
            error,
        })?;
        Ok(plan)
    }

    /// `info` again (it was called once at load).
    pub fn call_info(&self, queries: Arc<dyn Queries>) -> Result<BackendInfo, CallError> {
        call_info(&self.runtime, &self.pre, &self.name, queries)
    }

    /// May `requester` use `volume`? A take-over is checked: its stale
    /// holders must be recorded holders on provably gone nodes, and its
    /// fence steps storage-level steps the backend declared.
    pub fn fence(
        &self,
        q: Arc<dyn Queries>,
        volume: &Volume,
        requester: &Consumer,
        holders: &[Holder],
        nodes: &[NodeFacts],
    ) -> Result<Decision, CallError> {
        let decision = self.call(
            q,
            "fence",
            compat::unaskable(volume, Some(requester)),
            |b, s| b.volagent_policy_policy().call_fence(s, volume, requester, holders, nodes),
            |b, s| {
                let (h, n): (Vec<old::Holder>, Vec<old::NodeFacts>) =
                    (convert(holders)?, convert(nodes)?);
                up(b.volagent_policy_policy().call_fence(
                    s,
                    &convert(volume)?,
                    &convert(requester)?,
                    &h,
                    &n,
                )?)
            },
        )?;
        if let Decision::TakeOver(take) = &decision {
            validate::take_over(take, holders, nodes, &self.info().capabilities, volume)
                .map_err(|reason| CallError::TakeOver { backend: self.name.to_string(), reason })?;
        }
        Ok(decision)
    }

    /// The plan attaching `volume` for `requester`, checked.
    pub fn attach(
        &self,
        q: Arc<dyn Queries>,
        volume: &Volume,
        requester: &Consumer,
        local_holders: &[Holder],
        paths: &NodePaths,
    ) -> Result<Plan, CallError> {
        let plan = self.call(
            q,
            "attach",
            compat::unaskable(volume, Some(requester)),
            |b, s| {
                b.volagent_policy_policy().call_attach(s, volume, requester, local_holders, paths)
            },
            |b, s| {
                let h: Vec<old::Holder> = convert(local_holders)?;
                up(b.volagent_policy_policy().call_attach(
                    s,
                    &convert(volume)?,
                    &convert(requester)?,
                    &h,
                    &convert(paths)?,
                )?)
            },
        )?;
        self.checked("attach", plan, &Operation::Attach { volume, consumer: requester, paths })
    }

    /// The plan detaching `volume` from `consumer`, checked.
    pub fn detach(
        &self,
        q: Arc<dyn Queries>,
        volume: &Volume,
        consumer: &Consumer,
        local_holders: &[Holder],
        paths: &NodePaths,
    ) -> Result<Plan, CallError> {
        let plan = self.call(
            q,
            "detach",
            compat::unaskable(volume, Some(consumer)),
            |b, s| {
                b.volagent_policy_policy().call_detach(s, volume, consumer, local_holders, paths)
            },
            |b, s| {
                let h: Vec<old::Holder> = convert(local_holders)?;
                up(b.volagent_policy_policy().call_detach(
                    s,
                    &convert(volume)?,
                    &convert(consumer)?,
                    &h,
                    &convert(paths)?,
                )?)
            },
        )?;
        self.checked("detach", plan, &Operation::Detach { volume, consumer, paths })
    }

    /// The plan growing `volume` where `consumer` has it, checked. A 0.4
    /// guest was never asked: the host grows the filesystem at the
    /// consumer's dir itself, as it did for 0.4.
    pub fn expand(
        &self,
        q: Arc<dyn Queries>,
        volume: &Volume,
        consumer: &Consumer,
        paths: &NodePaths,
    ) -> Result<Plan, CallError> {
        let grow = || {
            vec![crate::policy::Step::GrowFilesystem(crate::policy::GrowFilesystem {
                target: consumer.mount_dir.clone(),
            })]
        };
        if let Pre::V0_4(_) = self.pre {
            if let Some(error) = compat::unaskable(volume, Some(consumer)) {
                return Err(CallError::Policy {
                    backend: self.name.to_string(),
                    function: "expand",
                    error,
                });
            }
            return Ok(grow());
        }
        let plan = self.call(
            q,
            "expand",
            None,
            |b, s| b.volagent_policy_policy().call_expand(s, volume, consumer, paths),
            |_, _| Ok(Ok(grow())),
        )?;
        self.checked("expand", plan, &Operation::Expand { volume, consumer, paths })
    }

    /// Why `volume` is not healthy where `consumer` has it, by the backend;
    /// a 0.4 guest was never asked (none). Bounded: it is shown to people.
    pub fn condition(
        &self,
        q: Arc<dyn Queries>,
        volume: &Volume,
        consumer: &Consumer,
        paths: &NodePaths,
    ) -> Result<Option<String>, CallError> {
        let said = self.call(
            q,
            "condition",
            None,
            |b, s| b.volagent_policy_policy().call_condition(s, volume, consumer, paths).map(Ok),
            |_, _| Ok(Ok(None)),
        )?;
        Ok(said.map(|m| crate::text::bounded(m, 1024)))
    }

    /// The plan cleaning up `items`, checked against all their paths.
    pub fn cleanup(
        &self,
        q: Arc<dyn Queries>,
        reason: CleanupReason,
        items: &[CleanupItem],
    ) -> Result<Plan, CallError> {
        let unaskable = items.iter().find_map(|i| compat::unaskable(&i.volume, None));
        let plan = self.call(
            q,
            "cleanup",
            unaskable,
            |b, s| b.volagent_policy_policy().call_cleanup(s, reason, items),
            |b, s| {
                let i: Vec<old::CleanupItem> = convert(items)?;
                up(b.volagent_policy_policy().call_cleanup(s, convert(&reason)?, &i)?)
            },
        )?;
        self.checked("cleanup", plan, &Operation::Cleanup { reason, items })
    }
}
