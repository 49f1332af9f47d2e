//! `NetworkPolicy` (weft.dev): prioritised allow/deny rules for selected pods,
//! evaluated before the standard `networking.k8s.io` policies. The semantics
//! are documented in docs/network-policy.md; [`validate`] holds the checks
//! the CRD schema cannot express (the operator reports them in the status,
//! the agent skips a policy that fails them).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::Protocol;

/// Allow/deny rules for the pods selected in this namespace. Rules are
/// evaluated in order of `priority` (highest first, Deny before Allow at
/// equal priority); the first matching rule decides (Deny drops, Allow admits
/// without consulting standard policies).
/// Traffic no Weft rule matches goes on to the standard NetworkPolicies.
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "weft.dev",
    version = "v1alpha1",
    kind = "NetworkPolicy",
    plural = "networkpolicies",
    shortname = "wnp",
    namespaced,
    status = "NetworkPolicyStatus",
    category = "weft",
    printcolumn(name = "Priority", type_ = "integer", json_path = ".spec.priority"),
    printcolumn(name = "Pods", type_ = "integer", json_path = ".status.selectedPods"),
    printcolumn(name = "Accepted", type_ = "string", json_path = ".status.conditions[?(@.type==\"Accepted\")].status"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    doc = "Weft network policy with ordered allow/deny rules"
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// Pods of this namespace the policy applies to; empty selects all.
    #[serde(default)]
    pub pod_selector: LabelSelector,
    /// 0 (lowest) to 1000 (highest).
    #[serde(default)]
    #[schemars(range(min = 0, max = 1000))]
    pub priority: i32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub ingress: Vec<PolicyRule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub egress: Vec<PolicyRule>,
}

/// What a matching rule does.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum PolicyAction {
    Allow,
    Deny,
}

/// One rule: traffic from (ingress) or to (egress) `peers` on `ports` is
/// allowed or denied. Empty `peers` match every address, empty `ports` every
/// port and protocol.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct PolicyRule {
    pub action: PolicyAction,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub peers: Vec<PolicyPeer>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub ports: Vec<PolicyPort>,
}

/// A peer: pods (optionally in other namespaces) or an IP block. Given both
/// selectors, pods must match both (podSelector within the selected
/// namespaces); a podSelector alone means the policy's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = Rule::new("has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)").message("a peer needs podSelector, namespaceSelector or ipBlock"))]
#[x_kube(validation = Rule::new("!has(self.ipBlock) || (!has(self.podSelector) && !has(self.namespaceSelector))").message("ipBlock cannot be combined with podSelector or namespaceSelector"))]
#[serde(rename_all = "camelCase")]
pub struct PolicyPeer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_block: Option<IpBlock>,
}

/// A CIDR with optional holes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct IpBlock {
    #[x_kube(validation = Rule::new("isCIDR(self)").message("ipBlock.cidr must be a valid CIDR such as 10.0.0.0/8"))]
    #[schemars(length(min = 9, max = 43))]
    pub cidr: String,
    /// Ranges inside `cidr` to leave out (validated by the controller; a CEL
    /// rule per entry would blow the apiserver's cost budget).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(min = 9, max = 43)))]
    pub except: Vec<String>,
}

