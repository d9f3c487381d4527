//! The cluster's `BackendPolicy` objects on a node: the digests they name
//! are trusted for their backends ([`Listing`]), the versions they choose
//! are put in place in the plugin dir ([`crate::plugin::directed`]), and
//! the node's own entry of each object's status says what serves here and
//! what the shadow saw — written by server-side apply under a field
//! manager of the node's own, so the entries of all nodes merge (the
//! controller's webhook holds each agent to its own entry).

use super::crds::{BackendPolicy, BackendPolicySpec, NodeRollout, RolloutMode};
use crate::ops::Agent;
use crate::plugin::directed::{self, Missing, Stores, Wanted};
use crate::plugin::trust::{AllowList, TrustSources};
use crate::policy::Runtime;
use crate::socket::status::Board;
use futures_util::StreamExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use sha2::Digest;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// How often the node's entries are written again with fresh counts, and
/// the versions looked at again, when nothing changes.
const ROUND: Duration = Duration::from_secs(10);

/// The objects as last listed: what the cluster trusts. What they trust is
/// kept on disk too (`cache`), so that an agent restarted while the API
/// server does not answer still serves the versions only they vouch for.
#[derive(Clone, Default)]
pub struct Listing {
    objects: Arc<RwLock<Option<Vec<BackendPolicy>>>>,
    /// Until the first listing: what the cache held.
    cached: Arc<RwLock<Option<AllowList>>>,
    cache: Option<PathBuf>,
}

impl Listing {
    /// A listing kept in the file `cache` (in the agent's state dir).
    pub fn cached_in(cache: PathBuf) -> Listing {
        Listing { cache: Some(cache), ..Listing::default() }
    }

    /// The digests each object names, for its backend; none of a backend
    /// two objects name (neither is applied either).
    pub fn allow_list(&self) -> AllowList {
        let objects = self.objects.read().unwrap_or_else(|p| p.into_inner());
        let Some(objects) = objects.as_ref() else {
            return self
                .cached
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or_default();
        };
        let mut list = AllowList::default();
        for o in objects {
            if conflict(objects, o).is_some() {
                continue;
            }
            list.add(&o.spec.backend, &o.spec.serving);
            if let Some(c) = &o.spec.candidate {
                list.add(&o.spec.backend, c);
            }
        }
        list
    }

    /// List the objects now (at start, before the first pass over the
    /// plugin dir); while the API server does not answer, the cache
    /// stands in until the task's first listing.
    pub async fn refresh(&self, client: &kube::Client) {
        let api: Api<BackendPolicy> = Api::all(client.clone());
        let why =
            match tokio::time::timeout(Duration::from_secs(5), api.list(&ListParams::default()))
                .await
            {
                Ok(Ok(list)) => {
                    self.set(list.items);
                    return;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer within 5 s".to_string(),
            };
        let cached = self.cache.as_deref().and_then(|path| {
            let text = std::fs::read_to_string(path).ok()?;
            AllowList::parse(path, &text).ok()
        });
        tracing::warn!(
            cached = cached.as_ref().map(AllowList::len),
            "BackendPolicy objects not listed yet ({why}): what they trusted when last listed stands in"
        );
        *self.cached.write().unwrap_or_else(|p| p.into_inner()) = cached;
    }

    /// The objects now; whether any spec changed.
    fn set(&self, objects: Vec<BackendPolicy>) -> bool {
        let changed = {
            let mut now = self.objects.write().unwrap_or_else(|p| p.into_inner());
            let changed = now
                .as_ref()
                .is_none_or(|now| now.iter().map(|o| &o.spec).ne(objects.iter().map(|o| &o.spec)));
            *now = Some(objects);
            changed
        };
        if changed && let Some(path) = &self.cache {
            let tmp = path.with_extension("new");
            let written = std::fs::write(&tmp, self.allow_list().render())
                .and_then(|()| std::fs::rename(&tmp, path));
            if let Err(e) = written {
                tracing::warn!(cache = %path.display(), "what BackendPolicy objects trust is not kept: {e}");
            }
        }
        changed
    }

    fn objects(&self) -> Vec<BackendPolicy> {
        self.objects.read().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default()
    }
}

/// What `spec` wants served and shadowed: with mode Serve the candidate
/// serves (the serving version is kept for a rollback); with Shadow it
/// runs beside the serving version.
pub fn wanted(spec: &BackendPolicySpec) -> Wanted {
    let (serve, candidate) = match (&spec.mode, &spec.candidate) {
        (RolloutMode::Serve, Some(c)) => (c.clone(), None),
        (RolloutMode::Shadow, c) => (spec.serving.clone(), c.clone()),
        (RolloutMode::Serve, None) => (spec.serving.clone(), None),
    };
    Wanted { backend: spec.backend.clone(), serve, candidate }
}

/// The other object naming `o`'s backend, if any.
fn conflict<'a>(objects: &'a [BackendPolicy], o: &BackendPolicy) -> Option<&'a BackendPolicy> {
    objects.iter().find(|x| x.spec.backend == o.spec.backend && x.metadata.name != o.metadata.name)
}

