//! A gRPC channel to the agent's Unix socket, with bounded waits so that a
//! dead or stuck agent never hangs its caller (weft-cni, the `weft` CLI).

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

/// Why the agent could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("weft-agent socket {0} does not exist (is the weft-agent running on this node?)")]
    NoSocket(PathBuf),
    #[error("weft-agent did not accept a connection on {0} within {1:?}")]
    Timeout(PathBuf, Duration),
    #[error("cannot connect to weft-agent on {path}: {source}")]
    Connect { path: PathBuf, source: tonic::transport::Error },
}

/// A channel to `socket`: connected within `connect_timeout`, each request
/// bounded by `request_timeout` (None: unbounded, for streams).
pub async fn channel(
    socket: &Path,
    connect_timeout: Duration,
    request_timeout: Option<Duration>,
) -> Result<Channel, ConnectError> {
    if !socket.exists() {
        return Err(ConnectError::NoSocket(socket.to_owned()));
    }
    let path = socket.to_owned();
    // The URI is required by the API but unused: the connector dials the socket.
    let mut endpoint = Endpoint::from_static("http://weft-agent");
    if let Some(t) = request_timeout {
        endpoint = endpoint.timeout(t);
    }
    let connecting = endpoint.connect_with_connector(service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
    }));
    tokio::time::timeout(connect_timeout, connecting)
        .await
        .map_err(|_| ConnectError::Timeout(socket.to_owned(), connect_timeout))?
        .map_err(|source| ConnectError::Connect { path: socket.to_owned(), source })
}
