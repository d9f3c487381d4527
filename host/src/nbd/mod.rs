//! The agent's NBD server: exports local files and block devices (and, with
//! the rbd backend, userspace storage) to NBD clients — the kernel's nbd
//! driver, nbdfuse, qemu, libnbd tools — over a Unix socket or loopback TCP.
//!
//! One thread per connection: the handshake ([`handshake`]) with a deadline,
//! then requests in order ([`transmission`]). Exports are looked up by name
//! in [`Exports`], which the agent changes while serving. With a TLS
//! configuration ([`tls`]), every client must STARTTLS before anything else.

pub mod export;
pub mod handshake;
pub mod tls;
pub mod transmission;
pub mod wire;

pub use export::{Export, Extent};

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// A client that has not chosen an export by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    #[error("handshake: {0}")]
    Handshake(String),
    #[error("transmission: {0}")]
    Transmission(String),
}

/// The exports, by name; the empty name is the default export.
#[derive(Clone, Default)]
pub struct Exports(Arc<RwLock<BTreeMap<String, Arc<dyn Export>>>>);

impl Exports {
    pub fn insert(&self, name: &str, export: Arc<dyn Export>) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), export);
    }

    /// Stop offering `name`; connections already using it go on.
    pub fn remove(&self, name: &str) -> bool {
        self.0.write().unwrap_or_else(|e| e.into_inner()).remove(name).is_some()
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Export>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    pub fn names(&self) -> Vec<String> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect()
    }
}

/// A connected client's byte stream.
pub trait Stream: Read + Write + Send + 'static {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// A second handle, to shut the connection down from elsewhere.
    fn shutdown_handle(&self) -> io::Result<Box<dyn Fn() + Send + Sync>>;
}

impl Stream for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn shutdown_handle(&self) -> io::Result<Box<dyn Fn() + Send + Sync>> {
        let s = self.try_clone()?;
        Ok(Box::new(move || drop(s.shutdown(std::net::Shutdown::Both))))
    }
}

impl Stream for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn shutdown_handle(&self) -> io::Result<Box<dyn Fn() + Send + Sync>> {
        let s = self.try_clone()?;
        Ok(Box::new(move || drop(s.shutdown(std::net::Shutdown::Both))))
    }
}

/// One client, from greeting to disconnect; with `tls`, inside TLS.
pub fn serve_connection<S: Stream>(mut stream: S, exports: &Exports, tls: Option<&tls::ServerConfig>) -> Result<(), ProtocolError> {
    use handshake::{Ending, Tls};
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let no_zeroes = handshake::greet(&mut stream)?;
    let Some(config) = tls else {
        return match handshake::options(&mut stream, exports, no_zeroes, Tls::Off)? {
            Ending::Go(session) => transmit(stream, &session),
            Ending::Left | Ending::StartTls => Ok(()),
        };
    };
    if !matches!(handshake::options(&mut stream, exports, no_zeroes, Tls::Required)?, Ending::StartTls) {
        return Ok(());
    }
    let conn = rustls::ServerConnection::new(config.clone()).map_err(|e| ProtocolError::Handshake(format!("TLS: {e}")))?;
    let mut secured = rustls::StreamOwned::new(conn, stream);
    // The TLS handshake now, so that its failure is named as such.
    while secured.conn.is_handshaking() {
        secured.conn.complete_io(&mut secured.sock).map_err(|e| ProtocolError::Handshake(format!("TLS: {e}")))?;
    }
    match handshake::options(&mut secured, exports, no_zeroes, Tls::Established)? {
        Ending::Go(session) => {
            secured.sock.set_read_timeout(None)?;
            tracing::debug!(export = %session.name, "nbd client connected over TLS");
            transmission::serve(secured, &session)
        }
        Ending::Left | Ending::StartTls => Ok(()),
    }
}

fn transmit<S: Stream>(stream: S, session: &handshake::Session) -> Result<(), ProtocolError> {
    // Clients may idle between requests as long as they like.
    stream.set_read_timeout(None)?;
    tracing::debug!(export = %session.name, structured = session.structured, "nbd client connected");
    transmission::serve(stream, session)
}

