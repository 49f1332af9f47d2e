//! `PodEndpoint`: what policy reads of one pod (its node, addresses, labels
//! and named ports), published by the operator when the chart's
//! `podEndpoints.enabled` is set. Agents then watch these instead of every
//! Pod in the cluster (their own node's pods they still watch whole): a Pod
//! changes with every status update its kubelet makes and is several
//! kilobytes, its endpoint changes only when one of these fields does and is
//! a fraction of that size. Every agent's watch multiplies the apiserver's
//! work per change by the node count (Cilium's CiliumEndpoint and
//! Kubernetes' EndpointSlices are the same idea).

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::Protocol;

/// Field manager of the operator's writes of endpoints.
pub const FIELD_MANAGER: &str = "weft-operator-pod-endpoints";

/// One pod, as policy sees it. Named after its pod, in its namespace, and
/// owned by it (the garbage collector removes it with the pod, also while
/// the operator is down).
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[kube(
    group = "weft.dev",
    version = "v1alpha1",
    kind = "PodEndpoint",
    plural = "podendpoints",
    shortname = "wpe",
    namespaced,
    category = "weft",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeName"),
    printcolumn(name = "IPs", type_ = "string", json_path = ".spec.podIPs"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    doc = "What policy reads of a pod, published by the Weft operator"
)]
#[serde(rename_all = "camelCase")]
pub struct PodEndpointSpec {
    /// The node the pod runs on.
    #[schemars(length(max = 253))]
    pub node_name: String,
    /// The pod's addresses: at most one per family, IPv4 first.
    #[serde(rename = "podIPs", default)]
    #[schemars(length(max = 2))]
    pub pod_ips: Vec<IpAddr>,
    /// The pod's labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// The pod's named container ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<NamedPort>,
}

/// A named container port.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct NamedPort {
    #[schemars(length(min = 1, max = 15))]
    pub name: String,
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    pub protocol: Protocol,
}

impl PodEndpointSpec {
    /// What policy reads of `pod`; None for a pod outside the pod network
    /// (host network) or finished (its address may already be another
    /// pod's). The node and addresses are empty until the pod has them.
    pub fn of_pod(pod: &Pod) -> Option<PodEndpointSpec> {
        let spec = pod.spec.as_ref()?;
        if spec.host_network == Some(true) {
            return None;
        }
        let status = pod.status.as_ref();
        if status.and_then(|s| s.phase.as_deref()).is_some_and(|p| p == "Succeeded" || p == "Failed") {
            return None;
        }
        let ports = spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|p| {
                Some(NamedPort {
                    name: p.name.clone()?,
                    port: u16::try_from(p.container_port).ok().filter(|&n| n != 0)?,
                    protocol: protocol(p.protocol.as_deref())?,
                })
            })
            .collect();
        Some(PodEndpointSpec {
            node_name: spec.node_name.clone().unwrap_or_default(),
            pod_ips: status.map(pod_addresses).unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            ports,
        })
    }

    /// Whether the operator publishes it: a pod is a peer to other nodes
    /// only once it runs on one with an address.
    pub fn is_published(&self) -> bool {
        !self.node_name.is_empty() && !self.pod_ips.is_empty()
    }
}

/// The API's spelling of a port's protocol (`TCP` when absent); None for
/// anything else.
fn protocol(name: Option<&str>) -> Option<Protocol> {
    match name.unwrap_or("TCP") {
        "TCP" => Some(Protocol::Tcp),
        "UDP" => Some(Protocol::Udp),
        "SCTP" => Some(Protocol::Sctp),
        _ => None,
    }
}

/// A pod's addresses from `podIPs` (else `podIP`): the first valid one of
/// each family, IPv4 first; anything unparsable is no address.
fn pod_addresses(status: &PodStatus) -> Vec<IpAddr> {
    let listed = status.pod_ips.iter().flatten().map(|p| p.ip.as_str()).chain(status.pod_ip.as_deref());
    let parsed: Vec<IpAddr> = listed.filter_map(|ip| ip.parse().ok()).collect();
    let v4 = parsed.iter().copied().find(IpAddr::is_ipv4);
    let v6 = parsed.iter().copied().find(IpAddr::is_ipv6);
    v4.into_iter().chain(v6).collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "prod", "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [
                {"name": "http", "containerPort": 8080},
                {"containerPort": 9000},
                {"name": "odd", "containerPort": 70000},
                {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
            "status": {"podIP": "fd00::5", "podIPs": [{"ip": "fd00::5"}, {"ip": "bogus"}, {"ip": "fd00::6"}, {"ip": "10.0.0.5"}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_becomes_its_node_addresses_labels_and_named_ports() {
        let spec = PodEndpointSpec::of_pod(&pod()).unwrap();
        let addrs: Vec<IpAddr> = ["10.0.0.5", "fd00::5"].map(|a| a.parse().unwrap()).into();
        assert_eq!(spec.pod_ips, addrs, "one address per family, IPv4 first");
        assert_eq!(spec.node_name, "n1");
        assert_eq!(spec.labels["app"], "web");
        let named = |name: &str, port, protocol| NamedPort { name: name.into(), port, protocol };
        assert_eq!(spec.ports, [named("http", 8080, Protocol::Tcp), named("dns", 53, Protocol::Udp)]);
        assert!(spec.is_published());
    }

    #[test]
    fn host_network_finished_and_unaddressed_pods_are_not_published() {
        let mut host = pod();
        host.spec.as_mut().unwrap().host_network = Some(true);
        assert_eq!(PodEndpointSpec::of_pod(&host), None, "host-network pods are not policy pods");
        let mut done = pod();
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        assert_eq!(PodEndpointSpec::of_pod(&done), None, "a finished pod's address may belong to another pod");
        let mut pending = pod();
        pending.status = None;
        let spec = PodEndpointSpec::of_pod(&pending).unwrap();
        assert!(spec.pod_ips.is_empty() && !spec.is_published());
        let mut unscheduled = pod();
        unscheduled.spec.as_mut().unwrap().node_name = None;
        assert!(!PodEndpointSpec::of_pod(&unscheduled).unwrap().is_published());
    }

    #[test]
    fn an_endpoint_is_small_on_the_wire() {
        let spec = PodEndpointSpec::of_pod(&pod()).unwrap();
        let json = serde_json::to_string(&PodEndpoint::new("web", spec)).unwrap();
        assert!(json.contains(r#""podIPs":["10.0.0.5","fd00::5"]"#), "{json}");
        assert!(json.len() < 400, "{} bytes: {json}", json.len());
    }
}
