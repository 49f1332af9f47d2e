//! Packets logged by `log group N` rules, read over netlink (NFLOG).
//!
//! The kernel copies the first [`COPY`] bytes of each logged packet (enough
//! for the IP header and the ports) with the rule's prefix to whoever bound
//! the group in this network namespace. Nothing here knows what the prefix
//! means: that is the caller's.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nflog::{ConfigCmd, ConfigMode, ConfigNla, PacketNla, ULogMessage, config_request};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{Socket, constants::NETLINK_NETFILTER};

use crate::dataplane::netlink_datagram::{self, Read};

/// Bytes of each packet the kernel copies to us: an IPv6 header and the ports.
const COPY: u32 = 64;
/// Room for a burst of records between two reads; past it the kernel drops
/// records and says so (ENOBUFS).
const RECV_BUFFER: usize = 1 << 20;
/// How long the kernel may take to answer the bind.
const BIND_ANSWER: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("opening a netfilter netlink socket: {0}")]
    Socket(#[source] std::io::Error),
    #[error("binding NFLOG group {group}: {source}")]
    Bind {
        group: u16,
        #[source]
        source: std::io::Error,
    },
    #[error("the kernel refused NFLOG group {group} (is another program reading it?): {message}")]
    Refused { group: u16, message: String },
    #[error("reading NFLOG group {group}: {source}")]
    Recv {
        group: u16,
        #[source]
        source: std::io::Error,
    },
}

/// One logged packet: the rule's prefix and what its headers say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Logged {
    pub prefix: String,
    /// `None` when the copy is not an IP packet we can read.
    pub packet: Option<Packet>,
}

/// The addresses, protocol and (TCP, UDP, SCTP) ports of a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// IP protocol number (6 TCP, 17 UDP, 132 SCTP, 1 ICMP …).
    pub proto: u8,
    /// Source and destination port.
    pub ports: Option<(u16, u16)>,
}

/// What one read brought.
#[derive(Debug, PartialEq, Eq)]
pub enum Received {
    Packets(Vec<Logged>),
    /// The kernel dropped records: we read too slowly.
    Lost,
}

/// A bound NFLOG group.
pub struct Group {
    socket: Socket,
    group: u16,
    buf: Vec<u8>,
}

impl Group {
    /// Binds `group` in the calling thread's network namespace.
    pub fn bind(group: u16) -> Result<Self, Error> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(Error::Socket)?;
        socket.bind_auto().map_err(|source| Error::Bind { group, source })?;
        // A larger buffer is a nicety; the default still works.
        let _ = socket.set_rx_buf_sz(RECV_BUFFER);
        let mut me = Group { socket, group, buf: Vec::new() };
        let request = config_request(
            NetfilterProtoFamily::Unspec,
            group,
            // Each record sent as it is logged: by default the kernel holds
            // them until 100 gather or a second passes, and a denied
            // connection's record would come up to a second late.
            vec![ConfigCmd::Bind.into(), ConfigMode::new_packet(COPY).into(), ConfigNla::QThresh(1)],
        );
        let mut bytes = vec![0; request.header.length as usize];
        request.serialize(&mut bytes);
        me.socket.send(&bytes, 0).map_err(|source| Error::Bind { group, source })?;
        // The answer is an ack (an error message with code 0) or a refusal.
        let refusal = |message: String| Error::Refused { group, message };
        match me.read(BIND_ANSWER)? {
            Read::Bytes => {}
            Read::Nothing => return Err(refusal(format!("no answer within {BIND_ANSWER:?}"))),
            Read::Lost => return Err(refusal("the answer was lost".into())),
        }
        match NetlinkMessage::<NetfilterMessage>::deserialize(&me.buf).map(|m| m.payload) {
            Ok(NetlinkPayload::Error(e)) => match e.code {
                None => Ok(me),
                Some(code) => Err(refusal(std::io::Error::from_raw_os_error(-code.get()).to_string())),
            },
            other => Err(refusal(format!("unexpected answer {other:?}"))),
        }
    }

    fn read(&mut self, timeout: Duration) -> Result<Read, Error> {
        let group = self.group;
        netlink_datagram::read(&self.socket, &mut self.buf, timeout).map_err(|source| Error::Recv { group, source })
    }

    /// Waits up to `timeout` for records; an empty list when none came.
    pub fn recv(&mut self, timeout: Duration) -> Result<Received, Error> {
        Ok(match self.read(timeout)? {
            Read::Bytes => Received::Packets(parse_messages(&self.buf)),
            Read::Nothing => Received::Packets(Vec::new()),
            Read::Lost => Received::Lost,
        })
    }
}

/// The logged packets in one read of the socket (acks and anything else
/// are passed over).
pub fn parse_messages(mut bytes: &[u8]) -> Vec<Logged> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let Ok(msg) = NetlinkMessage::<NetfilterMessage>::deserialize(bytes) else { break };
        let len = (msg.header.length as usize).next_multiple_of(4);
        if let NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::ULog(ULogMessage::Packet(nlas)),
            ..
        }) = msg.payload
        {
            let mut logged = Logged { prefix: String::new(), packet: None };
            for nla in nlas {
                match nla {
                    PacketNla::Prefix(p) => logged.prefix = p.to_string_lossy().into_owned(),
                    PacketNla::Payload(p) => logged.packet = parse_packet(&p),
                    _ => {}
                }
            }
            out.push(logged);
        }
        if len == 0 || len >= bytes.len() {
            break;
        }
        bytes = &bytes[len..];
    }
    out
}

