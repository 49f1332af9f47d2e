//! Carving per-node subnets out of the cluster CIDR. Pure: the caller passes
//! every CIDR in use (read from the API), this picks the lowest free block.
//! Works for IPv4 and IPv6 alike by doing address arithmetic on `u128`.

use ipnet::IpNet;
use std::net::IpAddr;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IpamError {
    #[error("node prefix length /{node} must be between the cluster prefix /{cluster} and /{max}")]
    BadPrefix { cluster: u8, node: u8, max: u8 },
    #[error("node blocks of /{node} in a /{cluster} are too large to count")]
    TooLarge { cluster: u8, node: u8 },
}

/// The cluster CIDR and the size of each node's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    cluster: IpNet,
    node_prefix: u8,
}

impl Pool {
    pub fn new(cluster: IpNet, node_prefix: u8) -> Result<Pool, IpamError> {
        let cluster = cluster.trunc();
        let max = cluster.max_prefix_len();
        if node_prefix < cluster.prefix_len() || node_prefix > max {
            return Err(IpamError::BadPrefix { cluster: cluster.prefix_len(), node: node_prefix, max });
        }
        // Keep block size and count representable in u128.
        if max - node_prefix >= 128 || node_prefix - cluster.prefix_len() >= 128 {
            return Err(IpamError::TooLarge { cluster: cluster.prefix_len(), node: node_prefix });
        }
        Ok(Pool { cluster, node_prefix })
    }

    pub fn cluster(&self) -> IpNet {
        self.cluster
    }

    pub fn node_prefix(&self) -> u8 {
        self.node_prefix
    }

    /// How many node blocks fit in the cluster CIDR.
    pub fn capacity(&self) -> u128 {
        1u128 << (self.node_prefix - self.cluster.prefix_len())
    }

    /// True when `net` lies entirely inside the cluster CIDR.
    pub fn contains(&self, net: &IpNet) -> bool {
        self.cluster.contains(net)
    }

    /// The lowest block of the pool that overlaps none of `used`, or `None`
    /// when the pool is exhausted. CIDRs of the other family or outside the
    /// pool are ignored.
    pub fn next_free<'a>(&self, used: impl IntoIterator<Item = &'a IpNet>) -> Option<IpNet> {
        let (start, end) = range(&self.cluster);
        let block = 1u128 << (self.cluster.max_prefix_len() - self.node_prefix);
        let mut taken: Vec<(u128, u128)> = used
            .into_iter()
            .filter(|n| same_family(n, &self.cluster))
            .map(range)
            .filter(|(s, e)| *e >= start && *s <= end)
            .collect();
        taken.sort_unstable();

        let mut candidate = start;
        for (s, e) in taken {
            let candidate_end = candidate.checked_add(block - 1)?;
            if e < candidate {
                continue;
            }
            if s > candidate_end {
                break;
            }
            // Overlap: move to the first aligned block after this range.
            let next = e.checked_add(1)?;
            candidate = next.checked_add(block - 1)? / block * block;
        }
        let candidate_end = candidate.checked_add(block - 1)?;
        (candidate_end <= end).then(|| to_net(candidate, self.node_prefix, &self.cluster))
    }
}

/// True when the two networks share at least one address.
pub fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    if !same_family(a, b) {
        return false;
    }
    let (a0, a1) = range(a);
    let (b0, b1) = range(b);
    a0 <= b1 && b0 <= a1
}

/// Whether both networks are of one address family.
pub fn same_family(a: &IpNet, b: &IpNet) -> bool {
    matches!((a, b), (IpNet::V4(_), IpNet::V4(_)) | (IpNet::V6(_), IpNet::V6(_)))
}

