//! What the agent knows of its local volumes right now, for `volagent
//! status`: the last scan's volumes with their state, and the running wipes
//! with the step each is at (updated by the wipe as it goes).

use super::protocol::{LocalReport, LocalVolumeLine, WipeLine};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

/// At most this many volumes in a status answer (the rest are counted).
const MAX_LISTED: usize = 2000;

/// A wipe under way.
#[derive(Debug, Clone)]
pub struct RunningWipe {
    pub attempt: i64,
    pub method: Option<String>,
    /// 0-based index of the step running, and the plan's length.
    pub step: usize,
    pub steps: usize,
    pub step_kind: &'static str,
    pub started_at: String,
    pub started: Instant,
}

#[derive(Default)]
pub struct LocalState {
    scan: Mutex<Scanned>,
    running: Mutex<BTreeMap<String, RunningWipe>>,
}

#[derive(Default)]
struct Scanned {
    volumes: Vec<LocalVolumeLine>,
    scanned_at: Option<String>,
    error: Option<String>,
}

impl LocalState {
    pub fn set_scan(
        &self,
        volumes: Vec<LocalVolumeLine>,
        scanned_at: String,
        error: Option<String>,
    ) {
        *self.scan.lock().unwrap_or_else(|p| p.into_inner()) =
            Scanned { volumes, scanned_at: Some(scanned_at), error };
    }

    pub fn set_error(&self, error: String) {
        self.scan.lock().unwrap_or_else(|p| p.into_inner()).error = Some(error);
    }

    pub fn start(&self, volume: &str, wipe: RunningWipe) {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).insert(volume.to_string(), wipe);
    }

    /// A running wipe moved on to step `step` of `steps`.
    pub fn step(&self, volume: &str, step: usize, steps: usize, kind: &'static str) {
        if let Some(w) = self.running.lock().unwrap_or_else(|p| p.into_inner()).get_mut(volume) {
            (w.step, w.steps, w.step_kind) = (step, steps, kind);
        }
    }

    pub fn set_method(&self, volume: &str, method: &str) {
        if let Some(w) = self.running.lock().unwrap_or_else(|p| p.into_inner()).get_mut(volume) {
            w.method = Some(method.to_string());
        }
    }

    pub fn finish(&self, volume: &str) {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).remove(volume);
    }

    pub fn is_running(&self, volume: &str) -> bool {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).contains_key(volume)
    }

    pub fn running_count(&self) -> usize {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn report(&self) -> LocalReport {
        let scan = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let volumes: Vec<LocalVolumeLine> = scan
            .volumes
            .iter()
            .take(MAX_LISTED)
            .map(|v| {
                let mut v = v.clone();
                if running.contains_key(&v.name) {
                    v.state = "Wiping".into();
                }
                v
            })
            .collect();
        let wipes = running
            .iter()
            .map(|(volume, w)| WipeLine {
                volume: volume.clone(),
                attempt: w.attempt,
                method: w.method.clone(),
                step: w.step + 1,
                steps: w.steps,
                step_kind: w.step_kind.to_string(),
                started_at: w.started_at.clone(),
                elapsed_secs: w.started.elapsed().as_secs(),
            })
            .collect();
        LocalReport {
            volumes_left_out: scan.volumes.len().saturating_sub(volumes.len()),
            volumes,
            wipes,
            scanned_at: scan.scanned_at.clone(),
            error: scan.error.clone(),
        }
    }
}
