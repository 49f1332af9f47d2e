//! Compiled policy → the `policy` part of Weft's nftables table, pure.
//!
//! Layout: the base chain `policy-forward` (filter, forward hook) accepts
//! replies of admitted connections at once (conntrack), then looks a local
//! pod's address up as source in the verdict map `policy-egress` and as
//! destination in `policy-ingress` (`policy-egress6` and `policy-ingress6`
//! for IPv6: a pod is in the maps of each family it has an address of);
//! each jumps to the pod's chain for that direction. A rule whose peers are
//! addresses of both families becomes a rule per family, so an IPv4 block
//! never matches an IPv6 packet nor the other way round. A pod chain returns what it admits (so egress and then
//! ingress are both checked) and denies the rest: rejects it by default (a
//! TCP reset, ICMP "administratively prohibited" for everything else, so a
//! client fails at once instead of waiting out its timeout) or, with
//! [`DenyAction::Drop`], drops it silently. An accept in Weft's chain
//! only ends Weft's chain: every other table and iptables chain on the hook
//! still sees the packet, so Weft never admits on anybody's behalf. What a
//! pod sends to its own node does not cross the forward hook: the base chain
//! `policy-input` (input hook) sends it through the pod's egress chain.
//! What the node sends a pod (kubelet's probes) is never policed.
//!
//! Pod chains and address sets are named by a hash of their content: pods
//! with the same policy share a chain, and an update writes only the chains
//! and sets whose content changed, plus the map elements of pods whose
//! chain changed. Every rule counts into a named counter per policy,
//! direction and verdict; counters are objects of their own, so they keep
//! counting when a chain is rewritten.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ipnet::IpNet;
use nftables::stmt::Statement as NftStatement;

use super::model::{Chain, Direction, Match, Peers, PodPolicy, Verdict};
use crate::firewall::build::{self, Addr};
use crate::firewall::ruleset::{
    self, ChainKind, FILTER, Family, Hook, HookPoint, Key, Part, Proto, Rule, Set, SetKind, digest,
};

type Statement = NftStatement<'static>;

pub const OWNER: &str = "policy";
pub const INGRESS_MAP: &str = "policy-ingress";
pub const EGRESS_MAP: &str = "policy-egress";
pub const INGRESS_MAP6: &str = "policy-ingress6";
pub const EGRESS_MAP6: &str = "policy-egress6";

/// The dispatch map of a direction and family, with the address of the
/// local pod it looks up (the source of egress, the destination of ingress).
fn dispatch_map(dir: Direction, family: Family) -> (&'static str, Addr) {
    match (dir, family) {
        (Direction::Egress, Family::V4) => (EGRESS_MAP, Addr::Src),
        (Direction::Egress, Family::V6) => (EGRESS_MAP6, Addr::Src),
        (Direction::Ingress, Family::V4) => (INGRESS_MAP, Addr::Dst),
        (Direction::Ingress, Family::V6) => (INGRESS_MAP6, Addr::Dst),
    }
}

const FAMILIES: [Family; 2] = [Family::V4, Family::V6];
/// The origin of drops of packets conntrack finds invalid.
pub const INVALID: &str = "invalid";
/// The origin of drops no rule admitted.
pub const DEFAULT_DENY: &str = "default-deny";

/// The optional log of dropped packets: each drop rule is preceded by a
/// rule that copies (at most `per_second` a second, per rule) the packets
/// it is about to drop to NFLOG group `group`, prefixed with the name of
/// the rule's drop counter (which says policy and direction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropLog {
    pub group: u16,
    pub per_second: u32,
}

/// What a deny does with the packets it matches (agent flag
/// `--policy-deny-action`). Either way they are counted as dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DenyAction {
    /// Dropped and answered: a TCP reset for TCP, ICMP "administratively
    /// prohibited" for the rest.
    #[default]
    Reject,
    /// Dropped silently: the client waits for its own timeout.
    Drop,
}

impl std::str::FromStr for DenyAction {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reject" => Ok(DenyAction::Reject),
            "drop" => Ok(DenyAction::Drop),
            other => Err(format!("unknown deny action {other:?}: expected reject or drop")),
        }
    }
}

