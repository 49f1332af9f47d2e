//! Removal of the iptables chains and ipsets that agents before the
//! nftables engine left on a node (an upgrade in place): their jumps from
//! built-in chains are deleted, then the chains are flushed and deleted, in
//! one atomic `iptables-restore --noflush` per table; then the policy
//! ipsets, which nothing references any more, are destroyed. Nobody else's
//! rules or sets are touched: only chains named here are declared, only
//! rules jumping to them are deleted, only sets with Weft's prefix go.
//! Blocking; acts in the calling thread's network namespace.

use std::fmt::Write as _;
use std::time::Duration;

use crate::dataplane::exec::{self, ExecError};
use crate::dataplane::iptables;

/// The nat table chains of the iptables-era masquerade and host ports.
pub const NAT_CHAINS: &[&str] = &["WEFT-POSTROUTING", "WEFT-HOSTPORTS", "WEFT-HOSTPORTS-MASQ"];
/// The filter table chains of the iptables-era policy.
fn policy_chain(c: &str) -> bool {
    c == "WEFT-FORWARD" || c.starts_with("WEFT-PI-") || c.starts_with("WEFT-PE-")
}
/// The iptables-era policy ipsets.
const SET_PREFIX: &str = "weft-pol-";

/// The `iptables-restore --noflush` input removing `ours` (and every jump
/// to them) from `table`, given its `iptables-save`, or None when none is there.
pub fn removal_text(save: &str, table: &str, ours: &dyn Fn(&str) -> bool) -> Option<String> {
    let mut chains = Vec::new();
    let mut jumps = Vec::new();
    for line in save.lines().map(str::trim_end) {
        if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or_default();
            if ours(name) {
                chains.push(name.to_owned());
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split_whitespace().next().unwrap_or_default();
            let target = rule.rsplit_once(" -j ").map(|(_, t)| t.split_whitespace().next().unwrap_or_default());
            if !ours(chain) && target.is_some_and(ours) {
                jumps.push(format!("-D {rule}"));
            }
        }
    }
    if chains.is_empty() && jumps.is_empty() {
        return None;
    }
    let mut t = format!("*{table}\n");
    jumps.iter().for_each(|j| t.push_str(&format!("{j}\n")));
    // Declaring a chain under --noflush empties it; then it can go.
    chains.iter().for_each(|c| {
        let _ = writeln!(t, ":{c} - [0:0]");
    });
    chains.iter().for_each(|c| {
        let _ = writeln!(t, "-X {c}");
    });
    t.push_str("COMMIT\n");
    Some(t)
}

