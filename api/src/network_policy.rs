//! `NetworkPolicy` (weft.dev): ordered allow/deny rules for selected pods.
//! Its controller comes in a later issue; this is the first shape.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::Protocol;

/// Allow/deny rules for the pods selected in this namespace. Higher
/// `priority` wins when rules of several policies match.
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

/// One rule: traffic from/to `peers` on `ports` is allowed or denied. Empty
/// `peers` or `ports` match everything.
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

/// A peer: pods (optionally in other namespaces) or an IP block.
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

/// A port or port range.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("!has(self.endPort) || (has(self.port) && self.endPort >= self.port)").message("endPort requires port and must not be below it"))]
#[serde(rename_all = "camelCase")]
pub struct PolicyPort {
    #[serde(default)]
    pub protocol: Protocol,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub end_port: Option<i32>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicyStatus {
    /// `Accepted` once the controller has compiled the policy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::common::conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Number of pods the policy currently selects.
    #[serde(default)]
    pub selected_pods: i32,
}