/// A port, a named port (resolved against the destination pod's container
/// ports) or a numeric range `port`..=`endPort`. No `port`: every port of
/// `protocol`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("!has(self.endPort) || (has(self.port) && type(self.port) == int && self.endPort >= self.port)").message("endPort requires a numeric port and must not be below it"))]
#[x_kube(validation = Rule::new("!has(self.port) || type(self.port) != int || (self.port >= 1 && self.port <= 65535)").message("port must be between 1 and 65535"))]
#[serde(rename_all = "camelCase")]
pub struct PolicyPort {
    #[serde(default)]
    pub protocol: Protocol,
    /// A number (1-65535) or the name of a container port of the destination pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<IntOrString>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub end_port: Option<i32>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicyStatus {
    /// `Accepted`: True once the operator validated the policy, False with
    /// the reason when it is rejected (agents then ignore it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::common::conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Number of pods the policy currently selects.
    #[serde(default)]
    pub selected_pods: i32,
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The status condition the operator maintains.
pub const CONDITION_ACCEPTED: &str = "Accepted";

/// Checks what the CRD schema cannot (CIDR containment, selector syntax).
/// Returns every problem, each naming its field; empty when valid.
pub fn validate(spec: &NetworkPolicySpec) -> Vec<String> {
    let mut problems = Vec::new();
    crate::selector::validate(&spec.pod_selector, "spec.podSelector", &mut problems);
    for (dir, rules) in [("ingress", &spec.ingress), ("egress", &spec.egress)] {
        for (i, rule) in rules.iter().enumerate() {
            for (j, peer) in rule.peers.iter().enumerate() {
                let at = format!("spec.{dir}[{i}].peers[{j}]");
                if let Some(s) = &peer.pod_selector {
                    crate::selector::validate(s, &format!("{at}.podSelector"), &mut problems);
                }
                if let Some(s) = &peer.namespace_selector {
                    crate::selector::validate(s, &format!("{at}.namespaceSelector"), &mut problems);
                }
                if let Some(b) = &peer.ip_block {
                    validate_ip_block(b, &format!("{at}.ipBlock"), &mut problems);
                }
            }
            for (j, port) in rule.ports.iter().enumerate() {
                if let Some(IntOrString::String(name)) = &port.port
                    && !is_port_name(name)
                {
                    problems.push(format!(
                        "spec.{dir}[{i}].ports[{j}].port: {name:?} is not a port name (lowercase letters, digits and '-', at most 15 characters, at least one letter)"
                    ));
                }
            }
        }
    }
    problems
}

/// An IANA service name, as container port names are.
fn is_port_name(n: &str) -> bool {
    (1..=15).contains(&n.len())
        && n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && n.bytes().any(|b| b.is_ascii_lowercase())
        && !n.starts_with('-')
        && !n.ends_with('-')
        && !n.contains("--")
}

fn validate_ip_block(b: &IpBlock, at: &str, problems: &mut Vec<String>) {
    let Ok(cidr) = b.cidr.parse::<ipnet::IpNet>() else {
        problems.push(format!("{at}.cidr: {:?} is not a CIDR", b.cidr));
        return;
    };
    for (k, e) in b.except.iter().enumerate() {
        match e.parse::<ipnet::IpNet>() {
            Err(_) => problems.push(format!("{at}.except[{k}]: {e:?} is not a CIDR")),
            Ok(ex) if !(cidr.contains(&ex) && ex.prefix_len() > cidr.prefix_len()) => {
                problems.push(format!("{at}.except[{k}]: {e} is not strictly inside cidr {}", b.cidr))
            }
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_with_block(cidr: &str, except: &[&str]) -> NetworkPolicySpec {
        NetworkPolicySpec {
            pod_selector: LabelSelector::default(),
            priority: 0,
            ingress: vec![PolicyRule {
                action: PolicyAction::Deny,
                peers: vec![PolicyPeer {
                    ip_block: Some(IpBlock {
                        cidr: cidr.into(),
                        except: except.iter().map(|e| (*e).to_owned()).collect(),
                    }),
                    ..Default::default()
                }],
                ports: vec![],
            }],
            egress: vec![],
        }
    }

    #[test]
    fn except_must_be_strictly_inside_cidr() {
        assert!(validate(&spec_with_block("10.0.0.0/8", &["10.1.0.0/16"])).is_empty());
        let p = validate(&spec_with_block("10.0.0.0/8", &["192.168.0.0/16", "10.0.0.0/8", "nope"]));
        assert_eq!(p.len(), 3, "{p:?}");
        assert_eq!(
            p[0],
            "spec.ingress[0].peers[0].ipBlock.except[0]: 192.168.0.0/16 is not strictly inside cidr 10.0.0.0/8"
        );
        assert!(p[1].contains("except[1]: 10.0.0.0/8 is not strictly inside"), "{p:?}");
        assert!(p[2].contains("except[2]: \"nope\" is not a CIDR"), "{p:?}");
    }

    #[test]
    fn port_names_are_iana_service_names() {
        for good in ["http", "metrics-9090", "a"] {
            assert!(is_port_name(good), "{good}");
        }
        for bad in ["", "HTTP", "-http", "http-", "a--b", "1234", "a-very-long-port-name"] {
            assert!(!is_port_name(bad), "{bad}");
        }
        let mut spec = spec_with_block("10.0.0.0/8", &[]);
        spec.ingress[0].ports = vec![PolicyPort {
            protocol: crate::Protocol::Tcp,
            port: Some(IntOrString::String("Web_UI".into())),
            end_port: None,
        }];
        let p = validate(&spec);
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("spec.ingress[0].ports[0].port: \"Web_UI\" is not a port name"), "{p:?}");
    }
}
