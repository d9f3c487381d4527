//! The kernel's FUSE messages this server reads and writes (`linux/fuse.h`,
//! protocol 7.23 and later), in the machine's byte order: a request's
//! header and the arguments of the operations a one-file filesystem
//! answers, and the replies to them. Anything else is answered ENOSYS.

/// The protocol's major version, and the minor one this server speaks.
pub const MAJOR: u32 = 7;
pub const MINOR: u32 = 31;
/// The oldest kernel minor served: 7.23 fixed the sizes of the messages
/// read here (Linux 4.5).
pub const MIN_MINOR: u32 = 23;

/// The largest write asked of the server, and so the read buffer's size.
pub const MAX_WRITE: u32 = 1 << 20;
/// A request: its header, its arguments, and at most one write's data.
pub const BUFFER: usize = MAX_WRITE as usize + 4096;

pub const IN_HEADER: usize = 40;
pub const OUT_HEADER: usize = 16;

pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

/// `FUSE_NOTIFY_RESEND` (Linux 6.9): the kernel queues again every request
/// a reader took and did not answer.
pub const NOTIFY_RESEND: i32 = 7;

/// INIT flags asked for: reads may come in parallel, writes up to
/// `MAX_WRITE` (in pages).
const ASYNC_READ: u32 = 1 << 0;
const BIG_WRITES: u32 = 1 << 5;
const MAX_PAGES: u32 = 1 << 22;

/// `setattr`'s fields that are set.
pub mod set {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
}

/// A request's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
}

/// A request, its arguments parsed.
#[derive(Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Init {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u32,
    },
    Lookup {
        name: &'a [u8],
    },
    Getattr,
    Setattr {
        valid: u32,
        size: u64,
    },
    Open {
        flags: u32,
    },
    Opendir,
    Read {
        offset: u64,
        size: u32,
    },
    Write {
        offset: u64,
        flags: u32,
        data: &'a [u8],
    },
    Readdir {
        offset: u64,
        size: u32,
    },
    Fallocate {
        offset: u64,
        length: u64,
        mode: u32,
    },
    Statfs,
    Fsync,
    /// Answered with no error and nothing else: flush, release(dir),
    /// fsyncdir, destroy.
    Ok,
    /// Never answered: forget, batch forget, interrupt.
    NoReply,
    /// Answered ENOSYS.
    Unknown(u32),
}

/// Why a message could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("a FUSE request of {got} bytes, shorter than its header or arguments")]
    Short { got: usize },
    #[error("a FUSE request whose header says {said} bytes, but {got} were read")]
    Length { said: u32, got: usize },
}

/// Little reads at fixed offsets, bounds checked.
struct Args<'a>(&'a [u8]);

impl<'a> Args<'a> {
    fn bytes<const N: usize>(&self, at: usize) -> Result<[u8; N], ParseError> {
        self.0
            .get(at..at + N)
            .and_then(|b| b.try_into().ok())
            .ok_or(ParseError::Short { got: self.0.len() })
    }
    fn u32(&self, at: usize) -> Result<u32, ParseError> {
        self.bytes::<4>(at).map(u32::from_ne_bytes)
    }
    fn u64(&self, at: usize) -> Result<u64, ParseError> {
        self.bytes::<8>(at).map(u64::from_ne_bytes)
    }
    fn from(&self, at: usize) -> Result<&'a [u8], ParseError> {
        self.0.get(at..).ok_or(ParseError::Short { got: self.0.len() })
    }
}

/// Parse one message as read from `/dev/fuse`.
pub fn parse(msg: &[u8]) -> Result<(Header, Request<'_>), ParseError> {
    let head = Args(msg);
    let header = Header {
        len: head.u32(0)?,
        opcode: head.u32(4)?,
        unique: head.u64(8)?,
        nodeid: head.u64(16)?,
    };
    if header.len as usize != msg.len() {
        return Err(ParseError::Length { said: header.len, got: msg.len() });
    }
    let a = Args(head.from(IN_HEADER)?);
    let request = match header.opcode {
        op::INIT => Request::Init {
            major: a.u32(0)?,
            minor: a.u32(4)?,
            max_readahead: a.u32(8)?,
            flags: a.u32(12)?,
        },
        op::LOOKUP => {
            let raw = a.from(0)?;
            let name = raw.split(|b| *b == 0).next().unwrap_or(raw);
            Request::Lookup { name }
        }
        op::GETATTR => Request::Getattr,
        op::SETATTR => Request::Setattr { valid: a.u32(0)?, size: a.u64(16)? },
        op::OPEN => Request::Open { flags: a.u32(0)? },
        op::OPENDIR => Request::Opendir,
        op::READ => Request::Read { offset: a.u64(8)?, size: a.u32(16)? },
        op::READDIR => Request::Readdir { offset: a.u64(8)?, size: a.u32(16)? },
        op::WRITE => {
            let size = a.u32(16)? as usize;
            let data = a.from(40)?;
            let data = data.get(..size).ok_or(ParseError::Short { got: msg.len() })?;
            Request::Write { offset: a.u64(8)?, flags: a.u32(32)?, data }
        }
        op::FALLOCATE => {
            Request::Fallocate { offset: a.u64(8)?, length: a.u64(16)?, mode: a.u32(24)? }
        }
        op::STATFS => Request::Statfs,
        op::FSYNC => Request::Fsync,
        op::FLUSH | op::RELEASE | op::RELEASEDIR | op::FSYNCDIR | op::DESTROY => Request::Ok,
        op::FORGET | op::BATCH_FORGET | op::INTERRUPT => Request::NoReply,
        other => Request::Unknown(other),
    };
    Ok((header, request))
}

