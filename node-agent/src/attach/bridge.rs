//! Bridged pods: the host veth is a port of the node bridge, which carries
//! the gateway address; pods share the pod CIDR as one L2 segment.

use ipnet::IpNet;

use super::Driver;
use super::observed::ObservedHost;
use crate::attachment::Attachment;
use crate::dataplane::link::HostSide;
use crate::dataplane::{DataplaneError, bridge_netfilter};

pub struct Bridge;

impl Driver for Bridge {
    fn mode(&self) -> Attachment {
        Attachment::Bridge
    }

    fn pod_prefix(&self, block: IpNet) -> u8 {
        block.prefix_len()
    }

    fn host_side(&self, bridge_index: u32) -> HostSide {
        HostSide::Bridge(bridge_index)
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
