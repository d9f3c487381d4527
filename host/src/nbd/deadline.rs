//! How long a connection may wait on its client. The whole handshake has
//! one deadline. After it, the wait for the next request is bounded by the
//! idle timeout — none by default: the kernel's nbd driver, nbdfuse and
//! qemu keep a connection open and silent for as long as their volume is
//! idle, and closing it would fail the volume — while once a request has
//! begun, each read of it and each write of its reply must make progress
//! within the request timeout.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From the greeting to the chosen export, a TLS handshake included.
    pub handshake: Duration,
    /// Between requests; `None`: as long as the client likes.
    pub idle: Option<Duration>,
    /// For each read of a request once it has begun, and each write of a
    /// reply (a client that stops reading its replies).
    pub request: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            handshake: Duration::from_secs(10),
            idle: None,
            request: Duration::from_secs(30),
        }
    }
}

/// A socket whose read timeout can be changed while other layers (TLS, a
/// buffer) read it.
pub trait ReadTimeout {
    /// `None` waits for ever; a zero duration is not a timeout.
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl ReadTimeout for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, timeout)
    }
}

impl ReadTimeout for std::net::TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, timeout)
    }
}

impl<S: ReadTimeout + Read + Write> ReadTimeout
    for rustls::StreamOwned<rustls::ServerConnection, S>
{
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.sock.set_read_timeout(timeout)
    }
}

/// A read or write the socket's timeout ended (SO_RCVTIMEO and SO_SNDTIMEO
/// end them with EAGAIN).
pub fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// A stream whose every read ends by `deadline`: before each one, the
/// socket's read timeout is set to the time left, so that a client sending
/// a byte at a time cannot stretch the handshake.
pub struct Until<'a, S> {
    stream: &'a mut S,
    deadline: Instant,
}

impl<'a, S> Until<'a, S> {
    pub fn new(stream: &'a mut S, deadline: Instant) -> Self {
        Until { stream, deadline }
    }
}

impl<S: Read + ReadTimeout> Read for Until<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the deadline has passed"));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl<S: Write> Write for Until<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// The read timeout a socket has, so that it is changed only when it must
/// be: a request that starts on an empty buffer switches from the idle
/// timeout to the request timeout and back, two system calls, and none when
/// both are the same.
#[derive(Debug, Default)]
pub struct Switch {
    now: Option<Option<Duration>>,
}

impl Switch {
    pub fn set<S: ReadTimeout + ?Sized>(
        &mut self,
        stream: &S,
        timeout: Option<Duration>,
    ) -> io::Result<()> {
        if self.now != Some(timeout) {
            stream.set_read_timeout(timeout)?;
            self.now = Some(timeout);
        }
        Ok(())
    }
}