/// Where the server listens.
pub enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    /// Listen on a Unix socket at `path`, replacing a stale socket file.
    pub fn unix(path: &std::path::Path) -> io::Result<Listener> {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(io::ErrorKind::AddrInUse, format!("{}: a server already listens there", path.display())));
        }
        // Only a stale socket is replaced, never another kind of file.
        match std::fs::symlink_metadata(path) {
            Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                std::fs::remove_file(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            }
            Ok(_) => return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{}: exists and is not a socket", path.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
        }
        let listener = UnixListener::bind(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        Ok(Listener::Unix(listener, path.to_path_buf()))
    }

    /// Listen on TCP at `addr`. Without TLS only on loopback: the
    /// protocol carries the data in the clear.
    pub fn tcp(addr: std::net::SocketAddr, tls: bool) -> io::Result<Listener> {
        if !addr.ip().is_loopback() && !tls {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{addr}: NBD beyond loopback is served only with TLS (give a certificate and key)"),
            ));
        }
        Ok(Listener::Tcp(TcpListener::bind(addr)?))
    }

    pub fn describe(&self) -> String {
        match self {
            Listener::Unix(_, p) => format!("unix:{}", p.display()),
            Listener::Tcp(l) => l.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp".into()),
        }
    }

    /// The next client: how to shut it down, and how to serve it.
    fn accept(&self) -> io::Result<(ShutdownFn, Connection)> {
        match self {
            Listener::Unix(l, _) => {
                let (s, _) = l.accept()?;
                Ok((s.shutdown_handle()?, Box::new(move |e: &Exports, t: Option<&tls::ServerConfig>| serve_connection(s, e, t))))
            }
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                Ok((s.shutdown_handle()?, Box::new(move |e: &Exports, t: Option<&tls::ServerConfig>| serve_connection(s, e, t))))
            }
        }
    }

    /// Wake a blocked `accept` for good: on Linux, shutting a listening
    /// socket down makes it fail (no path or address needed, which may be
    /// gone by then).
    fn wake(&self) {
        use std::os::fd::AsFd;
        let fd = match self {
            Listener::Unix(l, _) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        };
        let _ = nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }
}

type ShutdownFn = Box<dyn Fn() + Send + Sync>;
type Connection = Box<dyn FnOnce(&Exports, Option<&tls::ServerConfig>) -> Result<(), ProtocolError> + Send>;

/// A running server; dropping it stops accepting and closes every connection.
pub struct Server {
    listener: Arc<Listener>,
    stopping: Arc<AtomicBool>,
    connections: Arc<Mutex<BTreeMap<u64, ShutdownFn>>>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    /// Accept clients of `exports` on `listener`, at most `max_connections`
    /// at once; with `tls`, each must STARTTLS first.
    pub fn start(listener: Listener, exports: Exports, max_connections: usize, tls: Option<tls::ServerConfig>) -> io::Result<Server> {
        let listener = Arc::new(listener);
        let stopping = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<BTreeMap<u64, ShutdownFn>>> = Arc::default();
        let (l, s, c) = (listener.clone(), stopping.clone(), connections.clone());
        let accept = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(&l, &exports, tls.as_ref(), &s, &c, max_connections))?;
        Ok(Server { listener, stopping, connections, accept: Some(accept) })
    }

    pub fn describe(&self) -> String {
        self.listener.describe()
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.connections.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.listener.wake();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for stop in self.connections.lock().unwrap_or_else(|e| e.into_inner()).values() {
            stop();
        }
        if let Listener::Unix(_, p) = self.listener.as_ref() {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn accept_loop(
    listener: &Listener,
    exports: &Exports,
    tls: Option<&tls::ServerConfig>,
    stopping: &AtomicBool,
    connections: &Arc<Mutex<BTreeMap<u64, ShutdownFn>>>,
    max_connections: usize,
) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let conn = listener.accept();
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let (stop, conn) = match conn {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                tracing::warn!(listener = %listener.describe(), "nbd accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        {
            let mut live = connections.lock().unwrap_or_else(|e| e.into_inner());
            if live.len() >= max_connections {
                tracing::warn!(listener = %listener.describe(), "nbd: {max_connections} connections already; refusing one");
                continue; // dropping `conn` closes it
            }
            live.insert(id, stop);
        }
        let (exports, registry, tls) = (exports.clone(), connections.clone(), tls.cloned());
        let spawned = std::thread::Builder::new().name("nbd-conn".into()).spawn(move || {
            let result = conn(&exports, tls.as_ref());
            registry.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            match result {
                Ok(()) => tracing::debug!("nbd client left"),
                Err(ProtocolError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => tracing::debug!("nbd client left mid-message"),
                Err(e) => tracing::info!("nbd connection closed: {e}"),
            }
        });
        if let Err(e) = spawned {
            connections.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            tracing::warn!("nbd: cannot start a connection thread: {e}");
        }
    }
}

#[cfg(test)]
mod tests;
