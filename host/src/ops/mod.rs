//! The operation pipeline: per-volume lock → fence → ledger → plan →
//! execute, with the ledger entry rolled back when execution fails.

pub mod cleanup;
pub mod cluster;
pub mod csi;
mod failure;
pub mod held;
pub mod oplog;
pub mod queries;
pub mod reconcile;
pub mod release;
pub mod request;
pub mod stash;
mod takeover;

use crate::clock::now_rfc3339;
use crate::exec::Executor;
use crate::ledger::{Ledger, LedgerError, Record, StorageClient, VolumeSource};
use crate::policy::{Decision, Holder, NodeFacts, NodePaths, PathRoot, Plugin, Volume};
use crate::sys::Sys;
use cluster::{ClusterError, ClusterView};
pub use failure::{Done, Failure, FailureKind, MAX_MESSAGE};
use oplog::{Finished, Op, Subject};
use queries::NodeQueries;
use request::{MountDir, parse_mount, parse_mount_dir};
use stash::{Entry, Stash};
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Where this node keeps things. The dirs are resolved (no symlinks): the
/// agent acts only beneath them.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node: String,
    pub kubelet_root: PathBuf,
    /// kubelet's root as configured, which is how kubelet spells the dirs
    /// it passes (it may be a symlink to `kubelet_root`).
    pub kubelet_root_given: PathBuf,
    pub state_dir: PathBuf,
    pub discovery_dirs: Vec<PathBuf>,
    /// Backends whose inline pod volumes are served (with a cluster; keyed
    /// by pod UID and volume name).
    pub inline_backends: Vec<String>,
}

/// The tag of the loop devices the agent of `node` with state dir
/// `state_dir` attaches: stable across its restarts, and not another
/// agent's on the same machine (test nodes, two installs). At most 63
/// bytes, the size of the field that carries it.
pub fn loop_tag(node: &str, state_dir: &std::path::Path) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(state_dir.as_os_str().as_encoded_bytes());
    let mut node = node.to_string();
    while node.len() > 36 {
        node.pop();
    }
    format!("volagent:{node}:{}", hex::encode(&digest[..8]))
}

impl NodeConfig {
    /// The roots the agent acts beneath.
    pub fn roots(&self) -> Vec<PathBuf> {
        let mut roots = vec![self.kubelet_root.clone(), self.state_dir.clone()];
        roots.extend(self.discovery_dirs.iter().cloned());
        roots
    }

    /// kubelet's root in both spellings, the resolved one first.
    pub fn kubelet_roots(&self) -> [&std::path::Path; 2] {
        [&self.kubelet_root, &self.kubelet_root_given]
    }

    pub fn paths(&self, backend: &str, volume: &str) -> NodePaths {
        NodePaths {
            kubelet_root: self.kubelet_root.display().to_string(),
            staging_dir: self
                .kubelet_root
                .join("plugins/volagent")
                .join(backend)
                .join("mounts")
                .join(volume)
                .display()
                .to_string(),
            state_dir: self.state_dir.join("volumes").join(volume).display().to_string(),
            discovery_dirs: self.discovery_dirs.iter().map(|d| d.display().to_string()).collect(),
        }
    }
}

/// The device a discovered disk's PV names, checked to be that disk (by
/// its identity) before any policy sees the volume; none for other volumes.
async fn verified_devices(sys: &Sys, volume: &Volume) -> Result<Vec<String>, Failure> {
    let Some(device) = crate::policy::validate::verified_device(volume) else {
        return Ok(Vec::new());
    };
    let identity = volume
        .options
        .iter()
        .find(|kv| kv.key == crate::local::discovery::IDENTITY_OPTION)
        .map(|kv| kv.value.clone())
        .unwrap_or_default();
    let (path, inspect) = (device.clone(), sys.inspect.clone());
    blocking(move || {
        crate::local::discovery::verify_device(
            inspect.as_ref(),
            std::path::Path::new(&path),
            &identity,
        )
    })
    .await?
    .map_err(|m| Failure::new(FailureKind::Denied, format!("volume {}: {m}", volume.name)))?;
    Ok(vec![device])
}

/// What the cluster answered, as the failure of the request about `what`.
fn cluster_failure(what: &str, e: ClusterError) -> Failure {
    let kind = match e {
        ClusterError::Unavailable(_) => FailureKind::Unavailable,
        ClusterError::Refused(_) => FailureKind::Denied,
    };
    Failure::new(kind, format!("{what}: {e}"))
}

fn internal(e: impl std::fmt::Display) -> Failure {
    Failure::new(FailureKind::Failed, e.to_string())
}

fn ledger_failure(e: LedgerError) -> Failure {
    let kind = if e.is_race() { FailureKind::Busy } else { FailureKind::Unavailable };
    Failure::new(kind, e.to_string())
}

/// Volumes with an operation in progress.
#[derive(Default, Clone)]
struct Locks(Arc<Mutex<HashSet<String>>>);

/// Held while an operation's steps may still run; it can outlive the request
/// (see [`Agent::run_plan`]).
struct LockGuard {
    locks: Locks,
    volume: String,
}

impl Locks {
    fn try_lock(&self, volume: &str) -> Option<LockGuard> {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        held.insert(volume.to_string())
            .then(|| LockGuard { locks: self.clone(), volume: volume.to_string() })
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.locks.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.volume);
    }
}

/// How many times a lost ledger race is retried before giving up.
const LEDGER_RETRIES: usize = 5;

