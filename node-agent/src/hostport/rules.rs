//! Host port DNAT as the `hostport` part of Weft's nftables table, pure:
//!
//! - `hostport-ports`, a verdict map `protocol . port → jump <chain>`, is
//!   looked up from `hostport-prerouting` (traffic from other nodes and
//!   local pods) and `hostport-output` (the node itself) for packets to a
//!   local address: one lookup whatever the number of host ports.
//! - `hostport-<proto>-<port>`, one chain per host port: for each mapping
//!   on it and each address family the pod has, a mark for traffic from
//!   this node's pods and the DNAT to `podIP:containerPort` (restricted to
//!   the mapping's host IP if it has one, and then to that IP's family).
//! - `hostport-postrouting` masquerades marked traffic, so a pod reaching a
//!   host port on its own node (another pod, or itself: hairpin) gets
//!   replies through the node, not straight over the bridge from an address
//!   it never talked to.
//!
//! Adding or releasing a host port changes one map element and one chain.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv6Net};

use super::store::{Allocation, Mapping};
use crate::firewall::build::{self, Addr};
use crate::firewall::ruleset::{
    Chain, ChainKind, DSTNAT, Hook, HookPoint, Key, Part, Proto, Rule, SRCNAT, Set, SetKind,
};

pub const OWNER: &str = "hostport";
pub const MAP: &str = "hostport-ports";
/// The mark for host port traffic from local pods (the bit portmap uses).
const MARK: u32 = 0x2000;

/// This node's pod blocks: traffic from them to a host port is marked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodBlocks {
    /// The pool's (IPv4, or IPv6 on an IPv6-only node).
    pub pool: IpNet,
    /// The IPv6 block beside an IPv4 pool (dual-stack).
    pub ipv6: Option<Ipv6Net>,
}

/// A host port: protocol and port.
pub type Port = (Proto, u16);

pub fn port(m: &Mapping) -> Port {
    (Proto::from(m.protocol), m.host_port)
}

/// The chain of one host port.
pub fn chain_name((p, port): Port) -> String {
    format!("{OWNER}-{}-{port}", p.as_str())
}

/// What a rule comment says of a mapping's pod.
fn text(a: &Allocation) -> String {
    let short: String = a.container_id.chars().take(12).collect();
    format!("{}/{} {short}", a.pod_namespace, a.pod_name)
}

/// The rules of one mapping: a mark and a DNAT per family it is forwarded
/// over (the pool's first). A host IP of one family forwards only that
/// family; IPv6 beside IPv4 needs the pod's IPv6 address and the node's
/// IPv6 block.
fn mapping_rules(a: &Allocation, m: &Mapping, pods: PodBlocks) -> Vec<Rule> {
    let ipv4 = Some((a.pod_ip, pods.pool));
    let ipv6 = a.pod_ipv6.zip(pods.ipv6).map(|(ip, block)| (IpAddr::V6(ip), IpNet::V6(block)));
    let proto = Proto::from(m.protocol);
    let mut rules = Vec::new();
    for (pod_ip, block) in [ipv4, ipv6].into_iter().flatten() {
        if m.host_ip.is_some_and(|h| h.is_ipv4() != pod_ip.is_ipv4()) {
            continue;
        }
        let to_host_ip = || m.host_ip.map(|ip| build::addr_in(Addr::Dst, IpNet::from(ip)));
        let mut mark = Vec::from_iter(to_host_ip());
        mark.extend([build::addr_in(Addr::Src, block.trunc()), build::set_mark_bits(MARK)]);
        let mut dnat = Vec::from_iter(to_host_ip());
        dnat.extend([build::l4proto(proto), build::dnat(pod_ip, m.container_port)]);
        rules.extend([Rule::new(&text(a), mark), Rule::new(&text(a), dnat)]);
    }
    rules
}

/// The chain of host port `k` for the mappings on it (in record order).
fn port_chain<'a>(on_port: impl Iterator<Item = (&'a Allocation, &'a Mapping)>, pods: PodBlocks) -> Chain {
    Chain { hook: None, rules: on_port.flat_map(|(a, m)| mapping_rules(a, m, pods)).collect() }
}

