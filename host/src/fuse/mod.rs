//! A small FUSE server for a filesystem of a few fixed inodes: it mounts a
//! connection, or serves one it was handed, already initialised.
//!
//! Why not the `fuser` crate, which served this before: a successor must
//! serve a connection whose INIT its predecessor answered (no second one
//! comes), and every reader must read the one open file the connection's
//! keeper holds too, never a clone of it. Requests a reader took are kept
//! by the open file it read them from: while another holder keeps that file
//! open, a reader's death loses none of them, and a successor's
//! `FUSE_NOTIFY_RESEND` (Linux 6.9) has the kernel queue them again. A
//! clone's requests end with an error when the cloned file closes.
//!
//! A stop (`Stop::trigger`) lets each reader finish the request it holds
//! and take no other: a planned hand-over then leaves nothing behind, even
//! on a kernel without the resend notice.

pub mod abi;

use abi::{Attr, Request};
use nix::errno::Errno;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// What the filesystem answers; errors are errnos.
pub trait Filesystem: Send + Sync {
    fn lookup(&self, parent: u64, name: &[u8]) -> Result<Attr, Errno>;
    fn getattr(&self, ino: u64) -> Result<Attr, Errno>;
    /// `valid` says which fields are set (`abi::set`); only the size is
    /// given, other fields are refused or ignored by their flag.
    fn setattr(&self, ino: u64, valid: u32, size: u64) -> Result<Attr, Errno>;
    fn open(&self, ino: u64, flags: i32) -> Result<(), Errno>;
    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno>;
    fn write(&self, ino: u64, offset: u64, data: &[u8], flags: i32) -> Result<u32, Errno>;
    fn fsync(&self, ino: u64) -> Result<(), Errno>;
    fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<(), Errno>;
    /// A directory's entries: (inode, `d_type`, name).
    fn entries(&self, ino: u64) -> Result<Vec<(u64, u32, Vec<u8>)>, Errno>;
}

#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: String, source: Errno },
    #[error("FUSE connection: {what}: {source}")]
    Connection { what: &'static str, source: Errno },
    #[error("the kernel's FUSE protocol 7.{0} is older than 7.{min} (Linux 4.5)", min = abi::MIN_MINOR)]
    TooOld(u32),
}

/// How a mount is made.
pub struct MountOptions<'a> {
    /// The mount's source, as the mount table shows it.
    pub fsname: &'a str,
    /// Shown as the type `fuse.<subtype>`.
    pub subtype: &'a str,
    pub read_only: bool,
}

/// One FUSE connection's open `/dev/fuse` file.
pub struct Connection {
    fd: OwnedFd,
    /// Requests read and not yet answered, and read in all: what a watch
    /// compares with the kernel's count of requests waiting.
    in_flight: AtomicUsize,
    taken: AtomicU64,
}

