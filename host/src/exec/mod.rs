//! Running a checked plan on the node through `sys`: every step idempotent
//! (already attached or mounted is success), and a failing step rolls back
//! what the steps before it did.

use crate::policy::{
    BlockSource, DeviceSpec, FormatMode, MountSource, NbdAttach, NbdSpec, RbdAttach, RbdSpec, Step,
    WipeMethod,
};
use crate::secret::Secrets;
use crate::sys::rbd_export::{CephClient, RbdTarget};
use crate::sys::{LoopAttach, Sys, SysError, Wipe};
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
pub fn holding(volume: &crate::policy::Volume) -> Option<&str> {
    (volume.mode == crate::policy::VolumeMode::Filesystem).then_some(volume.fs_type.as_str())
}

/// Whether `plan`, for a volume holding the filesystem `holds` (None: a
/// raw block volume), waits on nothing but this node's own disks: loop
/// devices, local block devices and filesystems, bind mounts — never a
/// network peer (an NBD or RBD device, a network filesystem, a forced
/// unmount of a dead one). A filesystem volume that names no filesystem
/// (a gluster PV often does not) is not taken for a local one. Such plans
/// may keep their worker ([`crate::runtime::on_worker`]); the tools a
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
            Step::AttachDevice(a) => {
                let device = self.attach(&a.spec, a.read_only)?;
                self.outcome.devices.insert(a.id.clone(), device);
                Ok(())
            }
            Step::Format(f) => {
                let device = self.device(&f.device)?;
                let found = match self.fresh.get(&device) {
                    Some((file, backing)) => {
                        self.sys.filesystems.probe_attached(&device, file, backing.as_ref())?
                    }
                    None => self.sys.filesystems.probe(&device)?,
                };
                match (found, f.mode) {
                    (None, _) | (Some(_), FormatMode::Always) => {
                        self.fresh.remove(&device);
                        Ok(self.sys.filesystems.mkfs(&device, &f.fs_type)?)
                    }
                    (Some(found), FormatMode::IfUnformatted) if found == f.fs_type => Ok(()),
                    (Some(found), FormatMode::IfUnformatted) => Err(refused(format!(
                        "{} already holds {found}, but the volume asks for {}; refusing to format over it",
                        device.display(),
                        f.fs_type
                    ))),
                }
            }
            Step::Mount(m) => {
                let target = Path::new(&m.target);
                let source = match &m.source {
                    MountSource::Block(b) => {
                        let device = self.device(b)?;
                        let ours =
                            self.undo.iter().any(|u| matches!(u, Undo::Detach(d) if *d == device));
                        if !ours {
                            self.in_use_elsewhere(&device, target)?;
                        }
                        device.display().to_string()
                    }
                    MountSource::Network(s) => s.clone(),
                };
                if let Some(existing) = self.sys.mount_at(target)? {
                    return if existing.source == source {
                        Ok(())
                    } else {
                        Err(refused(format!(
                            "{} is already mounted from {}",
                            target.display(),
                            existing.source
                        )))
                    };
                }
                self.ensure_dir(target)?;
                self.sys.mounts.mount(
                    &source,
                    target,
                    &m.fs_type,
                    &m.options.join(","),
                    m.read_only,
                )?;
                self.undo.push(Undo::Unmount(target.to_path_buf()));
                Ok(())
            }
            Step::BindMount(b) => {
                let (source, target) = (Path::new(&b.source), Path::new(&b.target));
                // A dir bound onto itself that this run has just mounted
                // (a CSI stage: the staging dir is the "pod" dir).
                if source == target
                    && self.undo.iter().any(|u| matches!(u, Undo::Unmount(t) if t == target))
                {
                    return Ok(());
                }
                if self.sys.is_mounted(target)? {
                    // kubelet retries a mount it did not see finish.
                    return Ok(());
                }
                self.ensure_dir(target)?;
                self.sys.mounts.bind(source, target, b.read_only)?;
                self.undo.push(Undo::Unmount(target.to_path_buf()));
                Ok(())
            }
            Step::Unmount(u) => {
                let target = Path::new(&u.target);
                if self.sys.is_mounted(target)? {
                    if let Some(device) = self.sys.mounts.device_of_mount(target)? {
                        self.freed.push(device);
                    }
                    self.sys.mounts.unmount(target, u.force)?;
                }
                // An empty mount point is ours to tidy (kubelet copes with its
                // pod dir being gone); one still mounted over refuses (EBUSY).
                // A block publication's mount point is an empty file.
                let removed = match self.sys.mounts.remove_dir(target) {
                    Err(SysError::Errno { errno: nix::errno::Errno::ENOTDIR, .. }) => {
                        self.sys.mounts.remove_file(target)
                    }
                    other => other,
                };
                if let Err(e) = removed {
                    tracing::debug!(path = %target.display(), "left in place: {e}");
                }
                Ok(())
            }
            Step::PublishBlock(p) => {
                let (device, target) = (self.device(&p.device)?, Path::new(&p.target));
                if self.sys.is_mounted(target)? {
                    let existing = self.sys.mounts.published_device(target)?;
                    return if existing.is_some()
                        && existing == self.sys.mounts.device_number(&device)?
                    {
                        Ok(())
                    } else {
                        Err(refused(format!(
                            "{} is already mounted, and not from {}",
                            target.display(),
                            device.display()
                        )))
                    };
                }
                if let Some(dir) = target.parent() {
                    self.ensure_dir(dir)?;
                }
                if self.sys.mounts.ensure_file(target)? {
                    self.undo.push(Undo::RemoveFile(target.to_path_buf()));
                }
                self.sys.mounts.bind_device(&device, target, p.read_only)?;
                self.undo.push(Undo::Unmount(target.to_path_buf()));
                Ok(())
            }
            Step::GrowFilesystem(g) => {
                let target = Path::new(&g.target);
                let Some(mounted) = self.sys.mount_at(target)? else {
                    return Err(refused(format!(
                        "{} is not mounted: nothing to grow",
                        target.display()
                    )));
                };
                if !mounted.source.starts_with("/dev/") {
                    return Err(refused(format!(
                        "{} is {} from {}, not a filesystem on a block device",
                        target.display(),
                        mounted.fs_type,
                        mounted.source
                    )));
                }
                let size = self.sys.filesystems.grow_filesystem(
                    Path::new(&mounted.source),
                    target,
                    &mounted.fs_type,
                )?;
                self.outcome.grown.insert(g.target.clone(), size);
                Ok(())
            }
            Step::DetachDevice(d) => {
                match &d.spec {
                    DeviceSpec::Nbd(nbd) => return self.detach_export(&nbd_key(nbd)),
                    DeviceSpec::Rbd(rbd) => return self.detach_rbd(rbd, d.force),
                    DeviceSpec::Loop(_) => {}
                }
                for device in self.attached(&d.spec)? {
                    self.sys.devices.loop_detach(&device)?;
                }
                Ok(())
            }
            Step::Wipe(w) => {
                let device = self.device(&w.device)?;
                self.fresh.remove(&device);
                let method = match w.method {
                    WipeMethod::Signatures => Wipe::Signatures,
                    WipeMethod::Discard => Wipe::Discard,
                    WipeMethod::Zero => Wipe::Zero,
                    WipeMethod::Shred(n) => Wipe::Shred(n),
                };
                Ok(self.sys.filesystems.wipe(&device, method)?)
            }
            Step::ClearDirectory(c) => {
                let removed = self.sys.filesystems.clear_dir(Path::new(&c.path))?;
                tracing::info!(dir = %c.path, removed, "cleared a released volume's dir");
                Ok(())
            }
            Step::BlocklistClient(b) => {
                let client = self.ceph_client(&b.monitors, &b.user, b.secret_key.as_deref())?;
                tracing::warn!(address = %b.address, monitors = %b.monitors.join(","), "blocklisting a storage client");
                Ok(self.sys.storage.blocklist(&client, &b.address)?)
            }
        }
    }

    fn ensure_dir(&mut self, dir: &Path) -> Result<(), StepError> {
        if self.sys.mounts.ensure_dir(dir)? {
            self.undo.push(Undo::RemoveDir(dir.to_path_buf()));
        }
        Ok(())
    }

    /// Attach, or find the device already attached for `spec` (the same
    /// file, by identity).
    fn attach(&mut self, spec: &DeviceSpec, read_only: bool) -> Result<PathBuf, StepError> {
        let file = match spec {
            DeviceSpec::Nbd(nbd) => return self.attach_nbd(nbd, read_only),
            DeviceSpec::Rbd(rbd) => return self.attach_rbd(rbd, read_only),
            DeviceSpec::Loop(file) => file,
        };
        let file = Path::new(file);
        let (device, backing) = match self.sys.devices.loop_attach_or_reuse(file, read_only)? {
            LoopAttach::Reused(device) => return Ok(device),
            LoopAttach::Attached { device, backing } => (device, backing),
        };
        self.undo.push(Undo::Detach(device.clone()));
        self.fresh.insert(device.clone(), (file.to_path_buf(), backing));
        Ok(device)
    }

    /// An NBD export as a block device: the kernel's nbd device, or a
    /// userspace client exposing it as a file on a loop device (or the
    /// device already there for it, whichever path made it).
    fn attach_nbd(&mut self, spec: &NbdSpec, read_only: bool) -> Result<PathBuf, StepError> {
        let key = nbd_key(spec);
        if let Some(device) = self.export_device(&key)? {
            return Ok(device);
        }
        let kernel = match spec.attach {
            NbdAttach::Auto => self.sys.nbd.kernel_driver(),
            NbdAttach::Userspace => false,
            NbdAttach::Kernel if self.sys.nbd.kernel_driver() => true,
            NbdAttach::Kernel => {
                return Err(refused(format!(
                    "nbd export {:?} at {}: the volume asks for the kernel's nbd driver, which this node does not have \
                     (no nbd module loaded); use attach: userspace (or auto)",
                    spec.export_name, spec.server
                )));
            }
        };
        let (server, export) = match &spec.local_file {
            Some(local) => {
                let file = self.sys.devices.open_file(Path::new(local), !read_only)?;
                if self.sys.nbd.serve(&key, file, read_only)? {
                    self.undo.push(Undo::NbdStopServing(key.clone()));
                }
                (self.sys.nbd.server_address(&key), String::new())
            }
            None => (spec.server.clone(), spec.export_name.clone()),
        };
        self.connect_export(key, &server, &export, spec.connections, kernel, read_only)
    }

    /// An RBD image as a block device, by the path the volume's plan asks
    /// for (or, for `auto`, the first the node has): the kernel's rbd
    /// driver; the agent's helper NBD server in front of librbd, reached
    /// through the kernel's nbd device or a userspace client on a loop
    /// device; rbd-fuse's file of the image on a loop device. A device
    /// already there for the image, whichever path made it, is reused.
    fn attach_rbd(&mut self, spec: &RbdSpec, read_only: bool) -> Result<PathBuf, StepError> {
        let key = rbd_key(spec);
        let device = match self.rbd_device(spec, &key)? {
            Some(device) => device,
            None => match self.rbd_path(spec)? {
                RbdAttach::Kernel => self.attach_krbd(spec, read_only)?,
                RbdAttach::Fuse => self.attach_rbd_fuse(&key, spec, read_only)?,
                _ => self.attach_rbd_export(&key, spec, read_only)?,
            },
        };
        // Who the node is to the cluster, for the ledger: other nodes'
        // agents place the image's watchers by it.
        let mut clients: Vec<(u64, String)> =
            self.krbd_mappings(spec)?.into_iter().map(|m| (m.client_id, m.client_addr)).collect();
        clients.extend(
            self.sys
                .nbd
                .storage_clients()
                .into_iter()
                .filter(|(k, _, _)| *k == key)
                .map(|(_, id, address)| (id, address)),
        );
        self.outcome.storage_clients.extend(clients);
        Ok(device)
    }

    /// Which path maps `spec` on this node.
    fn rbd_path(&self, spec: &RbdSpec) -> Result<RbdAttach, StepError> {
        let image = format!("rbd image {}/{}", spec.pool, spec.image);
        let (kernel, helper, fuse) = (
            || self.sys.krbd.available(),
            || self.sys.nbd.rbd_helper_available(),
            || self.sys.nbd.rbd_fuse_available(),
        );
        let missing = |what: &str, option: &str| {
            refused(format!(
                "{image}: the volume asks for {what}, which this node does not have; use attach: {option}"
            ))
        };
        match spec.attach {
            RbdAttach::Auto if kernel() => Ok(RbdAttach::Kernel),
            RbdAttach::Auto if helper() => Ok(RbdAttach::Nbd),
            RbdAttach::Auto if fuse() => Ok(RbdAttach::Fuse),
            RbdAttach::Auto => Err(refused(format!(
                "{image}: this node has no way to map it: no kernel rbd driver, no librbd with an NBD client (nbd.ko or nbdfuse), no rbd-fuse"
            ))),
            RbdAttach::Kernel if !kernel() => {
                Err(missing("the kernel's rbd driver (no rbd module)", "nbd, fuse or auto"))
            }
            RbdAttach::Nbd if !helper() => Err(missing(
                "the agent's NBD server on librbd (librbd, and nbd.ko or nbdfuse)",
                "kernel, fuse or auto",
            )),
            RbdAttach::Fuse if !fuse() => {
                Err(missing("rbd-fuse (not installed)", "kernel, nbd or auto"))
            }
            chosen => Ok(chosen),
        }
    }

    /// The device already there for `spec` (key `key`), whichever path made it.
    fn rbd_device(&self, spec: &RbdSpec, key: &str) -> Result<Option<PathBuf>, StepError> {
        if let Some(m) = self.krbd_mappings(spec)?.into_iter().next() {
            return Ok(Some(m.device));
        }
        if let Some(device) = self.export_device(key)? {
            return Ok(Some(device));
        }
        Ok(self.loops_over(&self.sys.nbd.rbd_fuse_file(key, &spec.image))?.into_iter().next())
    }

    /// The agent's kernel mappings of `spec`'s image (none where the kernel
    /// has no rbd driver): one an admin made by hand is never reused or
    /// unmapped.
    fn krbd_mappings(
        &self,
        spec: &RbdSpec,
    ) -> Result<Vec<crate::sys::krbd::KernelMapping>, StepError> {
        if !self.sys.krbd.available() {
            return Ok(Vec::new());
        }
        // Monitors that do not resolve now name no mapping that could be found.
        let Ok(monitors) = crate::sys::krbd::kernel_monitors(&spec.monitors.join(",")) else {
            return Ok(Vec::new());
        };
        Ok(self
            .sys
            .krbd
            .mappings_of(&monitors, &spec.pool, &spec.image)?
            .into_iter()
            .filter(|m| m.ours)
            .collect())
    }

    fn attach_krbd(&mut self, spec: &RbdSpec, read_only: bool) -> Result<PathBuf, StepError> {
        let mut client =
            self.ceph_client(&spec.monitors, &spec.user, spec.secret_key.as_deref())?;
        let monitors = crate::sys::krbd::kernel_monitors(&spec.monitors.join(","))
            .map_err(|e| refused(format!("rbd image {}/{}: {e}", spec.pool, spec.image)))?;
        client.monitors = Some(monitors);
        let (mapping, mapped) = self.sys.krbd.map(&client, &spec.pool, &spec.image, read_only)?;
        if mapped {
            self.undo.push(Undo::KrbdUnmap(mapping.id));
        }
        Ok(mapping.device)
    }

    /// rbd-fuse's file of the image on a loop device. rbd-fuse says
    /// nothing of its Ceph client; the watcher that appears when the loop
    /// device opens the image is it.
    fn attach_rbd_fuse(
        &mut self,
        key: &str,
        spec: &RbdSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        let target = RbdTarget {
            client: self.ceph_client(&spec.monitors, &spec.user, spec.secret_key.as_deref())?,
            pool: spec.pool.clone(),
            image: spec.image.clone(),
        };
        // Best effort: without the lists the client stays unknown (other
        // nodes then deny exclusive mounts of the image: fail closed).
        let watchers = |run: &Self| match run.sys.storage.rbd_watchers(
            &target.client,
            &spec.pool,
            &spec.image,
        ) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(
                    "cannot list the watchers of rbd image {}/{}: {e}",
                    spec.pool,
                    spec.image
                );
                None
            }
        };
        let before = watchers(self);
        if self.sys.nbd.connect_rbd_fuse(key, &target, read_only)? {
            self.undo.push(Undo::NbdDisconnect(key.to_string()));
        }
        let device = self
            .sys
            .devices
            .loop_attach(&self.sys.nbd.rbd_fuse_file(key, &spec.image), read_only)?;
        self.undo.push(Undo::Detach(device.clone()));
        let new: Vec<_> = match (before, watchers(self)) {
            (Some(before), Some(after)) => {
                after.into_iter().filter(|w| !before.iter().any(|b| b.id == w.id)).collect()
            }
            _ => Vec::new(),
        };
        match new.as_slice() {
            [w] => self.sys.nbd.set_storage_client(
                key,
                u64::try_from(w.id).unwrap_or_default(),
                &w.address,
            )?,
            other => tracing::warn!(
                image = %format!("{}/{}", spec.pool, spec.image),
                "rbd-fuse's Ceph client is not known ({} new watchers): other nodes cannot place it and deny exclusive mounts meanwhile",
                other.len()
            ),
        }
        Ok(device)
    }

    fn attach_rbd_export(
        &mut self,
        key: &str,
        spec: &RbdSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        let key = key.to_string();
        let target = RbdTarget {
            client: self.ceph_client(&spec.monitors, &spec.user, spec.secret_key.as_deref())?,
            pool: spec.pool.clone(),
            image: spec.image.clone(),
        };
        if self.sys.nbd.serve_rbd(&key, &target, read_only)? {
            self.undo.push(Undo::NbdStopServing(key.clone()));
        }
        let (server, kernel) = (self.sys.nbd.server_address(&key), self.sys.nbd.kernel_driver());
        // A second connection keeps requests in flight while librbd
        // completes others.
        self.connect_export(key, &server, "", RBD_CONNECTIONS, kernel, read_only)
    }

    /// How to reach a Ceph cluster as `user`, with the key the volume's
    /// secret holds under `secret_key` (none: the node's own keyring).
    fn ceph_client(
        &self,
        monitors: &[String],
        user: &str,
        secret_key: Option<&str>,
    ) -> Result<CephClient, StepError> {
        let key = match secret_key {
            Some(name) => Some(self.secrets.get(name).cloned().ok_or_else(|| {
                refused(format!(
                    "the volume's secret has no value for key {name:?} (kubelet passes a secret's values only on mount)"
                ))
            })?),
            None => None,
        };
        if let Some(secret) = &key {
            secret.ceph_key(secret_key.unwrap_or_default()).map_err(refused)?;
        }
        Ok(CephClient {
            conf: None,
            monitors: Some(monitors.join(",")),
            user: user.to_string(),
            keyring: None,
            key,
        })
    }

    /// The device already there for export `key`, whichever path made it.
    fn export_device(&self, key: &str) -> Result<Option<PathBuf>, StepError> {
        if let Some(device) = self.sys.nbd.kernel_device(key) {
            return Ok(Some(device));
        }
        Ok(self.loops_over(&self.sys.nbd.file(key))?.into_iter().next())
    }

    /// Connect `server`'s `export` as export `key`'s device: a kernel nbd
    /// device, or a userspace client's file on a loop device.
    fn connect_export(
        &mut self,
        key: String,
        server: &str,
        export: &str,
        connections: u8,
        kernel: bool,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        if kernel {
            let (device, connected) =
                self.sys.nbd.kernel_connect(&key, server, export, connections, read_only)?;
            if connected {
                self.undo.push(Undo::NbdKernelDisconnect(key));
            }
            return Ok(device);
        }
        let uri = crate::sys::nbd_client::uri(server, export);
        if self.sys.nbd.connect(&key, &uri, connections, read_only)? {
            self.undo.push(Undo::NbdDisconnect(key.clone()));
        }
        let device = self.sys.devices.loop_attach(&self.sys.nbd.file(&key), read_only)?;
        self.undo.push(Undo::Detach(device.clone()));
        Ok(device)
    }

    /// Undo what attaching `spec` did, whichever path it took.
    fn detach_rbd(&mut self, spec: &RbdSpec, force: bool) -> Result<(), StepError> {
        for m in self.krbd_mappings(spec)? {
            self.sys.krbd.unmap(m.id, force)?;
        }
        let key = rbd_key(spec);
        for device in self.loops_over(&self.sys.nbd.rbd_fuse_file(&key, &spec.image))? {
            self.sys.devices.loop_detach(&device)?;
        }
        self.detach_export(&key)
    }

    /// Undo what attaching export `key` did, whichever path it took; the
    /// helper server (a local file's or an RBD image's) goes last.
    fn detach_export(&mut self, key: &str) -> Result<(), StepError> {
        for device in self.loops_over(&self.sys.nbd.file(key))? {
            self.sys.devices.loop_detach(&device)?;
        }
        self.sys.nbd.disconnect(key)?;
        self.sys.nbd.kernel_disconnect(key)?;
        Ok(self.sys.nbd.stop_serving(key)?)
    }

    /// The loop devices over a userspace client's `file`.
    fn loops_over(&self, file: &Path) -> Result<Vec<PathBuf>, StepError> {
        let tag = self.sys.devices.loop_tag();
        Ok(self
            .sys
            .devices
            .loop_devices()?
            .into_iter()
            .filter(|l| l.is_over_client_file(file, tag))
            .map(|l| l.device)
            .collect())
    }

    /// The devices attached for `spec` (none is fine: already detached):
    /// those over its file, and this agent's loop devices whose filesystem
    /// this plan unmounted (the volume's own, even when its file can no
    /// longer be reached by its path: replaced, removed, a symlink now).
    fn attached(&self, spec: &DeviceSpec) -> Result<Vec<PathBuf>, StepError> {
        let DeviceSpec::Loop(file) = spec else { return Err(unsupported(spec)) };
        let id = match self.sys.devices.file_id(Path::new(file)) {
            Ok(id) => id,
            Err(e @ SysError::Refused { .. }) => {
                tracing::warn!(file, "its loop devices are not looked up by this path: {e}");
                None
            }
            Err(e) => return Err(e.into()),
        };
        if id.is_none() && self.freed.is_empty() {
            return Ok(Vec::new());
        }
        let tag = self.sys.devices.loop_tag();
        Ok(self
            .sys
            .devices
            .loop_statuses()?
            .into_iter()
            .filter(|l| {
                (id.is_some() && l.backing == id)
                    || (l.tag == tag && self.freed.contains(&l.number))
            })
            .map(|l| l.device)
            .collect())
    }

    /// The device a step names, as its node under /dev.
    fn device(&self, source: &BlockSource) -> Result<PathBuf, StepError> {
        match source {
            BlockSource::Attached(id) => self
                .outcome
                .devices
                .get(id)
                .cloned()
                .ok_or_else(|| refused(format!("device {id:?} was not attached by this plan"))),
            BlockSource::Device(path) => Ok(self.sys.devices.block_device(Path::new(path))?),
        }
    }

    /// One device per volume: a device this run did not attach may already
    /// be mounted, but only for the volume `target` is for (its staging dir
    /// and pod dirs all end in the volume's name). Mounting one filesystem
    /// for two volumes would hand one volume's data to the other's pods.
    fn in_use_elsewhere(&self, device: &Path, target: &Path) -> Result<(), StepError> {
        let source = device.display().to_string();
        let table = self.sys.mounts.mount_table()?;
        match table
            .iter()
            .find(|m| m.source == source && m.mount_point.file_name() != target.file_name())
        {
            Some(other) => Err(refused(format!(
                "{} is already mounted at {}, which is not this volume's; one device serves one volume",
                device.display(),
                other.mount_point.display()
            ))),
            None => Ok(()),
        }
    }

    /// Undo this run's effects, newest first; what could not be undone.
    fn rollback(&mut self) -> Vec<String> {
        let mut failures = Vec::new();
        while let Some(undo) = self.undo.pop() {
            let result = match &undo {
                Undo::Detach(device) => self.sys.devices.loop_detach(device),
                Undo::NbdDisconnect(key) => self.sys.nbd.disconnect(key),
                Undo::NbdKernelDisconnect(key) => self.sys.nbd.kernel_disconnect(key),
                Undo::NbdStopServing(key) => self.sys.nbd.stop_serving(key),
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

/// The name of the userspace client of an export (and of the helper
/// server of a local file): one per export on a node, whatever volume
/// names it.
pub fn nbd_key(spec: &NbdSpec) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(spec.server.as_bytes());
    h.update([0]);
    h.update(spec.export_name.as_bytes());
    if let Some(file) = &spec.local_file {
        h.update([0]);
        h.update(file.as_bytes());
    }
    format!("export-{}", hex::encode(&h.finalize()[..12]))
}

/// NBD connections from the client to an RBD helper.
const RBD_CONNECTIONS: u8 = 2;

/// The name of an RBD image's helper server and client on this node: one
/// per image of a cluster, whatever volume names it.
pub fn rbd_key(spec: &RbdSpec) -> String {
    use sha2::Digest;
    let mut monitors = spec.monitors.clone();
    monitors.sort();
    let mut h = sha2::Sha256::new();
    h.update(b"rbd\0");
    h.update(monitors.join(",").as_bytes());
    h.update([0]);
    h.update(spec.pool.as_bytes());
    h.update([0]);
    h.update(spec.image.as_bytes());
    format!("export-{}", hex::encode(&h.finalize()[..12]))
}

fn unsupported(spec: &DeviceSpec) -> StepError {
    refused(format!("{} devices cannot be attached by this agent yet", spec.kind().name()))
}

#[cfg(test)]
mod tests;