/// The endings of the rules a deny becomes: each an optional extra match
/// and the verdict. Rejecting without a protocol matched takes two rules,
/// a reset for TCP and ICMP for the rest.
fn deny_endings(action: DenyAction, proto: Option<Proto>) -> Vec<(Option<Statement>, Statement)> {
    match (action, proto) {
        (DenyAction::Drop, _) => vec![(None, build::drop())],
        (DenyAction::Reject, Some(Proto::Tcp)) => vec![(None, build::reject_tcp_reset())],
        (DenyAction::Reject, Some(_)) => vec![(None, build::reject_prohibited())],
        (DenyAction::Reject, None) => {
            vec![(Some(build::l4proto(Proto::Tcp)), build::reject_tcp_reset()), (None, build::reject_prohibited())]
        }
    }
}

/// What a named counter counts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CounterLabels {
    /// `ns/name`, `weft.dev/ns/name`, `default-deny` or `invalid`.
    pub policy: String,
    pub direction: Direction,
    pub verdict: Verdict,
}

impl CounterLabels {
    pub fn verdict_str(&self) -> &'static str {
        match self.verdict {
            Verdict::Allow => "allowed",
            Verdict::Drop => "dropped",
        }
    }
}

/// What the kernel should hold, and what each counter counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub part: Part,
    pub counters: BTreeMap<String, CounterLabels>,
}

impl Desired {
    pub fn rule_count(&self) -> usize {
        self.part.chains.values().map(|c| c.rules.len()).sum()
    }
}

fn counter_name(l: &CounterLabels) -> String {
    let dir = if l.direction == Direction::Ingress { "in" } else { "eg" };
    format!("{OWNER}-count-{dir}-{}-{}", l.verdict_str(), digest(&l.policy))
}

pub fn set_name(nets: &[IpNet]) -> String {
    // Of the nets' bytes, not their text: a set may hold thousands, and a
    // pod selected anew names each of its sets. Each net is its family,
    // address and prefix length, so two lists never give the same bytes.
    let mut bytes = Vec::with_capacity(nets.len() * 18);
    for net in nets {
        match net {
            IpNet::V4(n) => {
                bytes.push(4);
                bytes.extend_from_slice(&n.addr().octets());
            }
            IpNet::V6(n) => {
                bytes.push(6);
                bytes.extend_from_slice(&n.addr().octets());
            }
        }
        bytes.push(net.prefix_len());
    }
    format!("{OWNER}-set-{}", crate::stable_hash::digest_bytes(&bytes))
}

/// Names counters and sets as rules need them.
struct Names<'a> {
    sets: &'a mut BTreeMap<String, Set>,
    counters: &'a mut BTreeMap<String, CounterLabels>,
    log: Option<DropLog>,
    deny: DenyAction,
}

impl Names<'_> {
    fn counter(&mut self, policy: &str, direction: Direction, verdict: Verdict) -> String {
        let labels = CounterLabels { policy: policy.to_owned(), direction, verdict };
        let name = counter_name(&labels);
        self.counters.entry(name.clone()).or_insert(labels);
        name
    }

    /// A set of `nets`, all of `family`.
    fn set(&mut self, family: Family, nets: &[IpNet]) -> String {
        let name = set_name(nets);
        self.sets.entry(name.clone()).or_insert_with(|| Set::nets(family, nets.iter().copied()));
        name
    }
}

/// The statements of the rules matching `m` in direction `dir`: one rule,
/// or one per family when its peers are addresses.
fn match_stmts(dir: Direction, m: &Match, names: &mut Names<'_>) -> Vec<Vec<Statement>> {
    let remote = if dir == Direction::Ingress { Addr::Src } else { Addr::Dst };
    let peers: Vec<Option<Statement>> = match &m.peers {
        Peers::Any => vec![None],
        Peers::Nets(nets) => FAMILIES
            .into_iter()
            .filter_map(|family| {
                let of_family: Vec<IpNet> = nets.iter().copied().filter(|n| Family::of_net(n) == family).collect();
                match of_family.as_slice() {
                    [] => None,
                    [one] => Some(Some(build::addr_in(remote, *one))),
                    many => Some(Some(build::addr_in_set(remote, family, &names.set(family, many)))),
                }
            })
            .collect(),
    };
    peers
        .into_iter()
        .map(|peer| {
            let mut out: Vec<Statement> = peer.into_iter().collect();
            if let Some(p) = m.proto {
                out.push(build::l4proto(p));
                if let Some((lo, hi)) = m.ports {
                    out.push(build::dport(p, lo, hi));
                }
            }
            out
        })
        .collect()
}

