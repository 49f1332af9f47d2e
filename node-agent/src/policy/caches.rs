//! The policy loop's view of the API: reflectors for pods (trimmed to what
//! policy reads), namespaces, both kinds of NetworkPolicy and, when asked
//! for, ClusterNetworkPolicies and the nodes their peers name, each change
//! waking the loop; when they count as filled; and the cluster they show,
//! with the addresses ADD gave pods the API does not show yet.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, PodStatus};
use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use weft_api::cluster_network_policy::ClusterNetworkPolicy;
use weft_api::network_policy::{self as wnp, NetworkPolicy as WeftPolicy};
use weft_api::watch::{self, Projection};

use super::attached::{Attached, Taken};
use super::model::{Cluster, NamedPort, NodeInfo, PodInfo, Proto};

/// How long the caches may take to fill before that is reported as a
/// failure (new pods wait for them at ADD meanwhile).
const CACHE_GRACE: Duration = Duration::from_secs(30);
/// How long the policy loop waits for Weft's own policy cache before it
/// enforces standard NetworkPolicy without it (the CRD may be missing).
const WEFT_CACHE_GRACE: Duration = Duration::from_secs(30);

/// The caches policy is computed from.
pub struct Caches {
    pods: Projection<PodInfo>,
    namespaces: Store<Namespace>,
    standard: Store<StandardPolicy>,
    weft: Store<WeftPolicy>,
    /// When ClusterNetworkPolicies are enforced: them, and the nodes.
    cluster: Option<(Store<ClusterNetworkPolicy>, Projection<NodeInfo>)>,
}

impl Caches {
    /// Starts the watches (ClusterNetworkPolicies' with `cluster_policies`);
    /// each change notifies `changed`.
    pub fn start(client: &Client, changed: &Arc<tokio::sync::Notify>, cluster_policies: bool) -> Self {
        let pods = watch::project(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            "Pod",
            pod_info,
            Arc::clone(changed),
        );
        let namespaces = reflect(Api::<Namespace>::all(client.clone()), "Namespace", Arc::clone(changed), slim);
        let standard = reflect(Api::<StandardPolicy>::all(client.clone()), "NetworkPolicy", Arc::clone(changed), slim);
        let weft = reflect(Api::<WeftPolicy>::all(client.clone()), "weft.dev NetworkPolicy", Arc::clone(changed), slim);
        let cluster = cluster_policies.then(|| {
            let policies = reflect(
                Api::<ClusterNetworkPolicy>::all(client.clone()),
                "ClusterNetworkPolicy",
                Arc::clone(changed),
                slim,
            );
            let nodes = watch::project(
                Api::<Node>::all(client.clone()),
                watcher::Config::default(),
                "Node",
                node_info,
                Arc::clone(changed),
            );
            (policies, nodes)
        });
        Caches { pods, namespaces, standard, weft, cluster }
    }

