//! What each pod may send, as firewall parts: pure, no kernel.
//!
//! A pod is hostile: root in its namespace with `CAP_NET_RAW`, it can add
//! addresses, send with any source, answer ARP and neighbour discovery for
//! addresses that are not its own, and talk IPv6 link-local or multicast
//! to its neighbours, none of which policy (keyed by the pods' API
//! addresses) would recognise. So every frame a pod sends is checked on
//! the node's side of its veth before anything else sees it:
//!
//! - bridged pods (table `bridge weft`, the bridge's prerouting hook): the
//!   Ethernet source must be the pod's MAC; ARP must announce the pod's own
//!   MAC and IPv4 address; IPv4 and IPv6 must come from the pod's own
//!   addresses, to a unicast destination; neighbour discovery (router and
//!   neighbour solicitations and advertisements, hop limit 255) is let
//!   through for pods that have IPv6, as their gateway needs it, from the
//!   pod's own addresses (its IPv6 ones, its link-local one, or none while
//!   it checks for duplicates), and an advertisement only for one of them:
//!   else a pod could make the node send another pod's traffic to it. Everything
//!   else (link-local data, multicast, broadcast, IPv6 from an IPv4-only
//!   pod, VLAN tags, other EtherTypes) is dropped.
//! - routed pods (table `inet weft`, prerouting): IPv4 and IPv6 must come
//!   from the pod's own addresses on its own veth; neighbour discovery from
//!   a link-local source is let through for pods that have IPv6. Their
//!   link-local traffic reaches only the node (routers do not forward it).
//!
//! A veth of Weft's that is in no set (its ADD has not finished, or its
//! record is gone) sends nothing: the guard fails closed.

use std::net::{IpAddr, Ipv6Addr};

use crate::attachment::Attachment;
use crate::dataplane::link::HOST_VETH_PREFIX;
use crate::firewall::build::{self, Field};
use crate::firewall::ruleset::{
    Chain, ChainKind, Family, Hook, HookPoint, IfName, Key, Part, PortFields, PortKey, Rule, Set, SetKind,
};

/// The owner (name prefix) of the guard's objects in both tables.
pub const OWNER: &str = "guard";
/// The named counter of dropped frames, in each table.
pub const DROPPED: &str = "guard-dropped";
/// Before connection tracking (-200): a spoofed packet makes no entry.
const PRIORITY: i32 = -300;
/// What a pod with IPv6 needs of neighbour discovery (never router
/// advertisements or redirects: only the node routes).
const ND_SOLICITS: [&str; 2] = ["nd-router-solicit", "nd-neighbor-solicit"];
const ND_ADVERT: &str = "nd-neighbor-advert";
/// The regular chain of the bridge table for a bridged pod's neighbour discovery.
const NEIGHBOUR: &str = "neighbour";
/// The regular chain of the bridge table that checks what a neighbour
/// advertisement announces: written over netlink (nft 1.0.6 cannot build its rule).
const ADVERTISED: &str = "advertised";
/// A bridged pod's (veth, MAC, own IPv6 address) for neighbour discovery
/// (named apart from the routed table's `nd`, keyed by the veth alone).
const ND_OWN: &str = "nd-own";
/// Frames to many (never between pods).
const CAST_TO_MANY: [&str; 2] = ["broadcast", "multicast"];

/// One pod interface: the node's end of its veth, the pod's MAC and addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuardedPort {
    pub host_veth: String,
    pub pod_mac: [u8; 6],
    pub addrs: Vec<IpAddr>,
    pub mode: Attachment,
}