/// The id of a request that could not be parsed, when its header is whole.
pub fn unique_of(msg: &[u8]) -> Option<u64> {
    Args(msg).u64(8).ok()
}

/// A reply's header: `error` is 0 or a negative errno; `len` counts the
/// payload that follows.
pub fn out_header(unique: u64, error: i32, payload: usize) -> [u8; OUT_HEADER] {
    let mut out = [0u8; OUT_HEADER];
    out[0..4].copy_from_slice(&((OUT_HEADER + payload) as u32).to_ne_bytes());
    out[4..8].copy_from_slice(&error.to_ne_bytes());
    out[8..16].copy_from_slice(&unique.to_ne_bytes());
    out
}

/// The notice that asks the kernel to queue again the requests a reader
/// took and never answered.
pub fn resend_notice() -> [u8; OUT_HEADER] {
    out_header(0, NOTIFY_RESEND, 0)
}

/// A file's attributes, as a reply states them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    /// File type and permission bits (`S_IFDIR | 0o700`, …).
    pub mode: u32,
    pub nlink: u32,
    /// Seconds since the epoch, for all three times.
    pub time: u64,
}

/// Appends, in the kernel's layout.
struct Out(Vec<u8>);

impl Out {
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
    fn attr(&mut self, a: &Attr) -> &mut Self {
        self.u64(a.ino).u64(a.size).u64(a.size.div_ceil(512));
        self.u64(a.time).u64(a.time).u64(a.time).u32(0).u32(0).u32(0);
        // mode, nlink, uid, gid, rdev, blksize, flags
        self.u32(a.mode).u32(a.nlink).u32(0).u32(0).u32(0).u32(4096).u32(0)
    }
}

/// `fuse_entry_out`: never cached, so that a stat asks again.
pub fn entry(a: &Attr) -> Vec<u8> {
    let mut o = Out(Vec::with_capacity(128));
    o.u64(a.ino).u64(0).u64(0).u64(0).u32(0).u32(0).attr(a);
    o.0
}

/// `fuse_attr_out`, never cached.
pub fn attr(a: &Attr) -> Vec<u8> {
    let mut o = Out(Vec::with_capacity(104));
    o.u64(0).u32(0).u32(0).attr(a);
    o.0
}

/// `fuse_open_out`: handle 0, no flags.
pub fn opened() -> Vec<u8> {
    vec![0u8; 16]
}

/// `fuse_write_out`.
pub fn written(size: u32) -> Vec<u8> {
    let mut o = Out(Vec::with_capacity(8));
    o.u32(size).u32(0);
    o.0
}

/// `fuse_statfs_out`: no blocks or files to count; 4 KiB blocks.
pub fn statfs() -> Vec<u8> {
    let mut o = Out(Vec::with_capacity(80));
    o.u64(0).u64(0).u64(0).u64(0).u64(0).u32(4096).u32(255).u32(4096).u32(0);
    o.0.resize(80, 0);
    o.0
}

/// A directory's entries from `offset` on, as many as fit in `size`
/// bytes: (inode, type as in `d_type`, name).
pub fn dirents(entries: &[(u64, u32, &[u8])], offset: u64, size: u32) -> Vec<u8> {
    let mut o = Out(Vec::new());
    for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
        let len = (24 + name.len()).next_multiple_of(8);
        if o.0.len() + len > size as usize {
            break;
        }
        o.u64(*ino).u64(i as u64 + 1).u32(name.len() as u32).u32(*kind);
        o.0.extend_from_slice(name);
        o.0.resize(o.0.len().next_multiple_of(8), 0);
    }
    o.0
}

