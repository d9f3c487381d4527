//! What the agent answers when a guest asks: this node's view, only inside
//! the dirs the backend declared it works in, and never past the guest's
//! deadline. A path on a hung FUSE mount or a device that does not answer
//! can block a thread in the kernel for good: such a query runs on a thread
//! of its own, and the guest's call fails when it does not answer in time.

use crate::model::{MountEntry, NodeFacts, PathKind, Watcher};
use crate::policy::validate::clean_absolute;
use crate::policy::{Queries, QueryError};
use crate::sys::rbd_export::CephClient;
use crate::sys::{Kind, MountInfo, Sys};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub struct NodeQueries {
    pub node: String,
    pub sys: Sys,
    /// Dirs the backend may ask about (its declared path roots, on this node).
    roots: Vec<PathBuf>,
    /// How long one query may take: the guest's own deadline.
    deadline: Duration,
    /// The mount table, read on the first `mount-at` (most policies never
    /// ask; reading procfs does not block).
    mounts: OnceLock<Vec<MountInfo>>,
    /// Node facts read from the cluster before the call.
    facts: Vec<NodeFacts>,
    /// The volume's Ceph cluster, for `image-watchers`.
    ceph: Option<CephClient>,
    /// Block devices under /dev the host verified to be the volume's (by
    /// the identity its PV records): answered as block devices.
    devices: Vec<String>,
    /// Storage clients the ledger records for the volume: global id, node.
    known_clients: Vec<(u64, String)>,
}

/// Query threads that may be blocked in the kernel at once: beyond this,
/// queries fail at once rather than leave more threads behind.
const MAX_QUERY_THREADS: usize = 32;
static QUERY_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Query threads kept waiting for the next query once theirs is answered:
/// starting a thread costs more than most queries do.
const IDLE_QUERY_THREADS: usize = 4;

type Job = Box<dyn FnOnce() + Send>;
static IDLE: std::sync::Mutex<Vec<std::sync::mpsc::Sender<Job>>> =
    std::sync::Mutex::new(Vec::new());

fn idle() -> std::sync::MutexGuard<'static, Vec<std::sync::mpsc::Sender<Job>>> {
    IDLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// A query thread: runs jobs until, a job done, enough others are idle.
fn query_thread(jobs: std::sync::mpsc::Receiver<Job>, me: std::sync::mpsc::Sender<Job>) {
    while let Ok(job) = jobs.recv() {
        job();
        let mut idle = idle();
        if idle.len() >= IDLE_QUERY_THREADS {
            return;
        }
        idle.push(me.clone());
    }
}

/// Hand `job` to an idle query thread, or to a new one.
fn dispatch(job: Job) -> std::io::Result<()> {
    let mut job = job;
    loop {
        // The list's lock is let go before the hand-over.
        let Some(worker) = idle().pop() else { break };
        match worker.send(job) {
            Ok(()) => return Ok(()),
            Err(std::sync::mpsc::SendError(back)) => job = back,
        }
    }
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    // Cannot fail: the receiver is right here.
    let _ = tx.send(job);
    std::thread::Builder::new()
        .name("volagent-query".into())
        .spawn(move || query_thread(rx, tx))
        .map(drop)
}

/// Run `f` on a query thread and wait for it at most `deadline`; a thread
/// that does not answer is left to finish (or not) on its own.
fn bounded<T: Send + 'static>(
    query: &'static str,
    path: &str,
    deadline: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, QueryError> {
    let failed = |message: String| QueryError::Failed { query, path: path.to_string(), message };
    if QUERY_THREADS.fetch_add(1, Ordering::SeqCst) >= MAX_QUERY_THREADS {
        QUERY_THREADS.fetch_sub(1, Ordering::SeqCst);
        return Err(failed(format!(
            "{MAX_QUERY_THREADS} earlier queries are still blocked (a hung filesystem?); not asking again"
        )));
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
        QUERY_THREADS.fetch_sub(1, Ordering::SeqCst);
    });
    if let Err(e) = dispatch(job) {
        QUERY_THREADS.fetch_sub(1, Ordering::SeqCst);
        return Err(failed(format!("cannot start a query thread: {e}")));
    }
    rx.recv_timeout(deadline).map_err(|_| QueryError::Timeout {
        query,
        path: path.to_string(),
        ms: deadline.as_millis(),
    })
}

impl NodeQueries {
    /// Queries of a backend that may ask about `roots`, each answered
    /// within `deadline`.
    pub fn new(node: String, sys: Sys, roots: Vec<PathBuf>, deadline: Duration) -> NodeQueries {
        NodeQueries {
            node,
            sys,
            roots,
            deadline,
            mounts: OnceLock::new(),
            facts: Vec::new(),
            ceph: None,
            known_clients: Vec::new(),
            devices: Vec::new(),
        }
    }

