//! The iptables and ipset policy engine that the nftables one replaced,
//! kept only for tests: the upgrade test creates what an earlier agent
//! left, and the policy benchmark measures it beside the nftables engine.
//!
//! Compiled policy → iptables (filter table) and ipset, pure. IPv4 only,
//! as that engine was: IPv6 peers and addresses are left out.
//!
//! Layout: FORWARD jumps once (first) to `WEFT-FORWARD`, which returns
//! replies of admitted connections at once (conntrack), then dispatches a
//! local pod's traffic by source address to its egress chain `WEFT-PE-<h>`
//! and by destination address to its ingress chain `WEFT-PI-<h>`. A pod
//! chain RETURNs what it admits (so egress and then ingress are both
//! checked, and FORWARD goes on as without Weft) and DROPs the rest. Weft
//! never ACCEPTs on anybody's behalf. Traffic between a pod and its own
//! node does not cross FORWARD, so kubelet probes are never policed.
//!
//! Chain and set names are hashes of their content: pods with the same
//! policy share a chain, and an update rewrites only the chains whose
//! content changed (plus the dispatch chain when a name changed).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use ipnet::{IpNet, Ipv4Net};

use super::model::{Chain, Direction, Match, Peers, PodPolicy, Verdict};
use crate::stable_hash::legacy::fnv1a_64;

pub const FORWARD_CHAIN: &str = "WEFT-FORWARD";
const INGRESS_PREFIX: &str = "WEFT-PI-";
const EGRESS_PREFIX: &str = "WEFT-PE-";
pub const SET_PREFIX: &str = "weft-pol-";
const JUMP_COMMENT: &str = "weft: network policy";
/// Comment prefix of every DROP rule; the word after it labels the drop counter.
pub const DROP_TAG: &str = "weft-drop";

/// What the kernel should hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// Chain → rules as `iptables-save` prints them (`-A …`), WEFT-FORWARD included.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Set → members.
    pub sets: BTreeMap<String, Vec<Ipv4Net>>,
}

pub fn set_name(nets: &[Ipv4Net]) -> String {
    let text: String = nets.iter().map(|n| format!("{n},")).collect();
    format!("{SET_PREFIX}{:016x}", fnv1a_64(text.bytes()))
}

fn comment(text: &str) -> String {
    // iptables limits comments to 256 bytes; names are ASCII.
    let t: String = text.chars().filter(|c| *c != '"').take(240).collect();
    format!("-m comment --comment \"{t}\"")
}

/// One rule line for `m`, with `chain` standing for the chain's name; None
/// when its peers are IPv6 addresses only.
fn match_line(chain: &str, dir: Direction, m: &Match, sets: &mut BTreeMap<String, Vec<Ipv4Net>>) -> Option<String> {
    let mut line = format!("-A {chain}");
    let (addr_flag, set_dir) = match dir {
        Direction::Ingress => ("-s", "src"),
        Direction::Egress => ("-d", "dst"),
    };
    let mut set_match = None;
    if let Peers::Nets(nets) = &m.peers {
        let nets: Vec<Ipv4Net> =
            nets.iter().filter_map(|n| if let IpNet::V4(n) = n { Some(*n) } else { None }).collect();
        if nets.is_empty() {
            return None;
        }
        if let [one] = nets.as_slice() {
            let _ = write!(line, " {addr_flag} {one}");
        } else {
            let name = set_name(&nets);
            sets.insert(name.clone(), nets);
            set_match = Some(format!(" -m set --match-set {name} {set_dir}"));
        }
    }
    if let Some(p) = m.proto {
        let _ = write!(line, " -p {}", p.as_str());
    }
    if let Some(s) = set_match {
        line.push_str(&s);
    }
    if let (Some(p), Some((lo, hi))) = (m.proto, m.ports) {
        if lo == hi {
            let _ = write!(line, " -m {} --dport {lo}", p.as_str());
        } else {
            let _ = write!(line, " -m {} --dport {lo}:{hi}", p.as_str());
        }
    }
    Some(line)
}

/// The rules of a pod chain, with `chain` as its name.
fn chain_lines(chain: &str, dir: Direction, c: &Chain, sets: &mut BTreeMap<String, Vec<Ipv4Net>>) -> Vec<String> {
    let mut out =
        vec![format!("-A {chain} -m conntrack --ctstate INVALID {} -j DROP", comment(&format!("{DROP_TAG} invalid")))];
    for r in &c.rules {
        let (tag, target) = match r.verdict {
            Verdict::Allow => (r.origin.clone(), "RETURN"),
            Verdict::Drop => (format!("{DROP_TAG} {}", r.origin), "DROP"),
        };
        for line in r.matches.iter().filter_map(|m| match_line(chain, dir, m, sets)) {
            out.push(format!("{line} {} -j {target}", comment(&tag)));
        }
    }
    if c.default_deny {
        out.push(format!("-A {chain} {} -j DROP", comment(&format!("{DROP_TAG} default-deny"))));
    }
    out
}

