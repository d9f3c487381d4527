//! `volagent nbd fuse`: an NBD export served as one file in a FUSE mount of
//! its own, for nodes without the kernel's nbd driver (the executor puts a
//! loop device on the file). It replaces nbdfuse on that path for two
//! reasons: with `follow_size`, a stat of the file asks the server for the
//! export's size again, so a volume grown under a mounted filesystem is
//! seen (the loop device and the filesystem are then grown over it); and
//! the FUSE connection is this project's own to keep and, later, hand over.
//! (Only where the server may grow an export and takes more connections:
//! the agent's own helper. qemu-nbd, by default, serves one client at a
//! time, and a size question would wait for the first to leave.)
//!
//! Requests run on `connections` threads, each with its own NBD connection
//! when the server says writes on one are seen on all (multi-conn), else on
//! one connection shared in turn. Only root (the mount's owner) may use it.

use crate::fuse::{Connection, Filesystem, MountOptions, Stop, abi};
use crate::nbd::client::{Client, ClientError, ExportInfo};
use crate::nbd::wire;
use nix::errno::Errno;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

const ROOT: u64 = 1;
const FILE: u64 = 2;
/// How long a size question to the server may take before the last known
/// size is answered instead.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the first connections may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a request whose connection broke tries to connect again (a
/// helper being started again by the agent) before it fails.
const RECONNECT_FOR: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum FuseFileError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Fuse(#[from] crate::fuse::FuseError),
    #[error("{path}: {what}: {source}")]
    Io { path: String, what: &'static str, source: std::io::Error },
    #[error("{path}: {what}")]
    Invalid { path: String, what: String },
}

/// What to serve, and where.
pub struct FuseFile<'a> {
    /// "unix:PATH" or "HOST:PORT".
    pub server: &'a str,
    pub export: &'a str,
    /// `<mount dir>/<file name>`: the dir is mounted, the file is the export.
    pub file: &'a Path,
    pub connections: u8,
    pub read_only: bool,
    /// Ask the export's size again at each stat.
    pub follow_size: bool,
    /// Written once the mount serves (how the agent knows it is up).
    pub pid_file: Option<&'a Path>,
    /// The connection of a client that ended, mounted at the dir already:
    /// served instead of a new mount, its untaken requests asked again.
    pub handed: Option<OwnedFd>,
    /// A request whose connection broke is sent again on a new one: only
    /// for a server that keeps what it acknowledged when it ends (the
    /// agent's local-file helper, whose writes are in its file).
    pub reconnect: bool,
}

impl FuseFile<'_> {
    /// Mount (or take over) and serve until the mount goes (the agent
    /// unmounts it) or SIGTERM: then the requests under way are answered,
    /// no other is taken, and the connection is left to its keeper.
    pub fn serve(self) -> Result<(), FuseFileError> {
        let invalid = |what: &str| FuseFileError::Invalid {
            path: self.file.display().to_string(),
            what: what.to_string(),
        };
        let (Some(dir), Some(name)) = (self.file.parent(), self.file.file_name()) else {
            return Err(invalid("must be <mount dir>/<file name>"));
        };
        let first = Client::connect(self.server, self.export, CONNECT_TIMEOUT)?;
        let info = first.info();
        let read_only = self.read_only || info.has(wire::TFLAG_READ_ONLY);
        // Without multi-conn a flush on one connection need not cover
        // writes made on another: one connection then, shared.
        let count = if info.has(wire::TFLAG_CAN_MULTI_CONN) {
            usize::from(self.connections.max(1))
        } else {
            1
        };
        let mut pool = vec![Mutex::new(first)];
        for _ in 1..count {
            pool.push(Mutex::new(Client::connect(self.server, self.export, CONNECT_TIMEOUT)?));
        }
        let fs = ExportFs {
            server: self.server.to_string(),
            export: self.export.to_string(),
            name: name.as_encoded_bytes().to_vec(),
            size: AtomicU64::new(info.size),
            read_only,
            follow_size: self.follow_size,
            pool,
            next: AtomicUsize::new(0),
            started: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            failures: AtomicU64::new(0),
            reconnect: self.reconnect,
        };
        let stop = Stop::new()?;
        let term = stop_on_sigterm(&stop).map_err(|source| FuseFileError::Io {
            path: dir.display().to_string(),
            what: "wait for SIGTERM",
            source,
        })?;
        let mut lost_unless_watched = false;
        let connection = match self.handed {
            Some(fd) => {
                let connection = Connection::handed(fd)?;
                if !connection.resend()? {
                    tracing::warn!(
                        "this kernel cannot queue again the requests the last client took (Linux 6.9 can): watching for any it left unanswered"
                    );
                    lost_unless_watched = true;
                }
                tracing::info!(dir = %dir.display(), "serving the connection handed over");
                connection
            }
            None => {
                let fsname = format!("volagent-nbd:{}", self.export);
                let options = MountOptions { fsname: &fsname, subtype: "volagent-nbd", read_only };
                Connection::mount(dir, &options)?
            }
        };
        if let Some(pid_file) = self.pid_file {
            std::fs::write(pid_file, std::process::id().to_string()).map_err(|source| {
                FuseFileError::Io {
                    path: pid_file.display().to_string(),
                    what: "write the pid file",
                    source,
                }
            })?;
        }
        let served = std::thread::scope(|s| {
            if lost_unless_watched {
                let (connection, stop) = (&connection, &stop);
                s.spawn(move || super::lost_requests::watch(connection, dir, stop));
            }
            let served = connection.serve(&fs, count.max(2), &stop);
            // The watch ends with the readers.
            stop.trigger();
            served
        });
        drop(term);
        Ok(served?)
    }
}

