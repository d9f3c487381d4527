//! The agent's half of local volumes. It scans its local classes' dirs,
//! publishes what it found in its node's NodeLocalVolumes status, and
//! carries out the wipes the controller requests in the spec, moving each
//! from InProgress to Complete or Error. It writes the status only; the
//! spec is the controller's. A wipe an agent restart cut short is started
//! again, never reported complete.

use super::cluster::Cluster;
use super::crds::{
    DiscoveredVolume, LocalOperation, LocalOperationPhase, LocalOperationStatus, NodeLocalVolumes,
    NodeLocalVolumesStatus, SkippedEntry,
};
use crate::clock::now_rfc3339;
use crate::local::LocalClass;
use crate::local::discovery::{self, Scan};
use crate::model::{AccessMode, KeyValue, Volume};
use crate::ops::Agent;
use crate::socket::local_report::{LocalState, RunningWipe};
use crate::socket::protocol::LocalVolumeLine;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use super::crds::LOCAL_BACKEND;

#[derive(Debug, Clone)]
pub struct LocalConfig {
    pub classes: Vec<LocalClass>,
    /// How often the dirs are scanned besides on every change of the spec.
    pub interval: Duration,
}

/// A wipe's end, reported to the loop that owns the status.
struct Done {
    op: LocalOperation,
    result: Result<String, Refused>,
}

/// Why a wipe did not complete.
#[derive(Debug)]
enum Refused {
    /// Not now (a pod on the node still has it mounted, another operation
    /// on it runs): tried again next round, still InProgress.
    Busy(String),
    Failed(String),
}

struct Publisher {
    agent: Arc<Agent>,
    cluster: Cluster,
    config: LocalConfig,
    state: Arc<LocalState>,
    /// The status as this agent last wrote (or, at start, found) it.
    status: Option<NodeLocalVolumesStatus>,
    written: Option<NodeLocalVolumesStatus>,
    done: tokio::sync::mpsc::UnboundedSender<Done>,
    /// Wipes that were busy, to be tried again (not restarts).
    again: std::collections::BTreeSet<String>,
}

/// Run until cancelled: scan, publish, start what the spec asks.
pub async fn run(agent: Arc<Agent>, cluster: Cluster, config: LocalConfig, state: Arc<LocalState>) {
    let node = cluster.node.clone();
    let api: Api<NodeLocalVolumes> = Api::all(cluster.client.clone());
    let mut changes =
        watcher(api, watcher::Config::default().fields(&format!("metadata.name={node}")))
            .default_backoff()
            .map(|_| ())
            .boxed();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let interval = config.interval;
    let mut me = Publisher {
        agent,
        cluster,
        config,
        state,
        status: None,
        written: None,
        done: tx,
        again: Default::default(),
    };
    loop {
        if let Err(e) = me.round().await {
            tracing::error!(node = %node, "local volumes: {e:#}");
            me.state.set_error(format!("{e:#}"));
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            Some(()) = changes.next() => {
                // Coalesce a burst of watch events into one round.
                while let Ok(Some(())) = tokio::time::timeout(Duration::from_millis(200), changes.next()).await {}
            }
            Some(done) = rx.recv() => me.finish(done),
        }
        while let Ok(done) = rx.try_recv() {
            me.finish(done);
        }
    }
}

