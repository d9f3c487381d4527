//! A gRPC channel to a Unix socket: what kubelet does to reach a driver,
//! for the agent's own commands, its tests and its benchmark.

use std::path::PathBuf;
use tonic::transport::{Channel, Endpoint, Uri};

/// Connect to the gRPC server at `socket`.
pub async fn connect(socket: PathBuf) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by the API and unused: the connector dials the socket.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}