/// The kernel state for `pods` (local pods under policy).
pub fn render(pods: &[PodPolicy]) -> Desired {
    let mut d = Desired::default();
    let mut dispatch_eg = Vec::new();
    let mut dispatch_in = Vec::new();
    for p in pods {
        for (dir, chain, prefix, dispatch) in [
            (Direction::Egress, &p.egress, EGRESS_PREFIX, &mut dispatch_eg),
            (Direction::Ingress, &p.ingress, INGRESS_PREFIX, &mut dispatch_in),
        ] {
            let Some(chain) = chain else { continue };
            let mut sets = BTreeMap::new();
            let body = chain_lines("@", dir, chain, &mut sets);
            let name = format!("{prefix}{:016x}", fnv1a_64(body.join("\n").bytes()));
            d.sets.append(&mut sets);
            let rules: Vec<String> = body.iter().map(|l| l.replacen("-A @", &format!("-A {name}"), 1)).collect();
            d.chains.entry(name.clone()).or_insert(rules);
            let flag = if dir == Direction::Egress { "-s" } else { "-d" };
            for ip in p.ips.iter().filter(|ip| ip.is_ipv4()) {
                let text = comment(&format!("{} {}", p.key, dir.as_str()));
                dispatch.push(format!("-A {FORWARD_CHAIN} {flag} {ip}/32 {text} -j {name}"));
            }
        }
    }
    let mut fwd = vec![format!(
        "-A {FORWARD_CHAIN} -m conntrack --ctstate RELATED,ESTABLISHED {} -j RETURN",
        comment("weft: replies of admitted connections")
    )];
    fwd.extend(dispatch_eg);
    fwd.extend(dispatch_in);
    d.chains.insert(FORWARD_CHAIN.to_owned(), fwd);
    d
}

fn ours(chain: &str) -> bool {
    chain == FORWARD_CHAIN || chain.starts_with(INGRESS_PREFIX) || chain.starts_with(EGRESS_PREFIX)
}

/// Rules compare without quotes: iptables-save quotes a comment only when it must.
fn norm(rule: &str) -> String {
    rule.trim_end().replace('"', "")
}

/// A DROP rule's packet counter, as read from `iptables-save -c`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropCounter {
    /// Chain and rule: identifies the counter across reads.
    pub rule: String,
    /// The word after `weft-drop`: a Weft policy, `default-deny` or `invalid`.
    pub policy: String,
    pub direction: Direction,
    pub packets: u64,
}

/// What of ours the filter table holds.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Current {
    /// Our chains → rules (normalised).
    pub chains: BTreeMap<String, Vec<String>>,
    /// Jumps from FORWARD to WEFT-FORWARD, as printed.
    pub jumps: Vec<String>,
    /// Whether our jump is FORWARD's first rule.
    pub jump_first: bool,
    pub drops: Vec<DropCounter>,
}

/// Parses `iptables-save [-c] -t filter`.
pub fn parse_save(save: &str) -> Current {
    let mut cur = Current::default();
    let jump_suffix = format!("-j {FORWARD_CHAIN}");
    let mut forward_rules = 0;
    for raw in save.lines() {
        let (packets, line) = match raw.strip_prefix('[').and_then(|r| r.split_once("] ")) {
            Some((counts, rest)) => (counts.split(':').next().and_then(|p| p.parse().ok()).unwrap_or(0), rest),
            None => (0, raw),
        };
        if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or_default();
            if ours(name) {
                cur.chains.entry(name.to_owned()).or_default();
            }
            continue;
        }
        let Some(rest) = line.strip_prefix("-A ") else { continue };
        let chain = rest.split_whitespace().next().unwrap_or_default();
        if chain == "FORWARD" {
            forward_rules += 1;
            if line.trim_end().ends_with(&jump_suffix) {
                cur.jump_first |= forward_rules == 1;
                cur.jumps.push(line.trim_end().to_owned());
            }
            continue;
        }
        if !ours(chain) {
            continue;
        }
        let rule = norm(line);
        if rule.ends_with("-j DROP")
            && let Some(tagged) = rule.split(&format!("--comment {DROP_TAG} ")).nth(1)
        {
            let direction = if chain.starts_with(EGRESS_PREFIX) { Direction::Egress } else { Direction::Ingress };
            let policy = tagged.split_whitespace().next().unwrap_or_default().to_owned();
            cur.drops.push(DropCounter { rule: rule.clone(), policy, direction, packets });
        }
        cur.chains.entry(chain.to_owned()).or_default().push(rule);
    }
    cur
}

