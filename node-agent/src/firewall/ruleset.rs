//! The firewall's desired and observed state, and the diff between them,
//! pure: no kernel, no program runs.
//!
//! Weft owns one nftables table. Each feature (masquerade, host ports,
//! policy) owns a [`Part`] of it: every chain, set and counter whose name
//! starts with the part's owner and a dash. A diff only ever names objects
//! of its own part, so features update independently and nothing outside
//! the table is ever touched.
//!
//! Rules are recognised by their comment, which starts with a hash of the
//! rule's statements and text: the kernel prints rules back in its own
//! normal form, so comparing statements would be fragile, while the comment
//! comes back byte for byte. A rule without our hash (added by hand) makes
//! its chain differ, and the chain is rewritten.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use nftables::stmt::Statement;

/// L4 protocols Weft matches and maps on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
            Proto::Sctp => 132,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }

    /// The protocol of an IP protocol number, if it is one of these.
    pub fn from_number(n: u8) -> Option<Proto> {
        [Proto::Tcp, Proto::Udp, Proto::Sctp].into_iter().find(|p| p.number() == n)
    }

    /// From the Kubernetes API's spelling (`TCP` when absent); `None` for
    /// anything else (matches nothing).
    pub fn parse(s: Option<&str>) -> Option<Proto> {
        match s.unwrap_or("TCP") {
            "TCP" => Some(Proto::Tcp),
            "UDP" => Some(Proto::Udp),
            "SCTP" => Some(Proto::Sctp),
            _ => None,
        }
    }

    /// From nftables' spelling.
    pub fn from_nft(s: &str) -> Option<Proto> {
        [Proto::Tcp, Proto::Udp, Proto::Sctp].into_iter().find(|p| p.as_str() == s)
    }
}

impl From<weft_api::Protocol> for Proto {
    fn from(p: weft_api::Protocol) -> Self {
        match p {
            weft_api::Protocol::Tcp => Proto::Tcp,
            weft_api::Protocol::Udp => Proto::Udp,
            weft_api::Protocol::Sctp => Proto::Sctp,
        }
    }
}

/// Where a base chain hooks in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookPoint {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainKind {
    Filter,
    Nat,
}

/// A base chain's hook: its packets come from the kernel, not from a jump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    pub kind: ChainKind,
    pub point: HookPoint,
    pub priority: i32,
}

/// nftables' named priorities.
pub const DSTNAT: i32 = -100;
pub const FILTER: i32 = 0;
pub const SRCNAT: i32 = 100;

/// nftables keeps at most 128 bytes of a rule comment.
const MAX_COMMENT: usize = 128;

/// One rule: statements and the comment that identifies it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub stmts: Vec<Statement<'static>>,
    /// `<32 hex digits of digest> <text>`, within nftables' limit.
    pub comment: String,
}

impl Rule {
    /// `text` says what the rule is for; anything but printable ASCII
    /// becomes `_` (names are validated where they enter, but a comment is
    /// no place to carry anything else).
    pub fn new(text: &str, stmts: Vec<Statement<'static>>) -> Rule {
        let body = serde_json::to_string(&stmts).unwrap_or_default();
        let safe: String = text.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '_' }).collect();
        let mut comment = format!("{} {safe}", digest(&format!("{body}\n{safe}")));
        comment.truncate(MAX_COMMENT);
        Rule { stmts, comment }
    }

    pub fn id(&self) -> &str {
        rule_id(&self.comment)
    }
}

fn rule_id(comment: &str) -> &str {
    comment.get(..DIGEST_HEX).filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit())).unwrap_or("")
}

/// Hex digits of a [`digest`].
const DIGEST_HEX: usize = crate::stable_hash::DIGEST_HEX;

pub use crate::stable_hash::digest;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chain {
    pub hook: Option<Hook>,
    pub rules: Vec<Rule>,
}

/// The address family of an address match, set or map. Weft's table is
/// `inet`: a match on one family's header never matches the other's packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: IpAddr) -> Family {
        if ip.is_ipv4() { Family::V4 } else { Family::V6 }
    }

    pub fn of_net(n: &IpNet) -> Family {
        Family::of(n.addr())
    }

    /// nftables' name of the family's header (`ip saddr`, `ip6 saddr`).
    pub fn header(self) -> &'static str {
        match self {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        }
    }

    /// nftables' type of the family's addresses.
    pub fn addr_type(self) -> &'static str {
        match self {
            Family::V4 => "ipv4_addr",
            Family::V6 => "ipv6_addr",
        }
    }

    pub fn from_addr_type(t: &str) -> Option<Family> {
        [Family::V4, Family::V6].into_iter().find(|f| f.addr_type() == t)
    }
}

