//! Recorded scenarios: a call, its inputs, the answers to host queries and
//! the expected outcome, run against a built component. The format is
//! documented in docs/scenarios.md.

use super::load::Plugin;
use super::queries::RecordedQueries;
use super::recorded::CallInput;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("{}: cannot read: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: not a valid scenario file: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("{}: written for backend {expected:?}, but the plugin is {actual:?}", path.display())]
    WrongBackend { path: PathBuf, expected: String, actual: String },
    #[error("{}: no scenario files (*.yaml, *.yml, *.json) found", path.display())]
    Empty { path: PathBuf },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    /// The backend these scenarios are for; checked against `info.name`.
    backend: Option<String>,
    #[serde(default)]
    defaults: Defaults,
    scenarios: Vec<Scenario>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Defaults {
    #[serde(default)]
    input: Map<String, Value>,
    #[serde(default)]
    host: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    name: String,
    call: CallKind,
    #[serde(default)]
    input: Map<String, Value>,
    #[serde(default)]
    host: Map<String, Value>,
    expect: Value,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum CallKind {
    Info,
    Fence,
    Attach,
    Detach,
    Expand,
    Condition,
    Cleanup,
}

/// How one scenario went.
#[derive(Debug)]
pub struct Outcome {
    pub file: PathBuf,
    pub name: String,
    /// None when it passed; else what differs, readable.
    pub failure: Option<String>,
}

/// Scenario files at `path`: the file itself, or the sorted *.yaml, *.yml
/// and *.json files of a dir.
pub fn files(path: &Path) -> Result<Vec<PathBuf>, ScenarioError> {
    let read_err = |source| ScenarioError::Read { path: path.to_path_buf(), source };
    if !std::fs::metadata(path).map_err(read_err)?.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut found = Vec::new();
    for entry in std::fs::read_dir(path).map_err(read_err)? {
        let p = entry.map_err(read_err)?.path();
        let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
        if matches!(ext, "yaml" | "yml" | "json") && p.is_file() {
            found.push(p);
        }
    }
    if found.is_empty() {
        return Err(ScenarioError::Empty { path: path.to_path_buf() });
    }
    found.sort();
    Ok(found)
}

/// A scenario that could not be prepared: its name and why.
pub type Malformed = (String, String);

/// A scenario ready to run: typed inputs and recorded host answers.
pub struct Prepared {
    pub name: String,
    pub call: CallInput,
    pub queries: Arc<RecordedQueries>,
    pub expect: Value,
}

impl Prepared {
    /// Make the call; the outcome as a scenario writes it.
    pub fn execute(&self, plugin: &Plugin) -> Value {
        self.call.answer(plugin, self.queries.clone()).answer.to_value()
    }

    /// Make the call again on another version of the policy that recorded
    /// it ([`super::queries::ReplayQueries`]).
    pub fn replay(&self, plugin: &Plugin) -> Value {
        let queries = Arc::new(super::queries::ReplayQueries((*self.queries).clone()));
        self.call.answer(plugin, queries).answer.to_value()
    }

    /// None when `actual` matches the expectation; else a readable diff.
    pub fn check(&self, actual: &Value) -> Option<String> {
        compare(&self.expect, actual).err()
    }
}

/// Largest scenario file read.
pub const MAX_SCENARIO_BYTES: u64 = 4 << 20;

/// Parse one file for `backend`. Each scenario is prepared on its own, so a
/// malformed one is reported (name, reason) without hiding the others.
pub fn load(path: &Path, backend: &str) -> Result<Vec<Result<Prepared, Malformed>>, ScenarioError> {
    let parse_err = |message: String| ScenarioError::Parse { path: path.to_path_buf(), message };
    // Scenario files ship beside plugins: read like them, a regular file
    // of bounded size.
    let bytes = crate::sys::beneath::read_file(path, MAX_SCENARIO_BYTES).map_err(|e| {
        ScenarioError::Read {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        }
    })?;
    let text = String::from_utf8(bytes).map_err(|e| parse_err(format!("not UTF-8: {e}")))?;
    parse_str(path, &text, path.extension().is_some_and(|e| e == "json"), backend)
}

/// Parse scenario text for `backend`, JSON or YAML; `path` only names it in
/// errors. Apart from [`load`] so that it can be fuzzed from memory.
pub fn parse_str(
    path: &Path,
    text: &str,
    json: bool,
    backend: &str,
) -> Result<Vec<Result<Prepared, Malformed>>, ScenarioError> {
    let parse_err = |message: String| ScenarioError::Parse { path: path.to_path_buf(), message };
    let file: ScenarioFile = if json {
        serde_json::from_str(text).map_err(|e| parse_err(e.to_string()))?
    } else {
        serde_norway::from_str(text).map_err(|e| parse_err(e.to_string()))?
    };
    if let Some(expected) = &file.backend
        && expected != backend
    {
        return Err(ScenarioError::WrongBackend {
            path: path.to_path_buf(),
            expected: expected.clone(),
            actual: backend.to_string(),
        });
    }
    Ok(file
        .scenarios
        .into_iter()
        .map(|s| {
            let name = s.name.clone();
            prepare(&file.defaults, s).map_err(|why| (name, why))
        })
        .collect())
}

/// Run every scenario of one file.
pub fn run_file(plugin: &Plugin, path: &Path) -> Result<Vec<Outcome>, ScenarioError> {
    Ok(load(path, plugin.name())?
        .into_iter()
        .map(|prepared| match prepared {
            Ok(p) => Outcome {
                file: path.to_path_buf(),
                failure: p.check(&p.execute(plugin)),
                name: p.name,
            },
            Err((name, why)) => Outcome { file: path.to_path_buf(), name, failure: Some(why) },
        })
        .collect())
}

impl CallKind {
    /// The input keys of this call; defaults for other calls are left out.
    fn keys(self) -> &'static [&'static str] {
        match self {
            CallKind::Info => &[],
            CallKind::Fence => &["volume", "requester", "holders", "nodes"],
            CallKind::Attach => &["volume", "requester", "local_holders", "paths"],
            CallKind::Detach => &["volume", "consumer", "local_holders", "paths"],
            CallKind::Expand | CallKind::Condition => &["volume", "consumer", "paths"],
            CallKind::Cleanup => &["reason", "items"],
        }
    }
}

/// Keys no call takes are typos: refuse them rather than test nothing.
fn check_default_keys(defaults: &Defaults) -> Result<(), String> {
    let all = [
        CallKind::Fence,
        CallKind::Attach,
        CallKind::Detach,
        CallKind::Expand,
        CallKind::Condition,
        CallKind::Cleanup,
    ];
    match defaults.input.keys().find(|k| !all.iter().any(|c| c.keys().contains(&k.as_str()))) {
        Some(k) => Err(format!("defaults.input.{k} is not an input of any call")),
        None => Ok(()),
    }
}

/// The first key written in `written` that `typed` (what it parsed into,
/// serialized again) does not have: a misspelt field would otherwise be
/// dropped silently.
fn unknown_key(written: &Value, typed: &Value, at: &str) -> Option<String> {
    match (written, typed) {
        (Value::Object(w), Value::Object(t)) => w.iter().find_map(|(k, v)| match t.get(k) {
            None => Some(format!("{at}.{k}")),
            Some(tv) => unknown_key(v, tv, &format!("{at}.{k}")),
        }),
        (Value::Array(w), Value::Array(t)) => w
            .iter()
            .zip(t)
            .enumerate()
            .find_map(|(i, (wv, tv))| unknown_key(wv, tv, &format!("{at}[{i}]"))),
        _ => None,
    }
}

/// Parse `value` as `T`, refusing keys `T` does not have.
fn strict<T: serde::de::DeserializeOwned + serde::Serialize>(
    value: Value,
    what: &str,
) -> Result<T, String> {
    let typed: T =
        serde_json::from_value(value.clone()).map_err(|e| format!("invalid {what}: {e}"))?;
    let again = serde_json::to_value(&typed).map_err(|e| format!("invalid {what}: {e}"))?;
    match unknown_key(&value, &again, what) {
        Some(key) => Err(format!("unknown field {key}")),
        None => Ok(typed),
    }
}

const OUTCOMES: &[&str] = &["decision", "plan", "info", "condition", "error", "refused"];

fn prepare(defaults: &Defaults, scenario: Scenario) -> Result<Prepared, String> {
    check_default_keys(defaults)?;
    match scenario.expect.as_object().map(|m| m.keys().collect::<Vec<_>>()) {
        Some(keys) if keys.len() == 1 && OUTCOMES.contains(&keys[0].as_str()) => {}
        _ => return Err(format!("expect must have exactly one of {}", OUTCOMES.join(", "))),
    }
    if matches!(scenario.call, CallKind::Info) && !scenario.input.is_empty() {
        return Err("an info call takes no input".to_string());
    }
    // Defaults serve every call in the file; a scenario's own input is strict.
    let keys = scenario.call.keys();
    let mut input = Value::Object(
        defaults
            .input
            .iter()
            .filter(|(k, _)| keys.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    );
    merge(&mut input, Value::Object(scenario.input));
    options_as_list(&mut input);
    let mut host = Value::Object(defaults.host.clone());
    merge(&mut host, Value::Object(scenario.host));
    let queries: RecordedQueries = strict(host, "host")?;
    let what = format!("input for a {:?} call", scenario.call);
    let call = match scenario.call {
        CallKind::Info => CallInput::Info,
        CallKind::Fence => CallInput::Fence(strict(input, &what)?),
        CallKind::Attach => CallInput::Attach(strict(input, &what)?),
        CallKind::Detach => CallInput::Detach(strict(input, &what)?),
        CallKind::Expand => CallInput::Expand(strict(input, &what)?),
        CallKind::Condition => CallInput::Condition(strict(input, &what)?),
        CallKind::Cleanup => CallInput::Cleanup(strict(input, &what)?),
    };
    Ok(Prepared { name: scenario.name, call, queries: Arc::new(queries), expect: scenario.expect })
}

/// Deep-merge `over` into `base`: objects merge key by key, anything else
/// replaces.
fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// Volume options may be written as a map; the contract has a list of
/// key/value pairs.
fn options_as_list(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                if key == "volume"
                    && let Some(Value::Object(opts)) = v.get_mut("options")
                {
                    let list = opts
                        .iter()
                        .map(|(k, v)| serde_json::json!({ "key": k, "value": v }))
                        .collect();
                    v["options"] = Value::Array(list);
                }
                options_as_list(v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(options_as_list),
        _ => {}
    }
}

/// Does `actual` match `expected`? Objects match when every expected key
/// matches (others are ignored); lists match element by element and must be
/// as long; a string with `*` is a wildcard pattern; the rest must be equal.
fn compare(expected: &Value, actual: &Value) -> Result<(), String> {
    let mut at = String::from("$");
    if first_mismatch(expected, actual, &mut at) {
        return Ok(());
    }
    let projected = project(expected, actual);
    let exp = serde_norway::to_string(expected).unwrap_or_default();
    let act = serde_norway::to_string(&projected).unwrap_or_default();
    let diff = similar::TextDiff::from_lines(&exp, &act)
        .unified_diff()
        .context_radius(3)
        .header("expected", "actual")
        .to_string();
    Err(format!("first difference at {at}\n{diff}"))
}

/// True when they match; else `at` names the first difference.
fn first_mismatch(expected: &Value, actual: &Value, at: &mut String) -> bool {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => e.iter().all(|(k, ev)| {
            let len = at.len();
            at.push('.');
            at.push_str(k);
            let ok = a.get(k).is_some_and(|av| first_mismatch(ev, av, at));
            if ok {
                at.truncate(len);
            }
            ok
        }),
        (Value::Array(e), Value::Array(a)) => {
            if e.len() != a.len() {
                at.push_str(&format!(" (expected {} items, got {})", e.len(), a.len()));
                return false;
            }
            e.iter().zip(a).enumerate().all(|(i, (ev, av))| {
                let len = at.len();
                at.push_str(&format!("[{i}]"));
                let ok = first_mismatch(ev, av, at);
                if ok {
                    at.truncate(len);
                }
                ok
            })
        }
        (Value::String(e), Value::String(a)) if e.contains('*') => wildcard(e, a),
        (e, a) => e == a,
    }
}

/// `actual` cut down to the shape of `expected`, so the diff shows only
/// what the scenario asserts.
fn project(expected: &Value, actual: &Value) -> Value {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => Value::Object(
            a.iter()
                .filter(|(k, _)| e.contains_key(*k))
                .map(|(k, v)| (k.clone(), project(&e[k], v)))
                .collect(),
        ),
        (Value::Array(e), Value::Array(a)) if e.len() == a.len() => {
            Value::Array(e.iter().zip(a).map(|(ev, av)| project(ev, av)).collect())
        }
        (Value::String(e), Value::String(a)) if e.contains('*') && wildcard(e, a) => {
            expected.clone()
        }
        _ => actual.clone(),
    }
}

