//! `HostPortAllocation`: host ports claimed by one pod on one node. The
//! node's agent writes the spec from its durable record (it allocated the
//! ports); the operator writes the status, keeps the pod's annotation in
//! sync and deletes allocations whose pod is gone.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::Protocol;

/// Pod annotation opting in to automatic host ports: the container ports to
/// expose, by number (`8080`, `53/UDP`) or by name (`http`), comma-separated.
pub const PORTS_ANNOTATION: &str = "weft.dev/host-ports";
/// Namespace label (with value [`NAMESPACE_OPT_IN_VALUE`]) that lets the
/// namespace's pods use [`PORTS_ANNOTATION`]. Pod Security admission and
/// policy engines look at `hostPort` in the pod spec only, so without this
/// any pod author could take node ports; labelling namespaces is for cluster
/// admins.
pub const NAMESPACE_OPT_IN_LABEL: &str = "weft.dev/host-ports";
pub const NAMESPACE_OPT_IN_VALUE: &str = "allowed";
/// Pod annotation the operator keeps in sync: JSON object from
/// `containerPort/PROTOCOL` to the reachable `nodeIP:hostPort`.
pub const ADDRESSES_ANNOTATION: &str = "weft.dev/host-port-addresses";
pub use crate::NODE_LABEL;

/// Host ports of one pod.
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "weft.dev",
    version = "v1alpha1",
    kind = "HostPortAllocation",
    plural = "hostportallocations",
    shortname = "whp",
    namespaced,
    status = "HostPortAllocationStatus",
    category = "weft",
    printcolumn(name = "Pod", type_ = "string", json_path = ".spec.podRef.name"),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeName"),
    printcolumn(name = "Addresses", type_ = "string", json_path = ".status.addresses"),
    printcolumn(name = "Pool", type_ = "string", priority = 1, json_path = ".status.nodePool.summary"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    doc = "Host ports claimed by a pod on a node"
)]
#[serde(rename_all = "camelCase")]
pub struct HostPortAllocationSpec {
    /// The pod that owns the ports.
    pub pod_ref: PodRef,
    /// Node the pod runs on.
    #[schemars(length(min = 1, max = 253))]
    pub node_name: String,
    /// Host IP the ports are bound on.
    #[serde(rename = "nodeIP")]
    #[schemars(length(min = 2, max = 45))]
    pub node_ip: String,
    /// The node's IPv6 address, when the pod has an IPv6 address: its
    /// ports are forwarded over IPv6 as well.
    #[serde(default, rename = "nodeIPv6", skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 45))]
    pub node_ipv6: Option<String>,
    /// Claimed ports.
    #[schemars(length(min = 1, max = 256))]
    pub ports: Vec<HostPort>,
    /// The node's range automatic ports are picked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_range: Option<PortRangeSpec>,
}

/// An inclusive port range.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.first <= self.last").message("portRange.first must not be above portRange.last"))]
pub struct PortRangeSpec {
    #[schemars(range(min = 1, max = 65535))]
    pub first: i32,
    #[schemars(range(min = 1, max = 65535))]
    pub last: i32,
}

/// Reference to a pod in the allocation's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct PodRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// UID of the pod, so that a recreated pod with the same name is a new owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub uid: Option<String>,
}

/// One host port mapping.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostPort {
    #[serde(default)]
    pub protocol: Protocol,
    #[schemars(range(min = 1, max = 65535))]
    pub container_port: i32,
    #[schemars(range(min = 1, max = 65535))]
    pub host_port: i32,
    /// The container port's name, when the pod asked for it by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 15))]
    pub name: Option<String>,
    /// Only traffic to this node address is forwarded (pod spec `hostIP`).
    #[serde(default, rename = "hostIP", skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 45))]
    pub host_ip: Option<String>,
    /// Picked from the node's range (annotation) rather than fixed (pod spec `hostPort`).
    #[serde(default)]
    pub automatic: bool,
}

/// Written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostPortAllocationStatus {
    /// `PodAnnotated`: whether the pod's `weft.dev/host-port-addresses`
    /// annotation shows these ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::common::conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Where each port is reachable: `nodeIP:hostPort/protocol`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    /// Usage of the node's host port range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_pool: Option<NodePoolStatus>,
}

/// How much of a node's host port range is in use.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolStatus {
    /// Ports of the range held by allocations on the node.
    pub used: i32,
    /// Ports in the range.
    pub size: i32,
    /// `used/size`, for `kubectl get -o wide`.
    #[serde(default)]
    pub summary: String,
}
