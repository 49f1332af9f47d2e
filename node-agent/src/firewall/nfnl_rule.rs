//! Rules as nf_tables expressions, for the statements host ports use, so
//! that an allocation is one netlink batch instead of an `nft` run (a
//! process and its start-up: about 4 ms, against 0.1 ms for the batch),
//! and for the guard's check of a neighbour advertisement's target, which
//! nft 1.0.6 cannot build (a raw payload in a lookup of an IPv6 set).
//! A rule with any other statement is `None` here and goes through nft.
//!
//! The expressions are the ones nft itself emits for these statements
//! (`nft --debug=netlink`), so that nft lists the rules as it would list
//! its own; a kernel test compares the two listings.

use std::net::IpAddr;

use ipnet::IpNet;
use nftables::expr::{
    BinaryOperation, Expression, Meta, MetaKey, NamedExpression, Payload, PayloadBase, PayloadField, PayloadRaw,
};
use nftables::stmt::{Counter, Mangle, Match, NAT, NATFamily, Operator, Statement};

use super::nfnl::{NFTA_DATA_VALUE, NFTA_LIST_ELEM, attr, attr_str, nested};
use super::ruleset::{Proto, Rule};

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

fn cmp_eq(b: &mut Vec<u8>, bytes: &[u8]) {
    expr(b, "cmp", |b| {
        u32_attr(b, NFTA_CMP_SREG, NFT_REG_1);
        u32_attr(b, NFTA_CMP_OP, NFT_CMP_EQ);
        value(b, NFTA_CMP_DATA, bytes);
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
    expr(b, "lookup", |b| {
        attr_str(b, NFTA_LOOKUP_SET, set);
        u32_attr(b, NFTA_LOOKUP_SREG, register(0));
    });
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
    expr(b, "payload", |b| {
        u32_attr(b, NFTA_PAYLOAD_DREG, NFT_REG_1);
        u32_attr(b, NFTA_PAYLOAD_BASE, NFT_PAYLOAD_NETWORK_HEADER);
        u32_attr(b, NFTA_PAYLOAD_OFFSET, offset);
        u32_attr(b, NFTA_PAYLOAD_LEN, bytes as u32);
    });
    if bytes == whole && usize::from(len) < whole * 8 {
        let (_, mask) = family_bytes(net.netmask());
        bitwise(b, &mask, &vec![0; whole]);
    }
    cmp_eq(b, &octets[..bytes]);
    Some(())
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

/// One statement's expressions; None when it is not one of those above.
fn statement(b: &mut Vec<u8>, s: &Statement<'_>) -> Option<()> {
    match s {
        Statement::Match(Match { left, right, op: Operator::EQ }) => match left {
            Expression::Named(NamedExpression::Concat(fields)) => {
                concat_in_set(b, fields, text(right)?.strip_prefix('@')?)
            }
            Expression::Named(NamedExpression::Payload(Payload::PayloadField(PayloadField { protocol, field })))
                if protocol == "ip" || protocol == "ip6" =>
            {
                let net = net_of(right)?;
                let offset = match (net, field.as_ref()) {
                    (IpNet::V4(_), "saddr") if protocol == "ip" => 12,
                    (IpNet::V4(_), "daddr") if protocol == "ip" => 16,
                    (IpNet::V6(_), "saddr") if protocol == "ip6" => 8,
                    (IpNet::V6(_), "daddr") if protocol == "ip6" => 24,
                    _ => return None,
                };
                ip_addr_is(b, offset, net)
            }
            l if is_meta(l, MetaKey::L4proto) => {
                let proto = Proto::from_nft(text(right)?)?;
                meta_load(b, NFT_META_L4PROTO);
                cmp_eq(b, &[proto.number()]);
                Some(())
            }
            _ => None,
        },
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

/// The expressions and comment of `rule` as NEWRULE attributes; None when
/// a statement is not one this module encodes.
pub fn encode(rule: &Rule) -> Option<Vec<u8>> {
    let mut b = Vec::new();
    let mut ok = true;
    nested(&mut b, NFTA_RULE_EXPRESSIONS, |b| {
        ok = rule.stmts.iter().all(|s| statement(b, s).is_some());
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
            assert!(encode(&Rule::new("x", stmts.clone())).is_some(), "{stmts:?}");
        }
        let guard = vec![build::key_in_set(&[Field::InIface, Field::EtherSrc, Field::NdTarget], "s"), build::accept()];
        assert!(encode(&Rule::new("x", guard)).is_some());
        assert!(encode(&Rule::new("x", vec![build::count_into("c"), build::drop()])).is_some());
        // A field nft adds a dependency for (`ip6 saddr` in a bridge table) is nft's.
        let v6 = build::key_in_set(&[Field::InIface, Field::Src(Family::V6)], "s");
        assert!(encode(&Rule::new("x", vec![v6])).is_none());
        for other in [build::masquerade(), build::ct_state(&["established"]), build::to_local_address()] {
            assert!(encode(&Rule::new("x", vec![build::l4proto(Proto::Tcp), other.clone()])).is_none(), "{other:?}");
        }
    }

    #[test]
    fn a_prefix_off_a_byte_boundary_is_masked_and_the_comment_is_user_data() {
        let rule = Rule::new("pod a", vec![build::addr_in(Addr::Src, "10.240.0.0/12".parse::<IpNet>().unwrap())]);
        let bytes = encode(&rule).unwrap();
        let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"bitwise\0") && has(&[255, 240, 0, 0]), "mask 255.240.0.0");
        let mut comment = vec![NFTNL_UDATA_RULE_COMMENT, (rule.comment.len() + 1) as u8];
        comment.extend(rule.comment.as_bytes());
        assert!(has(&comment), "comment in user data");
        let whole = Rule::new("pod a", vec![build::addr_in(Addr::Src, "10.244.0.0/16".parse::<IpNet>().unwrap())]);
        let bytes = encode(&whole).unwrap();
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
            ];
            let rules: Vec<(&str, Rule)> = rules.into_iter().map(|(t, s)| (t, Rule::new("pod a", s))).collect();
            let mut script = String::from("add table inet t\nadd chain inet t a\n");
            for (text, rule) in &rules {
                script.push_str(&format!("add rule inet t a {text} comment \"{}\"\n", rule.comment));
            }
            nft_script(&script);
            let mut changes = vec![Change::AddChain("b")];
            changes.extend(rules.iter().map(|(_, r)| Change::AddRule("b", encode(r).expect("encodable"))));
            Conn::default().apply(crate::firewall::ruleset::TableFamily::Inet, "t", &changes, std::time::Duration::from_secs(5)).expect("netlink");
            let listed = |chain: &str| {
                let out = std::process::Command::new("nft").args(["list", "chain", "inet", "t", chain]).output();
                let text = String::from_utf8_lossy(&out.expect("nft").stdout).into_owned();
                text.replace(&format!("chain {chain} "), "chain _ ")
            };
            let (by_nft, by_netlink) = (listed("a"), listed("b"));
            assert!(by_nft.contains("dnat ip to 10.244.1.5:8080"), "{by_nft}");
            assert!(by_nft.contains("dnat ip6 to [fd00:10:244:1::5]:8080"), "{by_nft}");
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
                Change::AddRule("b", encode(&check).expect("encodable")),
                Change::AddRule("b", encode(&drop).expect("encodable")),
                Change::AddChain("c"),
                Change::AddRule("c", encode(&on_s6).expect("encodable")),
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
