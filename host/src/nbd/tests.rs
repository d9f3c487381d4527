//! The protocol's edges, with a hand-driven client over a socket pair:
//! what real clients never send. Interop with real clients is in
//! `host/tests/nbd_interop.rs`.

use super::export::Memory;
use super::wire::*;
use super::*;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

struct Client {
    s: UnixStream,
    server: std::thread::JoinHandle<Result<(), ProtocolError>>,
}

fn start(exports: &Exports) -> Client {
    start_with(exports, Timeouts::default())
}

fn start_with(exports: &Exports, timeouts: Timeouts) -> Client {
    let (c, s) = UnixStream::pair().unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let e = exports.clone();
    let server = std::thread::spawn(move || serve_connection(s, &e, None, &timeouts));
    let mut client = Client { s: c, server };
    let mut greeting = [0u8; 18];
    client.s.read_exact(&mut greeting).unwrap();
    assert_eq!(be64(&greeting[0..8]), NBDMAGIC);
    assert_eq!(be64(&greeting[8..16]), IHAVEOPT);
    client
}

fn memory(size: usize, read_only: bool) -> (Exports, Arc<Memory>) {
    let exports = Exports::default();
    let m = Arc::new(Memory::new(size, read_only));
    exports.insert("disk", m.clone());
    (exports, m)
}

impl Client {
    fn flags(&mut self, flags: u32) {
        self.s.write_all(&flags.to_be_bytes()).unwrap();
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        self.try_option(option, data).unwrap();
    }

    /// Send an option the server may hang up on.
    fn try_option(&mut self, option: u32, data: &[u8]) -> std::io::Result<()> {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.s.write_all(&m)
    }

    /// (reply type, payload)
    fn option_reply(&mut self) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(be64(&h[0..8]), OPTION_REPLY_MAGIC);
        let mut data = vec![0u8; be32(&h[16..20]) as usize];
        self.s.read_exact(&mut data).unwrap();
        (be32(&h[12..16]), data)
    }

    /// GO to `name`, with structured replies when asked; the export's size.
    fn go(&mut self, name: &str, structured: bool) -> u64 {
        self.flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
        if structured {
            self.option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(self.option_reply().0, REP_ACK);
        }
        self.option(OPT_GO, &go_data(name));
        let mut size = None;
        loop {
            match self.option_reply() {
                (REP_INFO, d) if be16(&d) == INFO_EXPORT => size = Some(be64(&d[2..10])),
                (REP_INFO, _) => {}
                (REP_ACK, _) => return size.expect("NBD_INFO_EXPORT before the ACK"),
                (other, d) => panic!("GO answered {other:#x}: {}", String::from_utf8_lossy(&d)),
            }
        }
    }

    fn request(&mut self, kind: u16, flags: u16, offset: u64, length: u32, payload: &[u8]) {
        let mut r = REQUEST_MAGIC.to_be_bytes().to_vec();
        r.extend_from_slice(&flags.to_be_bytes());
        r.extend_from_slice(&kind.to_be_bytes());
        r.extend_from_slice(&42u64.to_be_bytes());
        r.extend_from_slice(&offset.to_be_bytes());
        r.extend_from_slice(&length.to_be_bytes());
        r.extend_from_slice(payload);
        self.s.write_all(&r).unwrap();
    }

    /// A simple reply's error, reading `data_len` bytes of data on success.
    fn simple_reply(&mut self, data_len: usize) -> (u32, Vec<u8>) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(be32(&h[0..4]), SIMPLE_REPLY_MAGIC);
        assert_eq!(be64(&h[8..16]), 42);
        let error = be32(&h[4..8]);
        let mut data = vec![0u8; if error == 0 { data_len } else { 0 }];
        self.s.read_exact(&mut data).unwrap();
        (error, data)
    }

    /// A structured reply chunk: (flags, type, payload).
    fn chunk(&mut self) -> (u16, u16, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(be32(&h[0..4]), STRUCTURED_REPLY_MAGIC);
        let mut data = vec![0u8; be32(&h[16..20]) as usize];
        self.s.read_exact(&mut data).unwrap();
        (be16(&h[4..6]), be16(&h[6..8]), data)
    }

    /// The server's verdict on the connection, after the client left.
    fn end(self) -> Result<(), ProtocolError> {
        drop(self.s);
        self.server.join().unwrap()
    }

    /// The server's verdict, reached without the client leaving.
    fn verdict(self) -> Result<(), ProtocolError> {
        let verdict = self.server.join().unwrap();
        drop(self.s);
        verdict
    }
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