/// The guard's parts: (table `bridge weft`, table `inet weft`). A port
/// whose veth name is not one the kernel takes is left out (it cannot
/// exist, so it sends nothing).
pub fn parts(ports: &[GuardedPort]) -> (Part, Part) {
    let mut bridge = Part::new(OWNER);
    let mut inet = Part::new(OWNER);
    let sets = |part: &mut Part, names: &[(&str, PortFields)]| {
        for (name, fields) in names {
            part.sets.insert(part.name(name), Set { kind: SetKind::Ports(*fields), elements: Default::default() });
        }
    };
    let with_mac = |addr| PortFields { mac: true, addr };
    let without_mac = |addr| PortFields { mac: false, addr };
    // A bridged pod's neighbour discovery is keyed by its own addresses too.
    sets(
        &mut bridge,
        &[
            ("ip4", with_mac(Some(Family::V4))),
            ("ip6", with_mac(Some(Family::V6))),
            (ND_OWN, with_mac(Some(Family::V6))),
        ],
    );
    sets(
        &mut inet,
        &[("ip4", without_mac(Some(Family::V4))), ("ip6", without_mac(Some(Family::V6))), ("nd", without_mac(None))],
    );

    for port in ports {
        let Some(iface) = IfName::new(&port.host_veth) else { continue };
        let (part, mac) = match port.mode {
            Attachment::Bridge => (&mut bridge, Some(port.pod_mac)),
            Attachment::Routed => (&mut inet, None),
        };
        let mut add = |set: &str, addr: Option<IpAddr>| {
            let name = format!("{OWNER}-{set}");
            if let Some(s) = part.sets.get_mut(&name) {
                s.elements.insert(Key::Port(PortKey { iface, mac, addr }), None);
            }
        };
        for addr in &port.addrs {
            add(if addr.is_ipv4() { "ip4" } else { "ip6" }, Some(*addr));
        }
        if port.addrs.iter().any(IpAddr::is_ipv6) {
            match port.mode {
                Attachment::Bridge => {
                    let own = port.addrs.iter().copied().filter(IpAddr::is_ipv6);
                    let extra = [link_local_of(port.pod_mac), Ipv6Addr::UNSPECIFIED].map(IpAddr::V6);
                    for addr in own.chain(extra) {
                        add(ND_OWN, Some(addr));
                    }
                }
                Attachment::Routed => add("nd", None),
            }
        }
    }

    for part in [&mut bridge, &mut inet] {
        part.counters.insert(DROPPED.to_owned());
    }
    let hook = Some(Hook { kind: ChainKind::Filter, point: HookPoint::Prerouting, priority: PRIORITY });
    bridge.chains.insert(bridge.name("bridged"), Chain { hook, rules: bridged_rules() });
    bridge.chains.insert(bridge.name(NEIGHBOUR), Chain { hook: None, rules: neighbour_rules() });
    bridge.chains.insert(bridge.name(ADVERTISED), Chain { hook: None, rules: advertised_rules() });
    inet.chains.insert(inet.name("routed"), Chain { hook, rules: routed_rules() });
    (bridge, inet)
}

fn set(name: &str) -> String {
    format!("{OWNER}-{name}")
}

fn bridged_rules() -> Vec<Rule> {
    use Field::*;
    vec![
        Rule::new("not a pod's port", vec![build::in_iface_not_prefixed(HOST_VETH_PREFIX), build::accept()]),
        // First, as most of what pods send is this: an IPv4 packet is
        // neither ARP nor neighbour discovery, so it need not pass those
        // rules' compares (broadcast and multicast fall through to their drop).
        Rule::new(
            "IPv4 unicast from the pod's own address",
            vec![
                build::pkttype_not_in(&CAST_TO_MANY),
                build::key_in_set(&[InIface, EtherSrc, Src(Family::V4)], &set("ip4")),
                build::accept(),
            ],
        ),
        Rule::new(
            "ARP of the pod's own MAC and IPv4 address",
            vec![
                build::key_in_set(&[InIface, EtherSrc, ArpSenderIp], &set("ip4")),
                build::key_in_set(&[InIface, ArpSenderMac, ArpSenderIp], &set("ip4")),
                build::accept(),
            ],
        ),
        // One compare for every other frame (this is every packet's path);
        // neighbour discovery goes on in a chain of its own.
        Rule::new(
            "neighbour discovery, checked in its own chain",
            vec![build::icmpv6_type_in(&build::ND_TYPES), build::goto(&set(NEIGHBOUR))],
        ),
        Rule::new(
            "no broadcast or multicast between pods",
            vec![build::pkttype_in(&CAST_TO_MANY), build::count_into(DROPPED), build::drop()],
        ),
        Rule::new(
            "IPv6 from the pod's own address",
            vec![build::key_in_set(&[InIface, EtherSrc, Src(Family::V6)], &set("ip6")), build::accept()],
        ),
        Rule::new("anything else a pod sends", vec![build::count_into(DROPPED), build::drop()]),
    ]
}

