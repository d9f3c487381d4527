//! Listening sockets every server shares (the agent socket, CSI, kubelet
//! registration, metrics, the admission webhook): binding a root-only Unix
//! socket beside no live peer, and pausing an accept loop that ran out of
//! descriptors. A leaf: servers of every edge use it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixListener;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("socket {}: {source}", path.display())]
    Bind { path: PathBuf, source: std::io::Error },
    #[error("socket {}: another agent is listening on it", path.display())]
    InUse { path: PathBuf },
}

/// Refuse to start beside a live agent on the same socket.
pub fn ensure_free(path: &Path) -> Result<(), ListenError> {
    if path.exists() && std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ListenError::InUse { path: path.to_path_buf() });
    }
    Ok(())
}

/// Bind the socket: a stale socket file left by a dead agent is replaced; a
/// live one is not.
pub fn bind(path: &Path) -> Result<UnixListener, ListenError> {
    UnixListener::from_std(bind_std(path)?)
        .map_err(|source| ListenError::Bind { path: path.to_path_buf(), source })
}

/// [`bind`], the listener not yet registered with a runtime (non-blocking,
/// as a runtime takes it): for a socket served on another runtime.
pub fn bind_std(path: &Path) -> Result<std::os::unix::net::UnixListener, ListenError> {
    let err = |source| ListenError::Bind { path: path.to_path_buf(), source };
    ensure_free(path)?;
    if path.exists() {
        std::fs::remove_file(path).map_err(err)?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(err)?;
    listener.set_nonblocking(true).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

/// How an accept loop waits after a failed accept (EMFILE, ENFILE,
/// ENOBUFS, ENOMEM): doubling pauses from 10 ms to 1 s, one log line per
/// streak of failures, never giving up.
#[derive(Debug)]
pub struct AcceptPause {
    next: Duration,
    failures: u64,
}

impl Default for AcceptPause {
    fn default() -> Self {
        AcceptPause { next: Duration::from_millis(10), failures: 0 }
    }
}

impl AcceptPause {
    pub fn reset(&mut self) {
        if self.failures > 0 {
            tracing::info!(failures = self.failures, "accepting connections again");
        }
        *self = AcceptPause::default();
    }

    pub async fn wait(&mut self, listener: &str, e: &std::io::Error) {
        tokio::time::sleep(self.failed(listener, e)).await;
    }

    /// [`wait`](Self::wait) for a blocking accept loop.
    pub fn wait_blocking(&mut self, listener: &str, e: &std::io::Error) {
        std::thread::sleep(self.failed(listener, e));
    }

    fn failed(&mut self, listener: &str, e: &std::io::Error) -> Duration {
        if self.failures == 0 {
            tracing::warn!("{listener}: cannot accept a connection ({e}); pausing and retrying");
        }
        self.failures += 1;
        let pause = self.next;
        self.next = (self.next * 2).min(Duration::from_secs(1));
        pause
    }
}
