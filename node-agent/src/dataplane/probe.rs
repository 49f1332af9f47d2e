//! One connection opened from inside a pod's network namespace, as the pod
//! itself would open it: the socket is made in the pod's namespace (on a
//! short-lived thread) and used from here, so nothing waits on a thread
//! while the handshake or the answer is awaited.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::net::{TcpSocket, UdpSocket};

use super::netns::{NetnsError, inside};

/// How a probe ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// TCP: the handshake completed.
    Connected,
    /// UDP: a datagram came back.
    Answered,
    /// A TCP reset or an ICMP port unreachable.
    Refused,
    /// Another ICMP unreachable (a filter's "prohibited", no route).
    Unreachable,
    /// Nothing came back in time.
    NoAnswer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Udp,
}

/// What a probe did: how it ended, the port it was sent from, and the
/// socket's error if it reported one.
#[derive(Debug)]
pub struct Probed {
    pub outcome: Outcome,
    pub source: SocketAddr,
    pub detail: String,
}

/// Sends one probe from the namespace at `netns` to `dst`, waiting at most
/// `wait` for the handshake (TCP) or an answer (UDP).
pub async fn probe(netns: &Path, transport: Transport, dst: SocketAddr, wait: Duration) -> Result<Probed, NetnsError> {
    let any: SocketAddr = if dst.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    match transport {
        Transport::Tcp => {
            let socket = inside(netns, move || {
                let s = if any.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }
                    .map_err(NetnsError::Socket)?;
                s.bind(any).map_err(NetnsError::Socket)?;
                Ok(s)
            })
            .await?;
            let source = socket.local_addr().map_err(NetnsError::Socket)?;
            Ok(match tokio::time::timeout(wait, socket.connect(dst)).await {
                Ok(Ok(stream)) => {
                    let source = stream.local_addr().unwrap_or(source);
                    Probed { outcome: Outcome::Connected, source, detail: String::new() }
                }
                Ok(Err(e)) => Probed { outcome: failed(&e), source, detail: e.to_string() },
                Err(_) => Probed { outcome: Outcome::NoAnswer, source, detail: String::new() },
            })
        }
        Transport::Udp => {
            let socket = inside(netns, move || {
                let s = std::net::UdpSocket::bind(any).map_err(NetnsError::Socket)?;
                s.set_nonblocking(true).map_err(NetnsError::Socket)?;
                Ok(s)
            })
            .await?;
            let socket = UdpSocket::from_std(socket).map_err(NetnsError::Socket)?;
            let source = socket.local_addr().map_err(NetnsError::Socket)?;
            // Connected, so that an ICMP error comes back as the next receive's error.
            let sent = async {
                socket.connect(dst).await?;
                socket.send(b"weft probe\n").await?;
                let mut buf = [0u8; 1500];
                socket.recv(&mut buf).await
            };
            Ok(match tokio::time::timeout(wait, sent).await {
                Ok(Ok(_)) => Probed { outcome: Outcome::Answered, source, detail: String::new() },
                Ok(Err(e)) => Probed { outcome: failed(&e), source, detail: e.to_string() },
                Err(_) => Probed { outcome: Outcome::NoAnswer, source, detail: String::new() },
            })
        }
    }
}

/// What a socket's error says of the path.
fn failed(e: &io::Error) -> Outcome {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => Outcome::Refused,
        io::ErrorKind::TimedOut => Outcome::NoAnswer,
        _ => Outcome::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{TestNetns, require_root};

    /// From inside a namespace: a listener answers, a closed port refuses,
    /// a port a filter rejects is unreachable, one it drops has no answer.
    #[tokio::test]
    async fn a_probe_tells_connected_refused_unreachable_and_no_answer_apart() {
        if !require_root() {
            return;
        }
        let ns = TestNetns::new();
        let listener = ns.run(|| {
            let sh = |c: &str| {
                assert!(std::process::Command::new("sh").args(["-c", c]).status().expect("sh").success(), "{c}")
            };
            sh("ip link set lo up");
            sh("nft 'add table inet t; add chain inet t out { type filter hook output priority 0; }; \
                add rule inet t out tcp dport 7001 reject with icmpx admin-prohibited; \
                add rule inet t out tcp dport 7002 drop'");
            std::net::TcpListener::bind("127.0.0.1:7000").expect("listen")
        });
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let wait = Duration::from_millis(500);
        let path = std::path::PathBuf::from(format!("/run/netns/{}", ns.name()));
        let tcp = |port| probe(&path, Transport::Tcp, at(port), wait);
        let open = tcp(7000).await.expect("probe");
        assert_eq!(open.outcome, Outcome::Connected, "{open:?}");
        assert_ne!(open.source.port(), 0);
        assert_eq!(tcp(7003).await.expect("probe").outcome, Outcome::Refused);
        assert_eq!(tcp(7001).await.expect("probe").outcome, Outcome::Unreachable);
        assert_eq!(tcp(7002).await.expect("probe").outcome, Outcome::NoAnswer);
        // UDP: nothing listens, so the port is unreachable.
        let udp = probe(&path, Transport::Udp, at(7000), wait).await.expect("probe");
        assert_eq!(udp.outcome, Outcome::Refused, "{udp:?}");
        drop(listener);
        assert!(probe(Path::new("/nonexistent/netns"), Transport::Tcp, at(7000), wait).await.is_err());
    }
}
