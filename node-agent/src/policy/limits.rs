//! The bounds on what standard NetworkPolicies may compile to: one policy
//! (`weft_api::standard_policy`, whose refusals the operator reports) and
//! all the policies that select one node's pods together (this agent's,
//! reported by it). A refused policy keeps isolating the pods it selects
//! and admits nothing, so refusing never opens what it closed.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::networking::v1 as netv1;
pub use weft_api::standard_policy::{MAX_COST, MAX_NODE_COST, standard_cost};

use super::model::{Cluster, PodInfo, policy_types, selects};

/// A standard policy refused for this node's bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRefusal {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub cost: u64,
    /// What the older policies that select this node's pods cost together.
    pub before: u64,
}

/// Refuses in `cluster` the standard policies past the bound of the node
/// whose pods are `local`, and returns them. Each policy that selects a
/// pod of the node counts its cost, oldest first (creation time, then
/// namespace and name), so new policies never push out older ones; a
/// refused policy costs nothing, and so does one over the per-policy
/// bound (refused everywhere).
pub fn enforce_node_bound(cluster: &mut Cluster, local: &[Arc<PodInfo>]) -> Vec<NodeRefusal> {
    // Cheap first: the policies of namespaces with a local pod, each costed
    // once (a cost walks every except of the policy).
    let local_namespaces: HashSet<&str> = local.iter().map(|p| p.namespace.as_str()).collect();
    let costed: Vec<(usize, u64)> = cluster
        .standard
        .iter()
        .enumerate()
        .filter(|(_, p)| p.metadata.namespace.as_deref().is_some_and(|ns| local_namespaces.contains(ns)))
        .filter_map(|(i, p)| Some((i, p.spec.as_ref().map(standard_cost).filter(|c| (1..=MAX_COST).contains(c))?)))
        .collect();
    if costed.iter().fold(0u64, |sum, (_, c)| sum.saturating_add(*c)) <= MAX_NODE_COST {
        return Vec::new();
    }
    let selects_local = |p: &netv1::NetworkPolicy| {
        let (Some(ns), Some(spec)) = (p.metadata.namespace.as_deref(), p.spec.as_ref()) else { return false };
        let Some(sel) = spec.pod_selector.as_ref() else { return true };
        local.iter().any(|pod| selects(ns, sel, pod))
    };
    let mut order: Vec<(usize, u64)> =
        costed.into_iter().filter(|(i, _)| selects_local(&cluster.standard[*i])).collect();
    let age = |i: usize| {
        let m = &cluster.standard[i].metadata;
        (m.creation_timestamp.as_ref(), m.namespace.as_deref(), m.name.as_deref())
    };
    order.sort_by(|a, b| age(a.0).cmp(&age(b.0)));
    let (mut total, mut refused) = (0u64, Vec::new());
    for (i, c) in order {
        if total.saturating_add(c) <= MAX_NODE_COST {
            total += c;
            continue;
        }
        let policy = &cluster.standard[i];
        let m = &policy.metadata;
        refused.push(NodeRefusal {
            namespace: m.namespace.clone().unwrap_or_default(),
            name: m.name.clone().unwrap_or_default(),
            uid: m.uid.clone().unwrap_or_default(),
            cost: c,
            before: total,
        });
        cluster.standard[i] = Arc::new(refused_form(policy));
    }
    refused
}

/// What a refused policy is enforced as: its pod selector and policy
/// types with no rule (isolated, nothing admitted).
fn refused_form(policy: &netv1::NetworkPolicy) -> netv1::NetworkPolicy {
    let spec = policy.spec.clone().unwrap_or_default();
    let (ingress, egress) = policy_types(&spec);
    let types = [(ingress, "Ingress"), (egress, "Egress")].into_iter().filter(|t| t.0).map(|t| t.1.to_owned());
    netv1::NetworkPolicy {
        metadata: policy.metadata.clone(),
        spec: Some(netv1::NetworkPolicySpec {
            pod_selector: spec.pod_selector,
            policy_types: Some(types.collect()),
            ingress: ingress.then(Vec::new),
            egress: egress.then(Vec::new),
        }),
    }
}

/// Why `r` is refused on `node`, as its Event and the agent's log say it.
pub fn node_refusal_message(r: &NodeRefusal, node: &str) -> String {
    format!(
        "refused on node {node}: its rules compile to about {} entries, and the older policies that select pods of this node already compile to {}; together they would pass Weft's per-node bound of {MAX_NODE_COST}. The pods it selects on this node stay isolated for its policy types and it admits nothing there. Remove or merge policies, or use fewer ipBlock excepts or ports",
        r.cost, r.before
    )
}