pub struct Agent {
    pub config: NodeConfig,
    plugins: RwLock<BTreeMap<String, Arc<Plugin>>>,
    ledger: Arc<dyn Ledger>,
    stash: Arc<Stash>,
    sys: Sys,
    locks: Locks,
    /// How long a request waits for a plan's steps.
    plan_deadline: Duration,
    /// The cluster, when there is one: node facts, PVs, Events.
    cluster: Option<Arc<dyn ClusterView>>,
}

impl Agent {
    pub fn new(
        config: NodeConfig,
        plugins: Vec<Plugin>,
        ledger: Arc<dyn Ledger>,
        stash: Stash,
        sys: Sys,
        plan_deadline: Duration,
    ) -> Agent {
        let plugins = plugins.into_iter().map(|p| (p.name().to_string(), Arc::new(p))).collect();
        Agent {
            config,
            plugins: RwLock::new(plugins),
            ledger,
            stash: Arc::new(stash),
            sys,
            locks: Locks::default(),
            plan_deadline,
            cluster: None,
        }
    }

    /// Read node facts and PVs from `cluster`, and tell it of failures.
    pub fn with_cluster(mut self, cluster: Arc<dyn ClusterView>) -> Agent {
        self.cluster = Some(cluster);
        self
    }

    pub fn plugin(&self, backend: &str) -> Result<Arc<Plugin>, Failure> {
        let plugins = self.plugins.read().unwrap_or_else(|p| p.into_inner());
        plugins.get(backend).cloned().ok_or_else(|| {
            let known: Vec<&str> = plugins.keys().map(String::as_str).collect();
            Failure::new(
                FailureKind::UnknownBackend,
                format!(
                    "backend {backend:?} is not loaded on this node (loaded: {})",
                    known.join(", ")
                ),
            )
        })
    }

    /// Serve `plugin` for its backend from now on; calls already running
    /// finish on the version they started with (they hold its Arc).
    pub fn swap_plugin(&self, plugin: Plugin) -> Option<Arc<Plugin>> {
        let mut plugins = self.plugins.write().unwrap_or_else(|p| p.into_inner());
        plugins.insert(plugin.name().to_string(), Arc::new(plugin))
    }