/// Appends the rules denying what `stmts` match (`proto`: the protocol they
/// match, if any) with `action`, counted (and logged, when the drop log is on).
fn counted_deny(
    out: &mut Vec<Rule>,
    names: &mut Names<'_>,
    (dir, origin): (Direction, &str),
    stmts: Vec<Statement>,
    proto: Option<Proto>,
    action: DenyAction,
) {
    let counter = names.counter(origin, dir, Verdict::Drop);
    if let Some(log) = names.log {
        // A rule of its own: an exceeded limit ends the rule it is in, and
        // the drop must not depend on it.
        let mut logged = stmts.clone();
        logged.push(build::under_rate_per_second(log.per_second));
        logged.push(build::log_to_group(log.group, &counter));
        out.push(Rule::new(&format!("{origin} drop log"), logged));
    }
    for (extra, verdict) in deny_endings(action, proto) {
        let text = match (action, &extra) {
            (DenyAction::Drop, _) => format!("{origin} drop"),
            (DenyAction::Reject, Some(_)) => format!("{origin} reject tcp"),
            (DenyAction::Reject, None) => format!("{origin} reject"),
        };
        let mut rule = stmts.clone();
        rule.extend(extra);
        rule.push(build::count_into(&counter));
        rule.push(verdict);
        out.push(Rule::new(&text, rule));
    }
}

/// The rules of one pod chain.
fn chain_rules(dir: Direction, c: &Chain, names: &mut Names<'_>) -> Vec<Rule> {
    let (mut out, deny) = (Vec::new(), names.deny);
    // Invalid packets are nobody's connection: nothing to answer.
    let invalid = vec![build::ct_state(&["invalid"])];
    counted_deny(&mut out, names, (dir, INVALID), invalid, None, DenyAction::Drop);
    for r in &c.rules {
        for m in &r.matches {
            for mut stmts in match_stmts(dir, m, names) {
                match r.verdict {
                    Verdict::Allow => {
                        stmts.push(build::count_into(&names.counter(&r.origin, dir, Verdict::Allow)));
                        stmts.push(build::ret());
                        out.push(Rule::new(&r.origin, stmts));
                    }
                    Verdict::Drop => {
                        let action = if r.silent { DenyAction::Drop } else { deny };
                        counted_deny(&mut out, names, (dir, &r.origin), stmts, m.proto, action)
                    }
                }
            }
        }
    }
    if c.default_deny {
        counted_deny(&mut out, names, (dir, DEFAULT_DENY), Vec::new(), None, deny);
    }
    out
}

/// One pod chain rendered: its name and rules, and the sets and counters
/// its rules use.
struct RenderedChain {
    name: String,
    rules: Vec<Rule>,
    sets: BTreeMap<String, Set>,
    counters: BTreeMap<String, CounterLabels>,
}

fn render_chain(dir: Direction, chain: &Chain, log: Option<DropLog>, deny: DenyAction) -> RenderedChain {
    let (mut sets, mut counters) = (BTreeMap::new(), BTreeMap::new());
    let rules = chain_rules(dir, chain, &mut Names { sets: &mut sets, counters: &mut counters, log, deny });
    let ids: String = rules.iter().map(|r| r.id()).collect();
    let tag = if dir == Direction::Ingress { "in" } else { "eg" };
    RenderedChain { name: format!("{OWNER}-{tag}-{}", digest(&ids)), rules, sets, counters }
}

/// The directions of a pod, as the two dispatch maps order them.
const DIRECTIONS: [Direction; 2] = [Direction::Egress, Direction::Ingress];

fn chain_of(p: &PodPolicy, dir: Direction) -> Option<&Chain> {
    match dir {
        Direction::Egress => p.egress.as_ref(),
        Direction::Ingress => p.ingress.as_ref(),
    }
}

/// A pod as last rendered: its policy and the names of its chains.
struct RenderedPod {
    policy: Arc<PodPolicy>,
    chains: [Option<String>; 2],
}

/// A chain in the rendered state: how many pod directions jump to it, the
/// contents it was rendered from, and the sets and counters its rules use.
struct ChainUse {
    refs: usize,
    dir: usize,
    contents: Vec<Chain>,
    sets: Vec<String>,
    counters: Vec<String>,
}

