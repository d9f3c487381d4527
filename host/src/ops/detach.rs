//! The detach pipeline: policy → lock → plan from the mount record
//! and the holders left here → execute → the record's holder and the
//! mount record go. Flexvolume unmounts, CSI unstages and reconciliation
//! all run it.

use super::context::Operation;
use super::execute::{run_plan, write_mounts};
use super::mount_records::MountRecord;
use super::plan::queries;
use super::record;
use super::{Agent, Done, Failure, internal};

impl Agent {
    /// Undo what the stash entry `entry` says was done at `mount_dir`.
    pub(crate) async fn detach(
        &self,
        backend: &str,
        entry: MountRecord,
        mount_dir: &str,
    ) -> Result<Done, Failure> {
        let node = &self.node;
        let MountRecord { volume, consumer, paths, .. } = entry;
        let mut op = Operation::new(self, backend, volume, consumer, Default::default(), paths)?;
        op.lock(node)?;
        let name = op.volume.name.clone();
        let remaining = record::others_here(node, &name, mount_dir).await?;
        let plan = op
            .plugin
            .detach(queries(node, &op.plugin, &[]), &op.volume, &op.consumer, &remaining, &op.paths)
            .map_err(internal)?;
        let local = crate::exec::runs_locally(crate::exec::holding(&op.volume), &plan);
        run_plan(node, plan, local, &mut op.lock).await?;
        record::remove_holder(node, &name, mount_dir).await?;
        write_mounts(node, |s| s.remove(mount_dir))?;
        Ok(Done { message: format!("volume {name} unmounted from {mount_dir}"), device: None })
    }
}
