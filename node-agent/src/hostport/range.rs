//! The node's host port range, and the ports host processes already hold.

use std::fmt;
use std::str::FromStr;

use weft_api::Protocol;

/// An inclusive range of ports. The default, 20000-29999, stays clear of the
/// Kubernetes NodePort range (30000-32767) and Linux's default ephemeral
/// range (32768-60999).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

pub const DEFAULT_RANGE: &str = "20000-29999";

impl PortRange {
    /// How many ports it holds; never 0 (`first <= last`), hence no `is_empty`.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        usize::from(self.last - self.first) + 1
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    /// The port after `port`, wrapping to the start.
    pub fn next(&self, port: u16) -> u16 {
        if port >= self.last || port < self.first { self.first } else { port + 1 }
    }

    pub fn overlaps(&self, other: &PortRange) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl FromStr for PortRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s.split_once('-').ok_or_else(|| format!("{s:?} is not a range like 20000-29999"))?;
        let p = |x: &str| x.trim().parse::<u16>().ok().filter(|n| *n > 0);
        match (p(a), p(b)) {
            (Some(first), Some(last)) if first <= last => Ok(PortRange { first, last }),
            _ => Err(format!("{s:?} is not a range of ports 1-65535 with first <= last")),
        }
    }
}

/// The node's ephemeral port range (`net.ipv4.ip_local_port_range`).
pub fn ephemeral_range() -> Option<PortRange> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().filter_map(|x| x.parse().ok());
    Some(PortRange { first: it.next()?, last: it.next()? })
}

/// Whether a process in this network namespace holds `port`: a listening
/// TCP socket or a bound UDP socket on it (any IPv4 address). Probed by
/// binding the wildcard address for an instant — microseconds, where
/// reading /proc/net/{tcp,udp} walks the kernel's whole socket hash tables
/// (milliseconds on a big host).
pub fn in_use(protocol: Protocol, port: u16) -> bool {
    // IPv4 first; then IPv6, for a listener bound to IPv6 only (a node
    // without IPv6 refuses the bind with another error: not in use).
    let unspecified: [std::net::IpAddr; 2] = [[0u8; 4].into(), [0u16; 8].into()];
    unspecified.into_iter().any(|ip| {
        let addr = std::net::SocketAddr::new(ip, port);
        let result = match protocol {
            // std sets SO_REUSEADDR: only a listener (or a socket bound
            // without it) makes this fail, not TIME_WAIT leftovers.
            Protocol::Tcp => std::net::TcpListener::bind(addr).map(drop),
            Protocol::Udp => std::net::UdpSocket::bind(addr).map(drop),
            // Not probed (no SCTP sockets without kernel support).
            Protocol::Sctp => Ok(()),
        };
        matches!(result, Err(e) if e.kind() == std::io::ErrorKind::AddrInUse)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_wrap() {
        let r: PortRange = "20000-20002".parse().unwrap();
        assert_eq!((r.len(), r.next(20002), r.next(20000)), (3, 20000, 20001));
        assert!("30-20".parse::<PortRange>().is_err());
        assert!("0-20".parse::<PortRange>().is_err());
        assert!("20000".parse::<PortRange>().unwrap_err().contains("not a range"));
        let default: PortRange = DEFAULT_RANGE.parse().unwrap();
        assert!(!default.overlaps(&PortRange { first: 30000, last: 32767 }), "NodePort range");
        assert!(!default.overlaps(&PortRange { first: 32768, last: 60999 }), "ephemeral range");
    }

    #[test]
    fn listening_and_bound_sockets_are_seen_and_free_ports_are_not() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(in_use(Protocol::Tcp, port));
        let u = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        let uport = u.local_addr().unwrap().port();
        assert!(in_use(Protocol::Udp, uport));
        drop(l);
        drop(u);
        assert!(!in_use(Protocol::Tcp, port), "a closed listener leaves the port free");
        assert!(!in_use(Protocol::Udp, uport));
        // A listener on IPv6 alone leaves the IPv4 bind free: seen all the same.
        use nix::sys::socket::{self as so, sockopt};
        use std::os::fd::AsRawFd;
        let fd = so::socket(so::AddressFamily::Inet6, so::SockType::Stream, so::SockFlag::empty(), None).unwrap();
        so::setsockopt(&fd, sockopt::Ipv6V6Only, &true).unwrap();
        let any6 = so::SockaddrIn6::from("[::]:0".parse::<std::net::SocketAddrV6>().unwrap());
        so::bind(fd.as_raw_fd(), &any6).unwrap();
        so::listen(&fd, so::Backlog::new(1).unwrap()).unwrap();
        let port6 = so::getsockname::<so::SockaddrIn6>(fd.as_raw_fd()).unwrap().port();
        assert!(std::net::TcpListener::bind(("0.0.0.0", port6)).is_ok(), "IPv4 is free");
        assert!(in_use(Protocol::Tcp, port6));
    }
}