/// The base chain on the input hook: what a local pod sends to its own node
/// (a host-network server, the node's addresses) goes through the pod's
/// egress chain as what it sends elsewhere does through the forward one.
/// Replies are not checked (so kubelet's probes, from the node, are never
/// policed), nor is neighbour discovery (a pod's own address asking for its
/// gateway, as ARP, which no hook here sees).
fn input_chain() -> ruleset::Chain {
    let mut rules = vec![
        Rule::new(
            "replies of admitted connections",
            vec![build::ct_state(&["established", "related"]), build::accept()],
        ),
        Rule::new("neighbour discovery", vec![build::icmpv6_type_in(&build::ND_TYPES), build::accept()]),
    ];
    for family in FAMILIES {
        let (map, addr) = dispatch_map(Direction::Egress, family);
        rules.push(Rule::new("egress of local pods to this node", vec![build::addr_vmap(addr, family, map)]));
    }
    let hook = Hook { kind: ChainKind::Filter, point: HookPoint::Input, priority: FILTER };
    ruleset::Chain { hook: Some(hook), rules }
}

/// Keeps the rendered state between passes and patches it: a pod whose
/// policy is the one rendered last (the same `Arc`) costs nothing, a
/// changed pod renders only chains no pod had, and a chain, set or counter
/// leaves the state when the last pod using it does (reference counts).
/// Always equal to a render from scratch, which the incremental property
/// test holds it to.
pub struct Renderer {
    log: Option<DropLog>,
    deny: DenyAction,
    /// Shared with the caller; patched in place when the caller has let
    /// go of it, copied first otherwise.
    desired: Arc<Desired>,
    pods: HashMap<String, RenderedPod>,
    chains: HashMap<String, ChainUse>,
    /// Chain name by content, per direction. A content holds every peer
    /// address: hashed with SipHash, that was a fifth of a pass that
    /// selects a pod anew, so foldhash hashes it.
    by_content: [HashMap<Chain, String, foldhash::fast::RandomState>; 2],
    set_refs: HashMap<String, usize>,
    counter_refs: HashMap<String, usize>,
}

impl Renderer {
    /// With the drop log when `log` is set.
    pub fn new(log: Option<DropLog>) -> Self {
        let mut part = Part::new(OWNER);
        let base = Hook { kind: ChainKind::Filter, point: HookPoint::Forward, priority: FILTER };
        let mut rules = vec![Rule::new(
            "replies of admitted connections",
            vec![build::ct_state(&["established", "related"]), build::accept()],
        )];
        // Egress first: a packet between two local pods is checked as the
        // sender's egress, then as the receiver's ingress.
        for dir in DIRECTIONS {
            for family in FAMILIES {
                let (map, addr) = dispatch_map(dir, family);
                part.sets.insert(map.to_owned(), Set { kind: SetKind::AddrJumps(family), elements: BTreeMap::new() });
                let text = format!("{} of local pods", dir.as_str());
                rules.push(Rule::new(&text, vec![build::addr_vmap(addr, family, map)]));
            }
        }
        part.chains.insert(format!("{OWNER}-forward"), ruleset::Chain { hook: Some(base), rules });
        part.chains.insert(format!("{OWNER}-input"), input_chain());
        Renderer {
            log,
            deny: DenyAction::default(),
            desired: Arc::new(Desired { part, counters: BTreeMap::new() }),
            pods: HashMap::new(),
            chains: HashMap::new(),
            by_content: Default::default(),
            set_refs: HashMap::new(),
            counter_refs: HashMap::new(),
        }
    }

    /// Denies with `action` instead of the default (reject).
    pub fn with_deny_action(mut self, action: DenyAction) -> Self {
        self.deny = action;
        self
    }

    /// The kernel state for `pods` (local pods under policy).
    pub fn render(&mut self, pods: &[Arc<PodPolicy>]) -> Arc<Desired> {
        let mut desired = std::mem::replace(&mut self.desired, Arc::new(Desired::empty()));
        let d = Arc::make_mut(&mut desired);
        let mut next: HashMap<String, RenderedPod> = HashMap::with_capacity(pods.len());
        // Per direction (as DIRECTIONS), per family (as FAMILIES).
        let mut maps: [[BTreeMap<Key, Option<String>>; 2]; 2] = Default::default();
        // Released only once every pod has taken what it uses: a chain that
        // moves from one pod to another never leaves the state.
        let mut released: Vec<String> = Vec::new();
        for p in pods {
            let chains = match self.pods.remove(&p.key) {
                Some(last) if Arc::ptr_eq(&last.policy, p) => last.chains,
                last => {
                    released.extend(last.into_iter().flat_map(|l| l.chains).flatten());
                    DIRECTIONS.map(|dir| chain_of(p, dir).map(|chain| self.acquire(d, dir, chain)))
                }
            };
            for (by_family, name) in maps.iter_mut().zip(&chains) {
                let Some(name) = name else { continue };
                for ip in &p.ips {
                    let family = usize::from(Family::of(*ip) == Family::V6);
                    by_family[family].insert(Key::addr(*ip), Some(name.clone()));
                }
            }
            let replaced = next.insert(p.key.clone(), RenderedPod { policy: Arc::clone(p), chains });
            released.extend(replaced.into_iter().flat_map(|r| r.chains).flatten());
        }
        released.extend(self.pods.drain().flat_map(|(_, gone)| gone.chains).flatten());
        for name in released {
            self.release(d, &name);
        }
        self.pods = next;
        for (dir, by_family) in DIRECTIONS.into_iter().zip(maps) {
            for (family, elements) in FAMILIES.into_iter().zip(by_family) {
                let (map, _) = dispatch_map(dir, family);
                d.part.sets.insert(map.to_owned(), Set { kind: SetKind::AddrJumps(family), elements });
            }
        }
        self.desired = desired;
        Arc::clone(&self.desired)
    }