/// What the rollout task works with.
pub struct Rollouts {
    pub agent: Arc<Agent>,
    pub runtime: Arc<Runtime>,
    pub trust: Arc<TrustSources>,
    pub board: Arc<Board>,
    pub plugin_dir: PathBuf,
    pub stores: Vec<PathBuf>,
    /// Starts a pass over the plugin dir (what is trusted changed), when
    /// the dir is watched.
    pub poke: Option<crate::plugin::watch::Poke>,
}

/// Put the listed objects' versions in place now, before the first pass
/// over the plugin dir (blocking: it compiles what it checks). What fails
/// is said, and tried again by the task's rounds.
pub fn apply_at_start(
    listing: &Listing,
    runtime: &Arc<Runtime>,
    trust: &TrustSources,
    plugin_dir: &std::path::Path,
    stores: &[PathBuf],
) {
    let objects = listing.objects();
    let mut stores = Stores::new(stores.to_vec());
    for o in objects.iter().filter(|o| conflict(&objects, o).is_none()) {
        let w = wanted(&o.spec);
        match directed::apply(runtime, trust, &mut stores, plugin_dir, &w, None) {
            Ok(done) => {
                for line in done {
                    tracing::info!(backend = w.backend, "BackendPolicy at start: {line}");
                }
            }
            Err(e) => tracing::warn!(backend = w.backend, "BackendPolicy at start: {e:#}"),
        }
    }
}

/// A wake-up for every change of an object's spec (its generation), not
/// of its status: the nodes' own writes wake no one.
fn spec_changes(api: Api<BackendPolicy>) -> tokio::sync::mpsc::Receiver<()> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let mut seen: HashMap<String, Option<i64>> = HashMap::new();
        while let Some(event) = stream.next().await {
            let changed = match event {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                    let name = o.metadata.name.clone().unwrap_or_default();
                    seen.insert(name, o.metadata.generation) != Some(o.metadata.generation)
                }
                Ok(watcher::Event::Delete(o)) => {
                    seen.remove(&o.metadata.name.clone().unwrap_or_default()).is_some()
                }
                Ok(_) | Err(_) => false,
            };
            // A wake-up already waiting covers this one too.
            if changed && tx.try_send(()).is_err() && tx.is_closed() {
                return;
            }
        }
    });
    rx
}

/// Follow the objects until cancelled: on every change of a spec, and
/// every round (counts, stores filled, the agent's checks done).
pub async fn run(client: kube::Client, node: String, listing: Listing, r: Rollouts) {
    let api: Api<BackendPolicy> = Api::all(client);
    let mut changes = spec_changes(api.clone());
    let stores = Arc::new(Mutex::new(Stores::new(r.stores.clone())));
    let r = Arc::new(r);
    let manager = field_manager(&node);
    let mut written: HashMap<String, Written> = HashMap::new();
    let mut refused: HashMap<String, Refusal> = HashMap::new();
    loop {
        match api.list(&ListParams::default()).await {
            Ok(list) => {
                if listing.set(list.items)
                    && let Some(poke) = &r.poke
                {
                    poke.send();
                }
                let objects = listing.objects();
                for o in &objects {
                    let entry = apply_one(&r, &stores, &objects, o, &node, &mut refused).await;
                    write_entry(&api, &manager, o, entry, &mut written).await;
                }
                let named =
                    |name: &String| objects.iter().any(|o| o.metadata.name.as_ref() == Some(name));
                written.retain(|name, _| named(name));
                refused.retain(|name, _| named(name));
            }
            Err(e) => {
                tracing::warn!("BackendPolicy objects not listed: {e}; the last listing stands");
            }
        }
        let _ = tokio::time::timeout(ROUND, changes.recv()).await;
    }
}