    /// Waits until the caches standard NetworkPolicy needs are filled (and
    /// the ClusterNetworkPolicy one, when enforced: asked for, it is
    /// required), and Weft's own for a while (its CRD may be missing:
    /// standard policy does not wait for it). Taking longer than [`CACHE_GRACE`] is reported as a
    /// failure on `attached` meanwhile. False: a cache was dropped, and
    /// policy cannot be enforced.
    pub async fn wait_filled(&self, client: &Client, attached: &Attached) -> bool {
        tracing::info!("policy: waiting for the pod, namespace and policy caches");
        let caches = async {
            self.pods.wait_until_ready().await.is_ok()
                && self.namespaces.wait_until_ready().await.is_ok()
                && self.standard.wait_until_ready().await.is_ok()
                && match &self.cluster {
                    Some((policies, nodes)) => {
                        policies.wait_until_ready().await.is_ok() && nodes.wait_until_ready().await.is_ok()
                    }
                    None => true,
                }
        };
        tokio::pin!(caches);
        let ready = match tokio::time::timeout(CACHE_GRACE, &mut caches).await {
            Ok(ready) => ready,
            Err(_) => {
                attached.set_failure(Some(format!(
                    "the Pod, Namespace, NetworkPolicy{} caches are not filled after {CACHE_GRACE:?} (may the agent list them? see its log)",
                    if self.cluster.is_some() { ", Node and ClusterNetworkPolicy (is its CRD installed?)" } else { "" }
                )));
                caches.await
            }
        };
        if !ready {
            tracing::error!("a policy cache was dropped before it was ready; policy is not enforced");
            attached
                .set_failure(Some("a policy cache was dropped before it was ready (see the agent's log)".to_owned()));
            return false;
        }
        // Without Weft's CRD (not installed, or no permission) Weft policies
        // are enforced once their cache fills, and standard ones from now on.
        let listed = Api::<WeftPolicy>::all(client.clone()).list(&kube::api::ListParams::default().limit(1)).await;
        let weft_served = match listed {
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 403 => {
                tracing::error!(error = %e, "cannot list weft.dev NetworkPolicies (is the CRD installed, may the agent list it?); enforcing standard NetworkPolicy without them");
                false
            }
            _ => true,
        };
        if weft_served && tokio::time::timeout(WEFT_CACHE_GRACE, self.weft.wait_until_ready()).await.is_err() {
            tracing::error!(
                "the weft.dev NetworkPolicy cache is not ready after {WEFT_CACHE_GRACE:?} (is the CRD installed, may the agent list it?); enforcing standard NetworkPolicy without it"
            );
        }
        true
    }

    /// The cluster as the stores see it; invalid Weft policies are left
    /// out (logged once per pass).
    pub fn snapshot(&self) -> Cluster {
        let mut c = Cluster {
            pods: self.pods.values(),
            namespaces: BTreeMap::new(),
            standard: self.standard.state(),
            weft: Vec::new(),
            cluster_policies: Vec::new(),
            nodes: Vec::new(),
        };
        c.namespaces = namespace_labels(self.namespaces.state().iter().map(Arc::as_ref));
        if let Some((policies, nodes)) = &self.cluster {
            c.cluster_policies = policies.state();
            c.nodes = nodes.values();
            c.nodes.sort_by(|a, b| a.name.cmp(&b.name));
        }
        c.weft = valid_weft(self.weft.state());
        c
    }
}

/// Each namespace's labels, by name.
pub fn namespace_labels<'n>(
    namespaces: impl IntoIterator<Item = &'n Namespace>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let named = namespaces.into_iter().filter_map(|ns| Some((ns.metadata.name.clone()?, ns)));
    named.map(|(name, ns)| (name, ns.metadata.labels.clone().unwrap_or_default())).collect()
}

/// The Weft policies that are enforced: those `validate` finds nothing
/// wrong with (the others are logged at debug; the operator reports them).
pub fn valid_weft(policies: Vec<Arc<WeftPolicy>>) -> Vec<Arc<WeftPolicy>> {
    let mut out = Vec::with_capacity(policies.len());
    for p in policies {
        let problems = wnp::validate(&p.spec);
        if problems.is_empty() {
            out.push(p);
        } else {
            tracing::debug!(namespace = ?p.metadata.namespace, name = ?p.metadata.name, ?problems, "ignoring an invalid Weft NetworkPolicy");
        }
    }
    out
}

/// Keeps only what policy reads, so that the caches stay small with many pods.
fn slim<K: Resource>(obj: &mut K) {
    let meta = obj.meta_mut();
    meta.managed_fields = None;
    meta.annotations = None;
    meta.owner_references = None;
}

fn reflect<K>(api: Api<K>, what: &'static str, changed: Arc<tokio::sync::Notify>, trim: fn(&mut K)) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    weft_api::watch::reflect(api, watcher::Config::default(), what, trim, Some(changed))
}

/// What policy needs of a Pod object; None for pods outside the pod network
/// (host network, finished, or not addressed yet without a node).
pub fn pod_info(pod: &Pod) -> Option<PodInfo> {
    let spec = pod.spec.as_ref()?;
    if spec.host_network == Some(true) {
        return None;
    }
    let status = pod.status.as_ref();
    if status.and_then(|s| s.phase.as_deref()).is_some_and(|p| p == "Succeeded" || p == "Failed") {
        return None;
    }
    let ips = status.map(pod_addresses).unwrap_or_default();
    let ports = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| {
            Some(NamedPort {
                name: p.name.clone()?,
                port: u16::try_from(p.container_port).ok()?,
                proto: Proto::parse(p.protocol.as_deref())?,
            })
        })
        .collect();
    Some(PodInfo {
        namespace: pod.metadata.namespace.clone()?,
        name: pod.metadata.name.clone()?,
        labels: pod.metadata.labels.clone().unwrap_or_default(),
        ips,
        node: spec.node_name.clone().unwrap_or_default(),
        ports,
    })
}