    pub fn with_facts(mut self, facts: Vec<NodeFacts>) -> NodeQueries {
        self.facts = facts;
        self
    }

    /// Place watchers that are these clients (global id, node) on their nodes.
    pub fn with_known_clients(mut self, clients: Vec<(u64, String)>) -> NodeQueries {
        self.known_clients = clients;
        self
    }

    /// Devices the host verified are the volume's.
    pub fn with_devices(mut self, devices: Vec<String>) -> NodeQueries {
        self.devices = devices;
        self
    }

    /// Answer `image-watchers` from this cluster.
    pub fn with_ceph(mut self, ceph: Option<CephClient>) -> NodeQueries {
        self.ceph = ceph;
        self
    }

    /// `path` must be a clean absolute path strictly below one of the roots.
    fn scoped(&self, query: &'static str, path: &str) -> Result<(), QueryError> {
        let inside = clean_absolute(path).is_ok()
            && self.roots.iter().any(|r| {
                Path::new(path).strip_prefix(r).is_ok_and(|rest| !rest.as_os_str().is_empty())
            });
        if inside {
            return Ok(());
        }
        let roots: Vec<String> = self.roots.iter().map(|r| r.display().to_string()).collect();
        Err(QueryError::OutsideRoots {
            query,
            path: crate::text::bounded(path.to_string(), 512),
            roots: if roots.is_empty() { "none".into() } else { roots.join(", ") },
        })
    }
}

impl Queries for NodeQueries {
    /// What the cluster said of the node, when it was asked. Otherwise this
    /// node exists and is ready, and other nodes cannot be judged: they count
    /// as existing (never provably gone) and not ready.
    fn node_state(&self, name: &str) -> NodeFacts {
        if let Some(f) = self.facts.iter().find(|f| f.name == name) {
            return f.clone();
        }
        let me = name == self.node;
        NodeFacts { name: name.to_string(), exists: true, ready: me, out_of_service: false }
    }

    /// Looked at through an `O_PATH` handle resolved beneath the roots: no
    /// symlink is followed and nothing is opened (a FIFO cannot block it).
    /// From the kernel's caches in place when they can answer; otherwise
    /// on a query thread, as the filesystem must be asked.
    fn lookup_path(&self, path: &str) -> Result<PathKind, QueryError> {
        if self.devices.iter().any(|d| d == path) {
            return Ok(PathKind::BlockDevice);
        }
        self.scoped("lookup-path", path)?;
        let cached = self.sys.devices.kind_of_cached(Path::new(path));
        let kind = match cached {
            Some(answer) => answer,
            None => {
                let (sys, p) = (self.sys.clone(), PathBuf::from(path));
                bounded("lookup-path", path, self.deadline, move || sys.devices.kind_of(&p))?
            }
        }
        .map_err(|e| QueryError::Failed {
            query: "lookup-path",
            path: path.to_string(),
            message: e.to_string(),
        })?;
        Ok(match kind {
            None => PathKind::Missing,
            Some(Kind::File) => PathKind::RegularFile,
            Some(Kind::Dir) => PathKind::Directory,
            Some(Kind::Block) => PathKind::BlockDevice,
            Some(Kind::Other) => PathKind::Other,
        })
    }

    /// Only block devices: below the roots (resolved to their /dev node), or
    /// device nodes under /dev. Nothing else is opened.
    fn filesystem_type(&self, device: &str) -> Result<Option<String>, QueryError> {
        let in_dev = device.starts_with("/dev/") && clean_absolute(device).is_ok();
        if !in_dev {
            self.scoped("filesystem-type", device)?;
        }
        let (sys, p) = (self.sys.clone(), PathBuf::from(device));
        let answer = bounded("filesystem-type", device, self.deadline, move || {
            let node = if in_dev { p } else { sys.devices.block_device(&p)? };
            sys.filesystems.probe(&node)
        })?;
        answer.map_err(|e| QueryError::Failed {
            query: "filesystem-type",
            path: device.to_string(),
            message: e.to_string(),
        })
    }

    fn mount_at(&self, target: &str) -> Result<Option<MountEntry>, QueryError> {
        self.scoped("mount-at", target)?;
        let mounts = self.mounts.get_or_init(|| {
            self.sys.mounts.mount_table().unwrap_or_else(|e| {
                tracing::error!(
                    "a guest asked for a mount, but the mount table is unreadable: {e}"
                );
                Vec::new()
            })
        });
        Ok(mounts.iter().rev().find(|m| m.mount_point.as_os_str() == target).map(|m| MountEntry {
            source: m.source.clone(),
            target: target.to_string(),
            fs_type: m.fs_type.clone(),
            read_only: m.read_only(),
        }))
    }

