//! Property: the compiled chains (`compile` + `admits`) decide every packet
//! as a naive evaluator does that walks the policies directly, written from
//! the `networking.k8s.io/v1` API reference, the ClusterNetworkPolicy CRD's
//! text (tiers, Pass) and docs/network-policy.md (Weft precedence) — no
//! address ranges, no caches, no chains, and no code of `model` or
//! `weft_api::selector` besides the input types.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ipnet::IpNet;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{Map, Value, json};

use super::{Cluster, Direction, NamedPort, NodeInfo, PodInfo, Proto, admits, compile, netv1, wnp};
use weft_api::cluster_network_policy as cnp;

pub(crate) const NODE: &str = "n1";
const NAMESPACES: [&str; 3] = ["alpha", "beta", "gamma"];
const KEYS: [&str; 3] = ["app", "tier", "team"];
const VALUES: [&str; 2] = ["x", "y"];
/// Container port numbers and numeric policy ports come from one pool, so
/// named and numeric ports meet.
const PORTS: [u16; 4] = [53, 80, 5432, 8080];
/// `endPort - port` of a range (0: a one-port range).
const WIDTHS: [u16; 3] = [0, 100, 3000];
/// Container port names; policies also name "nope", which no pod has.
const PORT_NAMES: [&str; 3] = ["http", "dns", "db"];
const POLICY_PORT_NAMES: [&str; 4] = ["http", "dns", "db", "nope"];
/// Pods get 10.0.0.1..=10.0.0.39, and some also fd00::1..=fd00::27 (the
/// same host number); blocks of both families cut through those ranges and
/// around them.
const CIDRS: [&str; 13] = [
    "10.0.0.0/24",
    "10.0.0.0/27",
    "10.0.0.16/28",
    "10.0.0.8/29",
    "10.0.0.5/32",
    "10.0.0.0/8",
    "0.0.0.0/0",
    "192.168.0.0/16",
    "fd00::/64",
    "fd00::/123",
    "fd00::10/124",
    "fd00::5/128",
    "::/0",
];
/// Prefix lengths `except` entries are drawn toward (at least the block's + 1).
const HOLE_LENGTHS: [u8; 8] = [16, 24, 26, 28, 29, 30, 31, 32];

// ---------------------------------------------------------------------------
// Generators

/// A generated cluster: what the model reads, with the policies kept as the
/// JSON they were made from so that a failure prints readably.
#[derive(Clone)]
pub(crate) struct Case {
    pub(crate) namespaces: BTreeMap<String, BTreeMap<String, String>>,
    pub(crate) pods: Vec<PodInfo>,
    pub(crate) standard: Vec<Value>,
    pub(crate) weft: Vec<Value>,
    /// ClusterNetworkPolicies of both tiers.
    pub(crate) cluster: Vec<Value>,
    /// n1 and n2, labelled (ClusterNetworkPolicy node peers).
    pub(crate) nodes: Vec<NodeInfo>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "namespaces: {:?}", self.namespaces)?;
        for p in &self.pods {
            let ports: Vec<String> = p.ports.iter().map(|n| format!("{}={}/{:?}", n.name, n.port, n.proto)).collect();
            writeln!(
                f,
                "pod {} ip={} node={} labels={:?} ports={:?}",
                p.key(),
                p.ips.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                p.node,
                p.labels,
                ports
            )?;
        }
        for n in &self.nodes {
            writeln!(f, "node {} ip={:?} labels={:?}", n.name, n.ips, n.labels)?;
        }
        for p in self.standard.iter().chain(&self.weft).chain(&self.cluster) {
            writeln!(f, "{p}")?;
        }
        Ok(())
    }
}

impl Case {
    pub(crate) fn cluster(&self) -> Cluster {
        Cluster {
            pods: self.pods.iter().cloned().map(Arc::new).collect(),
            namespaces: self.namespaces.clone(),
            standard: self.standard.iter().map(|v| Arc::new(serde_json::from_value(v.clone()).unwrap())).collect(),
            weft: self.weft.iter().map(|v| Arc::new(serde_json::from_value(v.clone()).unwrap())).collect(),
            cluster_policies: self
                .cluster
                .iter()
                .map(|v| Arc::new(serde_json::from_value(v.clone()).unwrap()))
                .collect(),
            nodes: self.nodes.iter().cloned().map(Arc::new).collect(),
        }
    }
}

fn labels() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map(
        select(KEYS.to_vec()).prop_map(String::from),
        select(VALUES.to_vec()).prop_map(String::from),
        0..=2,
    )
}

