//! Calling a backend: each of its functions by the guest's contract, and
//! every returned plan or take-over checked before anyone acts on it.

use super::contract::{Answer, Guest, ProvisionCall};
use super::imports::CallState;
use super::invoke::{CallError, call_info, invoke};
use super::load::Plugin;
use super::queries::Queries;
use super::recorded::{
    self, Answered, AttachInput, CallInput, CleanupInput, Decided, DetachInput, ExpandInput,
    FenceInput, RecordingQueries,
};
use super::validate::{self, Operation};
use crate::model::{
    BackendInfo, CapacityRequest, CleanupItem, CleanupReason, Consumer, CreateRequest, Decision,
    GrowFilesystem, Holder, NodeFacts, NodePaths, Plan, PolicyError, Provision, ProvisionError,
    Step, Target, Volume,
};
use std::sync::Arc;
use wasmtime::Store;

/// The calls of a loaded backend. Each runs on a fresh instance, and every
/// answer is checked before it is returned.
impl Plugin {
    /// One call, in the host's model whatever contract the guest speaks;
    /// a request the guest's contract cannot ask (`unaskable`) is refused
    /// without calling it.
    fn call<R>(
        &self,
        queries: Arc<dyn Queries>,
        function: &'static str,
        unaskable: Option<PolicyError>,
        f: impl FnOnce(&dyn Guest, &mut Store<CallState>) -> Answer<R>,
    ) -> Result<R, CallError> {
        let start = std::time::Instant::now();
        let result = match unaskable {
            Some(refusal) => Ok(Err(refusal)),
            None => {
                let ready = self.spares.take(&queries, &self.runtime.limits);
                invoke(
                    &self.runtime,
                    &self.name,
                    queries,
                    function,
                    ready,
                    Some(&self.spares),
                    |s| self.pre.instantiate(s),
                    |g, s| f(&**g, s),
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
        // A candidate's calls are the shadow's, counted by it: they must not
        // show as the serving backend's.
        if !self.spares.is_cold() {
            crate::metrics::get().plugin_call(&self.name, function, outcome, start.elapsed());
        }
        result
    }

    /// `call`, seen by the backend's tap when it wants to: the queries are
    /// written down as the guest asks them, and the tap gets the inputs,
    /// the answers and the outcome once the call's own answer is taken.
    fn observed<R>(
        &self,
        q: Arc<dyn Queries>,
        input: impl FnOnce() -> CallInput,
        answer: impl FnOnce(&R) -> recorded::Answer,
        call: impl FnOnce(Arc<dyn Queries>) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        let Some(tap) = self.tap.get().filter(|t| t.wants()) else {
            return call(q);
        };
        let at = std::time::SystemTime::now();
        let recording = RecordingQueries::new(q);
        let result = call(recording.clone());
        tap.seen(Decided {
            backend: self.name.clone(),
            version: self.info().version.clone(),
            sha256: self.sha256().to_string(),
            at,
            input: input(),
            host: recording.take(),
            answered: Answered::of_ref(&result, answer),
        });
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
        let input = || {
            CallInput::Fence(FenceInput {
                volume: volume.clone(),
                requester: requester.clone(),
                holders: holders.to_vec(),
                nodes: nodes.to_vec(),
            })
        };
        self.observed(
            q,
            input,
            |d: &Decision| recorded::Answer::Decision(d.clone()),
            |q| {
                let decision =
                    self.call(q, "fence", self.pre.unaskable(volume, Some(requester)), |g, s| {
                        g.fence(s, volume, requester, holders, nodes)
                    })?;
                if let Decision::TakeOver(take) = &decision {
                    validate::take_over(take, holders, nodes, &self.info().capabilities, volume)
                        .map_err(|reason| CallError::TakeOver {
                            backend: self.name.to_string(),
                            reason,
                        })?;
                }
                Ok(decision)
            },
        )
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
        let input = || {
            CallInput::Attach(AttachInput {
                volume: volume.clone(),
                requester: requester.clone(),
                local_holders: local_holders.to_vec(),
                paths: paths.clone(),
            })
        };
        self.observed(
            q,
            input,
            |p: &Plan| recorded::Answer::Plan(p.clone()),
            |q| {
                let plan =
                    self.call(q, "attach", self.pre.unaskable(volume, Some(requester)), |g, s| {
                        g.attach(s, volume, requester, local_holders, paths)
                    })?;
                self.checked(
                    "attach",
                    plan,
                    &Operation::Attach { volume, consumer: requester, paths },
                )
            },
        )
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
        let input = || {
            CallInput::Detach(DetachInput {
                volume: volume.clone(),
                consumer: consumer.clone(),
                local_holders: local_holders.to_vec(),
                paths: paths.clone(),
            })
        };
        self.observed(
            q,
            input,
            |p: &Plan| recorded::Answer::Plan(p.clone()),
            |q| {
                let plan =
                    self.call(q, "detach", self.pre.unaskable(volume, Some(consumer)), |g, s| {
                        g.detach(s, volume, consumer, local_holders, paths)
                    })?;
                self.checked("detach", plan, &Operation::Detach { volume, consumer, paths })
            },
        )
    }

    /// The plan growing `volume` where `consumer` has it, checked. A guest
    /// with no expand of its own (0.4) is not asked: the host grows the
    /// filesystem at the consumer's dir itself.
    pub fn expand(
        &self,
        q: Arc<dyn Queries>,
        volume: &Volume,
        consumer: &Consumer,
        paths: &NodePaths,
    ) -> Result<Plan, CallError> {
        let input = || CallInput::Expand(expand_input(volume, consumer, paths));
        self.observed(
            q,
            input,
            |p: &Plan| recorded::Answer::Plan(p.clone()),
            |q| {
                let plan =
                    self.call(q, "expand", self.pre.unaskable(volume, Some(consumer)), |g, s| {
                        g.expand(s, volume, consumer, paths)
                    })?;
                match plan {
                    Some(plan) => {
                        self.checked("expand", plan, &Operation::Expand { volume, consumer, paths })
                    }
                    // No expand of the guest's own: the host's, unchecked against
                    // capabilities the guest never declared for it.
                    None => Ok(vec![Step::GrowFilesystem(GrowFilesystem {
                        target: consumer.mount_dir.clone(),
                    })]),
                }
            },
        )
    }

    /// Why `volume` is not healthy where `consumer` has it, by the backend;
    /// none from a guest with no say (0.4). Bounded: it is shown to people.
    pub fn condition(
        &self,
        q: Arc<dyn Queries>,
        volume: &Volume,
        consumer: &Consumer,
        paths: &NodePaths,
    ) -> Result<Option<String>, CallError> {
        let input = || CallInput::Condition(expand_input(volume, consumer, paths));
        self.observed(
            q,
            input,
            |c: &Option<String>| recorded::Answer::Condition(c.clone()),
            |q| {
                let said = self.call(q, "condition", None, |g, s| {
                    g.condition(s, volume, consumer, paths).map(Ok)
                })?;
                Ok(said.map(|m| crate::text::bounded(m, 1024)))
            },
        )
    }

    /// The plan cleaning up `items`, checked against all their paths.
    pub fn cleanup(
        &self,
        q: Arc<dyn Queries>,
        reason: CleanupReason,
        items: &[CleanupItem],
    ) -> Result<Plan, CallError> {
        let input = || CallInput::Cleanup(CleanupInput { reason, items: items.to_vec() });
        self.observed(
            q,
            input,
            |p: &Plan| recorded::Answer::Plan(p.clone()),
            |q| {
                let unaskable = items.iter().find_map(|i| self.pre.unaskable(&i.volume, None));
                let plan =
                    self.call(q, "cleanup", unaskable, |g, s| g.cleanup(s, reason, items))?;
                self.checked("cleanup", plan, &Operation::Cleanup { reason, items })
            },
        )
    }

    /// Whether the backend provisions volumes (exports the provisioner).
    pub fn provisions(&self) -> bool {
        self.pre.provisions()
    }

    /// A provisioner call: its refusal as `Ok(Err(..))`, a fault (trap,
    /// deadline, a plan the host refuses) as `Err`. The plan is checked.
    fn provisioner<R>(
        &self,
        function: &'static str,
        f: impl FnOnce(&dyn Guest, &mut Store<CallState>) -> wasmtime::Result<Result<R, ProvisionError>>,
    ) -> Result<Result<R, ProvisionError>, CallError> {
        if !self.provisions() {
            return Ok(Err(ProvisionError::Unsupported(format!(
                "backend {} does not provision volumes: its policy does not export {}/provisioner",
                self.name,
                super::CONTRACT_PACKAGE
            ))));
        }
        // No queries: a provisioner decides from its request alone.
        let queries: Arc<dyn Queries> = Arc::new(super::queries::RecordedQueries::default());
        self.call(queries, function, None, |g, s| f(g, s).map(Ok))
    }

    /// The controller plan for `call`, checked.
    fn provision(
        &self,
        call: ProvisionCall<'_>,
    ) -> Result<Result<Provision, ProvisionError>, CallError> {
        let function = call.function();
        let answer = self.provisioner(function, |g, s| g.provision(s, call))?;
        if let Ok(p) = &answer {
            let needs_id = matches!(call, ProvisionCall::Create(_) | ProvisionCall::Snapshot(_));
            validate::provision(p, &self.info().capabilities, needs_id).map_err(|error| {
                CallError::Plan { backend: self.name.to_string(), function, error }
            })?;
        }
        Ok(answer)
    }

    pub fn create_volume(
        &self,
        request: &CreateRequest,
    ) -> Result<Result<Provision, ProvisionError>, CallError> {
        self.provision(ProvisionCall::Create(request))
    }

    pub fn delete_volume(
        &self,
        target: &Target,
    ) -> Result<Result<Provision, ProvisionError>, CallError> {
        self.provision(ProvisionCall::Delete(target))
    }

    pub fn expand_volume(
        &self,
        target: &Target,
    ) -> Result<Result<Provision, ProvisionError>, CallError> {
        self.provision(ProvisionCall::Expand(target))
    }

    pub fn snapshot(
        &self,
        target: &Target,
    ) -> Result<Result<Provision, ProvisionError>, CallError> {
        self.provision(ProvisionCall::Snapshot(target))
    }

    pub fn delete_snapshot(
        &self,
        target: &Target,
    ) -> Result<Result<Provision, ProvisionError>, CallError> {
        self.provision(ProvisionCall::DeleteSnapshot(target))
    }

    /// Bytes a new volume could get where `request` asks; none: unknown.
    pub fn capacity(
        &self,
        request: &CapacityRequest,
    ) -> Result<Result<Option<u64>, ProvisionError>, CallError> {
        self.provisioner("capacity", |g, s| g.capacity(s, request))
    }
}

fn expand_input(volume: &Volume, consumer: &Consumer, paths: &NodePaths) -> ExpandInput {
    ExpandInput { volume: volume.clone(), consumer: consumer.clone(), paths: paths.clone() }
}
