//! The transmission phase: requests are served one at a time, in order,
//! per connection (clients get parallelism from several connections,
//! which the export allows). A write's payload is read whole before any
//! byte of it is written: a client that leaves mid-request changes nothing.
//! The payload's buffer grows only as its bytes arrive, so a client that
//! announces a large write and sends little costs the server little.

use super::ProtocolError;
use super::deadline::{ReadTimeout, Switch, Timeouts, timed_out};
use super::handshake::{MAX_PAYLOAD, Session};
use super::wire::{self, Request};
use std::io::{self, BufRead, BufReader, Read, Write};

/// Extents sent in one BLOCK_STATUS reply at most.
const MAX_EXTENTS: usize = 1024;
/// Room before a read's data for the longest reply header in front of it.
const HEADROOM: usize = wire::STRUCTURED_REPLY_LEN + 8;
/// A write's buffer grows by at most this much before the bytes to fill it
/// have arrived.
pub const PAYLOAD_STEP: usize = 1 << 20;

/// Serve requests until the client disconnects (NBD_CMD_DISC or EOF
/// between requests); an error ends the connection. Between requests the
/// client may idle for `timeouts.idle`; once a request has begun, each
/// read must make progress within `timeouts.request`.
pub fn serve<S: Read + Write + ReadTimeout>(
    stream: S,
    session: &Session,
    timeouts: &Timeouts,
) -> Result<(), ProtocolError> {
    let mut reader = BufReader::with_capacity(256 * 1024, stream);
    let mut buf: Vec<u8> = Vec::new();
    let mut switch = Switch::default();
    loop {
        if reader.buffer().is_empty() {
            switch.set(reader.get_ref(), timeouts.idle)?;
            match reader.fill_buf() {
                // EOF exactly between requests is a client that left.
                Ok([]) => return Ok(()),
                Ok(_) => {}
                Err(e) if timed_out(&e) => {
                    return Err(ProtocolError::Idle(timeouts.idle.unwrap_or_default()));
                }
                Err(e) => return Err(e.into()),
            }
            switch.set(reader.get_ref(), Some(timeouts.request))?;
        }
        let stalled = |e: ProtocolError| match e {
            ProtocolError::Io(e) if timed_out(&e) => ProtocolError::Stalled(timeouts.request),
            e => e,
        };
        let Some(request) = next_request(&mut reader, &mut buf).map_err(stalled)? else {
            return Ok(());
        };
        let mut conn = Conn { out: reader.get_mut(), session, buf: &mut buf };
        conn.handle(&request).map_err(stalled)?;
    }
}

/// The next request, its payload (a write's) in `buf[..length]`; `None`
/// for NBD_CMD_DISC.
fn next_request<R: Read>(
    reader: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Option<Request>, ProtocolError> {
    let mut header = [0u8; wire::REQUEST_LEN];
    reader.read_exact(&mut header)?;
    let request =
        Request::parse(&header).map_err(|e| ProtocolError::Transmission(e.to_string()))?;
    if request.kind == wire::CMD_DISC {
        return Ok(None);
    }
    if request.kind == wire::CMD_WRITE {
        if request.length > MAX_PAYLOAD {
            // Its payload cannot be skipped at a reasonable cost.
            return Err(ProtocolError::Transmission(format!(
                "write of {} bytes, over the {MAX_PAYLOAD} cap",
                request.length
            )));
        }
        read_payload(reader, buf, request.length as usize)?;
    }
    Ok(Some(request))
}

/// Read `len` bytes into `buf[..len]`, growing `buf` at most
/// [`PAYLOAD_STEP`] ahead of the bytes that have arrived (it keeps what it
/// has grown to, for the next request). Bytes already in `buf` are
/// overwritten, not zeroed again.
pub fn read_payload<R: Read>(reader: &mut R, buf: &mut Vec<u8>, len: usize) -> io::Result<()> {
    let mut filled = 0;
    while filled < len {
        let end = len.min(filled + PAYLOAD_STEP);
        if buf.len() < end {
            buf.resize(end, 0);
        }
        reader.read_exact(&mut buf[filled..end])?;
        filled = end;
    }
    Ok(())
}

struct Conn<'a, W> {
    out: &'a mut W,
    session: &'a Session,
    buf: &'a mut Vec<u8>,
}

/// How a request failed, for the client.
struct Refusal {
    errno: u32,
    message: String,
}