/// Neighbour discovery of a bridged pod (hop limit 255, from its own
/// addresses), and nothing else of it: the chain ends in a drop. It is
/// reached by `goto`, so an empty one would fall to the hook's accept; nft
/// writes it in the transaction that writes the rule going to it.
fn neighbour_rules() -> Vec<Rule> {
    use Field::*;
    vec![
        Rule::new(
            "solicitations of a pod with IPv6, from its own addresses",
            vec![
                build::icmpv6_type_in(&ND_SOLICITS),
                build::hop_limit(255),
                build::key_in_set(&[InIface, EtherSrc, Src(Family::V6)], &set(ND_OWN)),
                build::accept(),
            ],
        ),
        Rule::new(
            "advertisements of a pod with IPv6, from its own addresses, checked for what they announce",
            vec![
                build::icmpv6_type_in(&[ND_ADVERT]),
                build::hop_limit(255),
                build::key_in_set(&[InIface, EtherSrc, Src(Family::V6)], &set(ND_OWN)),
                build::jump(&set(ADVERTISED)),
            ],
        ),
        // Also what the advertisement check did not accept (and everything,
        // before that chain has its rules): neighbour discovery is never data.
        Rule::new("any other neighbour discovery", vec![build::count_into(DROPPED), build::drop()]),
    ]
}

/// An advertisement (a pod's own, by the rule that jumps here) must
/// announce one of the pod's own addresses.
fn advertised_rules() -> Vec<Rule> {
    use Field::*;
    vec![
        Rule::new(
            "an advertisement of the pod's own address",
            vec![build::key_in_set(&[InIface, EtherSrc, NdTarget], &set(ND_OWN)), build::accept()],
        ),
        Rule::new("an advertisement of another's address", vec![build::count_into(DROPPED), build::drop()]),
    ]
}

/// The link-local address the kernel gives an interface with `mac`
/// (modified EUI-64, the default address generation mode).
fn link_local_of(mac: [u8; 6]) -> Ipv6Addr {
    let [a, b, c, d, e, f] = mac;
    let group = |hi: u8, lo: u8| u16::from_be_bytes([hi, lo]);
    Ipv6Addr::new(0xfe80, 0, 0, 0, group(a ^ 0x02, b), group(c, 0xff), group(0xfe, d), group(e, f))
}

