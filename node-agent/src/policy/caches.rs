//! The policy loop's view of the API: reflectors for pods (trimmed to what
//! policy reads), namespaces, both kinds of NetworkPolicy and, when asked
//! for, ClusterNetworkPolicies and the nodes their peers name, each change
//! waking the loop; when they count as filled; and the cluster they show,
//! with the addresses ADD gave pods the API does not show yet.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use weft_api::cluster_network_policy::ClusterNetworkPolicy;
use weft_api::network_policy::{self as wnp, NetworkPolicy as WeftPolicy};
use weft_api::pod_endpoint::{PodEndpoint, PodEndpointSpec};
use weft_api::watch::{self, Projection};

use super::attached::{Attached, Taken};
use super::model::{Cluster, NamedPort, NodeInfo, PodInfo};
use super::pods::Pods;

/// How long the caches may take to fill before that is reported as a
/// failure (new pods wait for them at ADD meanwhile).
const CACHE_GRACE: Duration = Duration::from_secs(30);
/// How long the policy loop waits for Weft's own policy cache before it
/// enforces standard NetworkPolicy without it (the CRD may be missing).
const WEFT_CACHE_GRACE: Duration = Duration::from_secs(30);

/// Where the policy loop learns of the cluster's pods (agent flag
/// `--pod-source`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PodSource {
    /// A watch of every Pod in the cluster.
    #[default]
    Pods,
    /// A watch of this node's Pods, and of the PodEndpoints the operator
    /// publishes for the others (its `--publish-pod-endpoints`): a fraction
    /// of the apiserver's work per agent at scale.
    Endpoints,
}

/// The watches the cluster's pods come from.
enum PodWatches {
    /// Every Pod.
    All(Projection<PodInfo>),
    /// This node's Pods, and the PodEndpoints of other nodes' pods (this
    /// node's own Pods are fresher than their endpoints).
    Split { local: Projection<PodInfo>, endpoints: Projection<PodInfo> },
}

impl PodWatches {
    fn start(client: &Client, changed: &Arc<tokio::sync::Notify>, source: PodSource, node: &str) -> Self {
        let pods = Api::<Pod>::all(client.clone());
        match source {
            PodSource::Pods => {
                PodWatches::All(watch::project(pods, watcher::Config::default(), "Pod", pod_info, Arc::clone(changed)))
            }
            PodSource::Endpoints => {
                let local_pods = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
                PodWatches::Split {
                    local: watch::project(pods, local_pods, "Pod", pod_info, Arc::clone(changed)),
                    // This node's pods are not kept (nor is their update a change).
                    endpoints: watch::project(
                        Api::<PodEndpoint>::all(client.clone()),
                        watcher::Config::default(),
                        "PodEndpoint",
                        {
                            let node = node.to_owned();
                            move |e: &PodEndpoint| endpoint_info(e).filter(|p| p.node != node)
                        },
                        Arc::clone(changed),
                    ),
                }
            }
        }
    }

    async fn wait_until_ready(&self) -> bool {
        match self {
            PodWatches::All(pods) => pods.wait_until_ready().await.is_ok(),
            PodWatches::Split { local, endpoints, .. } => {
                local.wait_until_ready().await.is_ok() && endpoints.wait_until_ready().await.is_ok()
            }
        }
    }

    /// The pods as they are now (O(this node's pods): the maps are shared).
    fn pods(&self) -> Pods {
        match self {
            PodWatches::All(pods) => Pods::from_map(pods.map()),
            PodWatches::Split { local, endpoints } => {
                merge_pods(&Pods::from_map(local.map()), Pods::from_map(endpoints.map()))
            }
        }
    }
}

/// This node's pods from its own watch and the others' from their
/// endpoints; a pod in both (an endpoint not yet updated after the pod was
/// recreated here) is the local watch's. The node's pods are few: each is
/// put into a copy of the endpoints' map, which shares the rest.
fn merge_pods(local: &Pods, endpoints: Pods) -> Pods {
    let mut pods = endpoints;
    for pod in local {
        pods.insert(Arc::clone(pod));
    }
    pods
}

/// The caches policy is computed from.
pub struct Caches {
    pods: PodWatches,
    namespaces: Store<Namespace>,
    standard: Store<StandardPolicy>,
    weft: Store<WeftPolicy>,
    /// When ClusterNetworkPolicies are enforced: them, and the nodes.
    cluster: Option<(Store<ClusterNetworkPolicy>, Projection<NodeInfo>)>,
}

