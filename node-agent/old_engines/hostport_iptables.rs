//! The iptables host port engine that the nftables one replaced, kept only
//! for tests: the upgrade test creates the chains an earlier agent left, and
//! the host port benchmark measures it beside the nftables engine.
//!
//! Host port DNAT in the nat table, in Weft's own chains:
//!
//! - `WEFT-HOSTPORTS`, jumped to from PREROUTING (traffic from other nodes
//!   and local pods) and OUTPUT (the node itself) for local destinations:
//!   per mapping, a MARK rule for traffic coming from this node's pods and a
//!   DNAT rule to `podIP:containerPort`.
//! - `WEFT-HOSTPORTS-MASQ`, jumped to from POSTROUTING: masquerades marked
//!   traffic, so a pod reaching a host port on its own node (another pod, or
//!   itself: hairpin) gets replies through the node, not straight over the
//!   bridge from an address it never talked to.
//!
//! Rules are written in the exact form `iptables-save` prints, so the saved
//! state can be compared line by line ("already right" writes nothing).

use ipnet::Ipv4Net;
use weft_api::Protocol;

use super::store::{Allocation, Mapping};

pub const CHAIN: &str = "WEFT-HOSTPORTS";
pub const MASQ_CHAIN: &str = "WEFT-HOSTPORTS-MASQ";
/// The mark for host port traffic from local pods (the bit portmap uses too,
/// which Weft replaces).
const MARK: &str = "0x2000/0x2000";

fn proto(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// iptables keeps at most 255 bytes of a comment and refuses longer ones.
const MAX_COMMENT: usize = 255;

/// The rule comment naming a mapping's pod, quoted as iptables-save prints
/// it. Names are validated where they enter (weft-cni, the agent's request
/// decoding), but a record may come from an older agent: anything but
/// letters, digits and `.-_/:` becomes `_`, so nothing can end the quote or
/// the line, and the text is cut to iptables' limit so that what is written
/// is what iptables-save reads back.
fn comment(a: &Allocation) -> String {
    let short: String = a.container_id.chars().take(12).collect();
    let text = format!("weft: {}/{} {short}", a.pod_namespace, a.pod_name);
    let mut safe: String = text
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '/' | ':' | ' ') { c } else { '_' })
        .collect();
    safe.truncate(MAX_COMMENT);
    format!("\"{safe}\"")
}

fn dst(m: &Mapping) -> String {
    m.host_ip.map(|ip| format!("-d {ip}/32 ")).unwrap_or_default()
}

/// The two rules of one mapping, as printed by iptables-save.
fn mapping_rules(a: &Allocation, m: &Mapping, pod_cidr: Ipv4Net) -> [String; 2] {
    let (p, c, d) = (proto(m.protocol), comment(a), dst(m));
    let port = m.host_port;
    [
        format!(
            "-A {CHAIN} {d}-s {} -p {p} -m {p} --dport {port} -m comment --comment {c} -j MARK --set-xmark {MARK}",
            pod_cidr.trunc()
        ),
        format!(
            "-A {CHAIN} {d}-p {p} -m {p} --dport {port} -m comment --comment {c} -j DNAT --to-destination {}:{}",
            a.pod_ip, m.container_port
        ),
    ]
}

/// Every rule of `CHAIN` for one allocation.
pub fn allocation_rules(a: &Allocation, pod_cidr: Ipv4Net) -> Vec<String> {
    a.ports.iter().flat_map(|m| mapping_rules(a, m, pod_cidr)).collect()
}

fn masq_rules() -> Vec<String> {
    vec![format!(
        "-A {MASQ_CHAIN} -m mark --mark {MARK} -m comment --comment \"weft: host port traffic from local pods\" -j MASQUERADE"
    )]
}

fn jumps() -> Vec<String> {
    vec![
        format!("-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment \"weft: host ports\" -j {CHAIN}"),
        format!("-A OUTPUT -m addrtype --dst-type LOCAL -m comment --comment \"weft: host ports\" -j {CHAIN}"),
        format!("-A POSTROUTING -m comment --comment \"weft: host port masquerade\" -j {MASQ_CHAIN}"),
    ]
}

