//! Building blocks of Weft's rules as typed nftables statements, so that
//! parts read like the rules they make (`ip saddr 10.244.1.0/24`, `dnat
//! ip to …`) and nothing is ever rendered into nft's text language.

use std::collections::HashSet;
use std::net::IpAddr;

use ipnet::IpNet;
use nftables::expr::{
    BinaryOperation, Expression, Fib, FibFlag, FibResult, Meta, MetaKey, NamedExpression, Payload, PayloadBase,
    PayloadField, PayloadRaw, Range,
};
use nftables::stmt::{self, Counter, Mangle, Match, NAT, NATFamily, NATFlag, Operator, Statement};
use nftables::types::RejectCode;

use super::nft::net_expr;
use super::ruleset::{Family, Proto};

fn field(protocol: &'static str, name: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(PayloadField {
        protocol: protocol.into(),
        field: name.into(),
    })))
}

fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn is(left: Expression<'static>, op: Operator, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(Match { left, right, op })
}

fn set_ref(name: &str) -> Expression<'static> {
    Expression::String(format!("@{name}").into())
}

/// Source (`src`) or destination address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Addr {
    Src,
    Dst,
}

impl Addr {
    fn expr(self, family: Family) -> Expression<'static> {
        field(family.header(), if self == Addr::Src { "saddr" } else { "daddr" })
    }
}

/// `ip|ip6 saddr|daddr <net>`, by the net's family.
pub fn addr_in(a: Addr, net: impl Into<IpNet>) -> Statement<'static> {
    let net = net.into();
    is(a.expr(Family::of_net(&net)), Operator::EQ, net_expr(net))
}

/// `ip|ip6 saddr|daddr @<set>` (a set of `family`).
pub fn addr_in_set(a: Addr, family: Family, set: &str) -> Statement<'static> {
    is(a.expr(family), Operator::EQ, set_ref(set))
}

/// `<p> dport <lo>[-<hi>]` (after a protocol match).
pub fn dport(p: Proto, lo: u16, hi: u16) -> Statement<'static> {
    let right = if lo == hi {
        Expression::Number(u32::from(lo))
    } else {
        Expression::Range(Box::new(Range {
            range: [Expression::Number(u32::from(lo)), Expression::Number(u32::from(hi))],
        }))
    };
    is(field(p.as_str(), "dport"), Operator::EQ, right)
}

/// `ct state <states…>` (e.g. `established`, `related`, `invalid`).
pub fn ct_state(states: &[&'static str]) -> Statement<'static> {
    let ct =
        Expression::Named(NamedExpression::CT(nftables::expr::CT { key: "state".into(), family: None, dir: None }));
    let right = match states {
        [one] => Expression::String((*one).into()),
        many => Expression::List(many.iter().map(|s| Expression::String((*s).into())).collect()),
    };
    is(ct, Operator::IN, right)
}

/// `ip|ip6 saddr|daddr vmap @<map>` (a map keyed by `family`'s addresses).
pub fn addr_vmap(a: Addr, family: Family, map: &str) -> Statement<'static> {
    Statement::VerdictMap(stmt::VerdictMap { key: a.expr(family), data: set_ref(map) })
}

/// `meta l4proto <p>`.
pub fn l4proto(p: Proto) -> Statement<'static> {
    is(meta(MetaKey::L4proto), Operator::EQ, Expression::String(p.as_str().into()))
}

/// `fib daddr type local`: the destination is one of this node's addresses.
pub fn to_local_address() -> Statement<'static> {
    let fib = Fib { result: FibResult::Type, flags: HashSet::from([FibFlag::Daddr]) };
    is(Expression::Named(NamedExpression::Fib(fib)), Operator::EQ, Expression::String("local".into()))
}

/// `meta l4proto . th dport vmap @<map>`.
pub fn port_vmap(map: &str) -> Statement<'static> {
    Statement::VerdictMap(stmt::VerdictMap {
        key: Expression::Named(NamedExpression::Concat(vec![meta(MetaKey::L4proto), field("th", "dport")])),
        data: set_ref(map),
    })
}

/// `meta mark set meta mark | <bits>`.
pub fn set_mark_bits(bits: u32) -> Statement<'static> {
    Statement::Mangle(Mangle {
        key: meta(MetaKey::Mark),
        value: Expression::BinaryOperation(Box::new(BinaryOperation::OR(vec![
            meta(MetaKey::Mark),
            Expression::Number(bits),
        ]))),
    })
}

/// `meta mark & <bits> == <bits>`.
pub fn has_mark_bits(bits: u32) -> Statement<'static> {
    is(
        Expression::BinaryOperation(Box::new(BinaryOperation::AND(meta(MetaKey::Mark), Expression::Number(bits)))),
        Operator::EQ,
        Expression::Number(bits),
    )
}

/// `dnat ip|ip6 to <ip>:<port>`, by the address's family (needs a protocol
/// match before it). In the inet table it does nothing to a packet of the
/// other family, which goes on to the next rule.
pub fn dnat(ip: IpAddr, port: u16) -> Statement<'static> {
    Statement::DNAT(Some(NAT {
        addr: Some(Expression::String(ip.to_string().into())),
        family: Some(if ip.is_ipv4() { NATFamily::IP } else { NATFamily::IP6 }),
        port: Some(Expression::Number(u32::from(port))),
        flags: None,
    }))
}

/// `masquerade fully-random`.
pub fn masquerade() -> Statement<'static> {
    Statement::Masquerade(Some(NAT {
        addr: None,
        family: None,
        port: None,
        flags: Some(HashSet::from([NATFlag::FullyRandom])),
    }))
}

