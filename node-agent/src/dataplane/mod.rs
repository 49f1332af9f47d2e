//! The node's kernel dataplane, through rtnetlink. Only this module talks to
//! the kernel; what should exist is decided by its callers.

pub mod bridge_netfilter;
pub mod conntrack_events;
pub mod entries;
pub mod exec;
pub mod iptables;
pub mod ipv6_reach;
pub mod link;
pub mod netlink_blocking;
pub mod netlink_datagram;
pub mod netns;
pub mod probe;
pub mod routes;
pub mod sysctl;
pub mod tun;
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

/// Reads one whole dump (`what` names it in errors). A netlink socket runs
/// one dump at a time, and the agent's tasks share the host's socket: the
/// kernel refuses a dump that arrives while another is unfinished (EBUSY).
/// The other ends within milliseconds, so the dump is asked for again,
/// briefly; `request` builds (and sends) it anew each time.
pub(crate) async fn dump<T, S>(what: &str, mut request: impl FnMut() -> S) -> Result<Vec<T>, DataplaneError>
where
    S: futures::TryStream<Ok = T, Error = rtnetlink::Error> + Unpin,
{
    use futures::TryStreamExt;
    const RETRIES: u32 = 8;
    let mut pause = std::time::Duration::from_millis(1);
    let mut attempt = 0;
    loop {
        let mut out = Vec::new();
        let mut stream = request();
        let read = async {
            while let Some(item) = stream.try_next().await? {
                out.push(item);
            }
            Ok(())
        };
        match read.await {
            Ok(()) => return Ok(out),
            Err(e) if errno(&e) == Some(libc::EBUSY) && attempt < RETRIES => {
                attempt += 1;
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            Err(e) => return Err(op(what)(e)),
        }
    }
}

pub(crate) fn op(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> DataplaneError {
    let op = op.into();
    move |source| DataplaneError::Netlink { op, source }
}