/// What of ours `iptables-save -t nat` shows.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Saved {
    pub chain: Option<Vec<String>>,
    pub masq: Option<Vec<String>>,
    /// Rules in built-in chains that jump to ours.
    pub jumps: Vec<String>,
}

pub fn parse_save(save: &str) -> Saved {
    let mut s = Saved::default();
    for line in save.lines().map(str::trim_end) {
        if line.starts_with(&format!(":{CHAIN} ")) {
            s.chain.get_or_insert_with(Vec::new);
        } else if line.starts_with(&format!(":{MASQ_CHAIN} ")) {
            s.masq.get_or_insert_with(Vec::new);
        } else if line.starts_with(&format!("-A {CHAIN} ")) {
            s.chain.get_or_insert_with(Vec::new).push(line.to_owned());
        } else if line.starts_with(&format!("-A {MASQ_CHAIN} ")) {
            s.masq.get_or_insert_with(Vec::new).push(line.to_owned());
        } else if line.starts_with("-A ")
            && (line.ends_with(&format!("-j {CHAIN}")) || line.ends_with(&format!("-j {MASQ_CHAIN}")))
        {
            s.jumps.push(line.to_owned());
        }
    }
    s
}

/// The restore input making the nat table hold exactly `allocations`' rules
/// and our jumps, or `None` when it already does. Only our chains are
/// declared (and so flushed); built-in chains get single -D/-A lines.
pub fn full_sync_text(saved: &Saved, allocations: &[Allocation], pod_cidr: Ipv4Net) -> Option<String> {
    let want: Vec<String> = allocations.iter().flat_map(|a| allocation_rules(a, pod_cidr)).collect();
    let want_masq = masq_rules();
    let want_jumps = jumps();
    // Appends leave allocations in arrival order, a rewrite in record order:
    // the order between mappings does not matter, so compare sorted.
    let sorted = |v: &[String]| {
        let mut v = v.to_vec();
        v.sort();
        v
    };
    let chain_ok = saved.chain.as_deref().map(sorted) == Some(sorted(&want));
    let masq_ok = saved.masq.as_ref() == Some(&want_masq);
    let jumps_ok = saved.jumps == want_jumps;
    if chain_ok && masq_ok && jumps_ok {
        return None;
    }
    let mut t = String::from("*nat\n");
    if !chain_ok {
        t.push_str(&format!(":{CHAIN} - [0:0]\n"));
        want.iter().for_each(|r| t.push_str(&format!("{r}\n")));
    }
    if !masq_ok {
        t.push_str(&format!(":{MASQ_CHAIN} - [0:0]\n"));
        want_masq.iter().for_each(|r| t.push_str(&format!("{r}\n")));
    }
    if !jumps_ok {
        for j in &saved.jumps {
            t.push_str(&format!("{}\n", j.replacen("-A ", "-D ", 1)));
        }
        want_jumps.iter().for_each(|j| t.push_str(&format!("{j}\n")));
    }
    t.push_str("COMMIT\n");
    Some(t)
}

/// Appends one allocation's rules (the chains exist and hold the others).
pub fn append_text(a: &Allocation, pod_cidr: Ipv4Net) -> String {
    let mut t = String::from("*nat\n");
    allocation_rules(a, pod_cidr).iter().for_each(|r| t.push_str(&format!("{r}\n")));
    t.push_str("COMMIT\n");
    t
}

/// Deletes one allocation's rules; fails (and the caller falls back to a
/// full sync) when one of them is not there.
pub fn delete_text(a: &Allocation, pod_cidr: Ipv4Net) -> String {
    let mut t = String::from("*nat\n");
    for r in allocation_rules(a, pod_cidr) {
        t.push_str(&format!("{}\n", r.replacen("-A ", "-D ", 1)));
    }
    t.push_str("COMMIT\n");
    t
}
