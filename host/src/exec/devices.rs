//! Block devices a plan attaches and detaches: loop devices over files, NBD
//! exports through the node's NBD client, and finding the device a later
//! step names.

use super::*;

impl Run<'_> {
    pub(super) fn attach_device(
        &mut self,
        a: &crate::model::AttachDevice,
    ) -> Result<(), StepError> {
        let device = self.attach(&a.spec, a.read_only)?;
        self.outcome.devices.insert(a.id.clone(), device);
        Ok(())
    }

    pub(super) fn detach_device(
        &mut self,
        d: &crate::model::DetachDevice,
    ) -> Result<(), StepError> {
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

    /// Attach, or find the device already attached for `spec` (the same
    /// file, by identity).
    pub(super) fn attach(
        &mut self,
        spec: &DeviceSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
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
    pub(super) fn attach_nbd(
        &mut self,
        spec: &NbdSpec,
        read_only: bool,
    ) -> Result<PathBuf, StepError> {
        let key = nbd_key(spec);
        if let Some(device) = self.export_device(&key)? {
            return Ok(device);
        }
        let kernel = match spec.attach {
            NbdAttach::Auto => self.sys.kernel_nbd.available(),
            NbdAttach::Userspace => false,
            NbdAttach::Kernel if self.sys.kernel_nbd.available() => true,
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
                if self.sys.export_helpers.serve(&key, file, read_only)? {
                    self.undo.push(Undo::NbdStopServing(key.clone()));
                }
                (self.sys.export_helpers.server_address(&key), String::new())
            }
            None => (spec.server.clone(), spec.export_name.clone()),
        };
        self.connect_export(key, &server, &export, spec.connections, kernel, read_only)
    }

    /// The loop devices over a userspace client's `file`.
    pub(super) fn loops_over(&self, file: &Path) -> Result<Vec<PathBuf>, StepError> {
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
    pub(super) fn attached(&self, spec: &DeviceSpec) -> Result<Vec<PathBuf>, StepError> {
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
            .loops_over(id, &self.freed)?
            .into_iter()
            .filter(|l| (id.is_some() && l.backing == id) || l.tag == tag)
            .map(|l| l.device)
            .collect())
    }

    /// The device a step names, as its node under /dev.
    pub(super) fn device(&self, source: &BlockSource) -> Result<PathBuf, StepError> {
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

    /// The device already there for export `key`, whichever path made it.
    pub(super) fn export_device(&self, key: &str) -> Result<Option<PathBuf>, StepError> {
        if let Some(device) = self.sys.kernel_nbd.device(key) {
            return Ok(Some(device));
        }
        // Only a running client's device, over its file where it is now:
        // one left over the file of a client that ended (its mount
        // detached, or failing ENOTCONN) would fail every request.
        if !self.sys.fuse_clients.running(key)? {
            return Ok(None);
        }
        self.loop_over_client(key)
    }

    /// The loop device over client `key`'s file on its mount as it is now:
    /// by the file's path, or by the mount's device when an earlier agent
    /// attached it (the kernel then names the file "/<key>" only).
    fn loop_over_client(&self, key: &str) -> Result<Option<PathBuf>, StepError> {
        let file = self.sys.fuse_clients.file(key);
        let fuse = crate::sys::mountinfo::fuse_mounts_by_device(&self.sys.mounts.mount_table()?);
        Ok(self
            .sys
            .devices
            .loop_devices()?
            .into_iter()
            .find(|l| {
                l.backing_file == file
                    || (file.parent().is_some() && l.fuse_mount(&fuse) == file.parent())
            })
            .map(|l| l.device))
    }

    /// Connect `server`'s `export` as export `key`'s device: a kernel nbd
    /// device, or a userspace client's file on a loop device.
    pub(super) fn connect_export(
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
                self.sys.kernel_nbd.connect(&key, server, export, connections, read_only)?;
            if connected {
                self.undo.push(Undo::NbdKernelDisconnect(key));
            }
            return Ok(device);
        }
        if self.sys.fuse_clients.connect(&key, server, export, connections, read_only)? {
            self.undo.push(Undo::NbdDisconnect(key.clone()));
        } else if let Some(device) = self.loop_over_client(&key)? {
            // Running already, or just started again on its connection: the
            // loop device over its file is the export's; a second one would
            // let two filesystems write the same blocks.
            return Ok(device);
        }
        let device = self.sys.devices.loop_attach(&self.sys.fuse_clients.file(&key), read_only)?;
        self.undo.push(Undo::Detach(device.clone()));
        Ok(device)
    }

    /// Undo what attaching export `key` did, whichever path it took; the
    /// helper server (a local file's or an RBD image's) goes last.
    pub(super) fn detach_export(&mut self, key: &str) -> Result<(), StepError> {
        for device in self.loops_over(&self.sys.fuse_clients.file(key))? {
            self.sys.devices.loop_detach(&device)?;
        }
        self.sys.fuse_clients.disconnect(key)?;
        self.sys.kernel_nbd.disconnect(key)?;
        Ok(self.sys.export_helpers.stop_serving(key)?)
    }
}

pub(super) fn unsupported(spec: &DeviceSpec) -> StepError {
    refused(format!("{} devices cannot be attached by this agent yet", spec.kind().name()))
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
