//! Masquerade of pod traffic leaving the cluster, with iptables in the nat
//! table: Weft's own chain `WEFT-POSTROUTING`, jumped to once from
//! POSTROUTING. Pod-to-pod traffic (destination inside the cluster CIDR) is
//! never masqueraded, so pods see each other's real addresses.
//!
//! State is read with `iptables-save -t nat` and written with a single
//! `iptables-restore --noflush`, which is atomic and only touches the lines
//! it names: our chain is flushed and refilled, nobody else's chain is
//! flushed. Nothing is written when the rules are already right.

use ipnet::Ipv4Net;

pub const CHAIN: &str = "WEFT-POSTROUTING";
const JUMP_COMMENT: &str = "weft: masquerade pod traffic leaving the cluster";

pub use super::iptables::IptablesError as MasqueradeError;
use super::iptables::{restore, save};

/// The rules of our chain, exactly as `iptables-save` prints them, so that
/// comparing with the saved state detects "already right".
pub fn chain_rules(pod_cidr: Ipv4Net, cluster_cidr: Ipv4Net) -> Vec<String> {
    let s = pod_cidr.trunc();
    let c = cluster_cidr.trunc();
    vec![
        format!("-A {CHAIN} -s {s} -d {c} -m comment --comment \"weft: pod-to-pod keeps its source\" -j RETURN"),
        format!(
            "-A {CHAIN} -s {s} -d 224.0.0.0/4 -m comment --comment \"weft: no masquerade for multicast\" -j RETURN"
        ),
        format!(
            "-A {CHAIN} -s {s} -m comment --comment \"weft: pod to outside the cluster\" -j MASQUERADE --random-fully"
        ),
    ]
}

fn jump_rule() -> String {
    format!("-A POSTROUTING -m comment --comment \"{JUMP_COMMENT}\" -j {CHAIN}")
}

/// What of ours is in the nat table.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NatState {
    pub chain_exists: bool,
    pub chain_rules: Vec<String>,
    /// Jumps from POSTROUTING to our chain, as printed.
    pub jumps: Vec<String>,
}

/// Extracts our chain and jumps from `iptables-save -t nat` output.
pub fn parse_save(save: &str) -> NatState {
    let mut st = NatState::default();
    let chain_decl = format!(":{CHAIN} ");
    let rule_prefix = format!("-A {CHAIN} ");
    let jump_suffix = format!("-j {CHAIN}");
    for line in save.lines().map(str::trim_end) {
        if line.starts_with(&chain_decl) {
            st.chain_exists = true;
        } else if line.starts_with(&rule_prefix) {
            st.chain_rules.push(line.to_owned());
        } else if line.starts_with("-A POSTROUTING ") && line.ends_with(&jump_suffix) {
            st.jumps.push(line.to_owned());
        }
    }
    st
}

/// The `iptables-restore --noflush` input turning `current` into the wanted
/// state, or `None` when it already is.
pub fn restore_text(current: &NatState, pod_cidr: Ipv4Net, cluster_cidr: Ipv4Net) -> Option<String> {
    let rules = chain_rules(pod_cidr, cluster_cidr);
    let jump = jump_rule();
    let jump_ok = current.jumps.len() == 1 && current.jumps[0] == jump;
    if current.chain_exists && current.chain_rules == rules && jump_ok {
        return None;
    }
    let mut t = String::from("*nat\n");
    // Declaring a chain under --noflush creates it when missing, and flushes
    // it when present: only our own chain is declared.
    t.push_str(&format!(":{CHAIN} - [0:0]\n"));
    for r in &rules {
        t.push_str(r);
        t.push('\n');
    }
    if !jump_ok {
        for j in &current.jumps {
            t.push_str(&j.replacen("-A POSTROUTING", "-D POSTROUTING", 1));
            t.push('\n');
        }
        t.push_str(&jump);
        t.push('\n');
    }
    t.push_str("COMMIT\n");
    Some(t)
}

/// The input removing everything of ours, or `None` when there is nothing.
// Used by remove(), the clean-up path (tests today; an uninstall hook later).
#[allow(dead_code)]
pub fn removal_text(current: &NatState) -> Option<String> {
    if !current.chain_exists && current.jumps.is_empty() {
        return None;
    }
    let mut t = String::from("*nat\n");
    for j in &current.jumps {
        t.push_str(&j.replacen("-A POSTROUTING", "-D POSTROUTING", 1));
        t.push('\n');
    }
    if current.chain_exists {
        t.push_str(&format!(":{CHAIN} - [0:0]\n-X {CHAIN}\n"));
    }
    t.push_str("COMMIT\n");
    Some(t)
}