/// SIGTERM, blocked in this thread and every thread it starts after,
/// triggers `stop` (a thread waits for it).
fn stop_on_sigterm(stop: &Stop) -> std::io::Result<std::thread::JoinHandle<()>> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.thread_block().map_err(std::io::Error::from)?;
    let trigger = stop.clone();
    std::thread::Builder::new().name("sigterm".into()).spawn(move || {
        if set.wait() == Ok(Signal::SIGTERM) {
            tracing::info!("SIGTERM: answering the requests under way and taking no more");
            trigger.trigger();
        }
    })
}

struct ExportFs {
    server: String,
    export: String,
    name: Vec<u8>,
    /// The size last heard from the server.
    size: AtomicU64,
    read_only: bool,
    follow_size: bool,
    pool: Vec<Mutex<Client>>,
    next: AtomicUsize,
    /// Seconds since the epoch: every time the files show.
    started: u64,
    failures: AtomicU64,
    reconnect: bool,
}

impl ExportFs {
    fn attr(&self, ino: u64) -> abi::Attr {
        let (mode, size, nlink) = match ino {
            ROOT => (nix::libc::S_IFDIR | 0o700, 0, 2),
            _ => (
                nix::libc::S_IFREG | if self.read_only { 0o400 } else { 0o600 },
                self.size.load(Ordering::Relaxed),
                1,
            ),
        };
        abi::Attr { ino, size, mode, nlink, time: self.started }
    }

    /// The export's size as the server says it now; the last known one
    /// when it cannot say.
    fn refresh_size(&self) {
        if !self.follow_size {
            return;
        }
        match Client::probe(&self.server, &self.export, PROBE_TIMEOUT) {
            Ok(ExportInfo { size, .. }) => {
                let old = self.size.swap(size, Ordering::Relaxed);
                if old != size {
                    tracing::info!(export = %self.export, old, size, "the export's size changed");
                }
            }
            Err(e) => tracing::warn!("{e}; answering the last known size"),
        }
    }

    /// Run `f` on the next connection. With `reconnect`, a connection that
    /// broke (its server ended: a helper the agent is starting again) is
    /// made again and `f` run again: reads, writes at an offset and flushes
    /// mean the same done twice, and the server kept what it acknowledged.
    fn with<T>(
        &self,
        mut f: impl FnMut(&mut Client) -> Result<T, ClientError>,
    ) -> Result<T, Errno> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.pool.len();
        let mut c = self.pool[i].lock().unwrap_or_else(|e| e.into_inner());
        let mut result = f(&mut c);
        let deadline = std::time::Instant::now() + RECONNECT_FOR;
        while self.reconnect
            && matches!(result, Err(ClientError::Io { .. }))
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
            match Client::connect(&self.server, &self.export, PROBE_TIMEOUT) {
                Ok(fresh) => {
                    tracing::info!(export = %self.export, "connected again after: {}", result.as_ref().err().map(ToString::to_string).unwrap_or_default());
                    *c = fresh;
                    result = f(&mut c);
                }
                Err(e) => tracing::debug!("connecting again: {e}"),
            }
        }
        result.map_err(|e| {
            // The log is a file the agent reads back: the first failures
            // and then one in a thousand, not one line per retried block.
            let n = self.failures.fetch_add(1, Ordering::Relaxed);
            if n < 10 || n.is_multiple_of(1000) {
                tracing::warn!(failures = n + 1, "{e}");
            }
            Errno::from_raw(e.errno())
        })
    }

    fn file(&self, ino: u64) -> Result<(), Errno> {
        match ino {
            FILE => Ok(()),
            ROOT => Err(Errno::EISDIR),
            _ => Err(Errno::ENOENT),
        }
    }
}

