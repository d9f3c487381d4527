//! Running a checked plan on the node through `sys`: every step idempotent
//! (already attached or mounted is success), and a failing step rolls back
//! what the steps before it did.

mod devices;
mod filesystems;
mod mounts;
mod rbd;

use crate::model::{
    BlockSource, DeviceSpec, FormatMode, MountSource, NbdAttach, NbdSpec, RbdAttach, RbdSpec, Step,
    WipeMethod,
};
use crate::secret::Secrets;
use crate::sys::rbd_export::{CephClient, RbdTarget};
use crate::sys::{LoopAttach, Sys, SysError, Wipe};
pub use devices::nbd_key;
pub use rbd::rbd_key;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error("{0}")]
    Refused(String),
}

/// A plan that failed: which step, why, and what rolling back could not undo.
#[derive(Debug, thiserror::Error)]
#[error("step {} ({step}) failed: {source}{}", index + 1, rollback_note(rollback_failures))]
pub struct ExecError {
    pub index: usize,
    pub step: &'static str,
    pub source: StepError,
    pub rollback_failures: Vec<String>,
}

fn rollback_note(failures: &[String]) -> String {
    if failures.is_empty() {
        "; the steps before it were rolled back".to_string()
    } else {
        format!("; rolling back left work undone: {}", failures.join("; "))
    }
}

/// What a successful plan produced.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Device of each attach-device step, by id.
    pub devices: BTreeMap<String, PathBuf>,
    /// The storage clients the devices are served by (an RBD helper's
    /// Ceph client): global id and address.
    pub storage_clients: Vec<(u64, String)>,
    /// Size in bytes of each filesystem a grow-filesystem step grew, by
    /// target.
    pub grown: BTreeMap<String, u64>,
}

/// An effect of this run that rollback undoes.
#[derive(Debug)]
enum Undo {
    Detach(PathBuf),
    /// Stop the userspace NBD client with this key.
    NbdDisconnect(String),
    /// Disconnect the kernel nbd device connected for this key.
    NbdKernelDisconnect(String),
    /// Stop the helper NBD server with this key.
    NbdStopServing(String),
    /// Unmap the kernel rbd mapping with this id.
    KrbdUnmap(u32),
    Unmount(PathBuf),
    RemoveDir(PathBuf),
    RemoveFile(PathBuf),
}

pub struct Executor {
    sys: Sys,
    /// The volume's secret values, for steps that name a key.
    secrets: Arc<Secrets>,
    /// Told (step index, step count, step kind) as each step starts.
    progress: Option<Progress>,
}

