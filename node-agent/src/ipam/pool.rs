//! The address pool of one pod CIDR, of either family: which addresses may
//! be handed out and which one comes next; and the IPv6 block of a
//! dual-stack node, whose addresses follow the IPv4 ones.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("pod CIDR {0} is too small: it needs at least 4 addresses (network, gateway, one pod, the last)")]
    TooSmall(IpNet),
    #[error("IPv6 block {v6} holds fewer addresses than pod CIDR {v4}: a pod's IPv6 address has its IPv4 host number")]
    Ipv6TooSmall { v6: Ipv6Net, v4: IpNet },
    #[error("the second block of a dual-stack node must be IPv6 beside an IPv4 pod CIDR, not beside {0}")]
    NotBesideIpv4(IpNet),
}

/// An address as a number, so both families share the arithmetic.
fn number(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// Usable addresses of a pod CIDR: everything but the network address, the
/// gateway (the first host address, on the node's bridge) and the last
/// address (IPv4's broadcast; IPv6 has none, but one address of a block
/// that size costs nothing and keeps both families alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    cidr: IpNet,
}

impl Pool {
    pub fn new(cidr: IpNet) -> Result<Self, PoolError> {
        let cidr = cidr.trunc();
        if cidr.max_prefix_len() - cidr.prefix_len() < 2 {
            return Err(PoolError::TooSmall(cidr));
        }
        Ok(Self { cidr })
    }

    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    fn address(&self, n: u128) -> IpAddr {
        match self.cidr {
            // Every number handed in is inside the IPv4 CIDR.
            IpNet::V4(_) => IpAddr::V4(Ipv4Addr::from(u32::try_from(n).unwrap_or_default())),
            IpNet::V6(_) => IpAddr::V6(Ipv6Addr::from(n)),
        }
    }

    pub fn gateway(&self) -> IpAddr {
        self.address(number(self.cidr.network()) + 1)
    }

    /// The gateway with the pool's prefix length, as it sits on the bridge.
    pub fn gateway_net(&self) -> IpNet {
        IpNet::new(self.gateway(), self.cidr.prefix_len()).unwrap_or(self.cidr)
    }

    fn first(&self) -> u128 {
        number(self.cidr.network()) + 2
    }

    fn last(&self) -> u128 {
        number(self.cidr.broadcast()) - 1
    }

    /// How many addresses pods can get (at most `u64::MAX`: an IPv6 /64
    /// holds more than any node will use).
    pub fn size(&self) -> u64 {
        u64::try_from(self.last() - self.first() + 1).unwrap_or(u64::MAX)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.cidr.network().is_ipv4() && (self.first()..=self.last()).contains(&number(ip))
    }

    /// The next free address after `after` (wrapping around), so that a
    /// just-released address is not reused at once; `None` when full.
    pub fn next_free(&self, used: impl Fn(&IpAddr) -> bool, after: Option<IpAddr>) -> Option<IpAddr> {
        let (first, last) = (self.first(), self.last());
        let start = match after.filter(|a| self.contains(*a)).map(number) {
            Some(a) if a < last => a + 1,
            _ => first,
        };
        (start..=last).chain(first..start).map(|n| self.address(n)).find(|ip| !used(ip))
    }
}

/// The IPv6 block of a dual-stack node. A pod's IPv6 address has the host
/// number of its IPv4 address (10.244.1.7 → fd00:10:244:1::7 in
/// fd00:10:244:1::/64), and so has the gateway: the IPv4 IPAM record is the
/// record of both, and a pod keeps both addresses or neither. (An
/// IPv6-only node has an IPv6 [`Pool`] and no block.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Block {
    cidr: Ipv6Net,
    v4: Ipv4Net,
}

/// Whether IPv6 block `v6` has room for every host number of `v4`.
pub fn ipv6_block_fits(v6: Ipv6Net, v4: Ipv4Net) -> bool {
    128 - v6.prefix_len() >= 32 - v4.prefix_len()
}

impl Ipv6Block {
    pub fn new(cidr: Ipv6Net, pool: Pool) -> Result<Self, PoolError> {
        let cidr = cidr.trunc();
        let IpNet::V4(v4) = pool.cidr else { return Err(PoolError::NotBesideIpv4(pool.cidr)) };
        if !ipv6_block_fits(cidr, v4) {
            return Err(PoolError::Ipv6TooSmall { v6: cidr, v4: pool.cidr });
        }
        Ok(Self { cidr, v4 })
    }

    pub fn cidr(&self) -> Ipv6Net {
        self.cidr
    }

    /// The IPv6 address of the pod with IPv4 address `ip` (of the pool).
    pub fn address_of(&self, ip: Ipv4Addr) -> Ipv6Addr {
        let host = u32::from(ip).wrapping_sub(u32::from(self.v4.network()));
        Ipv6Addr::from(u128::from(self.cidr.network()) | u128::from(host))
    }