impl Publisher {
    async fn round(&mut self) -> anyhow::Result<()> {
        let node = self.cluster.node.clone();
        let api: Api<NodeLocalVolumes> = Api::all(self.cluster.client.clone());
        let object = match api.get_opt(&node).await? {
            Some(o) => o,
            None => match api
                .create(&PostParams::default(), &NodeLocalVolumes::new(&node, Default::default()))
                .await
            {
                Ok(o) => o,
                Err(kube::Error::Api(s)) if s.code == 409 => api.get(&node).await?,
                Err(e) => return Err(e.into()),
            },
        };
        // What a previous run of this agent wrote: its attempts, and which
        // wipes it had started (InProgress, not running here: cut short).
        let mut status = match &self.status {
            Some(s) => s.clone(),
            None => object.status.clone().unwrap_or_default(),
        };
        let scan = self
            .agent
            .discover_local(self.config.classes.clone())
            .await
            .map_err(|f| anyhow::anyhow!(f.message))?;
        let scanned_at = now_rfc3339();
        status.volumes = scan.volumes.iter().map(|v| entry(&node, v)).collect();
        status.skipped = scan
            .skipped
            .iter()
            .map(|s| SkippedEntry { path: s.path.display().to_string(), why: s.why.clone() })
            .collect();
        status.scanned_at = Some(scanned_at.clone());
        let ops = object.spec.operations.clone();
        status.operations.retain(|s| ops.iter().any(|o| o.is(s)));
        let mut start = Vec::new();
        for op in &ops {
            match status.operations.iter_mut().find(|s| op.is(s)) {
                Some(s) if s.phase != LocalOperationPhase::InProgress => {}
                Some(_) if self.state.is_running(&op.volume) => {}
                Some(s) if self.again.remove(&op.volume) => start.push((op.clone(), s.attempt)),
                Some(s) => {
                    s.attempt += 1;
                    s.started_at = now_rfc3339();
                    s.message = Some("started again: the agent stopped during the wipe".into());
                    tracing::warn!(volume = %op.volume, attempt = s.attempt, "a wipe was cut short by an agent restart: starting it again");
                    start.push((op.clone(), s.attempt));
                }
                None => {
                    status.operations.push(LocalOperationStatus {
                        volume: op.volume.clone(),
                        pv_uid: op.pv_uid.clone(),
                        requested_at: op.requested_at.clone(),
                        phase: LocalOperationPhase::InProgress,
                        attempt: 1,
                        method: None,
                        message: None,
                        started_at: now_rfc3339(),
                        finished_at: None,
                    });
                    start.push((op.clone(), 1));
                }
            }
        }
        for (op, attempt) in &start {
            // Marked running before the status is written, so that a round
            // in between does not start it twice.
            self.state.start(
                &op.volume,
                RunningWipe {
                    attempt: *attempt,
                    method: None,
                    step: 0,
                    steps: 0,
                    step_kind: "planning",
                    started_at: now_rfc3339(),
                    started: Instant::now(),
                },
            );
        }
        if let Err(e) = self.publish(&api, status, &scan, scanned_at).await {
            // Not started after all: the next round starts them (the
            // status this agent holds says InProgress).
            for (op, _) in &start {
                self.state.finish(&op.volume);
                self.again.insert(op.volume.clone());
            }
            return Err(e);
        }
        for (op, _) in start {
            let discovered =
                scan.volumes.iter().find(|v| entry(&node, v).name == op.volume).cloned();
            tokio::spawn(wipe(
                self.agent.clone(),
                self.cluster.clone(),
                op,
                discovered,
                self.state.clone(),
                self.done.clone(),
            ));
        }
        Ok(())
    }

    /// Counts, the status report, and the object's status when it changed.
    async fn publish(
        &mut self,
        api: &Api<NodeLocalVolumes>,
        mut status: NodeLocalVolumesStatus,
        scan: &Scan,
        scanned_at: String,
    ) -> anyhow::Result<()> {
        let phase_count = |p: LocalOperationPhase| {
            status.operations.iter().filter(|s| s.phase == p).count() as i64
        };
        status.volume_count = status.volumes.len() as i64;
        status.wiping = phase_count(LocalOperationPhase::InProgress);
        status.failed = phase_count(LocalOperationPhase::Error);
        status.skipped_count = status.skipped.len() as i64;
        crate::metrics::get().local_volumes.set(status.volume_count);
        let lines = status
            .volumes
            .iter()
            .zip(&scan.volumes)
            .map(|(d, v)| LocalVolumeLine {
                name: d.name.clone(),
                class: d.class.clone(),
                path: v.path.display().to_string(),
                kind: d.kind.clone(),
                capacity: d.capacity.clone(),
                state: state_of(&status, &d.name).into(),
            })
            .collect();
        self.state.set_scan(lines, scanned_at, None);
        // The scan time alone changing is not worth a write.
        let mut unchanged = self.written.clone();
        if let Some(u) = &mut unchanged {
            u.scanned_at = status.scanned_at.clone();
        }
        // Held before it is written: what this agent knows stays its truth
        // when the API server is away.
        self.status = Some(status.clone());
        if unchanged.as_ref() != Some(&status) {
            // A merge patch leaves out what is absent: an emptied list must
            // be sent as empty.
            let mut value = serde_json::to_value(&status)?;
            value["skipped"] = serde_json::json!(status.skipped);
            let patch = serde_json::json!({ "status": value });
            api.patch_status(&self.cluster.node, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            self.written = Some(status);
        }
        Ok(())
    }

    fn finish(&mut self, done: Done) {
        self.state.finish(&done.op.volume);
        let Some(status) = &mut self.status else { return };
        let Some(s) = status.operations.iter_mut().find(|s| done.op.is(s)) else { return };
        s.finished_at = Some(now_rfc3339());
        match done.result {
            Ok(method) => {
                s.phase = LocalOperationPhase::Complete;
                s.method = Some(method);
                s.message = None;
            }
            Err(Refused::Busy(message)) => {
                s.message = Some(crate::text::bounded(format!("waiting: {message}"), 4096));
                s.finished_at = None;
                self.again.insert(done.op.volume.clone());
            }
            Err(Refused::Failed(message)) => {
                s.phase = LocalOperationPhase::Error;
                s.message = Some(crate::text::bounded(message, 4096));
            }
        }
    }
}

/// What the status says of a discovered volume.
fn state_of(status: &NodeLocalVolumesStatus, volume: &str) -> &'static str {
    match status.operations.iter().find(|s| s.volume == volume).map(|s| s.phase) {
        None => "Available",
        Some(LocalOperationPhase::InProgress) => "Wiping",
        Some(LocalOperationPhase::Error) => "WipeFailed",
        Some(LocalOperationPhase::Complete) => "Wiped",
    }
}