    /// The backends served now.
    pub fn plugins(&self) -> Vec<Arc<Plugin>> {
        self.plugins.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    pub fn backend_names(&self) -> Vec<String> {
        self.plugins.read().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }

    /// Stop serving `backend`.
    pub fn remove_plugin(&self, backend: &str) -> Option<Arc<Plugin>> {
        self.plugins.write().unwrap_or_else(|p| p.into_inner()).remove(backend)
    }

    /// How long a request waits for its operation's steps.
    pub fn plan_deadline(&self) -> Duration {
        self.plan_deadline
    }

    /// Volumes of `backend` this node has mounted (from the stash).
    pub async fn volumes_of(&self, backend: &str) -> Result<Vec<String>, Failure> {
        let backend = backend.to_string();
        let entries = self.stash_read(|s| s.all())?;
        let mut v: Vec<String> = entries
            .into_iter()
            .filter(|e| e.volume.backend == backend)
            .map(|e| e.volume.name)
            .collect();
        v.sort();
        v.dedup();
        Ok(v)
    }

    /// What `plugin`'s guest may ask this call: about the dirs it declared,
    /// within its own deadline.
    fn queries(&self, plugin: &Plugin, facts: &[NodeFacts]) -> Arc<NodeQueries> {
        Arc::new(self.node_queries(plugin, facts))
    }

    fn node_queries(&self, plugin: &Plugin, facts: &[NodeFacts]) -> NodeQueries {
        let roots = plugin
            .info()
            .capabilities
            .path_roots
            .iter()
            .flat_map(|root| match root {
                PathRoot::PodMountDir => vec![self.config.kubelet_root.join("pods")],
                PathRoot::StagingDir => vec![
                    self.config
                        .kubelet_root
                        .join("plugins/volagent")
                        .join(plugin.name())
                        .join("mounts"),
                ],
                PathRoot::StateDir => vec![self.config.state_dir.join("volumes")],
                PathRoot::DiscoveryDirs => self.config.discovery_dirs.clone(),
            })
            .collect();
        let deadline = plugin.limits().deadline;
        NodeQueries::new(self.config.node.clone(), self.sys.clone(), roots, deadline)
            .with_facts(facts.to_vec())
    }

    /// Facts of this node and of every holder's: from the cluster when
    /// there is one, else this node's own view.
    async fn node_facts(&self, holders: &[Holder]) -> Result<Vec<NodeFacts>, Failure> {
        let mut names: Vec<&str> = holders.iter().map(|h| h.consumer.node.as_str()).collect();
        names.push(&self.config.node);
        names.sort();
        names.dedup();
        match &self.cluster {
            Some(cluster) => cluster.node_facts(&names).await.map_err(|e| {
                Failure::new(
                    FailureKind::Unavailable,
                    format!("reading Nodes from the Kubernetes API: {e}"),
                )
            }),
            None => {
                let q = NodeQueries::new(
                    self.config.node.clone(),
                    self.sys.clone(),
                    Vec::new(),
                    Duration::ZERO,
                );
                Ok(names.into_iter().map(|n| crate::policy::Queries::node_state(&q, n)).collect())
            }
        }
    }

    /// The pod mount dirs this node's stash holds.
    /// Scan the local classes' dirs for volumes, with this node's mount table.
    pub async fn discover_local(
        &self,
        classes: Vec<crate::local::LocalClass>,
    ) -> Result<crate::local::discovery::Scan, Failure> {
        let sys = self.sys.clone();
        blocking(move || {
            let table =
                sys.mounts.mount_table().map_err(|e| internal(format!("discovery: {e}")))?;
            Ok(crate::local::discovery::scan(sys.inspect.as_ref(), &classes, &table))
        })
        .await?
    }

    /// Every mount the stash records on this node.
    pub async fn stashed_entries(&self) -> Result<Vec<stash::Entry>, Failure> {
        self.stash_read(|s| s.all())
    }

    /// kubelet's `mount <dir> <options>`; a failure is also told to the
    /// cluster as an Event on the pod.
    pub async fn mount(
        &self,
        backend: &str,
        mount_dir: &str,
        options: &BTreeMap<String, String>,
    ) -> Result<Done, Failure> {
        let start = std::time::Instant::now();
        let mut subject = Subject::of_options(options);
        let result = self.mount_volume(backend, mount_dir, options, &mut subject).await;
        crate::metrics::get().operation(
            "mount",
            metric_backend(backend, &result),
            result_label(&result),
            start.elapsed(),
        );
        let done = Finished {
            op: Op::Mount,
            node: &self.config.node,
            backend,
            mount_dir,
            subject: &subject,
            elapsed: start.elapsed(),
        };
        oplog::log(&done, &result);
        if let Err(f) = &result {
            self.tell_pod_mount_failed(options, f);
        }
        result
    }

    /// A failed mount as an Event on its pod, when there is a cluster and
    /// kubelet named the pod.
    pub fn tell_pod_mount_failed(&self, options: &BTreeMap<String, String>, f: &Failure) {
        let Some(cluster) = &self.cluster else { return };
        let get = |k: &str| options.get(&format!("kubernetes.io/{k}")).cloned().unwrap_or_default();
        let (ns, pod, uid) = (
            get("pod.namespace"),
            get("pod.name"),
            options
                .get("kubernetes.io/pod.uid")
                .or(options.get("kubernetes.io/pod.UID"))
                .cloned()
                .unwrap_or_default(),
        );
        let reason = match f.kind {
            FailureKind::Denied if f.fenced => "VolumeFenced",
            FailureKind::Denied => "VolumeRefused",
            _ => "VolumeMountFailed",
        };
        if !ns.is_empty() && !pod.is_empty() && f.kind != FailureKind::BadRequest {
            let (cluster, message) =
                (cluster.clone(), format!("volagent on {}: {}", self.config.node, f.message));
            let reason = reason.to_string();
            tokio::spawn(async move {
                cluster.pod_event(&ns, &pod, &uid, true, &reason, &message).await;
            });
        }
    }

    /// Run `plan`, waiting at most the plan deadline. A step that hangs
    /// (a mount of an unreachable filesystem, say) cannot be cancelled: at
    /// the deadline the request fails with `timed_out`, and the volume's lock
    /// passes to a task that holds it until the steps end, so no other
    /// operation on the volume starts meanwhile. Records stay as they are:
    /// kubelet's retry (or, after a restart, reconciliation) settles them.
    /// `local`: the plan waits on this node's own disks only
    /// ([`crate::exec::runs_locally`]).
    async fn run_plan(
        &self,
        plan: Vec<crate::policy::Step>,
        local: bool,
        lock: &mut Option<LockGuard>,
    ) -> Result<crate::exec::Outcome, Failure> {
        self.run_plan_with(plan, local, lock, Arc::default(), || Ok(())).await
    }

    /// [`run_plan`](Self::run_plan) with the volume's secret values, after
    /// `before` (on the same blocking thread: one trip there, not two).
    async fn run_plan_with(
        &self,
        plan: Vec<crate::policy::Step>,
        local: bool,
        lock: &mut Option<LockGuard>,
        secrets: Arc<crate::secret::Secrets>,
        before: impl FnOnce() -> Result<(), Failure> + Send + 'static,
    ) -> Result<crate::exec::Outcome, Failure> {
        self.on_plan_thread(lock, local, secrets, move |exec| {
            before()?;
            exec.run(&plan).map_err(internal)
        })
        .await
    }

    /// Run `job` with an executor on a blocking thread, under the plan
    /// deadline: steps can hang in the kernel. When the deadline passes, the
    /// volume's `lock` goes with the job, which holds it until it ends.
    /// In a request [`served`] with its answer bounded, the job runs right
    /// here instead (see there), on this very worker when it is `local`
    /// ([`crate::runtime::on_worker`]); on a CSI thread, a `local` one
    /// while another CSI thread is free ([`crate::runtime::run_here`]).
    async fn on_plan_thread<R: Send + 'static, E: From<Failure> + Send + 'static>(
        &self,
        lock: &mut Option<LockGuard>,
        local: bool,
        secrets: Arc<crate::secret::Secrets>,
        job: impl FnOnce(&Executor) -> Result<R, E> + Send + 'static,
    ) -> Result<R, E> {
        let exec = Executor::new(self.sys.clone()).with_secrets(secrets);
        if STEPS_IN_PLACE.try_with(|_| ()).is_ok()
            && let Some(_here) = crate::runtime::run_here(local)
        {
            return crate::runtime::on_worker(local, || job(&exec));
        }
        let mut task = tokio::task::spawn_blocking(move || job(&exec));
        match tokio::time::timeout(self.plan_deadline, &mut task).await {
            Ok(joined) => joined.map_err(|e| internal(format!("agent task failed: {e}")))?,
            Err(_) => {
                let guard = lock.take();
                tokio::spawn(async move {
                    let _ = task.await;
                    drop(guard);
                });
                Err(Failure::new(
                    FailureKind::TimedOut,
                    format!(
                        "the volume's steps were still running after {:?}; they go on, and the volume stays locked until they end; retry",
                        self.plan_deadline
                    ),
                )
                .into())
            }
        }
    }

    /// A stash write, on this worker: a file written and renamed in the
    /// runtime dir (a tmpfs on a node), local work of a few syscalls.
    async fn stash_op<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Stash) -> Result<R, stash::StashError> + Send + 'static,
    ) -> Result<R, Failure> {
        crate::runtime::on_worker(true, || f(&self.stash)).map_err(internal)
    }

    /// A stash read, inline: the stash answers from memory.
    fn stash_read<R>(
        &self,
        f: impl FnOnce(&Stash) -> Result<R, stash::StashError>,
    ) -> Result<R, Failure> {
        f(&self.stash).map_err(internal)
    }

    /// `subject` learns the volume as soon as it is known, for the log.
    async fn mount_volume(
        &self,
        backend: &str,
        mount_dir: &str,
        options: &BTreeMap<String, String>,
        subject: &mut Subject,
    ) -> Result<Done, Failure> {
        let dir = parse_mount_dir(&self.config.kubelet_roots(), backend, mount_dir)
            .map_err(|m| Failure::new(FailureKind::BadRequest, m))?;
        subject.learn_dir(&dir);
        let req = parse_mount(&self.config.node, backend, &dir, options)
            .map_err(|m| Failure::new(FailureKind::BadRequest, m))?;
        self.plugin(backend)?;
        let mut volume = req.volume;
        let mut me = req.consumer;
        let mut secrets = req.secrets;
        if let Some(cluster) = &self.cluster {
            // What the volume is comes from the cluster (its PV, or the
            // pod's inline volume where an admin allows those), never from
            // options the pod's author could write.
            let asked = cluster::VolumeRequest {
                backend,
                name: &volume.name,
                namespace: &me.pod_namespace,
                pod: &me.pod,
                pod_uid: &me.pod_uid,
                node: &self.config.node,
                inline_allowed: self.config.inline_backends.iter().any(|b| b == backend),
            };
            let defined = cluster
                .volume(&asked)
                .await
                .map_err(|e| cluster_failure(&format!("volume {}", asked.name), e))?;
            volume.name = defined.key;
            volume.access_mode = defined.access_mode;
            volume.fs_type = defined.fs_type;
            volume.options = defined.options;
            me.read_only |= defined.read_only;
            subject.volume = Some(volume.name.clone());
            self.connect_storage_cluster(backend, &mut volume, &mut secrets).await?;
        }
        let paths = self.config.paths(backend, &volume.name);
        self.attach(backend, volume, me, secrets, paths).await
    }

    /// A volume that names a StorageCluster: where the storage is and the
    /// credentials to reach it come from the StorageCluster (and the Secret
    /// it names). Options and secrets the volume has win. Nothing to do
    /// without a cluster or a StorageCluster.
    pub(crate) async fn connect_storage_cluster(
        &self,
        backend: &str,
        volume: &mut Volume,
        secrets: &mut crate::secret::Secrets,
    ) -> Result<(), Failure> {
        let (Some(cluster), Some(name)) = (&self.cluster, storage_cluster(volume)) else {
            return Ok(());
        };
        let connection = cluster
            .storage_connection(&name, backend)
            .await
            .map_err(|e| cluster_failure(&format!("volume {}", volume.name), e))?;
        for (key, value) in connection.options {
            if !volume.options.iter().any(|kv| kv.key == key) {
                volume.options.push(crate::policy::KeyValue { key, value });
            }
        }
        for (key, value) in connection.secrets {
            // A value kubelet passed (the PV's own secret) wins.
            secrets.entry(key).or_insert(value);
        }
        volume.secret_keys = secrets.keys().cloned().collect();
        Ok(())
    }

    /// The pipeline once the volume and its consumer are known: lock, fence
    /// and record, plan, stash, run — with the record and the stash entry
    /// rolled back when the steps fail. Flexvolume mounts and CSI stages
    /// both come here.
    pub(crate) async fn attach(
        &self,
        backend: &str,
        volume: Volume,
        me: crate::policy::Consumer,
        secrets: crate::secret::Secrets,
        paths: NodePaths,
    ) -> Result<Done, Failure> {
        let plugin = self.plugin(backend)?;
        let secrets = Arc::new(secrets);
        let devices = verified_devices(&self.sys, &volume).await?;
        let mut lock = Some(self.lock(&volume.name)?);

        // Fence and record, retrying lost races with a fresh read.
        let source = VolumeSource::of(&volume);
        let mut attempt = 0;
        let (added, plan, since) = loop {
            attempt += 1;
            let current = self.ledger.get(&volume.name).await.map_err(ledger_failure)?;
            if let Some((recorded, _)) = &current {
                same_volume(recorded, backend, &source)?;
            }
            let holders = current.as_ref().map(|(r, _)| r.holders.clone()).unwrap_or_default();
            let mut clients =
                current.as_ref().map(|(r, _)| r.storage_clients.clone()).unwrap_or_default();
            let nodes = self.node_facts(&holders).await?;
            let queries = Arc::new(
                self.node_queries(&plugin, &nodes)
                    .with_devices(devices.clone())
                    .with_ceph(ceph_client(&volume, &secrets))
                    .with_known_clients(clients.iter().map(|c| (c.id, c.node.clone())).collect()),
            );
            let decision =
                plugin.fence(queries.clone(), &volume, &me, &holders, &nodes).map_err(internal)?;
            let mut kept = holders.clone();
            let outcome = match &decision {
                Decision::Grant => "grant",
                Decision::Deny(_) => "deny",
                Decision::TakeOver(_) => "take-over",
            };
            crate::metrics::get().fence(backend, outcome);
            match decision {
                Decision::Grant => {}
                Decision::Deny(reason) => return Err(Failure::fenced(reason)),
                Decision::TakeOver(take) => {
                    let local = self
                        .fence_through_controller(
                            &volume.name,
                            take.fence_steps.clone(),
                            &take.stale,
                            &clients,
                        )
                        .await?;
                    self.run_plan_with(local, false, &mut lock, secrets.clone(), || Ok(())).await?;
                    kept.retain(|h| !take.stale.contains(h));
                    // The gone nodes' clients were fenced with them.
                    clients.retain(|c| !take.stale.iter().any(|h| h.consumer.node == c.node));
                }
            }
            let earlier = kept
                .iter()
                .find(|h| h.consumer.pod_uid == me.pod_uid && h.consumer.mount_dir == me.mount_dir)
                .map(|h| h.since.clone());
            let already = earlier.is_some();
            let local: Vec<Holder> = kept
                .iter()
                .filter(|h| h.consumer.node == me.node && h.consumer.mount_dir != me.mount_dir)
                .cloned()
                .collect();
            let since = earlier.unwrap_or_else(now_rfc3339);
            if !already {
                kept.push(Holder { consumer: me.clone(), since: since.clone() });
            }
            let record = Record {
                volume: volume.name.clone(),
                backend: backend.to_string(),
                access_mode: volume.access_mode,
                storage_cluster: storage_cluster(&volume),
                source: Some(source.clone()),
                holders: kept,
                storage_clients: clients,
            };
            let ledger = self.ledger.clone();
            let changed = match &current {
                None => true,
                Some((r, _)) => {
                    record.holders != holders
                        || r.source.is_none()
                        || record.storage_clients != r.storage_clients
                }
            };
            let version = current.as_ref().map(|(_, v)| v.clone());
            let write = async move {
                match version {
                    None => ledger.create(&record).await,
                    Some(v) if changed => ledger.update(&record, &v).await,
                    Some(v) => Ok(v),
                }
            };
            // Written while the backend computes its plan from the same
            // view: the plan has no effects, and is dropped when the write
            // loses a race or fails. A node-private ledger takes the write
            // in memory ([`crate::ledger::write_behind`]): no task for it.
            let (written, plan) = if self.ledger.node_private() {
                let written = write.await;
                (
                    written,
                    plugin.attach(queries.clone(), &volume, &me, &local, &paths).map_err(internal),
                )
            } else {
                let write = tokio::spawn(write);
                let plan =
                    plugin.attach(queries.clone(), &volume, &me, &local, &paths).map_err(internal);
                (write.await.map_err(|e| internal(format!("agent task failed: {e}")))?, plan)
            };
            match written {
                Ok(_) => break (!already, plan, since),
                // A record deleted since it was read (its last holder left,
                // or the controller moved a gone node's holders) is a race
                // lost too: read it again.
                Err(e)
                    if (e.is_race() || matches!(e, LedgerError::NotFound { .. }))
                        && attempt < LEDGER_RETRIES =>
                {
                    continue;
                }
                Err(e) => return Err(ledger_failure(e)),
            }
        };

        let entry = Entry {
            volume: volume.clone(),
            consumer: me.clone(),
            paths: paths.clone(),
            since: Some(since),
        };
        let result = async {
            // A refused plan: its record is rolled back below.
            let plan = plan?;
            let local = crate::exec::runs_locally(crate::exec::holding(&volume), &plan);
            // Stashed before any step runs, on the steps' own thread.
            let stash = self.stash.clone();
            self.on_plan_thread(&mut lock, local, secrets.clone(), move |exec| {
                stash.put(&entry).map_err(internal)?;
                exec.run(&plan).map_err(internal)
            })
            .await
        }
        .await;
        if let Ok(outcome) = &result
            && !outcome.storage_clients.is_empty()
            && let Err(e) =
                self.record_storage_clients(&volume.name, &outcome.storage_clients).await
        {
            // Fencing stays safe without it: other nodes cannot place this
            // node's client, so they deny rather than take over.
            tracing::warn!(volume = %volume.name, "recording the volume's storage client failed: {}", e.message);
        }
        match result {
            Ok(outcome) => Ok(Done {
                message: format!("volume {} mounted at {}", volume.name, me.mount_dir),
                device: outcome.devices.values().next().map(|d| d.display().to_string()),
            }),
            // Leave no trace of a mount that did not happen. A failed retry
            // of a mount that had succeeded keeps its record and stash entry:
            // its earlier steps are still in place.
            Err(failure) if added && failure.kind != FailureKind::TimedOut => {
                if let Err(e) = self.remove_holder(&volume.name, &me.mount_dir).await {
                    tracing::error!(volume = %volume.name, "rolling back the ledger entry failed: {}", e.message);
                }
                let dir = me.mount_dir.clone();
                if let Err(e) = self.stash_op(move |s| s.remove(&dir)).await {
                    tracing::error!(volume = %volume.name, "rolling back the stash entry failed: {}", e.message);
                }
                Err(failure)
            }
            Err(failure) => Err(failure),
        }
    }

    /// kubelet's `unmount <dir>`; a failure is also told to the cluster as
    /// an Event on the pod.
    pub async fn unmount(&self, backend: &str, mount_dir: &str) -> Result<Done, Failure> {
        let start = std::time::Instant::now();
        let mut subject = Subject::default();
        let result = self.unmount_volume(backend, mount_dir, &mut subject).await;
        crate::metrics::get().operation(
            "unmount",
            metric_backend(backend, &result),
            result_label(&result),
            start.elapsed(),
        );
        let done = Finished {
            op: Op::Unmount,
            node: &self.config.node,
            backend,
            mount_dir,
            subject: &subject,
            elapsed: start.elapsed(),
        };
        oplog::log(&done, &result);
        if let Err(f) = &result {
            self.tell_pod_unmount_failed(mount_dir, f);
        }
        result
    }

    /// A failed unmount as an Event on the pod the stash says mounted
    /// `mount_dir`, when there is a cluster.
    pub fn tell_pod_unmount_failed(&self, mount_dir: &str, f: &Failure) {
        if let Some(cluster) = &self.cluster
            && f.kind != FailureKind::BadRequest
            && let Ok(Some(entry)) = self.stash_read(|s| s.get(mount_dir))
        {
            let c = entry.consumer;
            let (cluster, message) =
                (cluster.clone(), format!("volagent on {}: {}", self.config.node, f.message));
            tokio::spawn(async move {
                cluster
                    .pod_event(
                        &c.pod_namespace,
                        &c.pod,
                        &c.pod_uid,
                        true,
                        "VolumeUnmountFailed",
                        &message,
                    )
                    .await;
            });
        }
    }

    /// What to undo comes from the stash; without a stash entry (a lost or
    /// damaged stash), from the ledger's record of the mounted dir.
    async fn unmount_volume(
        &self,
        backend: &str,
        mount_dir: &str,
        subject: &mut Subject,
    ) -> Result<Done, Failure> {
        let parsed = parse_mount_dir(&self.config.kubelet_roots(), backend, mount_dir)
            .map_err(|m| Failure::new(FailureKind::BadRequest, m))?;
        subject.learn_dir(&parsed);
        let mount_dir = parsed.dir.display().to_string();
        let mount_dir = mount_dir.as_str();
        let entry = match self.stash_read(|s| s.get(mount_dir))? {
            Some(entry) => entry,
            None => {
                let sys = self.sys.clone();
                let target = parsed.dir.clone();
                let mounted = blocking(move || sys.mount_at(&target)).await?.map_err(internal)?;
                let Some(m) = mounted else {
                    // Nothing is there: a retry after success, or never mounted.
                    return Ok(Done {
                        message: format!("{mount_dir} is not mounted"),
                        device: None,
                    });
                };
                match self.entry_from_ledger(backend, &parsed).await? {
                    Some(entry) => {
                        tracing::warn!(mount_dir, volume = %entry.volume.name, "no stash entry for a mounted dir: unmounting it as the ledger records it");
                        entry
                    }
                    None => {
                        return Err(Failure::new(
                            FailureKind::Failed,
                            format!(
                                "{mount_dir} is mounted from {}, but this agent has no record of mounting it; refusing to guess",
                                m.source
                            ),
                        ));
                    }
                }
            }
        };
        let c = &entry.consumer;
        *subject = Subject {
            volume: Some(entry.volume.name.clone()),
            pod: oplog::pod_name(&c.pod_namespace, &c.pod, &c.pod_uid),
        };
        self.detach(backend, entry, mount_dir).await
    }

    /// Undo what the stash entry `entry` says was done at `mount_dir`:
    /// the backend's detach plan, then the record and the entry go.
    /// Flexvolume unmounts and CSI unstages both come here.
    pub(crate) async fn detach(
        &self,
        backend: &str,
        entry: Entry,
        mount_dir: &str,
    ) -> Result<Done, Failure> {
        let plugin = self.plugin(backend)?;
        let volume: Volume = entry.volume.clone();
        let mut lock = Some(self.lock(&volume.name)?);
        let current = self.ledger.get(&volume.name).await.map_err(ledger_failure)?;
        let remaining: Vec<Holder> = current
            .map(|(r, _)| r.holders)
            .unwrap_or_default()
            .into_iter()
            .filter(|h| h.consumer.node == self.config.node && h.consumer.mount_dir != mount_dir)
            .collect();
        let queries = self.queries(&plugin, &[]);
        let plan = plugin
            .detach(queries, &volume, &entry.consumer, &remaining, &entry.paths)
            .map_err(internal)?;
        let local = crate::exec::runs_locally(crate::exec::holding(&volume), &plan);
        self.run_plan(plan, local, &mut lock).await?;
        self.remove_holder(&volume.name, mount_dir).await?;
        let dir = mount_dir.to_string();
        self.stash_op(move |s| s.remove(&dir)).await?;
        Ok(Done {
            message: format!("volume {} unmounted from {mount_dir}", volume.name),
            device: None,
        })
    }

    /// What the stash would hold for `dir`, rebuilt from the ledger: the
    /// record of the volume the dir is named after, holding a consumer at
    /// that dir on this node, with the source it was mounted from.
    async fn entry_from_ledger(
        &self,
        backend: &str,
        dir: &MountDir,
    ) -> Result<Option<Entry>, Failure> {
        for key in [dir.name.clone(), cluster::inline_key(&dir.pod_uid, &dir.name)] {
            if let Some(entry) =
                self.entry_of_record(backend, &dir.dir.display().to_string(), &key).await?
            {
                return Ok(Some(entry));
            }
        }
        Ok(None)
    }

    /// The stash entry of `path` rebuilt from the ledger's record `key`.
    pub(crate) async fn entry_of_record(
        &self,
        backend: &str,
        path: &str,
        key: &str,
    ) -> Result<Option<Entry>, Failure> {
        let Some((record, _)) = self.ledger.get(key).await.map_err(ledger_failure)? else {
            return Ok(None);
        };
        let holder = record
            .holders
            .iter()
            .find(|h| h.consumer.node == self.config.node && h.consumer.mount_dir == path);
        let (Some(holder), Some(source)) = (holder, &record.source) else { return Ok(None) };
        if record.backend != backend {
            return Ok(None);
        }
        let volume = Volume {
            name: record.volume.clone(),
            backend: record.backend.clone(),
            access_mode: record.access_mode,
            fs_type: source.fs_type.clone(),
            mode: crate::policy::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: source.options(),
            secret_keys: Vec::new(),
        };
        Ok(Some(Entry {
            paths: self.config.paths(backend, &volume.name),
            volume,
            consumer: holder.consumer.clone(),
            since: Some(holder.since.clone()),
        }))
    }

    fn lock(&self, volume: &str) -> Result<LockGuard, Failure> {
        self.locks.try_lock(volume).ok_or_else(|| {
            Failure::new(
                FailureKind::Busy,
                format!("volume {volume}: an operation is in progress on this node; retry"),
            )
        })
    }

    /// Record this node's storage clients of `volume` (replacing earlier ones).
    async fn record_storage_clients(
        &self,
        volume: &str,
        clients: &[(u64, String)],
    ) -> Result<(), Failure> {
        let node = &self.config.node;
        for _ in 0..LEDGER_RETRIES {
            let Some((mut record, version)) =
                self.ledger.get(volume).await.map_err(ledger_failure)?
            else {
                return Ok(());
            };
            let mut wanted: Vec<StorageClient> =
                record.storage_clients.iter().filter(|c| c.node != *node).cloned().collect();
            wanted.extend(clients.iter().map(|(id, address)| StorageClient {
                node: node.clone(),
                id: *id,
                address: address.clone(),
            }));
            if wanted == record.storage_clients {
                return Ok(());
            }
            record.storage_clients = wanted;
            match self.ledger.update(&record, &version).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_race() => continue,
                Err(e) => return Err(ledger_failure(e)),
            }
        }
        Err(Failure::new(
            FailureKind::Busy,
            format!("attachment record {volume} keeps changing; retry"),
        ))
    }

    /// Remove the holder at `mount_dir`; the record goes with its last
    /// holder, and this node's storage clients with its last one here.
    async fn remove_holder(&self, volume: &str, mount_dir: &str) -> Result<(), Failure> {
        for _ in 0..LEDGER_RETRIES {
            let Some((mut record, version)) =
                self.ledger.get(volume).await.map_err(ledger_failure)?
            else {
                return Ok(());
            };
            let before = record.holders.len();
            record.holders.retain(|h| h.consumer.mount_dir != mount_dir);
            if record.holders.len() == before {
                return Ok(());
            }
            let node = &self.config.node;
            if !record.holders.iter().any(|h| h.consumer.node == *node) {
                record.storage_clients.retain(|c| c.node != *node);
            }
            let result = if record.holders.is_empty() {
                self.ledger.delete(volume, &version).await
            } else {
                self.ledger.update(&record, &version).await.map(drop)
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if e.is_race() => continue,
                Err(e) => return Err(ledger_failure(e)),
            }
        }
        Err(Failure::new(
            FailureKind::Busy,
            format!("attachment record {volume} keeps changing; retry"),
        ))
    }
}

