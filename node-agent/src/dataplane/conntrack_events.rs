//! The kernel's connection tracking events (ctnetlink): a connection's
//! first packet (NEW) and its end (DESTROY, with its counters when
//! `net.netfilter.nf_conntrack_acct` is on), read over netlink in the
//! network namespace that binds them. Decoded by netlink-packet-netfilter;
//! the counters, which it leaves undecoded, here.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use netlink_packet_core::{NLA_TYPE_MASK, NetlinkMessage, NetlinkPayload, Nla};
use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Tuple};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner};
use netlink_sys::{Socket, constants::NETLINK_NETFILTER};

use super::exec;
use super::netlink_datagram::{self, Read};

/// The multicast groups of new and destroyed connections (NFNLGRP_CONNTRACK_*).
const GROUP_NEW: u32 = 1;
const GROUP_DESTROY: u32 = 3;
/// Room for a burst of events between two reads; past it the kernel drops
/// events and says so (ENOBUFS).
const RECV_BUFFER: usize = 4 << 20;
/// `recvmmsg` calls per wake-up at most (64 datagrams each).
const READS_PER_WAKE: usize = 4;
/// CTA_COUNTERS_ORIG/REPLY, and their CTA_COUNTERS_PACKETS/BYTES.
const CTA_COUNTERS_ORIG: u16 = 9;
const CTA_COUNTERS_REPLY: u16 = 10;
const CTA_COUNTERS_PACKETS: u16 = 1;
const CTA_COUNTERS_BYTES: u16 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    New,
    Destroy,
}

/// One event: the connection's original direction, and its counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: Kind,
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Source and destination port (0 for protocols without).
    pub sport: u16,
    pub dport: u16,
    /// Where replies come from: another address than `dst` after DNAT (a Service's backend).
    pub reply_src: Option<IpAddr>,
    /// Both directions' packets and bytes, when the kernel counts them.
    pub counters: Option<(u64, u64)>,
}

/// What one read brought.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Received {
    pub events: Vec<Event>,
    /// The kernel dropped events before these: we read too slowly.
    pub lost: bool,
}

/// A socket subscribed to the conntrack events of the caller's network namespace.
pub struct Events {
    socket: Socket,
    batch: netlink_datagram::Batch,
}

impl Events {
    pub fn bind() -> std::io::Result<Self> {
        Self::bind_with_buffer(RECV_BUFFER)
    }

    /// [`Events::bind`] with a receive buffer of `bytes` (the kernel may
    /// round it).
    fn bind_with_buffer(bytes: usize) -> std::io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        let _ = socket.set_rx_buf_sz(bytes);
        socket.add_membership(GROUP_NEW)?;
        socket.add_membership(GROUP_DESTROY)?;
        Ok(Events { socket, batch: netlink_datagram::Batch::default() })
    }

    /// Waits up to `timeout` for events, then takes every queued one (up
    /// to [`READS_PER_WAKE`] batches); an empty list when none came.
    pub fn recv(&mut self, timeout: Duration) -> std::io::Result<Received> {
        let mut got = Received::default();
        if !exec::readable_before(&self.socket, Instant::now() + timeout)? {
            return Ok(got);
        }
        // The kernel sends one datagram per event: many per system call.
        for _ in 0..READS_PER_WAKE {
            match self.batch.read_now(&self.socket)? {
                Read::Nothing => break,
                Read::Lost => got.lost = true,
                Read::Bytes => {}
            }
            for d in self.batch.datagrams() {
                got.events.extend(parse_messages(d));
            }
            if !self.batch.was_full() {
                break;
            }
        }
        Ok(got)
    }
}

/// The events in one datagram (anything else is passed over).
pub fn parse_messages(mut bytes: &[u8]) -> Vec<Event> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let Ok(msg) = NetlinkMessage::<NetfilterMessage>::deserialize(bytes) else { break };
        let len = (msg.header.length as usize).next_multiple_of(4);
        if let NetlinkPayload::InnerMessage(NetfilterMessage { inner: NetfilterMessageInner::Conntrack(m), .. }) =
            msg.payload
        {
            let event = match m {
                ConntrackMessage::New(attrs) => event(Kind::New, &attrs),
                ConntrackMessage::Delete(attrs) => event(Kind::Destroy, &attrs),
                _ => None,
            };
            out.extend(event);
        }
        if len == 0 || len >= bytes.len() {
            break;
        }
        bytes = &bytes[len..];
    }
    out
}

fn event(kind: Kind, attrs: &[ConntrackAttribute]) -> Option<Event> {
    let mut orig = None;
    let mut reply = None;
    let mut counters: Option<(u64, u64)> = None;
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = tuple(t),
            ConntrackAttribute::CtaTupleReply(t) => reply = tuple(t),
            // The kind keeps its nested flag here: compare without it.
            ConntrackAttribute::Other(nla)
                if matches!(nla.kind() & NLA_TYPE_MASK, CTA_COUNTERS_ORIG | CTA_COUNTERS_REPLY) =>
            {
                let mut value = vec![0; nla.value_len()];
                nla.emit_value(&mut value);
                if let Some((p, b)) = parse_counters(&value) {
                    let (sp, sb) = counters.unwrap_or_default();
                    counters = Some((sp + p, sb + b));
                }
            }
            _ => {}
        }
    }
    let (proto, src, dst, sport, dport) = orig?;
    Some(Event { kind, proto, src, dst, sport, dport, reply_src: reply.map(|r| r.1).filter(|a| *a != dst), counters })
}