/// The field manager of this node's entries: its own, within the API's
/// 128 characters whatever the node's name.
fn field_manager(node: &str) -> String {
    let name = format!("volagent-agent-{node}");
    if name.len() <= 128 {
        return name;
    }
    format!("volagent-agent-{}", &hex::encode(sha2::Sha256::digest(node.as_bytes()))[..32])
}

/// The last entry written for an object, and when.
struct Written {
    entry: NodeRollout,
    at: Instant,
}

/// A version the agent's checks refused, not tried again for a while (it
/// compiles and runs scenarios) unless what is wanted changes.
struct Refusal {
    wanted: Wanted,
    state: String,
    why: String,
    at: Instant,
}

/// How long a refused version is left before it is tried again.
const RETRY_REFUSED: Duration = Duration::from_secs(300);

/// Put `o`'s versions in place; the node's entry of its status.
async fn apply_one(
    r: &Arc<Rollouts>,
    stores: &Arc<Mutex<Stores>>,
    objects: &[BackendPolicy],
    o: &BackendPolicy,
    node: &str,
    refused: &mut HashMap<String, Refusal>,
) -> NodeRollout {
    let name = o.metadata.name.clone().unwrap_or_default();
    let wanted = wanted(&o.spec);
    let applied: Result<Vec<String>, (String, String)> = match conflict(objects, o) {
        Some(other) => Err((
            "Refused".into(),
            format!(
                "BackendPolicy {} names backend {} too: neither is applied",
                other.metadata.name.as_deref().unwrap_or("?"),
                o.spec.backend
            ),
        )),
        None => match refused
            .get(&name)
            .filter(|f| f.wanted == wanted && f.at.elapsed() < RETRY_REFUSED)
        {
            Some(f) => Err((f.state.clone(), f.why.clone())),
            None => {
                let (r2, stores, w) = (r.clone(), stores.clone(), wanted.clone());
                let loaded = r.agent.plugin(&wanted.backend).ok().map(|p| p.sha256().to_string());
                let result = tokio::task::spawn_blocking(move || {
                    let mut stores = stores.lock().unwrap_or_else(|p| p.into_inner());
                    directed::apply(
                        &r2.runtime,
                        &r2.trust,
                        &mut stores,
                        &r2.plugin_dir,
                        &w,
                        loaded.as_deref(),
                    )
                })
                .await
                .unwrap_or_else(|e| Err(anyhow::anyhow!("the rollout's task failed: {e}")));
                match result {
                    Ok(done) => {
                        refused.remove(&name);
                        Ok(done)
                    }
                    // Waiting for a store is cheap to look at again.
                    Err(e) if e.downcast_ref::<Missing>().is_some() => {
                        Err(("Pending".to_string(), format!("{e:#}")))
                    }
                    Err(e) => {
                        let why = format!("{e:#}");
                        tracing::warn!(
                            policy = name,
                            backend = wanted.backend,
                            "BackendPolicy refused: {why}"
                        );
                        refused.insert(
                            name.clone(),
                            Refusal {
                                wanted: wanted.clone(),
                                state: "Refused".into(),
                                why: why.clone(),
                                at: Instant::now(),
                            },
                        );
                        Err(("Refused".to_string(), why))
                    }
                }
            }
        },
    };
    match &applied {
        Ok(done) => {
            for line in done {
                tracing::info!(policy = name, backend = wanted.backend, "BackendPolicy: {line}");
            }
        }
        Err((state, why)) => {
            tracing::debug!(
                policy = name,
                backend = wanted.backend,
                "BackendPolicy {state}: {why}"
            );
        }
    }
    entry(r, node, &wanted, applied.err())
}

/// The node's entry: what serves and shadows here, and how that stands
/// against what is wanted.
fn entry(
    r: &Rollouts,
    node: &str,
    wanted: &Wanted,
    failed: Option<(String, String)>,
) -> NodeRollout {
    let serving = r.agent.plugin(&wanted.backend).ok().map(|p| p.sha256().to_string());
    let shadow = r.board.shadows_now().into_iter().find(|s| s.backend == wanted.backend);
    let candidate = shadow.as_ref().map(|s| s.sha256.clone());
    let (compared, differences) = shadow
        .as_ref()
        .map(|s| {
            let differences: u64 = s.differences.values().sum();
            (
                i64::try_from(s.compared).unwrap_or(i64::MAX),
                i64::try_from(differences).unwrap_or(i64::MAX),
            )
        })
        .unwrap_or((0, 0));
    let (state, message) = match failed {
        Some((state, why)) => (state, Some(why)),
        None if serving.as_deref() == Some(&wanted.serve) && candidate == wanted.candidate => {
            ("Applied".to_string(), None)
        }
        None => {
            // Put in place, but not taken: the agent's checks may have
            // refused it (said in its status), or not run yet.
            let refused = r.board.problems_now().into_iter().find(|p| {
                p.backend.as_deref() == Some(&wanted.backend)
                    && (p.sha256 == wanted.serve || Some(&p.sha256) == wanted.candidate.as_ref())
            });
            match refused {
                Some(p) => ("Refused".to_string(), Some(format!("{}: {}", p.file, p.reason))),
                None => ("Pending".to_string(), Some("waiting for the agent to load it".into())),
            }
        }
    };
    NodeRollout {
        node: node.to_string(),
        serving,
        candidate,
        compared,
        differences,
        state,
        message,
        updated_at: crate::clock::now_rfc3339(),
    }
}

