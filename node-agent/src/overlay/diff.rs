//! Desired vs observed → the kernel operations that close the gap, purely.
//!
//! Ownership decides what may be replaced or deleted:
//! - a route is Weft's when it carries [`RTPROT_WEFT`] and either leaves
//!   through the VXLAN device or points into the cluster's ranges
//!   ([`ClusterRanges`]);
//! - neighbour and FDB entries are Weft's when they are on the VXLAN device
//!   (the kernel layer only reports those), except the all-zeros FDB entry,
//!   which is the device's default destination, and non-permanent neighbour
//!   entries, which the kernel itself creates and ages.
//!
//! Everything else is left alone; a foreign entry sitting where a desired one
//! must go is reported as a conflict instead of being overwritten.
//!
//! The work is one pass over each map, and the number of operations equals
//! the number of entries that differ: one changed peer costs at most 3.

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::desired::Desired;
use super::entries::{Dev, Entry, EntryKey, Fdb, Neigh, RTPROT_WEFT};
pub use super::entries::{Observed, ObservedRoute, Op};
#[cfg(test)]
use {
    super::entries::{Mac, ObservedNeigh, Route},
    std::net::IpAddr,
};

/// A desired entry that cannot be programmed because a foreign one holds its
/// place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub key: EntryKey,
    pub existing: String,
}

/// What to do, in an order that keeps traffic flowing: L2 entries (FDB, then
/// neighbour) before the routes that use them; route deletions before the L2
/// entries they used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<Op>,
    pub conflicts: Vec<Conflict>,
}

/// Where Weft's routes point: the cluster's IPv4 CIDR and its IPv6 one.
/// Without the IPv6 one (an agent of a dual-stack cluster not told it)
/// every IPv6 destination counts, so that host-gw IPv6 routes stay
/// manageable; an IPv6-only cluster has no IPv4 range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterRanges {
    pub ipv4: Option<Ipv4Net>,
    pub ipv6: Option<Ipv6Net>,
}

impl ClusterRanges {
    /// From the cluster CIDR (of either family) and the IPv6 one of a
    /// dual-stack cluster.
    pub fn new(cluster: IpNet, ipv6: Option<Ipv6Net>) -> Self {
        match cluster {
            IpNet::V4(n) => Self { ipv4: Some(n), ipv6 },
            IpNet::V6(n) => Self { ipv4: None, ipv6: Some(n) },
        }
    }

    fn contains(&self, dst: &IpNet) -> bool {
        match dst {
            IpNet::V4(n) => self.ipv4.is_some_and(|c| c.contains(n)),
            IpNet::V6(n) => self.ipv6.is_none_or(|c| c.contains(n)),
        }
    }
}

/// Whether an observed route was created by Weft and may be changed.
pub fn route_is_ours(r: &ObservedRoute, cluster: &ClusterRanges) -> bool {
    r.proto == RTPROT_WEFT && (matches!(r.route.dev, Dev::Vxlan | Dev::Tunnel) || cluster.contains(&r.route.dst))
}

