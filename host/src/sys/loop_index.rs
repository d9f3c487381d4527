//! The node's loop devices by backing file, kept without looking at every
//! device on every attach and detach (a node with hundreds of volumes has
//! hundreds of devices, and each look opens one and reads its status).
//!
//! Seeded by one full look, and kept by the kernel's uevents: the kernel
//! queues an event on every listening socket before the ioctl that binds
//! or clears a device returns, and a clear's event before the device can
//! be bound again. So draining the socket before a lookup hears of every
//! change made before the lookup started: the devices it names are read
//! again (one status each), the others are as last read. There is no
//! window in which a device bound before the lookup is missed, as there
//! would be with a cache kept up by a thread reading the events later.
//!
//! Trusted only once it has proven that it hears: the agent's own first
//! attach must show up on the socket (a network namespace that gets no
//! uevents would otherwise leave the index silently stale). Until then,
//! and after the socket overflowed, every lookup looks at every device,
//! as before. A hit is always read again from its device before use.
#![allow(unsafe_code)]

use super::loopdev::{self, Numbers};
use super::{FileId, LoopStatus, SysError};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The kernel's socket buffer for the events: an idle agent's queue
/// fills with every block device event on the node until its next
/// lookup; past this it overflows, and the next lookup looks at all.
const EVENT_BUFFER: usize = 1 << 20;

/// Own attaches unheard before that is said (once).
const UNHEARD: u32 = 3;
/// Devices remembered as heard of while unproven, at most (then the
/// set starts again).
const HEARD: usize = 4096;

#[derive(Default)]
pub struct LoopIndex {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for LoopIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopIndex").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Inner {
    /// The socket, opened at the first use; none when it cannot be.
    events: Option<Option<OwnedFd>>,
    /// Whether the socket was seen to carry the agent's own attach.
    proven: bool,
    /// Until then: the devices events named (a lookup may drain the
    /// event of an attach before the attach is told), and how many of
    /// the agent's own attaches went unheard.
    heard: std::collections::BTreeSet<Numbers>,
    unheard: u32,
    /// As last read; none until a full look, and after an overflow.
    known: Option<Known>,
    /// Full looks begun: only the latest one's result is kept (an earlier
    /// one finishing after it would bring back what it saw before).
    scans: u64,
    /// Devices an event named since they were last read.
    dirty: BTreeMap<Numbers, PathBuf>,
}

#[derive(Default)]
struct Known {
    by_number: HashMap<Numbers, LoopStatus>,
    by_backing: HashMap<FileId, Vec<Numbers>>,
}

impl Known {
    fn seeded(all: Vec<LoopStatus>) -> Known {
        let mut known = Known::default();
        for l in all {
            known.set(l.number, Some(l));
        }
        known
    }

    fn set(&mut self, number: Numbers, status: Option<LoopStatus>) {
        if let Some(old) = self.by_number.remove(&number)
            && let Some(backing) = old.backing
            && let Some(numbers) = self.by_backing.get_mut(&backing)
        {
            numbers.retain(|n| *n != number);
            if numbers.is_empty() {
                self.by_backing.remove(&backing);
            }
        }
        if let Some(status) = status {
            if let Some(backing) = status.backing {
                self.by_backing.entry(backing).or_default().push(number);
            }
            self.by_number.insert(number, status);
        }
    }
}