#[test]
fn unknown_export_gets_err_unknown_and_the_handshake_goes_on() {
    let (exports, _) = memory(4096, false);
    let mut c = start(&exports);
    c.flags(CLIENT_FIXED_NEWSTYLE);
    c.option(OPT_GO, &go_data("nope"));
    let (kind, msg) = c.option_reply();
    assert_eq!(kind, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&msg).contains("nope"));
    c.option(OPT_GO, &go_data("disk"));
    assert_eq!(c.option_reply().0, REP_INFO);
}

#[test]
fn malformed_options_are_refused_not_obeyed() {
    let (exports, _) = memory(4096, false);
    let mut c = start(&exports);
    c.flags(CLIENT_FIXED_NEWSTYLE);
    // A name length longer than the option.
    let mut bad = 100u32.to_be_bytes().to_vec();
    bad.extend_from_slice(b"disk\0\0");
    c.option(OPT_GO, &bad);
    assert_eq!(c.option_reply().0, REP_ERR_INVALID);
    c.option(OPT_LIST, b"x");
    assert_eq!(c.option_reply().0, REP_ERR_INVALID);
    c.option(999, &[]);
    assert_eq!(c.option_reply().0, REP_ERR_UNSUP);
    c.option(OPT_STARTTLS, &[]);
    assert_eq!(c.option_reply().0, REP_ERR_POLICY);
    // Meta contexts need structured replies first.
    c.option(OPT_SET_META_CONTEXT, &[]);
    assert_eq!(c.option_reply().0, REP_ERR_INVALID);
    // An option too long to read is skipped and refused.
    c.option(OPT_INFO, &vec![0u8; 20_000]);
    assert_eq!(c.option_reply().0, REP_ERR_TOO_BIG);
    c.option(OPT_ABORT, &[]);
    assert_eq!(c.option_reply().0, REP_ACK);
    assert!(c.end().is_ok());
}

#[test]
fn out_of_step_clients_are_disconnected() {
    let (exports, _) = memory(4096, false);
    let mut c = start(&exports);
    c.flags(0);
    assert!(matches!(c.end(), Err(ProtocolError::Handshake(m)) if m.contains("fixed newstyle")));

    let mut c = start(&exports);
    c.flags(CLIENT_FIXED_NEWSTYLE);
    c.s.write_all(&[0u8; 16]).unwrap();
    assert!(matches!(c.end(), Err(ProtocolError::Handshake(m)) if m.contains("IHAVEOPT")));

    let mut c = start(&exports);
    c.flags(CLIENT_FIXED_NEWSTYLE);
    let _ = c.try_option(OPT_GO, &vec![0u8; 2 << 20]);
    assert!(matches!(c.end(), Err(ProtocolError::Handshake(_))));

    let mut c = start(&exports);
    c.flags(CLIENT_FIXED_NEWSTYLE);
    for _ in 0..100 {
        let _ = c.try_option(OPT_LIST, &[]);
    }
    let end = c.verdict();
    assert!(matches!(&end, Err(ProtocolError::Handshake(m)) if m.contains("options")), "{end:?}");
}