/// Computes the operations turning `observed` into `desired`.
pub fn diff(desired: &Desired, observed: &Observed, cluster_cidr: &ClusterRanges) -> Plan {
    let mut plan = Plan::default();
    let mut route_dels = Vec::new();
    let mut neigh_dels = Vec::new();
    let mut fdb_dels = Vec::new();

    for (mac, want) in &desired.fdb {
        match observed.fdb.get(mac).map(Vec::as_slice) {
            None | Some([]) => plan.ops.push(Op::Add(Entry::Fdb(*want))),
            Some(dsts) => {
                // NLM_F_REPLACE rewrites the first remote only (and does
                // nothing when the wanted one is already among them); any
                // other remote is deleted on its own.
                let extras = if dsts.contains(&want.dst) {
                    dsts
                } else {
                    plan.ops.push(Op::Replace(Entry::Fdb(*want)));
                    &dsts[1..]
                };
                for extra in extras.iter().filter(|d| **d != want.dst) {
                    fdb_dels.push(Op::Delete(Entry::Fdb(Fdb { mac: *mac, dst: *extra })));
                }
            }
        }
    }
    for (ip, want) in &desired.neighs {
        match observed.neighs.get(ip) {
            None => plan.ops.push(Op::Add(Entry::Neigh(*want))),
            Some(o) if o.permanent && o.mac == Some(want.mac) => {}
            Some(_) => plan.ops.push(Op::Replace(Entry::Neigh(*want))),
        }
    }
    for (key, want) in &desired.routes {
        match observed.routes.get(key) {
            None => plan.ops.push(Op::Add(Entry::Route(want.clone()))),
            Some(o) if !route_is_ours(o, cluster_cidr) => plan
                .conflicts
                .push(Conflict { key: EntryKey::Route(*key), existing: format!("{} proto {}", o.route, o.proto) }),
            Some(o) if o.route == *want => {}
            Some(_) => plan.ops.push(Op::Replace(Entry::Route(want.clone()))),
        }
    }

    for (key, o) in &observed.routes {
        if !desired.routes.contains_key(key) && route_is_ours(o, cluster_cidr) {
            route_dels.push(Op::Delete(Entry::Route(o.route.clone())));
        }
    }
    for (ip, o) in &observed.neighs {
        if let (false, true, Some(mac)) = (desired.neighs.contains_key(ip), o.permanent, o.mac) {
            neigh_dels.push(Op::Delete(Entry::Neigh(Neigh { ip: *ip, mac })));
        }
    }
    for (mac, dsts) in &observed.fdb {
        if !mac.is_zero() && !desired.fdb.contains_key(mac) {
            fdb_dels.extend(dsts.iter().map(|dst| Op::Delete(Entry::Fdb(Fdb { mac: *mac, dst: *dst }))));
        }
    }

    plan.ops.extend(route_dels);
    plan.ops.extend(neigh_dels);
    plan.ops.extend(fdb_dels);
    plan
}