fn container_ports() -> impl Strategy<Value = Vec<NamedPort>> {
    // A map: names are unique within a pod.
    prop::collection::btree_map(select(PORT_NAMES.to_vec()), (select(PORTS.to_vec()), any::<bool>()), 0..=2).prop_map(
        |m| {
            m.into_iter()
                .map(|(name, (port, udp))| NamedPort {
                    name: name.into(),
                    port,
                    proto: if udp { Proto::Udp } else { Proto::Tcp },
                })
                .collect()
        },
    )
}

/// Namespaces (2-3, labelled) and pods (2-6, distinct addresses, some
/// with an IPv6 address too, on n1 or n2).
fn namespaces_and_pods() -> impl Strategy<Value = (BTreeMap<String, BTreeMap<String, String>>, Vec<PodInfo>)> {
    (prop::collection::vec(labels(), 2..=3), prop::collection::btree_set(1u8..40, 2..=6)).prop_flat_map(
        |(ns_labels, octets)| {
            let n_ns = ns_labels.len();
            let octets: Vec<u8> = octets.into_iter().collect();
            let pods = prop::collection::vec(
                (0..n_ns, labels(), prop_oneof![2 => Just(NODE), 1 => Just("n2")], container_ports(), any::<bool>()),
                octets.len(),
            );
            (Just(ns_labels), Just(octets).prop_shuffle(), pods).prop_map(|(ns_labels, octets, pods)| {
                let namespaces = NAMESPACES.iter().map(|n| (*n).to_owned()).zip(ns_labels).collect();
                let pods = pods
                    .into_iter()
                    .zip(octets)
                    .enumerate()
                    .map(|(i, ((ns, labels, node, ports, dual), octet))| PodInfo {
                        namespace: NAMESPACES[ns].into(),
                        name: format!("p{i}"),
                        labels,
                        ips: std::iter::once(IpAddr::V4(Ipv4Addr::new(10, 0, 0, octet)))
                            .chain(dual.then(|| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, octet.into()))))
                            .collect(),
                        node: node.into(),
                        ports,
                    })
                    .collect();
                (namespaces, pods)
            })
        },
    )
}

/// matchLabels, and now and then one matchExpressions entry; `{}` often.
fn selector() -> impl Strategy<Value = Value> {
    let key = || select(KEYS.to_vec());
    let value = || select(VALUES.to_vec());
    let match_labels = prop::collection::btree_map(key(), value(), 1..=2);
    let op = select(["In", "NotIn", "Exists", "DoesNotExist"].to_vec());
    let expression = (key(), op, prop::collection::btree_set(value(), 1..=2), prop::option::of(match_labels.clone()))
        .prop_map(|(key, op, values, labels)| {
            let mut e = json!({"key": key, "operator": op});
            if matches!(op, "In" | "NotIn") {
                e["values"] = json!(values);
            }
            let mut sel = json!({"matchExpressions": [e]});
            if let Some(l) = labels {
                sel["matchLabels"] = json!(l);
            }
            sel
        });
    prop_oneof![
        3 => Just(json!({})),
        5 => match_labels.prop_map(|l| json!({"matchLabels": l})),
        2 => expression,
    ]
}

/// A CIDR with 0-2 `except` entries strictly inside it, often around the pods.
fn ip_block() -> impl Strategy<Value = Value> {
    let hole = (any::<bool>(), any::<u32>(), select(HOLE_LENGTHS.to_vec()));
    (select(CIDRS.to_vec()), prop::collection::vec(hole, 0..=2), any::<bool>()).prop_map(|(cidr, holes, bare)| {
        let net: IpNet = cidr.parse().unwrap();
        let v6 = net.max_prefix_len() == 128;
        // Holes of an IPv6 block are drawn at the same depth from its end.
        let extra = net.max_prefix_len() - 32;
        let except: Vec<String> = holes
            .into_iter()
            .filter_map(|(near_pods, r, len)| {
                let len = (len + extra).max(net.prefix_len() + 1);
                if len > net.max_prefix_len() {
                    return None;
                }
                let host = (r % 48) as u8;
                let near = if v6 {
                    IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, host.into()))
                } else {
                    IpAddr::V4(Ipv4Addr::new(10, 0, 0, host))
                };
                let addr = if near_pods && net.contains(&near) {
                    near
                } else {
                    let (network, mask) = (as_int(net.network()), as_int(net.hostmask()));
                    from_int(v6, network | (u128::from(r) & mask))
                };
                Some(IpNet::new(addr, len).unwrap().trunc().to_string())
            })
            .collect();
        if except.is_empty() && bare { json!({"cidr": cidr}) } else { json!({"cidr": cidr, "except": except}) }
    })
}