/// What INIT is answered, or why the kernel is refused (its minor is too
/// old; a newer major is answered with ours, and the kernel asks again).
pub fn init_reply(major: u32, minor: u32, max_readahead: u32, flags: u32) -> Result<Vec<u8>, u32> {
    if major > MAJOR {
        let mut o = Out(Vec::with_capacity(8));
        o.u32(MAJOR).u32(MINOR);
        return Ok(o.0);
    }
    if major < MAJOR || minor < MIN_MINOR {
        return Err(minor);
    }
    let wanted = ASYNC_READ | BIG_WRITES | MAX_PAGES;
    let mut o = Out(Vec::with_capacity(64));
    o.u32(MAJOR).u32(MINOR.min(minor)).u32(max_readahead).u32(flags & wanted);
    // max_background, congestion_threshold, max_write, time_gran,
    // max_pages, map_alignment; the rest is zero.
    o.u16(16).u16(12).u32(MAX_WRITE).u32(1).u16(max_pages()).u16(0);
    o.0.resize(64, 0);
    Ok(o.0)
}

/// Pages of `MAX_WRITE`, in this machine's page size.
fn max_pages() -> u16 {
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .filter(|p| *p > 0)
        .unwrap_or(4096) as u32;
    (MAX_WRITE / page).max(1) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(opcode: u32, args: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((IN_HEADER + args.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&opcode.to_ne_bytes());
        m.extend_from_slice(&9u64.to_ne_bytes());
        m.extend_from_slice(&2u64.to_ne_bytes());
        m.resize(IN_HEADER, 0);
        m.extend_from_slice(args);
        m
    }

    #[test]
    fn a_write_carries_its_offset_flags_and_data() {
        let mut args = vec![0u8; 40];
        args[8..16].copy_from_slice(&4096u64.to_ne_bytes());
        args[16..20].copy_from_slice(&3u32.to_ne_bytes());
        args[32..36].copy_from_slice(&0o4010000u32.to_ne_bytes());
        args.extend_from_slice(b"abcdef");
        let msg = request(op::WRITE, &args);
        let (h, r) = parse(&msg).unwrap();
        assert_eq!((h.unique, h.nodeid, h.opcode), (9, 2, op::WRITE));
        assert_eq!(r, Request::Write { offset: 4096, flags: 0o4010000, data: b"abc" });
    }

    #[test]
    fn short_or_mislabelled_messages_are_refused() {
        assert!(matches!(parse(&[0u8; 12]), Err(ParseError::Short { .. })));
        let mut msg = request(op::READ, &[0u8; 40]);
        assert!(matches!(parse(&msg[..60]), Err(ParseError::Length { said: 80, got: 60 })));
        msg.truncate(IN_HEADER + 10);
        msg[0..4].copy_from_slice(&50u32.to_ne_bytes());
        assert_eq!(parse(&msg), Err(ParseError::Short { got: 10 }));
        // A write whose size runs past what was read.
        let mut args = vec![0u8; 40];
        args[16..20].copy_from_slice(&100u32.to_ne_bytes());
        assert!(matches!(parse(&request(op::WRITE, &args)), Err(ParseError::Short { .. })));
    }

    #[test]
    fn a_lookup_name_stops_at_its_nul_and_unknown_operations_are_named() {
        let msg = request(op::LOOKUP, b"export-ab\0");
        assert_eq!(parse(&msg).unwrap().1, Request::Lookup { name: b"export-ab" });
        assert_eq!(parse(&request(4242, &[])).unwrap().1, Request::Unknown(4242));
        assert_eq!(parse(&request(op::INTERRUPT, &[0; 8])).unwrap().1, Request::NoReply);
    }

    #[test]
    fn init_is_answered_in_the_kernels_terms_or_refused_when_too_old() {
        let reply = init_reply(7, 45, 131072, 0xffff_ffff).unwrap();
        assert_eq!(reply.len(), 64);
        assert_eq!(u32::from_ne_bytes(reply[4..8].try_into().unwrap()), MINOR);
        assert_eq!(u32::from_ne_bytes(reply[20..24].try_into().unwrap()), MAX_WRITE);
        let asked = u32::from_ne_bytes(reply[12..16].try_into().unwrap());
        assert_eq!(asked, ASYNC_READ | BIG_WRITES | MAX_PAGES);
        assert_eq!(init_reply(7, 22, 0, 0), Err(22));
        assert_eq!(init_reply(8, 0, 0, 0).unwrap().len(), 8);
    }

    #[test]
    fn dirents_are_padded_and_stop_where_the_buffer_ends() {
        let entries: [(u64, u32, &[u8]); 3] = [(1, 4, b"."), (1, 4, b".."), (2, 8, b"file")];
        let all = dirents(&entries, 0, 4096);
        assert_eq!(all.len(), 32 * 3);
        assert_eq!(dirents(&entries, 2, 4096).len(), 32);
        assert_eq!(dirents(&entries, 0, 40).len(), 32);
        assert!(dirents(&entries, 3, 4096).is_empty());
    }
}
