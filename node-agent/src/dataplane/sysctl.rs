//! IPv4 forwarding, which pods on other nodes (and routed pods on this one)
//! need. Level-triggered: checked at start-up and every resync, since a
//! `sysctl --system` or a firewall reload may turn it off behind our back.

use std::path::Path;

use super::DataplaneError;

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";
const IPV6_FORWARDING: &str = "/proc/sys/net/ipv6/conf/all/forwarding";
const CONNTRACK_ACCT: &str = "/proc/sys/net/netfilter/nf_conntrack_acct";

/// Turns IPv4 forwarding on in this network namespace; returns whether it was off.
pub fn ensure_ipv4_forwarding() -> Result<bool, DataplaneError> {
    ensure_on(Path::new(IP_FORWARD))
}

/// Turns IPv6 forwarding on (dual-stack nodes); returns whether it was off.
/// A forwarding interface ignores router advertisements unless its
/// `accept_ra` is 2: a node that takes its own IPv6 address from them needs that.
pub fn ensure_ipv6_forwarding() -> Result<bool, DataplaneError> {
    ensure_on(Path::new(IPV6_FORWARDING))
}

/// Has connection tracking count each connection's packets and bytes (the
/// flow records' counters); returns whether it was off.
pub fn ensure_conntrack_accounting() -> Result<bool, DataplaneError> {
    ensure_on(Path::new(CONNTRACK_ACCT))
}

/// Lets link `ifname` answer neighbour solicitations for its proxy entries
/// (a routed pod's host veth, for the IPv6 gateway). `ifname` is a name
/// the agent made, never input.
pub fn enable_proxy_ndp(ifname: &str) -> Result<(), DataplaneError> {
    ensure_on(&Path::new("/proc/sys/net/ipv6/conf").join(ifname).join("proxy_ndp")).map(drop)
}

fn ensure_on(path: &Path) -> Result<bool, DataplaneError> {
    let fail = |e: std::io::Error| DataplaneError::Unexpected(format!("{}: {e}", path.display()));
    if std::fs::read_to_string(path).map_err(fail)?.trim() == "1" {
        return Ok(false);
    }
    std::fs::write(path, b"1").map_err(fail)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_only_when_off() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ip_forward");
        std::fs::write(&path, "0\n").expect("write");
        assert!(ensure_on(&path).expect("first"));
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "1");
        assert!(!ensure_on(&path).expect("second"));
        assert!(ensure_on(&dir.path().join("missing")).is_err());
    }
}
