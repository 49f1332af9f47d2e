//! Address ranges of either family, pure: how `ipBlock`s (minus their
//! `except`s) and pod addresses become the fewest CIDRs a rule matches.
//! The two families never mix: an IPv4 range only ever holds IPv4
//! addresses, so an IPv4 block can never match an IPv6 peer.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// Inclusive addresses `lo..=hi` of one family, as integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Range {
    /// First field: IPv4 ranges sort before IPv6 ones, as `IpNet`s do.
    pub v6: bool,
    pub lo: u128,
    pub hi: u128,
}

impl Range {
    pub fn of_addr(a: IpAddr) -> Range {
        let (v6, n) = as_int(a);
        Range { v6, lo: n, hi: n }
    }

    pub fn of_net(n: &IpNet) -> Range {
        let (v6, lo) = as_int(n.network());
        Range { v6, lo, hi: lo | host_mask(n.max_prefix_len() - n.prefix_len()) }
    }

    pub fn contains(&self, a: IpAddr) -> bool {
        let (v6, n) = as_int(a);
        v6 == self.v6 && self.lo <= n && n <= self.hi
    }
}

fn as_int(a: IpAddr) -> (bool, u128) {
    match a {
        IpAddr::V4(a) => (false, u128::from(u32::from(a))),
        IpAddr::V6(a) => (true, u128::from(a)),
    }
}

/// The low `host_bits` bits set.
fn host_mask(host_bits: u8) -> u128 {
    if host_bits >= 128 { u128::MAX } else { (1u128 << host_bits) - 1 }
}

/// The ranges merged: sorted, disjoint, adjacent ones joined, per family.
pub fn union(mut r: Vec<Range>) -> Vec<Range> {
    r.sort_unstable();
    let mut out: Vec<Range> = Vec::with_capacity(r.len());
    for cur in r {
        match out.last_mut() {
            Some(last) if last.v6 == cur.v6 && (last.hi == u128::MAX || cur.lo <= last.hi + 1) => {
                last.hi = last.hi.max(cur.hi)
            }
            _ => out.push(cur),
        }
    }
    out
}

/// The addresses in both `a` and `b` (each merged, as [`union`] leaves them).
pub fn intersect(a: &[Range], b: &[Range]) -> Vec<Range> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        if x.v6 == y.v6 && x.lo.max(y.lo) <= x.hi.min(y.hi) {
            out.push(Range { v6: x.v6, lo: x.lo.max(y.lo), hi: x.hi.min(y.hi) });
        }
        // Step past the range that ends first (families order IPv4 first).
        if (x.v6, x.hi) < (y.v6, y.hi) { i += 1 } else { j += 1 }
    }
    out
}

/// `cidr` minus the `except`s of its family, as ranges; nothing for an
/// unparsable block (validation rejects those where they enter).
pub fn block(cidr: &str, except: &[String]) -> Vec<Range> {
    let Ok(net) = cidr.parse::<IpNet>() else { return Vec::new() };
    let whole = Range::of_net(&net.trunc());
    let holes = union(
        except
            .iter()
            .filter_map(|e| e.parse::<IpNet>().ok())
            .map(|e| Range::of_net(&e.trunc()))
            .filter(|h| h.v6 == whole.v6)
            .collect(),
    );
    let mut out = Vec::new();
    let mut lo = whole.lo;
    for h in holes {
        if h.hi < lo || h.lo > whole.hi {
            continue;
        }
        if h.lo > lo {
            out.push(Range { lo, hi: h.lo - 1, ..whole });
        }
        if h.hi >= whole.hi {
            return out;
        }
        lo = h.hi + 1;
    }
    out.push(Range { lo, ..whole });
    out
}

/// The fewest CIDRs covering exactly the (merged) ranges, in their order.
pub fn to_nets(ranges: &[Range]) -> Vec<IpNet> {
    let mut out = Vec::new();
    for r in ranges {
        let bits: u8 = if r.v6 { 128 } else { 32 };
        let mut cur = r.lo;
        loop {
            // The largest aligned block that starts at `cur` and ends by `hi`.
            let mut host = if cur == 0 { bits } else { (cur.trailing_zeros() as u8).min(bits) };
            while cur | host_mask(host) > r.hi {
                host -= 1;
            }
            out.push(net_at(r.v6, cur, bits - host));
            let last = cur | host_mask(host);
            if last >= r.hi {
                break;
            }
            cur = last + 1;
        }
    }
    out
}