/// The part with its base chains and map but no host port.
fn base() -> Part {
    let mut p = Part::new(OWNER);
    let lookup = || Rule::new("host ports", vec![build::to_local_address(), build::port_vmap(MAP)]);
    let nat = |point, priority| Some(Hook { kind: ChainKind::Nat, point, priority });
    p.chains.insert(p.name("prerouting"), Chain { hook: nat(HookPoint::Prerouting, DSTNAT), rules: vec![lookup()] });
    p.chains.insert(p.name("output"), Chain { hook: nat(HookPoint::Output, DSTNAT), rules: vec![lookup()] });
    let masq = Rule::new("host port traffic from local pods", vec![build::has_mark_bits(MARK), build::masquerade()]);
    p.chains.insert(p.name("postrouting"), Chain { hook: nat(HookPoint::Postrouting, SRCNAT), rules: vec![masq] });
    p.sets.insert(MAP.to_owned(), Set { kind: SetKind::PortJumps, elements: BTreeMap::new() });
    p
}

/// The whole part for `allocations`.
pub fn part(allocations: &[Allocation], pods: PodBlocks) -> Part {
    let mut p = base();
    let ports: Vec<Port> = allocations.iter().flat_map(|a| a.ports.iter().map(port)).collect();
    refresh(&mut p, &ports, allocations, pods);
    p
}

/// Brings the chains and map elements of host ports `ports` in `p` in line
/// with `allocations` (the others are left as they are): what an ADD or a
/// release changes, without rebuilding every host port's rules.
pub fn refresh(p: &mut Part, ports: &[Port], allocations: &[Allocation], pods: PodBlocks) {
    let mut by_port: BTreeMap<Port, Vec<(&Allocation, &Mapping)>> = ports.iter().map(|k| (*k, Vec::new())).collect();
    for a in allocations {
        for m in &a.ports {
            if let Some(on_port) = by_port.get_mut(&port(m)) {
                on_port.push((a, m));
            }
        }
    }
    for (hp, on_port) in by_port {
        let (name, k) = (chain_name(hp), Key::ProtoPort(hp.0, hp.1));
        let map = p.sets.entry(MAP.to_owned()).or_insert(Set { kind: SetKind::PortJumps, elements: BTreeMap::new() });
        if on_port.is_empty() {
            map.elements.remove(&k);
            p.chains.remove(&name);
        } else {
            map.elements.insert(k, Some(name.clone()));
            p.chains.insert(name, port_chain(on_port.into_iter(), pods));
        }
    }
}

