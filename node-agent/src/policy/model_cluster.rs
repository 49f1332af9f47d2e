//! ClusterNetworkPolicy (`policy.networking.k8s.io`, the SIG Network policy
//! API) compiled into the same chain of ordered Allow/Drop rules as the
//! namespaces' own policies, so that the renderer and the kernel know
//! nothing of tiers. Per pod and direction:
//!
//! 1. Admin tier: policy by policy, by priority ascending, then name (the
//!    API leaves ties to the implementation), rules in order. Accept →
//!    Allow, Deny → Drop. A Pass hands what it matches to the tiers below:
//!    in its place go the rules of those tiers, each restricted to what the
//!    Pass matches, then their end verdict for all of it, so no later Admin
//!    rule sees those packets.
//! 2. The namespaces' tier: weft.dev rules, then standard NetworkPolicy (a
//!    pod one of those isolates ends here: drop).
//! 3. Baseline tier, in the same order as Admin, for pods no standard
//!    policy isolates; then accept. A Pass there hands the packet to what
//!    follows, the default: it is an Accept.
//!
//! Node peers (experimental channel) match the addresses of the nodes their
//! selector picks (InternalIP and ExternalIP); what a pod sends its own node
//! is checked too (the renderer's input chain). Peers Weft cannot match yet
//! (by domain name, of the experimental channel, or a peer with no field
//! this version knows) fail closed as the API says: an Accept rule matches
//! nothing, a Deny or Pass rule denies everything. So does every rule of a
//! policy over the size limit (`cnp::MAX_COST`). The operator's `Accepted`
//! condition says which, and why.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use weft_api::cluster_network_policy as cnp;
use weft_api::selector;

use super::addr_ranges::{self, Range};
use super::{Direction, Match, Peer, PeerSpec, Peers, PodInfo, PortSel, Proto, Rule, RuleSpec, Verdict, View};

/// The pods a ClusterNetworkPolicy applies to.
#[derive(Clone, Copy, Debug)]
pub enum Subject<'a> {
    Namespaces(&'a LabelSelector),
    Pods {
        namespaces: &'a LabelSelector,
        pods: &'a LabelSelector,
    },
    /// Neither set (the CRD refuses it): no pod.
    Nothing,
}

impl<'a> Subject<'a> {
    pub fn of(s: &'a cnp::Subject) -> Self {
        match namespaces_or_pods(&s.namespaces, &s.pods) {
            Some((ns, None)) => Subject::Namespaces(ns),
            Some((namespaces, Some(pods))) => Subject::Pods { namespaces, pods },
            None => Subject::Nothing,
        }
    }

    /// Whether it selects `pod`, whose namespace is labelled `ns_labels`.
    pub fn selects(&self, pod: &PodInfo, ns_labels: &BTreeMap<String, String>) -> bool {
        match self {
            Subject::Namespaces(ns) => selector::matches(ns, ns_labels),
            Subject::Pods { namespaces, pods } => {
                selector::matches(namespaces, ns_labels) && selector::matches(pods, &pod.labels)
            }
            Subject::Nothing => false,
        }
    }
}

/// One rule of a tier policy; `pass`: the Admin tier's Pass.
pub(super) struct TierRule<'a> {
    pub spec: RuleSpec<'a>,
    pub pass: bool,
}

/// A ClusterNetworkPolicy reduced to what compilation needs.
pub(super) struct TierView<'a> {
    pub name: &'a str,
    pub subject: Subject<'a>,
    pub ingress: Vec<TierRule<'a>>,
    pub egress: Vec<TierRule<'a>>,
}

impl<'a> TierView<'a> {
    pub fn rules(&self, dir: Direction) -> &[TierRule<'a>] {
        match dir {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        }
    }

    pub fn origin(&self) -> String {
        format!("ClusterNetworkPolicy/{}", self.name)
    }
}

/// The policies of both tiers, each in evaluation order.
#[derive(Default)]
pub(super) struct Tiers<'a> {
    pub admin: Vec<TierView<'a>>,
    pub baseline: Vec<TierView<'a>>,
}

