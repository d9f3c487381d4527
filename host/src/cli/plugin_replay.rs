//! `volagent plugin record` and `volagent plugin replay`: a node's
//! recording as a scenario suite, and every recorded call made again on a
//! candidate version, with what it answers otherwise sorted by kind.

use crate::policy::differences::{self, Kind};
use crate::policy::{Plugin, scenario};
use anyhow::Context;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The scenario files at each path: a file, a dir's files, and the files
/// of its subdirs (a recording keeps each backend's in a dir of its own).
fn scenario_files(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for path in paths {
        let meta =
            std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
        if !meta.is_dir() {
            found.push(path.clone());
            continue;
        }
        let mut dirs = vec![path.clone()];
        for entry in std::fs::read_dir(path).with_context(|| format!("{}", path.display()))? {
            let entry = entry?;
            let hidden = entry.file_name().to_string_lossy().starts_with('.');
            if !hidden && entry.file_type()?.is_dir() {
                dirs.push(entry.path());
            }
        }
        for dir in dirs {
            match scenario::files(&dir) {
                Ok(files) => found.extend(files),
                Err(scenario::ScenarioError::Empty { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    if found.is_empty() {
        anyhow::bail!("no scenario files (*.json, *.yaml, *.yml) under {paths:?}");
    }
    Ok(found)
}

/// A recorded file's backend and scenarios, as written.
fn read_raw(file: &Path) -> anyhow::Result<(String, Vec<Value>)> {
    let bytes = crate::sys::beneath::read_file(file, scenario::MAX_SCENARIO_BYTES)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let value: Value = if file.extension().is_some_and(|e| e == "json") {
        serde_json::from_slice(&bytes)?
    } else {
        serde_norway::from_slice(&bytes)?
    };
    if value.get("defaults").is_some() {
        anyhow::bail!("it has defaults: a suite written by hand, not a recording");
    }
    let backend = value
        .get("backend")
        .and_then(Value::as_str)
        .context("it names no backend: not a recording")?
        .to_string();
    // It names the suite's file: a backend's name, nothing else.
    let label = !backend.is_empty()
        && backend.len() <= 63
        && backend.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    anyhow::ensure!(label, "backend {backend:?} is not a backend's name");
    let scenarios = value
        .get("scenarios")
        .and_then(Value::as_array)
        .cloned()
        .context("it has no scenarios list")?;
    Ok((backend, scenarios))
}

/// `volagent plugin record`: one suite per backend, each distinct call once.
pub fn record(recordings: &[PathBuf], out: &Path, only: Option<&str>) -> anyhow::Result<ExitCode> {
    // Backend → each distinct call's scenario and how often it was seen,
    // and where each is in that list by what it was.
    type Suite = (Vec<(Value, usize)>, HashMap<String, usize>);
    let mut suites: BTreeMap<String, Suite> = BTreeMap::new();
    let mut unreadable = 0;
    for file in scenario_files(recordings)? {
        let (backend, scenarios) = match read_raw(&file) {
            Ok(r) => r,
            Err(e) => {
                unreadable += 1;
                eprintln!("skipped {}: {e:#}", file.display());
                continue;
            }
        };
        if only.is_some_and(|b| b != backend) {
            continue;
        }
        let (suite, index) = suites.entry(backend).or_default();
        for mut s in scenarios {
            // A fault's message carries backtraces and timings: any fault
            // matches a recorded one.
            if let Some(expect) = s.get_mut("expect")
                && expect.get("refused").is_some()
            {
                *expect = serde_json::json!({ "refused": "*" });
            }
            // The same call, the same answers and the same outcome, whenever.
            let key = serde_json::to_string(&serde_json::json!([
                s.get("call"),
                s.get("input"),
                s.get("host"),
                s.get("expect")
            ]))?;
            match index.get(&key) {
                Some(&i) => suite[i].1 += 1,
                None => {
                    index.insert(key, suite.len());
                    suite.push((s, 1));
                }
            }
        }
    }
    if suites.is_empty() {
        anyhow::bail!(
            "no recorded calls found{}",
            only.map(|b| format!(" of backend {b}")).unwrap_or_default()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot make {}", out.display()))?;
    for (backend, (calls, _)) in suites {
        let total: usize = calls.iter().map(|c| c.1).sum();
        let scenarios: Vec<Value> = calls
            .into_iter()
            .map(|(mut s, seen)| {
                if seen > 1
                    && let Some(Value::String(name)) = s.get_mut("name")
                {
                    name.push_str(&format!(" (recorded {seen} times)"));
                }
                s
            })
            .collect();
        let distinct = scenarios.len();
        let head = format!(
            "# Recorded policy calls of backend {backend}: {total} calls, {distinct} distinct.\n"
        );
        let text = suite_text(&backend, &scenarios)?;
        // A suite loads as one file up to the scenario file limit; a larger
        // one is a dir of parts (`<stem>.scenarios/`, read in name order).
        let size = (head.len() + text.len()) as u64;
        let (path, parts) = if size <= scenario::MAX_SCENARIO_BYTES {
            (out.join(format!("{backend}.scenarios.yaml")), vec![format!("{head}{text}")])
        } else {
            let count = size.div_ceil(scenario::MAX_SCENARIO_BYTES / 2) as usize;
            let per = scenarios.len().div_ceil(count).max(1);
            let parts = scenarios
                .chunks(per)
                .map(|c| suite_text(&backend, c).map(|t| format!("{head}{t}")))
                .collect::<anyhow::Result<Vec<_>>>()?;
            (out.join(format!("{backend}.scenarios")), parts)
        };
        let files: Vec<PathBuf> = if parts.len() == 1 {
            vec![path.clone()]
        } else {
            std::fs::create_dir_all(&path)
                .with_context(|| format!("cannot make {}", path.display()))?;
            (0..parts.len()).map(|i| path.join(format!("{i:04}.yaml"))).collect()
        };
        for (file, text) in files.iter().zip(&parts) {
            // What is written must load as a suite.
            let prepared = scenario::parse_str(file, text, false, &backend)?;
            if let Some(Err((name, why))) = prepared.iter().find(|p| p.is_err()) {
                anyhow::bail!(
                    "recorded call {name:?} of backend {backend} is not a valid scenario: {why}"
                );
            }
            std::fs::write(file, text)
                .with_context(|| format!("cannot write {}", file.display()))?;
        }
        println!("{backend}: {total} recorded calls, {distinct} distinct: {}", path.display());
    }
    if unreadable > 0 {
        println!("{unreadable} files skipped (not recordings)");
    }
    Ok(ExitCode::SUCCESS)
}

fn suite_text(backend: &str, scenarios: &[Value]) -> anyhow::Result<String> {
    Ok(serde_norway::to_string(&serde_json::json!({
        "backend": backend,
        "scenarios": scenarios,
    }))?)
}

/// One call answered otherwise.
struct Seen {
    name: String,
    before: String,
    after: String,
}

/// How many examples of each kind are printed.
const EXAMPLES: usize = 5;

/// `volagent plugin replay`: every recorded call of the candidate's
/// backend, made on it with the recorded answers; exit 1 on a difference
/// of a kind `allowed` does not list, or on a call that could not be made.
pub fn replay(
    candidate: &Plugin,
    recordings: &[PathBuf],
    allowed: &[Kind],
) -> anyhow::Result<ExitCode> {
    let backend = candidate.name().to_string();
    let (mut same, mut other_backends, mut broken) = (0usize, 0usize, Vec::new());
    let mut by_kind: BTreeMap<Kind, Vec<Seen>> = BTreeMap::new();
    for file in scenario_files(recordings)? {
        let prepared = match scenario::load(&file, &backend) {
            Ok(p) => p,
            Err(scenario::ScenarioError::WrongBackend { .. }) => {
                other_backends += 1;
                continue;
            }
            Err(e) => {
                broken.push(e.to_string());
                continue;
            }
        };
        for p in prepared {
            let p = match p {
                Ok(p) => p,
                Err((name, why)) => {
                    broken.push(format!("{}: {name}: {why}", file.display()));
                    continue;
                }
            };
            let actual = p.replay(candidate);
            // A suite written by hand expects by shape: what matches is the same.
            if p.check(&actual).is_none() {
                same += 1;
                continue;
            }
            match differences::classify(&p.expect, &actual) {
                None => same += 1,
                Some(d) => by_kind.entry(d.kind).or_default().push(Seen {
                    name: p.name.clone(),
                    before: d.before,
                    after: d.after,
                }),
            }
        }
    }
    let differing: usize = by_kind.values().map(Vec::len).sum();
    println!(
        "{backend} {} ({}, sha256 {}) against {} recorded calls: {same} answered the same, {differing} otherwise{}",
        candidate.info().version,
        candidate.path().display(),
        candidate.sha256(),
        same + differing,
        if other_backends > 0 {
            format!(" ({other_backends} files of other backends left out)")
        } else {
            String::new()
        }
    );
    let mut refused = Vec::new();
    for (kind, seen) in &by_kind {
        let allowed = allowed.contains(kind);
        println!("{kind}: {}{}", seen.len(), if allowed { " (allowed)" } else { "" });
        if !allowed {
            refused.push(format!("{kind} ({})", seen.len()));
        }
        for s in seen.iter().take(EXAMPLES) {
            println!("  {}", s.name);
            println!("    recorded:  {}", s.before);
            println!("    candidate: {}", s.after);
        }
        if seen.len() > EXAMPLES {
            println!("  … and {} more", seen.len() - EXAMPLES);
        }
    }
    for b in &broken {
        println!("not replayed: {b}");
    }
    if same + differing == 0 {
        println!("no recorded call of backend {backend} was found");
        return Ok(ExitCode::FAILURE);
    }
    if !refused.is_empty() || !broken.is_empty() {
        let mut why = Vec::new();
        if !refused.is_empty() {
            why.push(format!("differences not allowed: {}", refused.join(", ")));
        }
        if !broken.is_empty() {
            why.push(format!("{} recordings could not be replayed", broken.len()));
        }
        println!("FAIL: {}", why.join("; "));
        return Ok(ExitCode::FAILURE);
    }
    println!("PASS");
    Ok(ExitCode::SUCCESS)
}