/// Protocol, addresses and ports of a tuple.
fn tuple(t: &[Tuple]) -> Option<(u8, IpAddr, IpAddr, u16, u16)> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, 0, 0);
    for part in t {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(n) => proto = Some(u8::from(*n)),
                        ProtoTuple::SourcePort(n) => sport = *n,
                        ProtoTuple::DestinationPort(n) => dport = *n,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((proto?, src?, dst?, sport, dport))
}

/// Packets and bytes of a CTA_COUNTERS_* nest (64-bit, big-endian).
fn parse_counters(mut b: &[u8]) -> Option<(u64, u64)> {
    let (mut packets, mut bytes) = (None, None);
    while b.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        let kind = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        let value = b.get(4..len)?;
        let n = <[u8; 8]>::try_from(value).ok().map(u64::from_be_bytes);
        match kind {
            CTA_COUNTERS_PACKETS => packets = n,
            CTA_COUNTERS_BYTES => bytes = n,
            _ => {}
        }
        let step = len.next_multiple_of(4);
        if step == 0 || step > b.len() {
            break;
        }
        b = &b[step..];
    }
    Some((packets?, bytes?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{TestNetns, require_root};

    fn sh(cmd: &str) {
        let out = std::process::Command::new("sh").args(["-c", cmd]).output().expect("sh");
        assert!(out.status.success(), "{cmd}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// A TCP connection over loopback in a fresh namespace: its NEW event,
    /// and its DESTROY event with both directions' counters once deleted.
    #[test]
    fn a_connection_is_seen_opened_and_destroyed_with_counters() {
        if !require_root() {
            return;
        }
        let ns = TestNetns::new();
        ns.run(|| {
            sh("ip link set lo up && sysctl -qw net.netfilter.nf_conntrack_acct=1");
            // Connection tracking runs in a namespace once a rule uses it.
            sh("nft 'add table inet t; add chain inet t out { type filter hook output priority 0; }; add rule inet t out ct state new accept'");
            let mut events = Events::bind().expect("bind the conntrack groups");
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
            let port = listener.local_addr().expect("addr").port();
            let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
            let (mut server, _) = listener.accept().expect("accept");
            use std::io::{Read as _, Write as _};
            client.write_all(b"hello").expect("write");
            let mut got = [0u8; 5];
            server.read_exact(&mut got).expect("read");
            drop((client, server));
            sh(&format!("conntrack -D -p tcp --dport {port} >/dev/null 2>&1"));

            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let (mut new, mut destroy) = (None, None);
            while (new.is_none() || destroy.is_none()) && std::time::Instant::now() < deadline {
                let got = events.recv(Duration::from_millis(200)).expect("recv");
                assert!(!got.lost, "events lost in an idle namespace");
                for e in got.events.into_iter().filter(|e| e.dport == port) {
                    match e.kind {
                        Kind::New => new = Some(e),
                        Kind::Destroy => destroy = Some(e),
                    }
                }
            }
            let new = new.expect("a NEW event");
            let lo: IpAddr = "127.0.0.1".parse().unwrap();
            assert_eq!((new.proto, new.src, new.dst, new.reply_src), (6, lo, lo, None));
            assert_ne!(new.sport, 0);
            let destroy = destroy.expect("a DESTROY event");
            let (packets, bytes) = destroy.counters.expect("counters with nf_conntrack_acct on");
            assert!(packets >= 6 && bytes > 5, "handshake, data and close: {packets} packets, {bytes} bytes");
        });
    }

    /// More events than the socket's buffer holds, unread: the next read
    /// says some were lost (ENOBUFS), and later events still come.
    #[test]
    fn events_past_a_full_buffer_are_reported_lost_and_reading_goes_on() {
        if !require_root() {
            return;
        }
        let ns = TestNetns::new();
        ns.run(|| {
            sh("ip link set lo up");
            sh("nft 'add table inet t; add chain inet t out { type filter hook output priority 0; }; add rule inet t out ct state new accept'");
            // The kernel doubles the size asked and keeps a floor of a few KiB.
            let mut events = Events::bind_with_buffer(4096).expect("bind the conntrack groups");
            let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
            // One new connection per destination port; each a NEW event of about 200 bytes.
            for port in 20_000..21_000u16 {
                socket.send_to(b"x", ("127.0.0.1", port)).expect("send");
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let mut lost = false;
            while !lost && std::time::Instant::now() < deadline {
                lost = events.recv(Duration::from_millis(100)).expect("recv").lost;
            }
            assert!(lost, "1,000 events in a 4 KiB buffer, and no loss reported");
            // Drained, the socket delivers again.
            while !events.recv(Duration::from_millis(50)).expect("recv").events.is_empty() {}
            socket.send_to(b"x", ("127.0.0.1", 30_000)).expect("send");
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let seen = loop {
                let got = events.recv(Duration::from_millis(200)).expect("recv");
                if got.events.iter().any(|e| e.kind == Kind::New && e.dport == 30_000) {
                    break true;
                }
                if std::time::Instant::now() > deadline {
                    break false;
                }
            };
            assert!(seen, "no event after the loss");
        });
    }

    #[test]
    fn counters_are_read_from_their_nest() {
        let mut nest = Vec::new();
        for (kind, v) in [(CTA_COUNTERS_PACKETS, 3u64), (CTA_COUNTERS_BYTES, 180)] {
            nest.extend(12u16.to_ne_bytes());
            nest.extend(kind.to_ne_bytes());
            nest.extend(v.to_be_bytes());
        }
        assert_eq!(parse_counters(&nest), Some((3, 180)));
        assert_eq!(parse_counters(&nest[..12]), None, "bytes missing");
        assert_eq!(parse_counters(&[8, 0, 1, 0]), None, "a short attribute is no panic");
    }
}
