//! Which volumes pin the pod that serves their data: those served by a
//! process no successor can take over. The agent hands a FUSE client's
//! connection to the next one and starts its helpers again (a local file's
//! on the same open file, a librbd one with the arguments and keyring it
//! kept; a kernel nbd device is then reconnected to it), but rbd-fuse and
//! the GlusterFS client are other programs' FUSE daemons, and a librbd
//! helper an earlier release started left no arguments to start it again
//! with. Their pod (the node's mounter, or the agent without one) must not
//! be replaced while they are mounted: `volagent status` and an Event say
//! so.

use super::Sys;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

pub const RBD_FUSE: &str = "rbd-fuse";
pub const GLUSTERFS: &str = "glusterfs";
pub const LIBRBD_HELPER: &str = "librbd in the agent's NBD helper";

/// The node's pinning devices, looked up once.
#[derive(Debug, Default)]
pub struct Pins {
    by_device: BTreeMap<String, &'static str>,
}

impl Pins {
    /// Pins of these devices only (for tests).
    #[cfg(test)]
    pub(crate) fn of_devices(devices: &[(&str, &'static str)]) -> Pins {
        Pins { by_device: devices.iter().map(|(d, by)| (d.to_string(), *by)).collect() }
    }

    /// What pins a volume whose staging mount is of `fs_type` on `device`.
    pub fn of(&self, device: Option<&str>, fs_type: &str) -> Option<&'static str> {
        if fs_type == "fuse.glusterfs" {
            return Some(GLUSTERFS);
        }
        self.by_device.get(device?).copied()
    }
}

impl Sys {
    /// The devices whose data a pinning process serves: a kernel nbd
    /// device or a userspace client's loop device whose server is a librbd
    /// helper that would not be started again, and rbd-fuse's loop devices.
    pub fn pins(&self) -> Pins {
        let librbd: BTreeSet<String> = self
            .export_helpers
            .storage_clients()
            .into_iter()
            .map(|(key, ..)| key)
            .filter(|key| !self.export_helpers.restartable(key))
            .collect();
        let mut by_device = BTreeMap::new();
        for (key, device) in self.kernel_nbd.connections() {
            if let Some(device) = device.filter(|_| librbd.contains(&key)) {
                by_device.insert(device.display().to_string(), LIBRBD_HELPER);
            }
        }
        // A client's file is <base>/<key>/<key> (ours) or <base>/<key>/<image> (rbd-fuse's).
        let ours = self.fuse_clients.file("k");
        let Some(base) = ours.parent().and_then(Path::parent) else { return Pins { by_device } };
        let loops = self.devices.loop_devices().unwrap_or_else(|e| {
            tracing::warn!("which volumes pin their pod is not known: {e}");
            Vec::new()
        });
        // A device an earlier agent attached names its file "/<name>": its
        // client's dir is then found by the FUSE mount the file is on.
        let fuse = self
            .mounts
            .mount_table()
            .map(|t| super::mountinfo::fuse_mounts_by_device(&t))
            .unwrap_or_default();
        for l in loops {
            let file = &l.backing_file;
            let Some(dir) =
                l.fuse_mount(&fuse).or(file.parent()).filter(|d| d.parent() == Some(base))
            else {
                continue;
            };
            let Some(key) = dir.file_name().and_then(|k| k.to_str()) else { continue };
            let pin = if file.file_name().and_then(|n| n.to_str()) != Some(key) {
                Some(RBD_FUSE)
            } else {
                librbd.contains(key).then_some(LIBRBD_HELPER)
            };
            if let Some(pin) = pin {
                by_device.insert(l.device.display().to_string(), pin);
            }
        }
        Pins { by_device }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_glusterfs_mount_pins_whatever_its_device_and_unknown_devices_pin_nothing() {
        let mut pins = Pins::default();
        pins.by_device.insert("/dev/loop3".into(), RBD_FUSE);
        assert_eq!(pins.of(None, "fuse.glusterfs"), Some(GLUSTERFS));
        assert_eq!(pins.of(Some("/dev/loop3"), "ext4"), Some(RBD_FUSE));
        assert_eq!(pins.of(Some("/dev/loop4"), "ext4"), None);
        assert_eq!(pins.of(None, "ext4"), None);
    }
}
