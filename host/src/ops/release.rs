//! Releasing a local volume for reuse: its backend's cleanup plan for
//! `local-volume-released` (the policy chooses the wipe), run on a thread
//! of its own at idle I/O priority, for as long as the wipe takes.

use super::plan::verified_devices;
use super::{Agent, Failure, internal};
use crate::exec::{Executor, Progress};
use crate::model::{CleanupItem, CleanupReason, Step, Volume, WipeMethod};
use crate::ops::FailureKind;
use std::sync::Arc;

/// How a plan destroys the data, as metrics and the status name it.
pub fn wipe_method(plan: &[Step]) -> String {
    let methods: Vec<String> = plan
        .iter()
        .filter_map(|s| match s {
            Step::Wipe(w) => Some(match w.method {
                WipeMethod::Signatures => "quick-reset".to_string(),
                WipeMethod::Discard => "blkdiscard".to_string(),
                WipeMethod::Zero => "zero".to_string(),
                WipeMethod::Shred(n) => format!("shred:{n}"),
            }),
            Step::ClearDirectory(_) => Some("clear-directory".to_string()),
            _ => None,
        })
        .collect();
    if methods.is_empty() { "none".to_string() } else { methods.join("+") }
}

impl Agent {
    /// Wipe the released local volume `volume` (as its PV defines it).
    /// `method` hears the wipe method once the plan is known, `progress`
    /// each step as it starts. Refused while a pod on this node still holds
    /// the volume or another operation on it runs.
    pub async fn release_local_volume(
        &self,
        volume: Volume,
        method: impl FnOnce(&str),
        progress: Progress,
    ) -> Result<String, Failure> {
        let plugin = self.plugin(&volume.backend)?;
        let name = volume.name.clone();
        let held = super::execute::read_mounts(&self.node, |s| s.all())?;
        if let Some(e) = held.iter().find(|e| e.volume.name == name) {
            return Err(Failure::new(
                FailureKind::Busy,
                format!(
                    "volume {name}: still mounted on this node for pod {}/{} at {}; not wiped",
                    e.consumer.pod_namespace, e.consumer.pod, e.consumer.mount_dir
                ),
            ));
        }
        let devices = verified_devices(&self.node.sys, &volume).await?;
        let lock = super::node::lock(&self.node, &name)?;
        let item = CleanupItem {
            volume: volume.clone(),
            paths: self.node.config.paths(&volume.backend, &name),
            holders: vec![],
        };
        let queries =
            Arc::new(super::plan::node_queries(&self.node, &plugin, &[]).with_devices(devices));
        let plan = plugin
            .cleanup(queries, CleanupReason::LocalVolumeReleased, std::slice::from_ref(&item))
            .map_err(internal)?;
        let chosen = wipe_method(&plan);
        method(&chosen);
        let exec = Executor::new(self.node.sys.clone()).with_progress(progress);
        let (tx, rx) = tokio::sync::oneshot::channel();
        // A thread of its own: the priority set on it must not stay with a
        // pooled thread that later serves a mount. The device tools' own
        // deadlines bound the wipe (hours for a shred of a big disk).
        std::thread::Builder::new()
            .name("volagent-wipe".into())
            .spawn(move || {
                // Held until the steps end, even if no one waits any more.
                let _lock = lock;
                crate::sys::lower_thread_priority();
                let _ = tx.send(exec.run(&plan));
            })
            .map_err(|e| internal(format!("volume {name}: cannot start the wipe thread: {e}")))?;
        let result = rx.await.map_err(|_| {
            internal(format!("volume {name}: the wipe thread ended without a result"))
        })?;
        result.map_err(|e| internal(format!("volume {name}: {e}")))?;
        Ok(chosen)
    }
}