/// The headers of an IPv4 or IPv6 packet (IPv6 extension headers are not
/// walked: such a packet shows its first next-header and no ports).
pub fn parse_packet(b: &[u8]) -> Option<Packet> {
    let (src, dst, proto, l4) = match b.first()? >> 4 {
        4 => {
            let ihl = usize::from(b[0] & 0x0f) * 4;
            let header: &[u8; 20] = b.get(..20)?.try_into().ok()?;
            let first_fragment = u16::from_be_bytes([header[6], header[7]]) & 0x1fff == 0;
            let src = Ipv4Addr::from(<[u8; 4]>::try_from(&header[12..16]).ok()?);
            let dst = Ipv4Addr::from(<[u8; 4]>::try_from(&header[16..20]).ok()?);
            (IpAddr::V4(src), IpAddr::V4(dst), header[9], first_fragment.then(|| b.get(ihl..)).flatten())
        }
        6 => {
            let header = b.get(..40)?;
            let src = Ipv6Addr::from(<[u8; 16]>::try_from(&header[8..24]).ok()?);
            let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&header[24..40]).ok()?);
            (IpAddr::V6(src), IpAddr::V6(dst), header[6], b.get(40..))
        }
        _ => return None,
    };
    let ports = match proto {
        6 | 17 | 132 => {
            l4.and_then(|l4| l4.get(..4)).map(|p| (u16::from_be_bytes([p[0], p[1]]), u16::from_be_bytes([p[2], p[3]])))
        }
        _ => None,
    };
    Some(Packet { src, dst, proto, ports })
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;

    use netlink_packet_core::NetlinkHeader;
    use netlink_packet_netfilter::NetfilterHeader;

    use super::*;

    fn ipv4_udp(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
        let mut b = vec![0x45, 0, 0, 28, 0, 0, 0x40, 0, 64, 17, 0, 0];
        b.extend(src);
        b.extend(dst);
        b.extend(sport.to_be_bytes());
        b.extend(dport.to_be_bytes());
        b.extend([0, 8, 0, 0]);
        b
    }

    #[test]
    fn ipv4_and_ipv6_headers_are_read_and_short_or_odd_copies_are_not() {
        let p = parse_packet(&ipv4_udp([10, 0, 1, 1], [10, 0, 1, 2], 40000, 7)).expect("IPv4 UDP");
        assert_eq!(p.src, "10.0.1.1".parse::<IpAddr>().unwrap());
        assert_eq!(p.dst, "10.0.1.2".parse::<IpAddr>().unwrap());
        assert_eq!((p.proto, p.ports), (17, Some((40000, 7))));

        // ICMP has no ports; a later fragment carries none either.
        let mut icmp = ipv4_udp([10, 0, 1, 1], [10, 0, 1, 2], 0, 0);
        icmp[9] = 1;
        assert_eq!(parse_packet(&icmp).map(|p| (p.proto, p.ports)), Some((1, None)));
        let mut fragment = ipv4_udp([10, 0, 1, 1], [10, 0, 1, 2], 1, 2);
        fragment[7] = 0x10;
        assert_eq!(parse_packet(&fragment).map(|p| p.ports), Some(None));

        let mut v6 = vec![0x60, 0, 0, 0, 0, 8, 6, 64];
        v6.extend("fd00::1".parse::<Ipv6Addr>().unwrap().octets());
        v6.extend("fd00::2".parse::<Ipv6Addr>().unwrap().octets());
        v6.extend(443u16.to_be_bytes());
        v6.extend(80u16.to_be_bytes());
        let p = parse_packet(&v6).expect("IPv6 TCP");
        assert_eq!((p.dst, p.proto, p.ports), ("fd00::2".parse().unwrap(), 6, Some((443, 80))));

        assert_eq!(parse_packet(&[]), None);
        assert_eq!(parse_packet(&[0x45, 0, 0]), None, "truncated header");
        assert_eq!(parse_packet(&[0x20; 40]), None, "not IP");
        assert_eq!(parse_packet(&ipv4_udp([1, 1, 1, 1], [2, 2, 2, 2], 1, 2)[..22]).map(|p| p.ports), Some(None));
    }

    fn packet_message(nlas: Vec<PacketNla>) -> Vec<u8> {
        let mut msg = NetlinkMessage::new(
            NetlinkHeader::default(),
            NetlinkPayload::from(NetfilterMessage::new(
                NetfilterHeader::new(NetfilterProtoFamily::IPv4, 0, 7),
                ULogMessage::Packet(nlas),
            )),
        );
        msg.finalize();
        let mut bytes = vec![0; msg.header.length as usize];
        msg.serialize(&mut bytes);
        bytes
    }

    #[test]
    fn every_record_of_a_read_is_found_with_its_prefix_and_packet() {
        let mut bytes = packet_message(vec![
            PacketNla::Prefix(CString::new("policy-count-in-dropped-00ff").unwrap()),
            PacketNla::Payload(ipv4_udp([10, 0, 1, 1], [10, 0, 1, 2], 1, 7)),
        ]);
        while !bytes.len().is_multiple_of(4) {
            bytes.push(0);
        }
        bytes.extend(packet_message(vec![PacketNla::Prefix(CString::new("second").unwrap())]));
        let got = parse_messages(&bytes);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].prefix, "policy-count-in-dropped-00ff");
        assert_eq!(got[0].packet.and_then(|p| p.ports), Some((1, 7)));
        assert_eq!(got[1], Logged { prefix: "second".into(), packet: None });
        assert!(parse_messages(&bytes[..10]).is_empty(), "a torn message is not a record");
    }
}