impl<'a> Tiers<'a> {
    pub fn new(policies: &'a [Arc<cnp::ClusterNetworkPolicy>]) -> Self {
        let mut tiers = Tiers::default();
        let mut ordered: Vec<&cnp::ClusterNetworkPolicy> = policies.iter().map(Arc::as_ref).collect();
        ordered.sort_by_key(|p| (p.spec.priority, p.metadata.name.as_deref().unwrap_or_default()));
        for p in ordered {
            let tier = p.spec.tier;
            // Oversized (`cnp::problems` says so in its status): every rule
            // fails closed, as one with a peer Weft cannot match.
            let refused = cnp::cost(&p.spec) > cnp::MAX_COST;
            let unless_refused = |peers: Vec<Peer<'a>>| if refused { vec![Peer::Nothing] } else { peers };
            let view = TierView {
                name: p.metadata.name.as_deref().unwrap_or_default(),
                subject: Subject::of(&p.spec.subject),
                ingress: p
                    .spec
                    .ingress
                    .iter()
                    .map(|r| {
                        rule(tier, r.action, unless_refused(r.from.iter().flat_map(peers).collect()), &r.protocols)
                    })
                    .collect(),
                egress: p
                    .spec
                    .egress
                    .iter()
                    .map(|r| {
                        let to = unless_refused(r.to.iter().flat_map(egress_peers).collect());
                        rule(tier, r.action, to, &r.protocols)
                    })
                    .collect(),
            };
            match p.spec.tier {
                cnp::Tier::Admin => tiers.admin.push(view),
                cnp::Tier::Baseline => tiers.baseline.push(view),
            }
        }
        tiers
    }

    pub fn all(&self) -> impl Iterator<Item = &TierView<'a>> {
        self.admin.iter().chain(&self.baseline)
    }

    /// The rules of `tier` for `pod` in direction `dir`, with whether each
    /// is a Pass (in the Baseline tier, an Accept: see the module's text).
    pub fn compile(
        view: &View<'a>,
        tier: &[TierView<'a>],
        dir: Direction,
        pod: &PodInfo,
        ns_labels: &BTreeMap<String, String>,
    ) -> Vec<(Rule, bool)> {
        let mut out = Vec::new();
        for p in tier.iter().filter(|p| p.subject.selects(pod, ns_labels)) {
            for (index, r) in (0..).zip(p.rules(dir)) {
                let matches = view.compile_rule(&r.spec, dir, pod);
                if !matches.is_empty() {
                    // A Deny drops (the API's word): never answered. (A
                    // Pass is replaced by the rules it passes to.)
                    let silent = r.spec.verdict == Verdict::Drop && !r.pass;
                    out.push((Rule { matches, verdict: r.spec.verdict, origin: p.origin(), index, silent }, r.pass));
                }
            }
        }
        out
    }
}

fn rule<'a>(
    tier: cnp::Tier,
    action: cnp::Action,
    peers: Vec<Peer<'a>>,
    protocols: &'a [cnp::Protocol],
) -> TierRule<'a> {
    let action = match (tier, action) {
        (cnp::Tier::Baseline, cnp::Action::Pass) => cnp::Action::Accept,
        (_, action) => action,
    };
    if action != cnp::Action::Accept && peers.iter().any(|p| matches!(p, Peer::Nothing)) {
        // Failing closed: deny everything (no peers: every address).
        let spec = RuleSpec { peers: PeerSpec::new(Vec::new(), ""), ports: Vec::new(), verdict: Verdict::Drop };
        return TierRule { spec, pass: false };
    }
    TierRule {
        // No peer is "this namespace": the policy has none.
        spec: RuleSpec {
            peers: PeerSpec::new(peers, ""),
            ports: ports(protocols),
            verdict: if action == cnp::Action::Accept { Verdict::Allow } else { Verdict::Drop },
        },
        pass: action == cnp::Action::Pass,
    }
}

fn peers(p: &cnp::IngressPeer) -> Vec<Peer<'_>> {
    vec![pod_peer(namespaces_or_pods(&p.namespaces, &p.pods))]
}

/// Whether any of `policies` has a node peer (whose addresses change with
/// the Nodes, not the pods).
pub fn name_nodes(policies: &[Arc<cnp::ClusterNetworkPolicy>]) -> bool {
    policies.iter().flat_map(|p| &p.spec.egress).flat_map(|r| &r.to).any(|peer| peer.nodes.is_some())
}

fn egress_peers(p: &cnp::EgressPeer) -> Vec<Peer<'_>> {
    if !p.networks.is_empty() {
        return p.networks.iter().map(|cidr| Peer::Block { cidr, except: &[] }).collect();
    }
    if let Some(nodes) = &p.nodes {
        return vec![Peer::Nodes(nodes)];
    }
    vec![pod_peer(namespaces_or_pods(&p.namespaces, &p.pods))]
}

fn pod_peer<'a>(selected: Option<(&'a LabelSelector, Option<&'a LabelSelector>)>) -> Peer<'a> {
    selected.map_or(Peer::Nothing, |(ns, pods)| Peer::Pods { ns: Some(ns), pods })
}

