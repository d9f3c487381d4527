//! Start-up reconciliation: what the stash and the ledger say this node
//! has, against what the mount table and the loop devices say it has. An
//! operation cut short (a crash, a kill -9) is rolled back, so kubelet's
//! retry starts from a clean node; what no record explains is reported and
//! removed.

use super::execute::blocking;
use super::{Agent, Failure, internal};
use crate::policy::validate::clean_absolute;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// What reconciliation did, for the log and for tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Pod mount dirs whose mount was complete: kept.
    pub kept: Vec<String>,
    /// Mounted dirs whose holder a crash kept from the (node-private)
    /// ledger, recorded again.
    pub recorded_again: Vec<String>,
    /// Pod mount dirs of operations cut short: rolled back.
    pub rolled_back: Vec<String>,
    /// Ledger holders on this node with no trace on the node: removed.
    pub stale_holders: Vec<String>,
    /// Mounts and devices under volagent's dirs that nothing explains: removed.
    pub orphans: Vec<String>,
    /// MountRecords entries that could not be decoded, set aside (their mounts are
    /// unmounted from the ledger's record when kubelet asks).
    pub quarantined: Vec<String>,
    /// What could not be repaired.
    pub errors: Vec<String>,
}

impl Agent {
    pub async fn reconcile(&self) -> Result<Report, Failure> {
        let mut report = Report::default();
        let stash = super::execute::read_mounts(&self.node, |s| s.all())?;
        report.quarantined = super::execute::read_mounts(&self.node, |s| s.quarantined())?;
        let mut stashed_dirs = BTreeSet::new();
        for entry in stash {
            let dir = entry.consumer.mount_dir.clone();
            stashed_dirs.insert(dir.clone());
            let mounted = self.mounted(&dir).await?;
            if mounted {
                // A node-private ledger stores records behind the
                // operations: a crash can leave a complete mount whose
                // holder never reached the disk.
                if self.node.ledger.node_private() {
                    match self.record_holder_again(&entry).await {
                        Ok(true) => report.recorded_again.push(dir.clone()),
                        Ok(false) => {}
                        Err(f) => report.errors.push(format!("{dir}: {}", f.message)),
                    }
                }
                report.kept.push(dir);
                continue;
            }
            // Cut short between recording and binding, or between unbinding
            // and forgetting: undo it; kubelet will ask again if it must.
            let backend = entry.volume.backend.clone();
            match self.detach(&backend, entry, &dir).await {
                Ok(_) => report.rolled_back.push(dir),
                Err(f) => report.errors.push(format!("{dir}: {}", f.message)),
            }
        }
        // Holders on this node that the stash does not know never got as far
        // as a device or a mount.
        let records = self
            .node
            .ledger
            .list_by_node(&self.node.config.node)
            .await
            .map_err(super::record::ledger_failure)?;
        // A staging dir a record names is not an orphan: its stash entry
        // may be lost or damaged, and its pods' unmounts will come.
        let recorded: BTreeSet<String> = records
            .iter()
            .map(|(r, _)| self.node.config.paths(&r.backend, &r.volume).staging_dir)
            .collect();
        for (record, _) in records {
            for h in record.on_node(&self.node.config.node) {
                let dir = &h.consumer.mount_dir;
                if stashed_dirs.contains(dir) || report.rolled_back.contains(dir) {
                    continue;
                }
                if self.mounted(dir).await? {
                    report.errors.push(format!(
                        "{dir} is mounted but this agent has no record of mounting it; left alone"
                    ));
                    continue;
                }
                match super::record::remove_holder(&self.node, &record.volume, dir).await {
                    Ok(()) => report.stale_holders.push(format!("{} {dir}", record.volume)),
                    Err(f) => report.errors.push(format!("{dir}: {}", f.message)),
                }
            }
        }
        self.sweep_orphans(&recorded, &mut report).await?;
        for target in self.forget_unmounted_publications().await? {
            report.rolled_back.push(target);
        }
        for line in &report.recorded_again {
            tracing::warn!(mount_dir = %line, "reconcile: recorded a mounted holder the ledger had lost");
        }
        for line in &report.rolled_back {
            tracing::warn!(mount_dir = %line, "reconcile: rolled back an operation cut short");
        }
        for line in report.stale_holders.iter().chain(&report.orphans) {
            tracing::warn!("reconcile: removed {line}");
        }
        for line in &report.quarantined {
            tracing::error!(mount_dir = %line, "reconcile: this dir's stash entry is quarantined (undecodable)");
        }
        for line in &report.errors {
            tracing::error!("reconcile: {line}");
        }
        Ok(report)
    }