/// How often an entry whose counts alone moved is written again.
const COUNTS_EVERY: Duration = Duration::from_secs(60);

/// Write `entry` as the node's entry of `o`'s status: at once when what
/// serves, what shadows, the state or the differences changed (or the
/// object lacks it), when only the calls compared moved at most every
/// minute, never when idle.
async fn write_entry(
    api: &Api<BackendPolicy>,
    manager: &str,
    o: &BackendPolicy,
    entry: NodeRollout,
    written: &mut HashMap<String, Written>,
) {
    let name = o.metadata.name.clone().unwrap_or_default();
    let without_time = |e: &NodeRollout| NodeRollout { updated_at: String::new(), ..e.clone() };
    // A new difference is news for the admin; calls compared are not.
    let without_counts = |e: &NodeRollout| NodeRollout { compared: 0, ..without_time(e) };
    let in_object = o.status.as_ref().and_then(|s| s.nodes.iter().find(|e| e.node == entry.node));
    let due = match (written.get(&name), in_object) {
        (Some(last), Some(shown)) => {
            without_counts(&last.entry) != without_counts(&entry)
                || without_counts(shown) != without_counts(&entry)
                || (without_time(&last.entry) != without_time(&entry)
                    && last.at.elapsed() >= COUNTS_EVERY)
        }
        _ => true,
    };
    if !due {
        return;
    }
    let patch = serde_json::json!({
        "apiVersion": "volagent.io/v1alpha1",
        "kind": "BackendPolicy",
        "metadata": { "name": name },
        "status": { "nodes": [entry] },
    });
    let params = PatchParams::apply(manager).force();
    match api.patch_status(&name, &params, &Patch::Apply(&patch)).await {
        Ok(_) => {
            written.insert(name, Written { entry, at: Instant::now() });
        }
        Err(e) => {
            tracing::warn!(policy = name, "this node's entry of the status not written: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mode: RolloutMode, candidate: Option<&str>) -> BackendPolicySpec {
        BackendPolicySpec {
            backend: "local-pv".into(),
            serving: "a".repeat(64),
            candidate: candidate.map(str::to_string),
            mode,
        }
    }

    #[test]
    fn serve_mode_serves_the_candidate_and_shadow_mode_runs_it_beside() {
        let c = "c".repeat(64);
        let w = wanted(&spec(RolloutMode::Shadow, Some(&c)));
        assert_eq!((w.serve, w.candidate), ("a".repeat(64), Some(c.clone())));
        let w = wanted(&spec(RolloutMode::Serve, Some(&c)));
        assert_eq!((w.serve, w.candidate), (c, None));
        let w = wanted(&spec(RolloutMode::Serve, None));
        assert_eq!((w.serve, w.candidate), ("a".repeat(64), None));
    }

    #[test]
    fn two_objects_for_one_backend_are_neither_trusted() {
        let object = |name: &str, backend: &str, sha: char| {
            let mut s = spec(RolloutMode::Shadow, None);
            s.backend = backend.into();
            s.serving = sha.to_string().repeat(64);
            BackendPolicy::new(name, s)
        };
        let listing = Listing::default();
        listing.set(vec![
            object("a", "nbd", 'a'),
            object("b", "nbd", 'b'),
            object("c", "rbd", 'c'),
        ]);
        let list = listing.allow_list();
        assert!(
            list.backends(&"a".repeat(64)).is_none() && list.backends(&"b".repeat(64)).is_none()
        );
        assert!(list.backends(&"c".repeat(64)).is_some_and(|b| b.contains("rbd")));
    }
}
