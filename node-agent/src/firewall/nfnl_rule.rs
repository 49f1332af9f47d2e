//! Rules as nf_tables expressions, for the statements host ports and
//! NetworkPolicy rules use, so that an allocation or a policy change is one
//! netlink batch instead of an `nft` run (a process and its start-up: about
//! 4 ms, against 0.1 ms for the batch; 13 to 33 ms of a policy pass on a
//! loaded node), and for the guard's check of a neighbour advertisement's
//! target, which nft 1.0.6 cannot build (a raw payload in a lookup of an
//! IPv6 set). A rule with any other statement is `None` here and goes
//! through nft.
//!
//! The expressions are the ones nft itself emits for these statements
//! (`nft --debug=netlink`), so that nft lists the rules as it would list
//! its own; a kernel test compares the two listings.

use std::net::IpAddr;

use ipnet::IpNet;
use nftables::expr::{
    BinaryOperation, Expression, Meta, MetaKey, NamedExpression, Payload, PayloadBase, PayloadField, PayloadRaw,
};
use nftables::stmt::{Counter, Limit, Log, Mangle, Match, NAT, NATFamily, Operator, Reject, RejectType, Statement};
use nftables::types::RejectCode;

use super::nfnl::{NFTA_DATA_VALUE, NFTA_LIST_ELEM, attr, attr_str, nested};
use super::ruleset::{Proto, Rule, TableFamily};

// linux/netfilter/nf_tables.h
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFTA_META_SREG: u16 = 3;
const NFT_META_MARK: u32 = 3;
const NFT_META_NFPROTO: u32 = 15;
const NFT_META_L4PROTO: u32 = 16;
const NFT_META_IIFNAME: u32 = 6;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFT_CMP_LTE: u32 = 3;
const NFT_CMP_GTE: u32 = 5;
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFT_CT_STATE: u32 = 0;
const NFTA_REJECT_TYPE: u16 = 1;
const NFTA_REJECT_ICMP_CODE: u16 = 2;
const NFT_REJECT_TCP_RST: u32 = 1;
const NFT_REJECT_ICMPX_UNREACH: u32 = 2;
const NFT_REJECT_ICMPX_ADMIN_PROHIBITED: u8 = 3;
/// `NFT_RETURN`, a negative verdict code sent as its two's complement.
const NFT_RETURN: u32 = (-5i32).cast_unsigned();
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_LL_HEADER: u32 = 0;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_LOOKUP_SREG: u16 = 2;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
const NFTA_OBJREF_IMM_TYPE: u16 = 1;
const NFTA_OBJREF_IMM_NAME: u16 = 2;
const NFT_OBJECT_COUNTER: u32 = 1;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
const NFT_NAT_DNAT: u32 = 1;
const NFTA_LIMIT_RATE: u16 = 1;
const NFTA_LIMIT_UNIT: u16 = 2;
const NFTA_LIMIT_BURST: u16 = 3;
const NFTA_LIMIT_TYPE: u16 = 4;
const NFTA_LIMIT_FLAGS: u16 = 5;
const NFT_LIMIT_PKTS: u32 = 0;
const NFTA_LOG_GROUP: u16 = 1;
const NFTA_LOG_PREFIX: u16 = 2;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_REG_2: u32 = 2;
/// The first 32-bit register; there are 16 (`NFT_REG32_00`..`15`).
const NFT_REG32_00: u32 = 8;
const REG32_COUNT: u32 = 16;
/// libnftnl's rule comment in the rule's user data (type, length, value).
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;

/// One expression: its name and attributes.
fn expr(b: &mut Vec<u8>, name: &str, data: impl FnOnce(&mut Vec<u8>)) {
    nested(b, NFTA_LIST_ELEM, |b| {
        attr_str(b, NFTA_EXPR_NAME, name);
        nested(b, NFTA_EXPR_DATA, data);
    });
}

fn u32_attr(b: &mut Vec<u8>, ty: u16, v: u32) {
    attr(b, ty, &v.to_be_bytes());
}

fn value(b: &mut Vec<u8>, ty: u16, bytes: &[u8]) {
    nested(b, ty, |b| attr(b, NFTA_DATA_VALUE, bytes));
}

fn meta_load(b: &mut Vec<u8>, key: u32) {
    expr(b, "meta", |b| {
        u32_attr(b, NFTA_META_KEY, key);
        u32_attr(b, NFTA_META_DREG, NFT_REG_1);
    });
}

fn cmp(b: &mut Vec<u8>, op: u32, bytes: &[u8]) {
    expr(b, "cmp", |b| {
        u32_attr(b, NFTA_CMP_SREG, NFT_REG_1);
        u32_attr(b, NFTA_CMP_OP, op);
        value(b, NFTA_CMP_DATA, bytes);
    });
}

