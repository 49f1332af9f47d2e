//! Masquerade of pod traffic leaving the cluster, as the `masquerade` part
//! of Weft's nftables table: one base chain at the srcnat hook. Pod-to-pod
//! traffic (destination inside the cluster CIDR) and multicast are never
//! masqueraded, so pods see each other's real addresses. IPv6 traffic gets
//! the same rules when its caller asks for them (a dual-stack node whose
//! pods' IPv6 addresses are not routable beyond it). Named counters tell
//! how much traffic kept its source and how much was masqueraded.

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::firewall::build::{self, Addr};
use crate::firewall::nft::Nft;
use crate::firewall::ruleset::{Chain, ChainKind, Hook, HookPoint, Part, Rule, SRCNAT};
use crate::firewall::{Engine, FirewallError};

pub const OWNER: &str = "masquerade";
/// Counts packets from pods to the cluster or multicast (kept their source).
pub const KEPT: &str = "masquerade-kept";
/// Counts packets from pods masqueraded on their way out of the cluster.
pub const MASQUERADED: &str = "masquerade-masqueraded";

pub type MasqueradeError = FirewallError;

/// This node's pod block and the cluster's range of one family: traffic
/// from the block leaving the range is masqueraded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ranges<N> {
    pub pods: N,
    pub cluster: N,
}

/// What the masquerade part holds for this node's pods: the rules of each
/// family that is set (IPv4 on all but IPv6-only nodes; IPv6 as the caller
/// decided).
pub fn part(ipv4: Option<Ranges<Ipv4Net>>, ipv6: Option<Ranges<Ipv6Net>>) -> Part {
    let mut p = Part::new(OWNER);
    p.counters.extend([KEPT.to_owned(), MASQUERADED.to_owned()]);
    let mut rules = Vec::new();
    if let Some(v4) = ipv4 {
        let multicast4: Ipv4Net = "224.0.0.0/4".parse().unwrap_or_default();
        rules.extend(family_rules("", v4.pods.trunc().into(), v4.cluster.trunc().into(), multicast4.into()));
    }
    if let Some(v6) = ipv6 {
        let multicast6: Ipv6Net = "ff00::/8".parse().unwrap_or_default();
        rules.extend(family_rules("IPv6 ", v6.pods.trunc().into(), v6.cluster.trunc().into(), multicast6.into()));
    }
    let hook = Hook { kind: ChainKind::Nat, point: HookPoint::Postrouting, priority: SRCNAT };
    p.chains.insert(p.name("postrouting"), Chain { hook: Some(hook), rules });
    p
}

/// The three rules of one family (`tag` names it in the rule comments).
fn family_rules(tag: &str, pods: IpNet, cluster: IpNet, multicast: IpNet) -> Vec<Rule> {
    let kept = |text: &str, to: IpNet| {
        let stmts = vec![build::addr_in(Addr::Src, pods), build::addr_in(Addr::Dst, to), build::count_into(KEPT)];
        Rule::new(&format!("{tag}{text}"), [stmts, vec![build::accept()]].concat())
    };
    vec![
        kept("pod-to-pod keeps its source", cluster),
        kept("no masquerade for multicast", multicast),
        Rule::new(
            &format!("{tag}pod to outside the cluster"),
            vec![build::addr_in(Addr::Src, pods), build::count_into(MASQUERADED), build::masquerade()],
        ),
    ]
}

/// Makes the masquerade rules right; `Ok(true)` when something was written.
/// Blocking (runs nft): call from a blocking context. Acts in the calling
/// thread's network namespace.
pub fn ensure(ipv4: Option<Ranges<Ipv4Net>>, ipv6: Option<Ranges<Ipv6Net>>) -> Result<bool, MasqueradeError> {
    Engine::new(Nft::default()).sync(&part(ipv4, ipv6))
}

