//! A call as a recording keeps it: its inputs, every answer the host gave
//! the guest, and what came out, in the host's model. The agent's tap
//! ([`Tap`]) sees each call this way; recordings and the shadow are made
//! from it, and a recorded call is a scenario ([`Decided::scenario`]) that
//! replays against any version of the backend.

use super::invoke::CallError;
use super::load::Plugin;
use super::queries::{Queries, QueryError, RecordedQueries, WatchersAnswer};
use crate::model::{
    BackendInfo, CleanupItem, CleanupReason, Consumer, Decision, Holder, MountEntry, NodeFacts,
    NodePaths, PathKind, Plan, PolicyError, Volume, Watcher,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FenceInput {
    pub volume: Volume,
    pub requester: Consumer,
    #[serde(default)]
    pub holders: Vec<Holder>,
    #[serde(default)]
    pub nodes: Vec<NodeFacts>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AttachInput {
    pub volume: Volume,
    pub requester: Consumer,
    #[serde(default)]
    pub local_holders: Vec<Holder>,
    pub paths: NodePaths,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DetachInput {
    pub volume: Volume,
    pub consumer: Consumer,
    #[serde(default)]
    pub local_holders: Vec<Holder>,
    pub paths: NodePaths,
}

/// An expand's or a condition's input.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExpandInput {
    pub volume: Volume,
    pub consumer: Consumer,
    pub paths: NodePaths,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CleanupInput {
    pub reason: CleanupReason,
    pub items: Vec<CleanupItem>,
}

/// One call of a backend and its inputs.
#[derive(Debug, Clone)]
pub enum CallInput {
    Info,
    Fence(FenceInput),
    Attach(AttachInput),
    Detach(DetachInput),
    Expand(ExpandInput),
    Condition(ExpandInput),
    Cleanup(CleanupInput),
}

impl CallInput {
    /// The call's name, as scenario files spell it.
    pub fn function(&self) -> &'static str {
        match self {
            CallInput::Info => "info",
            CallInput::Fence(_) => "fence",
            CallInput::Attach(_) => "attach",
            CallInput::Detach(_) => "detach",
            CallInput::Expand(_) => "expand",
            CallInput::Condition(_) => "condition",
            CallInput::Cleanup(_) => "cleanup",
        }
    }

    /// The input as a scenario's `input`.
    pub fn to_value(&self) -> Value {
        let v = match self {
            CallInput::Info => return Value::Object(Map::new()),
            CallInput::Fence(i) => serde_json::to_value(i),
            CallInput::Attach(i) => serde_json::to_value(i),
            CallInput::Detach(i) => serde_json::to_value(i),
            CallInput::Expand(i) | CallInput::Condition(i) => serde_json::to_value(i),
            CallInput::Cleanup(i) => serde_json::to_value(i),
        };
        // The model's types always serialize.
        v.unwrap_or(Value::Null)
    }

    /// One line for people: the call, the volume, the pod and the node.
    pub fn summary(&self) -> String {
        let about = |f: &str, v: &Volume, c: &Consumer| {
            format!("{f} {} for {}/{} on {}", v.name, c.pod_namespace, c.pod, c.node)
        };
        match self {
            CallInput::Info => "info".to_string(),
            CallInput::Fence(i) => about("fence", &i.volume, &i.requester),
            CallInput::Attach(i) => about("attach", &i.volume, &i.requester),
            CallInput::Detach(i) => about("detach", &i.volume, &i.consumer),
            CallInput::Expand(i) => about("expand", &i.volume, &i.consumer),
            CallInput::Condition(i) => about("condition", &i.volume, &i.consumer),
            CallInput::Cleanup(i) => {
                let names: Vec<&str> = i.items.iter().map(|i| i.volume.name.as_str()).collect();
                format!("cleanup ({:?}) of {}", i.reason, names.join(", "))
            }
        }
    }

    /// Make the call on `plugin`, answering its queries with `queries`.
    pub fn answer(&self, plugin: &Plugin, q: Arc<dyn Queries>) -> Answered {
        match self {
            CallInput::Info => Answered::of(plugin.call_info(q), |i| Answer::Info(i.clone())),
            CallInput::Fence(i) => {
                Answered::of(plugin.fence(q, &i.volume, &i.requester, &i.holders, &i.nodes), |d| {
                    Answer::Decision(d.clone())
                })
            }
            CallInput::Attach(i) => Answered::of(
                plugin.attach(q, &i.volume, &i.requester, &i.local_holders, &i.paths),
                |p| Answer::Plan(p.clone()),
            ),
            CallInput::Detach(i) => Answered::of(
                plugin.detach(q, &i.volume, &i.consumer, &i.local_holders, &i.paths),
                |p| Answer::Plan(p.clone()),
            ),
            CallInput::Expand(i) => {
                Answered::of(plugin.expand(q, &i.volume, &i.consumer, &i.paths), |p| {
                    Answer::Plan(p.clone())
                })
            }
            CallInput::Condition(i) => {
                Answered::of(plugin.condition(q, &i.volume, &i.consumer, &i.paths), |c| {
                    Answer::Condition(c.clone())
                })
            }
            CallInput::Cleanup(i) => {
                Answered::of(plugin.cleanup(q, i.reason, &i.items), |p| Answer::Plan(p.clone()))
            }
        }
    }
}

/// What a call came to, in the host's model: the guest's answer, its own
/// refusal, or the host's (a fault, a plan it refuses, a stopped call).
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Info(BackendInfo),
    Decision(Decision),
    Plan(Plan),
    Condition(Option<String>),
    Error(PolicyError),
    Refused(String),
}

impl Answer {
    /// The outcome as a scenario writes it: `{decision: ..}`, `{plan: ..}`,
    /// `{info: ..}`, `{condition: ..}`, `{error: ..}` or `{refused: ".."}`.
    pub fn to_value(&self) -> Value {
        let (key, value) = match self {
            Answer::Info(i) => ("info", serde_json::to_value(i)),
            Answer::Decision(d) => ("decision", serde_json::to_value(d)),
            Answer::Plan(p) => ("plan", serde_json::to_value(p)),
            Answer::Condition(c) => ("condition", serde_json::to_value(c)),
            Answer::Error(e) => ("error", serde_json::to_value(e)),
            Answer::Refused(m) => ("refused", Ok(Value::String(m.clone()))),
        };
        let mut map = Map::new();
        map.insert(key.to_string(), value.unwrap_or(Value::Null));
        Value::Object(map)
    }
}

/// An answer, and whether the call failed on the host's side: a host
/// query that failed (a hung path, a query outside the backend's dirs) or
/// no instance to be had (the pool full). Such a call says nothing of the
/// policy, and cannot be replayed from its answers.
#[derive(Debug, Clone)]
pub struct Answered {
    pub answer: Answer,
    pub host_failed: bool,
}

impl Answered {
    pub fn of<R>(result: Result<R, CallError>, ok: impl FnOnce(&R) -> Answer) -> Answered {
        Answered::of_ref(&result, ok)
    }

    pub fn of_ref<R>(result: &Result<R, CallError>, ok: impl FnOnce(&R) -> Answer) -> Answered {
        let answer = match result {
            Ok(r) => ok(r),
            Err(CallError::Policy { error, .. }) => Answer::Error(error.clone()),
            Err(e) => Answer::Refused(e.to_string()),
        };
        let host_failed =
            matches!(result, Err(CallError::Query { .. } | CallError::Instantiate { .. }));
        Answered { answer, host_failed }
    }
}

/// A call a tap saw.
#[derive(Debug, Clone)]
pub struct Decided {
    pub backend: Arc<str>,
    /// The serving version's `info.version` and file digest.
    pub version: String,
    pub sha256: String,
    pub at: SystemTime,
    pub input: CallInput,
    /// Every answer the host gave the guest during the call.
    pub host: RecordedQueries,
    pub answered: Answered,
}

impl Decided {
    /// The call as a scenario: `name`, `call`, `input`, `host`, `expect`
    /// (docs/scenarios.md). Secret values are never in it: a guest sees
    /// the names of a volume's secret keys, not their values.
    pub fn scenario(&self) -> Value {
        let at = humantime::format_rfc3339_micros(self.at);
        let sha = &self.sha256[..self.sha256.len().min(12)];
        serde_json::json!({
            "name": format!(
                "{} at {at}, decided by {} {} (sha256 {sha})",
                self.input.summary(), self.backend, self.version
            ),
            "call": self.input.function(),
            "input": self.input.to_value(),
            "host": serde_json::to_value(&self.host).unwrap_or(Value::Null),
            "expect": self.answered.answer.to_value(),
        })
    }

    /// A whole scenario file holding this call alone.
    pub fn scenario_file(&self) -> Value {
        serde_json::json!({ "backend": &*self.backend, "scenarios": [self.scenario()] })
    }
}

/// What sees a backend's calls: the agent's recorder and shadow. Set on a
/// served [`Plugin`]; the call's own answer is taken first, and `seen` must
/// not block (it hands the call to a thread of its own).
pub trait Tap: Send + Sync {
    /// Whether calls are to be seen now; asked before each call, so cheap.
    fn wants(&self) -> bool;
    fn seen(&self, decided: Decided);
}

/// The guest's queries, answered by `inner` and written down.
pub(crate) struct RecordingQueries {
    inner: Arc<dyn Queries>,
    log: Mutex<RecordedQueries>,
}

impl RecordingQueries {
    pub(crate) fn new(inner: Arc<dyn Queries>) -> Arc<RecordingQueries> {
        Arc::new(RecordingQueries { inner, log: Mutex::default() })
    }

    /// The answers given so far.
    pub(crate) fn take(&self) -> RecordedQueries {
        std::mem::take(&mut *self.log())
    }

    fn log(&self) -> std::sync::MutexGuard<'_, RecordedQueries> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Queries for RecordingQueries {
    fn node_state(&self, name: &str) -> NodeFacts {
        let facts = self.inner.node_state(name);
        let mut log = self.log();
        if !log.nodes.iter().any(|n| n.name == facts.name) {
            log.nodes.push(facts.clone());
        }
        facts
    }
    fn lookup_path(&self, path: &str) -> Result<PathKind, QueryError> {
        let kind = self.inner.lookup_path(path)?;
        self.log().paths.insert(path.to_string(), kind);
        Ok(kind)
    }
    fn filesystem_type(&self, device: &str) -> Result<Option<String>, QueryError> {
        let fs = self.inner.filesystem_type(device)?;
        // None is what a recording answers for anything not in it.
        if let Some(fs) = &fs {
            self.log().filesystems.insert(device.to_string(), fs.clone());
        }
        Ok(fs)
    }
    fn mount_at(&self, target: &str) -> Result<Option<MountEntry>, QueryError> {
        let entry = self.inner.mount_at(target)?;
        if let Some(e) = &entry {
            let mut log = self.log();
            if !log.mounts.iter().any(|m| m.target == e.target) {
                log.mounts.push(e.clone());
            }
        }
        Ok(entry)
    }
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        let answer = self.inner.image_watchers(pool, image);
        let recorded = match &answer {
            Ok(w) => WatchersAnswer::Watchers(w.clone()),
            Err(e) => WatchersAnswer::Error { error: e.clone() },
        };
        self.log().watchers.insert(format!("{pool}/{image}"), recorded);
        answer
    }
}
