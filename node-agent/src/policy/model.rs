//! The policy truth, pure: from pods, namespaces, standard
//! (`networking.k8s.io/v1`) and Weft (`weft.dev`) NetworkPolicies to what
//! each local pod's ingress and egress must admit. No kernel, no API: the
//! semantics are unit-tested here; `render` turns the result into nftables
//! objects, `incremental` recompiles only the pods a change affects.
//!
//! Per pod and direction the evaluation order is: Weft rules (priority
//! descending, Deny before Allow at equal priority; Deny drops, Allow admits
//! and is final), then, if a standard policy of that direction selects the
//! pod, the union of the standard rules, then drop. A pod no standard policy
//! of a direction selects is open in that direction (after Weft rules).
//! ClusterNetworkPolicy's Admin tier comes before all of them and its
//! Baseline tier after them (`model_cluster`), in the same chain.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1 as netv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use weft_api::cluster_network_policy::ClusterNetworkPolicy;
use weft_api::network_policy as wnp;
use weft_api::{selector, standard_policy};

use super::addr_ranges::{self, Range};
pub use super::pods::Pods;
use cluster::Tiers;

#[path = "model_cluster.rs"]
mod cluster;
#[path = "model_index.rs"]
mod index;
#[path = "model_peer_cache.rs"]
mod peer_cache;
pub use cluster::name_nodes;
pub use index::PolicyIndex;
pub use peer_cache::PeerCache;

pub use crate::firewall::ruleset::Proto;

/// A container port of a pod, for named-port resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedPort {
    pub name: String,
    pub port: u16,
    pub proto: Proto,
}

/// What policy needs of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// At most one per family (`status.podIPs`); empty until the pod has
    /// an address (it is then no peer and gets no chain).
    pub ips: Vec<IpAddr>,
    pub node: String,
    pub ports: Vec<NamedPort>,
}

impl PodInfo {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// What policy needs of a node: ClusterNetworkPolicy's node peers select
/// nodes by label and match their addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Its InternalIP and ExternalIP addresses (`status.addresses`).
    pub ips: Vec<IpAddr>,
}

/// Everything the agent knows of the cluster.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    /// Pods with a pod-network address (host-network and finished pods are
    /// left out by the caller), by namespace and name. Shared with the
    /// agent's cache of them, which reuses a pod's entry until it changes.
    pub pods: Pods,
    /// Namespace name → labels.
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// Shared with the watch caches: a pass copies no policy.
    pub standard: Vec<Arc<netv1::NetworkPolicy>>,
    /// Only policies that pass `weft_api::network_policy::validate`.
    pub weft: Vec<Arc<wnp::NetworkPolicy>>,
    /// ClusterNetworkPolicies of both tiers (`model_cluster`).
    pub cluster_policies: Vec<Arc<ClusterNetworkPolicy>>,
    /// Nodes, by name (only when ClusterNetworkPolicies are enforced: no
    /// other policy has node peers).
    pub nodes: Vec<Arc<NodeInfo>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// The remote addresses a match applies to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Peers {
    Any,
    /// Disjoint, sorted (IPv4 first), never empty; either family or both.
    /// Shared: every rule and pod with the same peers holds the same list.
    Nets(Arc<[IpNet]>),
}

/// One packet match: remote addresses, protocol and destination ports.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Match {
    pub peers: Peers,
    /// None: any protocol (then `ports` is None too).
    pub proto: Option<Proto>,
    /// Inclusive destination port range; None: every port.
    pub ports: Option<(u16, u16)>,
}

impl Match {
    /// Whether a packet from/to `remote` to destination port `proto`/`port` matches.
    pub fn hits(&self, remote: IpAddr, proto: Proto, port: u16) -> bool {
        let peer_ok = match &self.peers {
            Peers::Any => true,
            Peers::Nets(nets) => nets.iter().any(|n| n.contains(&remote)),
        };
        peer_ok && self.proto.is_none_or(|p| p == proto) && self.ports.is_none_or(|(lo, hi)| lo <= port && port <= hi)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Admit for this direction; no later rule is consulted.
    Allow,
    Drop,
}

/// A rule of a pod's chain: any of `matches` gives `verdict`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub verdict: Verdict,
    /// The policy it comes from: `ns/name`, `weft.dev/ns/name` or
    /// `ClusterNetworkPolicy/name`.
    pub origin: String,
    /// Its position in its policy's ingress or egress rules, from 0.
    pub index: u32,
    /// A Drop that never answers, whatever the agent's deny action: a
    /// ClusterNetworkPolicy Deny, which the API defines as a drop.
    pub silent: bool,
}