/// `*` matches any run of characters; everything else literally.
fn wildcard(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wildcards() {
        assert!(wildcard("*pod default/a*", "in use by pod default/a on node n1"));
        assert!(wildcard("volume *", "volume pv"));
        assert!(!wildcard("volume *x", "volume pv"));
        assert!(wildcard("a*b*c", "aXbYc"));
        assert!(!wildcard("a*b*c", "acb"));
        assert!(!wildcard("ab*ba", "aba"));
    }

    #[test]
    fn subset_matching_and_diff() {
        let actual = json!({"plan": [{"Unmount": {"target": "/x", "force": false}}]});
        assert!(compare(&json!({"plan": [{"Unmount": {"target": "/x"}}]}), &actual).is_ok());
        let err = compare(&json!({"plan": [{"Unmount": {"target": "/y"}}]}), &actual).unwrap_err();
        assert!(err.contains("$.plan[0].Unmount.target"), "{err}");
        assert!(err.contains("-    target: /y") && err.contains("+    target: /x"), "{err}");
        let err = compare(&json!({"plan": []}), &actual).unwrap_err();
        assert!(err.contains("expected 0 items, got 1"), "{err}");
        assert!(compare(&json!({"decision": "Grant"}), &actual).is_err());
    }

    #[test]
    fn misspelt_keys_are_found_at_any_depth() {
        let written =
            json!({"volume": {"name": "pv"}, "nodes": [{"name": "n", "out_of_servce": true}]});
        let typed = json!({"volume": {"name": "pv", "fs_type": ""}, "nodes": [{"name": "n", "out_of_service": false}]});
        assert_eq!(
            unknown_key(&written, &typed, "input").as_deref(),
            Some("input.nodes[0].out_of_servce")
        );
        assert_eq!(unknown_key(&typed, &typed, "input"), None);
    }

    #[test]
    fn defaults_merge_deeply_and_options_may_be_a_map() {
        let mut base = json!({"volume": {"name": "pv", "options": {"a": "1"}}, "paths": {"x": 1}});
        merge(&mut base, json!({"volume": {"options": {"b": "2"}}}));
        options_as_list(&mut base);
        assert_eq!(base["volume"]["name"], "pv");
        assert_eq!(
            base["volume"]["options"],
            json!([{"key": "a", "value": "1"}, {"key": "b", "value": "2"}])
        );
    }
}