    /// The name of the chain for `chain`, rendered and added to `d` when no
    /// pod had it.
    fn acquire(&mut self, d: &mut Desired, dir: Direction, chain: &Chain) -> String {
        let i = DIRECTIONS.iter().position(|x| *x == dir).unwrap_or_default();
        if let Some(name) = self.by_content[i].get(chain)
            && let Some(u) = self.chains.get_mut(name)
        {
            u.refs += 1;
            return name.clone();
        }
        let r = render_chain(dir, chain, self.log, self.deny);
        self.by_content[i].insert(chain.clone(), r.name.clone());
        if let Some(u) = self.chains.get_mut(&r.name) {
            // Other content, the same rules.
            u.refs += 1;
            u.contents.push(chain.clone());
            return r.name;
        }
        let mut u = ChainUse { refs: 1, dir: i, contents: vec![chain.clone()], sets: Vec::new(), counters: Vec::new() };
        for (name, set) in r.sets {
            *self.set_refs.entry(name.clone()).or_default() += 1;
            d.part.sets.entry(name.clone()).or_insert(set);
            u.sets.push(name);
        }
        for (name, labels) in r.counters {
            *self.counter_refs.entry(name.clone()).or_default() += 1;
            d.part.counters.insert(name.clone());
            d.counters.entry(name.clone()).or_insert(labels);
            u.counters.push(name);
        }
        self.chains.insert(r.name.clone(), u);
        d.part.chains.insert(r.name.clone(), ruleset::Chain { hook: None, rules: r.rules });
        r.name
    }

    /// One pod direction less jumps to chain `name`: the last takes it,
    /// and what only it used, out of `d`.
    fn release(&mut self, d: &mut Desired, name: &str) {
        let Some(u) = self.chains.get_mut(name) else { return };
        u.refs -= 1;
        if u.refs > 0 {
            return;
        }
        let Some(u) = self.chains.remove(name) else { return };
        d.part.chains.remove(name);
        for c in &u.contents {
            self.by_content[u.dir].remove(c);
        }
        for set in u.sets {
            if drop_ref(&mut self.set_refs, &set) {
                d.part.sets.remove(&set);
            }
        }
        for counter in u.counters {
            if drop_ref(&mut self.counter_refs, &counter) {
                d.part.counters.remove(&counter);
                d.counters.remove(&counter);
            }
        }
    }
}

/// Takes one reference to `name`; true when it was the last.
fn drop_ref(refs: &mut HashMap<String, usize>, name: &str) -> bool {
    let Some(n) = refs.get_mut(name) else { return false };
    *n -= 1;
    if *n > 0 {
        return false;
    }
    refs.remove(name);
    true
}

impl Desired {
    fn empty() -> Self {
        Desired { part: Part::new(OWNER), counters: BTreeMap::new() }
    }
}

/// The kernel state for `pods` (local pods under policy), with the drop
/// log when `log` is set, rendered from scratch.
#[cfg(test)]
pub fn render(pods: &[PodPolicy], log: Option<DropLog>) -> Desired {
    render_denying(pods, log, DenyAction::default())
}

/// [`render`] with the deny action `deny`.
#[cfg(test)]
pub fn render_denying(pods: &[PodPolicy], log: Option<DropLog>, deny: DenyAction) -> Desired {
    let pods: Vec<Arc<PodPolicy>> = pods.iter().cloned().map(Arc::new).collect();
    let mut renderer = Renderer::new(log).with_deny_action(deny);
    let desired = renderer.render(&pods);
    drop(renderer);
    Arc::unwrap_or_clone(desired)
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