/// A discovered volume as the status lists it.
pub fn entry(node: &str, v: &discovery::Volume) -> DiscoveredVolume {
    let (fs_type, device, identity) = match &v.kind {
        discovery::Kind::Filesystem { fs_type } => (Some(fs_type.clone()), None, None),
        discovery::Kind::Block { device, identity } => {
            (None, Some(device.display().to_string()), Some(identity.clone()))
        }
        discovery::Kind::File => (None, None, None),
    };
    DiscoveredVolume {
        name: crate::local::pv_name(node, &v.class, &v.path),
        class: v.class.clone(),
        path: v.path.display().to_string(),
        kind: v.kind_name().into(),
        fs_type,
        device,
        identity,
        capacity: crate::local::quantity(v.capacity_bytes),
    }
}

/// Wipe one released volume and report how it ended.
async fn wipe(
    agent: Arc<Agent>,
    cluster: Cluster,
    op: LocalOperation,
    discovered: Option<discovery::Volume>,
    state: Arc<LocalState>,
    done: tokio::sync::mpsc::UnboundedSender<Done>,
) {
    let started = Instant::now();
    let bytes = discovered.as_ref().map_or(0, |v| v.capacity_bytes);
    let result = wipe_volume(&agent, &cluster, &op, discovered, &state).await;
    let took = started.elapsed();
    let metrics = crate::metrics::get();
    match &result {
        Ok(method) => {
            metrics.local_wipe(method, bytes, "complete", took);
            tracing::info!(volume = %op.volume, method, secs = took.as_secs_f64(), "wiped a released local volume");
            let message = format!(
                "wiped by {method} in {:.1} s on node {}",
                took.as_secs_f64(),
                cluster.node
            );
            cluster.pv_event(op.pv_name(), &op.pv_uid, false, "WipeComplete", &message).await;
        }
        Err(Refused::Busy(message)) => {
            tracing::info!(volume = %op.volume, "wipe of a released local volume waits: {message}");
        }
        Err(Refused::Failed(message)) => {
            metrics.local_wipe("unknown", bytes, "error", took);
            tracing::error!(volume = %op.volume, "wipe of a released local volume failed: {message}");
            cluster.pv_event(op.pv_name(), &op.pv_uid, true, "WipeFailed", message).await;
        }
    }
    let _ = done.send(Done { op, result });
}

