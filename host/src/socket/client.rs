//! Asking a running agent over its socket, for the CLI's status commands.

use super::protocol::{self, FrameError, Request, Response};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The cause is part of the message, not a `source`: anyhow's `{:#}`
/// would print it twice.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the agent at {}: {error}; is `volagent agent` running on this node?", socket.display())]
    Unreachable { socket: PathBuf, error: std::io::Error },
    #[error("the agent at {}: {error}", socket.display())]
    Exchange { socket: PathBuf, error: FrameError },
}

/// Send `request` to the agent at `socket` and read its answer, waiting at
/// most `timeout` for each read and write.
pub fn ask(socket: &Path, request: Request, timeout: Duration) -> Result<Response, ClientError> {
    let mut stream = UnixStream::connect(socket)
        .map_err(|error| ClientError::Unreachable { socket: socket.to_path_buf(), error })?;
    let exchange =
        |error: FrameError| ClientError::Exchange { socket: socket.to_path_buf(), error };
    stream.set_read_timeout(Some(timeout)).map_err(|e| exchange(e.into()))?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| exchange(e.into()))?;
    protocol::exchange(&mut stream, request).map_err(exchange)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_agent_is_a_clear_error_naming_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let e = ask(&socket, Request::Status, Duration::from_secs(1)).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, ClientError::Unreachable { .. }), "{e:?}");
        assert!(
            text.starts_with(&format!("cannot reach the agent at {}: ", socket.display())),
            "{text}"
        );
        let chain = format!("{:#}", anyhow::Error::from(e));
        assert_eq!(chain.matches("No such file").count(), 1, "the cause once: {chain}");
    }
}