fn net_at(v6: bool, addr: u128, prefix: u8) -> IpNet {
    // Both constructors only fail on a prefix longer than the family's,
    // which `to_nets` never asks for.
    if v6 {
        Ipv6Net::new(Ipv6Addr::from(addr), prefix).map(IpNet::V6).unwrap_or_else(|_| IpNet::V6(Ipv6Net::default()))
    } else {
        let a = Ipv4Addr::from(u32::try_from(addr).unwrap_or_default());
        Ipv4Net::new(a, prefix).map(IpNet::V4).unwrap_or_else(|_| IpNet::V4(Ipv4Net::default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(ranges: &[Range]) -> Vec<String> {
        to_nets(ranges).iter().map(ToString::to_string).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_block_minus_its_excepts_becomes_the_fewest_cidrs() {
        let except = vec!["10.0.0.128/25".to_owned()];
        assert_eq!(nets(&block("10.0.0.0/24", &except)), ["10.0.0.0/25"]);
        let except = vec!["10.0.0.1/32".to_owned()];
        assert_eq!(nets(&block("10.0.0.0/29", &except)), ["10.0.0.0/32", "10.0.0.2/31", "10.0.0.4/30"]);
        let except = vec!["fd00::/65".to_owned()];
        assert_eq!(nets(&block("fd00::/64", &except)), ["fd00::8000:0:0:0/65"]);
        assert_eq!(nets(&block("10.0.0.0/24", &["10.0.0.0/16".to_owned()])), Vec::<String>::new());
    }

    #[test]
    fn the_whole_address_space_of_each_family_is_one_net() {
        assert_eq!(nets(&block("0.0.0.0/0", &[])), ["0.0.0.0/0"]);
        assert_eq!(nets(&block("::/0", &[])), ["::/0"]);
        let except = vec!["::/1".to_owned()];
        assert_eq!(nets(&block("::/0", &except)), ["8000::/1"]);
        let except = vec!["ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128".to_owned()];
        assert_eq!(nets(&block("::/0", &except)).len(), 128);
    }

    #[test]
    fn intersection_keeps_what_both_hold_per_family() {
        let a = union([block("10.0.0.0/24", &[]), block("fd00::/64", &[])].concat());
        let b = union([block("10.0.0.128/25", &[]), block("10.1.0.0/16", &[]), block("fd00::/8", &[])].concat());
        assert_eq!(nets(&intersect(&a, &b)), ["10.0.0.128/25", "fd00::/64"]);
        assert_eq!(nets(&intersect(&b, &a)), ["10.0.0.128/25", "fd00::/64"]);
        assert!(intersect(&block("10.0.0.0/8", &[]), &block("::/0", &[])).is_empty(), "families never meet");
        let holes = block("10.0.0.0/29", &["10.0.0.2/31".to_owned()]);
        assert_eq!(nets(&intersect(&holes, &block("10.0.0.1/32", &[]))), ["10.0.0.1/32"]);
        assert!(intersect(&holes, &block("10.0.0.3/32", &[])).is_empty());
    }

    #[test]
    fn an_except_of_the_other_family_removes_nothing() {
        let except = vec!["::/0".to_owned()];
        assert_eq!(nets(&block("10.0.0.0/8", &except)), ["10.0.0.0/8"]);
        let except = vec!["0.0.0.0/0".to_owned()];
        assert_eq!(nets(&block("fd00::/8", &except)), ["fd00::/8"]);
    }

    #[test]
    fn families_never_merge_and_ipv4_sorts_first() {
        let merged = union(vec![
            Range::of_addr(ip("fd00::1")),
            Range::of_addr(ip("10.0.0.1")),
            Range::of_addr(ip("10.0.0.0")),
            // u32::MAX + 1 as IPv6 follows 255.255.255.255 as integers only.
            Range::of_addr(ip("::1:0:0")),
            Range::of_addr(ip("255.255.255.255")),
        ]);
        assert_eq!(nets(&merged), ["10.0.0.0/31", "255.255.255.255/32", "::1:0:0/128", "fd00::1/128"]);
        assert!(!Range::of_net(&"0.0.0.0/0".parse().unwrap()).contains(ip("::1")));
        assert!(!Range::of_net(&"::/0".parse().unwrap()).contains(ip("10.0.0.1")));
    }

    #[test]
    fn adjacent_addresses_merge_into_one_aligned_net() {
        let addrs = ["10.0.0.5", "10.0.0.4", "10.0.0.6", "10.0.0.7"].map(|a| Range::of_addr(ip(a)));
        assert_eq!(nets(&union(addrs.into())), ["10.0.0.4/30"]);
        assert_eq!(nets(&block("255.255.255.254/31", &[])), ["255.255.255.254/31"]);
        assert_eq!(nets(&block("10.0.0.1/24", &[])), ["10.0.0.0/24"], "host bits are dropped");
        assert!(block("not a cidr", &[]).is_empty());
    }

    #[test]
    fn ranges_reaching_the_top_of_the_space_merge_without_overflow() {
        let top = Range::of_net(&"ffff::/16".parse().unwrap());
        let merged = union(vec![top, top, Range::of_net(&"fffe::/16".parse().unwrap())]);
        assert_eq!(nets(&merged), ["fffe::/15"]);
    }
}
