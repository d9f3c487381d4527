//! A blocking NBD client: the fixed newstyle handshake (NBD_OPT_GO, or
//! NBD_OPT_EXPORT_NAME from a server without it), then one request at a
//! time with simple replies. It is what `volagent nbd fuse` serves a file
//! through; a fresh handshake is also how it learns that an export grew.
//!
//! The server is not trusted to be well-formed: every length it sends is
//! bounded before anything is allocated for it, and a reply that is out of
//! step (another cookie, a bad magic) ends the connection.

use super::wire::{self, be16, be32, be64};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The longest option reply read (a server's error text, an info block).
const MAX_OPTION_REPLY: u32 = 64 * 1024;
/// The most one request may carry: far above what FUSE sends.
pub const MAX_REQUEST: usize = 32 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("NBD server {server}: {source}")]
    Io { server: String, source: io::Error },
    #[error("NBD server {server}: {what}")]
    Protocol { server: String, what: String },
    #[error("NBD server {server} refused export {export:?}: {what}")]
    Refused { server: String, export: String, what: String },
    #[error("NBD server {server}: {op} at {offset} failed with error {errno}")]
    Request { server: String, op: &'static str, offset: u64, errno: u32 },
}

impl ClientError {
    /// The errno a caller of a file operation should see.
    pub fn errno(&self) -> i32 {
        match self {
            ClientError::Request { errno, .. } => match *errno {
                wire::EPERM => nix::libc::EPERM,
                wire::ENOMEM => nix::libc::ENOMEM,
                wire::EINVAL => nix::libc::EINVAL,
                wire::ENOSPC => nix::libc::ENOSPC,
                wire::EOVERFLOW => nix::libc::EOVERFLOW,
                wire::ENOTSUP => nix::libc::EOPNOTSUPP,
                _ => nix::libc::EIO,
            },
            _ => nix::libc::EIO,
        }
    }
}

/// What the handshake said of the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    /// Transmission flags (`wire::TFLAG_*`).
    pub flags: u16,
}

impl ExportInfo {
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn open(server: &str, timeout: Duration) -> io::Result<Stream> {
        let stream = match server.strip_prefix("unix:") {
            Some(path) => Stream::Unix(UnixStream::connect(path)?),
            None => {
                let addr = std::net::ToSocketAddrs::to_socket_addrs(server)?
                    .next()
                    .ok_or_else(|| io::Error::other("the address resolves to nothing"))?;
                let tcp = TcpStream::connect_timeout(&addr, timeout)?;
                tcp.set_nodelay(true)?;
                Stream::Tcp(tcp)
            }
        };
        stream.set_timeout(Some(timeout))?;
        Ok(stream)
    }

    fn set_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t).and_then(|_| s.set_write_timeout(t)),
            Stream::Tcp(s) => s.set_read_timeout(t).and_then(|_| s.set_write_timeout(t)),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One connection to an export, in transmission.
pub struct Client {
    stream: Stream,
    server: String,
    info: ExportInfo,
    cookie: u64,
}

impl Client {
    /// Connect to `server` ("unix:PATH" or "HOST:PORT") and open `export`.
    /// `timeout` bounds the handshake; requests after it wait as long as
    /// the server takes (a hung server is the watchdog's to abort).
    pub fn connect(server: &str, export: &str, timeout: Duration) -> Result<Client, ClientError> {
        let failed = |source| ClientError::Io { server: server.to_string(), source };
        let mut stream = Stream::open(server, timeout).map_err(failed)?;
        let info = handshake(&mut stream, server, export)?;
        stream.set_timeout(None).map_err(failed)?;
        Ok(Client { stream, server: server.to_string(), info, cookie: 0 })
    }

    /// The export's size and flags now: a handshake of its own, ended at
    /// once. An export that grew says so here, not on a connection opened
    /// before.
    pub fn probe(server: &str, export: &str, timeout: Duration) -> Result<ExportInfo, ClientError> {
        let c = Client::connect(server, export, timeout)?;
        let _ = c.stream.set_timeout(Some(timeout));
        let info = c.info;
        c.disconnect();
        Ok(info)
    }