impl LoopIndex {
    /// The attached loop devices over the file `backing`, and those
    /// numbered in `numbers`, each as its status reads now.
    pub fn find(
        &self,
        backing: Option<FileId>,
        numbers: &[Numbers],
    ) -> Result<Vec<LoopStatus>, SysError> {
        let wanted = |l: &LoopStatus| {
            (backing.is_some() && l.backing == backing) || numbers.contains(&l.number)
        };
        let scan = {
            let mut inner = self.lock();
            let overflowed = inner.drain();
            if inner.proven && !overflowed && inner.known.is_some() {
                let found = inner.look_up(backing, numbers, wanted);
                if found.is_err() {
                    // Some device may be left as it was: all are read again.
                    inner.known = None;
                }
                return found;
            }
            // What the events said so far, the full look sees; those queued
            // from here on are read at a later lookup.
            inner.dirty.clear();
            inner.known = None;
            inner.scans += 1;
            inner.scans
        };
        // Not under the lock: lookups while unproven (after a restart with
        // every volume still attached, or where no events are heard) each
        // read every device, and must not wait for each other's.
        let all = loopdev::statuses()?;
        let found = all.iter().filter(|l| wanted(l)).cloned().collect();
        let mut inner = self.lock();
        // Devices that changed while it looked stay named in `dirty`, to
        // be read again at the next lookup.
        if inner.scans == scan {
            inner.known = Some(Known::seeded(all));
        }
        Ok(found)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether lookups use the index (the kernel's events proven heard).
    pub fn in_use(&self) -> bool {
        self.lock().proven
    }

    /// This agent attached `device` over `backing`, tagged `tag`: known
    /// from now on, and the proof that the socket hears, when it carried
    /// the attach's event.
    pub fn attached(&self, device: &Path, backing: Option<FileId>, tag: &str) {
        let Ok(st) = nix::sys::stat::stat(device) else { return };
        let rdev = st.st_rdev;
        let number = (nix::sys::stat::major(rdev) as u32, nix::sys::stat::minor(rdev) as u32);
        let mut inner = self.lock();
        let overflowed = inner.drain();
        if !inner.proven && !overflowed && inner.events.as_ref().is_some_and(|e| e.is_some()) {
            if inner.heard.contains(&number) {
                inner.proven = true;
                inner.heard.clear();
                tracing::debug!(device = %device.display(), "loop devices are looked up by the kernel's events from now on");
            } else {
                inner.unheard += 1;
                if inner.unheard == UNHEARD {
                    tracing::warn!(device = %device.display(), "the kernel's events for this agent's attaches are not heard (a network namespace without uevents?): every attach and detach looks at every loop device");
                }
            }
        }
        if let Some(known) = inner.known.as_mut() {
            let status =
                LoopStatus { device: device.to_path_buf(), backing, tag: tag.to_string(), number };
            known.set(number, Some(status));
        }
    }
}

impl Inner {
    /// The devices over `backing` or numbered in `numbers`, from the index
    /// brought up to date by the events drained, each read again.
    fn look_up(
        &mut self,
        backing: Option<FileId>,
        numbers: &[Numbers],
        wanted: impl Fn(&LoopStatus) -> bool,
    ) -> Result<Vec<LoopStatus>, SysError> {
        let known = self.known.get_or_insert_with(Known::default);
        for (number, device) in std::mem::take(&mut self.dirty) {
            known.set(number, loopdev::status_of(&device, number)?);
        }
        let mut hits: Vec<Numbers> =
            backing.and_then(|b| known.by_backing.get(&b)).cloned().unwrap_or_default();
        hits.extend(numbers.iter().filter(|n| known.by_number.contains_key(n)));
        hits.sort_unstable();
        hits.dedup();
        let mut found = Vec::new();
        for number in hits {
            let device = known.by_number[&number].device.clone();
            let now = loopdev::status_of(&device, number)?;
            if let Some(l) = now.as_ref().filter(|l| wanted(l)) {
                found.push(l.clone());
            }
            known.set(number, now);
        }
        found.sort_by(|a, b| a.device.cmp(&b.device));
        Ok(found)
    }

    /// Read every queued event into `dirty`; true when some were lost
    /// (the socket overflowed) and the index must be seeded again.
    fn drain(&mut self) -> bool {
        let Some(fd) = self.events.get_or_insert_with(open_events).as_ref() else {
            return false;
        };
        let mut buf = [0u8; 8192];
        let mut overflowed = false;
        loop {
            match nix::sys::socket::recvfrom::<nix::sys::socket::NetlinkAddr>(
                fd.as_raw_fd(),
                &mut buf,
            ) {
                Ok((n, from)) => {
                    // The kernel's own, not a process's.
                    if from.is_some_and(|a| a.pid() == 0)
                        && let Some((number, device)) = loop_event(&buf[..n])
                    {
                        if !self.proven {
                            if self.heard.len() == HEARD {
                                self.heard.clear();
                            }
                            self.heard.insert(number);
                        }
                        self.dirty.insert(number, device);
                    }
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::ENOBUFS) => overflowed = true,
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => {
                    tracing::warn!(
                        "reading the kernel's events failed ({e}): loop devices are looked up one by one from now on"
                    );
                    self.events = Some(None);
                    self.proven = false;
                    return true;
                }
            }
        }
        if overflowed {
            tracing::debug!(
                "the kernel's events overflowed their buffer: all loop devices read again"
            );
            self.known = None;
            self.dirty.clear();
        }
        overflowed
    }
}

/// A socket on the kernel's uevents; none when it cannot be had.
fn open_events() -> Option<OwnedFd> {
    use nix::sys::socket::*;
    let open = || -> nix::Result<OwnedFd> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            SockProtocol::NetlinkKObjectUEvent,
        )?;
        // Forced past the system's limit as root; else as much as allowed.
        if setsockopt(&fd, sockopt::RcvBufForce, &EVENT_BUFFER).is_err() {
            setsockopt(&fd, sockopt::RcvBuf, &EVENT_BUFFER)?;
        }
        // Group 1: the kernel's events (udev's own are group 2).
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 1))?;
        Ok(fd)
    };
    match open() {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::warn!(
                "no socket on the kernel's uevents ({e}): every attach and detach looks at every loop device"
            );
            None
        }
    }
}

