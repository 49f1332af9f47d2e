//! `HostPortAllocation`: host ports claimed by one pod on one node. Its
//! controller comes in a later issue; this is the first shape.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::Protocol;

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
    printcolumn(name = "NodeIP", type_ = "string", json_path = ".spec.nodeIP"),
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
    /// Claimed ports.
    #[schemars(length(min = 1, max = 256))]
    pub ports: Vec<HostPort>,
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
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct HostPortAllocationStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::common::conditions_schema")]
    pub conditions: Vec<Condition>,
}