#[test]
fn requests_out_of_bounds_or_read_only_fail_with_the_right_errno() {
    let (exports, m) = memory(8192, false);
    exports.insert("ro", Arc::new(Memory::new(8192, true)));
    let mut c = start(&exports);
    assert_eq!(c.go("disk", false), 8192);
    c.request(CMD_READ, 0, 8000, 512, &[]);
    assert_eq!(c.simple_reply(512).0, EINVAL);
    c.request(CMD_WRITE, 0, 8000, 512, &[7u8; 512]);
    assert_eq!(c.simple_reply(0).0, ENOSPC);
    c.request(CMD_READ, 0, u64::MAX - 10, 512, &[]);
    assert_eq!(c.simple_reply(512).0, EINVAL, "offset + length overflows");
    c.request(CMD_BLOCK_STATUS, 0, 0, 512, &[]);
    assert_eq!(c.simple_reply(0).0, EINVAL, "no context negotiated");
    c.request(CMD_READ, CMD_FLAG_FUA, 0, 512, &[]);
    assert_eq!(c.simple_reply(512).0, EINVAL, "FUA is no read flag");
    c.request(77, 0, 0, 0, &[]);
    assert_eq!(c.simple_reply(0).0, EINVAL);
    c.request(CMD_WRITE, CMD_FLAG_FUA, 512, 4, b"abcd");
    assert_eq!(c.simple_reply(0).0, 0);
    c.request(CMD_READ, 0, 510, 8, &[]);
    assert_eq!(c.simple_reply(8), (0, b"\0\0abcd\0\0".to_vec()));
    assert!(m.snapshot().iter().filter(|b| **b != 0).count() == 4, "nothing else was written");
    c.request(CMD_DISC, 0, 0, 0, &[]);
    assert!(c.end().is_ok());

    let mut c = start(&exports);
    c.go("ro", false);
    c.request(CMD_WRITE, 0, 0, 4, b"abcd");
    assert_eq!(c.simple_reply(0).0, EPERM);
    c.request(CMD_TRIM, 0, 0, 4096, &[]);
    assert_eq!(c.simple_reply(0).0, EPERM);
    c.request(CMD_WRITE_ZEROES, 0, 0, 4096, &[]);
    assert_eq!(c.simple_reply(0).0, EPERM);
}

#[test]
fn a_client_leaving_mid_write_changes_nothing() {
    let (exports, m) = memory(1 << 20, false);
    let mut c = start(&exports);
    c.go("disk", false);
    // Half of a 64 KiB write's payload, then the client is gone.
    c.request(CMD_WRITE, 0, 0, 65536, &[0xee; 32768]);
    assert!(
        matches!(c.end(), Err(ProtocolError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof)
    );
    assert!(m.snapshot().iter().all(|b| *b == 0), "a partial write reached the export");
}

#[test]
fn an_oversized_write_ends_the_connection() {
    let (exports, _) = memory(1 << 20, false);
    let mut c = start(&exports);
    c.go("disk", false);
    c.request(CMD_WRITE, 0, 0, handshake::MAX_PAYLOAD + 1, &[]);
    assert!(matches!(c.end(), Err(ProtocolError::Transmission(m)) if m.contains("cap")));
}

#[test]
fn structured_replies_carry_data_errors_and_allocation() {
    let (exports, _) = memory(8192, false);
    let mut c = start(&exports);
    c.flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    c.option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().0, REP_ACK);
    let mut set = (4u32).to_be_bytes().to_vec();
    set.extend_from_slice(b"disk");
    set.extend_from_slice(&2u32.to_be_bytes());
    for q in ["qemu:dirty-bitmap:x", BASE_ALLOCATION] {
        set.extend_from_slice(&(q.len() as u32).to_be_bytes());
        set.extend_from_slice(q.as_bytes());
    }
    c.option(OPT_SET_META_CONTEXT, &set);
    let (kind, ctx) = c.option_reply();
    assert_eq!((kind, be32(&ctx)), (REP_META_CONTEXT, BASE_ALLOCATION_ID));
    assert_eq!(&ctx[4..], BASE_ALLOCATION.as_bytes());
    assert_eq!(c.option_reply().0, REP_ACK);
    c.option(OPT_GO, &go_data("disk"));
    while c.option_reply().0 != REP_ACK {}

    c.request(CMD_READ, 0, 4096, 16, &[]);
    let (flags, kind, data) = c.chunk();
    assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA));
    assert_eq!(be64(&data), 4096);
    assert_eq!(data.len(), 8 + 16);
    c.request(CMD_READ, 0, 8192, 16, &[]);
    let (flags, kind, data) = c.chunk();
    assert_eq!((flags, kind, be32(&data)), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, EINVAL));
    assert!(String::from_utf8_lossy(&data[6..]).contains("beyond"), "the error says why");
    c.request(CMD_BLOCK_STATUS, 0, 0, 8192, &[]);
    let (flags, kind, data) = c.chunk();
    assert_eq!(
        (flags, kind, be32(&data)),
        (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, BASE_ALLOCATION_ID)
    );
    assert_eq!((be32(&data[4..]), be32(&data[8..])), (8192, 0), "one data extent over the range");
    c.request(CMD_FLUSH, 0, 0, 0, &[]);
    assert_eq!(c.chunk(), (REPLY_FLAG_DONE, REPLY_TYPE_NONE, vec![]));
}

