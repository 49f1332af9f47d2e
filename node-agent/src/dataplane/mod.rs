//! The node's kernel dataplane, through rtnetlink. Only this module talks to
//! the kernel; what should exist is decided by its callers.

pub mod iptables;
pub mod link;
// The overlay's kernel layer; used by `overlay`, which is not wired yet.
pub mod masquerade;
pub mod routes;
pub mod underlay;
pub mod vxlan;

/// A failed kernel operation, naming what was attempted.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("{op}: {source}")]
    Netlink { op: String, source: rtnetlink::Error },
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
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

pub(crate) fn op(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> DataplaneError {
    let op = op.into();
    move |source| DataplaneError::Netlink { op, source }
}