tokio::task_local! {
    /// Set on the task of a request [`served`] with a bounded answer.
    static STEPS_IN_PLACE: ();
}

/// A kubelet request's operation, on a task of its own, answered within
/// `deadline`. Its steps run on that task's own thread, not on a blocking
/// thread: the hand-off there and back is two thread wake-ups, ~100 µs on
/// a small VM, on every stage, publish and mount; a plan on local disks
/// only keeps the worker too ([`crate::runtime::on_worker`]). A step can
/// still hang in the kernel: at the deadline the request is answered
/// `timed_out` (by another worker), and the operation goes on, holding the
/// volume's lock until it ends; it then finishes or rolls back as it would
/// have, and kubelet's retry finds the volume done or the operation in
/// progress. Kubelet cancelling the call cannot cut the operation short
/// half-way either. On a CSI thread ([`crate::csi::threads`]) nothing
/// answers for a local step the kernel holds: the thread is the step's
/// until it returns, and kubelet's next call goes to the other thread.
///
/// The operation's own result, or why it has none: still running at the
/// deadline (or its task failed).
pub async fn served<R: Send + 'static>(
    deadline: Duration,
    work: impl std::future::Future<Output = R> + Send + 'static,
) -> Result<R, Failure> {
    let mut task = tokio::spawn(STEPS_IN_PLACE.scope((), work));
    match tokio::time::timeout(deadline, &mut task).await {
        Ok(joined) => joined.map_err(|e| internal(format!("agent task failed: {e}"))),
        Err(_) => Err(Failure::new(
            FailureKind::TimedOut,
            format!(
                "the operation was still running after {deadline:?} (a step hanging?); it goes on, and the volume stays locked until it ends; retry"
            ),
        )),
    }
}