#[test]
fn export_name_option_and_the_zero_padding() {
    let (exports, _) = memory(4096, true);
    let mut c = start(&exports);
    c.flags(CLIENT_FIXED_NEWSTYLE);
    c.option(OPT_EXPORT_NAME, b"disk");
    let mut reply = [0u8; 10 + 124];
    c.s.read_exact(&mut reply).unwrap();
    assert_eq!(be64(&reply), 4096);
    assert!(be16(&reply[8..]) & TFLAG_READ_ONLY != 0);
    assert!(reply[10..].iter().all(|b| *b == 0));
    c.request(CMD_READ, 0, 0, 8, &[]);
    assert_eq!(c.simple_reply(8).0, 0);
}

#[test]
fn where_tls_is_required_nothing_but_starttls_is_served() {
    use handshake::{Ending, Tls};
    let (exports, _) = memory(4096, false);
    let (c, mut s) = UnixStream::pair().unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let e = exports.clone();
    let server = std::thread::spawn(move || handshake::options(&mut s, &e, true, Tls::Required));
    let mut client = Client { s: c, server: std::thread::spawn(|| Ok(())) };
    for option in [OPT_GO, OPT_INFO, OPT_LIST, OPT_STRUCTURED_REPLY] {
        client.option(option, &go_data("disk"));
        let (kind, msg) = client.option_reply();
        assert_eq!(kind, REP_ERR_TLS_REQD, "option {option}");
        assert!(String::from_utf8_lossy(&msg).contains("STARTTLS"));
    }
    client.option(OPT_STARTTLS, b"x");
    assert_eq!(client.option_reply().0, REP_ERR_INVALID, "STARTTLS takes no data");
    client.option(OPT_STARTTLS, &[]);
    assert_eq!(client.option_reply().0, REP_ACK);
    assert!(matches!(server.join().unwrap(), Ok(Ending::StartTls)));

    // EXPORT_NAME cannot be answered with an error: the client is dropped.
    let (mut c, mut s) = UnixStream::pair().unwrap();
    let e = exports.clone();
    let server = std::thread::spawn(move || handshake::options(&mut s, &e, true, Tls::Required));
    let mut m = IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    m.extend_from_slice(&4u32.to_be_bytes());
    m.extend_from_slice(b"disk");
    c.write_all(&m).unwrap();
    assert!(
        matches!(server.join().unwrap(), Err(ProtocolError::Handshake(m)) if m.contains("STARTTLS"))
    );

    // Once TLS is on, a second STARTTLS is an error, not a restart.
    let (c, mut s) = UnixStream::pair().unwrap();
    let server =
        std::thread::spawn(move || handshake::options(&mut s, &exports, true, Tls::Established));
    let mut client = Client { s: c, server: std::thread::spawn(|| Ok(())) };
    client.option(OPT_STARTTLS, &[]);
    assert_eq!(client.option_reply().0, REP_ERR_INVALID);
    client.option(OPT_ABORT, &[]);
    assert_eq!(client.option_reply().0, REP_ACK);
    assert!(matches!(server.join().unwrap(), Ok(Ending::Left)));
}

/// Short timeouts for the tests of slow clients.
fn quick(idle: Option<Duration>) -> Timeouts {
    Timeouts { handshake: Duration::from_secs(5), idle, request: Duration::from_millis(300) }
}

/// The server's verdict and how long after `since` it came.
fn verdict_after(c: Client, since: std::time::Instant) -> (Result<(), ProtocolError>, Duration) {
    let verdict = c.server.join().unwrap();
    let took = since.elapsed();
    drop(c.s);
    (verdict, took)
}

/// Hands out `data`, then fails every read as a socket's read timeout does.
struct ThenSilence(std::io::Cursor<Vec<u8>>);

