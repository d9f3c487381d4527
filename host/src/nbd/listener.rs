//! Where the server listens, and who may connect there.
//!
//! - A Unix socket is created mode 0600 with no moment at which it is wider
//!   (bound in a private 0700 dir, then renamed into place), and each peer's
//!   uid is checked as it connects: root or the server's own uid, as on the
//!   agent's socket. Anyone else is closed, with a log line.
//! - TCP on loopback takes any client, as loopback NBD servers do. Beyond
//!   loopback, a client must hold a certificate the configured CA signed
//!   (mutual TLS): an address reachable from other nodes serves a whole disk
//!   to whoever connects. An operator may waive that explicitly, never
//!   TLS itself, which keeps the data off the wire in the clear.

use super::{Connection, Settings, ShutdownFn, Stream, serve_connection};
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Dead peers of a TCP connection are found by keepalive probes after this
/// much silence, then one probe every [`KEEPALIVE_INTERVAL`] (nine, Linux's
/// default count): an idle client is never closed for being idle, but a
/// node that vanished frees its connection in about 2½ minutes.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{}: {what}: {source}", path.display())]
    Unix { path: PathBuf, what: &'static str, source: io::Error },
    #[error("{}: a server already listens there", path.display())]
    InUse { path: PathBuf },
    #[error("{}: exists and is not a socket", path.display())]
    NotASocket { path: PathBuf },
    #[error("{addr}: {source}")]
    Tcp { addr: SocketAddr, source: io::Error },
    #[error(
        "{addr}: NBD beyond loopback is served only over TLS, with client certificates (--tls-cert, --tls-key and --tls-client-ca)"
    )]
    Cleartext { addr: SocketAddr },
    #[error(
        "{addr}: NBD beyond loopback requires client certificates: give --tls-client-ca, or --allow-unauthenticated-clients to let any client that reaches {addr} read and write the exports"
    )]
    Unauthenticated { addr: SocketAddr },
}

/// What a TCP listener's clients must show, as its TLS configuration says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Plain NBD: nothing.
    None,
    /// TLS without client certificates: the data is private on the wire,
    /// the exports open to every client.
    Tls,
    /// TLS, and a client certificate the configured CA signed.
    Certificates,
}

/// Where the server listens.
pub enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    /// Listen on a Unix socket at `path`, mode 0600, replacing a stale
    /// socket file.
    pub fn unix(path: &Path) -> Result<Listener, ListenError> {
        if UnixStream::connect(path).is_ok() {
            return Err(ListenError::InUse { path: path.to_path_buf() });
        }
        let failed =
            |what| move |source| ListenError::Unix { path: path.to_path_buf(), what, source };
        // Only a stale socket is replaced, never another kind of file.
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                std::fs::remove_file(path).map_err(failed("remove the stale socket"))?;
            }
            Ok(_) => return Err(ListenError::NotASocket { path: path.to_path_buf() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(failed("inspect")(e)),
        }
        Ok(Listener::Unix(bind_private(path)?, path.to_path_buf()))
    }

    /// Listen on TCP at `addr`. Beyond loopback only with TLS and client
    /// certificates, unless `allow_unauthenticated` (TLS still required).
    pub fn tcp(
        addr: SocketAddr,
        clients: ClientAuth,
        allow_unauthenticated: bool,
    ) -> Result<Listener, ListenError> {
        if !addr.ip().is_loopback() {
            match clients {
                ClientAuth::None => return Err(ListenError::Cleartext { addr }),
                ClientAuth::Tls if !allow_unauthenticated => {
                    return Err(ListenError::Unauthenticated { addr });
                }
                ClientAuth::Tls => {
                    tracing::warn!(%addr, "serving NBD beyond loopback WITHOUT client authentication (--allow-unauthenticated-clients): any client that reaches this address may read and write every export");
                }
                ClientAuth::Certificates => {}
            }
        }
        Ok(Listener::Tcp(
            TcpListener::bind(addr).map_err(|source| ListenError::Tcp { addr, source })?,
        ))
    }

    pub fn describe(&self) -> String {
        match self {
            Listener::Unix(_, p) => format!("unix:{}", p.display()),
            Listener::Tcp(l) => {
                l.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp".into())
            }
        }
    }

    /// The next client: how to shut it down, and how to serve it; `None`
    /// for a peer refused (and closed) here.
    pub(super) fn accept(&self) -> io::Result<Option<(ShutdownFn, Connection)>> {
        match self {
            Listener::Unix(l, path) => {
                let (s, _) = l.accept()?;
                if !peer_allowed(&s, path) {
                    return Ok(None);
                }
                Ok(Some(connection(s)?))
            }
            Listener::Tcp(l) => {
                let (s, peer) = l.accept()?;
                s.set_nodelay(true)?;
                let keepalive = socket2::TcpKeepalive::new()
                    .with_time(KEEPALIVE_IDLE)
                    .with_interval(KEEPALIVE_INTERVAL);
                if let Err(e) = socket2::SockRef::from(&s).set_tcp_keepalive(&keepalive) {
                    tracing::warn!(%peer, "nbd: cannot turn TCP keepalive on: {e}");
                }
                Ok(Some(connection(s)?))
            }
        }
    }

    /// Wake a blocked `accept` for good: on Linux, shutting a listening
    /// socket down makes it fail (no path or address needed, which may be
    /// gone by then).
    pub(super) fn wake(&self) {
        use std::os::fd::{AsFd, AsRawFd};
        let fd = match self {
            Listener::Unix(l, _) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        };
        let _ = nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }
}