/// What one direction of a pod admits, in evaluation order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Chain {
    pub rules: Vec<Rule>,
    /// Selected by a standard policy of this direction: drop what no rule admitted.
    pub default_deny: bool,
}

/// A local pod with at least one direction under policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPolicy {
    pub key: String,
    /// The pod's addresses (one per family), each looked up in the dispatch maps.
    pub ips: Vec<IpAddr>,
    pub ingress: Option<Chain>,
    pub egress: Option<Chain>,
}

/// A peer of either API: pods (by namespace and pod selectors) or an IP block.
#[derive(Debug, Clone, PartialEq)]
enum Peer<'a> {
    /// `ns`: None means the policy's own namespace; `pods`: None means all pods.
    Pods {
        ns: Option<&'a LabelSelector>,
        pods: Option<&'a LabelSelector>,
    },
    Block {
        cidr: &'a str,
        except: &'a [String],
    },
    /// Nodes by their labels: their addresses (ClusterNetworkPolicy only).
    Nodes(&'a LabelSelector),
    /// A peer that can match nothing (no field set).
    Nothing,
}

/// A port selector before resolution.
#[derive(Debug, Clone)]
enum PortSel {
    Proto(Proto),
    Range(Proto, u16, u16),
    Named(Proto, String),
    /// An unknown protocol or a bad number: matches nothing.
    Nothing,
}

/// A rule's peers, with what they are resolved against: rules with equal
/// specs (templated policies often share them) resolve to the same
/// addresses, so a pass resolves each distinct spec once.
#[derive(Debug, Clone, PartialEq)]
struct PeerSpec<'a> {
    /// Empty: every address.
    list: Vec<Peer<'a>>,
    /// The policy's namespace, when a peer means "this namespace" (else
    /// None: the result does not depend on it).
    own_ns: Option<&'a str>,
}

// Selectors compare as values (strings all the way down).
impl Eq for PeerSpec<'_> {}

impl std::hash::Hash for PeerSpec<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        fn selector<H: std::hash::Hasher>(sel: Option<&LabelSelector>, h: &mut H) {
            let Some(sel) = sel else { return 0u8.hash(h) };
            sel.match_labels.hash(h);
            for e in sel.match_expressions.iter().flatten() {
                (&e.key, &e.operator, &e.values).hash(h);
            }
        }
        self.own_ns.hash(h);
        for p in &self.list {
            match p {
                Peer::Pods { ns, pods } => {
                    1u8.hash(h);
                    selector(*ns, h);
                    selector(*pods, h);
                }
                Peer::Block { cidr, except } => (2u8, cidr, except).hash(h),
                Peer::Nothing => 3u8.hash(h),
                Peer::Nodes(sel) => {
                    4u8.hash(h);
                    selector(Some(sel), h);
                }
            }
        }
    }
}

impl<'a> PeerSpec<'a> {
    fn new(list: Vec<Peer<'a>>, policy_ns: &'a str) -> Self {
        let own_ns = list.iter().any(|p| matches!(p, Peer::Pods { ns: None, .. })).then_some(policy_ns);
        PeerSpec { list, own_ns }
    }
}

struct RuleSpec<'a> {
    peers: PeerSpec<'a>,
    /// Empty: every port.
    ports: Vec<PortSel>,
    verdict: Verdict,
}

fn port_sel(proto: Option<Proto>, port: Option<&IntOrString>, end: Option<i32>) -> PortSel {
    let Some(proto) = proto else { return PortSel::Nothing };
    match port {
        None => PortSel::Proto(proto),
        Some(IntOrString::Int(p)) => {
            let hi = end.unwrap_or(*p);
            match (u16::try_from(*p), u16::try_from(hi)) {
                (Ok(lo), Ok(hi)) if lo >= 1 && hi >= lo => PortSel::Range(proto, lo, hi),
                _ => PortSel::Nothing,
            }
        }
        Some(IntOrString::String(name)) => match name.parse::<u16>() {
            // "80" as a string is a number to the apiserver too.
            Ok(n) if n >= 1 => PortSel::Range(proto, n, end.and_then(|e| u16::try_from(e).ok()).unwrap_or(n)),
            _ => PortSel::Named(proto, name.clone()),
        },
    }
}

fn std_peer(p: &netv1::NetworkPolicyPeer) -> Peer<'_> {
    match (&p.ip_block, &p.namespace_selector, &p.pod_selector) {
        (Some(b), _, _) => Peer::Block { cidr: &b.cidr, except: b.except.as_deref().unwrap_or_default() },
        (None, None, None) => Peer::Nothing,
        (None, ns, pods) => Peer::Pods { ns: ns.as_ref(), pods: pods.as_ref() },
    }
}