impl Read for ThenSilence {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.0.read(buf)? {
            0 => Err(std::io::ErrorKind::WouldBlock.into()),
            n => Ok(n),
        }
    }
}

#[test]
fn a_payloads_buffer_grows_only_as_its_bytes_arrive() {
    use transmission::{PAYLOAD_STEP, read_payload};
    let mut buf = Vec::new();
    let mut silent = ThenSilence(std::io::Cursor::new(vec![7u8; 3000]));
    let err = read_payload(&mut silent, &mut buf, handshake::MAX_PAYLOAD as usize).unwrap_err();
    assert!(deadline::timed_out(&err), "{err}");
    assert!(buf.capacity() <= PAYLOAD_STEP, "{} bytes held for 3000 that came", buf.capacity());

    // A whole payload arrives whole, over what an earlier one left.
    let data: Vec<u8> = (0..3 * PAYLOAD_STEP + 5).map(|i| (i % 251) as u8).collect();
    let mut buf = vec![0xaa; 100];
    read_payload(&mut std::io::Cursor::new(data.clone()), &mut buf, data.len()).unwrap();
    assert!(buf[..data.len()] == data[..]);
    assert!(buf.capacity() <= 2 * (data.len() + PAYLOAD_STEP));
    // A shorter one after it reuses the buffer.
    read_payload(&mut std::io::Cursor::new(b"abc".to_vec()), &mut buf, 3).unwrap();
    assert_eq!(&buf[..3], b"abc");
}

#[test]
fn a_write_announced_and_never_sent_times_out_and_changes_nothing() {
    let (exports, m) = memory(1 << 20, false);
    let mut c = start_with(&exports, quick(None));
    c.go("disk", false);
    c.request(CMD_WRITE, 0, 0, handshake::MAX_PAYLOAD, &[0xee; 1000]);
    let since = std::time::Instant::now();
    let (verdict, took) = verdict_after(c, since);
    assert!(
        matches!(verdict, Err(ProtocolError::Stalled(t)) if t == Duration::from_millis(300)),
        "{verdict:?}"
    );
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    assert!(m.snapshot().iter().all(|b| *b == 0), "a partial write reached the export");
}

#[test]
fn a_request_header_cut_short_times_out() {
    let (exports, _) = memory(4096, false);
    let mut c = start_with(&exports, quick(None));
    c.go("disk", false);
    c.s.write_all(&REQUEST_MAGIC.to_be_bytes()).unwrap();
    c.s.write_all(&[0, 0, 0]).unwrap();
    let (verdict, took) = verdict_after(c, std::time::Instant::now());
    assert!(matches!(verdict, Err(ProtocolError::Stalled(_))), "{verdict:?}");
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
}

#[test]
fn without_an_idle_timeout_a_silent_client_stays_connected() {
    let (exports, _) = memory(4096, false);
    let mut c = start_with(&exports, quick(None));
    c.go("disk", false);
    // Far longer than the request timeout, between requests.
    std::thread::sleep(Duration::from_millis(1000));
    c.request(CMD_READ, 0, 0, 512, &[]);
    assert_eq!(c.simple_reply(512).0, 0);
    std::thread::sleep(Duration::from_millis(500));
    c.request(CMD_FLUSH, 0, 0, 0, &[]);
    assert_eq!(c.simple_reply(0).0, 0);
    c.request(CMD_DISC, 0, 0, 0, &[]);
    assert!(c.end().is_ok());
}

#[test]
fn an_idle_timeout_closes_a_silent_client_and_restarts_with_each_request() {
    let idle = Duration::from_millis(600);
    let (exports, _) = memory(4096, false);
    let mut c =
        start_with(&exports, Timeouts { request: Duration::from_secs(5), ..quick(Some(idle)) });
    c.go("disk", false);
    // Requests every 300 ms keep it open well past 600 ms.
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(300));
        c.request(CMD_READ, 0, 0, 512, &[]);
        assert_eq!(c.simple_reply(512).0, 0);
    }
    let since = std::time::Instant::now();
    let (verdict, took) = verdict_after(c, since);
    assert!(matches!(verdict, Err(ProtocolError::Idle(t)) if t == idle), "{verdict:?}");
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(4),
        "closed after {took:?}"
    );
}

