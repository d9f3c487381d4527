//! Mounts a plan makes and undoes: a device or network filesystem, a bind,
//! a block device published as a file, and unmounting.

use super::*;

impl Run<'_> {
    pub(super) fn mount(&mut self, m: &crate::model::Mount) -> Result<(), StepError> {
        let target = Path::new(&m.target);
        let source = match &m.source {
            MountSource::Block(b) => {
                let device = self.device(b)?;
                let ours = self.undo.iter().any(|u| matches!(u, Undo::Detach(d) if *d == device));
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
        self.sys.mounts.mount(&source, target, &m.fs_type, &m.options.join(","), m.read_only)?;
        self.undo.push(Undo::Unmount(target.to_path_buf()));
        Ok(())
    }

    pub(super) fn bind_mount(&mut self, b: &crate::model::BindMount) -> Result<(), StepError> {
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

    pub(super) fn unmount(&mut self, u: &crate::model::Unmount) -> Result<(), StepError> {
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

    pub(super) fn publish_block(
        &mut self,
        p: &crate::model::PublishBlock,
    ) -> Result<(), StepError> {
        let (device, target) = (self.device(&p.device)?, Path::new(&p.target));
        if self.sys.is_mounted(target)? {
            let existing = self.sys.mounts.published_device(target)?;
            return if existing.is_some() && existing == self.sys.mounts.device_number(&device)? {
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

    pub(super) fn ensure_dir(&mut self, dir: &Path) -> Result<(), StepError> {
        if self.sys.mounts.ensure_dir(dir)? {
            self.undo.push(Undo::RemoveDir(dir.to_path_buf()));
        }
        Ok(())
    }

    /// One device per volume: a device this run did not attach may already
    /// be mounted, but only for the volume `target` is for (its staging dir
    /// and pod dirs all end in the volume's name). Mounting one filesystem
    /// for two volumes would hand one volume's data to the other's pods.
    pub(super) fn in_use_elsewhere(&self, device: &Path, target: &Path) -> Result<(), StepError> {
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
}