fn weft_peer(p: &wnp::PolicyPeer) -> Peer<'_> {
    match (&p.ip_block, &p.namespace_selector, &p.pod_selector) {
        (Some(b), _, _) => Peer::Block { cidr: &b.cidr, except: &b.except },
        (None, None, None) => Peer::Nothing,
        (None, ns, pods) => Peer::Pods { ns: ns.as_ref(), pods: pods.as_ref() },
    }
}

fn std_ports(ports: Option<&Vec<netv1::NetworkPolicyPort>>) -> Vec<PortSel> {
    ports
        .into_iter()
        .flatten()
        .map(|p| port_sel(Proto::parse(p.protocol.as_deref()), p.port.as_ref(), p.end_port))
        .collect()
}

fn weft_ports(ports: &[wnp::PolicyPort]) -> Vec<PortSel> {
    ports.iter().map(|p| port_sel(Some(p.protocol.into()), p.port.as_ref(), p.end_port)).collect()
}

/// The policy types of a standard policy, with the API's defaulting:
/// Ingress always, Egress when there are egress rules.
pub fn policy_types(spec: &netv1::NetworkPolicySpec) -> (bool, bool) {
    match &spec.policy_types {
        Some(t) if !t.is_empty() => (t.iter().any(|x| x == "Ingress"), t.iter().any(|x| x == "Egress")),
        _ => (true, spec.egress.as_ref().is_some_and(|e| !e.is_empty())),
    }
}

/// The addresses of `pod`, in a namespace labelled `ns_labels`, that
/// `peer` of a policy in `policy_ns` matches: all of them for a pod peer
/// whose selectors match (no namespace selector: the policy's own
/// namespace), those inside the block for a block.
fn peer_addrs(peer: &Peer<'_>, policy_ns: &str, pod: &PodInfo, ns_labels: &BTreeMap<String, String>) -> Vec<IpAddr> {
    match peer {
        Peer::Block { cidr, except } => {
            let ranges = addr_ranges::block(cidr, except);
            pod.ips.iter().copied().filter(|ip| ranges.iter().any(|r| r.contains(*ip))).collect()
        }
        _ if peer_matches(peer, policy_ns, pod, ns_labels) => pod.ips.clone(),
        _ => Vec::new(),
    }
}

/// Whether `peer` matches `pod` (some address of it, for a block). Pod
/// peers are decided by their selectors alone, without allocating: this
/// runs for every candidate pod of every peer.
fn peer_matches(peer: &Peer<'_>, policy_ns: &str, pod: &PodInfo, ns_labels: &BTreeMap<String, String>) -> bool {
    match peer {
        Peer::Pods { ns, pods } => {
            let ns_ok = match ns {
                None => pod.namespace == policy_ns,
                Some(sel) => selector::matches(sel, ns_labels),
            };
            ns_ok && pods.is_none_or(|sel| selector::matches(sel, &pod.labels))
        }
        Peer::Block { .. } => !peer_addrs(peer, policy_ns, pod, ns_labels).is_empty(),
        // A node's addresses are no pod's (host-network pods are no peers).
        Peer::Nodes(_) | Peer::Nothing => false,
    }
}

/// Read-only view with the lookups compilation needs.
struct View<'a> {
    cluster: &'a Cluster,
    no_labels: BTreeMap<String, String>,
    /// Peer sets and egress matches of named ports by spec: resolved once,
    /// however many local pods and policies share them (the matches of a
    /// named egress port depend on the destination pods only, not on the
    /// selected pod), and kept across passes by the incremental compile.
    cache: RefCell<PeerCache>,
    /// Every pod, and every pod by namespace (built on first use: most
    /// passes need neither, and a walk of the pods' map costs ten times one
    /// of a `Vec`).
    all: std::cell::OnceCell<Vec<&'a PodInfo>>,
    by_ns: std::cell::OnceCell<HashMap<&'a str, Vec<&'a PodInfo>>>,
}

impl<'a> View<'a> {
    fn new(cluster: &'a Cluster, cache: PeerCache) -> Self {
        let (all, by_ns) = (std::cell::OnceCell::new(), std::cell::OnceCell::new());
        View { cluster, no_labels: BTreeMap::new(), cache: RefCell::new(cache), all, by_ns }
    }

    fn all(&self) -> &[&'a PodInfo] {
        self.all.get_or_init(|| self.cluster.pods.iter().map(Arc::as_ref).collect())
    }

