//! How two versions of a policy differ on one call: the recorded (or
//! serving) outcome against a candidate's, sorted into kinds a person can
//! allow or not (`volagent plugin replay --allow`, the shadow's counter).

use serde_json::Value;

/// A kind of difference, from the most to the least alarming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// A grant, take-over or plan became a denial or a policy refusal.
    BecameRefused,
    /// A denial or refusal became a grant, take-over or plan.
    BecameAllowed,
    /// The candidate faulted (trapped, ran out of time or memory, or
    /// answered something the host refuses) where the other did not.
    Fault,
    /// Both allowed, with a different fence decision (a take-over instead
    /// of a grant, other stale holders or fence steps).
    Decision,
    /// Both planned, with other steps (kinds, count or order).
    Steps,
    /// The same steps, on another device or source, or clearing another
    /// dir, unmounting or publishing at another target, fencing another
    /// client: what a step acts on.
    Device,
    /// The same steps and devices, with other arguments (options, flags,
    /// targets).
    Arguments,
    /// Both refused, for another reason.
    Refusal,
    /// Another condition (health) answer.
    Condition,
    /// Another `info`.
    Info,
    /// The other faulted and the candidate did not.
    NoLongerFaults,
}

impl Kind {
    pub const ALL: [Kind; 11] = [
        Kind::BecameRefused,
        Kind::BecameAllowed,
        Kind::Fault,
        Kind::Decision,
        Kind::Steps,
        Kind::Device,
        Kind::Arguments,
        Kind::Refusal,
        Kind::Condition,
        Kind::Info,
        Kind::NoLongerFaults,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::BecameRefused => "became-refused",
            Kind::BecameAllowed => "became-allowed",
            Kind::Fault => "fault",
            Kind::Decision => "decision",
            Kind::Steps => "steps",
            Kind::Device => "device",
            Kind::Arguments => "arguments",
            Kind::Refusal => "refusal",
            Kind::Condition => "condition",
            Kind::Info => "info",
            Kind::NoLongerFaults => "no-longer-faults",
        }
    }

    pub fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One call's difference: its kind, and each side cut short for people.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    pub kind: Kind,
    pub before: String,
    pub after: String,
}

#[derive(PartialEq, Clone, Copy)]
enum Class {
    Allowed,
    Refused,
    Fault,
}

/// The outcome's one key and its value.
fn split(outcome: &Value) -> (&str, &Value) {
    match outcome.as_object().and_then(|m| m.iter().next()) {
        Some((k, v)) => (k.as_str(), v),
        None => ("", outcome),
    }
}

fn class(key: &str, value: &Value) -> Class {
    match key {
        "refused" => Class::Fault,
        "error" => Class::Refused,
        "decision" if value.get("Deny").is_some() => Class::Refused,
        _ => Class::Allowed,
    }
}

/// How `after` differs from `before` (both outcomes as scenarios write
/// them, [`super::recorded::Answer::to_value`]); None when it does not.
/// Two faults are not a difference: their messages carry backtraces.
pub fn classify(before: &Value, after: &Value) -> Option<Difference> {
    if before == after {
        return None;
    }
    let ((bk, bv), (ak, av)) = (split(before), split(after));
    let kind = match (class(bk, bv), class(ak, av)) {
        (Class::Fault, Class::Fault) => return None,
        (Class::Fault, _) => Kind::NoLongerFaults,
        (_, Class::Fault) => Kind::Fault,
        (Class::Refused, Class::Allowed) => Kind::BecameAllowed,
        (Class::Allowed, Class::Refused) => Kind::BecameRefused,
        (Class::Refused, Class::Refused) => Kind::Refusal,
        (Class::Allowed, Class::Allowed) => match (bk, ak) {
            ("plan", "plan") => return Some(plan_difference(bv, av)),
            ("decision", "decision") => Kind::Decision,
            ("condition", "condition") => Kind::Condition,
            ("info", "info") => Kind::Info,
            _ => Kind::Steps,
        },
    };
    Some(Difference { kind, before: short(before), after: short(after) })
}

/// The step's kind, as a plan serializes it (`{"Mount": {..}}`).
fn step_kind(step: &Value) -> &str {
    split(step).0
}

/// The fields of a step that name what it acts on: a device, what is
/// mounted, a dir cleared or unmounted, a client fenced.
fn device_fields(step: &Value) -> Vec<&Value> {
    let (kind, fields) = split(step);
    let names: &[&str] = match kind {
        "AttachDevice" | "DetachDevice" => &["spec"],
        "Format" | "Wipe" => &["device"],
        "PublishBlock" => &["device", "target"],
        "Mount" | "BindMount" => &["source"],
        "Unmount" | "GrowFilesystem" => &["target"],
        "ClearDirectory" => &["path"],
        "BlocklistClient" => &["address", "monitors"],
        _ => &[],
    };
    names.iter().filter_map(|n| fields.get(n)).collect()
}