/// Makes the masquerade rules right; `Ok(true)` when something was written.
/// Blocking (runs iptables): call from a blocking context. Acts in the
/// calling thread's network namespace.
pub fn ensure(pod_cidr: Ipv4Net, cluster_cidr: Ipv4Net) -> Result<bool, MasqueradeError> {
    let current = parse_save(&save("nat")?);
    match restore_text(&current, pod_cidr, cluster_cidr) {
        None => Ok(false),
        Some(text) => restore(&text).map(|()| true),
    }
}

/// Removes Weft's chain and jump; `Ok(true)` when something was removed.
#[allow(dead_code)]
pub fn remove() -> Result<bool, MasqueradeError> {
    match removal_text(&parse_save(&save("nat")?)) {
        None => Ok(false),
        Some(text) => restore(&text).map(|()| true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Ipv4Net {
        "10.244.1.0/24".parse().unwrap()
    }

    fn cluster() -> Ipv4Net {
        "10.244.0.0/16".parse().unwrap()
    }

    #[test]
    fn rules_never_masquerade_pod_to_pod() {
        let rules = chain_rules(pod(), cluster());
        // RETURN for the cluster comes before the MASQUERADE.
        assert!(rules[0].contains("-s 10.244.1.0/24 -d 10.244.0.0/16") && rules[0].ends_with("-j RETURN"));
        assert!(rules[1].contains("-d 224.0.0.0/4") && rules[1].ends_with("-j RETURN"));
        assert!(rules[2].starts_with("-A WEFT-POSTROUTING -s 10.244.1.0/24 -m comment"));
        assert!(rules[2].ends_with("-j MASQUERADE --random-fully"));
        assert_eq!(rules.iter().filter(|r| r.contains("MASQUERADE")).count(), 1);
    }

    #[test]
    fn host_bits_are_dropped_from_cidrs() {
        let rules = chain_rules("10.244.1.7/24".parse().unwrap(), "10.244.3.0/16".parse().unwrap());
        assert!(rules[0].contains("-s 10.244.1.0/24 -d 10.244.0.0/16"));
    }

    #[test]
    fn fresh_table_gets_chain_rules_and_one_jump() {
        let text = restore_text(&NatState::default(), pod(), cluster()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "*nat");
        assert_eq!(lines[1], ":WEFT-POSTROUTING - [0:0]");
        assert_eq!(lines.iter().filter(|l| l.starts_with("-A WEFT-POSTROUTING")).count(), 3);
        assert_eq!(lines.iter().filter(|l| l.starts_with("-A POSTROUTING")).count(), 1);
        assert_eq!(*lines.last().unwrap(), "COMMIT");
        // Never a flush or a declaration of anybody else's chain.
        assert!(!text.contains("-F"));
        assert!(!text.contains(":POSTROUTING"));
    }

    #[test]
    fn converged_table_needs_no_write() {
        let save = format!(
            "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:{CHAIN} - [0:0]\n\
             -A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE\n{}\n{}\nCOMMIT\n",
            jump_rule(),
            chain_rules(pod(), cluster()).join("\n")
        );
        let st = parse_save(&save);
        assert!(st.chain_exists);
        assert_eq!(st.jumps.len(), 1);
        assert_eq!(restore_text(&st, pod(), cluster()), None);
    }

    #[test]
    fn changed_cidr_rewrites_our_chain_only() {
        let st = NatState { chain_exists: true, chain_rules: chain_rules(pod(), cluster()), jumps: vec![jump_rule()] };
        let text = restore_text(&st, "10.244.9.0/24".parse().unwrap(), cluster()).unwrap();
        assert!(text.contains("-s 10.244.9.0/24"));
        assert!(!text.contains("-A POSTROUTING") && !text.contains("-D POSTROUTING"), "jump left as is: {text}");
    }

    #[test]
    fn duplicate_or_foreign_looking_jumps_are_reduced_to_one() {
        let odd = format!("-A POSTROUTING -j {CHAIN}");
        let st =
            NatState { chain_exists: true, chain_rules: chain_rules(pod(), cluster()), jumps: vec![jump_rule(), odd] };
        let text = restore_text(&st, pod(), cluster()).unwrap();
        assert_eq!(text.matches("-D POSTROUTING").count(), 2);
        assert_eq!(text.matches("-A POSTROUTING").count(), 1);
        let d = text.find("-D POSTROUTING").unwrap();
        assert!(d < text.find("-A POSTROUTING").unwrap(), "delete before re-adding");
    }

    #[test]
    fn removal_deletes_jumps_then_chain() {
        assert_eq!(removal_text(&NatState::default()), None);
        let st = NatState { chain_exists: true, chain_rules: vec![], jumps: vec![jump_rule()] };
        let t = removal_text(&st).unwrap();
        assert!(t.find("-D POSTROUTING").unwrap() < t.find("-X WEFT-POSTROUTING").unwrap());
    }
}
