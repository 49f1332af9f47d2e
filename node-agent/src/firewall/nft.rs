//! The nftables backend: Weft's table written and read with `nft -j`, and
//! elements, address sets and deletions written over netlink (`nfnl`). The JSON is built
//! from typed objects (the `nftables` crate; where it has no type, as for
//! verdict maps, from `serde_json`), so no name or comment is ever spliced
//! into rule text.
//!
//! Why `nft` for chains, rules and sets: its JSON is the interface nftables
//! documents and keeps stable (netavark uses it too), and adding objects
//! costs about 1 ms. What nft 1.0 makes slow is anything touching elements
//! (it first reads every interval set's elements in the namespace: 58 ms
//! with 38,000 around) and deletes (16–20 ms on a large table, the cache
//! again). So elements and deletes go over netlink (`nfnl`), as do new
//! address sets (made with their elements in one transaction) and chains
//! whose rules are simple enough to encode (`nfnl_rule`: host ports,
//! policy). A commit is up to a few transactions in the diff's order, each
//! atomic.
//! Blocking (runs a program with a deadline): call from a blocking context.
//! Acts in the calling thread's network namespace.

use std::time::Duration;

use nftables::expr::{Expression, NamedExpression, Prefix};
use nftables::schema::{self, FlushObject, NfCmd, NfListObject, SetFlag, SetType, SetTypeValue};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};
use serde_json::{Value, json};

use super::ruleset::{
    ChainKind, Count, Family, Hook, HookPoint, IfName, Key, Observed, ObservedChain, ObservedSet, Op, PortFields,
    PortKey, Proto, SetKind, TableFamily,
};
use super::{Backend, FirewallError, nfnl, nfnl_rule};
use crate::dataplane::exec;

/// Weft's table (family inet, so that IPv6 can join it).
pub const TABLE: &str = "weft";
const TIMEOUT: Duration = Duration::from_secs(15);

/// nftables through the `nft` program.
#[derive(Debug)]
pub struct Nft {
    family: TableFamily,
    table: String,
    netlink: nfnl::Conn,
}

/// Weft's `inet` table.
impl Default for Nft {
    fn default() -> Self {
        Nft { family: TableFamily::Inet, table: TABLE.to_owned(), netlink: nfnl::Conn::default() }
    }
}

impl Nft {
    /// Weft's `bridge` table (frames pods send into the bridge).
    pub fn bridge() -> Self {
        Nft { family: TableFamily::Bridge, ..Nft::default() }
    }

    /// `nft -j list <what…> <family> <table>`; None when there is no table yet.
    fn list(&self, what: &[&str]) -> Result<Option<String>, FirewallError> {
        let mut args = vec!["-j", "list"];
        args.extend(what);
        args.extend([self.family.name(), &self.table]);
        let out = exec::run("nft", &args, None, TIMEOUT)?;
        if out.status.success() {
            return Ok(Some(out.stdout));
        }
        if out.stderr.contains("No such file or directory") {
            return Ok(None);
        }
        let stderr = out.stderr.trim().to_owned();
        Err(FirewallError::Nft(exec::ExecError::Failed { cmd: "nft", status: out.status, stderr }))
    }
}

impl Backend for Nft {
    fn observe(&self) -> Result<Observed, FirewallError> {
        // No table yet: nothing of ours is there.
        self.list(&["table"])?.map_or(Ok(Observed::default()), |text| parse_listing(&text))
    }

    fn counters(&self) -> Result<std::collections::BTreeMap<String, Count>, FirewallError> {
        let listing = self.list(&["counters", "table"])?;
        Ok(listing.map(|t| parse_listing(&t)).transpose()?.map(|o| o.counters).unwrap_or_default())
    }

    /// Each step of [`steps`] is one transaction, in the diff's order (new
    /// chains exist before a map element jumps to them; elements are gone
    /// before their chains go).
    fn commit(&self, ops: &[Op]) -> Result<(), FirewallError> {
        for step in steps(ops, self.family) {
            match step {
                Step::Nft(cmds) => {
                    let text = serde_json::to_string(&batch(self.family, &self.table, &cmds))
                        .map_err(FirewallError::Encode)?;
                    exec::run_ok("nft", &["-j", "-f", "-"], Some(text.as_bytes()), TIMEOUT, &[])?;
                }
                Step::Netlink(changes) => self.netlink.apply(self.family, &self.table, &changes, TIMEOUT)?,
            }
        }
        Ok(())
    }
}

fn hook_parts(h: Hook) -> (NfChainType, NfHook) {
    let kind = match h.kind {
        ChainKind::Filter => NfChainType::Filter,
        ChainKind::Nat => NfChainType::NAT,
    };
    let point = match h.point {
        HookPoint::Prerouting => NfHook::Prerouting,
        HookPoint::Input => NfHook::Input,
        HookPoint::Forward => NfHook::Forward,
        HookPoint::Output => NfHook::Output,
        HookPoint::Postrouting => NfHook::Postrouting,
    };
    (kind, point)
}

fn nf_family(f: TableFamily) -> NfFamily {
    match f {
        TableFamily::Inet => NfFamily::INet,
        TableFamily::Bridge => NfFamily::Bridge,
    }
}