fn connection<S: Stream>(s: S) -> io::Result<(ShutdownFn, Connection)> {
    let stop = s.shutdown_handle()?;
    let serve: Connection = Box::new(move |exports, settings: &Settings| {
        serve_connection(s, exports, settings.tls.as_ref(), &settings.timeouts)
    });
    Ok((stop, serve))
}

/// Root and the server's own uid may connect, as to the agent's socket;
/// anyone else is logged and closed.
fn peer_allowed(s: &UnixStream, path: &Path) -> bool {
    match nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials) {
        Ok(cred) if cred.uid() == 0 || cred.uid() == nix::unistd::geteuid().as_raw() => true,
        Ok(cred) => {
            tracing::warn!(socket = %path.display(), uid = cred.uid(), pid = cred.pid(), "refused an NBD client that is neither root nor this server's uid");
            false
        }
        Err(e) => {
            tracing::warn!(socket = %path.display(), "refused an NBD client whose credentials cannot be read: {e}");
            false
        }
    }
}

/// Bind a socket at `path` that is never wider than 0600: it is made in a
/// fresh 0700 dir beside `path` (so nobody else can reach it, whatever the
/// umask), narrowed there, and renamed into place. It is bound through the
/// dir's handle, which keeps the socket address short whatever `path`'s
/// length.
fn bind_private(path: &Path) -> Result<UnixListener, ListenError> {
    let failed = |what| move |source| ListenError::Unix { path: path.to_path_buf(), what, source };
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let staging =
        Staging::create(parent).map_err(failed("make a private dir beside the socket"))?;
    let dir = std::fs::File::open(&staging.0).map_err(failed("open the private dir"))?;
    let listener = {
        use std::os::fd::AsRawFd;
        UnixListener::bind(format!("/proc/self/fd/{}/socket", dir.as_raw_fd()))
            .map_err(failed("bind"))?
    };
    let made = staging.0.join("socket");
    std::fs::set_permissions(&made, std::fs::Permissions::from_mode(0o600))
        .map_err(failed("chmod 0600"))?;
    std::fs::rename(&made, path).map_err(failed("move into place"))?;
    Ok(listener)
}

/// A private dir; removed, with whatever is left in it, when dropped.
struct Staging(PathBuf);

impl Staging {
    fn create(parent: &Path) -> io::Result<Staging> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = parent.join(format!(
            ".nbd-socket-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let staging = Staging(dir);
        // The mode given to mkdir is narrowed by the umask; never widened.
        std::fs::set_permissions(&staging.0, std::fs::Permissions::from_mode(0o700))?;
        Ok(staging)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