    /// Add the stash entry's consumer to its volume's record if it is not
    /// there; true when it was added.
    async fn record_holder_again(
        &self,
        entry: &super::mount_records::MountRecord,
    ) -> Result<bool, Failure> {
        let volume = &entry.volume;
        let current =
            self.node.ledger.get(&volume.name).await.map_err(super::record::ledger_failure)?;
        let holder = crate::model::Holder {
            consumer: entry.consumer.clone(),
            since: crate::clock::now_rfc3339(),
        };
        let written = match current {
            Some((mut record, version)) => {
                if record.holders.iter().any(|h| h.consumer.mount_dir == entry.consumer.mount_dir) {
                    return Ok(false);
                }
                record.holders.push(holder);
                self.node.ledger.update(&record, &version).await.map(drop)
            }
            None => {
                let record = crate::ledger::Record {
                    volume: volume.name.clone(),
                    backend: volume.backend.clone(),
                    access_mode: volume.access_mode,
                    storage_cluster: super::record::storage_cluster(volume),
                    source: Some(crate::ledger::VolumeSource::of(volume)),
                    holders: vec![holder],
                    storage_clients: Vec::new(),
                };
                self.node.ledger.create(&record).await.map(drop)
            }
        };
        written.map_err(super::record::ledger_failure)?;
        Ok(true)
    }

    pub(super) async fn mounted(&self, dir: &str) -> Result<bool, Failure> {
        let sys = self.node.sys.clone();
        let dir = PathBuf::from(dir);
        blocking(move || sys.is_mounted(&dir)).await?.map_err(internal)
    }

    /// An orphan staging mount, `<staging-root>/<backend>/mounts/<volume>`,
    /// torn down by its backend's cleanup plan (stale-node, no holders).
    /// Nothing records the volume's options, so a backend that needs them
    /// refuses, and the caller unmounts it plainly.
    async fn clean_orphan_by_backend(&self, mount_point: &Path) -> Result<String, String> {
        let staging_root = self.node.config.kubelet_root.join("plugins/volagent");
        let rel = mount_point.strip_prefix(&staging_root).map_err(|e| e.to_string())?;
        let parts: Vec<&str> = rel.iter().filter_map(|c| c.to_str()).collect();
        let [backend, "mounts", volume] = parts.as_slice() else {
            return Err("not a staging dir".into());
        };
        let plugin = self.plugin(backend).map_err(|f| f.message)?;
        let mut lock = Some(super::node::lock(&self.node, volume).map_err(|f| f.message)?);
        let item = crate::model::CleanupItem {
            volume: crate::model::Volume {
                name: volume.to_string(),
                backend: backend.to_string(),
                access_mode: crate::policy::AccessMode::ReadWriteOnce,
                fs_type: String::new(),
                mode: crate::policy::VolumeMode::Filesystem,
                mount_flags: Vec::new(),
                options: Vec::new(),
                secret_keys: Vec::new(),
            },
            paths: self.node.config.paths(backend, volume),
            holders: Vec::new(),
        };
        let plan = plugin
            .cleanup(
                super::plan::queries(&self.node, &plugin, &[]),
                crate::policy::CleanupReason::StaleNode,
                &[item],
            )
            .map_err(|e| e.to_string())?;
        super::execute::run_plan(&self.node, plan, false, &mut lock)
            .await
            .map_err(|f| f.message)?;
        if self.mounted(&mount_point.display().to_string()).await.map_err(|f| f.message)? {
            return Err("still mounted after the backend's cleanup plan".into());
        }
        Ok(backend.to_string())
    }

