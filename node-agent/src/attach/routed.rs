//! Routed pods: the host veth has no master. The pod carries its address as
//! a /32 (its IPv6 address as a /128) with an on-link default route via the
//! gateway; the node reaches it by a /32 (/128) route on the host veth. Both
//! ends know each other's MAC from the start (permanent neighbour entries),
//! so nothing depends on the node's ARP or neighbour discovery settings, and
//! every packet saves the bridge hop at both ends.

use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_route::RouteNetlinkMessage;

use super::Driver;
use super::observed::ObservedHost;
use crate::attachment::Attachment;
use crate::dataplane::link::{self, AttachSpec, PodAddress};
use crate::dataplane::netlink_blocking::BlockingNetlink;
use crate::dataplane::netns::BlockingNetns;
use crate::dataplane::{DataplaneError, kernel_op, sysctl};

pub struct Routed;

impl Driver for Routed {
    fn mode(&self) -> Attachment {
        Attachment::Routed
    }

    fn pod_prefix(&self, block: IpNet) -> u8 {
        block.max_prefix_len()
    }

    /// The pod's own namespace reaches the gateway by an on-link default
    /// route; a runtime that sets the interface up from the result instead
    /// (a VM guest) needs the gateway's /32 (/128) before the default route
    /// via it.
    fn pod_routes(&self, gateway: IpAddr) -> Vec<(IpNet, Option<IpAddr>)> {
        vec![(IpNet::from(gateway), None), (super::default_route(gateway), Some(gateway))]
    }

    /// No master for the host end: the node routes to the pod on it
    /// (`link::route_to_pod`, which the repair loop shares), and the pod's
    /// gateway is off its /32 subnet. The node's IPv6 side answers for the
    /// gateway on the veth (proxy NDP).
    fn attach(&self, pod: &mut BlockingNetns, spec: &AttachSpec, _bridge: u32) -> Result<(), DataplaneError> {
        let mut host = BlockingNetlink::new().map_err(kernel_op("open a netlink socket"))?;
        let answers = link::create_veth(&mut host, pod, spec, None, vec![link::look_up(&spec.host_veth)])?;
        link::configure_pod(&mut pod.netlink, spec, true)?;
        let Some(RouteNetlinkMessage::NewLink(veth)) = answers.first() else {
            return Err(DataplaneError::Unexpected(format!("{} did not appear on the node", spec.host_veth)));
        };
        let addresses: Vec<_> = spec.addresses.iter().map(PodAddress::pair).collect();
        link::route_to_pod(&mut host, veth.header.index, &addresses, spec.pod_mac)?;
        if spec.addresses.iter().any(|a| a.address.addr().is_ipv6()) {
            sysctl::enable_proxy_ndp(&spec.host_veth)?;
        }
        Ok(())
    }

    fn routes_to_pod(&self) -> bool {
        true
    }

    fn check_host(&self, host: &ObservedHost) -> Result<(), String> {
        match host.unrouted.first() {
            None => Ok(()),
            Some(ip) => Err(format!("the node has no route to {ip} via {}", host.name)),
        }
    }

    /// Routed pods reach even each other through the node's forwarding path,
    /// over IPv6 too when they have it.
    fn ensure_node_settings(&self, ipv6: bool) -> Result<Vec<&'static str>, DataplaneError> {
        let mut repaired = Vec::from_iter(sysctl::ensure_ipv4_forwarding()?.then_some("ip_forward"));
        if ipv6 && sysctl::ensure_ipv6_forwarding()? {
            repaired.push("ipv6_forwarding");
        }
        Ok(repaired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::observed::tests::host;

    #[test]
    fn the_node_must_route_to_the_pod() {
        let mut h = host();
        assert_eq!(Routed.check_host(&h), Ok(()));
        h.unrouted = vec!["10.1.2.7".parse().unwrap()];
        assert!(Routed.check_host(&h).unwrap_err().contains("no route to 10.1.2.7 via weftv0123456789"));
        // A missing IPv6 route names the IPv6 address.
        h.unrouted = vec!["fd00::7".parse().unwrap()];
        assert!(Routed.check_host(&h).unwrap_err().contains("no route to fd00::7 via weftv0123456789"));
    }
}
