//! What can go wrong on the attachment path, in the domain's terms.
//! `cni_server` maps each kind to its CNI error code, in one place.

use std::time::Duration;

use crate::dataplane::DataplaneError;
use crate::hostport::HostPortError;
use crate::ipam::IpamError;

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The runtime's request is unusable (environment, CNI_NETNS).
    #[error("{0}")]
    InvalidRequest(String),
    /// The network configuration (or prevResult) is unusable.
    #[error("{0}")]
    InvalidConfig(String),
    /// prevResult could not be decoded.
    #[error("{0}")]
    Decode(String),
    #[error("no attachment for container {container_id} interface {ifname}")]
    Unknown { container_id: String, ifname: String },
    #[error(transparent)]
    Ipam(#[from] IpamError),
    #[error(transparent)]
    HostPorts(#[from] HostPortError),
    /// CHECK found the attachment differs from what ADD left.
    #[error("{0}")]
    CheckFailed(String),
    /// The node cannot attach pods now (STATUS, readiness).
    #[error("{0}")]
    NotReady(String),
    /// No pod address is left (STATUS, readiness).
    #[error("{0}")]
    NoAddressLeft(String),
    /// A dependency (the API) is briefly unavailable: the runtime should retry.
    #[error("{0}")]
    TryAgain(String),
    #[error("{what}: {source}")]
    Kernel { what: String, source: DataplaneError },
    #[error("{what}: no answer within {after:?}")]
    TimedOut { what: String, after: Duration },
    #[error("{0}")]
    Internal(String),
}