/// None when `program` is not installed (then nothing of it is left to remove).
fn installed<T>(r: Result<T, ExecError>) -> Result<Option<T>, ExecError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(ExecError::Spawn { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes the iptables-era chains `ours` selects from `table`; `Ok(true)`
/// when there were some. A node without iptables has none.
pub fn remove(table: &str, ours: &dyn Fn(&str) -> bool) -> Result<bool, ExecError> {
    let Some(save) = installed(iptables::save(table))? else { return Ok(false) };
    match removal_text(&save, table, ours) {
        None => Ok(false),
        Some(text) => iptables::restore(&text).map(|()| true),
    }
}

/// Destroys the iptables-era policy ipsets (after the rules naming them went).
fn remove_sets() -> Result<bool, ExecError> {
    const TIMEOUT: Duration = Duration::from_secs(15);
    let Some(out) = installed(exec::run_ok("ipset", &["list", "-n"], None, TIMEOUT, &[]))? else { return Ok(false) };
    let ours: Vec<&str> = out.stdout.lines().map(str::trim).filter(|n| n.starts_with(SET_PREFIX)).collect();
    let script: String = ours.iter().map(|n| format!("destroy {n}\n")).collect();
    if !ours.is_empty() {
        exec::run_ok("ipset", &["restore"], Some(script.as_bytes()), TIMEOUT, &[])?;
    }
    Ok(!ours.is_empty())
}

/// Removes what the iptables-era masquerade and host ports left (call once
/// their nftables rules are in place); `Ok(true)` when there was something.
pub fn remove_nat() -> Result<bool, ExecError> {
    remove("nat", &|c| NAT_CHAINS.contains(&c))
}

/// Removes what the iptables-era policy left (call once the nftables policy
/// rules are in place); `Ok(true)` when there was something.
pub fn remove_policy() -> Result<bool, ExecError> {
    let filter = remove("filter", &policy_chain)?;
    let sets = remove_sets()?;
    Ok(filter || sets)
}

/// Runs `remove` once the new rules are in place, logging the outcome.
pub async fn remove_once(what: &'static str, remove: fn() -> Result<bool, ExecError>) {
    match tokio::task::spawn_blocking(remove).await {
        Ok(Ok(true)) => tracing::info!(what, "removed the iptables-era rules of an earlier Weft agent"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => tracing::warn!(what, error = %e, "cannot remove the iptables-era rules of an earlier Weft agent"),
        Err(e) => tracing::warn!(what, error = %e, "the iptables clean-up task failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVE: &str = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
        :POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:WEFT-HOSTPORTS - [0:0]\n:WEFT-POSTROUTING - [0:0]\n\
        -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
        -A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment \"weft: host ports\" -j WEFT-HOSTPORTS\n\
        -A POSTROUTING -m comment --comment \"weft: masquerade pod traffic leaving the cluster\" -j WEFT-POSTROUTING\n\
        -A WEFT-HOSTPORTS -p tcp -m tcp --dport 20000 -j DNAT --to-destination 10.244.1.5:80\n\
        -A WEFT-POSTROUTING -s 10.244.1.0/24 -j MASQUERADE --random-fully\nCOMMIT\n";

    #[test]
    fn jumps_go_first_then_our_chains_and_nothing_else_is_named() {
        let t = removal_text(SAVE, "nat", &|c| NAT_CHAINS.contains(&c)).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "*nat");
        assert!(lines[1].starts_with("-D PREROUTING -m addrtype") && lines[1].ends_with("-j WEFT-HOSTPORTS"));
        assert!(lines[2].starts_with("-D POSTROUTING") && lines[2].ends_with("-j WEFT-POSTROUTING"));
        assert_eq!(
            &lines[3..],
            [
                ":WEFT-HOSTPORTS - [0:0]",
                ":WEFT-POSTROUTING - [0:0]",
                "-X WEFT-HOSTPORTS",
                "-X WEFT-POSTROUTING",
                "COMMIT"
            ]
        );
        assert!(!t.contains("KUBE"), "{t}");
    }

    #[test]
    fn policy_chains_and_their_jump_go_and_others_stay() {
        let save = "*filter\n:FORWARD ACCEPT [0:0]\n:KUBE-FORWARD - [0:0]\n:WEFT-FORWARD - [0:0]\n:WEFT-PI-00ff - [0:0]\n\
            -A FORWARD -m comment --comment \"weft: network policy\" -j WEFT-FORWARD\n-A FORWARD -j KUBE-FORWARD\n\
            -A WEFT-FORWARD -d 10.244.1.5/32 -j WEFT-PI-00ff\n-A WEFT-PI-00ff -j DROP\nCOMMIT\n";
        let t = removal_text(save, "filter", &policy_chain).unwrap();
        assert_eq!(t.matches("-D FORWARD").count(), 1, "{t}");
        assert!(t.contains("-X WEFT-FORWARD\n") && t.contains("-X WEFT-PI-00ff\n") && !t.contains("KUBE"), "{t}");
    }

    #[test]
    fn a_clean_table_needs_nothing() {
        let clean = "*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n";
        assert_eq!(removal_text(clean, "nat", &|c| NAT_CHAINS.contains(&c)), None);
    }
}