fn refuse(errno: u32, message: impl Into<String>) -> Refusal {
    Refusal { errno, message: message.into() }
}

fn io_errno(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(libc_errno) => match nix::errno::Errno::from_raw(libc_errno) {
            nix::errno::Errno::EPERM | nix::errno::Errno::EROFS | nix::errno::Errno::EACCES => {
                wire::EPERM
            }
            nix::errno::Errno::ENOSPC | nix::errno::Errno::EDQUOT => wire::ENOSPC,
            nix::errno::Errno::EINVAL => wire::EINVAL,
            nix::errno::Errno::ENOMEM => wire::ENOMEM,
            nix::errno::Errno::EOPNOTSUPP => wire::ENOTSUP,
            _ => wire::EIO,
        },
        None if e.kind() == io::ErrorKind::Unsupported => wire::ENOTSUP,
        None if e.kind() == io::ErrorKind::InvalidInput => wire::EINVAL,
        None => wire::EIO,
    }
}

impl From<io::Error> for Refusal {
    fn from(e: io::Error) -> Self {
        Refusal { errno: io_errno(&e), message: e.to_string() }
    }
}

impl<W: Write> Conn<'_, W> {
    fn handle(&mut self, r: &Request) -> Result<(), ProtocolError> {
        match self.run(r) {
            Ok(Some(start)) => {
                self.out.write_all(&self.buf[start..])?;
                Ok(self.out.flush()?)
            }
            Ok(None) => self.done(r.cookie),
            Err(refusal) => {
                tracing::debug!(export = %self.session.name, kind = r.kind, offset = r.offset, length = r.length, "nbd request refused: {}", refusal.message);
                self.error(r.cookie, refusal)
            }
        }
    }

    /// Do the request; `Some(start)` when its whole reply, with data, is
    /// `buf[start..]`.
    fn run(&mut self, r: &Request) -> Result<Option<usize>, Refusal> {
        let export = self.session.export.as_ref();
        let known = match r.kind {
            wire::CMD_READ => wire::CMD_FLAG_DF,
            wire::CMD_WRITE => wire::CMD_FLAG_FUA,
            wire::CMD_FLUSH => 0,
            wire::CMD_TRIM => wire::CMD_FLAG_FUA,
            wire::CMD_CACHE => 0,
            wire::CMD_WRITE_ZEROES => {
                wire::CMD_FLAG_FUA | wire::CMD_FLAG_NO_HOLE | wire::CMD_FLAG_FAST_ZERO
            }
            wire::CMD_BLOCK_STATUS => wire::CMD_FLAG_REQ_ONE,
            other => return Err(refuse(wire::EINVAL, format!("unknown command {other}"))),
        };
        if r.flags & !known != 0 {
            return Err(refuse(
                wire::EINVAL,
                format!("flags {:#x} not valid for command {}", r.flags, r.kind),
            ));
        }
        let writes = matches!(r.kind, wire::CMD_WRITE | wire::CMD_TRIM | wire::CMD_WRITE_ZEROES);
        if writes && export.read_only() {
            return Err(refuse(wire::EPERM, "the export is read-only"));
        }
        if r.kind != wire::CMD_FLUSH {
            let end = r.offset.checked_add(u64::from(r.length));
            if end.is_none_or(|end| end > export.size()) {
                let errno = if writes { wire::ENOSPC } else { wire::EINVAL };
                return Err(refuse(
                    errno,
                    format!(
                        "{}+{} is beyond the export's {} bytes",
                        r.offset,
                        r.length,
                        export.size()
                    ),
                ));
            }
        }
        let fua = r.flags & wire::CMD_FLAG_FUA != 0;
        match r.kind {
            wire::CMD_READ => return self.read(r).map(Some),
            wire::CMD_WRITE => export.write_at(&self.buf[..r.length as usize], r.offset, fua)?,
            wire::CMD_FLUSH => export.flush()?,
            wire::CMD_TRIM => {
                export.trim(r.offset, u64::from(r.length))?;
                if fua {
                    export.flush()?;
                }
            }
            wire::CMD_CACHE => export.cache(r.offset, u64::from(r.length))?,
            wire::CMD_WRITE_ZEROES => {
                let punch = r.flags & wire::CMD_FLAG_NO_HOLE == 0;
                let fast = r.flags & wire::CMD_FLAG_FAST_ZERO != 0;
                export.write_zeroes(r.offset, u64::from(r.length), punch, fast)?;
                if fua {
                    export.flush()?;
                }
            }
            wire::CMD_BLOCK_STATUS => return self.block_status(r).map(Some),
            _ => unreachable!("checked above"),
        }
        Ok(None)
    }

    fn read(&mut self, r: &Request) -> Result<usize, Refusal> {
        if r.length > MAX_PAYLOAD {
            let errno = if self.session.structured { wire::EOVERFLOW } else { wire::EINVAL };
            return Err(refuse(
                errno,
                format!("read of {} bytes, over the {MAX_PAYLOAD} cap", r.length),
            ));
        }
        let len = r.length as usize;
        self.buf.resize(HEADROOM + len, 0);
        self.session.export.read_at(&mut self.buf[HEADROOM..], r.offset)?;
        // The header goes right before the data: one write per reply.
        let start = if self.session.structured {
            let start = HEADROOM - wire::STRUCTURED_REPLY_LEN - 8;
            let (head, _) = self.buf.split_at_mut(HEADROOM);
            wire::structured_reply(
                &mut head[start..],
                wire::REPLY_FLAG_DONE,
                wire::REPLY_TYPE_OFFSET_DATA,
                r.cookie,
                8 + r.length,
            );
            head[HEADROOM - 8..].copy_from_slice(&r.offset.to_be_bytes());
            start
        } else {
            let start = HEADROOM - wire::SIMPLE_REPLY_LEN;
            wire::simple_reply(&mut self.buf[start..HEADROOM], 0, r.cookie);
            start
        };
        Ok(start)
    }

    fn block_status(&mut self, r: &Request) -> Result<usize, Refusal> {
        if !self.session.base_allocation {
            return Err(refuse(wire::EINVAL, "no metadata context was negotiated"));
        }
        if r.length == 0 {
            return Err(refuse(wire::EINVAL, "block status of zero bytes"));
        }
        let max = if r.flags & wire::CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
        let extents = self.session.export.extents(r.offset, r.length, max)?;
        let payload_len = 4 + 8 * extents.len();
        self.buf.clear();
        self.buf.resize(wire::STRUCTURED_REPLY_LEN, 0);
        wire::structured_reply(
            self.buf,
            wire::REPLY_FLAG_DONE,
            wire::REPLY_TYPE_BLOCK_STATUS,
            r.cookie,
            payload_len as u32,
        );
        self.buf.extend_from_slice(&wire::BASE_ALLOCATION_ID.to_be_bytes());
        for e in &extents {
            let state = if e.hole { wire::STATE_HOLE | wire::STATE_ZERO } else { 0 };
            self.buf.extend_from_slice(&e.length.to_be_bytes());
            self.buf.extend_from_slice(&state.to_be_bytes());
        }
        Ok(0)
    }

    /// Success without data.
    fn done(&mut self, cookie: u64) -> Result<(), ProtocolError> {
        if self.session.structured {
            let mut h = [0u8; wire::STRUCTURED_REPLY_LEN];
            wire::structured_reply(&mut h, wire::REPLY_FLAG_DONE, wire::REPLY_TYPE_NONE, cookie, 0);
            self.out.write_all(&h)?;
        } else {
            let mut h = [0u8; wire::SIMPLE_REPLY_LEN];
            wire::simple_reply(&mut h, 0, cookie);
            self.out.write_all(&h)?;
        }
        Ok(self.out.flush()?)
    }

    fn error(&mut self, cookie: u64, refusal: Refusal) -> Result<(), ProtocolError> {
        if self.session.structured {
            let message = truncate(&refusal.message, 4096);
            let mut reply = vec![0u8; wire::STRUCTURED_REPLY_LEN];
            wire::structured_reply(
                &mut reply,
                wire::REPLY_FLAG_DONE,
                wire::REPLY_TYPE_ERROR,
                cookie,
                6 + message.len() as u32,
            );
            reply.extend_from_slice(&refusal.errno.to_be_bytes());
            reply.extend_from_slice(&(message.len() as u16).to_be_bytes());
            reply.extend_from_slice(message.as_bytes());
            self.out.write_all(&reply)?;
        } else {
            let mut h = [0u8; wire::SIMPLE_REPLY_LEN];
            wire::simple_reply(&mut h, refusal.errno, cookie);
            self.out.write_all(&h)?;
        }
        Ok(self.out.flush()?)
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
