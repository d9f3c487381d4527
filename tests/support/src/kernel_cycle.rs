//! The kernel's own work for a mount cycle, as bare syscalls: the
//! reference the agent's overhead is measured against.

use nix::mount::{MntFlags, MsFlags};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The kernel's own work for the cycle, as bare syscalls on plain paths.
pub struct Kernel {
    image: PathBuf,
    staging: PathBuf,
    pod: PathBuf,
    /// Whose the pod's dir is: kubelet's (made before the cycle, as for a
    /// Flexvolume mount), or the driver's, which makes it at the publish
    /// and removes it at the unpublish (CSI: "creation of target_path is
    /// the responsibility of the SP", and it "MUST delete" it again).
    makes_pod_dir: bool,
}

impl Kernel {
    pub fn new(scratch: &crate::scratch::RootScratch, image: &Path) -> Kernel {
        let (staging, pod) = (scratch.path("kernel/staging"), scratch.path("kernel/pod"));
        std::fs::create_dir_all(&staging).expect("dir");
        std::fs::create_dir_all(&pod).expect("dir");
        Kernel { image: image.to_path_buf(), staging, pod, makes_pod_dir: false }
    }

    /// The cycle of a CSI driver: the pod's dir is made and removed in it.
    #[allow(dead_code)] // not in mount_cycle: kubelet makes a Flexvolume's dir
    pub fn csi(scratch: &crate::scratch::RootScratch, image: &Path) -> Kernel {
        let kernel = Kernel { makes_pod_dir: true, ..Kernel::new(scratch, image) };
        std::fs::remove_dir(&kernel.pod).expect("the pod's dir is the cycle's");
        kernel
    }

    pub fn cycle(&mut self, up: &mut Vec<Duration>, down: &mut Vec<Duration>) {
        let t = Instant::now();
        if self.makes_pod_dir {
            std::fs::create_dir(&self.pod).expect("make the pod's dir");
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.image)
            .expect("open image");
        let dev = volagent::sys::loopdev::attach(file.as_fd(), &self.image, false, "bench")
            .expect("attach");
        drop(file);
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        nix::mount::mount(Some(&dev), &self.staging, Some("ext4"), flags, None::<&str>)
            .expect("mount");
        nix::mount::mount(
            Some(&self.staging),
            &self.pod,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind");
        up.push(t.elapsed());
        let t = Instant::now();
        nix::mount::umount2(&self.pod, MntFlags::empty()).expect("unmount pod");
        nix::mount::umount2(&self.staging, MntFlags::empty()).expect("unmount staging");
        volagent::sys::loopdev::detach(&dev).expect("detach");
        if self.makes_pod_dir {
            std::fs::remove_dir(&self.pod).expect("remove the pod's dir");
        }
        down.push(t.elapsed());
    }
}
