//! Filesystems on a plan's devices: making one (never over another),
//! growing one, and wiping a device or clearing a dir for reuse.

use super::*;

impl Run<'_> {
    pub(super) fn format(&mut self, f: &crate::model::Format) -> Result<(), StepError> {
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

    pub(super) fn grow_filesystem(
        &mut self,
        g: &crate::model::GrowFilesystem,
    ) -> Result<(), StepError> {
        let target = Path::new(&g.target);
        let Some(mounted) = self.sys.mount_at(target)? else {
            return Err(refused(format!("{} is not mounted: nothing to grow", target.display())));
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

    pub(super) fn wipe(&mut self, w: &crate::model::Wipe) -> Result<(), StepError> {
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

    pub(super) fn clear_directory(
        &mut self,
        c: &crate::model::ClearDirectory,
    ) -> Result<(), StepError> {
        let removed = self.sys.filesystems.clear_dir(Path::new(&c.path))?;
        tracing::info!(dir = %c.path, removed, "cleared a released volume's dir");
        Ok(())
    }
}