impl Caches {
    /// Starts the watches (ClusterNetworkPolicies' with `cluster_policies`;
    /// the pods' from `pod_source`, this node being `node`); each change
    /// notifies `changed`.
    pub fn start(
        client: &Client,
        changed: &Arc<tokio::sync::Notify>,
        cluster_policies: bool,
        pod_source: PodSource,
        node: &str,
    ) -> Self {
        let pods = PodWatches::start(client, changed, pod_source, node);
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
            self.pods.wait_until_ready().await
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
                    "the Pod{}, Namespace, NetworkPolicy{} caches are not filled after {CACHE_GRACE:?} (may the agent list them? see its log)",
                    if matches!(self.pods, PodWatches::Split { .. }) { ", PodEndpoint (is its CRD installed?)" } else { "" },
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
            pods: self.pods.pods(),
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
    let spec = PodEndpointSpec::of_pod(pod)?;
    Some(info(pod.metadata.namespace.clone()?, pod.metadata.name.clone()?, spec))
}

/// What policy needs of a PodEndpoint the operator published.
pub fn endpoint_info(endpoint: &PodEndpoint) -> Option<PodInfo> {
    Some(info(endpoint.metadata.namespace.clone()?, endpoint.metadata.name.clone()?, endpoint.spec.clone()))
}

fn info(namespace: String, name: String, spec: PodEndpointSpec) -> PodInfo {
    let ports = spec.ports.into_iter().map(|p| NamedPort { name: p.name, port: p.port, proto: p.protocol.into() });
    PodInfo { namespace, name, labels: spec.labels, ips: spec.pod_ips, node: spec.node_name, ports: ports.collect() }
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

/// Gives this node's pods that ADD registered the addresses ADD gave them
/// (the API may not know them yet, or still show an earlier sandbox's);
/// returns the keys of those found in the API.
pub fn with_attached(pods: &mut Pods, node: &str, taken: &Taken) -> Vec<String> {
    let mut found = Vec::new();
    for (key, entry) in &taken.pods {
        let Some((namespace, name)) = key.split_once('/') else { continue };
        let Some(pod) = pods.get(namespace, name).filter(|p| p.node == node) else { continue };
        // Only a pod whose addresses differ is changed: a change copies
        // its path of the map, which the next pass's comparison then reads.
        if pod.ips != entry.ips
            && let Some(pod) = pods.get_mut(namespace, name)
        {
            Arc::make_mut(pod).ips = entry.ips.clone();
        }
        found.push(key.clone());
    }
    found
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use serde_json::json;

    use super::*;
    use crate::policy::model::Proto;

    fn pod(namespace: &str, name: &str, node: &str, ip: &str) -> Arc<PodInfo> {
        Arc::new(PodInfo {
            namespace: namespace.into(),
            name: name.into(),
            labels: BTreeMap::new(),
            ips: vec![ip.parse().unwrap()],
            node: node.into(),
            ports: Vec::new(),
        })
    }

    #[test]
    fn this_nodes_pods_come_from_its_watch_and_the_others_from_their_endpoints() {
        let local = vec![pod("a", "mine", "me", "10.0.0.1"), pod("b", "moved", "me", "10.0.0.2")];
        // Other nodes' endpoints, as the projection keeps them.
        let endpoints = vec![
            pod("a", "theirs", "other", "10.0.1.1"),
            pod("b", "moved", "other", "10.0.1.2"),
            pod("c", "last", "other", "10.0.1.3"),
        ];
        let merged = merge_pods(&local.into(), endpoints.into());
        let seen: Vec<(String, String)> = merged.iter().map(|p| (p.key(), p.ips[0].to_string())).collect();
        let want = [("a/mine", "10.0.0.1"), ("a/theirs", "10.0.1.1"), ("b/moved", "10.0.0.2"), ("c/last", "10.0.1.3")];
        assert_eq!(
            seen,
            want.map(|(k, ip)| (k.to_owned(), ip.to_owned())),
            "ordered by namespace and name; this node's Pod wins over a stale endpoint of another node"
        );
        // This node's pods first, last, side by side, or with no endpoints.
        let keys = |pods: Pods| pods.iter().map(|p| p.key()).collect::<Vec<_>>();
        let local = || -> Pods {
            vec![pod("a", "0", "me", "10.0.0.1"), pod("a", "1", "me", "10.0.0.2"), pod("z", "9", "me", "10.0.0.3")]
                .into()
        };
        let endpoints = vec![pod("a", "1", "other", "10.0.1.1"), pod("m", "5", "other", "10.0.1.2")];
        assert_eq!(keys(merge_pods(&local(), endpoints.into())), ["a/0", "a/1", "m/5", "z/9"]);
        assert_eq!(keys(merge_pods(&local(), Pods::default())), ["a/0", "a/1", "z/9"]);
        assert_eq!(keys(merge_pods(&Pods::default(), vec![pod("m", "5", "other", "10.0.1.2")].into())), ["m/5"]);
    }

    #[test]
    fn an_endpoint_is_the_pod_it_was_published_for() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "prod", "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
            "status": {"podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]}
        }))
        .unwrap();
        let mut endpoint = PodEndpoint::new("web", PodEndpointSpec::of_pod(&pod).unwrap());
        endpoint.metadata.namespace = Some("prod".into());
        // Through the API's JSON, as the agent's watch receives it.
        let endpoint: PodEndpoint = serde_json::from_value(serde_json::to_value(&endpoint).unwrap()).unwrap();
        assert_eq!(endpoint_info(&endpoint), pod_info(&pod));
    }

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