    fn by_ns(&self) -> &HashMap<&'a str, Vec<&'a PodInfo>> {
        self.by_ns.get_or_init(|| {
            let mut by_ns: HashMap<&str, Vec<&PodInfo>> = HashMap::new();
            for pod in self.all() {
                by_ns.entry(pod.namespace.as_str()).or_default().push(pod);
            }
            by_ns
        })
    }

    /// The pods `peer` could match: those of the policy's namespace, or of
    /// the namespaces its namespace selector matches (then checked in full).
    /// A namespace's pods are a range of the pods' map, found without
    /// reading the others.
    fn candidates(&self, ns: Option<&LabelSelector>, policy_ns: &str) -> Vec<&'a PodInfo> {
        let pods = &self.cluster.pods;
        match ns {
            None => pods.in_namespace(policy_ns).map(Arc::as_ref).collect(),
            // Matching a namespace without labels, it matches the pods of
            // namespaces the cluster does not list as well: all are read.
            Some(sel) if selector::matches(sel, &self.no_labels) => self
                .by_ns()
                .iter()
                .filter(|(name, _)| selector::matches(sel, self.ns_labels(name)))
                .flat_map(|(_, pods)| pods.iter().copied())
                .collect(),
            Some(sel) => (self.cluster.namespaces.iter())
                .filter(|(_, labels)| selector::matches(sel, labels))
                .flat_map(|(name, _)| pods.in_namespace(name).map(Arc::as_ref))
                .collect(),
        }
    }

    fn ns_labels(&self, ns: &str) -> &BTreeMap<String, String> {
        self.cluster.namespaces.get(ns).unwrap_or(&self.no_labels)
    }

    fn peer_pod_addrs(&self, peer: &Peer<'_>, policy_ns: &str, pod: &PodInfo) -> Vec<IpAddr> {
        peer_addrs(peer, policy_ns, pod, self.ns_labels(&pod.namespace))
    }

    /// The addresses of `peers` (empty peers: any).
    fn peer_set(&self, peers: &PeerSpec<'_>) -> Peers {
        if peers.list.is_empty() {
            return Peers::Any;
        }
        let policy_ns = peers.own_ns.unwrap_or_default();
        let mut ranges = Vec::new();
        for p in &peers.list {
            match p {
                Peer::Block { cidr, except } => ranges.extend(addr_ranges::block(cidr, except)),
                Peer::Pods { ns, .. } => ranges.extend(
                    self.candidates(*ns, policy_ns)
                        .into_iter()
                        .filter(|pod| peer_matches(p, policy_ns, pod, self.ns_labels(&pod.namespace)))
                        .flat_map(|pod| pod.ips.iter().copied().map(Range::of_addr)),
                ),
                Peer::Nodes(sel) => ranges.extend(
                    self.cluster
                        .nodes
                        .iter()
                        .filter(|n| selector::matches(sel, &n.labels))
                        .flat_map(|n| n.ips.iter().copied().map(Range::of_addr)),
                ),
                Peer::Nothing => {}
            }
        }
        Peers::Nets(addr_ranges::to_nets(&addr_ranges::union(ranges)).into())
    }

    /// The pods among `peers` (empty peers: every pod) with the addresses
    /// of each that the peers match, for named egress ports.
    fn peer_pods(&self, peers: &PeerSpec<'_>) -> Vec<(&'a PodInfo, Vec<IpAddr>)> {
        let (policy_ns, peers) = (peers.own_ns.unwrap_or_default(), &peers.list);
        self.all()
            .iter()
            .copied()
            .map(|pod| {
                let addrs = match peers.is_empty() {
                    true => pod.ips.clone(),
                    false => peers.iter().flat_map(|p| self.peer_pod_addrs(p, policy_ns, pod)).collect(),
                };
                (pod, addrs)
            })
            .filter(|(_, addrs)| !addrs.is_empty())
            .collect()
    }

    /// The egress matches of `peers` for the named port `name` of `proto`:
    /// each destination pod's own number for the name.
    fn named_port_matches(&self, peers: &PeerSpec<'_>, proto: Proto, name: &str) -> Vec<Match> {
        let mut by_port: BTreeMap<u16, Vec<Range>> = BTreeMap::new();
        for (dst, addrs) in self.peer_pods(peers) {
            for p in dst.ports.iter().filter(|p| p.name == name && p.proto == proto) {
                by_port.entry(p.port).or_default().extend(addrs.iter().copied().map(Range::of_addr));
            }
        }
        by_port
            .into_iter()
            .map(|(port, ips)| {
                let nets = addr_ranges::to_nets(&addr_ranges::union(ips));
                Match { peers: Peers::Nets(nets.into()), proto: Some(proto), ports: Some((port, port)) }
            })
            .collect()
    }

    /// The matches of one rule for `pod` (the selected, local pod).
    fn compile_rule(&self, rule: &RuleSpec<'a>, dir: Direction, pod: &PodInfo) -> Vec<Match> {
        let peers = self.cache.borrow_mut().set(&rule.peers, || self.peer_set(&rule.peers));
        if matches!(&peers, Peers::Nets(nets) if nets.is_empty()) {
            return Vec::new();
        }
        if rule.ports.is_empty() {
            return vec![Match { peers, proto: None, ports: None }];
        }
        let mut out = Vec::new();
        for sel in &rule.ports {
            match sel {
                PortSel::Proto(proto) => out.push(Match { peers: peers.clone(), proto: Some(*proto), ports: None }),
                PortSel::Range(proto, lo, hi) => {
                    out.push(Match { peers: peers.clone(), proto: Some(*proto), ports: Some((*lo, *hi)) })
                }
                PortSel::Nothing => {}
                // Ingress: the destination is the selected pod itself.
                PortSel::Named(proto, name) if dir == Direction::Ingress => {
                    for p in pod.ports.iter().filter(|p| &p.name == name && p.proto == *proto) {
                        out.push(Match { peers: peers.clone(), proto: Some(*proto), ports: Some((p.port, p.port)) });
                    }
                }
                // Egress: each destination pod's own number for the name.
                PortSel::Named(proto, name) => {
                    out.extend(
                        self.cache
                            .borrow_mut()
                            .named(&rule.peers, *proto, name, || self.named_port_matches(&rule.peers, *proto, name)),
                    );
                }
            }
        }
        out
    }
}

