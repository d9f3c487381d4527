//! Hot reload of the plugin dir. A pass compares the dir with what is
//! loaded and acts on the difference:
//!
//! - a new or changed `*.wasm` is loaded and checked (world, imports,
//!   `info`, and its own scenarios when shipped beside it as
//!   `<stem>.scenarios.yaml` or a `<stem>.scenarios/` dir) off the serving
//!   path, then swapped in; calls already running finish on the old version;
//! - a bad file is never swapped in: the last good version of its backend
//!   keeps serving and the backend is reported degraded (log, metric,
//!   status, Event) until a good file replaces it;
//! - a removed file unloads its backend and uninstalls its driver, unless
//!   volumes of that backend are attached here: then it stays loaded, says
//!   so, and the removal completes in a later pass once they are gone.
//!
//! Every file must be trusted first ([`super::trust`]): listed for its
//! backend, or signed with a configured key. An untrusted file is refused
//! before it is compiled, and the last trusted version keeps serving.
//!
//! A file named `<backend>.candidate.wasm` is not served: once loaded and
//! checked like any other, it runs in the shadow of the backend's serving
//! version ([`super::observe`]); removing it ends the shadow.
//! `<backend>.previous.wasm` is the version `volagent plugin promote` kept
//! for a rollback, and is not loaded. Dot-files are installs in progress
//! and are ignored.

use super::install::{self, DriverConfig};
use super::trust::{self, Trust};
use crate::ops::Agent;
use crate::policy::{Plugin, Runtime};
use crate::socket::protocol::PluginProblem;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a backend's kubelet integration goes.
#[derive(Clone)]
pub struct Integration {
    /// kubelet's volume plugin dir, or None not to install drivers.
    pub volume_plugin_dir: Option<PathBuf>,
    pub driver_binary: PathBuf,
    pub socket: PathBuf,
    pub kubelet_root: PathBuf,
    /// The agent's pod, for kubelet's plugin-containers registration
    /// (from the downward API); None outside a pod.
    pub pod: Option<super::install::PodIdentity>,
    /// The CSI drivers, or None not to serve CSI.
    pub csi: Option<Arc<crate::csi::drivers::Drivers>>,
    /// Where the status learns of the plugin dir's problems.
    pub board: Arc<crate::socket::status::Board>,
    /// The cluster, told of a rejected file with an Event on the agent's pod.
    pub cluster: Option<crate::kube::cluster::Cluster>,
    /// What sees the served backends' calls, and runs candidates.
    pub observer: Option<Arc<super::observe::Observer>>,
    /// What decides which files may be loaded.
    pub trust: Arc<super::trust::TrustSources>,
}

/// One file that serves a backend.
#[derive(Debug, Clone)]
struct Served {
    backend: String,
    sha256: String,
}

/// What a pass changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    pub added: Vec<String>,
    pub updated: Vec<String>,
    pub removed: Vec<String>,
    /// Files newly found bad: "<file>: <reason>".
    pub rejected: Vec<String>,
    /// Backends whose candidate now runs in the shadow, and whose ended.
    pub shadowed: Vec<String>,
    pub unshadowed: Vec<String>,
}

/// What a file of the plugin dir is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role<'a> {
    Serving,
    /// A candidate for the backend named.
    Candidate(&'a str),
    /// A version kept for a rollback.
    Kept,
}

fn role(name: &str) -> Role<'_> {
    if let Some(backend) = name.strip_suffix(CANDIDATE) {
        Role::Candidate(backend)
    } else if name.ends_with(PREVIOUS) {
        Role::Kept
    } else {
        Role::Serving
    }
}

/// The name ends of a candidate and of the version a promotion kept.
pub const CANDIDATE: &str = ".candidate.wasm";
pub const PREVIOUS: &str = ".previous.wasm";

/// A file found bad: its content's digest, its backend, why, and whether
/// it was a candidate.
#[derive(Debug, Clone)]
struct Rejected {
    sha256: String,
    backend: Option<String>,
    reason: String,
    candidate: bool,
    /// Refused as untrusted, under these trust sources and this signature:
    /// reconsidered when they change.
    trust_state: Option<String>,
}

impl Rejected {
    fn new(sha256: String, backend: Option<String>, reason: String, candidate: bool) -> Rejected {
        Rejected { sha256, backend, reason, candidate, trust_state: None }
    }