async fn wipe_volume(
    agent: &Arc<Agent>,
    cluster: &Cluster,
    op: &LocalOperation,
    discovered: Option<discovery::Volume>,
    state: &Arc<LocalState>,
) -> Result<String, Refused> {
    let checked = checked_volume(cluster, op, discovered).await.map_err(Refused::Failed)?;
    let name = &op.volume;
    cluster
        .pv_event(
            op.pv_name(),
            &op.pv_uid,
            false,
            "WipeStarted",
            &format!("wiping {} on node {}", checked.1.display(), cluster.node),
        )
        .await;
    let progress_state = state.clone();
    let progress_name = name.clone();
    let progress: crate::exec::Progress =
        Arc::new(move |step, steps, kind| progress_state.step(&progress_name, step, steps, kind));
    agent.release_local_volume(checked.0, |m| state.set_method(name, m), progress).await.map_err(
        |f| match f.kind {
            crate::ops::FailureKind::Busy => Refused::Busy(f.message),
            _ => Refused::Failed(f.message),
        },
    )
}

/// The volume to wipe, as its PV defines it, and its path; only what this
/// agent discovered, and only as its PV describes exactly that volume.
async fn checked_volume(
    cluster: &Cluster,
    op: &LocalOperation,
    discovered: Option<discovery::Volume>,
) -> Result<(Volume, std::path::PathBuf), String> {
    let v = discovered.ok_or_else(|| format!("volume {} is not among the local volumes node {} discovered (gone, or outside its discovery dirs): nothing wiped", op.volume, cluster.node))?;
    let name = op.pv_name();
    let pvs: Api<PersistentVolume> = Api::all(cluster.client.clone());
    let pv = pvs
        .get_opt(name)
        .await
        .map_err(|e| format!("reading PV {name}: {e}"))?
        .ok_or_else(|| format!("PV {name} is gone: nothing wiped"))?;
    if pv.metadata.uid.as_deref() != Some(op.pv_uid.as_str()) {
        return Err(format!(
            "PV {name} is not the released one (UID {}): nothing wiped",
            op.pv_uid
        ));
    }
    // The request is the controller's; the PV still says what it asked
    // for: released (or failed) under reclaim policy Delete.
    if !super::local_pvs::needs_wipe(&pv) {
        let phase = pv.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
        let policy = pv
            .spec
            .as_ref()
            .and_then(|s| s.persistent_volume_reclaim_policy.clone())
            .unwrap_or_default();
        return Err(format!(
            "PV {name} is {phase} with reclaim policy {policy}, not released under Delete: nothing wiped"
        ));
    }
    Ok((volume_of(&pv, &op.volume, &v, &cluster.node)?, v.path))
}