fn chain<'a>(f: TableFamily, table: &'a str, name: &'a str, hook: Option<Hook>) -> schema::Chain<'a> {
    let mut c = schema::Chain { family: nf_family(f), table: table.into(), name: name.into(), ..Default::default() };
    if let Some(h) = hook {
        let (kind, point) = hook_parts(h);
        c._type = Some(kind);
        c.hook = Some(point);
        c.prio = Some(h.priority);
        c.policy = Some(NfChainPolicy::Accept);
    }
    c
}

fn net_set<'a>(f: TableFamily, table: &'a str, name: &'a str, family: Family) -> schema::Set<'a> {
    let addr_type = match family {
        Family::V4 => SetType::Ipv4Addr,
        Family::V6 => SetType::Ipv6Addr,
    };
    schema::Set {
        family: nf_family(f),
        table: table.into(),
        name: name.into(),
        set_type: SetTypeValue::Single(addr_type),
        flags: Some([SetFlag::Interval].into_iter().collect()),
        ..Default::default()
    }
}

/// nftables has no typed verdict map in the crate: the object is written as JSON.
fn verdict_map(f: TableFamily, table: &str, name: &str, key: Value) -> Value {
    json!({"map": {"family": f.name(), "table": table, "name": name, "type": key, "map": "verdict"}})
}

/// A set keyed by interfaces (and MACs and addresses), exact match.
fn port_set(f: TableFamily, table: &str, name: &str, fields: PortFields) -> Value {
    let types = fields.types();
    let ty = if types.len() == 1 { json!(types[0]) } else { json!(types) };
    json!({"set": {"family": f.name(), "table": table, "name": name, "type": ty}})
}

fn set_or_map(is_map: bool) -> &'static str {
    if is_map { "map" } else { "set" }
}

fn key_expr(k: &Key) -> Value {
    match k {
        Key::Net(n) if n.prefix_len() == n.max_prefix_len() => json!(n.addr().to_string()),
        Key::Net(n) => json!({"prefix": {"addr": n.addr().to_string(), "len": n.prefix_len()}}),
        Key::ProtoPort(p, port) => json!({"concat": [p.as_str(), port]}),
        Key::Port(k) => {
            let mut fields = vec![json!(k.iface.as_str())];
            fields.extend(k.mac.map(|m| json!(crate::dataplane::link::format_mac(&m))));
            fields.extend(k.addr.map(|a| json!(a.to_string())));
            if fields.len() == 1 { fields.remove(0) } else { json!({"concat": fields}) }
        }
    }
}

fn element(k: &Key, jump: Option<&String>) -> Value {
    match jump {
        Some(target) => json!([key_expr(k), {"jump": {"target": target}}]),
        None => key_expr(k),
    }
}

/// One transaction of a commit.
#[derive(Debug)]
enum Step<'a> {
    /// nft commands.
    Nft(Vec<&'a Op>),
    /// Elements, address sets, deletions, and chains whose rules netlink
    /// can carry.
    Netlink(Vec<nfnl::Change<'a>>),
}

/// `ops` as transactions. Netlink carries element changes and deletions
/// (nft would first read much of the table, every interval set's elements
/// included), new address sets, counters and regular chains whose rules
/// `nfnl_rule` encodes: no nft process per allocation, policy change or
/// pod relabelled. A new address set is made with its elements in the same
/// transaction; other additions are nft's. A chain emptied to be refilled
/// is refilled in the same transaction, so that it is never seen empty.
/// Consecutive ops of one kind share a transaction.
fn steps(ops: &[Op], family: TableFamily) -> Vec<Step<'_>> {
    let created: std::collections::HashSet<&str> = ops
        .iter()
        .filter_map(|op| match op {
            Op::AddSet(name, SetKind::Nets(_)) => Some(name.as_str()),
            _ => None,
        })
        .collect();
    let deleted: std::collections::HashSet<&str> = ops
        .iter()
        .filter_map(|op| match op {
            Op::DeleteChain(name) => Some(name.as_str()),
            _ => None,
        })
        .collect();
    // Chains whose every new rule netlink can carry (`nfnl_rule`): they are
    // made, emptied and filled over netlink, all of a chain's rules in the
    // transaction that empties it. Others stay with nft.
    let mut encoded: Vec<Option<Vec<u8>>> = vec![None; ops.len()];
    let mut by_netlink: std::collections::HashMap<&str, bool> = std::collections::HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::AddRule(chain, rule) => {
                encoded[i] = nfnl_rule::encode(rule, family);
                *by_netlink.entry(chain.as_str()).or_insert(true) &= encoded[i].is_some();
            }
            // A new base chain is made with its rules, so it never hooks in empty.
            Op::AddChain(name, Some(_)) => drop(by_netlink.insert(name.as_str(), false)),
            _ => {}
        }
    }
    let netlink_chain = |name: &str| by_netlink.get(name).copied().unwrap_or(false);
    let elements_of = |set: &str| {
        ops.iter().find_map(|op| match op {
            Op::AddElements(name, elems) if name == set && !elems.is_empty() => Some(elems.as_slice()),
            _ => None,
        })
    };
    let mut out: Vec<Step<'_>> = Vec::new();
    // Whether an nft step (which makes the table first) comes before.
    let mut nft_before = false;
    for (i, op) in ops.iter().enumerate() {
        let changes = match op {
            Op::AddSet(name, SetKind::Nets(f)) => {
                let made = nfnl::Change::AddNetSet(name, *f);
                let filled = elements_of(name).map(|elems| nfnl::Change::AddRanges(name, elems));
                std::iter::once(made).chain(filled).collect()
            }
            Op::AddChain(name, None) if netlink_chain(name) => vec![nfnl::Change::AddChain(name)],
            Op::FlushChain(name) if netlink_chain(name) => vec![nfnl::Change::FlushChain(name)],
            Op::AddRule(chain, _) if netlink_chain(chain) => {
                encoded[i].take().map(|attrs| nfnl::Change::AddRule(chain, attrs)).into_iter().collect()
            }
            Op::AddElements(name, _) if created.contains(name.as_str()) => continue, // made with its set
            Op::AddElements(name, elems) if elems.iter().all(|(k, jump)| jump.is_some() || exact(k)) => {
                vec![nfnl::Change::AddElements(name, elems)]
            }
            Op::AddElements(name, elems) if elems.iter().all(|(k, jump)| jump.is_none() && is_net(k)) => {
                vec![nfnl::Change::AddRanges(name, elems)]
            }
            Op::DeleteElements(name, is_map, keys) if *is_map || keys.iter().all(exact) => {
                vec![nfnl::Change::DeleteElements(name, keys)]
            }
            Op::DeleteElements(name, false, keys) if keys.iter().all(is_net) => {
                vec![nfnl::Change::DeleteRanges(name, keys)]
            }
            Op::FlushChain(name) if deleted.contains(name.as_str()) => vec![nfnl::Change::FlushChain(name)],
            Op::DeleteChain(name) => vec![nfnl::Change::DeleteChain(name)],
            Op::DeleteSet(name, _) => vec![nfnl::Change::DeleteSet(name)],
            Op::AddCounter(name) => vec![nfnl::Change::AddCounter(name)],
            Op::DeleteCounter(name) => vec![nfnl::Change::DeleteCounter(name)],
            _ => Vec::new(),
        };
        match (changes.is_empty(), out.last_mut()) {
            (false, Some(Step::Netlink(last))) => last.extend(changes),
            // The table may not exist yet (a part's first sync can begin
            // with a counter): made first, as every nft batch does.
            (false, _) if !nft_before => {
                out.push(Step::Netlink(std::iter::once(nfnl::Change::AddTable).chain(changes).collect()))
            }
            (false, _) => out.push(Step::Netlink(changes)),
            (true, Some(Step::Nft(cmds))) => cmds.push(op),
            (true, _) => {
                out.push(Step::Nft(vec![op]));
                nft_before = true;
            }
        }
    }
    out
}

