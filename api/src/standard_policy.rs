//! The bound on what one standard (`networking.k8s.io/v1`) NetworkPolicy
//! may compile to, pure: the agents enforce it, the operator reports it.
//!
//! Standard NetworkPolicy has no item limits: a tenant may write an
//! `ipBlock` with thousands of `except` entries (each becomes up to 32
//! IPv4 or 128 IPv6 prefixes once the holes are cut out) and thousands of
//! `ports`, which multiply. Compiled, that is millions of set elements or
//! rules in every agent that runs a pod it selects. A policy whose cost
//! is over [`MAX_COST`] is refused: it still isolates the pods it selects
//! (its policy types hold) but admits nothing, so refusing it never opens
//! what it closed, and it never holds back the other policies. (Weft's own
//! NetworkPolicy has item limits in its CRD.)

use k8s_openapi::api::networking::v1 as netv1;

/// The most a policy may cost: prefixes times port entries, summed over
/// its rules (about what the agent writes for it).
pub const MAX_COST: u64 = 20_000;

/// The most the standard policies that select one node's pods may cost
/// together: past it, the newest are refused on that node (each agent
/// enforces it for its own pods).
pub const MAX_NODE_COST: u64 = 200_000;

/// What `spec` may compile to, at most: for each rule, its peers' weight
/// (1 for pods or namespaces, an `ipBlock` 1 plus 32 per IPv4 or 128 per
/// IPv6 `except`) times its port entries (at least 1).
pub fn standard_cost(spec: &netv1::NetworkPolicySpec) -> u64 {
    let ingress = spec.ingress.iter().flatten().map(|r| rule_cost(r.from.as_deref(), r.ports.as_deref()));
    let egress = spec.egress.iter().flatten().map(|r| rule_cost(r.to.as_deref(), r.ports.as_deref()));
    ingress.chain(egress).fold(0u64, u64::saturating_add)
}

fn rule_cost(peers: Option<&[netv1::NetworkPolicyPeer]>, ports: Option<&[netv1::NetworkPolicyPort]>) -> u64 {
    let weight = |p: &netv1::NetworkPolicyPeer| match &p.ip_block {
        Some(b) => {
            b.except.iter().flatten().map(|e| if e.contains(':') { 128 } else { 32 }).fold(1u64, u64::saturating_add)
        }
        None => 1,
    };
    let peers = peers.unwrap_or_default().iter().map(weight).fold(0u64, u64::saturating_add).max(1);
    let ports = u64::try_from(ports.unwrap_or_default().len()).unwrap_or(u64::MAX).max(1);
    peers.saturating_mul(ports)
}

/// Why a policy is refused (its cost is over [`MAX_COST`]), as its Event
/// and the agents' log say it; `None` when it is enforced as written.
pub fn refusal(spec: &netv1::NetworkPolicySpec) -> Option<String> {
    let cost = standard_cost(spec);
    (cost > MAX_COST).then(|| {
        format!(
            "refused: its rules compile to about {cost} entries (address prefixes times ports), over Weft's bound of {MAX_COST}; the pods it selects stay isolated for its policy types and it admits nothing. Split it, or use fewer ipBlock excepts or ports"
        )
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn spec(v: serde_json::Value) -> netv1::NetworkPolicySpec {
        serde_json::from_value(v).expect("spec")
    }

    #[test]
    fn ordinary_policies_cost_little_and_the_attack_costs_more_than_the_bound() {
        let ordinary = spec(json!({"podSelector": {}, "ingress": [
            {"from": [{"podSelector": {}}, {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
             "ports": [{"port": 80}, {"port": 443}]}]}));
        assert_eq!(standard_cost(&ordinary), (1 + 33) * 2);
        let excepts: Vec<String> = (0..1000).map(|i| format!("fd00:{i:x}::/48")).collect();
        let ports: Vec<serde_json::Value> = (1..=1000).map(|p| json!({"port": p})).collect();
        let attack = spec(json!({"podSelector": {}, "egress": [
            {"to": [{"ipBlock": {"cidr": "fd00::/16", "except": excepts}}], "ports": ports}]}));
        assert!(standard_cost(&attack) > MAX_COST * 1000, "{}", standard_cost(&attack));
        let deny_all = spec(json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}));
        assert_eq!(standard_cost(&deny_all), 0);
    }

    #[test]
    fn a_refusal_says_what_the_policy_costs_and_what_it_still_does() {
        let small = spec(json!({"podSelector": {}, "ingress": [{"ports": [{"port": 80}]}]}));
        assert_eq!(refusal(&small), None);
        let ports: Vec<serde_json::Value> = (1..=20_001).map(|p| json!({"port": p % 65535 + 1})).collect();
        let big = spec(json!({"podSelector": {}, "ingress": [{"ports": ports}]}));
        let why = refusal(&big).expect("refused");
        assert!(why.contains("20001") && why.contains("20000") && why.contains("admits nothing"), "{why}");
    }
}