/// Run blocking work (syscalls, tools, fsync) off the async workers.
async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Result<R, Failure> {
    tokio::task::spawn_blocking(f).await.map_err(|e| internal(format!("agent task failed: {e}")))
}

/// The backend label of a request: a name no loaded backend has is not
/// kept (a caller could make up any number of them).
fn metric_backend<'b, T>(backend: &'b str, r: &Result<T, Failure>) -> &'b str {
    match r {
        Err(f) if f.kind == FailureKind::UnknownBackend => "unknown",
        _ => backend,
    }
}

fn result_label<T>(r: &Result<T, Failure>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(f) => match f.kind {
            FailureKind::Denied => "denied",
            FailureKind::Busy => "busy",
            FailureKind::TimedOut => "timed_out",
            FailureKind::BadRequest => "bad_request",
            FailureKind::Unavailable => "unavailable",
            FailureKind::UnknownBackend => "unknown_backend",
            _ => "failed",
        },
    }
}

/// A request for a recorded volume must be for that volume: the same
/// backend and the same source. Otherwise it is another volume that only
/// shares the name (a second pod naming the first one's volume with a path
/// of its own must not be handed the first one's mount).
fn same_volume(recorded: &Record, backend: &str, source: &VolumeSource) -> Result<(), Failure> {
    let other = if recorded.backend != backend {
        format!("backend {}", recorded.backend)
    } else if recorded.source.as_ref().is_some_and(|s| s != source) {
        "another source (filesystem type or backend options)".to_string()
    } else {
        return Ok(());
    };
    Err(Failure::new(
        FailureKind::Denied,
        format!(
            "volume {} is in use with {other} than this request names; a volume is its name and its source, so this request is not for it",
            recorded.volume
        ),
    ))
}