/// A key of an interval set of addresses (written as a start and an end).
fn is_net(k: &Key) -> bool {
    matches!(k, Key::Net(_))
}

/// A key of an exact-match set: one netlink element, no interval to split.
fn exact(k: &Key) -> bool {
    matches!(k, Key::Port(_))
}

/// The nft transaction for `cmds`, after making sure the table exists
/// (`add` of an existing table is no change).
fn batch(f: TableFamily, table: &str, cmds: &[&Op]) -> Value {
    let typed = |cmd: NfCmd<'_>| serde_json::to_value(cmd).unwrap_or(Value::Null);
    let family = f.name();
    let mut out = vec![json!({"add": {"table": {"family": family, "name": table}}})];
    for op in cmds {
        out.push(match op {
            Op::AddChain(name, hook) => typed(NfCmd::Add(NfListObject::Chain(chain(f, table, name, *hook)))),
            Op::FlushChain(name) => typed(NfCmd::Flush(FlushObject::Chain(chain(f, table, name, None)))),
            Op::DeleteChain(name) => typed(NfCmd::Delete(NfListObject::Chain(chain(f, table, name, None)))),
            Op::AddRule(name, rule) => typed(NfCmd::Add(NfListObject::Rule(schema::Rule {
                family: nf_family(f),
                table: table.into(),
                chain: name.as_str().into(),
                expr: rule.stmts.as_slice().into(),
                comment: Some(rule.comment.as_str().into()),
                ..Default::default()
            }))),
            Op::AddSet(name, SetKind::Nets(family)) => {
                typed(NfCmd::Add(NfListObject::Set(Box::new(net_set(f, table, name, *family)))))
            }
            Op::AddSet(name, SetKind::PortJumps) => {
                json!({"add": verdict_map(f, table, name, json!(["inet_proto", "inet_service"]))})
            }
            Op::AddSet(name, SetKind::AddrJumps(family)) => {
                json!({"add": verdict_map(f, table, name, json!(family.addr_type()))})
            }
            Op::AddSet(name, SetKind::Ports(fields)) => json!({"add": port_set(f, table, name, *fields)}),
            Op::FlushSet(name, is_map) => {
                json!({"flush": {set_or_map(*is_map): {"family": family, "table": table, "name": name}}})
            }
            Op::DeleteSet(name, is_map) => {
                json!({"delete": {set_or_map(*is_map): {"family": family, "table": table, "name": name}}})
            }
            Op::AddElements(name, elems) => json!({"add": {"element": {
                "family": family, "table": table, "name": name,
                "elem": elems.iter().map(|(k, j)| element(k, j.as_ref())).collect::<Vec<_>>(),
            }}}),
            Op::DeleteElements(name, _, keys) => json!({"delete": {"element": {
                "family": family, "table": table, "name": name,
                "elem": keys.iter().map(key_expr).collect::<Vec<_>>(),
            }}}),
            Op::AddCounter(name) => json!({"add": {"counter": {"family": family, "table": table, "name": name}}}),
            Op::DeleteCounter(name) => {
                json!({"delete": {"counter": {"family": family, "table": table, "name": name}}})
            }
        });
    }
    json!({"nftables": out})
}