    fn untrusted(mut self, trust_state: String) -> Rejected {
        self.trust_state = Some(trust_state);
        self
    }

    /// Whether `sha256`, under `trust_state`, was refused already.
    fn same(&self, sha256: &str, trust_state: &str) -> bool {
        self.sha256 == sha256 && self.trust_state.as_deref().is_none_or(|t| t == trust_state)
    }

    fn state(&self) -> &'static str {
        match (self.candidate, &self.trust_state) {
            (true, _) => "candidate-rejected",
            (false, Some(_)) => "untrusted",
            (false, None) => "degraded",
        }
    }
}

/// A file's contents and what decides whether to trust them.
struct Found {
    sha256: String,
    bytes: Vec<u8>,
    signature: Option<(String, Result<Vec<u8>, String>)>,
    /// What decides whether it is trusted (see [`Trust::state_of`]).
    trust_state: String,
}

pub struct Reloader {
    agent: Arc<Agent>,
    runtime: Arc<Runtime>,
    dir: PathBuf,
    integration: Integration,
    /// File name → what it serves.
    served: BTreeMap<String, Served>,
    /// File name → its last rejected content and why (so an unchanged bad
    /// file is not loaded and reported again every pass).
    rejected: BTreeMap<String, Rejected>,
    /// Candidate file name → what runs in the shadow.
    candidates: BTreeMap<String, Served>,
    /// Backends whose file is gone but whose volumes are still attached.
    pending_removal: BTreeMap<String, (String, String)>,
    /// What is wrong with the trust sources themselves.
    trust_problem: Option<String>,
    passes: u64,
    /// The runtime's compiles begun when memory was last given back.
    released_at: u64,
    rt: tokio::runtime::Handle,
}

/// The file `name` of the plugin dir, read safely: beneath the dir, a
/// regular file, within the size limit.
fn read_plugin(dir: &Path, name: &str, max: u64) -> Result<Vec<u8>, String> {
    crate::sys::beneath::read_beneath(dir, Path::new(name), max).map_err(|e| e.to_string())
}

/// The `*.wasm` files of `dir` that are not dot-files, by file name.
fn wasm_files(dir: &Path) -> std::io::Result<BTreeMap<String, PathBuf>> {
    Ok(std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "wasm"))
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            (!name.starts_with('.')).then_some((name, p))
        })
        .collect())
}

/// The scenarios shipped beside `file`, if any.
fn scenarios_beside(file: &Path) -> Option<PathBuf> {
    let stem = file.file_stem()?.to_str()?;
    let dir = file.parent()?;
    [dir.join(format!("{stem}.scenarios.yaml")), dir.join(format!("{stem}.scenarios"))]
        .into_iter()
        .find(|p| p.exists())
}

/// Load `file` (its `bytes`, read once) and run its own scenarios; the
/// plugin, or why not.
fn load_checked(
    runtime: &Arc<Runtime>,
    file: &Path,
    bytes: &[u8],
    candidate: bool,
) -> Result<Plugin, (Option<String>, String)> {
    let plugin = load(runtime, file, bytes, candidate).map_err(|e| (None, e))?;
    run_scenarios(&plugin, file)?;
    Ok(plugin)
}

/// Load `file` (compiled, its world, imports and `info` checked).
fn load(
    runtime: &Arc<Runtime>,
    file: &Path,
    bytes: &[u8],
    candidate: bool,
) -> Result<Plugin, String> {
    let loaded = if candidate {
        Plugin::load_candidate(runtime, file, bytes)
    } else {
        Plugin::load_bytes(runtime, file, bytes)
    };
    loaded.map_err(|e| e.to_string())
}

/// Run the scenarios shipped beside `file` on `plugin`.
fn run_scenarios(plugin: &Plugin, file: &Path) -> Result<(), (Option<String>, String)> {
    if let Some(scenarios) = scenarios_beside(file) {
        let backend = Some(plugin.name().to_string());
        let files = crate::policy::scenario::files(&scenarios)
            .map_err(|e| (backend.clone(), format!("its scenarios: {e}")))?;
        for f in files {
            let outcomes = crate::policy::scenario::run_file(plugin, &f)
                .map_err(|e| (backend.clone(), format!("its scenarios: {e}")))?;
            if let Some(o) = outcomes.iter().find(|o| o.failure.is_some()) {
                let why = o.failure.clone().unwrap_or_default();
                let first = why.lines().next().unwrap_or_default().to_string();
                return Err((
                    backend,
                    format!("its scenario {:?} in {} fails: {first}", o.name, f.display()),
                ));
            }
        }
    }
    Ok(())
}