/// Counts a request as in flight while it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Connection {
    /// Mount a new connection at `dir`, for root alone (no `allow_other`).
    pub fn mount(dir: &Path, options: &MountOptions) -> Result<Connection, FuseError> {
        use nix::fcntl::OFlag;
        use nix::mount::MsFlags;
        let io = |what, source| FuseError::Io { what, path: dir.display().to_string(), source };
        let fd = nix::fcntl::open(
            "/dev/fuse",
            OFlag::O_RDWR | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| io("open /dev/fuse for", e))?;
        // max_read: no read larger than a reply may be (with large pages,
        // max_pages alone would allow more).
        let data = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0,max_read={}",
            fd.as_raw_fd(),
            abi::MAX_WRITE
        );
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        if options.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        nix::mount::mount(
            Some(options.fsname),
            dir,
            Some(format!("fuse.{}", options.subtype).as_str()),
            flags,
            Some(data.as_str()),
        )
        .map_err(|e| io("mount FUSE at", e))?;
        Ok(Connection::of(fd))
    }

    fn of(fd: OwnedFd) -> Connection {
        Connection { fd, in_flight: AtomicUsize::new(0), taken: AtomicU64::new(0) }
    }

    /// (Requests read and not answered yet, requests read in all.)
    pub fn activity(&self) -> (usize, u64) {
        (self.in_flight.load(Ordering::SeqCst), self.taken.load(Ordering::SeqCst))
    }

    /// A connection already mounted and initialised, handed over by its
    /// keeper: it must be the FUSE device.
    pub fn handed(fd: OwnedFd) -> Result<Connection, FuseError> {
        let st = nix::sys::stat::fstat(&fd)
            .map_err(|source| FuseError::Connection { what: "stat it", source })?;
        if st.st_mode & nix::libc::S_IFMT != nix::libc::S_IFCHR
            || st.st_rdev != nix::sys::stat::makedev(10, 229)
        {
            return Err(FuseError::Connection {
                what: "the descriptor handed over is not /dev/fuse",
                source: Errno::EBADF,
            });
        }
        Ok(Connection::of(fd))
    }

    /// Ask the kernel to queue again the requests a predecessor took and
    /// never answered. False when this kernel cannot (before Linux 6.9):
    /// those requests then wait forever, so a predecessor is stopped, not
    /// killed, where it can be.
    pub fn resend(&self) -> Result<bool, FuseError> {
        match nix::unistd::write(&self.fd, &abi::resend_notice()) {
            Ok(_) => Ok(true),
            Err(Errno::EINVAL) => Ok(false),
            Err(source) => Err(FuseError::Connection { what: "ask for a resend", source }),
        }
    }

    /// Serve `fs` on `threads` readers until the connection ends (the
    /// mount is gone or aborted) or `stop` is triggered.
    pub fn serve(&self, fs: &dyn Filesystem, threads: usize, stop: &Stop) -> Result<(), FuseError> {
        use nix::fcntl::{FcntlArg, OFlag, fcntl};
        // Non-blocking, so a reader that woke for a request another took
        // goes back to waiting instead of blocking past a stop.
        let flags = fcntl(&self.fd, FcntlArg::F_GETFL)
            .map_err(|source| FuseError::Connection { what: "read its flags", source })?;
        fcntl(&self.fd, FcntlArg::F_SETFL(OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK))
            .map_err(|source| FuseError::Connection { what: "make it non-blocking", source })?;
        std::thread::scope(|s| {
            let readers: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    s.spawn(|| {
                        let result = self.reader(fs, stop);
                        // One reader ending ends them all.
                        stop.trigger();
                        if let Err(e) = &result {
                            tracing::error!("{e}");
                        }
                        result
                    })
                })
                .collect();
            let mut first = Ok(());
            for r in readers {
                let result = r.join().unwrap_or(Err(FuseError::Connection {
                    what: "a reader panicked",
                    source: Errno::EIO,
                }));
                if first.is_ok() {
                    first = result;
                }
            }
            first
        })
    }

    fn reader(&self, fs: &dyn Filesystem, stop: &Stop) -> Result<(), FuseError> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut buf = vec![0u8; abi::BUFFER];
        loop {
            let mut fds = [
                PollFd::new(self.fd.as_fd(), PollFlags::POLLIN),
                PollFd::new(stop.fds.0.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(source) => return Err(FuseError::Connection { what: "wait", source }),
            }
            if fds[1].any().unwrap_or(true) {
                return Ok(());
            }
            let n = match nix::unistd::read(&self.fd, &mut buf) {
                Ok(n) => n,
                // Another reader took it, or it was interrupted before it
                // was read.
                Err(Errno::EAGAIN | Errno::EINTR | Errno::ENOENT) => continue,
                // Unmounted or aborted.
                Err(Errno::ENODEV) => return Ok(()),
                Err(source) => return Err(FuseError::Connection { what: "read", source }),
            };
            self.in_flight.fetch_add(1, Ordering::SeqCst);
            self.taken.fetch_add(1, Ordering::SeqCst);
            let _in_flight = InFlight(&self.in_flight);
            let (unique, reply) = match abi::parse(&buf[..n]) {
                Ok((header, request)) => match answer(fs, header.nodeid, request) {
                    Some(reply) => (header.unique, reply),
                    None => continue,
                },
                Err(e) => {
                    tracing::error!("{e}");
                    // Answered, so that its caller does not wait forever,
                    // when its id can be read at all.
                    match abi::unique_of(&buf[..n]) {
                        Some(unique) => (unique, Err(Errno::EIO)),
                        None => continue,
                    }
                }
            };
            let (error, payload) = match reply {
                Ok(payload) => (0, payload),
                Err(e) => (-(e as i32), Vec::new()),
            };
            let head = abi::out_header(unique, error, payload.len());
            match nix::sys::uio::writev(&self.fd, &[IoSlice::new(&head), IoSlice::new(&payload)]) {
                // ENOENT: the request was interrupted and is no more.
                Ok(_) | Err(Errno::ENOENT) => {}
                Err(Errno::ENODEV) => return Ok(()),
                Err(source) => return Err(FuseError::Connection { what: "reply", source }),
            }
        }
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The answer to one request: its payload or an errno; None when the
/// kernel expects none.
fn answer(fs: &dyn Filesystem, ino: u64, request: Request) -> Option<Result<Vec<u8>, Errno>> {
    Some(match request {
        Request::Init { major, minor, max_readahead, flags } => {
            abi::init_reply(major, minor, max_readahead, flags).map_err(|minor| {
                tracing::error!("{}", FuseError::TooOld(minor));
                Errno::EPROTO
            })
        }
        Request::Lookup { name } => fs.lookup(ino, name).map(|a| abi::entry(&a)),
        Request::Getattr => fs.getattr(ino).map(|a| abi::attr(&a)),
        Request::Setattr { valid, size } => fs.setattr(ino, valid, size).map(|a| abi::attr(&a)),
        Request::Open { flags } => fs.open(ino, flags as i32).map(|()| abi::opened()),
        Request::Opendir => Ok(abi::opened()),
        Request::Read { offset, size } => fs.read(ino, offset, size.min(abi::MAX_WRITE)),
        Request::Write { offset, flags, data } => {
            fs.write(ino, offset, data, flags as i32).map(abi::written)
        }
        Request::Readdir { offset, size } => fs.entries(ino).map(|entries| {
            let entries: Vec<(u64, u32, &[u8])> =
                entries.iter().map(|(i, k, n)| (*i, *k, n.as_slice())).collect();
            abi::dirents(&entries, offset, size)
        }),
        Request::Fallocate { offset, length, mode } => {
            fs.fallocate(ino, offset, length, mode as i32).map(|()| Vec::new())
        }
        Request::Statfs => Ok(abi::statfs()),
        Request::Fsync => fs.fsync(ino).map(|()| Vec::new()),
        Request::Ok => Ok(Vec::new()),
        Request::NoReply => return None,
        Request::Unknown(_) => Err(Errno::ENOSYS),
    })
}

/// Tells readers to take no more requests.
#[derive(Clone)]
pub struct Stop {
    fds: std::sync::Arc<(OwnedFd, OwnedFd)>,
}

impl Stop {
    pub fn new() -> Result<Stop, FuseError> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|source| FuseError::Connection { what: "make a stop pipe", source })?;
        Ok(Stop { fds: std::sync::Arc::new((read, write)) })
    }

    /// Every reader finishes the request it holds and returns. (The pipe
    /// is never read: it stays readable, so each reader sees it.)
    pub fn trigger(&self) {
        let _ = nix::unistd::write(&self.fds.1, &[1]);
    }

    /// Wait up to `timeout`; true once triggered.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut fds = [PollFd::new(self.fds.0.as_fd(), PollFlags::POLLIN)];
        let ms = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        matches!(poll(&mut fds, ms), Ok(n) if n > 0)
    }
}
