//! The gRPC client to the agent's Unix socket, with bounded waits so that a
//! dead or stuck agent never hangs the container runtime.

use std::path::Path;
use std::time::Duration;

use tonic::transport::Channel;
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

pub use weft_proto::unix::ConnectError;

pub async fn connect(socket: &Path) -> Result<CniClient<Channel>, ConnectError> {
    Ok(CniClient::new(weft_proto::unix::channel(socket, CONNECT_TIMEOUT, Some(REQUEST_TIMEOUT)).await?))
}
