//! `ClusterNetworkPolicy` (`policy.networking.k8s.io/v1beta1`), the SIG
//! Network policy API (`sigs.k8s.io/network-policy-api`): cluster-scoped
//! policy in two tiers, Admin (before NetworkPolicy) and Baseline (after
//! it). These types read the objects; the CRD is the module's own, vendored
//! in `charts/weft/files/clusternetworkpolicies/` (a test checks that these
//! types have exactly its fields, those of its experimental channel).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the policy API.
pub const GROUP: &str = "policy.networking.k8s.io";

#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1beta1",
    kind = "ClusterNetworkPolicy",
    plural = "clusternetworkpolicies",
    status = "ClusterNetworkPolicyStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    pub tier: Tier,
    /// 0 to 1000; lower values are checked first within the tier.
    pub priority: i32,
    pub subject: Subject,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<IngressRule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<EgressRule>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Tier {
    Admin,
    Baseline,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Action {
    Accept,
    Deny,
    /// Hands the decision to the next tier (NetworkPolicy after Admin).
    Pass,
}

/// The pods the policy applies to: exactly one of the two.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Pods by label; absent `namespaceSelector`: in every namespace.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    pub pod_selector: LabelSelector,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IngressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: Action,
    pub from: Vec<IngressPeer>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protocols: Vec<Protocol>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: Action,
    pub to: Vec<EgressPeer>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protocols: Vec<Protocol>,
}

/// Exactly one field set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IngressPeer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Exactly one field set; `nodes` and `domainNames` are experimental.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressPeer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    /// CIDRs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domain_names: Vec<String>,
}

/// Exactly one field set; `destinationNamedPort` is experimental.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Protocol {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<ProtocolPorts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp: Option<ProtocolPorts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sctp: Option<ProtocolPorts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_named_port: Option<String>,
}

/// The ports of one protocol; none: every port.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProtocolPorts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_port: Option<Port>,
}