/// One policy of either kind, reduced to what compilation needs.
struct PolicyView<'a> {
    namespace: &'a str,
    name: &'a str,
    pod_selector: &'a LabelSelector,
    /// Weft priority; None for standard policies.
    priority: Option<i32>,
    ingress: Option<Vec<RuleSpec<'a>>>,
    egress: Option<Vec<RuleSpec<'a>>>,
}

impl PolicyView<'_> {
    /// `ns/name` or `weft.dev/ns/name`: what rules and counters say they come from.
    fn origin(&self) -> String {
        match self.priority {
            None => format!("{}/{}", self.namespace, self.name),
            Some(_) => format!("weft.dev/{}/{}", self.namespace, self.name),
        }
    }
}

/// The empty selector: every pod of the namespace.
static EVERY_POD: LabelSelector = LabelSelector { match_expressions: None, match_labels: None };

fn standard_view(p: &netv1::NetworkPolicy) -> Option<PolicyView<'_>> {
    let spec = p.spec.as_ref()?;
    let namespace = p.metadata.namespace.as_deref()?;
    let (ing, eg) = policy_types(spec);
    if standard_policy::standard_cost(spec) > standard_policy::MAX_COST {
        // Refused (see `limits`): its pods stay isolated, nothing is admitted.
        return Some(PolicyView {
            namespace,
            name: p.metadata.name.as_deref().unwrap_or_default(),
            pod_selector: spec.pod_selector.as_ref().unwrap_or(&EVERY_POD),
            priority: None,
            ingress: ing.then(Vec::new),
            egress: eg.then(Vec::new),
        });
    }
    let ingress = ing.then(|| {
        spec.ingress
            .iter()
            .flatten()
            .map(|r| RuleSpec {
                peers: PeerSpec::new(r.from.iter().flatten().map(std_peer).collect(), namespace),
                ports: std_ports(r.ports.as_ref()),
                verdict: Verdict::Allow,
            })
            .collect()
    });
    let egress = eg.then(|| {
        spec.egress
            .iter()
            .flatten()
            .map(|r| RuleSpec {
                peers: PeerSpec::new(r.to.iter().flatten().map(std_peer).collect(), namespace),
                ports: std_ports(r.ports.as_ref()),
                verdict: Verdict::Allow,
            })
            .collect()
    });
    Some(PolicyView {
        namespace,
        name: p.metadata.name.as_deref().unwrap_or_default(),
        pod_selector: spec.pod_selector.as_ref().unwrap_or(&EVERY_POD),
        priority: None,
        ingress,
        egress,
    })
}

fn weft_rules<'a>(rs: &'a [wnp::PolicyRule], namespace: &'a str) -> Option<Vec<RuleSpec<'a>>> {
    (!rs.is_empty()).then(|| {
        rs.iter()
            .map(|r| RuleSpec {
                peers: PeerSpec::new(r.peers.iter().map(weft_peer).collect(), namespace),
                ports: weft_ports(&r.ports),
                verdict: match r.action {
                    wnp::PolicyAction::Allow => Verdict::Allow,
                    wnp::PolicyAction::Deny => Verdict::Drop,
                },
            })
            .collect()
    })
}