    /// The IPv6 address beside pool address `ip`; `None` for an IPv6 one.
    pub fn beside(&self, ip: IpAddr) -> Option<Ipv6Addr> {
        match ip {
            IpAddr::V4(v4) => Some(self.address_of(v4)),
            IpAddr::V6(_) => None,
        }
    }

    pub fn gateway(&self) -> Ipv6Addr {
        self.address_of(Ipv4Addr::from(u32::from(self.v4.network()) + 1))
    }

    /// The gateway with the block's prefix length, as it sits on the bridge.
    pub fn gateway_net(&self) -> Ipv6Net {
        Ipv6Net::new(self.gateway(), self.cidr.prefix_len()).unwrap_or(self.cidr)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn a_pods_ipv6_address_has_its_ipv4_host_number() {
        let v4 = pool("10.244.1.0/24");
        let b = Ipv6Block::new("fd00:10:244:1::/64".parse().unwrap(), v4).unwrap();
        assert_eq!(b.address_of("10.244.1.7".parse().unwrap()).to_string(), "fd00:10:244:1::7");
        assert_eq!(b.address_of("10.244.1.254".parse().unwrap()).to_string(), "fd00:10:244:1::fe");
        assert_eq!(b.gateway_net().to_string(), "fd00:10:244:1::1/64");
        assert_eq!(b.beside(ip("10.244.1.7")), Some("fd00:10:244:1::7".parse().unwrap()));
        assert_eq!(b.beside(ip("fd00::7")), None);
        let tight = Ipv6Block::new("fd00::100/120".parse().unwrap(), v4).unwrap();
        assert_eq!(tight.address_of("10.244.1.255".parse().unwrap()).to_string(), "fd00::1ff");
        let e = Ipv6Block::new("fd00::/121".parse().unwrap(), v4).unwrap_err();
        assert!(e.to_string().contains("fewer addresses"), "{e}");
        let e = Ipv6Block::new("fd00::/64".parse().unwrap(), pool("fd01::/64")).unwrap_err();
        assert!(e.to_string().contains("beside an IPv4 pod CIDR"), "{e}");
    }

    fn pool(s: &str) -> Pool {
        Pool::new(s.parse().unwrap()).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn never_hands_out_network_gateway_or_broadcast() {
        let p = pool("10.0.0.0/29");
        assert_eq!(p.gateway(), ip("10.0.0.1"));
        assert_eq!(p.size(), 5);
        let mut used = BTreeMap::new();
        let mut last = None;
        while let Some(ip) = p.next_free(|ip| used.contains_key(ip), last) {
            used.insert(ip, ());
            last = Some(ip);
        }
        let got: Vec<_> = used.keys().map(ToString::to_string).collect();
        assert_eq!(got, ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]);
    }

    #[test]
    fn next_fit_wraps_and_skips_used() {
        let p = pool("10.0.0.0/29");
        let used: BTreeMap<_, _> = [(ip("10.0.0.2"), ())].into();
        assert_eq!(p.next_free(|ip| used.contains_key(ip), Some(ip("10.0.0.6"))), Some(ip("10.0.0.3")));
        assert_eq!(p.next_free(|ip| used.contains_key(ip), Some(ip("10.0.0.4"))), Some(ip("10.0.0.5")));
        assert_eq!(
            p.next_free(|ip| used.contains_key(ip), Some(ip("192.168.0.4"))),
            Some(ip("10.0.0.3")),
            "a cursor elsewhere restarts"
        );
    }

    #[test]
    fn an_ipv6_pool_works_as_an_ipv4_one() {
        let p = pool("fd00:10:244:1::/64");
        assert_eq!(p.gateway_net().to_string(), "fd00:10:244:1::1/64");
        assert_eq!(p.size(), u64::MAX - 2, "2^64 less network, gateway and the last");
        assert_eq!(pool("fd00::/48").size(), u64::MAX, "counted up to what a u64 holds");
        let mut used = BTreeMap::new();
        let a = p.next_free(|ip| used.contains_key(ip), None).unwrap();
        assert_eq!(a, ip("fd00:10:244:1::2"));
        used.insert(a, ());
        assert_eq!(p.next_free(|ip| used.contains_key(ip), Some(a)), Some(ip("fd00:10:244:1::3")));
        assert!(p.contains(ip("fd00:10:244:1:ffff:ffff:ffff:fffe")) && !p.contains(ip("fd00:10:244:1::1")));
        assert!(!p.contains(ip("10.0.0.2")), "never an address of the other family");
        let small = pool("fd00::/126");
        assert_eq!(small.size(), 1);
        let one: BTreeMap<_, _> = [(ip("fd00::2"), ())].into();
        assert_eq!(small.next_free(|ip| one.contains_key(ip), None), None);
        assert!(Pool::new("fd00::/127".parse().unwrap()).is_err());
    }

    #[test]
    fn rejects_tiny_cidrs_and_normalises_host_bits() {
        let e = Pool::new("10.0.0.0/31".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("10.0.0.0/31 is too small"), "{e}");
        assert_eq!(pool("10.0.0.77/24").cidr().to_string(), "10.0.0.0/24");
    }
}