/// A port number or an inclusive range: exactly one.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<PortRange>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub struct PortRange {
    pub start: i32,
    pub end: i32,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct ClusterNetworkPolicyStatus {
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// The status condition Weft's operator keeps on each ClusterNetworkPolicy:
/// True when Weft enforces it as written, False with the reason when it
/// enforces it failing closed (see [`problems`]).
pub const CONDITION_ACCEPTED: &str = "Accepted";

/// The most one ClusterNetworkPolicy may compile to, as for a standard
/// NetworkPolicy ([`crate::standard_policy::MAX_COST`]). The CRD's item
/// limits (25 rules, 25 peers, 25 networks, 25 protocol entries) still allow
/// hundreds of thousands of entries in every agent.
pub const MAX_COST: u64 = crate::standard_policy::MAX_COST;

/// What `spec` may compile to, at most: for each rule, its peers' weight (a
/// network each, 1 for any other peer) times its protocol entries (at
/// least 1).
pub fn cost(spec: &ClusterNetworkPolicySpec) -> u64 {
    let rule = |peers: u64, protocols: usize| peers.saturating_mul(protocols.max(1) as u64);
    let ingress = spec.ingress.iter().map(|r| rule(r.from.len() as u64, r.protocols.len()));
    let egress = spec.egress.iter().map(|r| {
        let peers = r.to.iter().map(|p| (p.networks.len() as u64).max(1)).fold(0u64, u64::saturating_add);
        rule(peers, r.protocols.len())
    });
    ingress.chain(egress).fold(0u64, u64::saturating_add)
}

/// Why Weft cannot enforce `spec` as written, one text each (none: it can).
/// Either way nothing opens: an oversized policy's rules and a rule with a
/// peer Weft cannot match fail closed (an Accept matches nothing, a Deny or
/// Pass denies everything), as the API asks of unsupported peers.
pub fn problems(spec: &ClusterNetworkPolicySpec) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let cost = cost(spec);
    if cost > MAX_COST {
        out.push((
            "TooLarge",
            format!(
                "it may compile to {cost} entries, over Weft's limit of {MAX_COST} per policy: every rule fails closed (split it into smaller policies)"
            ),
        ));
    }
    for (i, r) in spec.egress.iter().enumerate() {
        if r.to.iter().any(|p| !p.domain_names.is_empty()) {
            let name = r.name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default();
            out.push((
                "DomainNamesUnsupported",
                format!(
                    "egress rule {i}{name}: Weft does not match domainNames peers yet, so the rule fails closed ({})",
                    if r.action == Action::Accept {
                        "it accepts nothing"
                    } else {
                        "it denies all egress of its subjects"
                    }
                ),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use kube::CustomResourceExt;
    use serde_json::Value;

    use super::*;

    /// Every property path of an OpenAPI schema (`spec.ingress[].from[].pods`),
    /// a required one marked with a `!` at its end.
    fn paths(schema: &Value, at: &str, out: &mut BTreeSet<String>) {
        let required: Vec<&str> =
            schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (name, sub) in props {
                let path = if at.is_empty() { name.clone() } else { format!("{at}.{name}") };
                out.insert(if required.contains(&name.as_str()) { format!("{path}!") } else { path.clone() });
                paths(sub, &path, out);
            }
        }
        if let Some(items) = schema.get("items") {
            paths(items, &format!("{at}[]"), out);
        }
    }

    fn v1beta1_paths(crd: &Value) -> BTreeSet<String> {
        let versions = crd["spec"]["versions"].as_array().expect("versions");
        let v1beta1 = versions.iter().find(|v| v["name"] == "v1beta1").expect("v1beta1 is served");
        let mut out = BTreeSet::new();
        paths(&v1beta1["schema"]["openAPIV3Schema"], "", &mut out);
        // What is required of spec (status is ours to write).
        out.retain(|p| p.starts_with("spec"));
        out
    }

    #[test]
    fn the_types_have_exactly_the_fields_and_required_ones_of_the_modules_experimental_crd() {
        let file =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/weft/files/clusternetworkpolicies/experimental.yaml");
        let text = std::fs::read_to_string(file).expect("the vendored CRD");
        let upstream: Value = serde_yaml::from_str(&text).expect("CRD YAML");
        let ours = serde_json::to_value(ClusterNetworkPolicy::crd()).expect("CRD JSON");
        let (upstream, ours) = (v1beta1_paths(&upstream), v1beta1_paths(&ours));
        assert!(upstream.contains("spec.egress[].to[].nodes"), "{upstream:?}");
        assert!(upstream.contains("spec.subject.pods.podSelector!"), "{upstream:?}");
        assert_eq!(
            ours.symmetric_difference(&upstream).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "fields only in one of them"
        );
    }

    #[test]
    fn an_admin_policy_reads_as_the_api_writes_it() {
        let yaml = "
apiVersion: policy.networking.k8s.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: sensitive}
spec:
  tier: Admin
  priority: 10
  subject:
    pods: {podSelector: {matchLabels: {app: db}}}
  ingress:
  - name: pass-monitoring
    action: Pass
    from: [{namespaces: {matchLabels: {team: monitoring}}}]
    protocols: [{tcp: {destinationPort: {range: {start: 9000, end: 9100}}}}]
  egress:
  - action: Deny
    to: [{networks: [10.0.0.0/8, fd00::/8]}]
";
        let p: ClusterNetworkPolicy = serde_yaml::from_str(yaml).expect("parses");
        assert_eq!((p.spec.tier, p.spec.priority), (Tier::Admin, 10));
        let rule = &p.spec.ingress[0];
        assert_eq!((rule.action, rule.name.as_deref()), (Action::Pass, Some("pass-monitoring")));
        let port = rule.protocols[0].tcp.as_ref().and_then(|t| t.destination_port.as_ref()).expect("port");
        assert_eq!(port.range, Some(PortRange { start: 9000, end: 9100 }));
        assert_eq!(p.spec.egress[0].to[0].networks, ["10.0.0.0/8", "fd00::/8"]);
        assert!(p.spec.subject.namespaces.is_none());
    }

    #[test]
    fn problems_name_unsupported_peers_and_an_oversized_policy() {
        let spec = |egress: serde_json::Value| -> ClusterNetworkPolicySpec {
            serde_json::from_value(serde_json::json!({"tier": "Admin", "priority": 1,
                "subject": {"namespaces": {}}, "egress": egress}))
            .unwrap()
        };
        let ok = spec(serde_json::json!([{"action": "Deny", "to": [{"networks": ["10.0.0.0/8"]}]}]));
        assert_eq!((cost(&ok), problems(&ok)), (1, vec![]));
        let domains =
            spec(serde_json::json!([{"name": "dns", "action": "Accept", "to": [{"domainNames": ["example.com"]}]}]));
        let found = problems(&domains);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, "DomainNamesUnsupported");
        assert!(found[0].1.contains("egress rule 0 (dns)") && found[0].1.contains("accepts nothing"), "{found:?}");
        // The CRD's limits: 25 rules × 25 peers × 25 networks × 25 protocol entries.
        let nets: Vec<String> = (0..25).map(|i| format!("10.{i}.0.0/16")).collect();
        let protos: Vec<_> = (1..=25).map(|p| serde_json::json!({"tcp": {"destinationPort": {"number": p}}})).collect();
        let rule = serde_json::json!({"action": "Deny", "to": vec![serde_json::json!({"networks": nets}); 25], "protocols": protos});
        let big = spec(serde_json::Value::Array(vec![rule; 25]));
        assert_eq!(cost(&big), 25 * 25 * 25 * 25);
        assert_eq!(problems(&big)[0].0, "TooLarge");
    }
}
