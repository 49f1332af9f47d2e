//! Publishes the node's host port records as `HostPortAllocation` objects
//! (level-triggered: list ours, apply what differs, delete what has no
//! record) and reports allocation failures as Events on the pod. Runs in
//! the background: ADD and DEL never wait for the API.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;
use weft_api::host_port::{HostPort, HostPortAllocation, HostPortAllocationSpec, NODE_LABEL, PodRef, PortRangeSpec};

use super::{Allocation, HostPorts, PodIdentity};

use crate::events;
use crate::lease::FIELD_MANAGER;

/// Name of the object for one allocation: the pod's name and a hash of the
/// attachment, so a pod recreated under the same name (perhaps on another
/// node) never fights over one object. (Objects older agents named with
/// another hash are replaced in one pass: the new one is written before
/// the old one, no longer wanted, is deleted.)
pub fn object_name(a: &Allocation) -> String {
    use crate::stable_hash::{hex, prefix};
    let h = hex(&prefix::<4>(&[a.container_id.as_bytes(), a.ifname.as_bytes()]));
    let pod: String = a.pod_name.chars().take(240).collect();
    format!("{pod}-{h}")
}

fn desired(a: &Allocation, node: &NodeAddresses, hp: &HostPorts) -> HostPortAllocationSpec {
    let range = hp.range();
    HostPortAllocationSpec {
        pod_ref: PodRef { name: a.pod_name.clone(), uid: (!a.pod_uid.is_empty()).then(|| a.pod_uid.clone()) },
        node_name: node.name.clone(),
        node_ip: node.node_ip.to_string(),
        node_ipv6: node.ipv6.filter(|_| a.pod_ipv6.is_some() || a.pod_ip.is_ipv6()).map(|ip| ip.to_string()),
        ports: a
            .ports
            .iter()
            .map(|m| HostPort {
                protocol: m.protocol,
                container_port: i32::from(m.container_port),
                host_port: i32::from(m.host_port),
                name: m.name.clone(),
                host_ip: m.host_ip.map(|ip| ip.to_string()),
                automatic: m.auto,
            })
            .collect(),
        port_range: Some(PortRangeSpec { first: i32::from(range.first), last: i32::from(range.last) }),
    }
}

/// The node, as its allocations name it.
#[derive(Debug, Clone)]
pub struct NodeAddresses {
    pub name: String,
    /// IPv4, or IPv6 on an IPv6-only node.
    pub node_ip: std::net::IpAddr,
    /// Published for pods with an IPv6 address.
    pub ipv6: Option<std::net::Ipv6Addr>,
}

/// Runs forever: after every change of the records, and every `resync`.
pub async fn run(client: kube::Client, node: NodeAddresses, hp: Arc<HostPorts>, resync: Duration) {
    loop {
        let wait = match publish_once(&client, &node, &hp).await {
            Ok(()) => resync,
            Err(e) => {
                tracing::warn!(error = %e, "cannot publish HostPortAllocations; retrying");
                Duration::from_secs(1)
            }
        };
        tokio::select! {
            _ = hp.changed.notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

async fn publish_once(client: &kube::Client, addresses: &NodeAddresses, hp: &HostPorts) -> Result<(), kube::Error> {
    let node = addresses.name.as_str();
    let all = Api::<HostPortAllocation>::all(client.clone());
    // Label values are at most 63 characters; longer node names list everything.
    let params = if node.len() <= 63 {
        ListParams::default().labels(&format!("{NODE_LABEL}={node}"))
    } else {
        ListParams::default()
    };
    let existing: HashMap<(String, String), HostPortAllocation> = all
        .list(&params)
        .await?
        .items
        .into_iter()
        .filter(|o| o.spec.node_name == node)
        .filter_map(|o| Some(((o.metadata.namespace.clone()?, o.metadata.name.clone()?), o)))
        .collect();
    let mut wanted = std::collections::HashSet::new();
    for a in hp.all().into_iter().filter(|a| !a.pod_name.is_empty() && !a.pod_namespace.is_empty()) {
        let name = object_name(&a);
        let spec = desired(&a, addresses, hp);
        let id = (a.pod_namespace.clone(), name.clone());
        wanted.insert(id.clone());
        if existing.get(&id).is_some_and(|o| o.spec == spec) {
            continue;
        }
        let mut metadata = json!({"name": name, "namespace": a.pod_namespace, "labels": {NODE_LABEL: node}});
        if !a.pod_uid.is_empty() {
            // Lets a Kubernetes garbage collector, where one runs, remove it with the pod.
            metadata["ownerReferences"] =
                json!([{"apiVersion": "v1", "kind": "Pod", "name": a.pod_name, "uid": a.pod_uid}]);
        }
        let object = json!({"apiVersion": "weft.dev/v1alpha1", "kind": "HostPortAllocation", "metadata": metadata, "spec": spec});
        Api::<HostPortAllocation>::namespaced(client.clone(), &a.pod_namespace)
            .patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&object))
            .await?;
    }
    for (ns, name) in existing.keys().filter(|id| !wanted.contains(*id)) {
        match Api::<HostPortAllocation>::namespaced(client.clone(), ns).delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Records a Warning Event on the pod, in the background.
pub fn warn_pod(client: &kube::Client, node: &str, pod: &PodIdentity, reason: &'static str, message: String) {
    if pod.namespace.is_empty() {
        return;
    }
    let regarding = events::Regarding {
        api_version: "v1",
        kind: "Pod",
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        uid: pod.uid.clone(),
    };
    events::record(client, node, regarding, events::Kind::Warning, reason, message);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostport::store::Mapping;

    #[test]
    fn specs_carry_the_record_and_names_are_stable() {
        let blocks = crate::hostport::PodBlocks {
            pool: "10.244.1.0/24".parse().unwrap(),
            ipv6: Some("fd00:10:244:1::/64".parse().unwrap()),
        };
        let hp = HostPorts::new("20000-20009".parse().unwrap(), blocks, vec![]);
        let mut a = Allocation {
            container_id: "abc".into(),
            ifname: "eth0".into(),
            pod_namespace: "default".into(),
            pod_name: "web".into(),
            pod_uid: "u-1".into(),
            pod_ip: "10.244.1.5".parse().unwrap(),
            pod_ipv6: None,
            ports: vec![Mapping {
                protocol: weft_api::Protocol::Udp,
                container_port: 53,
                host_port: 20001,
                host_ip: None,
                name: Some("dns".into()),
                auto: true,
            }],
        };
        let node = NodeAddresses {
            name: "node-1".into(),
            node_ip: "10.250.0.11".parse().unwrap(),
            ipv6: Some("fd00:250::11".parse().unwrap()),
        };
        let spec = desired(&a, &node, &hp);
        assert_eq!((spec.node_ip.as_str(), spec.node_ipv6), ("10.250.0.11", None), "the pod has no IPv6 address");
        a.pod_ipv6 = Some("fd00:10:244:1::5".parse().unwrap());
        assert_eq!(desired(&a, &node, &hp).node_ipv6.as_deref(), Some("fd00:250::11"));
        assert_eq!(spec.ports[0].host_port, 20001);
        assert_eq!(spec.pod_ref.uid.as_deref(), Some("u-1"));
        assert_eq!(spec.port_range.map(|r| (r.first, r.last)), Some((20000, 20009)));
        assert_eq!(object_name(&a), object_name(&a.clone()));
        assert!(object_name(&a).starts_with("web-") && object_name(&a).len() == 12);
    }
}