fn cmp_eq(b: &mut Vec<u8>, bytes: &[u8]) {
    cmp(b, NFT_CMP_EQ, bytes);
}

fn payload_load(b: &mut Vec<u8>, base: u32, offset: u32, len: u32) {
    expr(b, "payload", |b| {
        u32_attr(b, NFTA_PAYLOAD_DREG, NFT_REG_1);
        u32_attr(b, NFTA_PAYLOAD_BASE, base);
        u32_attr(b, NFTA_PAYLOAD_OFFSET, offset);
        u32_attr(b, NFTA_PAYLOAD_LEN, len);
    });
}

fn lookup(b: &mut Vec<u8>, set: &str) {
    expr(b, "lookup", |b| {
        attr_str(b, NFTA_LOOKUP_SET, set);
        u32_attr(b, NFTA_LOOKUP_SREG, NFT_REG_1);
    });
}

fn bitwise(b: &mut Vec<u8>, mask: &[u8], xor: &[u8]) {
    expr(b, "bitwise", |b| {
        u32_attr(b, NFTA_BITWISE_SREG, NFT_REG_1);
        u32_attr(b, NFTA_BITWISE_DREG, NFT_REG_1);
        u32_attr(b, NFTA_BITWISE_LEN, mask.len() as u32);
        value(b, NFTA_BITWISE_MASK, mask);
        value(b, NFTA_BITWISE_XOR, xor);
    });
}

fn immediate(b: &mut Vec<u8>, reg: u32, bytes: &[u8]) {
    expr(b, "immediate", |b| {
        u32_attr(b, NFTA_IMMEDIATE_DREG, reg);
        value(b, NFTA_IMMEDIATE_DATA, bytes);
    });
}

