//! Compiled policy → the `policy` part of Weft's nftables table, pure.
//!
//! Layout: the base chain `policy-forward` (filter, forward hook) accepts
//! replies of admitted connections at once (conntrack), then looks a local
//! pod's address up as source in the verdict map `policy-egress` and as
//! destination in `policy-ingress`; each jumps to the pod's chain for that
//! direction. A pod chain returns what it admits (so egress and then
//! ingress are both checked) and drops the rest. An accept in Weft's chain
//! only ends Weft's chain: every other table and iptables chain on the hook
//! still sees the packet, so Weft never admits on anybody's behalf. Traffic
//! between a pod and its own node does not cross the forward hook, so
//! kubelet probes are never policed.
//!
//! Pod chains and address sets are named by a hash of their content: pods
//! with the same policy share a chain, and an update writes only the chains
//! and sets whose content changed, plus the map elements of pods whose
//! chain changed. Every rule counts into a named counter per policy,
//! direction and verdict; counters are objects of their own, so they keep
//! counting when a chain is rewritten.

use std::collections::{BTreeMap, HashMap};

use ipnet::Ipv4Net;
use nftables::stmt::Statement as NftStatement;

use super::model::{Chain, Direction, Match, Peers, PodPolicy, Verdict};
use crate::firewall::build::{self, Addr};
use crate::firewall::ruleset::{self, ChainKind, FILTER, Hook, HookPoint, Key, Part, Rule, Set, SetKind, fnv};

type Statement = NftStatement<'static>;

pub const OWNER: &str = "policy";
pub const INGRESS_MAP: &str = "policy-ingress";
pub const EGRESS_MAP: &str = "policy-egress";
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
    format!("{OWNER}-count-{dir}-{}-{:016x}", l.verdict_str(), fnv(&l.policy))
}

pub fn set_name(nets: &[Ipv4Net]) -> String {
    let text: String = nets.iter().map(|n| format!("{n},")).collect();
    format!("{OWNER}-set-{:016x}", fnv(&text))
}

/// Names counters and sets as rules need them.
struct Names<'a> {
    sets: &'a mut BTreeMap<String, Set>,
    counters: &'a mut BTreeMap<String, CounterLabels>,
    log: Option<DropLog>,
}

impl Names<'_> {
    fn counter(&mut self, policy: &str, direction: Direction, verdict: Verdict) -> String {
        let labels = CounterLabels { policy: policy.to_owned(), direction, verdict };
        let name = counter_name(&labels);
        self.counters.entry(name.clone()).or_insert(labels);
        name
    }

    fn set(&mut self, nets: &[Ipv4Net]) -> String {
        let name = set_name(nets);
        self.sets.entry(name.clone()).or_insert_with(|| Set::nets(nets.iter().copied()));
        name
    }
}

/// The statements matching `m` in direction `dir`.
fn match_stmts(dir: Direction, m: &Match, names: &mut Names<'_>) -> Vec<Statement> {
    let remote = if dir == Direction::Ingress { Addr::Src } else { Addr::Dst };
    let mut out = Vec::new();
    match &m.peers {
        Peers::Any => {}
        Peers::Nets(nets) => match nets.as_slice() {
            [one] => out.push(build::addr_in(remote, *one)),
            many => out.push(build::addr_in_set(remote, &names.set(many))),
        },
    }
    if let Some(p) = m.proto {
        out.push(build::l4proto(p));
        if let Some((lo, hi)) = m.ports {
            out.push(build::dport(p, lo, hi));
        }
    }
    out
}

/// Appends a rule dropping what `stmts` match, counted (and logged, when
/// the drop log is on).
fn counted_drop(out: &mut Vec<Rule>, names: &mut Names<'_>, dir: Direction, origin: &str, mut stmts: Vec<Statement>) {
    let counter = names.counter(origin, dir, Verdict::Drop);
    if let Some(log) = names.log {
        // A rule of its own: an exceeded limit ends the rule it is in, and
        // the drop must not depend on it.
        let mut logged = stmts.clone();
        logged.push(build::under_rate_per_second(log.per_second));
        logged.push(build::log_to_group(log.group, &counter));
        out.push(Rule::new(&format!("{origin} drop log"), logged));
    }
    stmts.push(build::count_into(&counter));
    stmts.push(build::drop());
    out.push(Rule::new(&format!("{origin} drop"), stmts));
}