/// The loop device a uevent is about: `ACTION@DEVPATH` then `KEY=VALUE`
/// fields, NUL-separated. Partitions of loop devices are not loop devices.
fn loop_event(message: &[u8]) -> Option<(Numbers, PathBuf)> {
    let mut fields = message.split(|b| *b == 0).skip(1);
    let (mut block, mut name, mut major, mut minor) = (false, None, None, None);
    for field in fields.by_ref() {
        let Ok(field) = std::str::from_utf8(field) else { continue };
        match field.split_once('=') {
            Some(("SUBSYSTEM", s)) => block = s == "block",
            Some(("DEVNAME", n)) => name = Some(n),
            Some(("MAJOR", n)) => major = n.parse::<u32>().ok(),
            Some(("MINOR", n)) => minor = n.parse::<u32>().ok(),
            _ => {}
        }
    }
    let device = PathBuf::from(format!("/dev/{}", name?));
    (block && loopdev::is_loop_path(&device)).then_some(((major?, minor?), device))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(fields: &[&str]) -> Vec<u8> {
        fields.join("\0").into_bytes()
    }

    #[test]
    fn only_loop_devices_events_name_one() {
        let attach = message(&[
            "change@/devices/virtual/block/loop3",
            "ACTION=change",
            "DEVPATH=/devices/virtual/block/loop3",
            "SUBSYSTEM=block",
            "MAJOR=7",
            "MINOR=3",
            "DEVNAME=loop3",
            "DEVTYPE=disk",
            "SEQNUM=1",
        ]);
        assert_eq!(loop_event(&attach), Some(((7, 3), PathBuf::from("/dev/loop3"))));
        for other in [
            message(&["change@/x", "SUBSYSTEM=block", "MAJOR=8", "MINOR=0", "DEVNAME=sda"]),
            message(&["add@/x", "SUBSYSTEM=block", "MAJOR=259", "MINOR=0", "DEVNAME=loop3p1"]),
            message(&["add@/x", "SUBSYSTEM=bdi", "MAJOR=7", "MINOR=3", "DEVNAME=loop3"]),
            message(&["change@/x", "SUBSYSTEM=block", "MAJOR=7", "DEVNAME=loop3"]),
            message(&["change@/x", "SUBSYSTEM=block", "MAJOR=7", "MINOR=3", "DEVNAME=../sda"]),
            b"garbage\xff\0\0=".to_vec(),
        ] {
            assert_eq!(loop_event(&other), None, "{}", String::from_utf8_lossy(&other));
        }
    }

    #[test]
    fn the_index_follows_a_device_from_file_to_file() {
        let status = |n: u32, ino: u64| LoopStatus {
            device: PathBuf::from(format!("/dev/loop{n}")),
            backing: Some(FileId { dev: 1, ino }),
            tag: "t".into(),
            number: (7, n),
        };
        let mut known = Known::seeded(vec![status(0, 10), status(1, 11), status(2, 10)]);
        assert_eq!(known.by_backing[&FileId { dev: 1, ino: 10 }], [(7, 0), (7, 2)]);
        known.set((7, 0), Some(status(0, 12)));
        known.set((7, 1), None);
        assert_eq!(known.by_backing[&FileId { dev: 1, ino: 10 }], [(7, 2)]);
        assert_eq!(known.by_backing[&FileId { dev: 1, ino: 12 }], [(7, 0)]);
        assert!(!known.by_backing.contains_key(&FileId { dev: 1, ino: 11 }));
        assert_eq!(known.by_number.len(), 2);
    }
}