/// Observed state equal to `desired`, as if every op had been applied. Used
/// by tests and benchmarks to model the kernel.
#[cfg(test)]
pub fn observed_from(desired: &Desired) -> Observed {
    Observed {
        routes: desired
            .routes
            .iter()
            .map(|(k, r)| (*k, ObservedRoute { route: r.clone(), proto: RTPROT_WEFT }))
            .collect(),
        neighs: desired
            .neighs
            .iter()
            .map(|(ip, n)| (*ip, ObservedNeigh { ip: *ip, mac: Some(n.mac), permanent: true }))
            .collect(),
        fdb: desired.fdb.iter().map(|(m, f)| (*m, vec![f.dst])).collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::overlay::desired::{self, Backend, Local, Peer, VxlanUnderlay};

    fn cluster() -> ClusterRanges {
        ClusterRanges::new("10.0.0.0/8".parse().unwrap(), Some("fd00:10::/48".parse().unwrap()))
    }

    fn local() -> Local {
        Local {
            node_name: "self".into(),
            underlay: "192.168.0.1/16".parse().unwrap(),
            pod_cidr: "10.255.255.0/24".parse().unwrap(),
            pod_cidr6: None,
            cluster_cidr: "10.0.0.0/8".parse().unwrap(),
            backend: Backend::Vxlan,
            direct_routing: false,
            vxlan_underlay: VxlanUnderlay::Ipv4,
            cluster_cidr6: None,
            tunnel_port: 8285,
        }
    }

    fn peer(i: u32) -> Peer {
        let [_, _, hi, lo] = i.to_be_bytes();
        Peer {
            node_name: format!("node-{i}"),
            pod_cidr: format!("10.{}.{}.0/24", 1 + hi, lo).parse().unwrap(),
            pod_cidr6: None,
            node_ip: Ipv4Addr::new(172, 16, hi, lo.max(1)).into(),
            node_ipv6: None,
            vtep_mac: Some([0x02, 0x57, 0, 0, hi, lo]),
            backend: Backend::Vxlan,
            vxlan_underlay: VxlanUnderlay::Ipv4,
            wireguard_key: None,
        }
    }

    fn peers(n: u32) -> Vec<Peer> {
        (0..n).map(peer).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn foreign_route(dst: &str, dev: Dev, proto: u8) -> ObservedRoute {
        ObservedRoute {
            route: Route { dst: dst.parse().unwrap(), metric: 0, via: ip("192.168.0.254"), dev, onlink: false },
            proto,
        }
    }

    fn insert(o: &mut Observed, r: ObservedRoute) {
        o.routes.insert(r.route.key(), r);
    }

    fn count(plan: &Plan) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for op in &plan.ops {
            match op {
                Op::Add(_) => c.0 += 1,
                Op::Replace(_) => c.1 += 1,
                Op::Delete(_) => c.2 += 1,
            }
        }
        c
    }

    #[test]
    fn empty_kernel_gets_everything_added_l2_first() {
        let d = desired::compute(&local(), &peers(2));
        let plan = diff(&d, &Observed::default(), &cluster());
        assert_eq!(count(&plan), (6, 0, 0));
        let kinds: Vec<&str> = plan
            .ops
            .iter()
            .map(|op| match op.entry() {
                Entry::Fdb(_) => "fdb",
                Entry::Neigh(_) => "neigh",
                Entry::Route(_) => "route",
            })
            .collect();
        assert_eq!(kinds, ["fdb", "fdb", "neigh", "neigh", "route", "route"]);
    }

    #[test]
    fn converged_state_needs_nothing() {
        let d = desired::compute(&local(), &peers(10));
        assert_eq!(diff(&d, &observed_from(&d), &cluster()), Plan::default());
    }

    #[test]
    fn a_removed_peer_costs_three_deletes_routes_first() {
        let all = peers(10);
        let before = desired::compute(&local(), &all);
        let after = desired::compute(&local(), &all[1..]);
        let plan = diff(&after, &observed_from(&before), &cluster());
        assert_eq!(count(&plan), (0, 0, 3));
        assert!(matches!(plan.ops[0], Op::Delete(Entry::Route(_))));
        assert!(matches!(plan.ops[1], Op::Delete(Entry::Neigh(_))));
        assert!(matches!(plan.ops[2], Op::Delete(Entry::Fdb(_))));
    }

    #[test]
    fn thousand_peers_one_change_at_most_three_ops() {
        let mut all = peers(1000);
        let base = desired::compute(&local(), &all);
        assert!(base.errors.is_empty(), "{:?}", base.errors.iter().next());
        let observed = observed_from(&base);

        // Node IP changes: the FDB entry is replaced.
        all[500].node_ip = Ipv4Addr::new(172, 17, 0, 9).into();
        let plan = diff(&desired::compute(&local(), &all), &observed, &cluster());
        assert_eq!(count(&plan), (0, 1, 0), "{:?}", plan.ops);

        // VTEP MAC changes (device recreated): new FDB, neighbour replaced, old FDB deleted.
        let mut all = peers(1000);
        all[500].vtep_mac = Some([0x02, 0x57, 9, 9, 9, 9]);
        let plan = diff(&desired::compute(&local(), &all), &observed, &cluster());
        assert_eq!(count(&plan), (1, 1, 1), "{:?}", plan.ops);

        // A peer joins.
        let mut all = peers(1000);
        all.push(peer(1000));
        let plan = diff(&desired::compute(&local(), &all), &observed, &cluster());
        assert_eq!(count(&plan), (3, 0, 0));

        // A peer leaves.
        let mut all = peers(1000);
        all.remove(7);
        let plan = diff(&desired::compute(&local(), &all), &observed, &cluster());
        assert_eq!(count(&plan), (0, 0, 3));

        // A peer's data turns bad: its entries go, nothing else moves.
        let mut all = peers(1000);
        all[3].vtep_mac = None;
        let d = desired::compute(&local(), &all);
        assert_eq!(d.errors.len(), 1);
        assert!(diff(&d, &observed, &cluster()).ops.len() <= 3);
    }

    #[test]
    fn switching_a_peer_to_host_gw_replaces_its_route_and_drops_l2() {
        let mut l = local();
        let mut all = peers(3);
        let observed = observed_from(&desired::compute(&l, &all));
        l.direct_routing = true;
        all[1].node_ip = Ipv4Addr::new(192, 168, 7, 7).into();
        let plan = diff(&desired::compute(&l, &all), &observed, &cluster());
        assert_eq!(count(&plan), (0, 1, 2), "{:?}", plan.ops);
    }

    #[test]
    fn foreign_routes_are_never_deleted() {
        let d = desired::compute(&local(), &peers(1));
        let mut o = observed_from(&d);
        // Not ours by protocol, even on our device or in the cluster CIDR.
        insert(&mut o, foreign_route("10.9.0.0/24", Dev::Vxlan, 4));
        insert(&mut o, foreign_route("10.9.1.0/24", Dev::Underlay, 3));
        // Our protocol number but elsewhere: someone else picked 0x57 too.
        insert(&mut o, foreign_route("8.8.8.0/24", Dev::Other(7), RTPROT_WEFT));
        insert(&mut o, foreign_route("0.0.0.0/0", Dev::Underlay, RTPROT_WEFT));
        assert_eq!(diff(&d, &o, &cluster()), Plan::default());
    }

    #[test]
    fn stale_routes_of_ours_are_deleted() {
        let d = desired::compute(&local(), &peers(1));
        let mut o = observed_from(&d);
        insert(&mut o, foreign_route("10.9.0.0/24", Dev::Underlay, RTPROT_WEFT));
        insert(&mut o, foreign_route("172.31.0.0/24", Dev::Vxlan, RTPROT_WEFT));
        let mut metric = foreign_route("10.1.0.0/24", Dev::Underlay, RTPROT_WEFT);
        metric.route.metric = 100;
        insert(&mut o, metric);
        let plan = diff(&d, &o, &cluster());
        assert_eq!(count(&plan), (0, 0, 3), "{:?}", plan.ops);
    }

    /// host-gw IPv6 routes leave through the underlay: ours when they point
    /// into the IPv6 cluster range (any IPv6 destination when it is not
    /// known), never outside it.
    #[test]
    fn ipv6_routes_on_the_underlay_are_ours_inside_the_ipv6_range() {
        let v6 = |dst: &str| foreign_route(dst, Dev::Underlay, RTPROT_WEFT);
        let known = cluster();
        assert!(route_is_ours(&v6("fd00:10:0:2::/64"), &known));
        assert!(!route_is_ours(&v6("2001:db8::/64"), &known));
        let unknown = ClusterRanges { ipv6: None, ..known };
        assert!(route_is_ours(&v6("2001:db8::/64"), &unknown));
        let mut o = Observed::default();
        insert(&mut o, v6("fd00:10:0:9::/64"));
        insert(&mut o, v6("2001:db8::/64"));
        let plan = diff(&Desired::default(), &o, &known);
        assert_eq!(count(&plan), (0, 0, 1), "only the stale one inside the range goes: {:?}", plan.ops);
    }

    #[test]
    fn a_foreign_route_in_the_way_is_a_conflict_not_an_overwrite() {
        let d = desired::compute(&local(), &peers(1));
        let mut o = observed_from(&d);
        let dst = d.routes.keys().next().unwrap().dst.to_string();
        insert(&mut o, foreign_route(&dst, Dev::Underlay, 4));
        let plan = diff(&d, &o, &cluster());
        assert!(plan.ops.is_empty(), "{:?}", plan.ops);
        assert_eq!(plan.conflicts.len(), 1);
        assert_eq!(d.owners[&plan.conflicts[0].key], "node-0");
        assert!(plan.conflicts[0].existing.contains("proto 4"));
    }

    #[test]
    fn a_changed_route_of_ours_is_replaced() {
        let d = desired::compute(&local(), &peers(1));
        let mut o = observed_from(&d);
        for r in o.routes.values_mut() {
            r.route.onlink = false;
        }
        assert_eq!(count(&diff(&d, &o, &cluster())), (0, 1, 0));
    }

    #[test]
    fn neighbour_entries_learned_by_the_kernel_are_replaced_or_ignored() {
        let d = desired::compute(&local(), &peers(1));
        let mut o = observed_from(&d);
        for n in o.neighs.values_mut() {
            n.permanent = false;
        }
        // A dynamic entry for an unknown address is the kernel's business.
        o.neighs.insert(ip("10.99.0.0"), ObservedNeigh { ip: ip("10.99.0.0"), mac: None, permanent: false });
        let plan = diff(&d, &o, &cluster());
        assert_eq!(count(&plan), (0, 1, 0), "{:?}", plan.ops);
    }

    #[test]
    fn stale_permanent_neighbours_and_fdb_on_our_device_are_deleted() {
        let d = desired::compute(&local(), &peers(1));
        let mut o = observed_from(&d);
        let m = Mac([2, 0, 0, 0, 0, 0x77]);
        o.neighs.insert(ip("10.99.0.0"), ObservedNeigh { ip: ip("10.99.0.0"), mac: Some(m), permanent: true });
        o.fdb.insert(m, vec![ip("172.16.9.9")]);
        // The default destination of the device is not an entry of ours.
        o.fdb.insert(Mac([0; 6]), vec![ip("172.16.9.10")]);
        let plan = diff(&d, &o, &cluster());
        assert_eq!(count(&plan), (0, 0, 2), "{:?}", plan.ops);
    }

    /// The kernel's semantics for our operations, on the observed model.
    fn apply_model(o: &mut Observed, ops: &[Op]) {
        for op in ops {
            match (op, op.entry()) {
                (Op::Add(_) | Op::Replace(_), Entry::Route(r)) => {
                    o.routes.insert(r.key(), ObservedRoute { route: r.clone(), proto: RTPROT_WEFT });
                }
                (Op::Delete(_), Entry::Route(r)) => {
                    o.routes.remove(&r.key());
                }
                (Op::Add(_) | Op::Replace(_), Entry::Neigh(n)) => {
                    o.neighs.insert(n.ip, ObservedNeigh { ip: n.ip, mac: Some(n.mac), permanent: true });
                }
                (Op::Delete(_), Entry::Neigh(n)) => {
                    o.neighs.remove(&n.ip);
                }
                (Op::Add(_), Entry::Fdb(f)) => o.fdb.entry(f.mac).or_default().push(f.dst),
                (Op::Replace(_), Entry::Fdb(f)) => {
                    let dsts = o.fdb.entry(f.mac).or_default();
                    if dsts.is_empty() {
                        dsts.push(f.dst);
                    } else if !dsts.contains(&f.dst) {
                        dsts[0] = f.dst;
                    }
                }
                (Op::Delete(_), Entry::Fdb(f)) => {
                    if let Some(dsts) = o.fdb.get_mut(&f.mac) {
                        dsts.retain(|d| *d != f.dst);
                        if dsts.is_empty() {
                            o.fdb.remove(&f.mac);
                        }
                    }
                }
            }
        }
    }

    /// Random churn against a model kernel holding foreign entries: every
    /// plan converges in one pass and never touches a foreign entry.
    #[test]
    fn random_churn_converges_in_one_pass_and_spares_foreign_entries() {
        let mut seed: u64 = 0x5eed_0ffe;
        let mut rnd = |n: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        let mut l = local();
        let mut all = peers(60);
        let mut o = Observed::default();
        let foreign = [
            foreign_route("10.250.0.0/24", Dev::Vxlan, 4),
            foreign_route("10.251.0.0/24", Dev::Underlay, 3),
            foreign_route("0.0.0.0/0", Dev::Underlay, RTPROT_WEFT),
        ];
        for f in &foreign {
            insert(&mut o, f.clone());
        }
        for round in 0..500 {
            let changes = 1 + rnd(3) as usize;
            for _ in 0..changes {
                let i = rnd(all.len() as u64) as usize;
                match rnd(8) {
                    0 => {
                        all.remove(i);
                    }
                    1 => all.push(peer(100 + rnd(100) as u32)),
                    2 => all[i].node_ip = Ipv4Addr::new(172, 16, 200, rnd(250) as u8 + 1).into(),
                    3 => all[i].node_ip = Ipv4Addr::new(192, 168, 3, rnd(250) as u8 + 1).into(),
                    4 => all[i].vtep_mac = Some([0x02, 0x58, 0, 0, 0, rnd(250) as u8]),
                    5 => all[i].vtep_mac = None,
                    6 => all[i].pod_cidr = format!("10.{}.{}.0/24", 1 + rnd(2), rnd(256)).parse().unwrap(),
                    _ => l.direct_routing = !l.direct_routing,
                }
                if all.is_empty() {
                    all.push(peer(0));
                }
            }
            let d = desired::compute(&l, &all);
            let plan = diff(&d, &o, &cluster());
            assert!(plan.conflicts.is_empty());
            apply_model(&mut o, &plan.ops);
            assert_eq!(diff(&d, &o, &cluster()), Plan::default(), "round {round}: not converged");
            for f in &foreign {
                assert_eq!(o.routes.get(&f.route.key()), Some(f), "round {round}: foreign route touched");
            }
        }
    }

    #[test]
    fn fdb_with_extra_remotes_is_cleaned() {
        let d = desired::compute(&local(), &peers(1));
        let mut o = observed_from(&d);
        let (mac, f) = d.fdb.iter().next().unwrap();
        o.fdb.insert(*mac, vec![ip("172.16.9.9"), f.dst, ip("172.16.9.8")]);
        assert_eq!(count(&diff(&d, &o, &cluster())), (0, 0, 2));
        o.fdb.insert(*mac, vec![ip("172.16.9.9"), ip("172.16.9.8")]);
        assert_eq!(count(&diff(&d, &o, &cluster())), (0, 1, 1));
    }
}