/// What CHECK wants to see for one allocation: each of its host ports
/// mapped to its chain, and that chain holding the mapping's rules.
pub fn missing(observed: &crate::firewall::ruleset::Observed, a: &Allocation, pods: PodBlocks) -> Option<String> {
    let map = observed.sets.get(MAP);
    for m in &a.ports {
        let hp = port(m);
        let (name, k) = (chain_name(hp), Key::ProtoPort(hp.0, hp.1));
        if map.and_then(|s| s.elements.get(&k)) != Some(&Some(name.clone())) {
            return Some(format!("host port {}/{} is not in the nftables map {MAP}", m.host_port, m.protocol.as_str()));
        }
        let have = observed.chains.get(&name).map(|c| c.rule_ids.as_slice()).unwrap_or_default();
        if let Some(r) = mapping_rules(a, m, pods).iter().find(|r| !have.iter().any(|h| h == r.id())) {
            return Some(format!("host port rule missing from nftables chain {name}: {}", r.comment));
        }
    }
    None
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::firewall::ruleset::{Op, diff};
    use weft_api::Protocol;

    fn cidr() -> PodBlocks {
        PodBlocks { pool: "10.244.1.0/24".parse().unwrap(), ipv6: None }
    }

    fn dual_stack() -> PodBlocks {
        PodBlocks { ipv6: Some("fd00:10:244:1::/64".parse().unwrap()), ..cidr() }
    }

    pub fn alloc(id: &str, ip: &str, ports: &[(Protocol, u16, u16)]) -> Allocation {
        Allocation {
            container_id: format!("{id}0123456789abcdef"),
            ifname: "eth0".into(),
            pod_namespace: "default".into(),
            pod_name: id.into(),
            pod_uid: String::new(),
            pod_ip: ip.parse().unwrap(),
            pod_ipv6: None,
            ports: ports
                .iter()
                .map(|&(protocol, container_port, host_port)| Mapping {
                    protocol,
                    container_port,
                    host_port,
                    host_ip: None,
                    name: None,
                    auto: true,
                })
                .collect(),
        }
    }

    fn json(r: &Rule) -> String {
        serde_json::to_string(&r.stmts).unwrap()
    }

    #[test]
    fn fresh_table_gets_base_chains_map_and_one_chain_per_port_and_then_converges() {
        let a = alloc("web", "10.244.1.5", &[(Protocol::Tcp, 80, 20000), (Protocol::Udp, 53, 20001)]);
        let p = part(std::slice::from_ref(&a), cidr());
        let map = &p.sets[MAP];
        assert_eq!(map.elements[&Key::ProtoPort(Proto::Tcp, 20000)].as_deref(), Some("hostport-tcp-20000"));
        assert_eq!(map.elements[&Key::ProtoPort(Proto::Udp, 20001)].as_deref(), Some("hostport-udp-20001"));
        let tcp = &p.chains["hostport-tcp-20000"].rules;
        assert_eq!(tcp.len(), 2);
        assert!(json(&tcp[0]).contains("10.244.1.0") && json(&tcp[0]).contains("mangle"), "{}", json(&tcp[0]));
        assert!(json(&tcp[1]).contains(r#""dnat":{"addr":"10.244.1.5","family":"ip","port":80}"#), "{}", json(&tcp[1]));
        assert!(tcp[1].comment.ends_with(" default/web web012345678"), "{}", tcp[1].comment);
        for base in ["hostport-prerouting", "hostport-output", "hostport-postrouting"] {
            assert!(p.chains[base].hook.is_some(), "{base}");
        }
        let ops = diff(&Default::default(), &p);
        assert!(ops.iter().all(|o| !matches!(o, Op::DeleteChain(_) | Op::FlushChain(_))));
        assert!(diff(&p.as_observed(), &p).is_empty());
    }

    #[test]
    fn arrival_order_is_as_good_as_record_order() {
        let a = alloc("a", "10.244.1.5", &[(Protocol::Tcp, 80, 20000)]);
        let b = alloc("b", "10.244.1.6", &[(Protocol::Tcp, 80, 20001)]);
        let ab = part(&[a.clone(), b.clone()], cidr());
        assert!(diff(&ab.as_observed(), &part(&[b, a], cidr())).is_empty());
    }

    #[test]
    fn adding_and_releasing_one_port_touches_one_element_and_one_chain() {
        let a = alloc("a", "10.244.1.5", &[(Protocol::Tcp, 80, 20000)]);
        let b = alloc("b", "10.244.1.6", &[(Protocol::Tcp, 80, 20001)]);
        let before = part(std::slice::from_ref(&a), cidr());
        let mut after = before.clone();
        refresh(&mut after, &[(Proto::Tcp, 20001)], &[a.clone(), b.clone()], cidr());
        assert_eq!(after, part(&[a.clone(), b.clone()], cidr()), "a refresh is the same as a rebuild");
        let ops = diff(&before.as_observed(), &after);
        assert_eq!(ops.len(), 4, "chain, two rules, one element: {ops:?}");
        assert!(matches!(&ops[0], Op::AddChain(c, None) if c == "hostport-tcp-20001"));
        let mut released = after.clone();
        refresh(&mut released, &[(Proto::Tcp, 20001)], std::slice::from_ref(&a), cidr());
        assert_eq!(released, before);
        let ops = diff(&after.as_observed(), &released);
        assert_eq!(
            ops,
            vec![
                Op::DeleteElements(MAP.into(), true, vec![Key::ProtoPort(Proto::Tcp, 20001)]),
                Op::FlushChain("hostport-tcp-20001".into()),
                Op::DeleteChain("hostport-tcp-20001".into()),
            ]
        );
    }

    #[test]
    fn comments_hold_only_printable_text_within_the_limit() {
        let mut a = alloc("a", "10.244.1.5", &[(Protocol::Tcp, 80, 8080)]);
        a.pod_name = "web\" -j ACCEPT\n-A INPUT".into();
        let p = part(std::slice::from_ref(&a), cidr());
        let r = &p.chains["hostport-tcp-8080"].rules[0];
        assert!(r.comment.ends_with("default/web\" -j ACCEPT_-A INPUT a0123456789a"), "{}", r.comment);
        a.pod_namespace = "n".repeat(63);
        a.pod_name = "p".repeat(253);
        let p = part(std::slice::from_ref(&a), cidr());
        assert!(p.chains["hostport-tcp-8080"].rules.iter().all(|r| r.comment.len() == 128));
    }

    #[test]
    fn host_ip_limits_the_destination() {
        let mut a = alloc("a", "10.244.1.5", &[(Protocol::Tcp, 80, 8080)]);
        a.ports[0].host_ip = Some("10.250.0.11".parse().unwrap());
        let p = part(std::slice::from_ref(&a), cidr());
        for r in &p.chains["hostport-tcp-8080"].rules {
            assert!(
                json(r).starts_with(
                    r#"[{"match":{"left":{"payload":{"protocol":"ip","field":"daddr"}},"right":"10.250.0.11""#
                ),
                "{}",
                json(r)
            );
        }
    }

    #[test]
    fn a_dual_stack_pod_is_forwarded_over_both_families_and_a_host_ip_keeps_to_its_own() {
        let mut a = alloc("a", "10.244.1.5", &[(Protocol::Tcp, 80, 8080), (Protocol::Udp, 53, 8053)]);
        a.pod_ipv6 = Some("fd00:10:244:1::5".parse().unwrap());
        a.ports[1].host_ip = Some("fd00:250::11".parse().unwrap());
        let p = part(std::slice::from_ref(&a), dual_stack());
        let tcp: Vec<String> = p.chains["hostport-tcp-8080"].rules.iter().map(json).collect();
        assert_eq!(tcp.len(), 4, "{tcp:#?}");
        assert!(tcp[1].contains(r#""dnat":{"addr":"10.244.1.5","family":"ip","port":80}"#), "{}", tcp[1]);
        assert!(
            tcp[2].contains(r#""protocol":"ip6","field":"saddr""#) && tcp[2].contains("fd00:10:244:1::"),
            "{}",
            tcp[2]
        );
        assert!(tcp[3].contains(r#""dnat":{"addr":"fd00:10:244:1::5","family":"ip6","port":80}"#), "{}", tcp[3]);
        // The IPv6 host IP: IPv6 only, to that address.
        let udp: Vec<String> = p.chains["hostport-udp-8053"].rules.iter().map(json).collect();
        assert_eq!(udp.len(), 2, "{udp:#?}");
        assert!(udp.iter().all(|r| r.contains(r#""field":"daddr"}},"right":"fd00:250::11""#)), "{udp:#?}");
        assert!(udp[1].contains(r#""family":"ip6""#), "{}", udp[1]);
        // A pod without an IPv6 address (or a node without a block) is IPv4 only.
        assert_eq!(part(std::slice::from_ref(&a), cidr()).chains["hostport-tcp-8080"].rules.len(), 2);
        a.pod_ipv6 = None;
        let p = part(std::slice::from_ref(&a), dual_stack());
        assert_eq!(p.chains["hostport-tcp-8080"].rules.len(), 2);
        assert!(p.chains["hostport-udp-8053"].rules.is_empty(), "an IPv6 host IP and no IPv6 pod address");
        assert!(diff(&p.as_observed(), &p).is_empty());
    }

    #[test]
    fn check_names_what_is_missing() {
        let a = alloc("a", "10.244.1.5", &[(Protocol::Tcp, 80, 20000)]);
        let p = part(std::slice::from_ref(&a), cidr());
        assert_eq!(missing(&p.as_observed(), &a, cidr()), None);
        let mut obs = p.as_observed();
        obs.chains.get_mut("hostport-tcp-20000").unwrap().rule_ids.pop();
        assert!(
            missing(&obs, &a, cidr())
                .unwrap()
                .contains("host port rule missing from nftables chain hostport-tcp-20000")
        );
        obs.sets.get_mut(MAP).unwrap().elements.clear();
        assert!(missing(&obs, &a, cidr()).unwrap().contains("not in the nftables map"));
    }
}