/// The nftables family of one of Weft's tables: `inet` for everything
/// routed, `bridge` for what pods send into the node's bridge.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TableFamily {
    #[default]
    Inet,
    Bridge,
}

impl TableFamily {
    pub fn name(self) -> &'static str {
        match self {
            TableFamily::Inet => "inet",
            TableFamily::Bridge => "bridge",
        }
    }

    /// The family number nf_tables messages carry.
    pub fn nfproto(self) -> u8 {
        match self {
            TableFamily::Inet => libc::NFPROTO_INET as u8,
            TableFamily::Bridge => libc::NFPROTO_BRIDGE as u8,
        }
    }
}

/// An interface name as nftables' `ifname` type holds it: IFNAMSIZ bytes,
/// the name and NUL padding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IfName([u8; 16]);

impl IfName {
    /// `None` for a name the kernel would not take (empty, over 15 bytes,
    /// or with a NUL, a slash or white space in it).
    pub fn new(name: &str) -> Option<IfName> {
        let ok = !name.is_empty() && name.len() < 16 && name.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
        ok.then(|| {
            let mut bytes = [0; 16];
            bytes[..name.len()].copy_from_slice(name.as_bytes());
            IfName(bytes)
        })
    }

    pub fn as_str(&self) -> &str {
        let len = self.0.iter().position(|b| *b == 0).unwrap_or(16);
        std::str::from_utf8(&self.0[..len]).unwrap_or_default()
    }

    /// The bytes the kernel compares.
    pub fn bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl std::fmt::Debug for IfName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

/// The fields of a set keyed by an interface: its name, then optionally
/// a MAC and an address (`ifname . ether_addr . ipv4_addr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortFields {
    pub mac: bool,
    pub addr: Option<Family>,
}

impl PortFields {
    /// nftables' names of the fields' types, in order.
    pub fn types(self) -> Vec<&'static str> {
        let mut t = vec!["ifname"];
        if self.mac {
            t.push("ether_addr");
        }
        t.extend(self.addr.map(Family::addr_type));
        t
    }

    pub fn from_types(types: &[&str]) -> Option<PortFields> {
        let (first, rest) = types.split_first()?;
        if *first != "ifname" {
            return None;
        }
        let (mac, rest) = match rest.split_first() {
            Some((&"ether_addr", rest)) => (true, rest),
            _ => (false, rest),
        };
        let addr = match rest {
            [] => None,
            [t] => Some(Family::from_addr_type(t)?),
            _ => return None,
        };
        Some(PortFields { mac, addr })
    }
}

/// One element of a set keyed by an interface (see [`PortFields`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    pub iface: IfName,
    pub mac: Option<[u8; 6]>,
    pub addr: Option<IpAddr>,
}

impl PortKey {
    pub fn fields(&self) -> PortFields {
        PortFields { mac: self.mac.is_some(), addr: self.addr.map(Family::of) }
    }
}

/// What a set holds and, for a verdict map, what its values are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetKind {
    /// Addresses and prefixes of one family (an interval set).
    Nets(Family),
    /// Interfaces, with a MAC and an address each if the fields say so
    /// (an exact-match set).
    Ports(PortFields),
    /// `protocol . port` → jump to a chain.
    PortJumps,
    /// An address of one family → jump to a chain.
    AddrJumps(Family),
}

impl SetKind {
    /// Whether nftables calls it a map (deleted and flushed as one).
    pub fn is_map(self) -> bool {
        !matches!(self, SetKind::Nets(_) | SetKind::Ports(_))
    }
}

/// One element's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Net(IpNet),
    ProtoPort(Proto, u16),
    Port(PortKey),
}

impl Key {
    pub fn addr(ip: IpAddr) -> Key {
        Key::Net(IpNet::from(ip))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub kind: SetKind,
    /// Key → the chain a verdict map jumps to (`None` in a plain set).
    pub elements: BTreeMap<Key, Option<String>>,
}

impl Set {
    /// A set of `family`'s nets (the caller passes only nets of it).
    pub fn nets(family: Family, nets: impl IntoIterator<Item = IpNet>) -> Set {
        Set { kind: SetKind::Nets(family), elements: nets.into_iter().map(|n| (Key::Net(n.trunc()), None)).collect() }
    }
}

/// Everything one feature wants in Weft's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Prefix of every name in the part (`<owner>-…`).
    pub owner: &'static str,
    pub chains: BTreeMap<String, Chain>,
    pub sets: BTreeMap<String, Set>,
    /// Named counters (rules count into them by name).
    pub counters: BTreeSet<String>,
}