/// Reads `nft -j list table` output. Objects of unknown shape are kept as
/// "not ours" (a chain's rule without our id, a set of another type, an
/// element in another form), so a diff replaces them.
pub fn parse_listing(text: &str) -> Result<Observed, FirewallError> {
    let doc: Value = serde_json::from_str(text).map_err(FirewallError::Decode)?;
    let mut obs = Observed::default();
    let objects = doc.get("nftables").and_then(Value::as_array).cloned().unwrap_or_default();
    for obj in &objects {
        if let Some(c) = obj.get("chain") {
            let Some(name) = c.get("name").and_then(Value::as_str) else { continue };
            obs.chains.entry(name.to_owned()).or_default().hook = parse_hook(c);
        } else if let Some(r) = obj.get("rule") {
            let Some(chain) = r.get("chain").and_then(Value::as_str) else { continue };
            let comment = r.get("comment").and_then(Value::as_str).unwrap_or_default();
            let id = super::ruleset::Rule { stmts: Vec::new(), comment: comment.to_owned() }.id().to_owned();
            obs.chains.entry(chain.to_owned()).or_insert_with(ObservedChain::default).rule_ids.push(id);
        } else if let Some(s) = obj.get("set").or_else(|| obj.get("map")) {
            let Some(name) = s.get("name").and_then(Value::as_str) else { continue };
            obs.sets.insert(name.to_owned(), parse_set(s));
        } else if let Some(c) = obj.get("counter") {
            let Some(name) = c.get("name").and_then(Value::as_str) else { continue };
            let n = |k: &str| c.get(k).and_then(Value::as_u64).unwrap_or(0);
            obs.counters.insert(name.to_owned(), Count { packets: n("packets"), bytes: n("bytes") });
        }
    }
    Ok(obs)
}

fn parse_hook(c: &Value) -> Option<Hook> {
    let kind = match c.get("type")?.as_str()? {
        "filter" => ChainKind::Filter,
        "nat" => ChainKind::Nat,
        _ => return None,
    };
    let point = match c.get("hook")?.as_str()? {
        "prerouting" => HookPoint::Prerouting,
        "input" => HookPoint::Input,
        "forward" => HookPoint::Forward,
        "output" => HookPoint::Output,
        "postrouting" => HookPoint::Postrouting,
        _ => return None,
    };
    let priority = i32::try_from(c.get("prio")?.as_i64()?).ok()?;
    // A base chain whose policy is drop is not one Weft made.
    if c.get("policy").and_then(Value::as_str).is_some_and(|p| p != "accept") {
        return None;
    }
    Some(Hook { kind, point, priority })
}

fn parse_set(s: &Value) -> ObservedSet {
    let ty = s.get("type");
    let is_map = s.get("map").is_some();
    let kind = match (ty, s.get("map").and_then(Value::as_str)) {
        (Some(Value::String(t)), None) if t == "ifname" => PortFields::from_types(&[t]).map(SetKind::Ports),
        (Some(Value::String(t)), None) => Family::from_addr_type(t).map(SetKind::Nets),
        (Some(Value::Array(t)), Some("verdict")) if t.len() == 2 && t[0] == "inet_proto" && t[1] == "inet_service" => {
            Some(SetKind::PortJumps)
        }
        (Some(Value::String(t)), Some("verdict")) => Family::from_addr_type(t).map(SetKind::AddrJumps),
        (Some(Value::Array(t)), None) => {
            let types: Option<Vec<&str>> = t.iter().map(Value::as_str).collect();
            types.and_then(|t| PortFields::from_types(&t)).map(SetKind::Ports)
        }
        _ => None,
    };
    let mut out = ObservedSet { kind, is_map, ..Default::default() };
    for e in s.get("elem").and_then(Value::as_array).into_iter().flatten() {
        let parsed = if let Some(SetKind::Ports(fields)) = kind {
            parse_port_key(e, fields).map(|k| (Key::Port(k), None))
        } else if is_map {
            e.as_array().filter(|kv| kv.len() == 2).and_then(|kv| Some((parse_key(&kv[0])?, Some(parse_jump(&kv[1])?))))
        } else {
            parse_key(e).map(|k| (k, None))
        };
        match parsed {
            Some((k, v)) => {
                out.elements.insert(k, v);
            }
            None => out.unreadable += 1,
        }
    }
    out
}

fn parse_key(v: &Value) -> Option<Key> {
    if let Some(s) = v.as_str() {
        return Some(Key::addr(s.parse().ok()?));
    }
    if let Some(p) = v.get("prefix") {
        let addr = p.get("addr")?.as_str()?.parse().ok()?;
        let len = u8::try_from(p.get("len")?.as_u64()?).ok()?;
        return Some(Key::Net(ipnet::IpNet::new(addr, len).ok()?));
    }
    let parts = v.get("concat")?.as_array()?;
    let proto = match parts.first()? {
        Value::String(s) => Proto::from_nft(s)?,
        Value::Number(n) => proto_numbered(n.as_u64()?)?,
        _ => return None,
    };
    let port = u16::try_from(parts.get(1)?.as_u64()?).ok()?;
    Some(Key::ProtoPort(proto, port))
}

