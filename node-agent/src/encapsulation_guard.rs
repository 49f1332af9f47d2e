//! Pods never send the overlay's own encapsulation, as the `encap` part of
//! Weft's nftables table: one base chain at prerouting that drops UDP from
//! the cluster's pod ranges to the overlay's port (VXLAN's 8472, udp's
//! 8285), whatever its destination.
//!
//! Why: a node takes a VXLAN or udp packet from a peer node's address as
//! that node's traffic, and delivers what is inside. A pod can write such a
//! packet itself (a UDP socket is enough) and send it to another node, or
//! to any address of its own node (the kernel's VXLAN socket listens on
//! all of them); masqueraded on its way out, it arrives from its node's
//! address. The inner packet then carries whatever source the pod chose,
//! past the source guard that checked only the outer one, and policy takes
//! it for another pod's. Matching on the source (any pod of the cluster)
//! and not the interface also drops what a pod on another node sends in
//! through the tunnel. WireGuard needs none of this: a peer's packets are
//! authenticated by its key, which no pod holds.
//!
//! A pod's own tunnel to an outside host on the same port is dropped too
//! (as Calico does with workloads' VXLAN): the price of a port that cannot
//! be told apart.

use ipnet::IpNet;

use crate::firewall::build;
use crate::firewall::nft::Nft;
use crate::firewall::ruleset::{Chain, ChainKind, Hook, HookPoint, Part, Proto, Rule};
use crate::firewall::{Engine, FirewallError};

pub const OWNER: &str = "encap";
/// Counts the encapsulated packets pods tried to send.
pub const DROPPED: &str = "encap-dropped";
/// Before connection tracking (-200): a dropped packet makes no entry.
const PRIORITY: i32 = -300;

/// What is guarded: the overlay's UDP port, and the pod ranges of each
/// family the cluster has (the cluster's ranges, so that pods of other
/// nodes are covered too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encapsulation {
    pub port: u16,
    pub pods: Vec<IpNet>,
}

/// The part: an empty one (no chain) when there is nothing to guard, so
/// that a backend without an unauthenticated port leaves no rules behind.
pub fn part(guarded: Option<&Encapsulation>) -> Part {
    let mut p = Part::new(OWNER);
    let Some(g) = guarded else { return p };
    p.counters.insert(DROPPED.to_owned());
    let rules = g
        .pods
        .iter()
        .map(|net| {
            Rule::new(
                &format!("pods of {} send no overlay packets of their own", net.trunc()),
                vec![
                    build::addr_in(build::Addr::Src, net.trunc()),
                    build::l4proto(Proto::Udp),
                    build::dport(Proto::Udp, g.port, g.port),
                    build::count_into(DROPPED),
                    build::drop(),
                ],
            )
        })
        .collect();
    let hook = Hook { kind: ChainKind::Filter, point: HookPoint::Prerouting, priority: PRIORITY };
    p.chains.insert(p.name("prerouting"), Chain { hook: Some(hook), rules });
    p
}

/// Makes the kernel hold [`part`]; `Ok(true)` when something was written.
/// Blocking (runs nft): call from a blocking context. Acts in the calling
/// thread's network namespace.
pub fn ensure(guarded: Option<&Encapsulation>) -> Result<bool, FirewallError> {
    Engine::new(Nft::default()).sync(&part(guarded))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::firewall::ruleset::{Observed, Op, diff};

    fn vxlan() -> Encapsulation {
        Encapsulation { port: 8472, pods: vec!["10.244.0.0/16".parse().unwrap(), "fd00:10:244::/56".parse().unwrap()] }
    }

    fn texts(p: &Part) -> Vec<String> {
        p.chains["encap-prerouting"].rules.iter().map(|r| serde_json::to_string(&r.stmts).unwrap()).collect()
    }

    #[test]
    fn udp_from_pods_of_each_family_to_the_port_is_dropped_before_connection_tracking() {
        let p = part(Some(&vxlan()));
        let chain = &p.chains["encap-prerouting"];
        let hook = chain.hook.expect("a base chain");
        assert_eq!((hook.point, hook.priority), (HookPoint::Prerouting, -300));
        let rules = texts(&p);
        assert_eq!(rules.len(), 2, "{rules:#?}");
        for (rule, net) in rules.iter().zip(["10.244.0.0", "fd00:10:244::"]) {
            assert!(rule.contains(net) && rule.contains("\"udp\"") && rule.contains("8472"), "{rule}");
            assert!(rule.contains("encap-dropped") && rule.ends_with(r#"{"drop":null}]"#), "{rule}");
        }
        assert!(!rules[1].contains("10.244"), "no IPv4 address in the IPv6 rule: {}", rules[1]);
    }

    #[test]
    fn nothing_to_guard_leaves_no_chain_and_removes_one_left_behind() {
        let none = part(None);
        assert!(none.chains.is_empty() && none.counters.is_empty());
        let ops = diff(&part(Some(&vxlan())).as_observed(), &none);
        assert!(ops.iter().any(|o| matches!(o, Op::DeleteChain(c) if c == "encap-prerouting")), "{ops:?}");
    }

    #[test]
    fn host_bits_are_dropped_and_a_fresh_table_converges() {
        let sloppy = Encapsulation { port: 8472, pods: vec!["10.244.3.7/16".parse().unwrap()] };
        let clean = Encapsulation { port: 8472, pods: vec!["10.244.0.0/16".parse().unwrap()] };
        assert_eq!(part(Some(&sloppy)), part(Some(&clean)));
        let p = part(Some(&clean));
        assert!(!diff(&Observed::default(), &p).is_empty());
        assert!(diff(&p.as_observed(), &p).is_empty());
    }
}
