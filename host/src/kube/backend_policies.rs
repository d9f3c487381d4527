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
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// How often the node's entries are written again with fresh counts, and
/// the versions looked at again, when nothing changes.
const ROUND: Duration = Duration::from_secs(10);

/// The objects as last listed: what the cluster trusts.
#[derive(Clone, Default)]
pub struct Listing(Arc<RwLock<Vec<BackendPolicy>>>);

impl Listing {
    /// The digests each object names, for its backend; none of a backend
    /// two objects name (neither is applied either).
    pub fn allow_list(&self) -> AllowList {
        let objects = self.0.read().unwrap_or_else(|p| p.into_inner());
        let mut list = AllowList::default();
        for o in objects.iter() {
            if conflict(&objects, o).is_some() {
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
    /// plugin dir); an API server that does not answer within a few
    /// seconds leaves the listing empty until the task's first round.
    pub async fn refresh(&self, client: &kube::Client) {
        let api: Api<BackendPolicy> = Api::all(client.clone());
        match tokio::time::timeout(Duration::from_secs(5), api.list(&ListParams::default())).await {
            Ok(Ok(list)) => {
                self.set(list.items);
            }
            Ok(Err(e)) => tracing::warn!("BackendPolicy objects not listed yet: {e}"),
            Err(_) => tracing::warn!("BackendPolicy objects not listed yet: no answer within 5 s"),
        }
    }

    fn set(&self, objects: Vec<BackendPolicy>) -> bool {
        let mut now = self.0.write().unwrap_or_else(|p| p.into_inner());
        let changed = now.iter().map(|o| &o.spec).ne(objects.iter().map(|o| &o.spec));
        *now = objects;
        changed
    }

    fn objects(&self) -> Vec<BackendPolicy> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
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
    /// Starts a pass over the plugin dir (what is trusted changed).
    pub poke: tokio::sync::mpsc::UnboundedSender<()>,
}

/// Follow the objects until cancelled: on every change, and every round.
pub async fn run(client: kube::Client, node: String, listing: Listing, r: Rollouts) {
    let api: Api<BackendPolicy> = Api::all(client);
    let mut changes =
        watcher(api.clone(), watcher::Config::default()).default_backoff().map(|_| ()).boxed();
    let stores = Arc::new(Mutex::new(Stores::new(r.stores.clone())));
    let r = Arc::new(r);
    // The last entry written per object, and when.
    let mut written: HashMap<String, (NodeRollout, Instant)> = HashMap::new();
    loop {
        match api.list(&ListParams::default()).await {
            Ok(list) => {
                if listing.set(list.items) {
                    let _ = r.poke.send(());
                }
                let objects = listing.objects();
                for o in &objects {
                    let entry = apply_one(&r, &stores, &objects, o, &node).await;
                    write_entry(&api, &node, o, entry, &mut written).await;
                }
                written.retain(|name, _| {
                    objects.iter().any(|o| o.metadata.name.as_ref() == Some(name))
                });
            }
            Err(e) => {
                tracing::warn!("BackendPolicy objects not listed: {e}; the last listing stands");
            }
        }
        let _ = tokio::time::timeout(ROUND, changes.next()).await;
        while let Ok(Some(())) =
            tokio::time::timeout(Duration::from_millis(200), changes.next()).await
        {}
    }
}

/// Put `o`'s versions in place; the node's entry of its status.
async fn apply_one(
    r: &Arc<Rollouts>,
    stores: &Arc<Mutex<Stores>>,
    objects: &[BackendPolicy],
    o: &BackendPolicy,
    node: &str,
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
        None => {
            let (r2, stores, w) = (r.clone(), stores.clone(), wanted.clone());
            tokio::task::spawn_blocking(move || {
                let mut stores = stores.lock().unwrap_or_else(|p| p.into_inner());
                directed::apply(&r2.runtime, &r2.trust, &mut stores, &r2.plugin_dir, &w)
            })
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("the rollout's task failed: {e}")))
            .map_err(|e| {
                let state =
                    if e.downcast_ref::<Missing>().is_some() { "Pending" } else { "Refused" };
                (state.to_string(), format!("{e:#}"))
            })
        }
    };
    match &applied {
        Ok(done) => {
            for line in done {
                tracing::info!(policy = name, backend = wanted.backend, "BackendPolicy: {line}");
            }
        }
        Err((state, why)) => {
            tracing::warn!(policy = name, backend = wanted.backend, "BackendPolicy {state}: {why}");
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

/// Write `entry` as the node's entry of `o`'s status when it changed, or
/// its counts are a round old.
async fn write_entry(
    api: &Api<BackendPolicy>,
    node: &str,
    o: &BackendPolicy,
    entry: NodeRollout,
    written: &mut HashMap<String, (NodeRollout, Instant)>,
) {
    let name = o.metadata.name.clone().unwrap_or_default();
    let same = |a: &NodeRollout, b: &NodeRollout| {
        NodeRollout { updated_at: String::new(), ..a.clone() }
            == NodeRollout { updated_at: String::new(), ..b.clone() }
    };
    let in_object = o.status.as_ref().and_then(|s| s.nodes.iter().find(|e| e.node == node));
    if let Some((last, at)) = written.get(&name)
        && same(last, &entry)
        && in_object.is_some_and(|e| same(e, &entry))
        && at.elapsed() < ROUND * 6
    {
        return;
    }
    let patch = serde_json::json!({
        "apiVersion": "volagent.io/v1alpha1",
        "kind": "BackendPolicy",
        "metadata": { "name": name },
        "status": { "nodes": [entry] },
    });
    let params = PatchParams::apply(&format!("volagent-agent-{node}")).force();
    match api.patch_status(&name, &params, &Patch::Apply(&patch)).await {
        Ok(_) => {
            written.insert(name, (entry, Instant::now()));
        }
        Err(e) => tracing::warn!(policy = name, "this node's entry of the status not written: {e}"),
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
