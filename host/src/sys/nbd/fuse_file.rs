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

use crate::nbd::client::{Client, ClientError, ExportInfo};
use crate::nbd::wire;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyWrite, Request, WriteFlags,
};
use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

const FILE: INodeNo = INodeNo(2);
/// How long a size question to the server may take before the last known
/// size is answered instead.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the first connections may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum FuseFileError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{path}: {what}: {source}")]
    Fuse { path: String, what: &'static str, source: std::io::Error },
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
}

impl FuseFile<'_> {
    /// Mount and serve until the mount goes (the agent unmounts it).
    pub fn serve(&self) -> Result<(), FuseFileError> {
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
            name: name.to_os_string(),
            size: AtomicU64::new(info.size),
            read_only,
            follow_size: self.follow_size,
            pool,
            next: AtomicUsize::new(0),
            started: SystemTime::now(),
            failures: AtomicU64::new(0),
        };
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName(format!("volagent-nbd:{}", self.export)),
            fuser::MountOption::Subtype("volagent-nbd".into()),
            fuser::MountOption::NoSuid,
            fuser::MountOption::NoDev,
            fuser::MountOption::NoExec,
            if read_only { fuser::MountOption::RO } else { fuser::MountOption::RW },
        ];
        config.n_threads = Some(count.max(2));
        config.clone_fd = true;
        let fuse_err =
            |what, source| FuseFileError::Fuse { path: dir.display().to_string(), what, source };
        let session = fuser::Session::new(fs, dir, &config).map_err(|e| fuse_err("mount", e))?;
        if let Some(pid_file) = self.pid_file {
            std::fs::write(pid_file, std::process::id().to_string())
                .map_err(|e| fuse_err("write the pid file", e))?;
        }
        session.run().map_err(|e| fuse_err("serve", e))
    }
}

struct ExportFs {
    server: String,
    export: String,
    name: OsString,
    /// The size last heard from the server.
    size: AtomicU64,
    read_only: bool,
    follow_size: bool,
    pool: Vec<Mutex<Client>>,
    next: AtomicUsize,
    started: SystemTime,
    failures: AtomicU64,
}

impl ExportFs {
    fn attr(&self, ino: INodeNo) -> FileAttr {
        let (kind, perm, size, nlink) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o700, 0, 2),
            _ => (
                FileType::RegularFile,
                if self.read_only { 0o400 } else { 0o600 },
                self.size.load(Ordering::Relaxed),
                1,
            ),
        };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
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

    /// Run `f` on the next connection.
    fn with<T>(&self, f: impl FnOnce(&mut Client) -> Result<T, ClientError>) -> Result<T, Errno> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.pool.len();
        let mut c = self.pool[i].lock().unwrap_or_else(|e| e.into_inner());
        f(&mut c).map_err(|e| {
            // The log is a file the agent reads back: the first failures
            // and then one in a thousand, not one line per retried block.
            let n = self.failures.fetch_add(1, Ordering::Relaxed);
            if n < 10 || n.is_multiple_of(1000) {
                tracing::warn!(failures = n + 1, "{e}");
            }
            Errno::from_i32(e.errno())
        })
    }
}

/// Attributes are never cached: with `follow_size`, each stat asks the
/// size again.
const NO_CACHE: Duration = Duration::ZERO;

impl Filesystem for ExportFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent != INodeNo::ROOT || name != self.name.as_os_str() {
            return reply.error(Errno::ENOENT);
        }
        self.refresh_size();
        reply.entry(&NO_CACHE, &self.attr(FILE), fuser::Generation(0));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino {
            INodeNo::ROOT => reply.attr(&NO_CACHE, &self.attr(ino)),
            FILE => {
                self.refresh_size();
                reply.attr(&NO_CACHE, &self.attr(ino));
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // The export's size is the server's; an open with O_TRUNC or a
        // chmod cannot change it. Times are accepted and forgotten.
        if ino != FILE || mode.is_some() || uid.is_some() || gid.is_some() {
            return reply.error(Errno::EPERM);
        }
        if size.is_some_and(|s| s != self.size.load(Ordering::Relaxed)) {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&NO_CACHE, &self.attr(ino));
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, OsStr::new(".")),
            (INodeNo::ROOT, FileType::Directory, OsStr::new("..")),
            (FILE, FileType::RegularFile, self.name.as_os_str()),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if self.read_only && flags.0 & nix::libc::O_ACCMODE != nix::libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        let end = self.size.load(Ordering::Relaxed);
        let len = u64::from(size).min(end.saturating_sub(offset)) as usize;
        if len == 0 {
            return reply.data(&[]);
        }
        let mut buf = vec![0u8; len];
        match self.with(|c| c.read(&mut buf, offset)) {
            Ok(()) => reply.data(&buf),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if self.read_only {
            return reply.error(Errno::EROFS);
        }
        let end = self.size.load(Ordering::Relaxed);
        if offset.checked_add(data.len() as u64).is_none_or(|e| e > end) {
            // Past the export's end: a file that cannot grow by writing.
            return reply.error(Errno::ENOSPC);
        }
        let fua = flags.0 & (nix::libc::O_SYNC | nix::libc::O_DSYNC) != 0;
        match self.with(|c| c.write(data, offset, fua)) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // A close is not a sync (fsync is).
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.with(Client::flush) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        // The loop device's discards and write-zeroes: both must read back
        // as zeroes after, so both are NBD write-zeroes (a trim need not
        // zero); a hole may be punched only when the caller asked for one.
        use nix::libc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
        let punch = match mode & !FALLOC_FL_KEEP_SIZE {
            FALLOC_FL_PUNCH_HOLE if mode & FALLOC_FL_KEEP_SIZE != 0 => true,
            FALLOC_FL_ZERO_RANGE => false,
            _ => return reply.error(Errno::EOPNOTSUPP),
        };
        if ino != FILE || self.read_only {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let end = self.size.load(Ordering::Relaxed);
        if offset.checked_add(length).is_none_or(|e| e > end) {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let mut done = 0u64;
        while done < length {
            let step = (length - done).min(1 << 30) as u32;
            match self.with(|c| c.write_zeroes(offset + done, step, punch)) {
                Ok(true) => {}
                Ok(false) => return reply.error(Errno::EOPNOTSUPP),
                Err(e) => return reply.error(e),
            }
            done += u64::from(step);
        }
        reply.ok();
    }
}