/// A step-progress listener (a long wipe's status).
pub type Progress = Arc<dyn Fn(usize, usize, &'static str) + Send + Sync>;

impl Executor {
    pub fn new(sys: Sys) -> Self {
        Executor { sys, secrets: Arc::default(), progress: None }
    }

    /// Steps that name a secret key use its value from `secrets`.
    pub fn with_secrets(mut self, secrets: Arc<Secrets>) -> Self {
        self.secrets = secrets;
        self
    }

    pub fn with_progress(mut self, progress: Progress) -> Self {
        self.progress = Some(progress);
        self
    }

    /// Run `plan` (already checked by the policy validator) step by step.
    pub fn run(&self, plan: &[Step]) -> Result<Outcome, ExecError> {
        let mut run = Run {
            sys: &self.sys,
            secrets: &self.secrets,
            outcome: Outcome::default(),
            undo: Vec::new(),
            fresh: BTreeMap::new(),
            freed: Vec::new(),
        };
        for (index, step) in plan.iter().enumerate() {
            if let Some(p) = &self.progress {
                p(index, plan.len(), step.kind().name());
            }
            if let Err(source) = run.step(step) {
                let rollback_failures = run.rollback();
                return Err(ExecError {
                    index,
                    step: step.kind().name(),
                    source,
                    rollback_failures,
                });
            }
            #[cfg(feature = "testing")]
            if let Some(hook) = &self.sys.step_hook {
                hook.after_step(index + 1);
            }
        }
        Ok(run.outcome)
    }
}

/// Filesystems whose mounts and unmounts wait on local disks only.
const LOCAL_FILESYSTEMS: [&str; 5] = ["ext4", "xfs", "btrfs", "ext3", "ext2"];

/// What `volume` holds, as [`runs_locally`] asks: its filesystem, or
/// None for a raw block volume.
pub fn holding(volume: &crate::model::Volume) -> Option<&str> {
    (volume.mode == crate::policy::VolumeMode::Filesystem).then_some(volume.fs_type.as_str())
}

/// Whether `plan`, for a volume holding the filesystem `holds` (None: a
/// raw block volume), waits on nothing but this node's own disks: loop
/// devices, local block devices and filesystems, bind mounts — never a
/// network peer (an NBD or RBD device, a network filesystem, a forced
/// unmount of a dead one). A filesystem volume that names no filesystem
/// (a gluster PV often does not) is not taken for a local one. Such plans
/// may keep their worker ([`crate::workers::on_worker`]); the tools a
/// format or a probe runs hand it over themselves.
pub fn runs_locally(holds: Option<&str>, plan: &[Step]) -> bool {
    let fs_local = |fs: &str| LOCAL_FILESYSTEMS.contains(&fs);
    let device_local = |b: &BlockSource| match b {
        BlockSource::Attached(_) => true,
        BlockSource::Device(path) => !["/dev/nbd", "/dev/rbd"].iter().any(|p| path.starts_with(p)),
    };
    holds.is_none_or(fs_local)
        && plan.iter().all(|step| match step {
            Step::AttachDevice(a) => matches!(a.spec, DeviceSpec::Loop(_)),
            Step::DetachDevice(d) => matches!(d.spec, DeviceSpec::Loop(_)),
            Step::Format(f) => device_local(&f.device),
            Step::Mount(m) => {
                matches!(&m.source, MountSource::Block(b) if device_local(b))
                    && fs_local(&m.fs_type)
            }
            Step::BindMount(_) => true,
            Step::PublishBlock(p) => device_local(&p.device),
            Step::Unmount(u) => !u.force,
            Step::GrowFilesystem(_)
            | Step::Wipe(_)
            | Step::ClearDirectory(_)
            | Step::BlocklistClient(_) => false,
        })
}

struct Run<'s> {
    sys: &'s Sys,
    secrets: &'s Secrets,
    outcome: Outcome,
    undo: Vec<Undo>,
    /// Loop devices this run attached, with their backing files (by path,
    /// and open as attached when the node gave it), until a step writes
    /// through them: until then they hold the file's bytes.
    fresh: BTreeMap<PathBuf, (PathBuf, Option<std::fs::File>)>,
    /// Devices of the filesystems this run unmounted.
    freed: Vec<(u32, u32)>,
}

fn refused(what: String) -> StepError {
    StepError::Refused(what)
}

impl Run<'_> {
    fn step(&mut self, step: &Step) -> Result<(), StepError> {
        match step {
            Step::AttachDevice(s) => self.attach_device(s),
            Step::Format(s) => self.format(s),
            Step::Mount(s) => self.mount(s),
            Step::BindMount(s) => self.bind_mount(s),
            Step::Unmount(s) => self.unmount(s),
            Step::PublishBlock(s) => self.publish_block(s),
            Step::GrowFilesystem(s) => self.grow_filesystem(s),
            Step::DetachDevice(s) => self.detach_device(s),
            Step::Wipe(s) => self.wipe(s),
            Step::ClearDirectory(s) => self.clear_directory(s),
            Step::BlocklistClient(s) => self.blocklist_client(s),
        }
    }

    /// Undo this run's effects, newest first; what could not be undone.
    fn rollback(&mut self) -> Vec<String> {
        let mut failures = Vec::new();
        while let Some(undo) = self.undo.pop() {
            let result = match &undo {
                Undo::Detach(device) => self.sys.devices.loop_detach(device),
                Undo::NbdDisconnect(key) => self.sys.fuse_clients.disconnect(key),
                Undo::NbdKernelDisconnect(key) => self.sys.kernel_nbd.disconnect(key),
                Undo::NbdStopServing(key) => self.sys.export_helpers.stop_serving(key),
                Undo::KrbdUnmap(id) => self.sys.krbd.unmap(*id, false),
                Undo::Unmount(target) => self.sys.mounts.unmount(target, false),
                Undo::RemoveDir(dir) => self.sys.mounts.remove_dir(dir),
                Undo::RemoveFile(file) => self.sys.mounts.remove_file(file),
            };
            if let Err(e) = result {
                tracing::error!("rollback: {e}");
                failures.push(e.to_string());
            }
        }
        failures
    }
}

/// NBD connections from the client to an RBD helper.
const RBD_CONNECTIONS: u8 = 2;

#[cfg(test)]
mod tests;