    pub fn info(&self) -> ExportInfo {
        self.info
    }

    pub fn read(&mut self, buf: &mut [u8], offset: u64) -> Result<(), ClientError> {
        self.request(wire::CMD_READ, 0, offset, buf.len(), &[], "read")?;
        self.stream.read_exact(buf).map_err(|e| self.io(e))
    }

    pub fn write(&mut self, data: &[u8], offset: u64, fua: bool) -> Result<(), ClientError> {
        let flags = if fua && self.info.has(wire::TFLAG_SEND_FUA) { wire::CMD_FLAG_FUA } else { 0 };
        self.request(wire::CMD_WRITE, flags, offset, data.len(), data, "write")
    }

    /// Make every write acknowledged so far durable (a no-op where the
    /// server says it needs none).
    pub fn flush(&mut self) -> Result<(), ClientError> {
        if !self.info.has(wire::TFLAG_SEND_FLUSH) {
            return Ok(());
        }
        self.request(wire::CMD_FLUSH, 0, 0, 0, &[], "flush")
    }

    /// Tell the server these bytes are no longer needed (when it listens).
    pub fn trim(&mut self, offset: u64, length: u32) -> Result<(), ClientError> {
        if !self.info.has(wire::TFLAG_SEND_TRIM) {
            return Ok(());
        }
        self.request(wire::CMD_TRIM, 0, offset, length as usize, &[], "trim")
    }

    /// Zero the range; `punch` lets the server free it. False: the server
    /// cannot zero (nothing was sent).
    pub fn write_zeroes(
        &mut self,
        offset: u64,
        length: u32,
        punch: bool,
    ) -> Result<bool, ClientError> {
        if !self.info.has(wire::TFLAG_SEND_WRITE_ZEROES) {
            return Ok(false);
        }
        let flags = if punch { 0 } else { wire::CMD_FLAG_NO_HOLE };
        self.request(wire::CMD_WRITE_ZEROES, flags, offset, length as usize, &[], "write-zeroes")?;
        Ok(true)
    }

    /// The connection itself, in transmission, for the kernel to take
    /// over (`NBD_CMD_RECONFIGURE`): no timeouts left on it.
    pub fn into_socket(self) -> std::os::fd::OwnedFd {
        let _ = self.stream.set_timeout(None);
        match self.stream {
            Stream::Unix(s) => s.into(),
            Stream::Tcp(s) => s.into(),
        }
    }

    /// End the connection politely (NBD_CMD_DISC has no reply).
    pub fn disconnect(mut self) {
        let header = header(wire::CMD_DISC, 0, self.cookie, 0, 0);
        let _ = self.stream.write_all(&header);
    }

    fn io(&self, source: io::Error) -> ClientError {
        ClientError::Io { server: self.server.clone(), source }
    }

    /// Send one request (with its payload), then read its reply's header;
    /// a read's data follows it on the stream.
    fn request(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: usize,
        payload: &[u8],
        op: &'static str,
    ) -> Result<(), ClientError> {
        if payload.len() > MAX_REQUEST || (kind == wire::CMD_READ && length > MAX_REQUEST) {
            return Err(ClientError::Protocol {
                server: self.server.clone(),
                what: format!("a {op} of {length} bytes is larger than a request may be"),
            });
        }
        self.cookie = self.cookie.wrapping_add(1);
        let head = header(kind, flags, self.cookie, offset, length as u32);
        self.stream.write_all(&head).map_err(|e| self.io(e))?;
        if !payload.is_empty() {
            self.stream.write_all(payload).map_err(|e| self.io(e))?;
        }
        let mut reply = [0u8; wire::SIMPLE_REPLY_LEN];
        self.stream.read_exact(&mut reply).map_err(|e| self.io(e))?;
        let (magic, errno, cookie) = (be32(&reply[0..4]), be32(&reply[4..8]), be64(&reply[8..16]));
        if magic != wire::SIMPLE_REPLY_MAGIC || cookie != self.cookie {
            return Err(ClientError::Protocol {
                server: self.server.clone(),
                what: format!("a reply out of step (magic {magic:#x}, cookie {cookie}) to a {op}"),
            });
        }
        if errno != 0 {
            return Err(ClientError::Request { server: self.server.clone(), op, offset, errno });
        }
        Ok(())
    }
}