/// A peer of either API: podSelector, namespaceSelector, both, or ipBlock.
fn peer() -> impl Strategy<Value = Value> {
    prop_oneof![
        selector().prop_map(|s| json!({"podSelector": s})),
        selector().prop_map(|s| json!({"namespaceSelector": s})),
        (selector(), selector()).prop_map(|(n, p)| json!({"namespaceSelector": n, "podSelector": p})),
        ip_block().prop_map(|b| json!({"ipBlock": b})),
    ]
}

/// A port entry of either API: protocol absent/TCP/UDP; no port, a number,
/// a range, or a name.
fn port() -> impl Strategy<Value = Value> {
    let proto = prop::option::of(select(["TCP", "UDP"].to_vec()));
    let number = prop_oneof![
        1 => Just(None),
        3 => select(PORTS.to_vec()).prop_map(|p| Some(json!(p))),
        1 => (select(PORTS.to_vec()), select(WIDTHS.to_vec())).prop_map(|(p, w)| Some(json!([p, p + w]))),
        2 => select(POLICY_PORT_NAMES.to_vec()).prop_map(|n| Some(json!(n))),
    ];
    (proto, number).prop_map(|(proto, number)| {
        let mut e = Map::new();
        if let Some(p) = proto {
            e.insert("protocol".into(), json!(p));
        }
        match number {
            Some(Value::Array(range)) => {
                e.insert("port".into(), range[0].clone());
                e.insert("endPort".into(), range[1].clone());
            }
            Some(n) => {
                e.insert("port".into(), n);
            }
            None => {}
        }
        Value::Object(e)
    })
}

/// A list field: absent, present but empty, or 1..=max items.
fn list(item: impl Strategy<Value = Value>, max: usize) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        1 => Just(None),
        1 => Just(Some(json!([]))),
        4 => prop::collection::vec(item, 1..=max).prop_map(|v| Some(Value::Array(v))),
    ]
}

fn object(fields: Vec<(&str, Option<Value>)>) -> Value {
    Value::Object(fields.into_iter().filter_map(|(k, v)| v.map(|v| (k.to_owned(), v))).collect())
}

fn standard_rule(peers_field: &'static str) -> impl Strategy<Value = Value> {
    (list(peer(), 2), list(port(), 2))
        .prop_map(move |(peers, ports)| object(vec![(peers_field, peers), ("ports", ports)]))
}

/// (namespace index, spec) of a standard NetworkPolicy.
fn standard_policy() -> impl Strategy<Value = (usize, Value)> {
    let types = prop_oneof![
        3 => Just(None),
        1 => Just(Some(json!([]))),
        2 => Just(Some(json!(["Ingress"]))),
        2 => Just(Some(json!(["Egress"]))),
        2 => Just(Some(json!(["Ingress", "Egress"]))),
    ];
    let spec = (
        prop_oneof![1 => Just(None), 5 => selector().prop_map(Some)],
        types,
        list(standard_rule("from"), 2),
        list(standard_rule("to"), 2),
    )
        .prop_map(|(sel, types, ingress, egress)| {
            object(vec![("podSelector", sel), ("policyTypes", types), ("ingress", ingress), ("egress", egress)])
        });
    (0..NAMESPACES.len(), spec)
}

fn weft_rule() -> impl Strategy<Value = Value> {
    (select(["Allow", "Deny"].to_vec()), list(peer(), 2), list(port(), 2)).prop_map(|(action, peers, ports)| {
        object(vec![("action", Some(json!(action))), ("peers", peers), ("ports", ports)])
    })
}

/// (namespace index, spec) of a Weft NetworkPolicy; few priorities, so ties happen.
fn weft_policy() -> impl Strategy<Value = (usize, Value)> {
    let spec = (
        prop_oneof![1 => Just(None), 5 => selector().prop_map(Some)],
        prop::option::of(select([0, 5, 10].to_vec())),
        prop::collection::vec(weft_rule(), 0..=2),
        prop::collection::vec(weft_rule(), 0..=2),
    )
        .prop_map(|(sel, priority, ingress, egress)| {
            object(vec![
                ("podSelector", sel),
                ("priority", priority.map(|p: i32| json!(p))),
                ("ingress", Some(json!(ingress))),
                ("egress", Some(json!(egress))),
            ])
        });
    (0..NAMESPACES.len(), spec)
}

