//! The agent's NBD server: exports local files and block devices (and, with
//! the rbd backend, userspace storage) to NBD clients — the kernel's nbd
//! driver, nbdfuse, qemu, libnbd tools — over a Unix socket or TCP.
//!
//! One thread per connection: the handshake ([`handshake`]) with a deadline,
//! then requests in order ([`transmission`]), each wait bounded as
//! [`deadline`] says. Exports are looked up by name in [`Exports`], which
//! the agent changes while serving. With a TLS configuration ([`tls`]),
//! every client must STARTTLS before anything else. Who may connect at all
//! is the [`listener`]'s to check: Unix sockets only root and the server's
//! own uid, TCP beyond loopback only clients with certificates.

pub mod client;
pub mod deadline;
pub mod export;
pub mod handshake;
pub mod listener;
pub mod tls;
pub mod transmission;
pub mod wire;

pub use deadline::{ReadTimeout, Timeouts};
pub use export::{Export, Extent};
pub use listener::{ClientAuth, ListenError, Listener};

use std::collections::BTreeMap;
use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    #[error("handshake: {0}")]
    Handshake(String),
    #[error("handshake not finished within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("transmission: {0}")]
    Transmission(String),
    #[error("no request for {0:?}: closing the idle connection")]
    Idle(Duration),
    #[error("a request stalled: no progress for {0:?}")]
    Stalled(Duration),
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
pub trait Stream: io::Read + io::Write + ReadTimeout + Send + 'static {
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// A second handle, to shut the connection down from elsewhere.
    fn shutdown_handle(&self) -> io::Result<Box<dyn Fn() + Send + Sync>>;
}

impl Stream for UnixStream {
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
    fn shutdown_handle(&self) -> io::Result<Box<dyn Fn() + Send + Sync>> {
        let s = self.try_clone()?;
        Ok(Box::new(move || drop(s.shutdown(std::net::Shutdown::Both))))
    }
}

impl Stream for TcpStream {
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
    fn shutdown_handle(&self) -> io::Result<Box<dyn Fn() + Send + Sync>> {
        let s = self.try_clone()?;
        Ok(Box::new(move || drop(s.shutdown(std::net::Shutdown::Both))))
    }
}

/// One client, from greeting to disconnect; with `tls`, inside TLS.
pub fn serve_connection<S: Stream>(
    mut stream: S,
    exports: &Exports,
    tls: Option<&tls::ServerConfig>,
    timeouts: &Timeouts,
) -> Result<(), ProtocolError> {
    use deadline::Until;
    use handshake::{Ending, Tls};
    // A reply the client does not read ends the connection, handshake or not.
    stream.set_write_timeout(Some(timeouts.request))?;
    let deadline = Instant::now() + timeouts.handshake;
    let late = |e: ProtocolError| match e {
        ProtocolError::Io(e) if deadline::timed_out(&e) => {
            ProtocolError::HandshakeTimeout(timeouts.handshake)
        }
        e => e,
    };
    let mut within = Until::new(&mut stream, deadline);
    let no_zeroes = handshake::greet(&mut within).map_err(late)?;
    let Some(config) = tls else {
        return match handshake::options(&mut within, exports, no_zeroes, Tls::Off).map_err(late)? {
            Ending::Go(session) => {
                tracing::debug!(export = %session.name, structured = session.structured, "nbd client connected");
                transmission::serve(stream, &session, timeouts)
            }
            Ending::Left | Ending::StartTls => Ok(()),
        };
    };
    if !matches!(
        handshake::options(&mut within, exports, no_zeroes, Tls::Required).map_err(late)?,
        Ending::StartTls
    ) {
        return Ok(());
    }
    let conn = rustls::ServerConnection::new(config.clone())
        .map_err(|e| ProtocolError::Handshake(format!("TLS: {e}")))?;
    let mut secured = rustls::StreamOwned::new(conn, stream);
    let ending = {
        let mut within = Until::new(&mut secured.sock, deadline);
        // The TLS handshake now, so that its failure is named as such.
        while secured.conn.is_handshaking() {
            secured.conn.complete_io(&mut within).map_err(|e| {
                if deadline::timed_out(&e) {
                    ProtocolError::HandshakeTimeout(timeouts.handshake)
                } else {
                    ProtocolError::Handshake(format!("TLS: {e}"))
                }
            })?;
        }
        handshake::options(
            &mut rustls::Stream::new(&mut secured.conn, &mut within),
            exports,
            no_zeroes,
            Tls::Established,
        )
        .map_err(late)?
    };
    match ending {
        Ending::Go(session) => {
            tracing::debug!(export = %session.name, "nbd client connected over TLS");
            transmission::serve(secured, &session, timeouts)
        }
        Ending::Left | Ending::StartTls => Ok(()),
    }
}

type ShutdownFn = Box<dyn Fn() + Send + Sync>;
type Connection = Box<dyn FnOnce(&Exports, &Settings) -> Result<(), ProtocolError> + Send>;

/// How a server serves its clients.
#[derive(Clone)]
pub struct Settings {
    /// Clients served at once; more are closed as they come.
    pub max_connections: usize,
    /// With it, each client must STARTTLS first.
    pub tls: Option<tls::ServerConfig>,
    pub timeouts: Timeouts,
}

/// A running server; dropping it stops accepting and closes every connection.
pub struct Server {
    listener: Arc<Listener>,
    stopping: Arc<AtomicBool>,
    connections: Arc<Mutex<BTreeMap<u64, ShutdownFn>>>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    /// Accept clients of `exports` on `listener`, at most `max_connections`
    /// at once; with `tls`, each must STARTTLS first. Default timeouts.
    pub fn start(
        listener: Listener,
        exports: Exports,
        max_connections: usize,
        tls: Option<tls::ServerConfig>,
    ) -> io::Result<Server> {
        Server::start_with(
            listener,
            exports,
            Settings { max_connections, tls, timeouts: Timeouts::default() },
        )
    }

    pub fn start_with(
        listener: Listener,
        exports: Exports,
        settings: Settings,
    ) -> io::Result<Server> {
        let listener = Arc::new(listener);
        let stopping = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<BTreeMap<u64, ShutdownFn>>> = Arc::default();
        let (l, s, c) = (listener.clone(), stopping.clone(), connections.clone());
        let accept = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(&l, &exports, &settings, &s, &c))?;
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
    settings: &Settings,
    stopping: &AtomicBool,
    connections: &Arc<Mutex<BTreeMap<u64, ShutdownFn>>>,
) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let max_connections = settings.max_connections;
    loop {
        let conn = listener.accept();
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let (stop, conn) = match conn {
            Ok(Some(c)) => c,
            // A peer the listener refused; it said why.
            Ok(None) => continue,
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
        let (exports, registry, settings) =
            (exports.clone(), connections.clone(), settings.clone());
        let spawned = std::thread::Builder::new().name("nbd-conn".into()).spawn(move || {
            let result = conn(&exports, &settings);
            registry.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            match result {
                Ok(()) => tracing::debug!("nbd client left"),
                Err(ProtocolError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    tracing::debug!("nbd client left mid-message");
                }
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
