//! Bridged pods: the host veth is a port of the node bridge, which carries
//! the gateway address; pods share the pod CIDR as one L2 segment.

use ipnet::IpNet;
use netlink_packet_route::neighbour::NeighbourState;

use super::Driver;
use super::observed::ObservedHost;
use crate::attachment::Attachment;
use crate::dataplane::link::{self, AttachSpec};
use crate::dataplane::netlink_blocking::BlockingNetlink;
use crate::dataplane::netns::BlockingNetns;
use crate::dataplane::{DataplaneError, bridge_netfilter, kernel_op};

pub struct Bridge;

impl Driver for Bridge {
    fn mode(&self) -> Attachment {
        Attachment::Bridge
    }

    fn pod_prefix(&self, block: IpNet) -> u8 {
        block.prefix_len()
    }

    /// The host end is a port of the bridge with hairpin on: with bridge
    /// netfilter, a pod's traffic to its own host port is DNATed while being
    /// bridged and must be allowed back out of the port it came in on. The
    /// node's neighbour entry for each address is set as the pod's first
    /// packet would teach it: a previous holder of the address (a deleted
    /// pod) may have left a still-valid entry with its MAC, and traffic the
    /// node routes to the pod (from other nodes) would go there for seconds.
    fn attach(&self, pod: &mut BlockingNetns, spec: &AttachSpec, bridge: u32) -> Result<(), DataplaneError> {
        let mut then = vec![link::hairpin(&spec.host_veth)];
        for a in &spec.addresses {
            then.push(link::set_neighbour(bridge, a.address.addr(), spec.pod_mac, NeighbourState::Reachable));
        }
        let mut host = BlockingNetlink::new().map_err(kernel_op("open a netlink socket"))?;
        link::create_veth(&mut host, pod, spec, Some(bridge), then)?;
        link::configure_pod(&mut pod.netlink, spec, false)
    }

    fn routes_to_pod(&self) -> bool {
        false
    }

    fn check_host(&self, host: &ObservedHost) -> Result<(), String> {
        let Some(bridge) = host.bridge else {
            return Err(format!("bridge {} is missing", host.bridge_name));
        };
        if host.controller != Some(bridge) {
            return Err(format!("host veth {} is not attached to bridge {}", host.name, host.bridge_name));
        }
        Ok(())
    }

    /// Pods of this node reach each other over the bridge: iptables (policy,
    /// host ports) sees that traffic only through bridge netfilter.
    fn ensure_node_settings(&self, _ipv6: bool) -> Result<Vec<&'static str>, DataplaneError> {
        Ok(bridge_netfilter::ensure()?.then_some("bridge_netfilter").into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::observed::tests::host;

    #[test]
    fn the_host_end_must_be_a_port_of_the_bridge() {
        let mut h = host();
        assert_eq!(Bridge.check_host(&h), Ok(()));
        h.controller = None;
        assert!(Bridge.check_host(&h).unwrap_err().contains("not attached to bridge weft0"));
        h.bridge = None;
        assert!(Bridge.check_host(&h).unwrap_err().contains("bridge weft0 is missing"));
    }
}
