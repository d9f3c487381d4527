//! The agent's status as the socket protocol spells it: the node name,
//! the backends, the plugin dir's problems, the held volumes (from the
//! ledger), local volumes and CSI drivers, cut to fit a frame.

use super::protocol::{
    BackendStatus, CsiDriver, CsiPublication, CsiReport, HeldBy, HeldClient, HeldVolume,
    LocalReport, MAX_FRAME, PROTOCOL_VERSION, PluginProblem, Response, ResponseFrame, ShadowReport,
};
use crate::csi::drivers::Drivers;
use crate::csi::registration::Registered;
use crate::ledger::Record;
use crate::ops::Agent;
use crate::socket::local_report::LocalState;
use crate::sys::MountInfo;
use std::path::Path;
use std::sync::{Arc, OnceLock, RwLock, Weak};
use std::time::Duration;

/// How long a status waits for the ledger (with a cluster, the API
/// server): the rest of the status is worth answering without it.
const LEDGER_WAIT: Duration = Duration::from_secs(10);

/// What the status reports besides the agent's own state, told to it by
/// the parts that know: the plugin dir's reload pass, the local volumes'
/// scan, the CSI drivers.
#[derive(Default)]
pub struct Board {
    /// Degraded backends and pending removals, from the last reload pass.
    problems: RwLock<Vec<PluginProblem>>,
    /// Local volumes, when this agent manages them.
    local: OnceLock<Arc<LocalState>>,
    /// The CSI drivers, when this agent serves CSI (weak: they hold the agent).
    csi: OnceLock<Weak<Drivers>>,
    /// Candidate policies in the shadow and what they differed on.
    shadows: RwLock<Vec<ShadowReport>>,
    /// Where a request to switch recording goes.
    recording: OnceLock<Arc<dyn RecordingSwitch>>,
}

/// Switches a backend's recording on or off; what it did, or why not.
pub trait RecordingSwitch: Send + Sync {
    fn set(&self, backend: &str, on: bool) -> Result<String, String>;
    /// The backends recorded now.
    fn recorded(&self) -> Vec<String>;
}

impl std::fmt::Debug for Board {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Board").finish_non_exhaustive()
    }
}

impl Board {
    pub fn set_plugin_problems(&self, problems: Vec<PluginProblem>) {
        *self.problems.write().unwrap_or_else(|p| p.into_inner()) = problems;
    }

    /// The plugin dir's problems as last published.
    pub fn problems_now(&self) -> Vec<PluginProblem> {
        self.plugin_problems()
    }

    /// Report on local volumes from now on.
    pub fn manage_local(&self, state: Arc<LocalState>) {
        let _ = self.local.set(state);
    }

    /// Report these CSI drivers from now on.
    pub fn serve_csi(&self, drivers: &Arc<Drivers>) {
        let _ = self.csi.set(Arc::downgrade(drivers));
    }

    pub fn set_shadows(&self, shadows: Vec<ShadowReport>) {
        *self.shadows.write().unwrap_or_else(|p| p.into_inner()) = shadows;
    }