    /// Read from the cluster (librbd), within the guest's deadline. A
    /// watcher that is one of this node's own clients (a helper server,
    /// rbd-fuse, a kernel mapping) is placed on this node, one the ledger records for another node on that node;
    /// any other is unplaced (the guest counts it as foreign).
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        let name = format!("{pool}/{image}");
        let Some(client) = self.ceph.clone() else {
            return Err(format!(
                "image {name}: the volume names no monitors, so its cluster cannot be asked"
            ));
        };
        let (sys, p, i) = (self.sys.clone(), pool.to_string(), image.to_string());
        let listed = bounded("image-watchers", &name, self.deadline, move || {
            sys.storage.rbd_watchers(&client, &p, &i)
        })
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
        let mut ours: Vec<u64> =
            self.sys.export_helpers.storage_clients().into_iter().map(|(_, id, _)| id).collect();
        if self.sys.krbd.available() {
            let mappings = self.sys.krbd.mappings().map_err(|e| e.to_string())?;
            ours.extend(mappings.into_iter().filter(|m| m.ours).map(|m| m.client_id));
        }
        Ok(listed
            .into_iter()
            .map(|w| Watcher {
                node: u64::try_from(w.id).ok().and_then(|id| {
                    if ours.contains(&id) {
                        return Some(self.node.clone());
                    }
                    self.known_clients
                        .iter()
                        .find(|(known, _)| *known == id)
                        .map(|(_, node)| node.clone())
                }),
                client: format!("client.{}", w.id),
                address: w.address,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::fake::Fake;

    fn queries(fake: &std::sync::Arc<Fake>) -> NodeQueries {
        NodeQueries::new(
            "n1".into(),
            fake.sys(),
            vec![PathBuf::from("/mnt/disks")],
            Duration::from_millis(200),
        )
    }

    #[test]
    fn only_paths_below_the_roots_are_answered() {
        let fake = Fake::new();
        fake.state().files.insert("/mnt/disks/a.img".into());
        let q = queries(&fake);
        assert_eq!(q.lookup_path("/mnt/disks/a.img"), Ok(PathKind::RegularFile));
        assert_eq!(q.lookup_path("/mnt/disks/b.img"), Ok(PathKind::Missing));
        for bad in
            ["/etc/shadow", "/mnt/disks", "/mnt/disks/../../etc", "/mnt/disksX/a", "relative"]
        {
            assert!(matches!(q.lookup_path(bad), Err(QueryError::OutsideRoots { .. })), "{bad}");
            assert!(matches!(q.mount_at(bad), Err(QueryError::OutsideRoots { .. })), "{bad}");
        }
        assert!(matches!(q.filesystem_type("/etc/passwd"), Err(QueryError::OutsideRoots { .. })));
    }

    #[test]
    fn image_watchers_come_from_the_cluster_and_this_nodes_helpers_are_placed_here() {
        let fake = Fake::new();
        let target = crate::sys::rbd_export::RbdTarget {
            client: CephClient::default(),
            pool: "rbd".into(),
            image: "img".into(),
        };
        fake.sys().export_helpers.serve_rbd("export-1", &target, false).unwrap();
        fake.state().rbd_watchers.insert(
            "rbd/img".into(),
            vec![(5000, "10.0.0.9:0/5000".into()), (4100, "10.0.0.7:0/99".into())],
        );
        let without = queries(&fake);
        assert!(without.image_watchers("rbd", "img").unwrap_err().contains("names no monitors"));
        let q = queries(&fake).with_ceph(Some(CephClient {
            monitors: Some("10.0.0.1:6789".into()),
            user: "admin".into(),
            ..Default::default()
        }));
        let w = q.image_watchers("rbd", "img").unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!((w[0].client.as_str(), w[0].node.as_deref()), ("client.5000", Some("n1")));
        assert_eq!(
            (w[1].client.as_str(), w[1].address.as_str(), w[1].node.as_deref()),
            ("client.4100", "10.0.0.7:0/99", None)
        );
        let placed =
            q.with_known_clients(vec![(4100, "n2".into())]).image_watchers("rbd", "img").unwrap();
        assert_eq!(
            placed[1].node.as_deref(),
            Some("n2"),
            "the ledger's record places another node's client"
        );
        let q = queries(&fake).with_ceph(Some(CephClient {
            monitors: Some("10.0.0.1:6789".into()),
            user: "admin".into(),
            ..Default::default()
        }));
        fake.fail_next("rbd-watchers");
        assert!(q.image_watchers("rbd", "img").unwrap_err().contains("rbd/img"));
    }

    #[test]
    fn a_query_that_does_not_answer_fails_at_the_deadline() {
        let start = std::time::Instant::now();
        let r = bounded("lookup-path", "/mnt/disks/hung", Duration::from_millis(100), || {
            std::thread::sleep(Duration::from_secs(2));
        });
        assert!(matches!(r, Err(QueryError::Timeout { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
        assert_eq!(bounded("lookup-path", "/x", Duration::from_secs(1), || 7), Ok(7));
    }
}