/// `counter name <name>`.
pub fn count_into(name: &str) -> Statement<'static> {
    Statement::Counter(Counter::Named(name.to_owned().into()))
}

/// `limit rate <n>/second burst <n> packets`: matches while under the rate.
pub fn under_rate_per_second(n: u32) -> Statement<'static> {
    Statement::Limit(stmt::Limit {
        rate: n,
        rate_unit: Some("packets".into()),
        per: Some("second".into()),
        burst: Some(n),
        burst_unit: None,
        inv: None,
    })
}

/// `log prefix "<prefix>" group <group>`: a copy to whoever reads the
/// NFLOG group (nothing goes to the kernel's log).
pub fn log_to_group(group: u16, prefix: &str) -> Statement<'static> {
    let mut log = stmt::Log::new(Some(u32::from(group)));
    log.prefix = Some(prefix.to_owned().into());
    Statement::Log(Some(log))
}

pub fn accept() -> Statement<'static> {
    Statement::Accept(None)
}

pub fn drop() -> Statement<'static> {
    Statement::Drop(None)
}

/// `reject with tcp reset`: the packet is dropped and its sender gets a
/// reset (only for a rule that matches TCP).
pub fn reject_tcp_reset() -> Statement<'static> {
    Statement::Reject(Some(stmt::Reject::new(Some(stmt::RejectType::TCPReset), None)))
}

/// `reject with icmpx admin-prohibited`: the packet is dropped and its
/// sender gets ICMP (or ICMPv6) "administratively prohibited".
pub fn reject_prohibited() -> Statement<'static> {
    Statement::Reject(Some(stmt::Reject::new(Some(stmt::RejectType::ICMPX), Some(RejectCode::AdminProhibited))))
}

/// `return`: this chain admits; the caller's chain goes on.
pub fn ret() -> Statement<'static> {
    Statement::Return(None)
}

/// A field of a frame or packet, as part of a set lookup's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// The interface it came in on.
    InIface,
    /// The Ethernet source address.
    EtherSrc,
    /// An ARP packet's sender hardware address.
    ArpSenderMac,
    /// An ARP packet's sender protocol (IPv4) address.
    ArpSenderIp,
    /// The IP source address of a family.
    Src(Family),
    /// The target address of an IPv6 neighbour solicitation or
    /// advertisement (bytes 8–23 of the ICMPv6 message). nft 1.0.6 has no
    /// name for it, and refuses it in a lookup of an IPv6 set: a rule that
    /// uses it is written over netlink (`nfnl_rule`).
    NdTarget,
}

impl Field {
    fn expr(self) -> Expression<'static> {
        match self {
            Field::InIface => meta(MetaKey::Iifname),
            Field::EtherSrc => field("ether", "saddr"),
            Field::ArpSenderMac => field("arp", "saddr ether"),
            Field::ArpSenderIp => field("arp", "saddr ip"),
            Field::Src(family) => Addr::Src.expr(family),
            Field::NdTarget => Expression::Named(NamedExpression::Payload(Payload::PayloadRaw(PayloadRaw {
                base: PayloadBase::TH,
                offset: 64,
                len: 128,
            }))),
        }
    }
}

/// `<field> . <field> … @<set>`: the fields, concatenated, are in the set.
pub fn key_in_set(fields: &[Field], set: &str) -> Statement<'static> {
    let left = match fields {
        [one] => one.expr(),
        many => Expression::Named(NamedExpression::Concat(many.iter().map(|f| f.expr()).collect())),
    };
    is(left, Operator::EQ, set_ref(set))
}

/// `iifname != "<prefix>*"`: the interface's name does not start with `prefix`.
pub fn in_iface_not_prefixed(prefix: &str) -> Statement<'static> {
    is(meta(MetaKey::Iifname), Operator::NEQ, Expression::String(format!("{prefix}*").into()))
}

/// `ip6 hoplimit <n>`.
pub fn hop_limit(n: u8) -> Statement<'static> {
    is(field("ip6", "hoplimit"), Operator::EQ, Expression::Number(u32::from(n)))
}

/// `icmpv6 type { <types> }`, by nftables' names.
/// The ICMPv6 types of neighbour discovery a host sends (RFC 4861).
pub const ND_TYPES: [&str; 3] = ["nd-router-solicit", "nd-neighbor-solicit", "nd-neighbor-advert"];

pub fn icmpv6_type_in(types: &[&'static str]) -> Statement<'static> {
    is(field("icmpv6", "type"), Operator::IN, names(types))
}

/// `meta pkttype { <types> }` (`broadcast`, `multicast`, …).
pub fn pkttype_in(types: &[&'static str]) -> Statement<'static> {
    is(meta(MetaKey::Pkttype), Operator::IN, names(types))
}

/// `meta pkttype != { … }`.
pub fn pkttype_not_in(types: &[&'static str]) -> Statement<'static> {
    is(meta(MetaKey::Pkttype), Operator::NEQ, names(types))
}

fn names(items: &[&'static str]) -> Expression<'static> {
    Expression::Named(NamedExpression::Set(items.iter().map(|s| stmt_set_item(s)).collect()))
}

fn stmt_set_item(s: &'static str) -> nftables::expr::SetItem<'static> {
    nftables::expr::SetItem::Element(Expression::String(s.into()))
}

/// `goto <chain>`: the chain's verdict, or the calling base chain's policy
/// if it has none.
pub fn goto(chain: &str) -> Statement<'static> {
    Statement::Goto(stmt::JumpTarget { target: chain.to_owned().into() })
}

/// `jump <chain>`: the chain's verdict, or on to the next rule if it has none.
pub fn jump(chain: &str) -> Statement<'static> {
    Statement::Jump(stmt::JumpTarget { target: chain.to_owned().into() })
}
