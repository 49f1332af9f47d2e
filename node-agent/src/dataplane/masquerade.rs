//! Masquerade of pod traffic leaving the cluster, as the `masquerade` part
//! of Weft's nftables table: one base chain at the srcnat hook. Pod-to-pod
//! traffic (destination inside the cluster CIDR) and multicast are never
//! masqueraded, so pods see each other's real addresses. Named counters
//! tell how much traffic kept its source and how much was masqueraded.

use ipnet::Ipv4Net;

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

/// What the masquerade part holds for this node's pods.
pub fn part(pod_cidr: Ipv4Net, cluster_cidr: Ipv4Net) -> Part {
    let (s, c) = (pod_cidr.trunc(), cluster_cidr.trunc());
    let multicast: Ipv4Net = "224.0.0.0/4".parse().unwrap_or_default();
    let mut p = Part::new(OWNER);
    p.counters.extend([KEPT.to_owned(), MASQUERADED.to_owned()]);
    let rules = vec![
        Rule::new(
            "pod-to-pod keeps its source",
            vec![build::addr_in(Addr::Src, s), build::addr_in(Addr::Dst, c), build::count_into(KEPT), build::accept()],
        ),
        Rule::new(
            "no masquerade for multicast",
            vec![
                build::addr_in(Addr::Src, s),
                build::addr_in(Addr::Dst, multicast),
                build::count_into(KEPT),
                build::accept(),
            ],
        ),
        Rule::new(
            "pod to outside the cluster",
            vec![build::addr_in(Addr::Src, s), build::count_into(MASQUERADED), build::masquerade()],
        ),
    ];
    let hook = Hook { kind: ChainKind::Nat, point: HookPoint::Postrouting, priority: SRCNAT };
    p.chains.insert(p.name("postrouting"), Chain { hook: Some(hook), rules });
    p
}

/// Makes the masquerade rules right; `Ok(true)` when something was written.
/// Blocking (runs nft): call from a blocking context. Acts in the calling
/// thread's network namespace.
pub fn ensure(pod_cidr: Ipv4Net, cluster_cidr: Ipv4Net) -> Result<bool, MasqueradeError> {
    Engine::new(Nft::default()).sync(&part(pod_cidr, cluster_cidr))
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

    fn pod() -> Ipv4Net {
        "10.244.1.0/24".parse().unwrap()
    }

    fn cluster() -> Ipv4Net {
        "10.244.0.0/16".parse().unwrap()
    }

    fn text(r: &Rule) -> String {
        serde_json::to_string(&r.stmts).unwrap()
    }

    #[test]
    fn rules_never_masquerade_pod_to_pod() {
        let p = part(pod(), cluster());
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
        let a = part("10.244.1.7/24".parse().unwrap(), "10.244.3.0/16".parse().unwrap());
        assert_eq!(a, part(pod(), cluster()));
    }

    #[test]
    fn fresh_table_gets_chain_counters_and_rules_and_then_converges() {
        let p = part(pod(), cluster());
        let ops = diff(&Observed::default(), &p);
        assert_eq!(ops.iter().filter(|o| matches!(o, Op::AddRule(..))).count(), 3);
        assert_eq!(ops.iter().filter(|o| matches!(o, Op::AddCounter(..))).count(), 2);
        assert!(diff(&p.as_observed(), &p).is_empty());
    }

    #[test]
    fn changed_cidr_rewrites_the_chain_only() {
        let ops = diff(&part(pod(), cluster()).as_observed(), &part("10.244.9.0/24".parse().unwrap(), cluster()));
        assert!(matches!(&ops[0], Op::FlushChain(c) if c == "masquerade-postrouting"), "{ops:?}");
        assert_eq!(ops.len(), 4, "flush and three rules: {ops:?}");
    }
}
