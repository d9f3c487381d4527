//! A whole NBD client stream against the server: handshake options, then
//! requests, over a 64 KiB in-memory export, on a server with or without
//! required TLS. Whatever the bytes, the server answers or hangs up; it
//! never panics, and it writes only inside the export.
//!
//! The client may also be slow: the stream can stall once, at a point the
//! input picks, and arrive in small pieces. A stall is a timeout when the
//! server was waiting with one (the handshake's deadline, the idle
//! timeout, a begun request's timeout), and the connection must then end
//! with exactly that timeout's error; where it waited without one (an idle
//! client with no idle timeout), the client simply goes on later. And a
//! client cannot make the server hold more memory than it sent: a write
//! announced at 32 MiB and never sent costs no 32 MiB.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use volagent::nbd::export::Memory;
use volagent::nbd::{
    Exports, ProtocolError, ReadTimeout, Stream, Timeouts, handshake, serve_connection,
};

/// Counts the bytes allocated now and the most since [`reset_peak`]: the
/// server's memory, as the client's input drives it.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call goes to the system allocator unchanged; only sizes
// are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Distinct timeouts, so that a stall tells which one the server waited with.
const TIMEOUTS: Timeouts =
    Timeouts { handshake: Duration::from_secs(1000), idle: None, request: Duration::from_secs(3) };
const IDLE: Duration = Duration::from_secs(5);

/// What the server was waiting with when the client stalled.
const NO_STALL: u8 = 0;
const STALL_HANDSHAKE: u8 = 1;
const STALL_IDLE: u8 = 2;
const STALL_REQUEST: u8 = 3;
const STALL_WITHOUT_TIMEOUT: u8 = 4;

/// The client's side of the connection: its bytes, a piece at a time, with
/// one stall.
struct Duplex {
    input: Vec<u8>,
    at: usize,
    /// The most one read returns (a slow network); 0: no limit.
    piece: usize,
    stall_at: Option<usize>,
    timeout: Mutex<Option<Duration>>,
    stalled: Arc<AtomicU8>,
}

impl Read for Duplex {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut end = self.input.len();
        if let Some(stall) = self.stall_at {
            if self.at == stall {
                self.stall_at = None;
                let timeout = *self.timeout.lock().unwrap_or_else(|e| e.into_inner());
                let kind = match timeout {
                    None => STALL_WITHOUT_TIMEOUT,
                    Some(t) if t >= Duration::from_secs(900) => STALL_HANDSHAKE,
                    Some(t) if t == IDLE => STALL_IDLE,
                    Some(t) if t == TIMEOUTS.request => STALL_REQUEST,
                    Some(t) => panic!("a read with a timeout of {t:?}, which no setting gives"),
                };
                self.stalled.store(kind, Ordering::Relaxed);
                if kind != STALL_WITHOUT_TIMEOUT {
                    // What SO_RCVTIMEO gives when it runs out.
                    return Err(std::io::ErrorKind::WouldBlock.into());
                }
            } else if self.at < stall {
                end = stall;
            }
        }
        if self.piece > 0 {
            end = end.min(self.at + self.piece);
        }
        let n = buf.len().min(end - self.at);
        buf[..n].copy_from_slice(&self.input[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

impl Write for Duplex {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // A client that reads every reply: they are not kept.
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ReadTimeout for Duplex {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
        Ok(())
    }
}

impl Stream for Duplex {
    fn set_write_timeout(&self, _: Option<Duration>) -> std::io::Result<()> {
        Ok(())
    }
    fn shutdown_handle(&self) -> std::io::Result<Box<dyn Fn() + Send + Sync>> {
        Ok(Box::new(|| {}))
    }
}

fuzz_target!(|data: &[u8]| {
    let exports = Exports::default();
    let disk = Arc::new(Memory::new(64 * 1024, false));
    exports.insert("", disk.clone());
    exports.insert("ro", Arc::new(Memory::new(4096, true)));
    // The first byte: bit 0 picks a server that requires TLS (then only
    // STARTTLS or ABORT may end the options, and never with a session);
    // bit 1 an idle timeout; bit 2 a stall, at the offset the next two
    // bytes give; bits 3-7 the most bytes one read returns.
    let Some((&mode, mut data)) = data.split_first() else { return };
    let mut stall_at = None;
    if mode & 4 != 0 {
        let Some((offset, rest)) = data.split_first_chunk::<2>() else { return };
        stall_at = Some(u16::from_be_bytes(*offset) as usize % (rest.len() + 1));
        data = rest;
    }
    let stalled = Arc::new(AtomicU8::new(NO_STALL));
    let mut stream = Duplex {
        input: data.to_vec(),
        at: 0,
        piece: usize::from(mode >> 3),
        stall_at,
        timeout: Mutex::new(None),
        stalled: stalled.clone(),
    };
    if mode & 1 == 1 {
        if let Ok(ending) = handshake::greet(&mut stream)
            .and_then(|z| handshake::options(&mut stream, &exports, z, handshake::Tls::Required))
        {
            assert!(
                !matches!(ending, handshake::Ending::Go(_)),
                "a session without TLS on a server that requires it"
            );
        }
        return;
    }
    let timeouts = Timeouts { idle: (mode & 2 != 0).then_some(IDLE), ..TIMEOUTS };
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let result = serve_connection(stream, &exports, None, &timeouts);
    let used = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    // Buffers: 256 KiB to read requests, a payload's buffer at most twice
    // what arrived plus a step, reads of at most the 64 KiB export.
    let allowed = (3 << 20) + 2 * data.len();
    assert!(used <= allowed, "the server held {used} bytes for a client that sent {}", data.len());
    match (stalled.load(Ordering::Relaxed), &result) {
        (STALL_HANDSHAKE, r) => assert!(
            matches!(r, Err(ProtocolError::HandshakeTimeout(_))),
            "a stalled handshake: {r:?}"
        ),
        (STALL_IDLE, r) => assert!(
            matches!(r, Err(ProtocolError::Idle(t)) if *t == IDLE),
            "a client idle past the idle timeout: {r:?}"
        ),
        (STALL_REQUEST, r) => {
            assert!(matches!(r, Err(ProtocolError::Stalled(_))), "a stalled request: {r:?}")
        }
        (
            _,
            Err(
                e @ (ProtocolError::HandshakeTimeout(_)
                | ProtocolError::Idle(_)
                | ProtocolError::Stalled(_)),
            ),
        ) => {
            panic!("{e} though the client never stalled with a timeout set")
        }
        _ => {}
    }
    assert_eq!(disk.snapshot().len(), 64 * 1024);
});