    /// Staging mounts with no stashed consumer, and loop devices over local
    /// volume files that no stashed volume names and nothing mounts.
    async fn sweep_orphans(
        &self,
        recorded: &BTreeSet<String>,
        report: &mut Report,
    ) -> Result<(), Failure> {
        let stash = super::execute::read_mounts(&self.node, |s| s.all())?;
        let staging_root = self.node.config.kubelet_root.join("plugins/volagent");
        // First the backends' own cleanup plans, for the staging mounts
        // whose backend is loaded.
        let mut used: BTreeSet<String> =
            stash.iter().map(|e| e.paths.staging_dir.clone()).collect();
        used.extend(recorded.iter().cloned());
        let sys = self.node.sys.clone();
        let table = blocking(move || sys.mounts.mount_table()).await?.map_err(internal)?;
        for m in table.iter().rev() {
            let p = m.mount_point.display().to_string();
            let under = m.mount_point.starts_with(&staging_root)
                && m.mount_point.components().count() == staging_root.components().count() + 3;
            if !under || clean_absolute(&p).is_err() || used.contains(&p) {
                continue;
            }
            match self.clean_orphan_by_backend(&m.mount_point).await {
                Ok(backend) => report.orphans.push(format!(
                    "orphan mount {p} (from {}), by backend {backend}'s cleanup plan",
                    m.source
                )),
                Err(why) => {
                    tracing::warn!(mount = %p, "orphan not cleaned by its backend ({why}); unmounting it plainly");
                }
            }
        }
        let sys = self.node.sys.clone();
        let found = blocking(move || -> Result<(Vec<String>, Vec<String>), crate::sys::SysError> {
            let mut removed = Vec::new();
            let mut problems = Vec::new();
            let used_staging = used;
            let table = sys.mounts.mount_table()?;
            for m in table.iter().rev() {
                let p = m.mount_point.display().to_string();
                let under = m.mount_point.starts_with(&staging_root) && m.mount_point.components().count() == staging_root.components().count() + 3;
                if under && clean_absolute(&p).is_ok() && !used_staging.contains(&p) {
                    sys.mounts.unmount(&m.mount_point, false)?;
                    let _ = sys.mounts.remove_dir(&m.mount_point);
                    removed.push(format!("orphan mount {p} (from {})", m.source));
                }
            }
            // Files the stashed volumes name, by identity (a path option
            // outside the roots names nothing the agent attaches).
            let named: BTreeSet<crate::sys::FileId> = stash
                .iter()
                .flat_map(|e| e.volume.options.iter())
                .filter(|kv| kv.value.starts_with('/'))
                .filter_map(|kv| sys.devices.file_id(Path::new(&kv.value)).ok().flatten())
                .collect();
            let mounted: BTreeSet<String> = sys.mounts.mount_table()?.into_iter().map(|m| m.source).collect();
            for l in sys.devices.loop_devices()? {
                // Only devices this agent attached (they carry its tag): an
                // admin's or another program's loop device is never ours to
                // detach, whatever file it is over.
                let ours = l.tag == sys.devices.loop_tag();
                let busy = mounted.contains(&l.device.display().to_string());
                if ours && !busy && !l.backing.is_some_and(|id| named.contains(&id)) {
                    sys.devices.loop_detach(&l.device)?;
                    removed.push(format!("orphan loop device {} (over {})", l.device.display(), l.backing_file.display()));
                }
            }
            // Kernel nbd devices: the kernel holds their connections across
            // agent restarts; one a mount uses is kept, one nothing uses
            // (or whose connection is gone) is disconnected.
            let mut kernel_keys = BTreeSet::new();
            for (key, device) in sys.kernel_nbd.connections() {
                kernel_keys.insert(key.clone());
                if device.as_ref().is_some_and(|d| mounted.contains(&d.display().to_string())) {
                    continue;
                }
                sys.kernel_nbd.disconnect(&key)?;
                sys.export_helpers.stop_serving(&key)?;
                let what = device.map_or("gone".to_string(), |d| d.display().to_string());
                removed.push(format!("orphan kernel NBD connection {key} ({what})"));
            }
            // The agent's kernel rbd mappings: one a mount uses is kept, one
            // nothing uses is unmapped.
            if sys.krbd.available() {
                for m in sys.krbd.mappings()?.into_iter().filter(|m| m.ours) {
                    if !mounted.contains(&m.device.display().to_string()) {
                        sys.krbd.unmap(m.id, false)?;
                        removed.push(format!("orphan kernel rbd mapping {} ({}/{})", m.device.display(), m.pool, m.image));
                    }
                }
            }
            // Userspace NBD clients: one a loop device of ours still uses
            // is adopted as it runs (it outlived the previous agent); one
            // nothing uses is stopped.
            let loops = sys.devices.loop_devices()?;
            let tag = sys.devices.loop_tag();
            let fuse = crate::sys::mountinfo::fuse_mounts_by_device(&sys.mounts.mount_table()?);
            for (key, running) in sys.fuse_clients.clients()? {
                let file = sys.fuse_clients.file(&key);
                // An rbd-fuse client's file is named after its image, not
                // its key: any file in the client's dir is its, found by
                // its path or, once an earlier agent attached it, by the
                // mount it is on.
                let used = loops.iter().any(|l| {
                    l.is_over_client_file(&file, tag)
                        || (file.parent().is_some()
                            && (l.backing_file.parent() == file.parent()
                                || l.fuse_mount(&fuse) == file.parent()))
                });
                match (used, running) {
                    // A kernel connection's (helper server), seen to above.
                    (false, _) if kernel_keys.contains(&key) => {}
                    (true, true) => {}
                    (true, false) => problems.push(format!(
                        "the userspace NBD client {key} of a mounted volume is gone (its process ended, e.g. with the agent's container): \
                         its loop device fails I/O until the pods using it are restarted"
                    )),
                    (false, _) => {
                        sys.fuse_clients.disconnect(&key)?;
                        sys.export_helpers.stop_serving(&key)?;
                        removed.push(format!("orphan NBD client {key}"));
                    }
                }
            }
            Ok((removed, problems))
        })
        .await?;
        match found {
            Ok((removed, problems)) => {
                report.orphans.extend(removed);
                report.errors.extend(problems);
            }
            Err(e) => report.errors.push(e.to_string()),
        }
        Ok(())
    }
}