/// The one of `namespaces` and `pods` that is set, as (namespace selector,
/// pod selector): `pods` without a namespace selector means pods of every
/// namespace. None when neither or both are set.
fn namespaces_or_pods<'a>(
    namespaces: &'a Option<LabelSelector>,
    pods: &'a Option<cnp::NamespacedPod>,
) -> Option<(&'a LabelSelector, Option<&'a LabelSelector>)> {
    match (namespaces, pods) {
        (Some(ns), None) => Some((ns, None)),
        (None, Some(p)) => Some((p.namespace_selector.as_ref().unwrap_or(&super::EVERY_POD), Some(&p.pod_selector))),
        _ => None,
    }
}

/// Port selectors of `protocols` (none: every port of every protocol).
fn ports(protocols: &[cnp::Protocol]) -> Vec<PortSel> {
    let mut out = Vec::new();
    for p in protocols {
        let before = out.len();
        for (proto, ports) in [(Proto::Tcp, &p.tcp), (Proto::Udp, &p.udp), (Proto::Sctp, &p.sctp)] {
            let Some(ports) = ports else { continue };
            out.push(match &ports.destination_port {
                None => PortSel::Proto(proto),
                Some(cnp::Port { number: Some(n), range: None }) => range(proto, *n, *n),
                Some(cnp::Port { number: None, range: Some(r) }) => range(proto, r.start, r.end),
                Some(_) => PortSel::Nothing,
            });
        }
        if let Some(name) = &p.destination_named_port {
            out.extend([Proto::Tcp, Proto::Udp, Proto::Sctp].map(|proto| PortSel::Named(proto, name.clone())));
        }
        if out.len() == before {
            // An entry with nothing set matches nothing, not everything.
            out.push(PortSel::Nothing);
        }
    }
    out
}

fn range(proto: Proto, lo: i32, hi: i32) -> PortSel {
    match (u16::try_from(lo), u16::try_from(hi)) {
        (Ok(lo), Ok(hi)) if lo >= 1 && hi >= lo => PortSel::Range(proto, lo, hi),
        _ => PortSel::Nothing,
    }
}

/// The chain's rules: the Admin tier's in front of `rest` (the tiers below
/// it), each Pass replaced by `rest` restricted to what it matches and
/// `rest`'s end verdict (`default_deny`) for all of it.
pub(super) fn with_admin(admin: Vec<(Rule, bool)>, rest: Vec<Rule>, default_deny: bool) -> Vec<Rule> {
    let mut out = Vec::new();
    for (rule, pass) in admin {
        if !pass {
            out.push(rule);
            continue;
        }
        for r in &rest {
            let matches: Vec<Match> =
                rule.matches.iter().flat_map(|a| r.matches.iter().filter_map(move |b| intersect(a, b))).collect();
            if !matches.is_empty() {
                out.push(Rule {
                    matches,
                    verdict: r.verdict,
                    origin: r.origin.clone(),
                    index: r.index,
                    silent: r.silent,
                });
            }
        }
        let verdict = if default_deny { Verdict::Drop } else { Verdict::Allow };
        // The end of the namespaces' tier: their isolation, answered as theirs is.
        out.push(Rule { matches: rule.matches, verdict, origin: rule.origin, index: rule.index, silent: false });
    }
    out.extend(rest);
    out
}

/// The packets both `a` and `b` match, if any.
fn intersect(a: &Match, b: &Match) -> Option<Match> {
    let peers = match (&a.peers, &b.peers) {
        (Peers::Any, p) | (p, Peers::Any) => p.clone(),
        (Peers::Nets(x), Peers::Nets(y)) => {
            let ranges = |nets: &[ipnet::IpNet]| addr_ranges::union(nets.iter().map(Range::of_net).collect());
            let both = addr_ranges::intersect(&ranges(x), &ranges(y));
            if both.is_empty() {
                return None;
            }
            Peers::Nets(addr_ranges::to_nets(&both).into())
        }
    };
    let proto = match (a.proto, b.proto) {
        (None, p) | (p, None) => p,
        (Some(x), Some(y)) if x == y => Some(x),
        _ => return None,
    };
    let ports = match (a.ports, b.ports) {
        (None, p) | (p, None) => p,
        (Some((l1, h1)), Some((l2, h2))) if l1.max(l2) <= h1.min(h2) => Some((l1.max(l2), h1.min(h2))),
        _ => return None,
    };
    Some(Match { peers, proto, ports })
}