/// A ClusterNetworkPolicy peer: by namespaces, by pods, and for egress
/// also by networks and by nodes.
fn cluster_peer(egress: bool) -> impl Strategy<Value = Value> {
    let networks = prop::collection::vec(select(CIDRS.to_vec()), 1..=2).prop_map(|n| json!({"networks": n}));
    prop_oneof![
        2 => selector().prop_map(|s| json!({"namespaces": s})),
        2 => (prop::option::of(selector()), selector()).prop_map(|(n, p)| match n {
            Some(n) => json!({"pods": {"namespaceSelector": n, "podSelector": p}}),
            None => json!({"pods": {"podSelector": p}}),
        }),
        if egress { 2 } else { 0 } => networks,
        if egress { 1 } else { 0 } => selector().prop_map(|s| json!({"nodes": s})),
    ]
}

/// A ClusterNetworkPolicy protocol entry: a protocol with no port, a
/// number or a range; or a named port.
fn cluster_protocol() -> impl Strategy<Value = Value> {
    let proto = select(["tcp", "udp", "sctp"].to_vec());
    let port = prop_oneof![
        1 => Just(None),
        2 => select(PORTS.to_vec()).prop_map(|p| Some(json!({"number": p}))),
        1 => (select(PORTS.to_vec()), select(WIDTHS[1..].to_vec()))
            .prop_map(|(p, w)| Some(json!({"range": {"start": p, "end": p + w}}))),
    ];
    prop_oneof![
        4 => (proto, port).prop_map(|(proto, port)| match port {
            None => json!({proto: {}}),
            Some(p) => json!({proto: {"destinationPort": p}}),
        }),
        1 => select(POLICY_PORT_NAMES.to_vec()).prop_map(|n| json!({"destinationNamedPort": n})),
    ]
}

fn cluster_rule(egress: bool) -> impl Strategy<Value = Value> {
    (
        select(["Accept", "Deny", "Pass"].to_vec()),
        prop::collection::vec(cluster_peer(egress), 1..=2),
        list(cluster_protocol(), 2),
    )
        .prop_map(move |(action, peers, protocols)| {
            let field = if egress { "to" } else { "from" };
            object(vec![("action", Some(json!(action))), (field, Some(json!(peers))), ("protocols", protocols)])
        })
}

/// The spec of a ClusterNetworkPolicy; few priorities, so ties happen.
fn cluster_policy() -> impl Strategy<Value = Value> {
    select(["Admin", "Baseline"].to_vec()).prop_flat_map(|tier| {
        let subject = prop_oneof![
            selector().prop_map(|s| json!({"namespaces": s})),
            (prop::option::of(selector()), selector()).prop_map(|(n, p)| match n {
                Some(n) => json!({"pods": {"namespaceSelector": n, "podSelector": p}}),
                None => json!({"pods": {"podSelector": p}}),
            }),
        ];
        (
            select([0, 5, 10].to_vec()),
            subject,
            prop::collection::vec(cluster_rule(false), 0..=2),
            prop::collection::vec(cluster_rule(true), 0..=2),
        )
            .prop_map(move |(priority, subject, ingress, egress)| {
                json!({"tier": tier, "priority": priority, "subject": subject, "ingress": ingress, "egress": egress})
            })
    })
}

pub(crate) fn case() -> impl Strategy<Value = Case> {
    (
        namespaces_and_pods(),
        prop::collection::vec(standard_policy(), 0..=4),
        prop::collection::vec(weft_policy(), 0..=3),
        prop::collection::vec(cluster_policy(), 0..=3),
        (labels(), labels()),
    )
        .prop_map(|((namespaces, pods), standard, weft, cluster, node_labels)| {
            // Policies live in the cluster's namespaces (two or three of them).
            let ns = |i: usize| NAMESPACES[i % namespaces.len()];
            let standard = standard
                .into_iter()
                .enumerate()
                .map(|(i, (n, spec))| json!({"metadata": {"name": format!("np{i}"), "namespace": ns(n)}, "spec": spec}))
                .collect();
            let weft = weft
                .into_iter()
                .enumerate()
                .map(|(i, (n, spec))| {
                    json!({"apiVersion": "weft.dev/v1alpha1", "kind": "NetworkPolicy",
                           "metadata": {"name": format!("wnp{i}"), "namespace": ns(n)}, "spec": spec})
                })
                .collect();
            let cluster = cluster
                .into_iter()
                .enumerate()
                .map(|(i, spec)| {
                    json!({"apiVersion": "policy.networking.k8s.io/v1beta1", "kind": "ClusterNetworkPolicy",
                           "metadata": {"name": format!("cnp{i}")}, "spec": spec})
                })
                .collect();
            // Node addresses apart from the pods' (one node has an IPv6 one too).
            let nodes = vec![
                NodeInfo { name: NODE.into(), labels: node_labels.0, ips: vec!["192.168.50.1".parse().unwrap()] },
                NodeInfo {
                    name: "n2".into(),
                    labels: node_labels.1,
                    ips: vec!["192.168.50.2".parse().unwrap(), "fd00:50::2".parse().unwrap()],
                },
            ];
            Case { namespaces, pods, standard, weft, cluster, nodes }
        })
}

