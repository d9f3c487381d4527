//! `volagent plugin new|test|inspect|bench`: offline tools for policy authors.

use crate::policy::{Limits, Plugin, Runtime, scenario};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Subcommand)]
pub enum PluginCommand {
    /// Write a new backend's crate: the SDK, a policy skeleton with native
    /// unit tests, a scenario file and a README. It builds to a component
    /// that passes `volagent plugin test` as written.
    New {
        /// The backend's name (a DNS label): its drivers become
        /// volagent/<name> and <name>.csi.volagent.io.
        name: String,
        /// Where to write it (made; must not exist or be empty); default ./<name>.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Run recorded scenarios against a component; exit 1 if any fails.
    Test {
        /// The backend component (.wasm).
        wasm: PathBuf,
        /// Scenario files, or dirs of *.yaml / *.yml / *.json files.
        #[arg(required = true)]
        scenarios: Vec<PathBuf>,
    },
    /// Show a component's world, version, info and imports.
    Inspect {
        wasm: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Per-call latency (fresh instance each call): p50 / p99.
    Bench {
        wasm: PathBuf,
        /// Scenario file or dir whose calls to time; default: `info`.
        scenarios: Option<PathBuf>,
        /// Calls per scenario.
        #[arg(short = 'n', long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..))]
        calls: u32,
    },
    /// Turn a node's recording (`volagent agent --record DIR`) into one
    /// scenario suite per backend, each distinct call once:
    /// OUT/<backend>.scenarios.yaml, for `plugin test` and `plugin replay`,
    /// or to ship beside the policy.
    Record {
        /// The recording dir, or recorded files.
        #[arg(required = true)]
        recordings: Vec<PathBuf>,
        /// Where the suites go.
        #[arg(long, default_value = "scenarios")]
        out: PathBuf,
        /// Only this backend's calls.
        #[arg(long)]
        backend: Option<String>,
    },
    /// Make every recorded call of a backend again on a candidate version,
    /// with the recorded answers to its queries, and print what it answers
    /// otherwise, by kind; exit 1 on any difference of a kind not allowed.
    Replay {
        /// The candidate component (.wasm).
        candidate: PathBuf,
        /// Recording dirs, suites, or recorded files.
        #[arg(required = true)]
        recordings: Vec<PathBuf>,
        /// Kinds of difference expected (comma-separated): became-refused,
        /// became-allowed, fault, decision, steps, device, arguments,
        /// refusal, condition, info, no-longer-faults.
        #[arg(long, value_delimiter = ',', value_parser = parse_kind)]
        allow: Vec<crate::policy::differences::Kind>,
    },
    /// Serve a backend's candidate (<backend>.candidate.wasm in the plugin
    /// dir), checked as the agent checks any new file; the version that
    /// served is kept as <backend>.previous.wasm. The agent's watch takes
    /// the change.
    Promote {
        backend: String,
        /// The agent's plugin dir.
        #[arg(long, default_value = "/var/lib/volagent/plugins")]
        dir: PathBuf,
        /// What the agent trusts: the candidate must be trusted too.
        #[command(flatten)]
        trust: crate::plugin::trust::TrustArgs,
    },
    /// Serve a backend's previous version again; the version that served
    /// becomes the previous one.
    Rollback {
        backend: String,
        /// The agent's plugin dir.
        #[arg(long, default_value = "/var/lib/volagent/plugins")]
        dir: PathBuf,
        /// What the agent trusts: the previous version must still be.
        #[command(flatten)]
        trust: crate::plugin::trust::TrustArgs,
    },
    /// Print each policy's allow-list line (`<backend> <sha256>`), after it
    /// loads; with --list, add them to that allow-list.
    Trust {
        #[arg(required = true)]
        wasm: Vec<PathBuf>,
        /// The allow-list to add them to (made when missing).
        #[arg(long)]
        list: Option<PathBuf>,
    },
    /// Switch the recording of a backend's policy calls on or off in a
    /// running agent (started with --record DIR).
    Recording {
        backend: String,
        #[arg(value_parser = ["on", "off"])]
        state: String,
        /// The agent's socket.
        #[arg(long, default_value = crate::socket::protocol::DEFAULT_SOCKET)]
        socket: PathBuf,
    },
    /// Ask a running agent which backends it serves, which are degraded
    /// or waiting to be removed, and what candidates in the shadow answered
    /// otherwise; exit 1 if any backend is degraded.
    Status {
        /// The agent's socket.
        #[arg(long, default_value = crate::socket::protocol::DEFAULT_SOCKET)]
        socket: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: PluginCommand, limits: Limits) -> anyhow::Result<ExitCode> {
    if let PluginCommand::New { name, dir } = &command {
        let dir = dir.clone().unwrap_or_else(|| PathBuf::from(name));
        let written = super::plugin_new::write(name, &dir)?;
        println!("wrote {} files in {}", written.len(), dir.display());
        println!("next: cd {} && cargo build --release --target wasm32-wasip2", dir.display());
        return Ok(ExitCode::SUCCESS);
    }
    match &command {
        PluginCommand::Status { socket, json } => return status(socket, *json),
        PluginCommand::Recording { backend, state, socket } => {
            return recording(socket, backend, state == "on");
        }
        PluginCommand::Record { recordings, out, backend } => {
            return super::plugin_replay::record(recordings, out, backend.as_deref());
        }
        _ => {}
    }
    let runtime = Runtime::new(limits)?;
    match command {
        PluginCommand::Test { wasm, scenarios } => test(&runtime, &wasm, &scenarios),
        PluginCommand::Inspect { wasm, json } => inspect(&runtime, &wasm, json),
        PluginCommand::Bench { wasm, scenarios, calls } => bench(&runtime, &wasm, scenarios, calls),
        PluginCommand::Replay { candidate, recordings, allow } => {
            let (plugin, _) = load(&runtime, &candidate)?;
            super::plugin_replay::replay(&plugin, &recordings, &allow)
        }
        PluginCommand::Promote { backend, dir, trust } => {
            let trust = crate::plugin::trust::TrustSources::new(&trust)?;
            super::plugin_rollout::promote(&runtime, &trust, &dir, &backend)
                .map(|()| ExitCode::SUCCESS)
        }
        PluginCommand::Rollback { backend, dir, trust } => {
            let trust = crate::plugin::trust::TrustSources::new(&trust)?;
            super::plugin_rollout::rollback(&runtime, &trust, &dir, &backend)
                .map(|()| ExitCode::SUCCESS)
        }
        PluginCommand::Trust { wasm, list } => {
            super::plugin_rollout::trust_files(&runtime, &wasm, list.as_deref())
                .map(|()| ExitCode::SUCCESS)
        }
        PluginCommand::Status { .. }
        | PluginCommand::New { .. }
        | PluginCommand::Recording { .. }
        | PluginCommand::Record { .. } => {
            unreachable!("handled above")
        }
    }
}

fn parse_kind(s: &str) -> Result<crate::policy::differences::Kind, String> {
    use crate::policy::differences::Kind;
    Kind::parse(s).ok_or_else(|| {
        let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        format!("not a kind of difference (one of {})", names.join(", "))
    })
}

fn recording(socket: &Path, backend: &str, on: bool) -> anyhow::Result<ExitCode> {
    use crate::socket::protocol::{Request, Response};
    let request = Request::Recording { backend: backend.to_string(), on };
    match crate::socket::client::ask(socket, request, Duration::from_secs(30))? {
        Response::Ok { message, .. } => {
            println!("{message}");
            Ok(ExitCode::SUCCESS)
        }
        Response::Failed { message, .. } => {
            eprintln!("{message}");
            Ok(ExitCode::FAILURE)
        }
        other => anyhow::bail!("the agent at {} answered {other:?}", socket.display()),
    }
}

fn status(socket: &Path, json: bool) -> anyhow::Result<ExitCode> {
    use crate::socket::protocol::{Request, Response};
    let response = crate::socket::client::ask(socket, Request::Status, Duration::from_secs(30))?;
    let Response::Status { node, backends, problems, shadows, recording, .. } = response else {
        anyhow::bail!("the agent at {} answered {response:?}, not a status", socket.display());
    };
    let degraded = problems.iter().any(|p| p.state != "candidate-rejected");
    if json {
        println!(
            "{}",
            serde_json::json!({
                "node": node,
                "backends": backends,
                "problems": problems,
                "shadows": shadows,
                "recording": recording,
            })
        );
    } else {
        println!("node {node}");
        for b in &backends {
            let state = problems
                .iter()
                .find(|p| p.backend.as_deref() == Some(&b.name))
                .map_or("serving", |p| p.state.as_str());
            println!(
                "  {:<16} {:<10} {:<16} {} (sha256 {})",
                b.name, b.version, state, b.file, b.sha256
            );
        }
        for p in &problems {
            println!(
                "  {}: {} {} (sha256 {}): {}",
                p.state,
                p.backend.as_deref().unwrap_or("-"),
                p.file,
                p.sha256,
                p.reason
            );
        }
        for s in &shadows {
            let total: u64 = s.differences.values().sum();
            println!(
                "  shadow of {}: {} {} (sha256 {}): {} calls compared, {} skipped, {total} answered otherwise",
                s.backend, s.file, s.version, s.sha256, s.compared, s.skipped
            );
            for (kind, n) in &s.differences {
                println!("    {kind}: {n}");
            }
            for e in &s.examples {
                println!("    {} {} at {}", e.kind, e.call, e.at);
                println!("      serving:   {}", e.serving);
                println!("      candidate: {}", e.candidate);
            }
        }
        if !recording.is_empty() {
            println!("  recording: {}", recording.join(", "));
        }
    }
    Ok(if degraded { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

fn load(runtime: &Arc<Runtime>, wasm: &Path) -> anyhow::Result<(Plugin, Duration)> {
    let start = Instant::now();
    let plugin = Plugin::load_file(runtime, wasm)?;
    Ok((plugin, start.elapsed()))
}

fn test(runtime: &Arc<Runtime>, wasm: &Path, paths: &[PathBuf]) -> anyhow::Result<ExitCode> {
    let (plugin, _) = load(runtime, wasm)?;
    let (mut passed, mut failed) = (0, 0);
    for path in paths {
        for file in scenario::files(path)? {
            match scenario::run_file(&plugin, &file) {
                Err(e) => {
                    failed += 1;
                    println!("ERROR {e}");
                }
                Ok(outcomes) => {
                    for o in outcomes {
                        match o.failure {
                            None => {
                                passed += 1;
                                println!("PASS  {}: {}", o.file.display(), o.name);
                            }
                            Some(why) => {
                                failed += 1;
                                println!("FAIL  {}: {}", o.file.display(), o.name);
                                for line in why.lines() {
                                    println!("      {line}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    println!("{} {}: {passed} passed, {failed} failed", plugin.name(), plugin.info().version);
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn inspect(runtime: &Arc<Runtime>, wasm: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let (plugin, compile) = load(runtime, wasm)?;
    let info = plugin.info();
    if json {
        let v = serde_json::json!({
            "file": plugin.path(),
            "sha256": plugin.sha256(),
            "size": plugin.size(),
            "export": plugin.export(),
            "contract": plugin.contract(),
            "optional": plugin.optional_exports(),
            "imports": plugin.imports(),
            "info": info,
            "load_ms": compile.as_secs_f64() * 1e3,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    let caps = &info.capabilities;
    let names = |v: Vec<&str>| if v.is_empty() { "-".to_string() } else { v.join(", ") };
    println!("file:        {}", plugin.path().display());
    println!("sha256:      {}", plugin.sha256());
    println!(
        "size:        {} bytes (compiled and checked in {:.1} ms)",
        plugin.size(),
        compile.as_secs_f64() * 1e3
    );
    let adapted = if plugin.contract() == crate::policy::CONTRACT_VERSION {
        String::new()
    } else {
        format!(" (contract {}, served through the host's adapter)", plugin.contract())
    };
    println!("world:       exports {}{adapted}", plugin.export());
    println!("optional:    {}", names(plugin.optional_exports()));
    println!("backend:     {} {}", info.name, info.version);
    println!("about:       {}", info.description);
    println!("steps:       {}", names(caps.steps.iter().map(|s| s.name()).collect()));
    println!("controller:  {}", names(caps.controller_steps.iter().map(|s| s.name()).collect()));
    println!("devices:     {}", names(caps.device_kinds.iter().map(|d| d.name()).collect()));
    println!("filesystems: {}", names(caps.filesystems.iter().map(String::as_str).collect()));
    println!(
        "network fs:  {}",
        names(caps.network_filesystems.iter().map(String::as_str).collect())
    );
    println!("path roots:  {}", names(caps.path_roots.iter().map(|r| r.name()).collect()));
    println!("imports:");
    for i in plugin.imports() {
        println!("  {i}");
    }
    Ok(ExitCode::SUCCESS)
}

fn bench(
    runtime: &Arc<Runtime>,
    wasm: &Path,
    scenarios: Option<PathBuf>,
    calls: u32,
) -> anyhow::Result<ExitCode> {
    let (plugin, compile) = load(runtime, wasm)?;
    println!(
        "{} {}: compiled and checked in {:.1} ms",
        plugin.name(),
        plugin.info().version,
        compile.as_secs_f64() * 1e3
    );
    println!(
        "{:<60} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "call", "calls", "p50 µs", "p99 µs", "mean µs", "max µs"
    );
    let mut prepared = Vec::new();
    match scenarios {
        None => prepared.push(None),
        Some(path) => {
            for file in scenario::files(&path)? {
                for p in scenario::load(&file, plugin.name())? {
                    let p = p.map_err(|(name, why)| {
                        anyhow::anyhow!("{}: {name}: {why}", file.display())
                    })?;
                    prepared.push(Some(p));
                }
            }
        }
    }
    let no_facts = Arc::new(crate::policy::RecordedQueries::default());
    for p in &prepared {
        let call = || match p {
            None => drop(plugin.call_info(no_facts.clone())),
            Some(p) => drop(p.execute(&plugin)),
        };
        call(); // warm-up: the first call touches fresh pool slots
        let mut samples: Vec<Duration> = (0..calls)
            .map(|_| {
                let start = Instant::now();
                call();
                start.elapsed()
            })
            .collect();
        let crate::stats::Summary { p50, p99, mean, max } = crate::stats::summarize(&mut samples);
        let name = p.as_ref().map_or("info", |p| p.name.as_str());
        println!(
            "{:<60} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            truncate(name, 60),
            calls,
            p50,
            p99,
            mean,
            max
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).collect::<String>() + "…"
    }
}