/// The rules of one pod chain.
fn chain_rules(dir: Direction, c: &Chain, names: &mut Names<'_>) -> Vec<Rule> {
    let mut out = Vec::new();
    counted_drop(&mut out, names, dir, INVALID, vec![build::ct_state(&["invalid"])]);
    for r in &c.rules {
        for m in &r.matches {
            let mut stmts = match_stmts(dir, m, names);
            match r.verdict {
                Verdict::Allow => {
                    stmts.push(build::count_into(&names.counter(&r.origin, dir, Verdict::Allow)));
                    stmts.push(build::ret());
                    out.push(Rule::new(&r.origin, stmts));
                }
                Verdict::Drop => counted_drop(&mut out, names, dir, &r.origin, stmts),
            }
        }
    }
    if c.default_deny {
        counted_drop(&mut out, names, dir, DEFAULT_DENY, Vec::new());
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
    /// The pass that last used it (passes count from 1).
    used: u64,
}

fn render_chain(dir: Direction, chain: &Chain, log: Option<DropLog>) -> RenderedChain {
    let (mut sets, mut counters) = (BTreeMap::new(), BTreeMap::new());
    let rules = chain_rules(dir, chain, &mut Names { sets: &mut sets, counters: &mut counters, log });
    let ids: String = rules.iter().map(|r| r.id()).collect();
    let tag = if dir == Direction::Ingress { "in" } else { "eg" };
    RenderedChain { name: format!("{OWNER}-{tag}-{:016x}", fnv(&ids)), rules, sets, counters, used: 0 }
}

/// Renders pass after pass, keeping each pod chain rendered while some
/// pod has it: pods under the same policies have equal chains, and a
/// change renders only the chains that are new.
pub struct Renderer {
    log: Option<DropLog>,
    /// Egress chains, ingress chains.
    chains: [HashMap<Chain, RenderedChain>; 2],
    pass: u64,
}

impl Renderer {
    /// With the drop log when `log` is set.
    pub fn new(log: Option<DropLog>) -> Self {
        Renderer { log, chains: Default::default(), pass: 0 }
    }

    /// The kernel state for `pods` (local pods under policy).
    pub fn render<'p>(&mut self, pods: impl IntoIterator<Item = &'p PodPolicy>) -> Desired {
        self.pass += 1;
        let mut part = Part::new(OWNER);
        let mut counters = BTreeMap::new();
        let mut maps: [BTreeMap<Key, Option<String>>; 2] = Default::default();
        for p in pods {
            for (i, dir, chain) in [(0, Direction::Egress, &p.egress), (1, Direction::Ingress, &p.ingress)] {
                let Some(chain) = chain else { continue };
                let chains = &mut self.chains[i];
                if !chains.contains_key(chain) {
                    chains.insert(chain.clone(), render_chain(dir, chain, self.log));
                }
                let Some(rendered) = chains.get_mut(chain) else { continue };
                if rendered.used != self.pass {
                    // First use in this pass: its objects go into the part.
                    rendered.used = self.pass;
                    part.chains
                        .insert(rendered.name.clone(), ruleset::Chain { hook: None, rules: rendered.rules.clone() });
                    for (name, set) in &rendered.sets {
                        part.sets.entry(name.clone()).or_insert_with(|| set.clone());
                    }
                    for (name, labels) in &rendered.counters {
                        counters.entry(name.clone()).or_insert_with(|| labels.clone());
                    }
                }
                maps[i].insert(Key::addr(p.ip), Some(rendered.name.clone()));
            }
        }
        let pass = self.pass;
        self.chains.iter_mut().for_each(|chains| chains.retain(|_, r| r.used == pass));
        let [egress, ingress] = maps;
        part.sets.insert(EGRESS_MAP.to_owned(), Set { kind: SetKind::AddrJumps, elements: egress });
        part.sets.insert(INGRESS_MAP.to_owned(), Set { kind: SetKind::AddrJumps, elements: ingress });
        part.counters = counters.keys().cloned().collect();
        let base = Hook { kind: ChainKind::Filter, point: HookPoint::Forward, priority: FILTER };
        let rules = vec![
            Rule::new(
                "replies of admitted connections",
                vec![build::ct_state(&["established", "related"]), build::accept()],
            ),
            Rule::new("egress of local pods", vec![build::addr_vmap(Addr::Src, EGRESS_MAP)]),
            Rule::new("ingress of local pods", vec![build::addr_vmap(Addr::Dst, INGRESS_MAP)]),
        ];
        part.chains.insert(format!("{OWNER}-forward"), ruleset::Chain { hook: Some(base), rules });
        Desired { part, counters }
    }
}

/// The kernel state for `pods` (local pods under policy), with the drop
/// log when `log` is set, rendered from scratch.
#[cfg(test)]
pub fn render(pods: &[PodPolicy], log: Option<DropLog>) -> Desired {
    Renderer::new(log).render(pods)
}

#[cfg(test)]
#[path = "render_tests.rs"]
mod tests;