// ---------------------------------------------------------------------------
// The naive evaluator

pub(crate) mod naive {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    use super::*;

    /// matchLabels and every matchExpressions entry must hold; `{}` matches all.
    fn selects(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
        for (k, v) in sel.match_labels.iter().flatten() {
            if labels.get(k) != Some(v) {
                return false;
            }
        }
        for e in sel.match_expressions.iter().flatten() {
            let values = e.values.clone().unwrap_or_default();
            let value_in = labels.get(&e.key).is_some_and(|v| values.contains(v));
            let holds = match e.operator.as_str() {
                "In" => value_in,
                "NotIn" => !value_in,
                "Exists" => labels.contains_key(&e.key),
                "DoesNotExist" => !labels.contains_key(&e.key),
                other => panic!("the generator made operator {other}"),
            };
            if !holds {
                return false;
            }
        }
        true
    }

    fn pod_at(c: &Cluster, addr: IpAddr) -> Option<&PodInfo> {
        c.pods.iter().map(Arc::as_ref).find(|p| p.ips.contains(&addr))
    }

    fn namespace_labels(c: &Cluster, ns: &str) -> BTreeMap<String, String> {
        c.namespaces.get(ns).cloned().unwrap_or_default()
    }

    /// (`IpNet::contains` is false for an address of the other family.)
    fn in_block(cidr: &str, except: &[String], addr: IpAddr) -> bool {
        let net: IpNet = cidr.parse().unwrap();
        net.contains(&addr) && !except.iter().any(|e| e.parse::<IpNet>().unwrap().contains(&addr))
    }

    /// One peer (the fields of either API) against the remote address.
    fn peer_matches(
        c: &Cluster,
        policy_ns: &str,
        pods: Option<&LabelSelector>,
        namespaces: Option<&LabelSelector>,
        block: Option<(&str, &[String])>,
        remote: IpAddr,
    ) -> bool {
        if let Some((cidr, except)) = block {
            return in_block(cidr, except, remote);
        }
        // A selector peer is a set of pods: the remote must be one of them.
        let Some(pod) = pod_at(c, remote) else { return false };
        let namespace_ok = match namespaces {
            None => pod.namespace == policy_ns,
            Some(sel) => selects(sel, &namespace_labels(c, &pod.namespace)),
        };
        namespace_ok && pods.is_none_or(|sel| selects(sel, &pod.labels))
    }

    /// The pod a packet is addressed to: the selected pod for ingress, the
    /// pod behind the remote address (if any) for egress.
    fn destination<'c>(c: &'c Cluster, pod: &'c PodInfo, dir: Direction, remote: IpAddr) -> Option<&'c PodInfo> {
        match dir {
            Direction::Ingress => Some(pod),
            Direction::Egress => pod_at(c, remote),
        }
    }

    /// One port entry. `protocol` is the entry's (TCP when absent).
    fn port_matches(
        protocol: Option<&str>,
        number: Option<&IntOrString>,
        end: Option<i32>,
        dst: Option<&PodInfo>,
        proto: Proto,
        port: u16,
    ) -> bool {
        let entry_proto = match protocol.unwrap_or("TCP") {
            "TCP" => Proto::Tcp,
            "UDP" => Proto::Udp,
            "SCTP" => Proto::Sctp,
            other => panic!("the generator made protocol {other}"),
        };
        if entry_proto != proto {
            return false;
        }
        match number {
            None => true,
            Some(IntOrString::Int(n)) => match end {
                None => i32::from(port) == *n,
                Some(e) => *n <= i32::from(port) && i32::from(port) <= e,
            },
            // A name: the destination pod's container port of that name and protocol.
            Some(IntOrString::String(name)) => {
                dst.is_some_and(|d| d.ports.iter().any(|cp| &cp.name == name && cp.proto == proto && cp.port == port))
            }
        }
    }

    /// A standard rule's peers (`from` or `to`) and ports.
    type StandardRule<'a> = (&'a [netv1::NetworkPolicyPeer], &'a [netv1::NetworkPolicyPort]);

    fn or_empty<T>(v: Option<&Vec<T>>) -> &[T] {
        v.map(Vec::as_slice).unwrap_or_default()
    }

