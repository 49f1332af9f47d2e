//! The address pool of one pod CIDR: which addresses may be handed out and
//! which one comes next; and the IPv6 block of a dual-stack node, whose
//! addresses follow the IPv4 ones.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("pod CIDR {0} is too small: it needs at least a /30 (network, gateway, one pod, broadcast)")]
    TooSmall(Ipv4Net),
    #[error("IPv6 block {v6} holds fewer addresses than pod CIDR {v4}: a pod's IPv6 address has its IPv4 host number")]
    Ipv6TooSmall { v6: Ipv6Net, v4: Ipv4Net },
}

/// Usable addresses of a pod CIDR: everything but the network address, the
/// gateway (the first host address, on the node's bridge) and broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    cidr: Ipv4Net,
}

impl Pool {
    pub fn new(cidr: Ipv4Net) -> Result<Self, PoolError> {
        let cidr = cidr.trunc();
        if cidr.prefix_len() > 30 {
            return Err(PoolError::TooSmall(cidr));
        }
        Ok(Self { cidr })
    }

    pub fn cidr(&self) -> Ipv4Net {
        self.cidr
    }

    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.cidr.network()) + 1)
    }

    /// The gateway with the pool's prefix length, as it sits on the bridge.
    pub fn gateway_net(&self) -> Ipv4Net {
        Ipv4Net::new(self.gateway(), self.cidr.prefix_len()).unwrap_or(self.cidr)
    }

    fn first(&self) -> u32 {
        u32::from(self.cidr.network()) + 2
    }

    fn last(&self) -> u32 {
        u32::from(self.cidr.broadcast()) - 1
    }

    /// How many addresses pods can get.
    pub fn size(&self) -> u32 {
        self.last() - self.first() + 1
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        (self.first()..=self.last()).contains(&u32::from(ip))
    }

    /// The next free address after `after` (wrapping around), so that a
    /// just-released address is not reused at once; `None` when full.
    pub fn next_free<V>(&self, used: &BTreeMap<Ipv4Addr, V>, after: Option<Ipv4Addr>) -> Option<Ipv4Addr> {
        let (first, last) = (self.first(), self.last());
        let start = match after.map(u32::from) {
            Some(a) if (first..last).contains(&a) => a + 1,
            _ => first,
        };
        (start..=last).chain(first..start).map(Ipv4Addr::from).find(|ip| !used.contains_key(ip))
    }
}

/// The IPv6 block of a dual-stack node. A pod's IPv6 address has the host
/// number of its IPv4 address (10.244.1.7 → fd00:10:244:1::7 in
/// fd00:10:244:1::/64), and so has the gateway: the IPv4 IPAM record is the
/// record of both, and a pod keeps both addresses or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Block {
    cidr: Ipv6Net,
    v4: Pool,
}

/// Whether IPv6 block `v6` has room for every host number of `v4`.
pub fn ipv6_block_fits(v6: Ipv6Net, v4: Ipv4Net) -> bool {
    128 - v6.prefix_len() >= 32 - v4.prefix_len()
}

impl Ipv6Block {
    pub fn new(cidr: Ipv6Net, v4: Pool) -> Result<Self, PoolError> {
        let cidr = cidr.trunc();
        if !ipv6_block_fits(cidr, v4.cidr) {
            return Err(PoolError::Ipv6TooSmall { v6: cidr, v4: v4.cidr });
        }
        Ok(Self { cidr, v4 })
    }

    pub fn cidr(&self) -> Ipv6Net {
        self.cidr
    }

    /// The IPv6 address of the pod with IPv4 address `ip` (of the pool).
    pub fn address_of(&self, ip: Ipv4Addr) -> Ipv6Addr {
        let host = u32::from(ip).wrapping_sub(u32::from(self.v4.cidr.network()));
        Ipv6Addr::from(u128::from(self.cidr.network()) | u128::from(host))
    }

    pub fn gateway(&self) -> Ipv6Addr {
        self.address_of(self.v4.gateway())
    }

    /// The gateway with the block's prefix length, as it sits on the bridge.
    pub fn gateway_net(&self) -> Ipv6Net {
        Ipv6Net::new(self.gateway(), self.cidr.prefix_len()).unwrap_or(self.cidr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_ipv6_address_has_its_ipv4_host_number() {
        let v4 = pool("10.244.1.0/24");
        let b = Ipv6Block::new("fd00:10:244:1::/64".parse().unwrap(), v4).unwrap();
        assert_eq!(b.address_of("10.244.1.7".parse().unwrap()).to_string(), "fd00:10:244:1::7");
        assert_eq!(b.address_of("10.244.1.254".parse().unwrap()).to_string(), "fd00:10:244:1::fe");
        assert_eq!(b.gateway_net().to_string(), "fd00:10:244:1::1/64");
        let tight = Ipv6Block::new("fd00::100/120".parse().unwrap(), v4).unwrap();
        assert_eq!(tight.address_of("10.244.1.255".parse().unwrap()).to_string(), "fd00::1ff");
        let e = Ipv6Block::new("fd00::/121".parse().unwrap(), v4).unwrap_err();
        assert!(e.to_string().contains("fewer addresses"), "{e}");
    }

    fn pool(s: &str) -> Pool {
        Pool::new(s.parse().unwrap()).unwrap()
    }

    #[test]
    fn never_hands_out_network_gateway_or_broadcast() {
        let p = pool("10.0.0.0/29");
        assert_eq!(p.gateway(), Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(p.size(), 5);
        let mut used = BTreeMap::new();
        let mut last = None;
        while let Some(ip) = p.next_free(&used, last) {
            used.insert(ip, ());
            last = Some(ip);
        }
        let got: Vec<_> = used.keys().map(|ip| ip.octets()[3]).collect();
        assert_eq!(got, vec![2, 3, 4, 5, 6]);
    }

    #[test]
    fn next_fit_wraps_and_skips_used() {
        let p = pool("10.0.0.0/29");
        let used: BTreeMap<_, _> = [(Ipv4Addr::new(10, 0, 0, 2), ())].into();
        assert_eq!(p.next_free(&used, Some(Ipv4Addr::new(10, 0, 0, 6))), Some(Ipv4Addr::new(10, 0, 0, 3)));
        assert_eq!(p.next_free(&used, Some(Ipv4Addr::new(10, 0, 0, 4))), Some(Ipv4Addr::new(10, 0, 0, 5)));
    }

    #[test]
    fn rejects_tiny_cidrs_and_normalises_host_bits() {
        assert!(Pool::new("10.0.0.0/31".parse().unwrap()).is_err());
        assert_eq!(pool("10.0.0.77/24").cidr().to_string(), "10.0.0.0/24");
    }
}