fn jump_rule() -> String {
    format!("-A FORWARD {} -j {FORWARD_CHAIN}", comment(JUMP_COMMENT))
}

/// The `iptables-restore --noflush` input turning `cur` into `want`, or
/// `None` when the table is already right. Only chains whose rules differ
/// are declared (which flushes them) and refilled; stale chains of ours are
/// flushed and deleted after the dispatch chain stopped naming them.
pub fn restore_text(cur: &Current, want: &Desired) -> Option<String> {
    let changed: Vec<(&String, &Vec<String>)> = want
        .chains
        .iter()
        .filter(|(name, rules)| {
            cur.chains
                .get(*name)
                .is_none_or(|have| have.iter().ne(rules.iter().map(|r| norm(r)).collect::<Vec<_>>().iter()))
        })
        .collect();
    let stale: Vec<&String> = cur.chains.keys().filter(|c| !want.chains.contains_key(*c)).collect();
    let jump_ok = cur.jumps.len() == 1 && cur.jump_first && norm(&cur.jumps[0]) == norm(&jump_rule());
    if changed.is_empty() && stale.is_empty() && jump_ok {
        return None;
    }
    let mut t = String::from("*filter\n");
    // Declarations first: a rule may only jump to a chain that exists.
    for (name, _) in &changed {
        let _ = writeln!(t, ":{name} - [0:0]");
    }
    for name in &stale {
        let _ = writeln!(t, ":{name} - [0:0]");
    }
    for (_, rules) in &changed {
        for r in *rules {
            t.push_str(r);
            t.push('\n');
        }
    }
    if !jump_ok {
        for j in &cur.jumps {
            t.push_str(&j.replacen("-A FORWARD", "-D FORWARD", 1));
            t.push('\n');
        }
        t.push_str(&jump_rule().replacen("-A FORWARD", "-I FORWARD 1", 1));
        t.push('\n');
    }
    for name in &stale {
        let _ = writeln!(t, "-X {name}");
    }
    t.push_str("COMMIT\n");
    Some(t)
}

/// Our sets in `ipset save` output → members (normalised: `/32` dropped).
pub fn parse_sets(save: &str) -> BTreeMap<String, Vec<String>> {
    let mut sets: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in save.lines() {
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next()) {
            (Some("create"), Some(name), _) if name.starts_with(SET_PREFIX) => {
                sets.entry(name.to_owned()).or_default();
            }
            (Some("add"), Some(name), Some(member)) if name.starts_with(SET_PREFIX) => {
                sets.entry(name.to_owned()).or_default().push(member.trim_end_matches("/32").to_owned());
            }
            _ => {}
        }
    }
    for m in sets.values_mut() {
        m.sort();
    }
    sets
}

fn members(nets: &[Ipv4Net]) -> Vec<String> {
    let mut m: Vec<String> = nets.iter().map(|n| n.to_string().trim_end_matches("/32").to_owned()).collect();
    m.sort();
    m
}

/// `ipset restore` input creating missing sets and repairing altered ones
/// (run before iptables), and the input destroying stale ones (run after).
pub fn ipset_texts(cur: &BTreeMap<String, Vec<String>>, want: &Desired) -> (Option<String>, Option<String>) {
    let mut before = String::new();
    for (name, nets) in &want.sets {
        let wanted = members(nets);
        match cur.get(name) {
            Some(have) if *have == wanted => continue,
            Some(_) => {
                let _ = writeln!(before, "flush {name}");
            }
            None => {
                let maxelem = wanted.len().max(65536);
                let _ = writeln!(before, "create {name} hash:net family inet maxelem {maxelem}");
            }
        }
        for m in &wanted {
            let _ = writeln!(before, "add {name} {m}");
        }
    }
    let after: String = cur.keys().filter(|n| !want.sets.contains_key(*n)).map(|n| format!("destroy {n}\n")).collect();
    ((!before.is_empty()).then_some(before), (!after.is_empty()).then_some(after))
}

/// Makes the kernel match `want`: sets first (rules may name them), then one
/// atomic iptables-restore, then stale sets go. Blocking.
pub fn apply(want: &Desired) -> Result<bool, crate::dataplane::exec::ExecError> {
    use super::ipset;
    use crate::dataplane::iptables;
    let (before, after) = ipset_texts(&parse_sets(&ipset::save()?), want);
    let mut wrote = false;
    if let Some(t) = before {
        ipset::restore(&t)?;
        wrote = true;
    }
    let current = parse_save(&iptables::save_counted("filter")?);
    if let Some(t) = restore_text(&current, want) {
        iptables::restore(&t)?;
        wrote = true;
    }
    if let Some(t) = after {
        ipset::restore(&t)?;
        wrote = true;
    }
    Ok(wrote)
}