    struct Packet<'c> {
        pod: &'c PodInfo,
        dir: Direction,
        remote: IpAddr,
        proto: Proto,
        port: u16,
    }

    /// Standard policies: None when no policy of this direction selects the
    /// pod, else whether any rule of those policies admits the packet.
    fn standard(c: &Cluster, pkt: &Packet<'_>) -> Option<bool> {
        let dst = destination(c, pkt.pod, pkt.dir, pkt.remote);
        let mut isolated = false;
        let mut admitted = false;
        for np in &c.standard {
            let ns = np.metadata.namespace.as_deref().unwrap();
            let spec = np.spec.as_ref().unwrap();
            let every_pod = LabelSelector::default();
            if ns != pkt.pod.namespace || !selects(spec.pod_selector.as_ref().unwrap_or(&every_pod), &pkt.pod.labels) {
                continue;
            }
            // policyTypes defaulting (SetDefaults_NetworkPolicy): when empty,
            // Ingress, plus Egress if there are egress rules.
            let types: Vec<String> = match &spec.policy_types {
                Some(t) if !t.is_empty() => t.clone(),
                _ => {
                    let mut t = vec!["Ingress".to_owned()];
                    if spec.egress.as_ref().is_some_and(|e| !e.is_empty()) {
                        t.push("Egress".to_owned());
                    }
                    t
                }
            };
            let wanted = match pkt.dir {
                Direction::Ingress => "Ingress",
                Direction::Egress => "Egress",
            };
            if !types.iter().any(|t| t == wanted) {
                continue;
            }
            isolated = true;
            // Absent and empty `from`/`to`/`ports` alike: no restriction.
            let rules: Vec<StandardRule<'_>> = match pkt.dir {
                Direction::Ingress => spec
                    .ingress
                    .iter()
                    .flatten()
                    .map(|r| (or_empty(r.from.as_ref()), or_empty(r.ports.as_ref())))
                    .collect(),
                Direction::Egress => spec
                    .egress
                    .iter()
                    .flatten()
                    .map(|r| (or_empty(r.to.as_ref()), or_empty(r.ports.as_ref())))
                    .collect(),
            };
            for (peers, ports) in rules {
                let peer_ok = peers.is_empty()
                    || peers.iter().any(|p| {
                        let block =
                            p.ip_block.as_ref().map(|b| (b.cidr.as_str(), b.except.as_deref().unwrap_or_default()));
                        peer_matches(c, ns, p.pod_selector.as_ref(), p.namespace_selector.as_ref(), block, pkt.remote)
                    });
                let port_ok = ports.is_empty()
                    || ports.iter().any(|p| {
                        port_matches(p.protocol.as_deref(), p.port.as_ref(), p.end_port, dst, pkt.proto, pkt.port)
                    });
                admitted |= peer_ok && port_ok;
            }
        }
        isolated.then_some(admitted)
    }

    /// Weft policies: among the rules that match the packet (of the policies
    /// selecting the pod), those of the highest priority decide; Deny wins a
    /// tie. None when no Weft rule matches.
    fn weft(c: &Cluster, pkt: &Packet<'_>) -> Option<bool> {
        let dst = destination(c, pkt.pod, pkt.dir, pkt.remote);
        let mut matching: Vec<(i32, wnp::PolicyAction)> = Vec::new();
        for wp in &c.weft {
            let ns = wp.metadata.namespace.as_deref().unwrap();
            if ns != pkt.pod.namespace || !selects(&wp.spec.pod_selector, &pkt.pod.labels) {
                continue;
            }
            let rules = match pkt.dir {
                Direction::Ingress => &wp.spec.ingress,
                Direction::Egress => &wp.spec.egress,
            };
            for r in rules {
                let peer_ok = r.peers.is_empty()
                    || r.peers.iter().any(|p| {
                        let block = p.ip_block.as_ref().map(|b| (b.cidr.as_str(), b.except.as_slice()));
                        peer_matches(c, ns, p.pod_selector.as_ref(), p.namespace_selector.as_ref(), block, pkt.remote)
                    });
                let port_ok = r.ports.is_empty()
                    || r.ports.iter().any(|p| {
                        port_matches(Some(p.protocol.as_str()), p.port.as_ref(), p.end_port, dst, pkt.proto, pkt.port)
                    });
                if peer_ok && port_ok {
                    matching.push((wp.spec.priority, r.action));
                }
            }
        }
        let top = matching.iter().map(|(p, _)| *p).max()?;
        Some(!matching.iter().any(|&(p, a)| p == top && a == wnp::PolicyAction::Deny))
    }

    /// The action of the first rule of `tier` that matches the packet, the
    /// policies taken by priority ascending, then name; rules in order.
    fn cluster_tier(c: &Cluster, pkt: &Packet<'_>, tier: cnp::Tier) -> Option<cnp::Action> {
        let dst = destination(c, pkt.pod, pkt.dir, pkt.remote);
        let mut policies: Vec<&cnp::ClusterNetworkPolicy> =
            c.cluster_policies.iter().map(Arc::as_ref).filter(|p| p.spec.tier == tier).collect();
        policies.sort_by_key(|p| (p.spec.priority, p.metadata.name.clone()));
        let ns_labels = namespace_labels(c, &pkt.pod.namespace);
        for p in policies {
            let subject = &p.spec.subject;
            let selected = match (&subject.namespaces, &subject.pods) {
                (Some(ns), None) => selects(ns, &ns_labels),
                (None, Some(pods)) => {
                    pods.namespace_selector.as_ref().is_none_or(|s| selects(s, &ns_labels))
                        && selects(&pods.pod_selector, &pkt.pod.labels)
                }
                _ => panic!("the generator made a subject with {subject:?}"),
            };
            if !selected {
                continue;
            }
            let rules: Vec<(cnp::Action, Vec<cnp::EgressPeer>, &[cnp::Protocol])> = match pkt.dir {
                Direction::Ingress => p
                    .spec
                    .ingress
                    .iter()
                    .map(|r| {
                        let peers = r.from.iter().map(|f| cnp::EgressPeer {
                            namespaces: f.namespaces.clone(),
                            pods: f.pods.clone(),
                            ..Default::default()
                        });
                        (r.action, peers.collect(), r.protocols.as_slice())
                    })
                    .collect(),
                Direction::Egress => {
                    p.spec.egress.iter().map(|r| (r.action, r.to.clone(), r.protocols.as_slice())).collect()
                }
            };
            for (action, peers, protocols) in rules {
                let peer_ok = peers.iter().any(|peer| {
                    if !peer.networks.is_empty() {
                        return peer.networks.iter().any(|n| in_block(n, &[], pkt.remote));
                    }
                    if let Some(nodes) = &peer.nodes {
                        return c.nodes.iter().any(|n| selects(nodes, &n.labels) && n.ips.contains(&pkt.remote));
                    }
                    let Some(remote) = pod_at(c, pkt.remote) else { return false };
                    let remote_ns = namespace_labels(c, &remote.namespace);
                    match (&peer.namespaces, &peer.pods) {
                        (Some(ns), None) => selects(ns, &remote_ns),
                        (None, Some(pods)) => {
                            pods.namespace_selector.as_ref().is_none_or(|s| selects(s, &remote_ns))
                                && selects(&pods.pod_selector, &remote.labels)
                        }
                        _ => panic!("the generator made a peer with {peer:?}"),
                    }
                });
                let port_ok = protocols.is_empty()
                    || protocols.iter().any(|entry| {
                        let by_proto = [(Proto::Tcp, &entry.tcp), (Proto::Udp, &entry.udp), (Proto::Sctp, &entry.sctp)];
                        let numbered = by_proto.iter().any(|(proto, ports)| {
                            *proto == pkt.proto
                                && ports.as_ref().is_some_and(|ports| match &ports.destination_port {
                                    None => true,
                                    Some(port) => {
                                        let n = i32::from(pkt.port);
                                        port.number == Some(n) || port.range.is_some_and(|r| r.start <= n && n <= r.end)
                                    }
                                })
                        });
                        let named = entry.destination_named_port.as_ref().is_some_and(|name| {
                            dst.is_some_and(|d| {
                                d.ports
                                    .iter()
                                    .any(|cp| &cp.name == name && cp.proto == pkt.proto && cp.port == pkt.port)
                            })
                        });
                        numbered || named
                    });
                if peer_ok && port_ok {
                    return Some(action);
                }
            }
        }
        None
    }

    /// Whether `pod` admits, in `dir`, a packet from (ingress) or to
    /// (egress) `remote` with destination port `proto`/`port`: the Admin
    /// tier (Pass: on to the next tier), the namespace's policies (Weft's,
    /// then standard ones), the Baseline tier (Pass: on to the default),
    /// then admitted.
    pub fn allowed(c: &Cluster, pod: &PodInfo, dir: Direction, remote: IpAddr, proto: Proto, port: u16) -> bool {
        let pkt = Packet { pod, dir, remote, proto, port };
        match cluster_tier(c, &pkt, cnp::Tier::Admin) {
            Some(cnp::Action::Accept) => return true,
            Some(cnp::Action::Deny) => return false,
            Some(cnp::Action::Pass) | None => {}
        }
        if let Some(decided) = weft(c, &pkt).or_else(|| standard(c, &pkt)) {
            return decided;
        }
        cluster_tier(c, &pkt, cnp::Tier::Baseline) != Some(cnp::Action::Deny)
    }
}