/// The checks a new file of the plugin dir gets, for a file that will be
/// named `named` (its scenarios are looked for beside that name): the
/// plugin, or why it would be refused.
pub fn check_file(runtime: &Arc<Runtime>, named: &Path, bytes: &[u8]) -> Result<Plugin, String> {
    load_checked(runtime, named, bytes, true).map_err(|(_, why)| why)
}

impl Reloader {
    /// `rt` runs the async parts (stash reads, Events).
    pub fn new(
        agent: Arc<Agent>,
        runtime: Arc<Runtime>,
        dir: PathBuf,
        integration: Integration,
        rt: tokio::runtime::Handle,
    ) -> Reloader {
        Reloader {
            agent,
            runtime,
            dir,
            integration,
            served: BTreeMap::new(),
            rejected: BTreeMap::new(),
            candidates: BTreeMap::new(),
            pending_removal: BTreeMap::new(),
            trust_problem: None,
            passes: 0,
            released_at: 0,
            rt,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Passes run so far.
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// True while a removal waits for volumes to be detached.
    pub fn removal_pending(&self) -> bool {
        !self.pending_removal.is_empty()
    }

    /// Bring what is served in line with the dir. Blocking (compiles).
    /// Not from an async task: it blocks on the runtime.
    pub fn pass(&mut self) -> PassReport {
        self.passes += 1;
        crate::metrics::get().plugin_reloads.inc();
        let mut report = PassReport::default();
        let files = match wasm_files(&self.dir) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(dir = %self.dir.display(), "plugin dir unreadable; backends stay as they are: {e}");
                return report;
            }
        };
        let trust = self.integration.trust.now();
        self.note_trust_problem(trust.problem());
        let mut candidates = BTreeMap::new();
        for (name, path) in &files {
            match role(name) {
                Role::Serving => {}
                Role::Kept => continue,
                Role::Candidate(backend) => {
                    candidates.insert(name.clone(), (backend.to_string(), path.clone()));
                    continue;
                }
            }
            let bytes = read_plugin(&self.dir, name, self.runtime.limits.max_file_bytes);
            let sha = match &bytes {
                Ok(bytes) => hex::encode(Sha256::digest(bytes)),
                // Unreadable is bad too: said, never skipped in silence.
                Err(_) if self.rejected.get(name).is_some_and(|r| r.sha256.is_empty()) => continue,
                Err(e) => {
                    let backend = self.served.get(name).map(|s| s.backend.clone());
                    let r =
                        Rejected::new(String::new(), backend, format!("unreadable: {e}"), false);
                    self.reject(name, r, &mut report);
                    continue;
                }
            };
            if self.served.get(name).is_some_and(|s| s.sha256 == sha) {
                // Unchanged, or back to the version that serves.
                if self.rejected.remove(name).is_some() {
                    tracing::info!(file = %path.display(), "the serving version's file is back: no longer degraded");
                }
                continue;
            }
            let Ok(bytes) = bytes else { continue };
            let found = self.found(&trust, name, sha, bytes);
            if self.rejected.get(name).is_some_and(|r| r.same(&found.sha256, &found.trust_state)) {
                continue;
            }
            match self.load_trusted(&trust, path, found, false) {
                Ok((plugin, grant, sha)) => self.take(name, path, sha, plugin, &grant, &mut report),
                Err(mut r) => {
                    r.backend =
                        r.backend.or_else(|| self.served.get(name).map(|s| s.backend.clone()));
                    self.reject(name, r, &mut report);
                }
            }
        }
        for (name, (backend, path)) in &candidates {
            self.candidate(&trust, name, backend, path, &mut report);
        }
        let ended: Vec<String> =
            self.candidates.keys().filter(|n| !candidates.contains_key(*n)).cloned().collect();
        for name in ended {
            if let Some(c) = self.candidates.remove(&name) {
                self.unshadow(&c.backend, &mut report);
            }
        }
        let gone: Vec<String> = self
            .served
            .keys()
            .filter(|n| !files.contains_key(*n) || role(n) != Role::Serving)
            .cloned()
            .collect();
        for name in gone {
            if let Some(s) = self.served.remove(&name) {
                self.pending_removal.insert(s.backend, (name, s.sha256));
            }
        }
        self.rejected.retain(|name, _| files.contains_key(name));
        self.finish_removals(&mut report);
        self.publish();
        // After any compile since the last release, in a pass or not (a
        // BackendPolicy's checks compile before the rename that starts the
        // pass, which then finds the version kept).
        let attempts = self.runtime.compile_attempts();
        if attempts != self.released_at {
            self.released_at = attempts;
            crate::sys::memory::release_after_compile();
        }
        report
    }