/// An element of a set of [`SetKind::Ports`]: a name, or a concatenation
/// of the fields.
fn parse_port_key(v: &Value, fields: PortFields) -> Option<PortKey> {
    let parts: Vec<&Value> = match v.get("concat") {
        Some(c) => c.as_array()?.iter().collect(),
        None => vec![v],
    };
    let mut parts = parts.into_iter();
    let iface = IfName::new(parts.next()?.as_str()?)?;
    let mac = match fields.mac {
        true => Some(parse_mac(parts.next()?.as_str()?)?),
        false => None,
    };
    let addr = match fields.addr {
        Some(_) => Some(parts.next()?.as_str()?.parse().ok()?),
        None => None,
    };
    let key = PortKey { iface, mac, addr };
    (parts.next().is_none() && key.fields() == fields).then_some(key)
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = s.split(':').map(|b| u8::from_str_radix(b, 16).ok()).collect::<Option<_>>()?;
    bytes.try_into().ok()
}

fn proto_numbered(n: u64) -> Option<Proto> {
    match n {
        6 => Some(Proto::Tcp),
        17 => Some(Proto::Udp),
        132 => Some(Proto::Sctp),
        _ => None,
    }
}

fn parse_jump(v: &Value) -> Option<String> {
    Some(v.get("jump")?.get("target")?.as_str()?.to_owned())
}

