//! Whether this network namespace reaches beyond itself over IPv6: a
//! default IPv6 route and a global unicast address (2000::/3). Read from the
//! calling thread's namespace's procfs files, which the kernel keeps for
//! every namespace.

use super::DataplaneError;

/// Whether this namespace has a default IPv6 route and a global unicast
/// address. `Ok(false)` where IPv6 is off (the files are missing).
pub fn routable_ipv6() -> Result<bool, DataplaneError> {
    let read = |path: &str| match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(DataplaneError::Kernel { op: format!("read {path}"), source }),
    };
    // thread-self: the namespace of this thread, which may have entered one.
    let routes = read("/proc/thread-self/net/ipv6_route")?;
    let addresses = read("/proc/thread-self/net/if_inet6")?;
    Ok(match (routes, addresses) {
        (Some(r), Some(a)) => has_default_route(&r) && has_global_address(&a),
        _ => false,
    })
}

const RTF_UP: u32 = 0x0001;
const RTF_REJECT: u32 = 0x0200;

/// `/proc/net/ipv6_route`: destination, prefix length, source, source
/// prefix length, next hop, metric, refcount, use, flags, device. A usable
/// default route is `::/0`, up, not a reject (unreachable) route, not on lo.
fn has_default_route(ipv6_route: &str) -> bool {
    ipv6_route.lines().any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [dst, plen, _, _, _, _, _, _, flags, dev] = f.as_slice() else { return false };
        let flags = u32::from_str_radix(flags, 16).unwrap_or(0);
        dst.bytes().all(|b| b == b'0')
            && *plen == "00"
            && flags & RTF_UP != 0
            && flags & RTF_REJECT == 0
            && *dev != "lo"
    })
}

/// `/proc/net/if_inet6`: address (32 hex digits), interface index, prefix
/// length, scope, flags, device. Global unicast is 2000::/3: its first hex
/// digit is 2 or 3 (unique local fc00::/7 is scope global too, but routable
/// nowhere beyond its site).
fn has_global_address(if_inet6: &str) -> bool {
    if_inet6
        .lines()
        .any(|line| matches!(line.split_whitespace().next().and_then(|a| a.chars().next()), Some('2' | '3')))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTES_WITH_DEFAULT: &str = "\
fd000010024400010000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001   weft0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 00000400 00000002 00000000 00000003     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
";
    const ONLY_UNREACHABLE: &str = "\
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
";

    #[test]
    fn a_default_route_counts_only_when_up_usable_and_off_lo() {
        assert!(has_default_route(ROUTES_WITH_DEFAULT));
        assert!(!has_default_route(ONLY_UNREACHABLE), "the kernel's unreachable ::/0 on lo");
        assert!(!has_default_route(""));
        // A /64 is not a default route.
        assert!(!has_default_route(ROUTES_WITH_DEFAULT.lines().next().unwrap()));
    }

    #[test]
    fn only_2000_slash_3_addresses_are_global() {
        let line = |addr: &str| format!("{addr} 02 40 00 80     eth0\n");
        assert!(has_global_address(&line("20010db8000000000000000000000001")));
        assert!(has_global_address(&line("3fff0000000000000000000000000001")));
        for local in
            ["fd001000000000000000000000000001", "fe800000000000000000000000000001", "00000000000000000000000000000001"]
        {
            assert!(!has_global_address(&line(local)), "{local}");
        }
    }
}