fn plan_difference(before: &Value, after: &Value) -> Difference {
    let empty = Vec::new();
    let b = before.as_array().unwrap_or(&empty);
    let a = after.as_array().unwrap_or(&empty);
    let kinds = |p: &[Value]| p.iter().map(step_kind).collect::<Vec<_>>().join(", ");
    if b.len() != a.len() || b.iter().zip(a).any(|(x, y)| step_kind(x) != step_kind(y)) {
        return Difference {
            kind: Kind::Steps,
            before: format!("[{}]", kinds(b)),
            after: format!("[{}]", kinds(a)),
        };
    }
    // The same steps: the first that differs tells which kind.
    let (i, (x, y)) = b
        .iter()
        .zip(a)
        .enumerate()
        .find(|(_, (x, y))| x != y)
        .unwrap_or((0, (&Value::Null, &Value::Null)));
    let kind = if device_fields(x) != device_fields(y) { Kind::Device } else { Kind::Arguments };
    Difference {
        kind,
        before: format!("step {}: {}", i + 1, short(x)),
        after: format!("step {}: {}", i + 1, short(y)),
    }
}

/// A value in one line of bounded length.
fn short(v: &Value) -> String {
    const MAX: usize = 240;
    let text = v.to_string();
    if text.len() <= MAX {
        return text;
    }
    let mut cut = MAX;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kind(before: Value, after: Value) -> Option<Kind> {
        classify(&before, &after).map(|d| d.kind)
    }

    #[test]
    fn decisions() {
        let grant = json!({"decision": "Grant"});
        let deny = json!({"decision": {"Deny": "in use by pod a/b on node n1"}});
        let deny2 = json!({"decision": {"Deny": "read-only"}});
        let take = json!({"decision": {"TakeOver": {"stale": [], "fence_steps": []}}});
        assert_eq!(kind(grant.clone(), grant.clone()), None);
        assert_eq!(kind(grant.clone(), deny.clone()), Some(Kind::BecameRefused));
        assert_eq!(kind(deny.clone(), grant.clone()), Some(Kind::BecameAllowed));
        assert_eq!(kind(deny.clone(), deny2), Some(Kind::Refusal));
        assert_eq!(kind(grant.clone(), take), Some(Kind::Decision));
        let error = json!({"error": {"InvalidOptions": "no pool"}});
        assert_eq!(kind(json!({"plan": []}), error.clone()), Some(Kind::BecameRefused));
        assert_eq!(kind(error, json!({"plan": []})), Some(Kind::BecameAllowed));
    }

    #[test]
    fn faults() {
        let trap = json!({"refused": "backend x: fence trapped: wasm backtrace 0x12"});
        let trap2 = json!({"refused": "backend x: fence trapped: wasm backtrace 0x99"});
        let grant = json!({"decision": "Grant"});
        assert_eq!(kind(trap.clone(), trap2), None, "two faults are alike");
        assert_eq!(kind(grant.clone(), trap.clone()), Some(Kind::Fault));
        assert_eq!(kind(trap, grant), Some(Kind::NoLongerFaults));
    }

    #[test]
    fn plans() {
        let attach = |file: &str, ro: bool| json!({"AttachDevice": {"id": "d", "spec": {"Loop": file}, "read_only": ro}});
        let mount = |opts: Vec<&str>| json!({"Mount": {"source": {"Block": {"Attached": "d"}}, "target": "/t", "fs_type": "ext4", "options": opts, "read_only": false}});
        let plan = |steps: Vec<Value>| json!({ "plan": steps });
        let base = plan(vec![attach("/a.img", false), mount(vec![])]);
        assert_eq!(kind(base.clone(), base.clone()), None);
        assert_eq!(kind(base.clone(), plan(vec![attach("/a.img", false)])), Some(Kind::Steps));
        assert_eq!(
            kind(base.clone(), plan(vec![mount(vec![]), attach("/a.img", false)])),
            Some(Kind::Steps)
        );
        let d = classify(&base, &plan(vec![attach("/b.img", false), mount(vec![])])).unwrap();
        assert_eq!(d.kind, Kind::Device);
        assert!(d.before.starts_with("step 1: ") && d.after.contains("/b.img"), "{d:?}");
        assert_eq!(
            kind(base.clone(), plan(vec![attach("/a.img", true), mount(vec![])])),
            Some(Kind::Arguments)
        );
        assert_eq!(
            kind(base, plan(vec![attach("/a.img", false), mount(vec!["noatime"])])),
            Some(Kind::Arguments)
        );
    }

    #[test]
    fn kinds_have_names_that_parse_back() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.name()), Some(k));
        }
        assert_eq!(Kind::parse("nonsense"), None);
    }
}