fn routed_rules() -> Vec<Rule> {
    use Field::*;
    vec![
        Rule::new("not a pod's veth", vec![build::in_iface_not_prefixed(HOST_VETH_PREFIX), build::accept()]),
        Rule::new(
            "IPv4 from the pod's own address",
            vec![build::key_in_set(&[InIface, Src(Family::V4)], &set("ip4")), build::accept()],
        ),
        Rule::new(
            "IPv6 from the pod's own address",
            vec![build::key_in_set(&[InIface, Src(Family::V6)], &set("ip6")), build::accept()],
        ),
        Rule::new(
            "link-local neighbour discovery of a pod with IPv6",
            vec![
                build::icmpv6_type_in(&build::ND_TYPES),
                build::hop_limit(255),
                build::addr_in(build::Addr::Src, "fe80::/10".parse::<ipnet::IpNet>().unwrap_or_default()),
                build::key_in_set(&[InIface], &set("nd")),
                build::accept(),
            ],
        ),
        Rule::new("anything else a pod sends", vec![build::count_into(DROPPED), build::drop()]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(veth: &str, mode: Attachment, addrs: &[&str]) -> GuardedPort {
        GuardedPort {
            host_veth: veth.into(),
            pod_mac: [2, 0, 0, 0, 0, 5],
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            mode,
        }
    }

    fn elements(part: &Part, set: &str) -> Vec<PortKey> {
        part.sets[&format!("guard-{set}")]
            .elements
            .keys()
            .map(|k| match k {
                Key::Port(p) => *p,
                other => panic!("not a port key: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn bridged_pods_are_keyed_by_veth_mac_and_address_and_routed_ones_by_veth_and_address() {
        let ports = [
            port("weftv0000000001", Attachment::Bridge, &["10.244.1.5", "fd00:10:244:1::5"]),
            port("weftv0000000002", Attachment::Bridge, &["10.244.1.6"]),
            port("weftv0000000003", Attachment::Routed, &["10.244.1.7"]),
        ];
        let (bridge, inet) = parts(&ports);
        let v4 = elements(&bridge, "ip4");
        assert_eq!(v4.len(), 2);
        assert_eq!(v4[0].iface.as_str(), "weftv0000000001");
        assert_eq!(v4[0].mac, Some([2, 0, 0, 0, 0, 5]));
        assert_eq!(v4[0].addr, Some("10.244.1.5".parse().unwrap()));
        assert_eq!(elements(&bridge, "ip6").len(), 1);
        // Only the dual-stack pod may speak neighbour discovery: from and
        // for its own IPv6 address, its link-local one, or none (DAD).
        let nd = elements(&bridge, "nd-own");
        let nd: Vec<_> = nd.iter().map(|k| (k.iface.as_str(), k.addr.map(|a| a.to_string()))).collect();
        let own = |a: &str| ("weftv0000000001", Some(a.to_owned()));
        assert_eq!(nd.len(), 3, "{nd:?}");
        for addr in ["fd00:10:244:1::5", "fe80::ff:fe00:5", "::"] {
            assert!(nd.contains(&own(addr)), "{addr} in {nd:?}");
        }
        // The routed pod is the inet table's, without a MAC.
        let r4 = elements(&inet, "ip4");
        assert_eq!(r4.len(), 1);
        assert_eq!((r4[0].iface.as_str(), r4[0].mac), ("weftv0000000003", None));
        assert!(elements(&inet, "nd").is_empty());
        // Every key matches its set's fields.
        for part in [&bridge, &inet] {
            for s in part.sets.values() {
                let SetKind::Ports(fields) = s.kind else { panic!("{s:?}") };
                for k in s.elements.keys() {
                    let Key::Port(p) = k else { panic!() };
                    assert_eq!(p.fields(), fields);
                }
            }
        }
    }

    #[test]
    fn no_pods_still_make_the_chains_that_close_every_pod_veth() {
        let (bridge, inet) = parts(&[]);
        for (part, chain) in [(&bridge, "guard-bridged"), (&inet, "guard-routed")] {
            let c = &part.chains[chain];
            assert_eq!(c.hook.map(|h| h.priority), Some(PRIORITY));
            let last = c.rules.last().unwrap();
            assert_eq!(last.stmts.last(), Some(&build::drop()), "fails closed: {last:?}");
            assert!(part.counters.contains(DROPPED));
        }
    }

    #[test]
    fn the_link_local_address_is_the_modified_eui64_of_the_mac() {
        assert_eq!(link_local_of([0x02, 0x42, 0xac, 0x11, 0x00, 0x02]).to_string(), "fe80::42:acff:fe11:2");
        assert_eq!(link_local_of([0x00, 0x1b, 0x21, 0x3a, 0x4f, 0x5c]).to_string(), "fe80::21b:21ff:fe3a:4f5c");
    }

    #[test]
    fn an_advertisement_is_checked_in_a_chain_netlink_can_write_and_dropped_if_it_returns() {
        let (bridge, _) = parts(&[]);
        let advertised = &bridge.chains["guard-advertised"];
        assert_eq!(advertised.hook, None);
        for rule in &advertised.rules {
            assert!(
                crate::firewall::nfnl_rule::encode(rule, crate::firewall::ruleset::TableFamily::Bridge).is_some(),
                "{rule:?}"
            );
        }
        let rules = &bridge.chains["guard-neighbour"].rules;
        let jump = rules.iter().position(|r| r.stmts.contains(&build::jump("guard-advertised"))).expect("a jump");
        assert_eq!(rules[jump + 1].stmts.last(), Some(&build::drop()), "{:?}", rules[jump + 1]);
        // Reached by goto: nft writes it, in the transaction of the base
        // chain's rule going to it, so it is never seen empty.
        assert!(rules.iter().any(|r| crate::firewall::nfnl_rule::encode(r, crate::firewall::ruleset::TableFamily::Bridge).is_none()));
    }

    #[test]
    fn a_veth_name_the_kernel_would_refuse_is_left_out() {
        let (bridge, _) = parts(&[port("weftv-far-too-long-a-name", Attachment::Bridge, &["10.244.1.5"])]);
        assert!(elements(&bridge, "ip4").is_empty());
    }

    #[test]
    fn the_parts_are_the_same_whatever_the_order_of_the_ports() {
        let a = port("weftv0000000001", Attachment::Bridge, &["10.244.1.5"]);
        let b = port("weftv0000000002", Attachment::Routed, &["10.244.1.6"]);
        assert_eq!(parts(&[a.clone(), b.clone()]), parts(&[b, a]));
    }
}