/// An address or prefix as an nftables expression.
pub fn net_expr(n: ipnet::IpNet) -> Expression<'static> {
    let n = n.trunc();
    if n.prefix_len() == n.max_prefix_len() {
        Expression::String(n.addr().to_string().into())
    } else {
        Expression::Named(NamedExpression::Prefix(Prefix {
            addr: Box::new(Expression::String(n.addr().to_string().into())),
            len: u32::from(n.prefix_len()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::firewall::build;
    use crate::firewall::ruleset::Rule;

    #[test]
    fn a_listing_reads_back_chains_rules_sets_maps_and_counters() {
        let text = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
          {"table": {"family": "inet", "name": "weft", "handle": 1}},
          {"counter": {"family": "inet", "name": "policy-c", "table": "weft", "handle": 4, "packets": 5000000000, "bytes": 7}},
          {"map": {"family": "inet", "name": "hostport-ports", "table": "weft", "type": ["inet_proto", "inet_service"], "handle": 5, "map": "verdict",
                   "elem": [[{"concat": ["tcp", 8080]}, {"jump": {"target": "hostport-tcp-8080"}}], [{"concat": [17, 53]}, {"jump": {"target": "x"}}]]}},
          {"set": {"family": "inet", "name": "policy-s", "table": "weft", "type": "ipv4_addr", "handle": 6, "flags": ["interval"],
                   "elem": [{"prefix": {"addr": "10.1.0.0", "len": 16}}, "10.2.0.1", {"range": ["10.3.0.1", "10.3.0.9"]}]}},
          {"chain": {"family": "inet", "table": "weft", "name": "hostport-tcp-8080", "handle": 1}},
          {"chain": {"family": "inet", "table": "weft", "name": "hostport-prerouting", "handle": 2, "type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}},
          {"rule": {"family": "inet", "table": "weft", "chain": "hostport-tcp-8080", "handle": 7, "comment": "0123456789abcdef0123456789abcdef web", "expr": []}},
          {"rule": {"family": "inet", "table": "weft", "chain": "hostport-tcp-8080", "handle": 8, "expr": []}}]}"#;
        let obs = parse_listing(text).unwrap();
        assert_eq!(obs.counters["policy-c"].packets, 5_000_000_000, "64-bit counters");
        let map = &obs.sets["hostport-ports"];
        assert_eq!(map.kind, Some(SetKind::PortJumps));
        assert_eq!(map.elements[&Key::ProtoPort(Proto::Tcp, 8080)].as_deref(), Some("hostport-tcp-8080"));
        assert_eq!(map.elements[&Key::ProtoPort(Proto::Udp, 53)].as_deref(), Some("x"));
        let set = &obs.sets["policy-s"];
        assert_eq!(set.kind, Some(SetKind::Nets(Family::V4)));
        assert!(set.elements.contains_key(&Key::Net("10.1.0.0/16".parse().unwrap())));
        assert!(set.elements.contains_key(&Key::Net("10.2.0.1/32".parse().unwrap())));
        assert_eq!(set.unreadable, 1, "a range is not a form Weft writes");
        let c = &obs.chains["hostport-tcp-8080"];
        assert_eq!(c.hook, None);
        assert_eq!(c.rule_ids, ["0123456789abcdef0123456789abcdef", ""], "a rule without our id reads as foreign");
        let base = obs.chains["hostport-prerouting"].hook.unwrap();
        assert_eq!((base.kind, base.point, base.priority), (ChainKind::Nat, HookPoint::Prerouting, -100));
    }

    #[test]
    fn ipv6_sets_and_maps_read_back_as_their_family() {
        let text = r#"{"nftables": [
          {"set": {"family": "inet", "name": "policy-s6", "table": "weft", "type": "ipv6_addr", "handle": 6, "flags": ["interval"],
                   "elem": [{"prefix": {"addr": "fd00:1::", "len": 64}}, "fd00::1"]}},
          {"map": {"family": "inet", "name": "policy-ingress6", "table": "weft", "type": "ipv6_addr", "handle": 7, "map": "verdict",
                   "elem": [["fd00::5", {"jump": {"target": "policy-in-1"}}]]}}]}"#;
        let obs = parse_listing(text).unwrap();
        let set = &obs.sets["policy-s6"];
        assert_eq!(set.kind, Some(SetKind::Nets(Family::V6)));
        assert!(set.elements.contains_key(&Key::Net("fd00:1::/64".parse().unwrap())));
        assert!(set.elements.contains_key(&Key::Net("fd00::1/128".parse().unwrap())));
        let map = &obs.sets["policy-ingress6"];
        assert_eq!(map.kind, Some(SetKind::AddrJumps(Family::V6)));
        assert_eq!(map.elements[&Key::addr("fd00::5".parse().unwrap())].as_deref(), Some("policy-in-1"));
        let ops = [
            Op::AddSet("policy-s6".into(), SetKind::Nets(Family::V6)),
            Op::AddSet("policy-ingress6".into(), SetKind::AddrJumps(Family::V6)),
        ];
        let cmds: Vec<_> = ops.iter().collect();
        let b = batch(TableFamily::Inet, "weft", &cmds);
        assert_eq!(b["nftables"][1]["add"]["set"]["type"], "ipv6_addr");
        assert_eq!(b["nftables"][2]["add"]["map"]["type"], "ipv6_addr");
        assert_eq!(key_expr(&Key::Net("fd00::1/128".parse().unwrap())), json!("fd00::1"));
    }

    #[test]
    fn port_sets_read_back_as_written_in_either_table() {
        let text = r#"{"nftables": [
          {"set": {"family": "bridge", "name": "guard-ip4", "table": "weft", "type": ["ifname", "ether_addr", "ipv4_addr"], "handle": 3,
            "elem": [{"concat": ["weftv00001", "02:00:00:00:00:0a", "10.244.1.5"]}, {"concat": ["weftv00002", "zz", "10.244.1.6"]}]}},
          {"set": {"family": "bridge", "name": "guard-nd", "table": "weft", "type": "ifname", "handle": 5, "elem": ["weftv00001"]}},
          {"set": {"family": "inet", "name": "guard-r6", "table": "weft", "type": ["ifname", "ipv6_addr"], "handle": 6,
            "elem": [{"concat": ["weftv00003", "fd00::5"]}]}}]}"#;
        let obs = parse_listing(text).unwrap();
        let ip4 = &obs.sets["guard-ip4"];
        assert_eq!(ip4.kind, Some(SetKind::Ports(PortFields { mac: true, addr: Some(Family::V4) })));
        assert_eq!(ip4.unreadable, 1, "a MAC nft would never print");
        let written = Key::Port(PortKey {
            iface: IfName::new("weftv00001").unwrap(),
            mac: Some([2, 0, 0, 0, 0, 0x0a]),
            addr: Some("10.244.1.5".parse().unwrap()),
        });
        assert!(ip4.elements.contains_key(&written));
        assert_eq!(key_expr(&written), json!({"concat": ["weftv00001", "02:00:00:00:00:0a", "10.244.1.5"]}));
        let nd = &obs.sets["guard-nd"];
        assert_eq!(nd.kind, Some(SetKind::Ports(PortFields { mac: false, addr: None })));
        assert_eq!(nd.elements.len(), 1);
        assert_eq!(obs.sets["guard-r6"].elements.len(), 1);
        let ops = [Op::AddSet("guard-nd".into(), SetKind::Ports(PortFields { mac: false, addr: None }))];
        let cmds: Vec<_> = ops.iter().collect();
        let b = batch(TableFamily::Bridge, "weft", &cmds);
        assert_eq!(b["nftables"][0], json!({"add": {"table": {"family": "bridge", "name": "weft"}}}));
        assert_eq!(b["nftables"][1]["add"]["set"]["type"], "ifname");
        // Their elements go over netlink, not through nft's cache.
        let elems = vec![(written, None)];
        let ops =
            [Op::AddElements("guard-ip4".into(), elems), Op::DeleteElements("guard-ip4".into(), false, vec![written])];
        assert!(steps(&ops, TableFamily::Bridge).iter().all(|s| matches!(s, Step::Netlink(_))));
    }

    #[test]
    fn a_batch_makes_the_table_first_and_names_only_its_own_table() {
        let ops = [
            Op::AddSet("hostport-ports".into(), SetKind::PortJumps),
            Op::AddElements(
                "hostport-ports".into(),
                vec![(Key::ProtoPort(Proto::Tcp, 80), Some("hostport-tcp-80".into()))],
            ),
            Op::DeleteElements("policy-s".into(), false, vec![Key::Net("10.0.0.0/8".parse().unwrap())]),
        ];
        let cmds: Vec<_> = ops.iter().collect();
        let b = batch(TableFamily::Inet, "weft", &cmds);
        let cmds = b["nftables"].as_array().unwrap();
        assert_eq!(cmds[0], json!({"add": {"table": {"family": "inet", "name": "weft"}}}));
        assert_eq!(cmds[1]["add"]["map"]["map"], "verdict");
        assert_eq!(
            cmds[2]["add"]["element"]["elem"],
            json!([[{"concat": ["tcp", 80]}, {"jump": {"target": "hostport-tcp-80"}}]])
        );
        assert_eq!(cmds[3]["delete"]["element"]["elem"], json!([{"prefix": {"addr": "10.0.0.0", "len": 8}}]));
        assert!(!b.to_string().contains("\"table\":\"other\""));
    }

    #[test]
    fn elements_and_address_sets_go_over_netlink_and_a_new_set_is_made_with_its_elements() {
        let jump = |c: &str| Some(c.to_owned());
        let net = |s: &str| Key::Net(s.parse().unwrap());
        let ops = vec![
            Op::AddSet("policy-set-1".into(), SetKind::Nets(Family::V4)),
            Op::AddChain("policy-in-1".into(), None),
            Op::DeleteElements("policy-ingress".into(), true, vec![net("10.0.0.9/32")]),
            // A statement netlink does not carry: the chain is nft's.
            Op::AddRule("policy-in-1".into(), Rule::new("r", vec![build::to_local_address(), build::accept()])),
            Op::DeleteElements("policy-set-0".into(), false, vec![net("10.3.0.0/16")]),
            Op::AddElements("policy-set-0".into(), vec![(net("10.4.0.1/32"), None)]),
            Op::AddElements("policy-set-1".into(), vec![(net("10.1.0.0/16"), None), (net("10.2.0.1/32"), None)]),
            Op::AddElements("policy-ingress".into(), vec![(net("10.0.0.1/32"), jump("policy-in-1"))]),
            Op::DeleteChain("policy-in-0".into()),
        ];
        let steps = steps(&ops, TableFamily::Inet);
        let kinds: Vec<String> = steps
            .iter()
            .map(|s| match s {
                Step::Nft(c) => format!("nft:{}", c.len()),
                Step::Netlink(c) => format!("netlink:{}", c.len()),
            })
            .collect();
        // The new set's elements ride with it; the other element changes
        // and the deletes go in the diff's order.
        assert_eq!(kinds, ["netlink:3", "nft:1", "netlink:1", "nft:1", "netlink:4"]);
        let Step::Netlink(first) = &steps[0] else { unreachable!() };
        assert_eq!(first[1], nfnl::Change::AddNetSet("policy-set-1", Family::V4));
        let nfnl::Change::AddRanges("policy-set-1", elems) = &first[2] else { panic!("{:?}", first[2]) };
        assert_eq!(elems.len(), 2);
        let Step::Netlink(last) = &steps[4] else { unreachable!() };
        assert!(matches!(last[0], nfnl::Change::DeleteRanges("policy-set-0", _)), "{:?}", last[0]);
        assert!(matches!(last[1], nfnl::Change::AddRanges("policy-set-0", _)), "{:?}", last[1]);
        assert!(matches!(last[2], nfnl::Change::AddElements("policy-ingress", _)), "{:?}", last[2]);
    }

    #[test]
    fn chains_of_encodable_rules_go_over_netlink_with_their_refill() {
        let dnat = || Rule::new("p", vec![build::l4proto(Proto::Tcp), build::dnat("10.0.0.5".parse().unwrap(), 80)]);
        let kinds = |ops: &[Op]| -> Vec<String> {
            steps(ops, TableFamily::Inet)
                .iter()
                .map(|s| match s {
                    Step::Nft(c) => format!("nft:{}", c.len()),
                    Step::Netlink(c) => format!("netlink:{}", c.len()),
                })
                .collect()
        };
        // A host port allocation: chain, rules, map element in one batch.
        let allocate = [
            Op::AddChain("hostport-tcp-80".into(), None),
            Op::AddRule("hostport-tcp-80".into(), dnat()),
            Op::AddElements("hostport-ports".into(), vec![(Key::ProtoPort(Proto::Tcp, 80), Some("x".into()))]),
        ];
        assert_eq!(kinds(&allocate), ["netlink:4"]);
        // Made first: the table may not exist yet. After an nft step it does.
        let first = steps(&allocate, TableFamily::Inet);
        assert!(matches!(&first[0], Step::Netlink(c) if matches!(c[0], nfnl::Change::AddTable)));
        // One rule netlink cannot carry keeps the whole refill with nft.
        let refill = [
            Op::FlushChain("c".into()),
            Op::AddRule("c".into(), dnat()),
            Op::AddRule("c".into(), Rule::new("m", vec![build::masquerade()])),
        ];
        assert_eq!(kinds(&refill), ["nft:3"]);
        // A base chain is nft's whatever its rules.
        let hook = Hook { kind: ChainKind::Nat, point: HookPoint::Prerouting, priority: -100 };
        let base = [Op::AddChain("b".into(), Some(hook)), Op::AddRule("b".into(), dnat())];
        assert_eq!(kinds(&base), ["nft:2"]);
    }
}