/// The volume a wipe plan is asked for: the PV's own definition, checked
/// to be discovered volume `volume` (`v`) on this node — a discovered
/// volume's own Flexvolume PV, or the CSI PV of a volume provisioned on it
/// (whose handle is the discovered volume's name).
fn volume_of(
    pv: &PersistentVolume,
    volume: &str,
    v: &discovery::Volume,
    node: &str,
) -> Result<Volume, String> {
    let name = pv.metadata.name.clone().unwrap_or_default();
    let spec = pv.spec.clone().unwrap_or_default();
    let flex_driver = super::volumes::driver_name(LOCAL_BACKEND);
    let csi_driver = crate::csi::driver_name(LOCAL_BACKEND);
    let (options, fs_type) = match (&spec.flex_volume, &spec.csi) {
        (Some(flex), _) if flex.driver == flex_driver && name == volume => {
            (flex.options.clone().unwrap_or_default(), flex.fs_type.clone())
        }
        (_, Some(csi)) if csi.driver == csi_driver && csi.volume_handle == volume => {
            (csi.volume_attributes.clone().unwrap_or_default(), csi.fs_type.clone())
        }
        _ => {
            return Err(format!(
                "PV {name} is neither {flex_driver} volume {volume} nor {csi_driver} volume {volume}: nothing wiped"
            ));
        }
    };
    let want = v.data_path().display().to_string();
    if options.get("path") != Some(&want) || options.get("node").map(String::as_str) != Some(node) {
        return Err(format!(
            "PV {name} names path {:?} on node {:?}, not the discovered volume {want} on {node}: nothing wiped",
            options.get("path").map_or("", |s| s.as_str()),
            options.get("node").map_or("", |s| s.as_str())
        ));
    }
    if let discovery::Kind::Block { identity, .. } = &v.kind
        && options.get(discovery::IDENTITY_OPTION) != Some(identity)
    {
        return Err(format!(
            "PV {name} records another device identity than the discovered {identity}: nothing wiped"
        ));
    }
    Ok(Volume {
        name: volume.to_string(),
        backend: LOCAL_BACKEND.into(),
        access_mode: AccessMode::ReadWriteOnce,
        fs_type: fs_type.unwrap_or_default(),
        mode: crate::policy::VolumeMode::Filesystem,
        mount_flags: Vec::new(),
        options: options.into_iter().map(|(key, value)| KeyValue { key, value }).collect(),
        secret_keys: vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{FlexPersistentVolumeSource, PersistentVolumeSpec};
    use std::path::PathBuf;

    fn pv(driver: &str, options: &[(&str, &str)]) -> PersistentVolume {
        PersistentVolume {
            metadata: kube::api::ObjectMeta { name: Some("local-1".into()), ..Default::default() },
            spec: Some(PersistentVolumeSpec {
                flex_volume: Some(FlexPersistentVolumeSource {
                    driver: driver.into(),
                    fs_type: Some("ext4".into()),
                    options: Some(
                        options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn block() -> discovery::Volume {
        discovery::Volume {
            class: "fast".into(),
            path: PathBuf::from("/mnt/fast/wwn-1"),
            kind: discovery::Kind::Block {
                device: "/dev/sdb".into(),
                identity: "wwid:naa.1".into(),
            },
            capacity_bytes: 1 << 30,
        }
    }

    #[test]
    fn only_the_pv_of_exactly_the_discovered_volume_is_wiped() {
        let good =
            [("path", "/dev/sdb"), ("node", "n1"), ("identity", "wwid:naa.1"), ("wipe", "zero")];
        let v = volume_of(&pv("volagent/local-pv", &good), "local-1", &block(), "n1").unwrap();
        assert_eq!(
            (v.name.as_str(), v.backend.as_str(), v.fs_type.as_str()),
            ("local-1", "local-pv", "ext4")
        );
        assert!(v.options.iter().any(|kv| kv.key == "wipe" && kv.value == "zero"));
        // A PV edited to point elsewhere, at another node, another disk, or
        // another driver is refused: nothing outside what was discovered.
        for (bad, why) in [
            (vec![("path", "/etc/passwd"), ("node", "n1"), ("identity", "wwid:naa.1")], "path"),
            (vec![("path", "/dev/sdb"), ("node", "n2"), ("identity", "wwid:naa.1")], "node"),
            (vec![("path", "/dev/sdb"), ("node", "n1"), ("identity", "wwid:other")], "identity"),
            (vec![("path", "/dev/sdb"), ("node", "n1")], "identity"),
        ] {
            let e =
                volume_of(&pv("volagent/local-pv", &bad), "local-1", &block(), "n1").unwrap_err();
            assert!(e.contains("nothing wiped"), "{why}: {e}");
        }
        assert!(
            volume_of(&pv("volagent/rbd", &good), "local-1", &block(), "n1")
                .unwrap_err()
                .contains("neither volagent/local-pv volume local-1")
        );
        // A discovered volume's own PV is the one of its name.
        assert!(volume_of(&pv("volagent/local-pv", &good), "local-2", &block(), "n1").is_err());

        // A provisioned volume's CSI PV, whose handle is the discovered
        // volume's name, is checked the same way.
        let csi = |handle: &str, attributes: &[(&str, &str)]| PersistentVolume {
            metadata: kube::api::ObjectMeta { name: Some("pvc-9".into()), ..Default::default() },
            spec: Some(PersistentVolumeSpec {
                csi: Some(k8s_openapi::api::core::v1::CSIPersistentVolumeSource {
                    driver: "local-pv.csi.volagent.io".into(),
                    volume_handle: handle.into(),
                    volume_attributes: Some(
                        attributes.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        };
        let v = volume_of(&csi("local-1", &good), "local-1", &block(), "n1").unwrap();
        assert_eq!(v.name, "local-1", "the volume is the discovered one, not its PV");
        assert!(volume_of(&csi("local-2", &good), "local-1", &block(), "n1").is_err());
        let elsewhere = [("path", "/dev/sdc"), ("node", "n1"), ("identity", "wwid:naa.1")];
        let e = volume_of(&csi("local-1", &elsewhere), "local-1", &block(), "n1").unwrap_err();
        assert!(e.contains("nothing wiped"), "{e}");
    }
}