impl Filesystem for ExportFs {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<abi::Attr, Errno> {
        if parent != ROOT || name != self.name.as_slice() {
            return Err(Errno::ENOENT);
        }
        self.refresh_size();
        Ok(self.attr(FILE))
    }

    fn getattr(&self, ino: u64) -> Result<abi::Attr, Errno> {
        match ino {
            ROOT => Ok(self.attr(ino)),
            FILE => {
                self.refresh_size();
                Ok(self.attr(ino))
            }
            _ => Err(Errno::ENOENT),
        }
    }

    fn setattr(&self, ino: u64, valid: u32, size: u64) -> Result<abi::Attr, Errno> {
        // The export's size is the server's; an open with O_TRUNC or a
        // chmod cannot change it. Times are accepted and forgotten.
        if ino != FILE || valid & (abi::set::MODE | abi::set::UID | abi::set::GID) != 0 {
            return Err(Errno::EPERM);
        }
        if valid & abi::set::SIZE != 0 && size != self.size.load(Ordering::Relaxed) {
            return Err(Errno::EPERM);
        }
        Ok(self.attr(ino))
    }

    fn entries(&self, ino: u64) -> Result<Vec<(u64, u32, Vec<u8>)>, Errno> {
        if ino != ROOT {
            return Err(Errno::ENOTDIR);
        }
        let dir = u32::from(nix::libc::DT_DIR);
        Ok(vec![
            (ROOT, dir, b".".to_vec()),
            (ROOT, dir, b"..".to_vec()),
            (FILE, u32::from(nix::libc::DT_REG), self.name.clone()),
        ])
    }

    fn open(&self, ino: u64, flags: i32) -> Result<(), Errno> {
        self.file(ino)?;
        if self.read_only && flags & nix::libc::O_ACCMODE != nix::libc::O_RDONLY {
            return Err(Errno::EROFS);
        }
        Ok(())
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        self.file(ino)?;
        let end = self.size.load(Ordering::Relaxed);
        let len = u64::from(size).min(end.saturating_sub(offset)) as usize;
        let mut buf = vec![0u8; len];
        if len > 0 {
            self.with(|c| c.read(&mut buf, offset))?;
        }
        Ok(buf)
    }

    fn write(&self, ino: u64, offset: u64, data: &[u8], flags: i32) -> Result<u32, Errno> {
        self.file(ino)?;
        if self.read_only {
            return Err(Errno::EROFS);
        }
        let end = self.size.load(Ordering::Relaxed);
        if offset.checked_add(data.len() as u64).is_none_or(|e| e > end) {
            // Past the export's end: a file that cannot grow by writing.
            return Err(Errno::ENOSPC);
        }
        let fua = flags & (nix::libc::O_SYNC | nix::libc::O_DSYNC) != 0;
        self.with(|c| c.write(data, offset, fua))?;
        Ok(data.len() as u32)
    }

    fn fsync(&self, _ino: u64) -> Result<(), Errno> {
        self.with(Client::flush)
    }

    fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<(), Errno> {
        // The loop device's discards and write-zeroes: both must read back
        // as zeroes after, so both are NBD write-zeroes (a trim need not
        // zero); a hole may be punched only when the caller asked for one.
        use nix::libc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
        let punch = match mode & !FALLOC_FL_KEEP_SIZE {
            FALLOC_FL_PUNCH_HOLE if mode & FALLOC_FL_KEEP_SIZE != 0 => true,
            FALLOC_FL_ZERO_RANGE => false,
            _ => return Err(Errno::EOPNOTSUPP),
        };
        if ino != FILE || self.read_only {
            return Err(Errno::EOPNOTSUPP);
        }
        let end = self.size.load(Ordering::Relaxed);
        if offset.checked_add(length).is_none_or(|e| e > end) {
            return Err(Errno::EOPNOTSUPP);
        }
        let mut done = 0u64;
        while done < length {
            let step = (length - done).min(1 << 30) as u32;
            if !self.with(|c| c.write_zeroes(offset + done, step, punch))? {
                return Err(Errno::EOPNOTSUPP);
            }
            done += u64::from(step);
        }
        Ok(())
    }
}
