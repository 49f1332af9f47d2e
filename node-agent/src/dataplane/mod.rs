//! The node's kernel dataplane, through rtnetlink. Only this module talks to
//! the kernel; what should exist is decided by its callers.

pub mod bridge_netfilter;
pub mod entries;
pub mod exec;
pub mod iptables;
pub mod ipv6_reach;
pub mod link;
pub mod masquerade;
pub mod netlink_blocking;
pub mod netns;
pub mod routes;
pub mod sysctl;
pub mod underlay;
pub mod vxlan;

/// A failed kernel operation, naming what was attempted.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("{op}: {source}")]
    Netlink { op: String, source: rtnetlink::Error },
    #[error(transparent)]
    Netns(#[from] netns::NetnsError),
    #[error("{op}: {source}")]
    Kernel { op: String, source: std::io::Error },
    #[error("{0}")]
    Unexpected(String),
}

/// Errno of a netlink NACK, if that is what `e` is.
pub fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => Some(-m.raw_code()),
        _ => None,
    }
}

/// Like [`op`], for requests on a blocking socket.
pub(crate) fn kernel_op(op: impl Into<String>) -> impl FnOnce(std::io::Error) -> DataplaneError {
    let op = op.into();
    move |source| DataplaneError::Kernel { op, source }
}

pub(crate) fn op(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> DataplaneError {
    let op = op.into();
    move |source| DataplaneError::Netlink { op, source }
}