/// First and last address of `net` as integers.
fn range(net: &IpNet) -> (u128, u128) {
    (to_u128(net.network()), to_u128(net.broadcast()))
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn to_net(addr: u128, prefix: u8, family: &IpNet) -> IpNet {
    let ip = match family {
        // The address came from a v4 range, so it fits in 32 bits.
        IpNet::V4(_) => IpAddr::V4(std::net::Ipv4Addr::from(addr as u32)),
        IpNet::V6(_) => IpAddr::V6(std::net::Ipv6Addr::from(addr)),
    };
    // `prefix` was validated against the family in `Pool::new`.
    IpNet::new(ip, prefix).unwrap_or(*family)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("valid CIDR in test")
    }

    #[test]
    fn first_block_of_an_empty_pool() {
        let pool = Pool::new(net("10.244.0.0/16"), 24).expect("pool");
        assert_eq!(pool.next_free(&[]), Some(net("10.244.0.0/24")));
        assert_eq!(pool.capacity(), 256);
    }

    #[test]
    fn skips_used_blocks_and_fills_holes() {
        let pool = Pool::new(net("10.244.0.0/16"), 24).expect("pool");
        let used = [net("10.244.0.0/24"), net("10.244.1.0/24"), net("10.244.3.0/24")];
        assert_eq!(pool.next_free(&used), Some(net("10.244.2.0/24")));
    }

    #[test]
    fn a_larger_foreign_block_is_skipped_whole() {
        let pool = Pool::new(net("10.244.0.0/16"), 24).expect("pool");
        let used = [net("10.244.0.0/22"), net("10.244.4.128/25")];
        assert_eq!(pool.next_free(&used), Some(net("10.244.5.0/24")));
    }

    #[test]
    fn exhausted_pool_returns_none() {
        let pool = Pool::new(net("10.9.0.0/24"), 26).expect("pool");
        let mut used = Vec::new();
        while let Some(n) = pool.next_free(&used) {
            used.push(n);
        }
        assert_eq!(used.len(), 4);
        assert_eq!(used[3], net("10.9.0.192/26"));
        used.remove(1);
        assert_eq!(pool.next_free(&used), Some(net("10.9.0.64/26")), "a freed block is reused");
    }

    #[test]
    fn ignores_other_families_and_outside_ranges() {
        let pool = Pool::new(net("10.244.0.0/16"), 24).expect("pool");
        let used = [net("fd00::/64"), net("192.168.0.0/24"), net("10.0.0.0/8")];
        // 10.0.0.0/8 covers the whole pool.
        assert_eq!(pool.next_free(&used[..2]), Some(net("10.244.0.0/24")));
        assert_eq!(pool.next_free(&used), None);
    }

    #[test]
    fn ipv6_pools_work() {
        let pool = Pool::new(net("fd00:10:244::/48"), 64).expect("pool");
        let used = [net("fd00:10:244::/64")];
        assert_eq!(pool.next_free(&used), Some(net("fd00:10:244:1::/64")));
        assert_eq!(pool.capacity(), 65536);
        let whole = Pool::new(net("::/0"), 64);
        assert!(whole.is_ok());
        assert!(Pool::new(net("::/0"), 128).is_err(), "2^128 blocks cannot be counted");
    }

    #[test]
    fn top_of_the_address_space_does_not_overflow() {
        let pool = Pool::new(net("255.255.255.0/24"), 26).expect("pool");
        let used = [net("255.255.255.0/25"), net("255.255.255.192/26")];
        assert_eq!(pool.next_free(&used), Some(net("255.255.255.128/26")));
        let all = [net("255.255.255.0/24")];
        assert_eq!(pool.next_free(&all), None);
        let v6 = Pool::new(net("ffff:ffff:ffff:ffff::/64"), 66).expect("pool");
        assert_eq!(v6.next_free(&[net("ffff:ffff:ffff:ffff::/64")]), None);
    }

    #[test]
    fn rejects_bad_prefixes() {
        assert!(matches!(Pool::new(net("10.0.0.0/16"), 8), Err(IpamError::BadPrefix { .. })));
        assert!(matches!(Pool::new(net("10.0.0.0/16"), 33), Err(IpamError::BadPrefix { .. })));
    }

    #[test]
    fn overlap_detection() {
        assert!(overlaps(&net("10.0.0.0/8"), &net("10.1.2.0/24")));
        assert!(!overlaps(&net("10.0.1.0/24"), &net("10.0.2.0/24")));
        assert!(!overlaps(&net("10.0.0.0/8"), &net("::/0")));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Lease,
            Release(usize),
            /// A Subnet made by someone else: (offset in the pool, extra prefix bits).
            Foreign(u32, u8),
        }

        fn ops() -> impl Strategy<Value = Vec<Op>> {
            let op = prop_oneof![
                5 => Just(Op::Lease),
                2 => any::<usize>().prop_map(Op::Release),
                1 => (any::<u32>(), 0u8..8).prop_map(|(o, p)| Op::Foreign(o, p)),
            ];
            prop::collection::vec(op, 1..80)
        }

        proptest! {
            /// Under any sequence of leases, releases and foreign Subnets: a
            /// lease lies in the pool, has the node prefix, overlaps nothing
            /// in use, and `None` means no aligned block is free (checked by
            /// trying every block).
            #[test]
            fn leases_never_overlap_leave_the_pool_or_miss_free_space(
                base in any::<u32>(),
                cluster_prefix in 16u8..=28,
                bits in 0u8..=4,
                ops in ops(),
            ) {
                let node_prefix = cluster_prefix + bits;
                let cluster = IpNet::new(IpAddr::V4(base.into()), cluster_prefix).expect("prefix").trunc();
                let pool = Pool::new(cluster, node_prefix).expect("pool");
                let size = 1u64 << (32 - cluster_prefix);
                let start = u64::from(u32::from(match cluster.network() { IpAddr::V4(v4) => v4, IpAddr::V6(_) => unreachable!() }));
                let (mut leases, mut foreign): (Vec<IpNet>, Vec<IpNet>) = (Vec::new(), Vec::new());
                for op in ops {
                    match op {
                        Op::Lease => {
                            let used: Vec<IpNet> = leases.iter().chain(&foreign).copied().collect();
                            match pool.next_free(&used) {
                                Some(n) => {
                                    prop_assert!(pool.contains(&n), "{} outside {}", n, cluster);
                                    prop_assert_eq!(n.prefix_len(), node_prefix);
                                    prop_assert!(used.iter().all(|u| !overlaps(u, &n)), "{} overlaps {:?}", n, used);
                                    leases.push(n);
                                }
                                None => {
                                    for block in cluster.subnets(node_prefix).expect("blocks") {
                                        prop_assert!(used.iter().any(|u| overlaps(u, &block)), "{} was free", block);
                                    }
                                }
                            }
                        }
                        Op::Release(i) if !leases.is_empty() => {
                            leases.remove(i % leases.len());
                        }
                        Op::Release(_) => {}
                        Op::Foreign(offset, extra) => {
                            let addr = (start + u64::from(offset) % size) as u32;
                            let prefix = (cluster_prefix + extra).min(32);
                            foreign.push(IpNet::new(IpAddr::V4(addr.into()), prefix).expect("prefix").trunc());
                        }
                    }
                }
            }
        }
    }
}