    /// The candidates in the shadow, as the status reports them.
    pub fn shadows_now(&self) -> Vec<ShadowReport> {
        self.shadows.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Take requests to switch recording from now on.
    pub fn switch_recording_with(&self, switch: Arc<dyn RecordingSwitch>) {
        let _ = self.recording.set(switch);
    }

    /// Switch `backend`'s recording, when this agent records.
    pub fn switch_recording(&self, backend: &str, on: bool) -> Result<String, String> {
        match self.recording.get() {
            Some(s) => s.set(backend, on),
            None => Err("this agent does not record: start it with --record DIR".into()),
        }
    }

    fn plugin_problems(&self) -> Vec<PluginProblem> {
        self.problems.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn local_report(&self) -> Option<LocalReport> {
        self.local.get().map(|l| l.report())
    }
}

/// The node name, the backends, the plugin dir's problems and the held
/// volumes; a ledger that cannot be read is reported, not fatal.
pub async fn status(agent: &Agent, board: &Board) -> Response {
    let (volumes, volumes_error) =
        match tokio::time::timeout(LEDGER_WAIT, held_volumes(agent)).await {
            Ok(Ok(v)) => (v, None),
            Ok(Err(f)) => (Vec::new(), Some(f.message)),
            Err(_) => (
                Vec::new(),
                Some(format!("the attachment ledger did not answer within {LEDGER_WAIT:?}")),
            ),
        };
    let mut status = Response::Status {
        node: agent.node.config.node.clone(),
        backends: backend_status(agent),
        problems: board.plugin_problems(),
        volumes: Vec::new(),
        volumes_left_out: 0,
        volumes_error,
        local: board.local_report().map(Box::new),
        csi: csi_report(agent, board).await.map(Box::new),
        shadows: board.shadows_now(),
        recording: board.recording.get().map(|r| r.recorded()).unwrap_or_default(),
    };
    let base =
        serde_json::to_vec(&ResponseFrame { version: PROTOCOL_VERSION, response: status.clone() })
            .map_or(0, |b| b.len());
    let (kept, left_out) = fit(volumes, (MAX_FRAME as usize).saturating_sub(base));
    if let Response::Status { volumes, volumes_left_out, .. } = &mut status {
        *volumes = kept;
        *volumes_left_out = left_out;
    }
    status
}

fn backend_status(agent: &Agent) -> Vec<BackendStatus> {
    agent
        .plugins()
        .iter()
        .map(|p| BackendStatus {
            name: p.name().to_string(),
            version: p.info().version.clone(),
            file: p.path().display().to_string(),
            sha256: p.sha256().to_string(),
        })
        .collect()
}

async fn csi_report(agent: &Agent, board: &Board) -> Option<CsiReport> {
    let drivers = board.csi.get().and_then(Weak::upgrade)?;
    let drivers = drivers
        .backends()
        .into_iter()
        .map(|(backend, state)| CsiDriver {
            name: crate::csi::driver_name(&backend),
            backend,
            registration: match state {
                Registered::Yes => "registered".into(),
                Registered::NotYet => "waiting for kubelet".into(),
                Registered::Refused(e) => format!("refused: {e}"),
            },
        })
        .collect();
    let publications = match agent.publications().await {
        Ok(p) => p
            .into_iter()
            .map(|p| CsiPublication {
                volume: p.volume,
                backend: p.backend,
                pod: p.pod,
                target: p.target,
                read_only: p.read_only,
            })
            .collect(),
        Err(f) => {
            tracing::warn!("status: publications left out: {}", f.message);
            Vec::new()
        }
    };
    // At most a quarter of the frame: the held volumes get the rest.
    let (publications, publications_left_out) = fit(publications, MAX_FRAME as usize / 4);
    Some(CsiReport { drivers, publications, publications_left_out })
}

async fn held_volumes(agent: &Agent) -> Result<Vec<HeldVolume>, crate::ops::Failure> {
    let (records, table) = agent.held_records().await?;
    let pins = agent.pins().await;
    let mut held = held_of(&records, &agent.node.config.node, |r| agent.staging_dir_of(r), &table);
    for v in &mut held {
        v.pinned_by =
            crate::ops::holdings::pinned_by(&pins, &table, &v.staging_dir).map(str::to_string);
    }
    Ok(held)
}

/// `records` as `node` holds them, by backend and volume, each volume's
/// pods by namespace, name and mount dir.
pub fn held_of(
    records: &[Record],
    node: &str,
    staging_dir: impl Fn(&Record) -> String,
    table: &[MountInfo],
) -> Vec<HeldVolume> {
    let mut held: Vec<HeldVolume> = records
        .iter()
        .filter(|r| r.on_node(node).next().is_some())
        .map(|r| {
            let staging_dir = staging_dir(r);
            let mut pods: Vec<HeldBy> = r
                .on_node(node)
                .map(|h| HeldBy {
                    namespace: h.consumer.pod_namespace.clone(),
                    name: h.consumer.pod.clone(),
                    uid: h.consumer.pod_uid.clone(),
                    mount_dir: h.consumer.mount_dir.clone(),
                    read_only: h.consumer.read_only,
                    since: h.since.clone(),
                })
                .collect();
            pods.sort_by(|a, b| {
                (&a.namespace, &a.name, &a.mount_dir).cmp(&(&b.namespace, &b.name, &b.mount_dir))
            });
            HeldVolume {
                backend: r.backend.clone(),
                volume: r.volume.clone(),
                access_mode: r.access_mode.name().to_string(),
                device: device_at(table, &staging_dir),
                staging_dir,
                storage_cluster: r.storage_cluster.clone(),
                pods,
                pinned_by: None,
                storage_clients: r
                    .storage_clients
                    .iter()
                    .filter(|c| c.node == node)
                    .map(|c| HeldClient { id: c.id, address: c.address.clone() })
                    .collect(),
            }
        })
        .collect();
    held.sort_by(|a, b| (&a.backend, &a.volume).cmp(&(&b.backend, &b.volume)));
    held
}

/// The device mounted at `dir`: a block device's whole filesystem, not a
/// bind of a dir (whose source names the filesystem it was bound from).
fn device_at(table: &[MountInfo], dir: &str) -> Option<String> {
    let m = table.iter().rev().find(|m| m.mount_point == Path::new(dir))?;
    (m.source.starts_with("/dev/") && m.root == Path::new("/")).then(|| m.source.clone())
}

/// The first of `volumes` whose JSON fits in `budget` bytes, and how many
/// were left out.
pub fn fit<T: serde::Serialize>(items: Vec<T>, budget: usize) -> (Vec<T>, usize) {
    // Room for `"…_left_out":<n>,` besides the items.
    let mut left = budget.saturating_sub(64);
    let total = items.len();
    let mut kept = Vec::new();
    for v in items {
        let size = serde_json::to_vec(&v).map_or(usize::MAX, |b| b.len() + 1);
        if size > left {
            break;
        }
        left -= size;
        kept.push(v);
    }
    let left_out = total - kept.len();
    (kept, left_out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{AccessMode, Consumer, Holder};
    use std::path::PathBuf;

    fn holder(node: &str, ns: &str, pod: &str, volume: &str, since: &str) -> Holder {
        Holder {
            consumer: Consumer {
                node: node.into(),
                pod_namespace: ns.into(),
                pod: pod.into(),
                pod_uid: format!("uid-{pod}"),
                mount_dir: format!("/k/pods/uid-{pod}/volumes/volagent~local-pv/{volume}"),
                read_only: pod.ends_with("-ro"),
                mount_group: None,
            },
            since: since.into(),
        }
    }

    fn record(volume: &str, mode: AccessMode, holders: Vec<Holder>) -> Record {
        Record {
            volume: volume.into(),
            backend: "local-pv".into(),
            access_mode: mode,
            storage_cluster: None,
            source: None,
            holders,
            storage_clients: Vec::new(),
        }
    }

    fn mount(point: &str, source: &str, root: &str) -> MountInfo {
        MountInfo {
            id: 1,
            parent: 0,
            device: (7, 0),
            root: PathBuf::from(root),
            mount_point: PathBuf::from(point),
            options: "rw".into(),
            propagation: vec![],
            fs_type: "ext4".into(),
            source: source.into(),
            super_options: "rw".into(),
        }
    }

    fn staging(r: &Record) -> String {
        format!("/k/plugins/volagent/{}/mounts/{}", r.backend, r.volume)
    }

    #[test]
    fn only_this_nodes_pods_sorted_with_the_staging_device() {
        let records = vec![
            record(
                "pv2",
                AccessMode::ReadOnlyMany,
                vec![
                    holder("n1", "b", "z-ro", "pv2", "t2"),
                    holder("n2", "a", "elsewhere", "pv2", "t1"),
                    holder("n1", "a", "y-ro", "pv2", "t3"),
                ],
            ),
            record(
                "pv1",
                AccessMode::ReadWriteOnce,
                vec![holder("n1", "default", "web-0", "pv1", "2026-01-01T00:00:00Z")],
            ),
            record("pv3", AccessMode::ReadWriteMany, vec![holder("n2", "a", "b", "pv3", "t")]),
            record("pv4", AccessMode::ReadWriteOncePod, vec![holder("n1", "a", "c", "pv4", "t")]),
        ];
        let table = vec![
            mount("/k/plugins/volagent/local-pv/mounts/pv1", "/dev/loop7", "/"),
            mount("/k/pods/uid-web-0/volumes/volagent~local-pv/pv1", "/dev/loop7", "/"),
            // A bind of a dir: its source is the filesystem it lives on, not the volume's device.
            mount("/k/plugins/volagent/local-pv/mounts/pv2", "/dev/sda1", "/srv/data"),
        ];
        let held = held_of(&records, "n1", staging, &table);
        let names: Vec<&str> = held.iter().map(|v| v.volume.as_str()).collect();
        assert_eq!(names, ["pv1", "pv2", "pv4"], "pv3 is held on n2 only");
        let pv1 = &held[0];
        assert_eq!(pv1.device.as_deref(), Some("/dev/loop7"));
        assert_eq!(pv1.access_mode, "ReadWriteOnce");
        assert_eq!(pv1.staging_dir, "/k/plugins/volagent/local-pv/mounts/pv1");
        assert_eq!(
            pv1.pods,
            [HeldBy {
                namespace: "default".into(),
                name: "web-0".into(),
                uid: "uid-web-0".into(),
                mount_dir: "/k/pods/uid-web-0/volumes/volagent~local-pv/pv1".into(),
                read_only: false,
                since: "2026-01-01T00:00:00Z".into(),
            }]
        );
        let pv2 = &held[1];
        assert_eq!(pv2.device, None, "a bound dir has no device");
        let pods: Vec<(&str, &str, bool)> =
            pv2.pods.iter().map(|p| (p.namespace.as_str(), p.name.as_str(), p.read_only)).collect();
        assert_eq!(
            pods,
            [("a", "y-ro", true), ("b", "z-ro", true)],
            "n2's holder is not this node's"
        );
        assert_eq!(held[2].access_mode, "ReadWriteOncePod");
    }

    fn volume(n: usize) -> HeldVolume {
        HeldVolume {
            backend: "local-pv".into(),
            volume: format!("pv{n:05}"),
            access_mode: "ReadWriteOnce".into(),
            device: None,
            staging_dir: format!("/k/plugins/volagent/local-pv/mounts/pv{n:05}"),
            storage_cluster: None,
            pods: vec![],
            pinned_by: None,
            storage_clients: vec![],
        }
    }

    #[test]
    fn what_does_not_fit_is_left_out_and_counted() {
        let all: Vec<HeldVolume> = (0..100).map(volume).collect();
        let (kept, left_out) = fit(all.clone(), usize::MAX);
        assert_eq!((kept.len(), left_out), (100, 0));
        let one = serde_json::to_vec(&all[0]).unwrap().len() + 1;
        let (kept, left_out) = fit(all.clone(), 64 + 10 * one + one / 2);
        assert_eq!((kept.len(), left_out), (10, 90));
        assert_eq!(kept[..], all[..10], "the first ones, in order");
        assert_eq!(fit(all, 0), (vec![], 100));
    }

    #[test]
    fn a_status_of_many_volumes_stays_within_a_frame() {
        // 20000 volumes of ~200 bytes: about 4 MiB, four frames' worth.
        let (kept, left_out) = fit((0..20_000).map(volume).collect(), MAX_FRAME as usize - 200);
        assert!(left_out > 0 && kept.len() + left_out == 20_000);
        let status = Response::Status {
            node: "n1".into(),
            backends: vec![],
            problems: vec![],
            volumes: kept,
            volumes_left_out: left_out,
            volumes_error: None,
            local: None,
            csi: None,
            shadows: vec![],
            recording: vec![],
        };
        crate::socket::protocol::encode(&ResponseFrame {
            version: PROTOCOL_VERSION,
            response: status,
        })
        .expect("within a frame");
    }

    #[tokio::test]
    async fn the_agents_status_lists_what_the_ledger_records_of_this_node() {
        use crate::ledger::Ledger;
        let tmp = tempfile::tempdir().unwrap();
        let (agent, ledger, fake) = crate::ops::tests::test_agent(tmp.path());
        let board = Board::default();
        let Response::Status { volumes, volumes_left_out, volumes_error, .. } =
            status(&agent, &board).await
        else {
            panic!()
        };
        assert_eq!(
            (volumes, volumes_left_out, volumes_error),
            (vec![], 0, None),
            "nothing held yet"
        );

        ledger
            .create(&record(
                "pv1",
                AccessMode::ReadWriteOnce,
                vec![
                    holder("n1", "shop", "web-0", "pv1", "t1"),
                    holder("n2", "shop", "web-1", "pv1", "t2"),
                ],
            ))
            .await
            .unwrap();
        ledger
            .create(&record(
                "pv2",
                AccessMode::ReadWriteOnce,
                vec![holder("n2", "shop", "db-0", "pv2", "t3")],
            ))
            .await
            .unwrap();
        fake.state().mounts.push(mount(
            "/k/plugins/volagent/local-pv/mounts/pv1",
            "/dev/loop9",
            "/",
        ));
        let Response::Status { node, volumes, volumes_left_out, volumes_error, .. } =
            status(&agent, &board).await
        else {
            panic!()
        };
        assert_eq!((node.as_str(), volumes_left_out, volumes_error), ("n1", 0, None));
        assert_eq!(volumes.len(), 1, "pv2 is n2's alone: {volumes:?}");
        let v = &volumes[0];
        assert_eq!(
            (v.volume.as_str(), v.device.as_deref(), v.staging_dir.as_str()),
            ("pv1", Some("/dev/loop9"), "/k/plugins/volagent/local-pv/mounts/pv1")
        );
        let pods: Vec<(&str, &str, &str)> =
            v.pods.iter().map(|p| (p.name.as_str(), p.uid.as_str(), p.since.as_str())).collect();
        assert_eq!(pods, [("web-0", "uid-web-0", "t1")]);
    }
}