#[test]
fn a_client_that_reads_no_replies_is_dropped() {
    let (exports, _) = memory(16 << 20, false);
    let mut c = start_with(&exports, quick(None));
    c.go("disk", false);
    // 16 MiB of reply does not fit in the socket's buffer.
    c.request(CMD_READ, 0, 0, 16 << 20, &[]);
    let (verdict, took) = verdict_after(c, std::time::Instant::now());
    assert!(matches!(verdict, Err(ProtocolError::Stalled(_))), "{verdict:?}");
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
}

#[test]
fn the_handshake_has_one_deadline_however_the_bytes_trickle() {
    let (exports, _) = memory(4096, false);
    let timeouts = Timeouts { handshake: Duration::from_millis(800), ..quick(None) };
    let since = std::time::Instant::now();
    let c = start_with(&exports, timeouts);
    let mut writer = c.s.try_clone().unwrap();
    // A byte every 100 ms: each read is quick, the whole is not.
    let trickle = std::thread::spawn(move || {
        let mut m = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        m.extend_from_slice(&IHAVEOPT.to_be_bytes());
        m.extend_from_slice(&OPT_GO.to_be_bytes());
        m.extend_from_slice(&(go_data("disk").len() as u32).to_be_bytes());
        m.extend_from_slice(&go_data("disk"));
        for b in m {
            if writer.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let (verdict, took) = verdict_after(c, since);
    trickle.join().unwrap();
    assert!(
        matches!(verdict, Err(ProtocolError::HandshakeTimeout(t)) if t == Duration::from_millis(800)),
        "{verdict:?}"
    );
    assert!(took < Duration::from_secs(2), "closed after {took:?}");
}

#[test]
fn tcp_beyond_loopback_needs_tls_and_client_certificates_unless_waived() {
    let any: std::net::SocketAddr = "0.0.0.0:0".parse().unwrap();
    let cleartext =
        Listener::tcp(any, ClientAuth::None, false).err().expect("cleartext beyond loopback");
    assert!(matches!(cleartext, ListenError::Cleartext { .. }), "{cleartext}");
    let waived = Listener::tcp(any, ClientAuth::None, true)
        .err()
        .expect("the waiver is of certificates, not of TLS");
    assert!(matches!(waived, ListenError::Cleartext { .. }), "{waived}");
    let refused =
        Listener::tcp(any, ClientAuth::Tls, false).err().expect("TLS without client certificates");
    let said = refused.to_string();
    assert!(
        said.contains("0.0.0.0:0")
            && said.contains("--tls-client-ca")
            && said.contains("--allow-unauthenticated-clients"),
        "{said}"
    );
    assert!(Listener::tcp(any, ClientAuth::Tls, true).is_ok());
    assert!(Listener::tcp(any, ClientAuth::Certificates, false).is_ok());
    for loopback in ["127.0.0.1:0", "[::1]:0"] {
        let addr: std::net::SocketAddr = loopback.parse().unwrap();
        // ::1 may be missing in a container; loopback is never refused by policy.
        match Listener::tcp(addr, ClientAuth::None, false) {
            Ok(_) => {}
            Err(ListenError::Tcp { .. }) if addr.is_ipv6() => {}
            Err(e) => panic!("{loopback}: {e}"),
        }
    }
}

#[test]
fn a_unix_socket_is_0600_and_replaces_only_a_stale_socket() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let listener = Listener::unix(&path).unwrap();
    let mode = std::fs::symlink_metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o600, "mode {mode:o}");
    let names: Vec<_> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["nbd.sock"], "nothing but the socket is left beside it");
    assert!(matches!(Listener::unix(&path), Err(ListenError::InUse { .. })));
    drop(listener);
    // Its listener gone, the file is stale: replaced.
    assert!(Listener::unix(&path).is_ok());
    let file = dir.path().join("file");
    std::fs::write(&file, b"data").unwrap();
    assert!(matches!(Listener::unix(&file), Err(ListenError::NotASocket { .. })));
    assert_eq!(std::fs::read(&file).unwrap(), b"data");
    let missing = Listener::unix(&dir.path().join("no/such/dir/nbd.sock")).err().expect("no dir");
    assert!(missing.to_string().contains("no/such/dir"), "{missing}");
}