// ---------------------------------------------------------------------------
// The probes

/// Every pod address, the edges of every block and `except` (and the
/// addresses just outside them), and two addresses of each family no
/// policy names.
fn remotes(case: &Case) -> Vec<IpAddr> {
    let mut out: BTreeSet<IpAddr> = case.pods.iter().flat_map(|p| p.ips.iter().copied()).collect();
    out.extend(case.nodes.iter().flat_map(|n| n.ips.iter().copied()));
    let unnamed = ["10.0.0.200", "172.16.0.1", "fd00::c8", "2001:db8::1"];
    out.extend(unnamed.map(|a| a.parse::<IpAddr>().unwrap()));
    fn blocks(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for n in m.get("networks").and_then(Value::as_array).into_iter().flatten() {
                    out.push(n.as_str().unwrap().to_owned());
                }
                if let Some(b) = m.get("ipBlock") {
                    out.push(b["cidr"].as_str().unwrap().to_owned());
                    out.extend(b["except"].as_array().into_iter().flatten().map(|e| e.as_str().unwrap().to_owned()));
                }
                m.values().for_each(|x| blocks(x, out));
            }
            Value::Array(a) => a.iter().for_each(|x| blocks(x, out)),
            _ => {}
        }
    }
    let mut nets = Vec::new();
    case.standard.iter().chain(&case.weft).chain(&case.cluster).for_each(|p| blocks(p, &mut nets));
    for n in nets {
        let net: IpNet = n.parse().unwrap();
        let v6 = net.max_prefix_len() == 128;
        let top = if v6 { u128::MAX } else { u128::from(u32::MAX) };
        let (lo, hi) = (as_int(net.network()), as_int(net.network()) | as_int(net.hostmask()));
        out.extend([lo, hi].map(|a| from_int(v6, a)));
        out.extend(lo.checked_sub(1).map(|a| from_int(v6, a)));
        out.extend((hi < top).then(|| from_int(v6, hi + 1)));
    }
    out.into_iter().collect()
}