fn rules_of<'p, 'a>(p: &'p PolicyView<'a>, dir: Direction) -> &'p [RuleSpec<'a>] {
    match dir {
        Direction::Ingress => p.ingress.as_deref().unwrap_or_default(),
        Direction::Egress => p.egress.as_deref().unwrap_or_default(),
    }
}

fn weft_view(p: &wnp::NetworkPolicy) -> Option<PolicyView<'_>> {
    let namespace = p.metadata.namespace.as_deref()?;
    Some(PolicyView {
        namespace,
        name: p.metadata.name.as_deref().unwrap_or_default(),
        pod_selector: &p.spec.pod_selector,
        priority: Some(p.spec.priority),
        ingress: weft_rules(&p.spec.ingress, namespace),
        egress: weft_rules(&p.spec.egress, namespace),
    })
}

/// Whether a policy of `namespace` with `sel` selects `pod`.
pub fn selects(namespace: &str, sel: &LabelSelector, pod: &PodInfo) -> bool {
    pod.namespace == namespace && selector::matches(sel, &pod.labels)
}

/// Compiles pods one at a time against a snapshot: the policies indexed
/// by namespace once, the peer caches shared by every pod compiled.
pub struct Compiler<'a> {
    view: View<'a>,
    /// Standard and Weft policies by namespace.
    index: Index<'a>,
    /// ClusterNetworkPolicies, each tier in evaluation order.
    tiers: Tiers<'a>,
}

/// A compiler's index: its own, or one kept across passes.
enum Index<'a> {
    Own(index::ByNamespace<'a>),
    Kept(&'a index::ByNamespace<'a>),
}

impl<'a> std::ops::Deref for Index<'a> {
    type Target = index::ByNamespace<'a>;

    fn deref(&self) -> &Self::Target {
        match self {
            Index::Own(i) => i,
            Index::Kept(i) => i,
        }
    }
}

impl<'a> Compiler<'a> {
    #[cfg(test)]
    pub fn new(cluster: &'a Cluster) -> Self {
        Self::with_cache(cluster, PeerCache::default())
    }

    /// A compiler that starts from what `cache` resolved in earlier passes
    /// (forgotten where the cluster changed: see [`PeerCache`]).
    pub fn with_cache(cluster: &'a Cluster, cache: PeerCache) -> Self {
        let index = Index::Own(index::ByNamespace::new(&cluster.standard, &cluster.weft));
        Compiler { view: View::new(cluster, cache), index, tiers: Tiers::new(&cluster.cluster_policies) }
    }

    /// [`Compiler::with_cache`] with the policies looked up in `index`,
    /// which must index `cluster`'s ([`PolicyIndex::indexes`]).
    pub fn with_index(cluster: &'a Cluster, index: &'a PolicyIndex, cache: PeerCache) -> Self {
        debug_assert!(index.indexes(cluster), "the index is of other policies");
        let index = Index::Kept(index.by_namespace());
        Compiler { view: View::new(cluster, cache), index, tiers: Tiers::new(&cluster.cluster_policies) }
    }

    /// What it resolved, for the next pass.
    pub fn into_cache(self) -> PeerCache {
        self.view.cache.into_inner()
    }