#[cfg(test)]
mod kernel_tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::test_support::{TestNetns, require_root};

    fn nets(list: &[&str]) -> BTreeMap<Key, Option<String>> {
        list.iter().map(|n| (Key::Net(n.parse().unwrap()), None)).collect()
    }

    /// Address sets made, filled and emptied over netlink read back through
    /// nft as written, and the kernel matches addresses by them: prefixes
    /// side by side, one reaching the top of the address space, both
    /// families, and a set nft made with its own elements.
    #[test]
    fn address_sets_written_over_netlink_list_and_match_as_nfts_own() {
        if !require_root() {
            return;
        }
        TestNetns::new().run(|| {
            let nft = Nft::default();
            let v4 = ["10.0.0.1/32", "10.0.0.2/32", "10.0.0.8/29", "10.1.0.0/16", "255.255.255.0/24"];
            let v6 = ["fd00::1/128", "fd00:1::/64", "ff00::/8"];
            let ops = [
                Op::AddSet("s4".into(), SetKind::Nets(Family::V4)),
                Op::AddSet("s6".into(), SetKind::Nets(Family::V6)),
                Op::AddSet("empty".into(), SetKind::Nets(Family::V4)),
                Op::AddElements("s4".into(), nets(&v4).into_iter().collect()),
                Op::AddElements("s6".into(), nets(&v6).into_iter().collect()),
            ];
            assert!(steps(&ops, TableFamily::Inet).iter().all(|s| matches!(s, Step::Netlink(_))));
            nft.commit(&ops).expect("made over netlink");
            let listed = || nft.observe().expect("listed");
            let seen = listed();
            assert_eq!(seen.sets["s4"].elements, nets(&v4), "{:?}", seen.sets["s4"]);
            assert_eq!(seen.sets["s6"].elements, nets(&v6));
            assert_eq!(seen.sets["s4"].kind, Some(SetKind::Nets(Family::V4)));
            assert_eq!(seen.sets["s6"].kind, Some(SetKind::Nets(Family::V6)));
            assert!(seen.sets["empty"].elements.is_empty());
            assert_eq!(seen.sets["s4"].unreadable + seen.sets["s6"].unreadable, 0);

            // The kernel's lookup: inside, at the edges, between prefixes.
            let holds = |set: &str, addr: &str| {
                exec::run("nft", &["get", "element", "inet", TABLE, set, &format!("{{ {addr} }}")], None, TIMEOUT)
                    .expect("nft get element")
                    .status
                    .success()
            };
            for (addr, inside) in [
                ("10.0.0.1", true),
                ("10.0.0.3", false),
                ("10.0.0.7", false),
                ("10.0.0.15", true),
                ("10.0.0.16", false),
                ("10.1.255.255", true),
                ("10.2.0.0", false),
                ("255.255.255.255", true),
                ("0.0.0.0", false),
            ] {
                assert_eq!(holds("s4", addr), inside, "{addr} in s4");
            }
            assert!(holds("s6", "ff02::1") && holds("s6", "fd00:1::5") && !holds("s6", "fd00::2"));

            // Out and in, one transaction, beside nft's own elements.
            let script = "add set inet weft by_nft { type ipv4_addr; flags interval; \
                          elements = { 10.9.0.1, 10.9.1.0/24 } }";
            exec::run_ok("nft", &["-f", "-"], Some(script.as_bytes()), TIMEOUT, &[]).expect("nft's set");
            let ops = [
                Op::DeleteElements(
                    "s4".into(),
                    false,
                    ["10.0.0.2/32", "255.255.255.0/24"].map(|n| Key::Net(n.parse().unwrap())).to_vec(),
                ),
                Op::DeleteElements("by_nft".into(), false, vec![Key::Net("10.9.0.1/32".parse().unwrap())]),
                Op::AddElements("s4".into(), nets(&["10.0.0.3/32", "0.0.0.0/8"]).into_iter().collect()),
                Op::AddElements("by_nft".into(), nets(&["10.9.0.2/32", "0.0.0.0/8"]).into_iter().collect()),
                Op::DeleteElements("s6".into(), false, vec![Key::Net("ff00::/8".parse().unwrap())]),
            ];
            assert!(steps(&ops, TableFamily::Inet).iter().all(|s| matches!(s, Step::Netlink(_))));
            nft.commit(&ops).expect("changed over netlink");
            let seen = listed();
            let want = ["0.0.0.0/8", "10.0.0.1/32", "10.0.0.3/32", "10.0.0.8/29", "10.1.0.0/16"];
            assert_eq!(seen.sets["s4"].elements, nets(&want));
            assert_eq!(seen.sets["by_nft"].elements, nets(&["0.0.0.0/8", "10.9.0.2/32", "10.9.1.0/24"]));
            assert_eq!(seen.sets["s6"].elements, nets(&["fd00::1/128", "fd00:1::/64"]));
            assert!(!holds("s4", "255.255.255.255") && holds("s4", "10.0.0.3") && holds("s4", "0.1.2.3"));
            assert!(!holds("by_nft", "10.9.0.1") && holds("by_nft", "10.9.0.2"));

            // An overlapping prefix is refused, and its transaction with it.
            let ops = [
                Op::AddElements("s4".into(), nets(&["10.5.0.0/16"]).into_iter().collect()),
                Op::AddElements("s4".into(), nets(&["10.1.2.0/24"]).into_iter().collect()),
            ];
            nft.commit(&ops).expect_err("an overlap");
            assert_eq!(listed().sets["s4"].elements, nets(&want), "all or nothing");
        });
    }
}