fn verdict(b: &mut Vec<u8>, code: u32) {
    expr(b, "immediate", |b| {
        u32_attr(b, NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
        nested(b, NFTA_IMMEDIATE_DATA, |b| nested(b, NFTA_DATA_VERDICT, |b| u32_attr(b, NFTA_VERDICT_CODE, code)));
    });
}

/// The register that holds data from the `at`-th 32-bit register on, as
/// nft names it: a 128-bit register when `at` starts one.
fn register(at: u32) -> u32 {
    if at.is_multiple_of(4) { NFT_REG_1 + at / 4 } else { NFT_REG32_00 + at }
}

/// What loads one field of a concatenation: a meta key or a payload
/// (base, byte offset), and the field's length in bytes.
enum Load {
    Meta(u32),
    Payload(u32, u32),
}

fn load_of(e: &Expression<'_>) -> Option<(Load, u32)> {
    match e {
        e if is_meta(e, MetaKey::Iifname) => Some((Load::Meta(NFT_META_IIFNAME), 16)),
        Expression::Named(NamedExpression::Payload(Payload::PayloadField(PayloadField { protocol, field })))
            if protocol == "ether" && field == "saddr" =>
        {
            Some((Load::Payload(NFT_PAYLOAD_LL_HEADER, 6), 6))
        }
        Expression::Named(NamedExpression::Payload(Payload::PayloadRaw(PayloadRaw { base, offset, len })))
            if offset % 8 == 0 && len % 8 == 0 && *len > 0 =>
        {
            let base = match base {
                PayloadBase::LL => NFT_PAYLOAD_LL_HEADER,
                PayloadBase::NH => NFT_PAYLOAD_NETWORK_HEADER,
                PayloadBase::TH => NFT_PAYLOAD_TRANSPORT_HEADER,
                _ => return None,
            };
            Some((Load::Payload(base, offset / 8), len / 8))
        }
        _ => None,
    }
}

/// `<field> . <field> … @<set>`: each field loaded into the registers
/// after the last one's (rounded up to 32 bits, the layout of a concatenated
/// set key), then one lookup from the first.
fn concat_in_set(b: &mut Vec<u8>, fields: &[Expression<'_>], set: &str) -> Option<()> {
    let mut at = 0;
    for f in fields {
        let (load, len) = load_of(f)?;
        let dreg = register(at);
        at += len.div_ceil(4);
        if at > REG32_COUNT {
            return None;
        }
        match load {
            Load::Meta(key) => expr(b, "meta", |b| {
                u32_attr(b, NFTA_META_KEY, key);
                u32_attr(b, NFTA_META_DREG, dreg);
            }),
            Load::Payload(base, offset) => expr(b, "payload", |b| {
                u32_attr(b, NFTA_PAYLOAD_DREG, dreg);
                u32_attr(b, NFTA_PAYLOAD_BASE, base);
                u32_attr(b, NFTA_PAYLOAD_OFFSET, offset);
                u32_attr(b, NFTA_PAYLOAD_LEN, len);
            }),
        }
    }
    // From the first register, `register(0)`.
    lookup(b, set);
    Some(())
}

/// An address's bytes and its family's `nfproto`.
fn family_bytes(ip: IpAddr) -> (u8, Vec<u8>) {
    match ip {
        IpAddr::V4(a) => (NFPROTO_IPV4, a.octets().to_vec()),
        IpAddr::V6(a) => (NFPROTO_IPV6, a.octets().to_vec()),
    }
}

/// `ip|ip6 saddr|daddr <net>` (header offset `offset`), behind nft's
/// implicit `meta nfproto ipv4|ipv6` (the table is inet). A prefix on a
/// byte boundary compares only its bytes, as nft does; another one is
/// masked first.
fn ip_addr_is(b: &mut Vec<u8>, offset: u32, net: IpNet) -> Option<()> {
    let net = net.trunc();
    let len = net.prefix_len();
    if len == 0 {
        return None;
    }
    let (nfproto, octets) = family_bytes(net.addr());
    meta_load(b, NFT_META_NFPROTO);
    cmp_eq(b, &[nfproto]);
    let whole = octets.len();
    let bytes = if len.is_multiple_of(8) { usize::from(len / 8) } else { whole };
    payload_load(b, NFT_PAYLOAD_NETWORK_HEADER, offset, bytes as u32);
    if bytes == whole && usize::from(len) < whole * 8 {
        let (_, mask) = family_bytes(net.netmask());
        bitwise(b, &mask, &vec![0; whole]);
    }
    cmp_eq(b, &octets[..bytes]);
    Some(())
}

/// `ip|ip6 saddr|daddr @<set>`, behind the same implicit `meta nfproto`.
fn ip_addr_in_set(b: &mut Vec<u8>, v6: bool, offset: u32, set: &str) {
    meta_load(b, NFT_META_NFPROTO);
    cmp_eq(b, &[if v6 { NFPROTO_IPV6 } else { NFPROTO_IPV4 }]);
    payload_load(b, NFT_PAYLOAD_NETWORK_HEADER, offset, if v6 { 16 } else { 4 });
    lookup(b, set);
}

/// The header offset of `protocol`'s `field` (`ip saddr`: 12), and whether
/// it is IPv6's.
fn ip_field(protocol: &str, field: &str) -> Option<(bool, u32)> {
    match (protocol, field) {
        ("ip", "saddr") => Some((false, 12)),
        ("ip", "daddr") => Some((false, 16)),
        ("ip6", "saddr") => Some((true, 8)),
        ("ip6", "daddr") => Some((true, 24)),
        _ => None,
    }
}

/// The bit of each conntrack state in nft's `ct state` bitmask (the
/// kernel's `NF_CT_STATE_BIT`).
fn ct_state_bit(state: &str) -> Option<u32> {
    match state {
        "invalid" => Some(1),
        "established" => Some(1 << 1),
        "related" => Some(1 << 2),
        "new" => Some(1 << 3),
        "untracked" => Some(1 << 6),
        _ => None,
    }
}

fn text<'a>(e: &'a Expression<'_>) -> Option<&'a str> {
    match e {
        Expression::String(s) => Some(s),
        _ => None,
    }
}

fn is_meta(e: &Expression<'_>, key: MetaKey) -> bool {
    matches!(e, Expression::Named(NamedExpression::Meta(Meta { key: k })) if *k == key)
}

/// The address or prefix of `e` (as `net_expr` builds them).
fn net_of(e: &Expression<'_>) -> Option<IpNet> {
    match e {
        Expression::String(s) => s.parse::<IpAddr>().ok().map(IpNet::from),
        Expression::Named(NamedExpression::Prefix(p)) => {
            IpNet::new(text(&p.addr)?.parse().ok()?, u8::try_from(p.len).ok()?).ok()
        }
        _ => None,
    }
}

/// What the statements of a rule so far tell the next one.
struct Context {
    /// The table is `inet`: IP header fields get nft's implicit `meta
    /// nfproto` match (a bridge table's would be `ether type`), and the
    /// policy statements (ports, `ct state`, reject, the drop log's limit
    /// and log) are only ever used there.
    inet: bool,
    /// The transport protocol an earlier `meta l4proto` matched. A port
    /// match or a TCP reset needs it: nft would add that match itself when
    /// it is missing, and the rule would list otherwise.
    l4: Option<Proto>,
}

/// One statement's expressions; None when it is not one of those above.
fn statement(b: &mut Vec<u8>, s: &Statement<'_>, cx: &mut Context) -> Option<()> {
    match s {
        // `ct state <states>` (as `build::ct_state` writes it): nft's flag
        // test, (state & states) != 0.
        Statement::Match(Match { left: Expression::Named(NamedExpression::CT(ct)), right, op: Operator::IN })
            if ct.key == "state" && ct.family.is_none() && ct.dir.is_none() && cx.inet =>
        {
            let states = match right {
                Expression::List(items) => items.iter().map(|e| ct_state_bit(text(e)?)).sum::<Option<u32>>()?,
                one => ct_state_bit(text(one)?)?,
            };
            expr(b, "ct", |b| {
                u32_attr(b, NFTA_CT_KEY, NFT_CT_STATE);
                u32_attr(b, NFTA_CT_DREG, NFT_REG_1);
            });
            // The state is kept in host byte order.
            bitwise(b, &states.to_ne_bytes(), &[0; 4]);
            cmp(b, NFT_CMP_NEQ, &[0; 4]);
            Some(())
        }
        Statement::Match(Match { left, right, op: Operator::EQ }) => match left {
            Expression::Named(NamedExpression::Concat(fields)) => {
                concat_in_set(b, fields, text(right)?.strip_prefix('@')?)
            }
            Expression::Named(NamedExpression::Payload(Payload::PayloadField(PayloadField { protocol, field })))
                if (protocol == "ip" || protocol == "ip6") && cx.inet =>
            {
                let (v6, offset) = ip_field(protocol, field)?;
                if let Some(set) = text(right).and_then(|r| r.strip_prefix('@')) {
                    ip_addr_in_set(b, v6, offset, set);
                    return Some(());
                }
                let net = net_of(right)?;
                if matches!(net, IpNet::V6(_)) != v6 {
                    return None;
                }
                ip_addr_is(b, offset, net)
            }
            // `tcp|udp|sctp dport <port>|<lo>-<hi>`: all three keep it at offset 2.
            Expression::Named(NamedExpression::Payload(Payload::PayloadField(PayloadField { protocol, field })))
                if field == "dport" && cx.inet =>
            {
                let proto = Proto::from_nft(protocol)?;
                let port = |e: &Expression<'_>| match e {
                    Expression::Number(n) => u16::try_from(*n).ok(),
                    _ => None,
                };
                if cx.l4 != Some(proto) {
                    return None;
                }
                match right {
                    Expression::Range(range) => {
                        // `<lo>-<hi>`: nft's two comparisons, of big-endian
                        // values (the kernel compares bytes).
                        let [lo, hi] = &range.range;
                        let (lo, hi) = (port(lo)?, port(hi)?);
                        payload_load(b, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
                        cmp(b, NFT_CMP_GTE, &lo.to_be_bytes());
                        cmp(b, NFT_CMP_LTE, &hi.to_be_bytes());
                    }
                    one => {
                        let one = port(one)?;
                        payload_load(b, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
                        cmp_eq(b, &one.to_be_bytes());
                    }
                }
                Some(())
            }
            l if is_meta(l, MetaKey::L4proto) => {
                let proto = Proto::from_nft(text(right)?)?;
                meta_load(b, NFT_META_L4PROTO);
                cmp_eq(b, &[proto.number()]);
                cx.l4 = Some(proto);
                Some(())
            }
            _ => None,
        },
        Statement::Reject(Some(Reject { _type: Some(RejectType::TCPReset), expr: None }))
            if cx.inet && cx.l4 == Some(Proto::Tcp) =>
        {
            expr(b, "reject", |b| u32_attr(b, NFTA_REJECT_TYPE, NFT_REJECT_TCP_RST));
            Some(())
        }
        Statement::Reject(Some(Reject { _type: Some(RejectType::ICMPX), expr: Some(RejectCode::AdminProhibited) }))
            if cx.inet =>
        {
            expr(b, "reject", |b| {
                u32_attr(b, NFTA_REJECT_TYPE, NFT_REJECT_ICMPX_UNREACH);
                attr(b, NFTA_REJECT_ICMP_CODE, &[NFT_REJECT_ICMPX_ADMIN_PROHIBITED]);
            });
            Some(())
        }
        Statement::Return(None) => {
            verdict(b, NFT_RETURN);
            Some(())
        }
        // `meta mark set meta mark | bits`: nft's (mark & !bits) ^ bits.
        Statement::Mangle(Mangle { key, value }) if is_meta(key, MetaKey::Mark) => {
            let Expression::BinaryOperation(op) = value else { return None };
            let BinaryOperation::OR(terms) = op.as_ref() else { return None };
            let [first, Expression::Number(bits)] = terms.as_slice() else { return None };
            if !is_meta(first, MetaKey::Mark) {
                return None;
            }
            meta_load(b, NFT_META_MARK);
            // The mark is kept in host byte order.
            bitwise(b, &(!bits).to_ne_bytes(), &bits.to_ne_bytes());
            expr(b, "meta", |b| {
                u32_attr(b, NFTA_META_KEY, NFT_META_MARK);
                u32_attr(b, NFTA_META_SREG, NFT_REG_1);
            });
            Some(())
        }
        Statement::DNAT(Some(NAT { addr: Some(addr), family: Some(family), port: Some(port), flags: None })) => {
            let ip: IpAddr = text(addr)?.parse().ok()?;
            let (nfproto, octets) = family_bytes(ip);
            let wanted = if ip.is_ipv4() { NATFamily::IP } else { NATFamily::IP6 };
            if *family != wanted {
                return None;
            }
            let Expression::Number(port) = port else { return None };
            let port = u16::try_from(*port).ok()?;
            immediate(b, NFT_REG_1, &octets);
            immediate(b, NFT_REG_2, &port.to_be_bytes());
            expr(b, "nat", |b| {
                u32_attr(b, NFTA_NAT_TYPE, NFT_NAT_DNAT);
                u32_attr(b, NFTA_NAT_FAMILY, u32::from(nfproto));
                u32_attr(b, NFTA_NAT_REG_ADDR_MIN, NFT_REG_1);
                u32_attr(b, NFTA_NAT_REG_PROTO_MIN, NFT_REG_2);
            });
            Some(())
        }
        Statement::Accept(None) => {
            verdict(b, NF_ACCEPT);
            Some(())
        }
        Statement::Drop(None) => {
            verdict(b, NF_DROP);
            Some(())
        }
        // `limit rate <n>/second burst <m> packets` (as
        // `build::under_rate_per_second` writes it).
        Statement::Limit(Limit {
            rate,
            rate_unit,
            per,
            burst: Some(burst),
            burst_unit: None,
            inv: None | Some(false),
        }) if cx.inet && rate_unit.as_deref().is_none_or(|u| u == "packets") && per.as_deref() == Some("second") => {
            expr(b, "limit", |b| {
                attr(b, NFTA_LIMIT_RATE, &u64::from(*rate).to_be_bytes());
                attr(b, NFTA_LIMIT_UNIT, &1u64.to_be_bytes());
                u32_attr(b, NFTA_LIMIT_BURST, *burst);
                u32_attr(b, NFTA_LIMIT_TYPE, NFT_LIMIT_PKTS);
                u32_attr(b, NFTA_LIMIT_FLAGS, 0);
            });
            Some(())
        }
        // `log prefix "<prefix>" group <group>` (as `build::log_to_group`
        // writes it). No snap length: the kernel would read one of 0 as
        // "copy nothing" rather than as nft's "unset".
        Statement::Log(Some(Log {
            prefix: Some(prefix),
            group: Some(group),
            snaplen: None,
            queue_threshold: None,
            level: None,
            flags: None,
        })) if cx.inet => {
            let group = u16::try_from(*group).ok()?;
            if prefix.as_bytes().contains(&0) {
                return None;
            }
            expr(b, "log", |b| {
                attr(b, NFTA_LOG_GROUP, &group.to_be_bytes());
                attr_str(b, NFTA_LOG_PREFIX, prefix);
            });
            Some(())
        }
        Statement::Counter(Counter::Named(name)) => {
            expr(b, "objref", |b| {
                u32_attr(b, NFTA_OBJREF_IMM_TYPE, NFT_OBJECT_COUNTER);
                attr_str(b, NFTA_OBJREF_IMM_NAME, name);
            });
            Some(())
        }
        _ => None,
    }
}

/// The expressions and comment of `rule`, in a table of `family`, as
/// NEWRULE attributes; None when a statement is not one this module
/// encodes.
pub fn encode(rule: &Rule, family: TableFamily) -> Option<Vec<u8>> {
    let mut b = Vec::new();
    let mut ok = true;
    nested(&mut b, NFTA_RULE_EXPRESSIONS, |b| {
        let mut cx = Context { inet: family == TableFamily::Inet, l4: None };
        ok = rule.stmts.iter().all(|s| statement(b, s, &mut cx).is_some());
    });
    if !ok {
        return None;
    }
    let mut comment = rule.comment.as_bytes().to_vec();
    comment.push(0);
    let mut udata = vec![NFTNL_UDATA_RULE_COMMENT, u8::try_from(comment.len()).ok()?];
    udata.extend(comment);
    attr(&mut b, NFTA_RULE_USERDATA, &udata);
    Some(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::firewall::build::{self, Addr, Field};
    use crate::firewall::ruleset::Family;

    #[test]
    fn host_port_statements_are_encoded_and_others_are_left_to_nft() {
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let ok = [
            vec![build::addr_in(Addr::Src, net("10.244.1.0/24")), build::set_mark_bits(0x2000)],
            vec![build::addr_in(Addr::Dst, net("192.0.2.7/32")), build::l4proto(Proto::Udp)],
            vec![build::l4proto(Proto::Tcp), build::dnat("10.244.1.5".parse().unwrap(), 8080)],
            vec![build::addr_in(Addr::Src, net("10.244.0.0/13"))],
            vec![build::addr_in(Addr::Src, net("fd00:10:244:1::/64")), build::set_mark_bits(0x2000)],
            vec![build::l4proto(Proto::Tcp), build::dnat("fd00:10:244:1::5".parse().unwrap(), 8080)],
        ];
        for stmts in ok {
            assert!(encode(&Rule::new("x", stmts.clone()), TableFamily::Inet).is_some(), "{stmts:?}");
        }
        let guard = vec![build::key_in_set(&[Field::InIface, Field::EtherSrc, Field::NdTarget], "s"), build::accept()];
        assert!(encode(&Rule::new("x", guard), TableFamily::Bridge).is_some());
        assert!(encode(&Rule::new("x", vec![build::count_into("c"), build::drop()]), TableFamily::Bridge).is_some());
        // A field nft adds a dependency for (`ip6 saddr` in a bridge table) is nft's.
        let v6 = build::key_in_set(&[Field::InIface, Field::Src(Family::V6)], "s");
        assert!(encode(&Rule::new("x", vec![v6]), TableFamily::Bridge).is_none());
        for other in [build::masquerade(), build::to_local_address()] {
            let rule = Rule::new("x", vec![build::l4proto(Proto::Tcp), other.clone()]);
            assert!(encode(&rule, TableFamily::Inet).is_none(), "{other:?}");
        }
    }

    #[test]
    fn policy_statements_are_encoded_in_an_inet_table_only_and_ports_after_their_protocol() {
        use crate::firewall::build::Addr::{Dst, Src};
        let policy = [
            vec![build::ct_state(&["established", "related"]), build::accept()],
            vec![build::ct_state(&["invalid"]), build::count_into("c"), build::drop()],
            vec![build::addr_in_set(Src, Family::V4, "peers"), build::ret()],
            vec![
                build::addr_in_set(Dst, Family::V6, "peers6"),
                build::l4proto(Proto::Udp),
                build::dport(Proto::Udp, 53, 53),
                build::count_into("c"),
                build::ret(),
            ],
            vec![build::l4proto(Proto::Tcp), build::count_into("c"), build::reject_tcp_reset()],
            vec![build::count_into("c"), build::reject_prohibited()],
            vec![build::l4proto(Proto::Tcp), build::under_rate_per_second(10), build::log_to_group(7, "c")],
            vec![build::l4proto(Proto::Tcp), build::dport(Proto::Tcp, 80, 90), build::count_into("c"), build::ret()],
        ];
        for stmts in policy {
            let rule = Rule::new("x", stmts.clone());
            assert!(encode(&rule, TableFamily::Inet).is_some(), "{stmts:?}");
            assert!(
                encode(&rule, TableFamily::Bridge).is_none(),
                "a bridge table's dependency is not nft's own: {stmts:?}"
            );
        }
        // nft would add the protocol match these need; they are left to it.
        let without_protocol = [
            vec![build::dport(Proto::Tcp, 80, 80)],
            vec![build::l4proto(Proto::Udp), build::dport(Proto::Tcp, 80, 80)],
            vec![build::l4proto(Proto::Udp), build::reject_tcp_reset()],
        ];
        for stmts in without_protocol {
            assert!(encode(&Rule::new("x", stmts.clone()), TableFamily::Inet).is_none(), "{stmts:?}");
        }
    }

    #[test]
    fn a_prefix_off_a_byte_boundary_is_masked_and_the_comment_is_user_data() {
        let rule = Rule::new("pod a", vec![build::addr_in(Addr::Src, "10.240.0.0/12".parse::<IpNet>().unwrap())]);
        let bytes = encode(&rule, TableFamily::Inet).unwrap();
        let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"bitwise\0") && has(&[255, 240, 0, 0]), "mask 255.240.0.0");
        let mut comment = vec![NFTNL_UDATA_RULE_COMMENT, (rule.comment.len() + 1) as u8];
        comment.extend(rule.comment.as_bytes());
        assert!(has(&comment), "comment in user data");
        let whole = Rule::new("pod a", vec![build::addr_in(Addr::Src, "10.244.0.0/16".parse::<IpNet>().unwrap())]);
        let bytes = encode(&whole, TableFamily::Inet).unwrap();
        assert!(!bytes.windows(8).any(|w| w == b"bitwise\0"), "a /16 compares two bytes");
    }

    /// Runs an nft script in the calling thread's namespace.
    fn nft_script(script: &str) {
        let mut child = std::process::Command::new("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("nft");
        std::io::Write::write_all(child.stdin.as_mut().expect("stdin"), script.as_bytes()).expect("write");
        assert!(child.wait().expect("nft").success(), "{script}");
    }

    /// The same rules added by nft (from text) and over netlink (from
    /// Weft's statements) list the same: nft reads ours as its own.
    #[test]
    fn rules_added_over_netlink_list_as_nft_lists_its_own() {
        if !crate::test_support::require_root() {
            return;
        }
        let ns = crate::test_support::TestNetns::new();
        ns.run(|| {
            use super::super::nfnl::{Change, Conn};
            let net = |s: &str| s.parse::<IpNet>().unwrap();
            let pod: IpAddr = "10.244.1.5".parse().unwrap();
            let pod6: IpAddr = "fd00:10:244:1::5".parse().unwrap();
            let rules = [
                (
                    "ip saddr 10.244.1.0/24 meta mark set meta mark | 0x00002000",
                    vec![build::addr_in(Addr::Src, net("10.244.1.0/24")), build::set_mark_bits(0x2000)],
                ),
                (
                    "ip daddr 192.0.2.7 ip saddr 10.240.0.0/12 meta l4proto udp dnat ip to 10.244.1.5:8080",
                    vec![
                        build::addr_in(Addr::Dst, net("192.0.2.7/32")),
                        build::addr_in(Addr::Src, net("10.240.0.0/12")),
                        build::l4proto(Proto::Udp),
                        build::dnat(pod, 8080),
                    ],
                ),
                ("meta l4proto tcp dnat ip to 10.244.1.5:80", vec![build::l4proto(Proto::Tcp), build::dnat(pod, 80)]),
                (
                    "ip6 saddr fd00:10:244:1::/64 meta mark set meta mark | 0x00002000",
                    vec![build::addr_in(Addr::Src, net("fd00:10:244:1::/64")), build::set_mark_bits(0x2000)],
                ),
                (
                    "ip6 daddr fd00:250::11 ip6 saddr fd00:10:240::/44 meta l4proto udp dnat ip6 to [fd00:10:244:1::5]:8080",
                    vec![
                        build::addr_in(Addr::Dst, net("fd00:250::11/128")),
                        build::addr_in(Addr::Src, net("fd00:10:240::/44")),
                        build::l4proto(Proto::Udp),
                        build::dnat(pod6, 8080),
                    ],
                ),
                (
                    "meta l4proto tcp dnat ip6 to [fd00:10:244:1::5]:80",
                    vec![build::l4proto(Proto::Tcp), build::dnat(pod6, 80)],
                ),
                // NetworkPolicy rules.
                ("ct state established,related accept", vec![build::ct_state(&["established", "related"]), build::accept()]),
                (
                    "ct state invalid counter name \"c\" drop",
                    vec![build::ct_state(&["invalid"]), build::count_into("c"), build::drop()],
                ),
                ("ip saddr @peers return", vec![build::addr_in_set(Addr::Src, Family::V4, "peers"), build::ret()]),
                (
                    "ip6 daddr @peers6 meta l4proto udp udp dport 53 counter name \"c\" return",
                    vec![
                        build::addr_in_set(Addr::Dst, Family::V6, "peers6"),
                        build::l4proto(Proto::Udp),
                        build::dport(Proto::Udp, 53, 53),
                        build::count_into("c"),
                        build::ret(),
                    ],
                ),
                (
                    "meta l4proto tcp tcp dport 8080 counter name \"c\" return",
                    vec![build::l4proto(Proto::Tcp), build::dport(Proto::Tcp, 8080, 8080), build::count_into("c"), build::ret()],
                ),
                (
                    "meta l4proto tcp counter name \"c\" reject with tcp reset",
                    vec![build::l4proto(Proto::Tcp), build::count_into("c"), build::reject_tcp_reset()],
                ),
                (
                    "counter name \"c\" reject with icmpx admin-prohibited",
                    vec![build::count_into("c"), build::reject_prohibited()],
                ),
                (
                    "meta l4proto udp udp dport 8000-8080 counter name \"c\" return",
                    vec![
                        build::l4proto(Proto::Udp),
                        build::dport(Proto::Udp, 8000, 8080),
                        build::count_into("c"),
                        build::ret(),
                    ],
                ),
                // The policy drop log's copy to its NFLOG group.
                (
                    "ip saddr @peers meta l4proto tcp limit rate 10/second burst 10 packets log prefix \"c\" group 7",
                    vec![
                        build::addr_in_set(Addr::Src, Family::V4, "peers"),
                        build::l4proto(Proto::Tcp),
                        build::under_rate_per_second(10),
                        build::log_to_group(7, "c"),
                    ],
                ),
            ];
            let rules: Vec<(&str, Rule)> = rules.into_iter().map(|(t, s)| (t, Rule::new("pod a", s))).collect();
            let mut script = String::from(
                "add table inet t\nadd counter inet t c\n\
                 add set inet t peers { type ipv4_addr; flags interval; }\n\
                 add set inet t peers6 { type ipv6_addr; flags interval; }\n\
                 add chain inet t a\nadd chain inet t b\n",
            );
            for (text, rule) in &rules {
                script.push_str(&format!("add rule inet t a {text} comment \"{}\"\n", rule.comment));
            }
            nft_script(&script);
            let mut changes = Vec::new();
            changes.extend(rules.iter().map(|(_, r)| Change::AddRule("b", encode(r, TableFamily::Inet).expect("encodable"))));
            Conn::default().apply(crate::firewall::ruleset::TableFamily::Inet, "t", &changes, std::time::Duration::from_secs(5)).expect("netlink");
            let listed = |chain: &str| {
                let out = std::process::Command::new("nft").args(["list", "chain", "inet", "t", chain]).output();
                let text = String::from_utf8_lossy(&out.expect("nft").stdout).into_owned();
                text.replace(&format!("chain {chain} "), "chain _ ")
            };
            let (by_nft, by_netlink) = (listed("a"), listed("b"));
            assert!(by_nft.contains("dnat ip to 10.244.1.5:8080"), "{by_nft}");
            assert!(by_nft.contains("dnat ip6 to [fd00:10:244:1::5]:8080"), "{by_nft}");
            for policy in [
                "ct state established,related accept",
                "reject with tcp reset",
                "udp dport 53",
                "udp dport 8000-8080",
                "@peers6",
                "limit rate 10/second burst 10 packets log prefix \"c\" group 7",
            ] {
                assert!(by_nft.contains(policy), "{policy}: {by_nft}");
            }
            assert_eq!(by_netlink, by_nft);
        });
    }

    /// The guard's check of a neighbour advertisement's target, added by
    /// nft (from text, against a set typed as nft 1.0.6 allows) and over
    /// netlink (against the same set), lists the same; and nft lists the
    /// bridge table as JSON with it in place (the engine reads it so).
    #[test]
    fn the_advertised_target_check_lists_as_nft_lists_its_own() {
        if !crate::test_support::require_root() {
            return;
        }
        let ns = crate::test_support::TestNetns::new();
        ns.run(|| {
            use super::super::nfnl::{Change, Conn};
            let check = Rule::new(
                "own target",
                vec![build::key_in_set(&[Field::InIface, Field::EtherSrc, Field::NdTarget], "s"), build::accept()],
            );
            let drop = Rule::new("other target", vec![build::count_into("dropped"), build::drop()]);
            let script = format!(
                "add table bridge t\nadd counter bridge t dropped\n\
                 add set bridge t s {{ typeof iifname . ether saddr . @th,64,128; }}\n\
                 add set bridge t s6 {{ type ifname . ether_addr . ipv6_addr; }}\n\
                 add chain bridge t a\n\
                 add rule bridge t a iifname . ether saddr . @th,64,128 @s accept comment \"{}\"\n\
                 add rule bridge t a counter name \"dropped\" drop comment \"{}\"\n",
                check.comment, drop.comment
            );
            nft_script(&script);
            let on_s6 = Rule::new(
                "own target",
                vec![build::key_in_set(&[Field::InIface, Field::EtherSrc, Field::NdTarget], "s6"), build::accept()],
            );
            let changes = vec![
                Change::AddChain("b"),
                Change::AddRule("b", encode(&check, TableFamily::Bridge).expect("encodable")),
                Change::AddRule("b", encode(&drop, TableFamily::Bridge).expect("encodable")),
                Change::AddChain("c"),
                Change::AddRule("c", encode(&on_s6, TableFamily::Bridge).expect("encodable")),
            ];
            let family = crate::firewall::ruleset::TableFamily::Bridge;
            Conn::default().apply(family, "t", &changes, std::time::Duration::from_secs(5)).expect("netlink");
            let nft = |args: &[&str]| {
                let out = std::process::Command::new("nft").args(args).output().expect("nft");
                assert!(out.status.success(), "nft {args:?}: {}", String::from_utf8_lossy(&out.stderr));
                String::from_utf8_lossy(&out.stdout).into_owned()
            };
            let listed = |chain: &str| {
                nft(&["list", "chain", "bridge", "t", chain]).replace(&format!("chain {chain} "), "chain _ ")
            };
            assert_eq!(listed("b"), listed("a"));
            let json: serde_json::Value =
                serde_json::from_str(&nft(&["-j", "list", "table", "bridge", "t"])).expect("JSON");
            let comments: Vec<&str> = json["nftables"]
                .as_array()
                .expect("list")
                .iter()
                .filter(|o| o["rule"]["chain"] == "c")
                .filter_map(|o| o["rule"]["comment"].as_str())
                .collect();
            assert_eq!(comments, [on_s6.comment.as_str()]);
        });
    }
}