fn header(kind: u16, flags: u16, cookie: u64, offset: u64, length: u32) -> [u8; wire::REQUEST_LEN] {
    let mut h = [0u8; wire::REQUEST_LEN];
    h[0..4].copy_from_slice(&wire::REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&kind.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&length.to_be_bytes());
    h
}

fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + data.len());
    out.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// The handshake up to transmission: the export's size and flags.
fn handshake(s: &mut Stream, server: &str, export: &str) -> Result<ExportInfo, ClientError> {
    let io_err = |source| ClientError::Io { server: server.to_string(), source };
    let protocol = |what: String| ClientError::Protocol { server: server.to_string(), what };
    let refused = |what: String| ClientError::Refused {
        server: server.to_string(),
        export: export.to_string(),
        what,
    };
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).map_err(io_err)?;
    if be64(&greeting[0..8]) != wire::NBDMAGIC || be64(&greeting[8..16]) != wire::IHAVEOPT {
        return Err(protocol("not a newstyle NBD server".into()));
    }
    let server_flags = be16(&greeting[16..18]);
    if server_flags & wire::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol("the server does not speak fixed newstyle".into()));
    }
    let no_zeroes = server_flags & wire::FLAG_NO_ZEROES != 0;
    let client_flags =
        wire::CLIENT_FIXED_NEWSTYLE | if no_zeroes { wire::CLIENT_NO_ZEROES } else { 0 };
    s.write_all(&client_flags.to_be_bytes()).map_err(io_err)?;

    let mut go = Vec::with_capacity(6 + export.len());
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&option(wire::OPT_GO, &go)).map_err(io_err)?;
    let mut info = None;
    loop {
        let mut head = [0u8; 20];
        s.read_exact(&mut head).map_err(io_err)?;
        let (magic, opt, kind, len) =
            (be64(&head[0..8]), be32(&head[8..12]), be32(&head[12..16]), be32(&head[16..20]));
        if magic != wire::OPTION_REPLY_MAGIC || opt != wire::OPT_GO {
            return Err(protocol(format!("an option reply out of step (magic {magic:#x})")));
        }
        if len > MAX_OPTION_REPLY {
            return Err(protocol(format!("an option reply of {len} bytes")));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).map_err(io_err)?;
        match kind {
            wire::REP_INFO if data.len() >= 2 && be16(&data) == wire::INFO_EXPORT => {
                if data.len() != 12 {
                    return Err(protocol("a malformed NBD_INFO_EXPORT".into()));
                }
                info = Some(ExportInfo { size: be64(&data[2..10]), flags: be16(&data[10..12]) });
            }
            wire::REP_INFO => {}
            wire::REP_ACK => {
                return info
                    .ok_or_else(|| protocol("NBD_OPT_GO ended without the export's size".into()));
            }
            wire::REP_ERR_UNSUP => break,
            k if k & (1 << 31) != 0 => {
                let text = String::from_utf8_lossy(&data).into_owned();
                let text = crate::text::bounded(text, 300);
                return Err(refused(if text.is_empty() { format!("error {k:#x}") } else { text }));
            }
            other => return Err(protocol(format!("an unexpected reply {other} to NBD_OPT_GO"))),
        }
    }
    // A server without NBD_OPT_GO: the old way, with no error message.
    s.write_all(&option(wire::OPT_EXPORT_NAME, export.as_bytes())).map_err(io_err)?;
    let mut tail = [0u8; 10];
    s.read_exact(&mut tail).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => refused("the server closed the connection".into()),
        _ => io_err(e),
    })?;
    if !no_zeroes {
        let mut zeroes = [0u8; 124];
        s.read_exact(&mut zeroes).map_err(io_err)?;
    }
    Ok(ExportInfo { size: be64(&tail[0..8]), flags: be16(&tail[8..10]) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::{Exports, Listener, Server, export::Memory};
    use std::sync::Arc;

    fn serve(size: usize) -> (tempfile::TempDir, Server, String) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("s.sock");
        let exports = Exports::default();
        exports.insert("disk", Arc::new(Memory::new(size, false)));
        let server = Server::start(Listener::unix(&socket).unwrap(), exports, 8, None).unwrap();
        (dir, server, format!("unix:{}", socket.display()))
    }

    #[test]
    fn writes_read_back_and_flush_and_trim_reach_the_server() {
        let (_dir, _server, addr) = serve(1 << 20);
        let mut c = Client::connect(&addr, "disk", Duration::from_secs(5)).unwrap();
        assert_eq!(c.info().size, 1 << 20);
        c.write(b"hello", 4096, true).unwrap();
        c.flush().unwrap();
        let mut back = [0u8; 5];
        c.read(&mut back, 4096).unwrap();
        assert_eq!(&back, b"hello");
        c.trim(0, 4096).unwrap();
        assert!(c.write_zeroes(4096, 2, false).unwrap());
        c.read(&mut back, 4096).unwrap();
        assert_eq!(&back, b"\0\0llo");
        // Beyond the end: the server's error, not a broken connection.
        let e = c.read(&mut back, 1 << 20).unwrap_err();
        assert!(matches!(e, ClientError::Request { op: "read", .. }), "{e}");
        assert_eq!(e.errno(), nix::libc::EINVAL);
        c.read(&mut back, 4096).unwrap();
        c.disconnect();
    }

    /// A memory disk whose served size the test sets (as librbd's follows
    /// a resize).
    struct Growing(Memory, std::sync::atomic::AtomicU64);

    impl crate::nbd::Export for Growing {
        fn size(&self) -> u64 {
            self.1.load(std::sync::atomic::Ordering::Relaxed)
        }
        fn read_only(&self) -> bool {
            false
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.0.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            self.0.write_at(buf, offset, fua)
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn trim(&self, _offset: u64, _length: u64) -> io::Result<()> {
            Ok(())
        }
        fn write_zeroes(&self, o: u64, l: u64, punch: bool, fast: bool) -> io::Result<()> {
            self.0.write_zeroes(o, l, punch, fast)
        }
        fn extents(&self, o: u64, l: u32, max: usize) -> io::Result<Vec<crate::nbd::Extent>> {
            self.0.extents(o, l, max)
        }
    }

    #[test]
    fn a_grown_export_is_seen_by_a_probe_and_served_on_an_open_connection() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("g.sock");
        let exports = Exports::default();
        let disk = Arc::new(Growing(Memory::new(8192, false), 4096.into()));
        exports.insert("disk", disk.clone());
        let _server = Server::start(Listener::unix(&socket).unwrap(), exports, 8, None).unwrap();
        let addr = format!("unix:{}", socket.display());
        let mut open = Client::connect(&addr, "disk", Duration::from_secs(5)).unwrap();
        assert_eq!(open.info().size, 4096);
        assert!(open.write(b"x", 5000, false).is_err(), "past the end before it grew");
        disk.1.store(8192, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(Client::probe(&addr, "disk", Duration::from_secs(5)).unwrap().size, 8192);
        open.write(b"x", 5000, false).unwrap();
    }

    #[test]
    fn an_unknown_export_or_no_server_is_a_clear_error() {
        let (dir, _server, addr) = serve(4096);
        let e = Client::connect(&addr, "nothing", Duration::from_secs(5)).err().unwrap();
        assert!(matches!(e, ClientError::Refused { .. }), "{e}");
        assert!(e.to_string().contains("\"nothing\""), "{e}");
        let nowhere = format!("unix:{}", dir.path().join("none.sock").display());
        let e = Client::probe(&nowhere, "disk", Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("none.sock"), "{e}");
    }

    #[test]
    fn a_server_that_says_nothing_fails_the_handshake_within_its_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mute.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mute = std::thread::spawn(move || {
            let (_s, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_secs(1));
        });
        let start = std::time::Instant::now();
        let e = Client::probe(&format!("unix:{}", path.display()), "", Duration::from_millis(300))
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(1), "{e}");
        assert!(matches!(e, ClientError::Io { .. }), "{e}");
        mute.join().unwrap();
    }
}