/// What policy needs of a Node object: its labels and addresses.
pub fn node_info(node: &Node) -> Option<NodeInfo> {
    let ips = node
        .status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect();
    Some(NodeInfo { name: node.metadata.name.clone()?, labels: node.metadata.labels.clone().unwrap_or_default(), ips })
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

/// Gives this node's pods that ADD registered the addresses ADD gave them
/// (the API may not know them yet, or still show an earlier sandbox's);
/// returns the keys of those found in the API.
pub fn with_attached(pods: &mut [Arc<PodInfo>], node: &str, taken: &Taken) -> Vec<String> {
    let mut found = Vec::new();
    if taken.pods.is_empty() {
        return found;
    }
    for pod in pods.iter_mut().filter(|p| p.node == node) {
        let key = pod.key();
        let Some(entry) = taken.pods.get(&key) else { continue };
        if pod.ips != entry.ips {
            Arc::make_mut(pod).ips = entry.ips.clone();
        }
        found.push(key);
    }
    found
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn attached_pods_of_this_node_take_the_addresses_add_gave_them() {
        use crate::policy::model::tests::{NODE, cluster};
        let attached = Attached::default();
        let c = cluster();
        let local = c.pods.iter().find(|p| p.node == NODE).unwrap().key();
        let remote = c.pods.iter().find(|p| p.node != NODE).unwrap().key();
        let new_ip: IpAddr = "10.244.9.9".parse().unwrap();
        for pod in [&local, &remote, &"prod/not-in-the-api".to_owned()] {
            attached.admit(pod, "c", vec![new_ip]);
        }
        let mut pods = c.pods.clone();
        let found = with_attached(&mut pods, NODE, &attached.take());
        assert_eq!(found, std::slice::from_ref(&local), "only this node's pods, and only those the API knows");
        let ips = |key: &str| pods.iter().find(|p| p.key() == key).unwrap().ips.clone();
        assert_eq!(ips(&local), [new_ip]);
        assert_ne!(ips(&remote), [new_ip], "another node's pod is never changed");
        // The snapshot's own copy changed, not the cache's entry.
        assert_ne!(c.pods.iter().find(|p| p.key() == local).unwrap().ips, [new_ip]);
    }

    #[test]
    fn pods_become_policy_pods_with_named_ports() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "prod", "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [
                {"name": "http", "containerPort": 8080},
                {"containerPort": 9000},
                {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
            "status": {"podIP": "fd00::5", "podIPs": [{"ip": "fd00::5"}, {"ip": "bogus"}, {"ip": "fd00::6"}, {"ip": "10.0.0.5"}]}
        }))
        .unwrap();
        let info = pod_info(&pod).unwrap();
        let addrs: Vec<IpAddr> = ["10.0.0.5", "fd00::5"].map(|a| a.parse().unwrap()).into();
        assert_eq!(info.ips, addrs, "one address per family, IPv4 first");
        assert_eq!(info.key(), "prod/web");
        assert_eq!(info.node, "n1");
        assert_eq!(
            info.ports,
            [
                NamedPort { name: "http".into(), port: 8080, proto: Proto::Tcp },
                NamedPort { name: "dns".into(), port: 53, proto: Proto::Udp }
            ]
        );
        let mut host = pod.clone();
        host.spec.as_mut().unwrap().host_network = Some(true);
        assert_eq!(pod_info(&host), None, "host-network pods are not policy pods");
        let mut done = pod.clone();
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        assert_eq!(pod_info(&done), None, "a finished pod's address may belong to another pod");
        let mut pending = pod;
        pending.status = None;
        assert!(pod_info(&pending).unwrap().ips.is_empty());
    }
}
