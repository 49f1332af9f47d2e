//! Bridge netfilter: frames bridged between two pods on weft0 pass through
//! iptables only with `net.bridge.bridge-nf-call-iptables` on (IPv6 ones:
//! `bridge-nf-call-ip6tables`). NetworkPolicy
//! between pods of one node, hostPort DNAT of a pod reaching its own or a
//! neighbour's host port, and kube-proxy's service rules all depend on it.

use std::path::Path;

use super::DataplaneError;

const SYSCTLS: [&str; 2] =
    ["/proc/sys/net/bridge/bridge-nf-call-iptables", "/proc/sys/net/bridge/bridge-nf-call-ip6tables"];

/// Turns bridge netfilter on in this network namespace, for both families.
/// Without it, traffic between pods on this node would silently bypass
/// policy, so its absence stops the agent with the fix named. Returns
/// whether either was off.
pub fn ensure() -> Result<bool, DataplaneError> {
    let mut was_off = false;
    for path in SYSCTLS {
        was_off |= ensure_at(Path::new(path))?;
    }
    Ok(was_off)
}

fn ensure_at(path: &Path) -> Result<bool, DataplaneError> {
    let current = std::fs::read_to_string(path).map_err(|e| {
        DataplaneError::Unexpected(format!(
            "bridge netfilter is unavailable ({}: {e}); load the br_netfilter kernel module \
             (modprobe br_netfilter): without it, traffic between pods on this node bypasses \
             NetworkPolicy and hostPort rules",
            path.display()
        ))
    })?;
    if current.trim() == "1" {
        return Ok(false);
    }
    std::fs::write(path, b"1").map_err(|e| DataplaneError::Kernel {
        op: format!("turn on bridge netfilter ({})", path.display()),
        source: e,
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switched_on_when_off_left_alone_when_on_and_missing_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bridge-nf-call-iptables");
        std::fs::write(&f, "0\n").unwrap();
        assert!(ensure_at(&f).unwrap());
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "1");
        assert!(!ensure_at(&f).unwrap());
        let missing = ensure_at(&dir.path().join("absent")).unwrap_err().to_string();
        assert!(missing.contains("modprobe br_netfilter"), "{missing}");
    }
}