/// Removes Weft's masquerade rules; `Ok(true)` when something was removed.
#[allow(dead_code)] // the clean-up path: tests, and an uninstall hook later
pub fn remove() -> Result<bool, MasqueradeError> {
    Engine::new(Nft::default()).remove(OWNER)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::firewall::ruleset::{Observed, Op, diff};

    fn v4(pods: &str, cluster: &str) -> Ranges<Ipv4Net> {
        Ranges { pods: pods.parse().unwrap(), cluster: cluster.parse().unwrap() }
    }

    fn ipv4() -> Ranges<Ipv4Net> {
        v4("10.244.1.0/24", "10.244.0.0/16")
    }

    fn ipv6() -> Ranges<Ipv6Net> {
        Ranges { pods: "fd00:10:244:1::/64".parse().unwrap(), cluster: "fd00:10:244::/56".parse().unwrap() }
    }

    fn text(r: &Rule) -> String {
        serde_json::to_string(&r.stmts).unwrap()
    }

    #[test]
    fn rules_never_masquerade_pod_to_pod() {
        let p = part(Some(ipv4()), None);
        let chain = &p.chains["masquerade-postrouting"];
        assert_eq!(chain.hook.map(|h| h.priority), Some(SRCNAT));
        let rules: Vec<String> = chain.rules.iter().map(text).collect();
        // Pod-to-pod and multicast are accepted (kept) before the masquerade.
        assert!(rules[0].contains("10.244.1.0") && rules[0].contains("10.244.0.0") && rules[0].contains("accept"));
        assert!(rules[1].contains("224.0.0.0") && rules[1].contains("accept"));
        assert!(rules[2].contains("masquerade") && rules[2].contains("fully-random"), "{}", rules[2]);
        assert_eq!(rules.iter().filter(|r| r.contains("masquerade\"")).count(), 1);
    }

    #[test]
    fn host_bits_are_dropped_from_cidrs() {
        let a = part(Some(v4("10.244.1.7/24", "10.244.3.0/16")), None);
        assert_eq!(a, part(Some(ipv4()), None));
    }

    #[test]
    fn ipv6_gets_the_same_three_rules_after_ipv4_and_ipv4_stays_as_it_was() {
        let (single, dual) = (part(Some(ipv4()), None), part(Some(ipv4()), Some(ipv6())));
        let rules = |p: &Part| -> Vec<String> { p.chains["masquerade-postrouting"].rules.iter().map(text).collect() };
        let (single, dual) = (rules(&single), rules(&dual));
        assert_eq!(dual.len(), 6, "{dual:#?}");
        assert_eq!(dual[..3], single[..], "the IPv4 rules do not change");
        assert!(dual[3].contains("fd00:10:244:1::") && dual[3].contains("fd00:10:244::") && dual[3].contains("accept"));
        assert!(dual[3].contains(r#""protocol":"ip6""#), "matched as IPv6: {}", dual[3]);
        assert!(dual[4].contains("ff00::") && dual[4].contains("accept"), "{}", dual[4]);
        assert!(dual[5].contains("masquerade") && dual[5].contains("fd00:10:244:1::"), "{}", dual[5]);
        assert!(!dual[5].contains("10.244"), "no IPv4 address in an IPv6 rule: {}", dual[5]);
        let v6_only = rules(&part(None, Some(ipv6())));
        assert_eq!(v6_only[..], dual[3..], "an IPv6-only node has the IPv6 rules alone");
    }

    #[test]
    fn fresh_table_gets_chain_counters_and_rules_and_then_converges() {
        let p = part(Some(ipv4()), None);
        let ops = diff(&Observed::default(), &p);
        assert_eq!(ops.iter().filter(|o| matches!(o, Op::AddRule(..))).count(), 3);
        assert_eq!(ops.iter().filter(|o| matches!(o, Op::AddCounter(..))).count(), 2);
        assert!(diff(&p.as_observed(), &p).is_empty());
    }

    #[test]
    fn changed_cidr_rewrites_the_chain_only() {
        let ops =
            diff(&part(Some(ipv4()), None).as_observed(), &part(Some(v4("10.244.9.0/24", "10.244.0.0/16")), None));
        assert!(matches!(&ops[0], Op::FlushChain(c) if c == "masquerade-postrouting"), "{ops:?}");
        assert_eq!(ops.len(), 4, "flush and three rules: {ops:?}");
    }
}