    /// The file `name` (of digest `sha256`) with the signature beside it.
    fn found(&self, trust: &Trust, name: &str, sha256: String, bytes: Vec<u8>) -> Found {
        let signature = trust::signature_beside(&self.dir, name);
        let trust_state = trust.state_of(&sha256, &trust::signature_state(&signature));
        Found { sha256, bytes, signature, trust_state }
    }

    /// `found` loaded and checked, once it is trusted: the plugin, why it
    /// was trusted, and its digest; or why it is refused.
    fn load_trusted(
        &self,
        trust: &Trust,
        path: &Path,
        found: Found,
        candidate: bool,
    ) -> Result<(Plugin, trust::Grant, String), Rejected> {
        let Found { sha256, bytes, signature, trust_state } = found;
        let signature = signature.as_ref().map(|(n, r)| (n.as_str(), r.clone()));
        // Before it is compiled: an untrusted file never runs.
        let grant = trust.check(&sha256, &bytes, signature).map_err(|why| {
            Rejected::new(sha256.clone(), None, why, candidate).untrusted(trust_state.clone())
        })?;
        let plugin = load(&self.runtime, path, &bytes, candidate)
            .map_err(|why| Rejected::new(sha256.clone(), None, why, candidate))?;
        // A listing holds for the backends it names: checked once `info`
        // says which this is, before it serves or runs its scenarios.
        if let Err(why) = grant.covers(plugin.name(), &sha256) {
            let backend = Some(plugin.name().to_string());
            return Err(Rejected::new(sha256, backend, why, candidate).untrusted(trust_state));
        }
        run_scenarios(&plugin, path)
            .map_err(|(backend, why)| Rejected::new(sha256.clone(), backend, why, candidate))?;
        Ok((plugin, grant, sha256))
    }

    /// Say (once per change) what is wrong with the trust sources.
    fn note_trust_problem(&mut self, problem: Option<String>) {
        if problem != self.trust_problem {
            if let Some(p) = &problem {
                tracing::error!("{p}; only signed policies can be loaded until it is mended");
            }
            self.trust_problem = problem;
        }
    }

    /// Run the candidate `name` in the shadow of `backend`, once it is
    /// loaded and checked like any other file.
    fn candidate(
        &mut self,
        trust: &Trust,
        name: &str,
        backend: &str,
        path: &Path,
        report: &mut PassReport,
    ) {
        if self.integration.observer.is_none() {
            return;
        }
        let bytes = read_plugin(&self.dir, name, self.runtime.limits.max_file_bytes);
        let sha = match &bytes {
            Ok(bytes) => hex::encode(Sha256::digest(bytes)),
            Err(_) if self.rejected.get(name).is_some_and(|r| r.sha256.is_empty()) => return,
            Err(e) => {
                self.end_candidate(name, report);
                let reason = format!("unreadable: {e}");
                let r = Rejected::new(String::new(), Some(backend.into()), reason, true);
                return self.reject(name, r, report);
            }
        };
        if self.candidates.get(name).is_some_and(|c| c.sha256 == sha) {
            return;
        }
        let Ok(bytes) = bytes else { return };
        let found = self.found(trust, name, sha, bytes);
        if self.rejected.get(name).is_some_and(|r| r.same(&found.sha256, &found.trust_state)) {
            return;
        }
        // A new content: whatever ran for the old one ends now.
        self.end_candidate(name, report);
        let loaded = self.load_trusted(trust, path, found, true).and_then(|(p, grant, sha)| {
            if p.name() == backend {
                return Ok((p, grant, sha));
            }
            let why = format!(
                "named as a candidate for backend {backend}, but it is backend {}",
                p.name()
            );
            Err(Rejected::new(sha, None, why, true))
        });
        let (plugin, grant, sha) = match loaded {
            Ok(x) => x,
            Err(mut r) => {
                r.backend = Some(backend.into());
                return self.reject(name, r, report);
            }
        };
        let version = plugin.info().version.clone();
        if let Some(observer) = &self.integration.observer {
            observer.set_shadow(backend, Some(Arc::new(plugin)));
        }
        self.rejected.remove(name);
        self.candidates
            .insert(name.to_string(), Served { backend: backend.to_string(), sha256: sha.clone() });
        tracing::info!(backend, version, file = %path.display(), sha256 = sha, trusted = grant.describe(), "candidate runs in the shadow of the serving version");
        report.shadowed.push(backend.to_string());
    }