/// The option naming the StorageCluster a volume lives on.
pub const STORAGE_CLUSTER_OPTION: &str = "storageCluster";

/// How the host reaches the Ceph cluster of a volume for the guest's
/// `image-watchers`: its `monitors` (or its StorageCluster's endpoints),
/// `user` (default admin) and, from its secret, the key named by
/// `secretKey` (default "key") — the rbd backend's option names. None when
/// the volume names no monitors.
fn ceph_client(
    volume: &Volume,
    secrets: &crate::secret::Secrets,
) -> Option<crate::sys::rbd_export::CephClient> {
    let get = |k: &str| volume.options.iter().find(|kv| kv.key == k).map(|kv| kv.value.as_str());
    let listed = get("monitors").or(get(cluster::ENDPOINTS_OPTION))?;
    let monitors: Vec<&str> = listed.split(',').map(str::trim).filter(|m| !m.is_empty()).collect();
    if monitors.is_empty() {
        return None;
    }
    Some(crate::sys::rbd_export::CephClient {
        conf: None,
        monitors: Some(monitors.join(",")),
        user: get("user").unwrap_or("admin").to_string(),
        keyring: None,
        key: secrets.get(get("secretKey").unwrap_or("key")).cloned(),
    })
}

fn storage_cluster(volume: &Volume) -> Option<String> {
    volume.options.iter().find(|kv| kv.key == STORAGE_CLUSTER_OPTION).map(|kv| kv.value.clone())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::Path;

    /// An agent of node `n1` with kubelet's root at `/k`, no backends, an
    /// embedded ledger (returned too) and a fake node.
    pub(crate) fn test_agent(
        dir: &Path,
    ) -> (Agent, Arc<crate::ledger::embedded::EmbeddedLedger>, Arc<crate::sys::fake::Fake>) {
        let config = NodeConfig {
            node: "n1".into(),
            kubelet_root: "/k".into(),
            kubelet_root_given: "/k".into(),
            state_dir: dir.join("state"),
            discovery_dirs: vec![],
            inline_backends: vec![],
        };
        let ledger = Arc::new(
            crate::ledger::embedded::EmbeddedLedger::open(&dir.join("ledger.redb"), false).unwrap(),
        );
        let stash = Stash::open(&dir.join("stash")).unwrap();
        let fake = crate::sys::fake::Fake::new();
        (
            Agent::new(
                config,
                Vec::new(),
                ledger.clone(),
                stash,
                fake.sys(),
                Duration::from_secs(5),
            ),
            ledger,
            fake,
        )
    }

    #[test]
    fn loop_tags_are_per_agent_stable_and_fit_their_field() {
        let a = loop_tag("node-a", Path::new("/var/lib/volagent"));
        assert_eq!(
            a,
            loop_tag("node-a", Path::new("/var/lib/volagent")),
            "the same after a restart"
        );
        assert_ne!(
            a,
            loop_tag("node-a", Path::new("/tmp/test-1/state")),
            "another agent's on this machine"
        );
        assert_ne!(a, loop_tag("node-b", Path::new("/var/lib/volagent")));
        assert!(a.starts_with("volagent:node-a:"), "{a}");
        assert!(loop_tag(&"n".repeat(253), Path::new("/x")).len() <= 63);
    }

    #[test]
    fn a_volume_takes_one_operation_at_a_time() {
        let locks = Locks::default();
        let first = locks.try_lock("pv1").expect("free");
        assert!(locks.try_lock("pv1").is_none(), "a second operation on pv1 must be refused");
        assert!(locks.try_lock("pv2").is_some(), "other volumes are independent");
        drop(first);
        assert!(locks.try_lock("pv1").is_some(), "released with the guard");
    }
}