    /// What `pod` admits, when some policy selects it and it has an address.
    pub fn pod_policy(&self, pod: &PodInfo) -> Option<PodPolicy> {
        if pod.ips.is_empty() {
            return None;
        }
        let none = Vec::new();
        let standard_here = self.index.standard.get(pod.namespace.as_str()).unwrap_or(&none);
        let weft_here = self.index.weft.get(pod.namespace.as_str()).unwrap_or(&none);
        let chain = |dir: Direction| -> Option<Chain> {
            let pick = |p: &PolicyView<'_>| -> bool {
                let rules = if dir == Direction::Ingress { &p.ingress } else { &p.egress };
                rules.is_some() && selects(p.namespace, p.pod_selector, pod)
            };
            // Weft rules: priority descending (already sorted), Deny first at equal priority.
            let mut weft_rules: Vec<(i32, bool, Rule)> = Vec::new();
            for p in weft_here.iter().filter(|p| pick(p)) {
                for (index, r) in (0..).zip(rules_of(p, dir)) {
                    let matches = self.view.compile_rule(r, dir, pod);
                    if !matches.is_empty() {
                        let rule = Rule { matches, verdict: r.verdict, origin: p.origin(), index, silent: false };
                        weft_rules.push((p.priority.unwrap_or_default(), r.verdict == Verdict::Allow, rule));
                    }
                }
            }
            weft_rules.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut rules: Vec<Rule> = weft_rules.into_iter().map(|(_, _, r)| r).collect();
            let isolating: Vec<&PolicyView<'_>> = standard_here.iter().filter(|p| pick(p)).collect();
            for p in &isolating {
                for (index, r) in (0..).zip(rules_of(p, dir)) {
                    let matches = self.view.compile_rule(r, dir, pod);
                    if !matches.is_empty() {
                        rules.push(Rule { matches, verdict: Verdict::Allow, origin: p.origin(), index, silent: false });
                    }
                }
            }
            let default_deny = !isolating.is_empty();
            // The tiers of ClusterNetworkPolicy around them (model_cluster).
            let ns_labels = self.view.ns_labels(&pod.namespace);
            if !default_deny {
                let baseline = Tiers::compile(&self.view, &self.tiers.baseline, dir, pod, ns_labels);
                rules.extend(baseline.into_iter().map(|(rule, _)| rule));
            }
            let admin = Tiers::compile(&self.view, &self.tiers.admin, dir, pod, ns_labels);
            let rules = cluster::with_admin(admin, rules, default_deny);
            (default_deny || !rules.is_empty()).then_some(Chain { rules, default_deny })
        };
        let (ingress, egress) = (chain(Direction::Ingress), chain(Direction::Egress));
        (ingress.is_some() || egress.is_some()).then(|| PodPolicy {
            key: pod.key(),
            ips: pod.ips.clone(),
            ingress,
            egress,
        })
    }

    /// The reach (namespace and pod selector) of every policy whose rules
    /// resolve differently with `was` than with `is` (a pod as it was and
    /// as it is, each with its namespace's labels then; None: absent): the
    /// pods those policies select are the ones to recompile after the change.
    pub fn reach_of_rules_changed_by(&self, was: Option<PodInNs<'_>>, is: Option<PodInNs<'_>>) -> Vec<Reach<'a>> {
        let mut out = Vec::new();
        for p in self.index.standard.values().chain(self.index.weft.values()).flatten() {
            let changed = [Direction::Ingress, Direction::Egress].into_iter().any(|dir| {
                // An absent pod is seen as one no rule matches.
                rules_of(p, dir).iter().any(|r| {
                    let before = was.map(|pod| what_rule_sees(r, dir, pod)).unwrap_or_default();
                    before != is.map(|pod| what_rule_sees(r, dir, pod)).unwrap_or_default()
                })
            });
            if changed {
                out.push(Reach::Namespaced { namespace: p.namespace, pod_selector: p.pod_selector });
            }
        }
        for p in self.tiers.all() {
            let changed = [Direction::Ingress, Direction::Egress].into_iter().any(|dir| {
                p.rules(dir).iter().any(|r| {
                    let before = was.map(|pod| what_rule_sees(&r.spec, dir, pod)).unwrap_or_default();
                    before != is.map(|pod| what_rule_sees(&r.spec, dir, pod)).unwrap_or_default()
                })
            });
            if changed {
                out.push(Reach::Cluster(p.subject));
            }
        }
        out
    }

    /// The policies that select `pod` in direction `dir` (its chain's
    /// rules come from them, and a standard one isolates it): their
    /// origins, namespaced ones first, in evaluation order within each kind.
    pub fn selecting(&self, pod: &PodInfo, dir: Direction) -> Vec<String> {
        let here = |by_ns: &HashMap<&str, Vec<PolicyView<'_>>>| -> Vec<String> {
            let views = by_ns.get(pod.namespace.as_str()).map(Vec::as_slice).unwrap_or_default();
            let has_dir =
                |p: &PolicyView<'_>| if dir == Direction::Ingress { p.ingress.is_some() } else { p.egress.is_some() };
            views
                .iter()
                .filter(|p| has_dir(p) && selects(p.namespace, p.pod_selector, pod))
                .map(|p| p.origin())
                .collect()
        };
        let mut out = here(&self.index.weft);
        out.extend(here(&self.index.standard));
        let ns_labels = self.view.ns_labels(&pod.namespace);
        out.extend(
            self.tiers
                .all()
                .filter(|p| !p.rules(dir).is_empty() && p.subject.selects(pod, ns_labels))
                .map(|p| p.origin()),
        );
        out
    }

    /// Whether any ClusterNetworkPolicy is in force (its subjects depend on
    /// namespace labels, unlike the namespaces' own policies).
    pub fn has_cluster_policies(&self) -> bool {
        self.tiers.all().next().is_some()
    }
}