    fn end_candidate(&mut self, name: &str, report: &mut PassReport) {
        if let Some(c) = self.candidates.remove(name) {
            self.unshadow(&c.backend, report);
        }
    }

    fn unshadow(&self, backend: &str, report: &mut PassReport) {
        if let Some(observer) = &self.integration.observer {
            observer.set_shadow(backend, None);
        }
        tracing::info!(backend, "no candidate runs in the shadow any more");
        report.unshadowed.push(backend.to_string());
    }

    fn take(
        &mut self,
        name: &str,
        path: &Path,
        sha: String,
        plugin: Plugin,
        grant: &trust::Grant,
        report: &mut PassReport,
    ) {
        let backend = plugin.name().to_string();
        if let Some((other, _)) =
            self.served.iter().find(|(n, s)| s.backend == backend && n.as_str() != name)
        {
            let reason = format!("backend {backend} is already served by {other}");
            return self.reject(name, Rejected::new(sha, Some(backend), reason, false), report);
        }
        let version = plugin.info().version.clone();
        if let Some(observer) = &self.integration.observer {
            plugin.set_tap(observer.tap(&backend));
        }
        let old = self.agent.swap_plugin(plugin);
        self.rejected.remove(name);
        self.pending_removal.remove(&backend);
        self.served
            .insert(name.to_string(), Served { backend: backend.clone(), sha256: sha.clone() });
        match old {
            Some(old) => {
                tracing::info!(backend, version, file = %path.display(), sha256 = sha, trusted = grant.describe(), previous = %old.info().version, "backend updated");
                report.updated.push(backend.clone());
            }
            None => {
                tracing::info!(backend, version, file = %path.display(), sha256 = sha, trusted = grant.describe(), "backend added");
                report.added.push(backend.clone());
            }
        }
        // Reinstalling an unchanged driver is harmless and repairs one a
        // person deleted.
        self.integrate(&backend);
    }

    fn reject(&mut self, name: &str, rejected: Rejected, report: &mut PassReport) {
        let file = self.dir.join(name).display().to_string();
        let Rejected { sha256: sha, backend, reason, candidate, .. } = &rejected;
        let candidate = *candidate;
        let serving =
            backend.as_ref().is_some_and(|b| self.served.values().any(|s| &s.backend == b));
        let consequence = if candidate {
            "not run in the shadow"
        } else if serving {
            "the last good version keeps serving"
        } else {
            "not loaded"
        };
        // A candidate never served: its rejection degrades nothing.
        let (what, event) = match (rejected.state(), rejected.trust_state.is_some()) {
            (_, true) => ("untrusted policy refused", "PolicyUntrusted"),
            ("candidate-rejected", _) => ("candidate rejected", "PolicyCandidateRejected"),
            _ => ("backend degraded", "BackendDegraded"),
        };
        tracing::error!(
            file,
            sha256 = sha,
            backend = backend.as_deref().unwrap_or("?"),
            "{what}: {reason}; {consequence}"
        );
        // An untrusted file of no backend yet degrades none (it was never
        // compiled to say which it is).
        if !candidate && (backend.is_some() || rejected.trust_state.is_none()) {
            crate::metrics::get().backend_degraded(backend.as_deref().unwrap_or(name), 1);
        }
        if let Some(cluster) = self.integration.cluster.clone()
            && let Some(pod) = &self.integration.pod
        {
            let message = format!("{file} (sha256 {sha}) rejected: {reason}; {consequence}");
            let pod = pod.clone();
            self.rt.spawn(async move {
                cluster
                    .pod_event(
                        &pod.pod_namespace,
                        &pod.pod_name,
                        &pod.pod_uid,
                        true,
                        event,
                        &message,
                    )
                    .await;
            });
        }
        report.rejected.push(format!("{file}: {reason}"));
        self.rejected.insert(name.to_string(), rejected);
    }