fn as_int(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(a) => u32::from(a).into(),
        IpAddr::V6(a) => a.into(),
    }
}

fn from_int(v6: bool, n: u128) -> IpAddr {
    if v6 { IpAddr::V6(n.into()) } else { IpAddr::V4(Ipv4Addr::from(u32::try_from(n).unwrap())) }
}

/// Every pool port (the numbers of named ports too) and its neighbour, the
/// ends of every range and just past them, and two ports nothing names.
fn probe_ports() -> Vec<u16> {
    let mut out: BTreeSet<u16> = [1, 65535].into();
    for p in PORTS {
        out.extend([p, p + 1]);
        for w in WIDTHS {
            out.extend([p + w, p + w + 1]);
        }
    }
    out.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// For every local pod, both directions, every probe address, protocol
    /// and port: the compiled chain (none: open) admits exactly what the
    /// naive reading of the policies admits.
    #[test]
    fn compiled_chains_admit_what_the_policies_say(case in case()) {
        let c = case.cluster();
        for p in &c.weft {
            prop_assert!(wnp::validate(&p.spec).is_empty(), "generated an invalid Weft policy: {:?}", wnp::validate(&p.spec));
        }
        let compiled = compile(&c, NODE);
        for pp in &compiled {
            prop_assert!(
                c.pods.iter().any(|p| p.key() == pp.key && p.node == NODE && p.ips == pp.ips),
                "{} is no local pod", pp.key
            );
        }
        let (remotes, ports) = (remotes(&case), probe_ports());
        for pod in c.pods.iter().filter(|p| p.node == NODE) {
            let policy = compiled.iter().find(|p| p.key == pod.key());
            for dir in [Direction::Ingress, Direction::Egress] {
                let chain = policy.and_then(|p| match dir {
                    Direction::Ingress => p.ingress.as_ref(),
                    Direction::Egress => p.egress.as_ref(),
                });
                for &remote in &remotes {
                    for proto in [Proto::Tcp, Proto::Udp, Proto::Sctp] {
                        for &port in &ports {
                            let model = chain.is_none_or(|ch| admits(ch, remote, proto, port));
                            let naive = naive::allowed(&c, pod, dir, remote, proto, port);
                            prop_assert_eq!(
                                model, naive,
                                "{} {:?} remote {} {:?}/{}: model {}, naive {}; chain {:?}",
                                pod.key(), dir, remote, proto, port, model, naive, chain
                            );
                        }
                    }
                }
            }
        }
    }
}