impl Part {
    pub fn new(owner: &'static str) -> Part {
        Part { owner, chains: BTreeMap::new(), sets: BTreeMap::new(), counters: BTreeSet::new() }
    }

    /// `<owner>-<suffix>`: the name of one of this part's objects.
    pub fn name(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.owner)
    }

    /// The part as the kernel shows it once applied (tests compare states
    /// with it; the engine tracks its writes with [`Observed::apply`]).
    #[cfg(test)]
    pub fn as_observed(&self) -> Observed {
        Observed {
            chains: self
                .chains
                .iter()
                .map(|(n, c)| {
                    (
                        n.clone(),
                        ObservedChain { hook: c.hook, rule_ids: c.rules.iter().map(|r| r.id().to_owned()).collect() },
                    )
                })
                .collect(),
            sets: self
                .sets
                .iter()
                .map(|(n, s)| {
                    (
                        n.clone(),
                        ObservedSet {
                            kind: Some(s.kind),
                            elements: s.elements.clone(),
                            unreadable: 0,
                            is_map: s.kind.is_map(),
                        },
                    )
                })
                .collect(),
            counters: self.counters.iter().map(|c| (c.clone(), Count::default())).collect(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObservedChain {
    pub hook: Option<Hook>,
    /// Each rule's id ("" for a rule that is not ours).
    pub rule_ids: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObservedSet {
    /// None: a type Weft never makes.
    pub kind: Option<SetKind>,
    pub elements: BTreeMap<Key, Option<String>>,
    /// Elements in a form Weft never writes (so the set is flushed and refilled).
    pub unreadable: usize,
    /// A map, not a set (what nftables needs to be told to delete it).
    pub is_map: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub packets: u64,
    pub bytes: u64,
}

/// What Weft's table holds (of one part, once [`Observed::of`] filtered it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub chains: BTreeMap<String, ObservedChain>,
    pub sets: BTreeMap<String, ObservedSet>,
    pub counters: BTreeMap<String, Count>,
}

impl Observed {
    /// The state after `ops` were committed: what an engine knows the
    /// kernel holds after a write, at the cost of the write's size, not of
    /// the part's.
    pub fn apply(&mut self, ops: &[Op]) {
        for op in ops {
            match op {
                Op::AddChain(name, hook) => {
                    self.chains.insert(name.clone(), ObservedChain { hook: *hook, rule_ids: Vec::new() });
                }
                Op::FlushChain(name) => {
                    if let Some(c) = self.chains.get_mut(name) {
                        c.rule_ids.clear();
                    }
                }
                Op::DeleteChain(name) => {
                    self.chains.remove(name);
                }
                Op::AddRule(name, rule) => {
                    self.chains.entry(name.clone()).or_default().rule_ids.push(rule.id().to_owned());
                }
                Op::AddSet(name, kind) => {
                    let set = ObservedSet { kind: Some(*kind), is_map: kind.is_map(), ..Default::default() };
                    self.sets.insert(name.clone(), set);
                }
                Op::FlushSet(name, _) => {
                    if let Some(s) = self.sets.get_mut(name) {
                        s.elements.clear();
                        s.unreadable = 0;
                    }
                }
                Op::DeleteSet(name, _) => {
                    self.sets.remove(name);
                }
                Op::AddElements(name, elems) => {
                    self.sets.entry(name.clone()).or_default().elements.extend(elems.iter().cloned());
                }
                Op::DeleteElements(name, _, keys) => {
                    if let Some(s) = self.sets.get_mut(name) {
                        keys.iter().for_each(|k| {
                            s.elements.remove(k);
                        });
                    }
                }
                Op::AddCounter(name) => {
                    self.counters.insert(name.clone(), Count::default());
                }
                Op::DeleteCounter(name) => {
                    self.counters.remove(name);
                }
            }
        }
    }

    /// Only the objects of `owner`'s part.
    pub fn of(mut self, owner: &str) -> Observed {
        let prefix = format!("{owner}-");
        self.chains.retain(|n, _| n.starts_with(&prefix));
        self.sets.retain(|n, _| n.starts_with(&prefix));
        self.counters.retain(|n, _| n.starts_with(&prefix));
        self
    }
}

/// One step of a transaction, in the order it must run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    AddChain(String, Option<Hook>),
    FlushChain(String),
    DeleteChain(String),
    AddRule(String, Rule),
    AddSet(String, SetKind),
    /// Name, and whether it is a map.
    FlushSet(String, bool),
    DeleteSet(String, bool),
    AddElements(String, Vec<(Key, Option<String>)>),
    /// Name, whether it is a map, the keys.
    DeleteElements(String, bool, Vec<Key>),
    AddCounter(String),
    DeleteCounter(String),
}

/// The ops turning `have` into `want`, empty when they already match.
/// Order: new sets, counters and chains first (rules and elements may name
/// them); changed chains flushed and refilled; stale elements out and new
/// ones in (a changed element is both, side by side); then stale chains,
/// sets and counters, which nothing names any more, are deleted.
pub fn diff(have: &Observed, want: &Part) -> Vec<Op> {
    let mut create = Vec::new();
    let mut unlink = Vec::new();
    let mut fill = Vec::new();
    let mut link = Vec::new();
    let mut remove = Vec::new();

    for (name, set) in &want.sets {
        let current = have.sets.get(name);
        let elements = match current {
            Some(h) if h.kind == Some(set.kind) && h.unreadable == 0 => &h.elements,
            Some(h) if h.kind == Some(set.kind) => {
                fill.push(Op::FlushSet(name.clone(), h.is_map));
                &BTreeMap::new()
            }
            Some(h) => {
                // A set of another type under our name cannot be retyped in
                // place: it goes and comes back (only tampering gets here).
                create.push(Op::DeleteSet(name.clone(), h.is_map));
                create.push(Op::AddSet(name.clone(), set.kind));
                &BTreeMap::new()
            }
            None => {
                create.push(Op::AddSet(name.clone(), set.kind));
                &BTreeMap::new()
            }
        };
        // Most sets are as they were: one walk of both in order tells,
        // a fraction of a lookup per element.
        if *elements == set.elements {
            continue;
        }
        let gone: Vec<Key> = elements.iter().filter(|(k, v)| set.elements.get(k) != Some(v)).map(|(k, _)| *k).collect();
        let new: Vec<(Key, Option<String>)> =
            set.elements.iter().filter(|(k, v)| elements.get(k) != Some(v)).map(|(k, v)| (*k, v.clone())).collect();
        if !gone.is_empty() {
            unlink.push(Op::DeleteElements(name.clone(), set.kind.is_map(), gone));
        }
        if !new.is_empty() {
            link.push(Op::AddElements(name.clone(), new));
        }
    }
    for (name, h) in have.sets.iter().filter(|(n, _)| !want.sets.contains_key(*n)) {
        remove.push(Op::DeleteSet(name.clone(), h.is_map));
    }

    for name in want.counters.iter().filter(|c| !have.counters.contains_key(*c)) {
        create.push(Op::AddCounter(name.clone()));
    }
    for name in have.counters.keys().filter(|c| !want.counters.contains(*c)) {
        remove.push(Op::DeleteCounter(name.clone()));
    }

    for (name, chain) in &want.chains {
        let ids = || chain.rules.iter().map(Rule::id);
        match have.chains.get(name) {
            Some(h) if h.hook == chain.hook && h.rule_ids.iter().map(String::as_str).eq(ids()) => continue,
            Some(h) if h.hook == chain.hook => fill.push(Op::FlushChain(name.clone())),
            Some(_) => {
                // A hook cannot be changed in place: the chain is made anew
                // (a base chain: no rule jumps to it).
                create.push(Op::FlushChain(name.clone()));
                create.push(Op::DeleteChain(name.clone()));
                fill.push(Op::AddChain(name.clone(), chain.hook));
            }
            // A base chain is made right before its rules, in their
            // transaction (it never hooks in empty, whatever other chains
            // are written in between); a regular one first (rules jump to it).
            None if chain.hook.is_some() => fill.push(Op::AddChain(name.clone(), chain.hook)),
            None => create.push(Op::AddChain(name.clone(), chain.hook)),
        }
        fill.extend(chain.rules.iter().map(|r| Op::AddRule(name.clone(), r.clone())));
    }
    let stale: Vec<&String> = have.chains.keys().filter(|n| !want.chains.contains_key(*n)).collect();
    // All stale chains are emptied before any is deleted: one may jump to another.
    let mut drop_chains: Vec<Op> = stale.iter().map(|n| Op::FlushChain((*n).clone())).collect();
    drop_chains.extend(stale.iter().map(|n| Op::DeleteChain((*n).clone())));
    remove.splice(0..0, drop_chains);

    // Elements out and in next to each other, so that a key whose value
    // changes is replaced in one transaction, never missing in between.
    let mut ops = create;
    ops.extend(fill);
    ops.extend(unlink);
    ops.extend(link);
    ops.extend(remove);
    ops
}

#[cfg(test)]
#[path = "ruleset_tests.rs"]
mod tests;
