//! The pod attachment path: what the CNI verbs, start-up reconciliation
//! and the repair loop do to this node's pods.
//!
//! - [`Attacher`] owns what they need; its methods are the verbs.
//! - [`add`]: reserve → program → persist; one [`add::Rollback`] guard undoes
//!   a reservation on every failure and when the ADD is dropped half-way.
//! - [`check`]: observe ([`observe`]) → compare ([`observed`], pure).
//! - [`del`] and [`gc`]: tear down, idempotently.
//! - [`startup`]: keeps every attachment it cannot prove gone, reports the
//!   ones it cannot verify.
//! - [`repair`]: the level-triggered loop for the bridge, the routes to
//!   routed pods and the node settings the mode needs.
//! - [`guard`]: what each pod may send, from the records.
//! - [`status`]: readiness, observed only.
//! - [`ordering`]: one verb at a time per attachment.
//! - The modes, one file each behind [`Driver`]: [`bridge`], [`routed`].
//!
//! Verbs return [`AttachError`]; `cni_server` turns it into CNI error codes.

mod add;
mod attacher;
mod bridge;
mod check;
mod del;
mod error;
mod gc;
mod guard;
mod names;
mod observe;
mod observed;
mod ordering;
pub mod repair;
mod routed;
mod startup;
mod status;

use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

pub use attacher::{Attacher, KubeAccess};
pub use error::AttachError;
pub use ordering::KeyLocks;

use crate::attachment::Attachment;
use crate::dataplane::DataplaneError;
use crate::dataplane::link::AttachSpec;
use crate::dataplane::netns::BlockingNetns;
use observed::ObservedHost;

/// The longest a kernel call on a request path may take. Netlink answers in
/// microseconds; a call this slow means a wedged kernel or a stuck path
/// (an unresponsive mount under CNI_NETNS), and the verb fails instead of
/// holding the attachment (and the runtime) for ever.
pub const KERNEL_TIMEOUT: Duration = Duration::from_secs(10);

/// What differs between the ways a pod joins the node: how its interface is
/// made and wired on both ends (`attach`), what the node's end must look
/// like (`check_host`, and the routes the repair loop puts back), and the
/// node settings the mode needs. The building blocks are `dataplane::link`'s,
/// which know no mode.
///
/// A third mode is a file of its own implementing this trait, plus its
/// [`Attachment`] value and a line in [`driver`]. The likely one, a tap for
/// VM runtimes (the pod's end a tap device a hypervisor opens instead of a
/// veth peer), fits it: `attach` makes the tap and wires the node's end as
/// either existing mode does, and the rest is the same. What it would also
/// need is outside the trait: DEL and GC find pods by their host veth name
/// (`names::host_veth_name`), so a tap's host end must be named the same way.
pub trait Driver: Send + Sync {
    fn mode(&self) -> Attachment;

    /// The prefix length of the pod's address on its interface, for an
    /// address of `block` (the pod CIDR or the IPv6 block).
    fn pod_prefix(&self, block: IpNet) -> u8;

    /// Makes the pod's interface and the node's end of it as `spec` says
    /// (`bridge`: the node bridge's index, which holds the gateways).
    /// Blocking: the caller runs it off the CNI server's thread. On failure
    /// the caller deletes the host veth, which removes what was made on it.
    fn attach(&self, pod: &mut BlockingNetns, spec: &AttachSpec, bridge: u32) -> Result<(), DataplaneError>;

    /// Whether the node reaches the pod by a /32 (and /128) route on the
    /// host veth, which the repair loop puts back when it goes.
    fn routes_to_pod(&self) -> bool;

    /// What the host end must look like besides existing and being up;
    /// `Err` says what differs.
    fn check_host(&self, host: &ObservedHost) -> Result<(), String>;

    /// Turns on the node settings pods of this mode need (`ipv6`: pods get
    /// IPv6 addresses too); checked at start-up and every resync. Returns
    /// the names of those that had to be turned on.
    fn ensure_node_settings(&self, ipv6: bool) -> Result<Vec<&'static str>, DataplaneError>;

    /// The routes of one family a runtime sets on the pod's interface, in
    /// order, as the CNI result lists them: (destination, gateway; `None`:
    /// on-link).
    fn pod_routes(&self, gateway: IpAddr) -> Vec<(IpNet, Option<IpAddr>)> {
        vec![(default_route(gateway), Some(gateway))]
    }

    /// The pod's address `ip` (of `block`) as its interface carries it.
    fn pod_address(&self, ip: IpAddr, block: IpNet) -> IpNet {
        // A prefix from `pod_prefix` is at most the family's length.
        IpNet::new(ip, self.pod_prefix(block)).unwrap_or_else(|_| IpNet::from(ip))
    }
}