/// A pod and the labels of its namespace.
pub type PodInNs<'p> = (&'p PodInfo, &'p BTreeMap<String, String>);

/// What a rule's resolution reads of one pod (the default: nothing).
#[derive(Debug, Default, PartialEq)]
struct Seen<'p> {
    /// The addresses, when a pod peer matches the pod.
    addresses: Option<&'p [IpAddr]>,
    /// Addresses and named ports, when the pod is a destination of an
    /// egress rule that names a port.
    named_ports: Option<(&'p [IpAddr], &'p [NamedPort])>,
}

/// What of `pod` the resolution of `rule` reads: its address when a pod
/// peer matches it, and its address and named ports when an egress rule
/// names a port and the pod is among the peers. Equal for two versions of
/// a pod: the rule resolves the same with either.
fn what_rule_sees<'p>(rule: &RuleSpec<'_>, dir: Direction, pod: PodInNs<'p>) -> Seen<'p> {
    let named_egress = dir == Direction::Egress && rule.ports.iter().any(|p| matches!(p, PortSel::Named(..)));
    what_peers_see(&rule.peers, named_egress, pod)
}

/// What of `pod` the resolution of `peers` reads: its address when a pod
/// peer matches it, and (`named_egress`: for an egress rule naming a port)
/// its address and named ports when it is among the peers.
fn what_peers_see<'p>(peers: &PeerSpec<'_>, named_egress: bool, (pod, ns_labels): PodInNs<'p>) -> Seen<'p> {
    let (peers, policy_ns) = (&peers.list, peers.own_ns.unwrap_or_default());
    let matches = |peer: &Peer<'_>| peer_matches(peer, policy_ns, pod, ns_labels);
    // A block's addresses are the block's, whatever pods it holds.
    let pod_peer = peers.iter().any(|peer| matches!(peer, Peer::Pods { .. }) && matches(peer));
    let named = named_egress && (peers.is_empty() || pod_peer || peers.iter().any(matches));
    let addrs = pod.ips.as_slice();
    Seen { addresses: pod_peer.then_some(addrs), named_ports: named.then_some((addrs, pod.ports.as_slice())) }
}

/// Which pods a policy selects.
#[derive(Clone, Copy, Debug)]
pub enum Reach<'a> {
    /// Those of `namespace` that `pod_selector` matches.
    Namespaced { namespace: &'a str, pod_selector: &'a LabelSelector },
    /// A ClusterNetworkPolicy's subject.
    Cluster(cluster::Subject<'a>),
}

impl<'a> Reach<'a> {
    pub fn of_standard(p: &'a netv1::NetworkPolicy) -> Option<Self> {
        let namespace = p.metadata.namespace.as_deref()?;
        let spec = p.spec.as_ref()?;
        Some(Reach::Namespaced { namespace, pod_selector: spec.pod_selector.as_ref().unwrap_or(&EVERY_POD) })
    }

    pub fn of_weft(p: &'a wnp::NetworkPolicy) -> Option<Self> {
        Some(Reach::Namespaced { namespace: p.metadata.namespace.as_deref()?, pod_selector: &p.spec.pod_selector })
    }

    pub fn of_cluster(p: &'a ClusterNetworkPolicy) -> Self {
        Reach::Cluster(cluster::Subject::of(&p.spec.subject))
    }

    /// Whether it selects `pod`, whose namespace is labelled `ns_labels`.
    pub fn selects(&self, pod: &PodInfo, ns_labels: &BTreeMap<String, String>) -> bool {
        match self {
            Reach::Namespaced { namespace, pod_selector } => selects(namespace, pod_selector, pod),
            Reach::Cluster(subject) => subject.selects(pod, ns_labels),
        }
    }
}

/// The policy of every pod on `node` that some policy selects, all
/// compiled (what the incremental compile is held to).
#[cfg(test)]
pub fn compile(cluster: &Cluster, node: &str) -> Vec<PodPolicy> {
    let compiler = Compiler::new(cluster);
    cluster.pods.iter().filter(|p| p.node == node).filter_map(|pod| compiler.pod_policy(pod)).collect()
}

/// What a chain decides for one packet (for tests): from/to `remote`,
/// `proto`/`port`. True when admitted.
#[cfg(test)]
pub fn admits(chain: &Chain, remote: IpAddr, proto: Proto, port: u16) -> bool {
    super::explain::decide(Some(chain), remote, proto, port).admitted()
}

#[cfg(test)]
#[path = "model_tests.rs"]
pub(crate) mod tests;

#[cfg(test)]
#[path = "model_props.rs"]
pub(crate) mod props;