    fn finish_removals(&mut self, report: &mut PassReport) {
        let pending: Vec<String> = self.pending_removal.keys().cloned().collect();
        for backend in pending {
            let attached = match self.rt.block_on(self.agent.volumes_of(&backend)) {
                Ok(v) => v,
                Err(f) => {
                    tracing::error!(
                        backend,
                        "cannot tell whether volumes are attached; removal waits: {}",
                        f.message
                    );
                    continue;
                }
            };
            if !attached.is_empty() {
                tracing::warn!(backend, volumes = ?attached, "backend file removed, but volumes are attached here: it stays loaded until they are detached");
                continue;
            }
            self.pending_removal.remove(&backend);
            self.agent.remove_plugin(&backend);
            // The status says it is gone before its driver is.
            self.publish();
            self.disintegrate(&backend);
            crate::metrics::get().backend_degraded(&backend, 0);
            tracing::info!(backend, "backend removed and its driver uninstalled");
            report.removed.push(backend);
        }
    }

    /// Tell the agent's status what is wrong.
    fn publish(&self) {
        let mut problems: Vec<PluginProblem> = self
            .rejected
            .iter()
            .map(|(name, r)| PluginProblem {
                backend: r.backend.clone(),
                file: self.dir.join(name).display().to_string(),
                sha256: r.sha256.clone(),
                state: r.state().into(),
                reason: r.reason.clone(),
            })
            .collect();
        if let Some(why) = &self.trust_problem {
            problems.push(PluginProblem {
                backend: None,
                file: self.integration.trust.allow_list().display().to_string(),
                sha256: String::new(),
                state: "allow-list-invalid".into(),
                reason: why.clone(),
            });
        }
        problems.extend(
            self.pending_removal.iter().map(|(backend, (name, sha))| PluginProblem {
                backend: Some(backend.clone()),
                file: self.dir.join(name).display().to_string(),
                sha256: sha.clone(),
                state: "removal-pending".into(),
                reason:
                    "the file was removed, but volumes of this backend are attached on this node"
                        .into(),
            }),
        );
        // A backend served by a good file is not degraded any more.
        for s in self.served.values() {
            if !problems.iter().any(|p| {
                p.backend.as_deref() == Some(&s.backend) && p.state != "candidate-rejected"
            }) {
                crate::metrics::get().backend_degraded(&s.backend, 0);
            }
        }
        self.integration.board.set_plugin_problems(problems);
    }

    /// The driver and the plugin-containers registration of `backend`.
    fn integrate(&self, backend: &str) {
        let i = &self.integration;
        if let Some(vpd) = &i.volume_plugin_dir {
            let config = DriverConfig { socket: i.socket.clone(), backend: backend.to_string() };
            match install::install_driver(vpd, &i.driver_binary, &config) {
                Ok(path) => {
                    tracing::info!(backend, driver = %path.display(), "Flexvolume driver installed: kubelet sees it as volagent/{backend}");
                }
                Err(e) => tracing::error!(backend, "Flexvolume driver not installed: {e}"),
            }
        }
        if let Some(csi) = &i.csi
            && let Err(e) = csi.add(backend)
        {
            tracing::error!(backend, "CSI driver not served: {e}");
        }
        if let Some(pod) = &i.pod {
            match install::register_container(&i.kubelet_root, backend, pod) {
                Ok(path) => {
                    tracing::info!(backend, file = %path.display(), "registered the agent's container for kubelet's mount utilities");
                }
                Err(e) => {
                    tracing::error!(backend, "plugin-containers registration not written: {e}");
                }
            }
        }
    }

    fn disintegrate(&self, backend: &str) {
        let i = &self.integration;
        if let Some(csi) = &i.csi {
            csi.remove(backend);
        }
        if let Some(vpd) = &i.volume_plugin_dir
            && let Err(e) = install::uninstall_driver(vpd, backend)
        {
            tracing::error!(backend, "Flexvolume driver not uninstalled: {e}");
        }
        if i.pod.is_some()
            && let Err(e) = install::unregister_container(&i.kubelet_root, backend)
        {
            tracing::error!(backend, "plugin-containers registration not removed: {e}");
        }
    }
}