/// `0.0.0.0/0` or `::/0`, by the family of `gateway`.
pub fn default_route(gateway: IpAddr) -> IpNet {
    match gateway {
        IpAddr::V4(_) => IpNet::V4(Ipv4Net::default()),
        IpAddr::V6(_) => IpNet::V6(Ipv6Net::default()),
    }
}

/// The driver of a mode.
pub fn driver(mode: Attachment) -> &'static dyn Driver {
    match mode {
        Attachment::Bridge => &bridge::Bridge,
        Attachment::Routed => &routed::Routed,
    }
}

/// Awaits a kernel call of a request path, at most [`KERNEL_TIMEOUT`].
pub async fn deadline<T>(what: &str, call: impl Future<Output = Result<T, DataplaneError>>) -> Result<T, AttachError> {
    deadline_within(KERNEL_TIMEOUT, what, call).await
}

async fn deadline_within<T>(
    limit: Duration,
    what: &str,
    call: impl Future<Output = Result<T, DataplaneError>>,
) -> Result<T, AttachError> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r.map_err(|source| AttachError::Kernel { what: what.to_owned(), source }),
        Err(_) => Err(AttachError::TimedOut { what: what.to_owned(), after: limit }),
    }
}

/// Runs blocking kernel work (entering a pod's namespace, ADD's batched
/// netlink) on the blocking pool, so the CNI server's thread never waits on
/// it, and waits at most [`KERNEL_TIMEOUT`]. A call that times out goes on
/// in the background; whatever it creates afterwards has no record, and GC
/// removes it.
pub async fn off_thread<T: Send + 'static, E: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<Result<T, E>, AttachError> {
    match tokio::time::timeout(KERNEL_TIMEOUT, tokio::task::spawn_blocking(work)).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(join)) => Err(AttachError::Internal(format!("{what}: the task failed: {join}"))),
        Err(_) => Err(AttachError::TimedOut { what: what.to_owned(), after: KERNEL_TIMEOUT }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_pods_carry_their_address_alone() {
        let cidr: IpNet = "10.1.2.0/24".parse().expect("cidr");
        let ip = "10.1.2.7".parse().expect("ip");
        assert_eq!(driver(Attachment::Bridge).pod_address(ip, cidr).to_string(), "10.1.2.7/24");
        assert_eq!(driver(Attachment::Routed).pod_address(ip, cidr).to_string(), "10.1.2.7/32");
        assert_eq!(driver(Attachment::Routed).mode(), Attachment::Routed);
        let (ip6, block): (IpAddr, IpNet) =
            ("fd00:0:0:2::7".parse().expect("ip"), "fd00:0:0:2::/64".parse().expect("block"));
        assert_eq!(driver(Attachment::Bridge).pod_address(ip6, block).to_string(), "fd00:0:0:2::7/64");
        assert_eq!(driver(Attachment::Routed).pod_address(ip6, block).to_string(), "fd00:0:0:2::7/128");
    }

    /// A runtime that configures the interface from the result alone (a VM
    /// runtime does) must be able to add every route in the order listed:
    /// a /32 pod reaches its gateway only by the on-link route before it.
    #[test]
    fn routed_pods_list_the_route_to_their_gateway_first() {
        let show = |mode, gw: &str| -> Vec<String> {
            driver(mode)
                .pod_routes(gw.parse().expect("gw"))
                .iter()
                .map(|(dst, via)| format!("{dst} via {}", via.map(|g| g.to_string()).unwrap_or("link".into())))
                .collect()
        };
        assert_eq!(show(Attachment::Bridge, "10.1.2.1"), ["0.0.0.0/0 via 10.1.2.1"]);
        assert_eq!(show(Attachment::Routed, "10.1.2.1"), ["10.1.2.1/32 via link", "0.0.0.0/0 via 10.1.2.1"]);
        assert_eq!(show(Attachment::Bridge, "fd00::1"), ["::/0 via fd00::1"]);
        assert_eq!(show(Attachment::Routed, "fd00::1"), ["fd00::1/128 via link", "::/0 via fd00::1"]);
    }

    #[tokio::test]
    async fn a_stuck_kernel_call_times_out() {
        let stuck = std::future::pending::<Result<(), DataplaneError>>();
        let e = deadline_within(Duration::from_millis(20), "look up eth0", stuck).await.expect_err("times out");
        assert!(matches!(e, AttachError::TimedOut { .. }), "{e}");
        assert!(e.to_string().contains("look up eth0"), "{e}");
    }
}
