//! The gRPC client to the agent's Unix socket, with bounded waits so that a
//! dead or stuck agent never hangs the container runtime.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;
use weft_proto::cni::v1::cni_client::CniClient;

/// How long to wait for the agent to accept the connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one verb may take end to end. Kubelet retries failed ADDs, so a
/// clear failure beats an open-ended wait.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long STATUS may take. The runtime asks for it on every status query
/// of kubelet's and waits on it, so a hung agent must turn into a quick
/// "not ready" rather than a runtime that looks down.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(5);

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

pub async fn connect(socket: &Path) -> Result<CniClient<Channel>, ConnectError> {
    if !socket.exists() {
        return Err(ConnectError::NoSocket(socket.to_owned()));
    }
    let path = socket.to_owned();
    // The URI is required by the API but unused: the connector dials the socket.
    let endpoint = Endpoint::from_static("http://weft-agent").timeout(REQUEST_TIMEOUT);
    let connecting = endpoint.connect_with_connector(service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
    }));
    let channel = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| ConnectError::Timeout(socket.to_owned(), CONNECT_TIMEOUT))?
        .map_err(|source| ConnectError::Connect { path: socket.to_owned(), source })?;
    Ok(CniClient::new(channel))
}
