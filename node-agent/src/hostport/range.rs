//! The node's host port range, and the ports host processes already hold.

use std::collections::HashSet;
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

/// Ports bound by processes in this network namespace: listening TCP and
/// bound UDP sockets, IPv4 and IPv6. Read from /proc/net at the moment of
/// the call (a snapshot; good enough to step around long-running daemons).
pub fn bound_ports() -> HashSet<(Protocol, u16)> {
    let mut set = HashSet::new();
    for (file, proto, listen_only) in [
        ("/proc/net/tcp", Protocol::Tcp, true),
        ("/proc/net/tcp6", Protocol::Tcp, true),
        ("/proc/net/udp", Protocol::Udp, false),
        ("/proc/net/udp6", Protocol::Udp, false),
    ] {
        if let Ok(text) = std::fs::read_to_string(file) {
            set.extend(parse_proc_net(&text, listen_only).into_iter().map(|p| (proto, p)));
        }
    }
    set
}

/// Local ports of the sockets in a /proc/net/{tcp,udp}[6] table; with
/// `listen_only`, of those in state LISTEN (0A).
pub fn parse_proc_net(text: &str, listen_only: bool) -> Vec<u16> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let local = cols.nth(1)?;
            let state = cols.nth(1)?;
            if listen_only && state != "0A" {
                return None;
            }
            u16::from_str_radix(local.rsplit_once(':')?.1, 16).ok()
        })
        .collect()
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
    fn proc_net_tables_give_listening_ports() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue\n\
                   0: 00000000:1F90 00000000:0000 0A 00000000:00000000\n\
                   1: 0100007F:A000 0100007F:1F90 01 00000000:00000000\n";
        assert_eq!(parse_proc_net(tcp, true), vec![8080]);
        assert_eq!(parse_proc_net(tcp, false), vec![8080, 40960]);
    }

    #[test]
    fn a_listening_socket_here_is_seen() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(bound_ports().contains(&(Protocol::Tcp, port)));
    }
}