/// `namespace/name` of the standard policies over the bound (`limits`).
pub fn refused_policies(cluster: &Cluster) -> Vec<String> {
    let over = |p: &&Arc<netv1::NetworkPolicy>| p.spec.as_ref().is_some_and(|s| standard_cost(s) > MAX_COST);
    let key = |p: &Arc<netv1::NetworkPolicy>| {
        format!(
            "{}/{}",
            p.metadata.namespace.as_deref().unwrap_or_default(),
            p.metadata.name.as_deref().unwrap_or_default()
        )
    };
    cluster.standard.iter().filter(over).map(key).collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::model::tests::{NODE, cluster, std_policy};
    use crate::policy::model::{Proto, admits, compile};
    use crate::policy::pods::LocalPods;

    /// `c`'s pods on `node` (with an address).
    fn local(c: &Cluster, node: &str) -> Vec<Arc<PodInfo>> {
        LocalPods::new(node).follow(&c.pods).0.to_vec()
    }

    #[test]
    fn a_refused_policy_isolates_its_pods_and_admits_nothing() {
        let mut c = cluster();
        let excepts: Vec<String> = (0..700).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256)).collect();
        let oversized = json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [
            {"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": excepts}}]}]});
        c.standard = vec![std_policy("prod", "huge", oversized)];
        assert!(standard_cost(&c.standard[0].spec.clone().unwrap()) > MAX_COST);
        let pods = compile(&c, NODE);
        let db = pods.iter().find(|p| p.key == "prod/db").expect("prod/db stays under policy");
        let ingress = db.ingress.as_ref().expect("isolated for ingress");
        assert!(ingress.rules.is_empty() && ingress.default_deny, "{ingress:?}");
        assert!(!admits(ingress, "10.200.0.1".parse().unwrap(), Proto::Tcp, 5432));
    }

    /// A policy that selects `app: db` in `prod`, allowing `n` IPv4 blocks
    /// with 600 excepts each (cost about 19,200 per rule), created at `t`.
    fn heavy(name: &str, t: &str, port: i32) -> Arc<netv1::NetworkPolicy> {
        let excepts: Vec<String> = (0..599).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256)).collect();
        let spec = json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [
            {"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": excepts}}], "ports": [{"port": port}]}]});
        let mut p = (*std_policy("prod", name, spec)).clone();
        p.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t.parse().unwrap()));
        Arc::new(p)
    }

    #[test]
    fn past_the_node_bound_the_newest_policies_are_refused_and_the_older_kept() {
        let mut c = cluster();
        // Eleven policies of about 19,200 each: ten fit under 200,000.
        let mut policies: Vec<_> = (0..11)
            .map(|i| heavy(&format!("p{i:02}"), &format!("2026-01-01T00:00:{:02}Z", 59 - i), 1000 + i))
            .collect();
        assert!(policies.iter().all(|p| standard_cost(p.spec.as_ref().unwrap()) <= MAX_COST));
        policies.reverse();
        c.standard = policies;
        let here = local(&c, NODE);
        let refused = enforce_node_bound(&mut c, &here);
        // p10 is the oldest (00:00:49) and p00 the newest (00:00:59).
        assert_eq!(refused.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["p00"], "{refused:?}");
        assert!(refused[0].before + refused[0].cost > MAX_NODE_COST);
        let message = node_refusal_message(&refused[0], NODE);
        assert!(message.contains("per-node bound of 200000"), "{message}");
        let pods = compile(&c, NODE);
        let db = pods.iter().find(|p| p.key == "prod/db").expect("prod/db under policy");
        let ingress = db.ingress.as_ref().expect("isolated for ingress");
        let from = "10.255.0.1".parse().unwrap();
        assert!(admits(ingress, from, Proto::Tcp, 1010), "the oldest policy's port is admitted");
        assert!(!admits(ingress, from, Proto::Tcp, 1000), "the refused policy's port is not");
        // Enforcing again is stable: the refused form costs nothing.
        let mut again = c.clone();
        assert!(enforce_node_bound(&mut again, &here).is_empty());
    }

    #[test]
    fn policies_that_select_no_pod_of_the_node_cost_it_nothing() {
        let mut c = cluster();
        c.standard = (0..11).map(|i| heavy(&format!("p{i:02}"), "2026-01-01T00:00:00Z", 1000 + i)).collect();
        let elsewhere = enforce_node_bound(&mut c.clone(), &local(&c, "another-node"));
        assert!(elsewhere.is_empty(), "{elsewhere:?}");
        let here = local(&c, NODE);
        assert_eq!(enforce_node_bound(&mut c, &here).len(), 1);
    }
}
