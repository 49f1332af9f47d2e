//! TUN offloads: the device is opened with `IFF_VNET_HDR` and TSO, so the
//! kernel hands over a TCP stream's data in packets of up to 64 KiB (one
//! read instead of forty), and takes such packets back (one write, one pass
//! through routing and the firewall instead of forty). Each packet carries
//! a `virtio_net_hdr` in front.
//!
//! Pure code, no I/O: [`segment`] cuts what the kernel hands over into the
//! packets that travel (each within the device's MTU, checksums complete);
//! [`Coalescer`] joins what arrives back into as few packets as the kernel
//! allows, after checking every segment's checksum. This is what the
//! kernel's own GSO and GRO do, and what wireguard-go does in userspace.

use std::fmt;

/// Bytes of `struct virtio_net_hdr` in front of every packet.
pub const VNET_HDR_LEN: usize = 10;

const F_NEEDS_CSUM: u8 = 1;
const GSO_NONE: u8 = 0;
const GSO_TCPV4: u8 = 1;
const GSO_TCPV6: u8 = 4;
const GSO_ECN: u8 = 0x80;

const TCP: u8 = 6;
const TCP_CSUM_OFFSET: usize = 16;
const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;
const URG: u8 = 0x20;
const ECE: u8 = 0x40;
const CWR: u8 = 0x80;
/// The kernel's limit on one packet's IP length.
const MAX_PACKET: usize = 65_535;
/// Segments joined into one packet at most (as the kernel's GRO).
const MAX_SEGMENTS: usize = 64;

/// `struct virtio_net_hdr`, in the host's byte order (the TUN device's
/// default for it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn parse(b: &[u8]) -> Option<Self> {
        let b: &[u8; VNET_HDR_LEN] = b.get(..VNET_HDR_LEN)?.try_into().ok()?;
        let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        Some(VnetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
        })
    }

    pub fn write(&self, b: &mut [u8]) {
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_ne_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_ne_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_ne_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_ne_bytes());
    }
}

/// Why a packet from the device could not be cut into packets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(&'static str);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// The Internet checksum's running sum of `data` (big-endian 16-bit words,
/// an odd last byte padded), added to `sum`; eight bytes at a time.
fn add(mut sum: u64, data: &[u8]) -> u64 {
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_be_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        sum += (w >> 32) + (w & 0xffff_ffff);
    }
    let mut rest = words.remainder().chunks_exact(2);
    for w in &mut rest {
        sum += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = rest.remainder() {
        sum += u64::from(*last) << 8;
    }
    sum
}

/// `sum` folded to 16 bits (not complemented).
fn fold(mut sum: u64) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The IP header's fields a transport checksum covers: addresses,
/// protocol and the transport length.
fn pseudo_header(packet: &[u8], l4_len: usize) -> u64 {
    let (addresses, proto) = if packet[0] >> 4 == 4 { (&packet[12..20], packet[9]) } else { (&packet[8..40], TCP) };
    add(0, addresses) + u64::from(proto) + l4_len as u64
}

fn set_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Writes the IPv4 header checksum of `packet` (header of `ihl` bytes).
fn ipv4_header_checksum(packet: &mut [u8], ihl: usize) {
    set_u16(packet, 10, 0);
    let c = !fold(add(0, &packet[..ihl]));
    set_u16(packet, 10, c);
}

/// Writes the complete TCP checksum of `packet` (transport at `l4`).
fn tcp_checksum(packet: &mut [u8], l4: usize) {
    set_u16(packet, l4 + TCP_CSUM_OFFSET, 0);
    let c = !fold(add(pseudo_header(packet, packet.len() - l4), &packet[l4..]));
    set_u16(packet, l4 + TCP_CSUM_OFFSET, c);
}

fn tcp_checksum_valid(packet: &[u8], l4: usize) -> bool {
    fold(add(pseudo_header(packet, packet.len() - l4), &packet[l4..])) == 0xffff
}

/// Where a TCP packet's parts are: the transport header's offset and the
/// payload's. None for anything else, or a header that does not fit.
fn tcp_layout(packet: &[u8]) -> Option<(usize, usize)> {
    let l4 = match packet.first()? >> 4 {
        4 if packet.len() >= 20 && packet[9] == TCP => usize::from(packet[0] & 0x0f) * 4,
        6 if packet.len() >= 40 && packet[6] == TCP => 40,
        _ => return None,
    };
    let data = l4 + usize::from(*packet.get(l4 + 12)? >> 4) * 4;
    (l4 >= 20 && data >= l4 + 20 && data <= packet.len()).then_some((l4, data))
}

/// How many packets `segment` makes of `packet` (at least one), without
/// cutting it: for counting what is dropped whole.
pub fn segments(hdr: &VnetHdr, packet: &[u8]) -> u64 {
    let mss = usize::from(hdr.gso_size);
    match tcp_layout(packet) {
        Some((_, data)) if hdr.gso_type != GSO_NONE && mss > 0 => (packet.len() - data).div_ceil(mss).max(1) as u64,
        _ => 1,
    }
}

/// Cuts a packet read from the device (`packet`, after its header `hdr`)
/// into the packets it stands for, each with its checksums complete, and
/// hands each to `each`. A packet without GSO is only completed (in place).
/// `scratch` holds one segment at a time.
pub fn segment(
    hdr: &VnetHdr,
    packet: &mut [u8],
    scratch: &mut Vec<u8>,
    each: &mut dyn FnMut(&[u8]),
) -> Result<(), Malformed> {
    if hdr.gso_type == GSO_NONE {
        if hdr.flags & F_NEEDS_CSUM != 0 {
            let start = usize::from(hdr.csum_start);
            let field = start + usize::from(hdr.csum_offset);
            if field + 2 > packet.len() {
                return Err(Malformed("checksum offset beyond the packet"));
            }
            // The field holds the pseudo-header's sum: the rest is added.
            let c = !fold(add(0, &packet[start..]));
            set_u16(packet, field, c);
        }
        each(packet);
        return Ok(());
    }
    let v6 = match hdr.gso_type & !GSO_ECN {
        GSO_TCPV4 => false,
        GSO_TCPV6 => true,
        _ => return Err(Malformed("a GSO type other than TCP")),
    };
    let (l4, data) = tcp_layout(packet).ok_or(Malformed("a TCP GSO packet without a TCP header"))?;
    if (packet[0] >> 4 == 6) != v6 || usize::from(hdr.csum_start) != l4 {
        return Err(Malformed("a GSO packet whose header disagrees with it"));
    }
    let mss = usize::from(hdr.gso_size);
    if mss == 0 {
        return Err(Malformed("a GSO packet without a segment size"));
    }
    let (id, seq, flags) = (u16_at(packet, 4), u32_at(packet, l4 + 4), packet[l4 + 13]);
    let payloads = packet[data..].chunks(mss);
    let last = payloads.len().saturating_sub(1);
    for (i, payload) in payloads.enumerate() {
        scratch.clear();
        scratch.extend_from_slice(&packet[..data]);
        scratch.extend_from_slice(payload);
        let len = scratch.len();
        if v6 {
            set_u16(scratch, 4, (len - 40) as u16);
        } else {
            set_u16(scratch, 2, len as u16);
            set_u16(scratch, 4, id.wrapping_add(i as u16));
            ipv4_header_checksum(scratch, l4);
        }
        scratch[l4 + 4..l4 + 8].copy_from_slice(&seq.wrapping_add((i * mss) as u32).to_be_bytes());
        let mut f = flags;
        if i != last {
            f &= !(FIN | PSH);
        }
        if i != 0 {
            f &= !CWR;
        }
        scratch[l4 + 13] = f;
        tcp_checksum(scratch, l4);
        each(scratch);
    }
    Ok(())
}

/// A packet on its way into the device: `buf` holds its header room and
/// the packet; more segments of one flow may join it.
struct Slot {
    buf: Vec<u8>,
    /// The transport header's and the payload's offsets (in the packet);
    /// None: nothing may join.
    tcp: Option<(usize, usize)>,
    segment: usize,
    segments: usize,
    next_seq: u32,
    open: bool,
}

impl Slot {
    fn packet(&self) -> &[u8] {
        &self.buf[VNET_HDR_LEN..]
    }

    /// True when `packet` (a TCP packet laid out as `tcp`) is of this
    /// slot's flow: same addresses and ports (whether or not it may join).
    fn same_flow(&self, packet: &[u8], (l4, _): (usize, usize)) -> bool {
        let Some((my_l4, _)) = self.tcp else { return false };
        let mine = self.packet();
        let addresses = if packet[0] >> 4 == 4 { 12..20 } else { 8..40 };
        my_l4 == l4
            && mine[0] >> 4 == packet[0] >> 4
            && mine[addresses.clone()] == packet[addresses]
            && mine[l4..l4 + 4] == packet[l4..l4 + 4]
    }

    /// True when `packet`, of this slot's flow, continues it: the next
    /// bytes, no longer than the first segment, and headers the kernel
    /// treats as one packet's (as its GRO: same IP fields, same ack,
    /// window and options).
    fn continues(&self, packet: &[u8], (l4, data): (usize, usize)) -> bool {
        let mine = self.packet();
        let payload = packet.len() - data;
        let same_ip = if packet[0] >> 4 == 4 {
            mine[1] == packet[1] && mine[8] == packet[8] && mine[6..8] == packet[6..8]
        } else {
            mine[..4] == packet[..4] && mine[7] == packet[7]
        };
        self.open
            && Some((l4, data)) == self.tcp
            && same_ip
            && u32_at(packet, l4 + 4) == self.next_seq
            && payload <= self.segment
            && mine[l4 + 8..l4 + 13] == packet[l4 + 8..l4 + 13]
            && mine[l4 + 14..l4 + 16] == packet[l4 + 14..l4 + 16]
            && mine[l4 + 18..data] == packet[l4 + 18..data]
            && self.segments < MAX_SEGMENTS
            && mine.len() + payload <= MAX_PACKET
    }

    /// The header the packet goes into the device with.
    fn finish(&mut self) -> VnetHdr {
        let Some((l4, data)) = self.tcp.filter(|_| self.segments > 1) else { return VnetHdr::default() };
        let packet = &mut self.buf[VNET_HDR_LEN..];
        let len = packet.len();
        let v6 = packet[0] >> 4 == 6;
        if v6 {
            set_u16(packet, 4, (len - 40) as u16);
        } else {
            set_u16(packet, 2, len as u16);
            ipv4_header_checksum(packet, l4);
        }
        // As a partial checksum: the kernel adds the rest (or trusts it).
        let pseudo = fold(pseudo_header(packet, len - l4));
        set_u16(packet, l4 + TCP_CSUM_OFFSET, pseudo);
        VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: if v6 { GSO_TCPV6 } else { GSO_TCPV4 },
            hdr_len: data as u16,
            gso_size: self.segment as u16,
            csum_start: l4 as u16,
            csum_offset: TCP_CSUM_OFFSET as u16,
        }
    }
}

/// True for a TCP segment that may be joined with others: data with only
/// ACK (and PSH, which ends a run), an IPv4 header without options or
/// fragmentation, and correct checksums (a joined packet's is trusted by
/// the kernel, so each part is checked here, as the kernel's GRO does).
fn joinable(packet: &[u8], (l4, data): (usize, usize)) -> bool {
    let flags = packet[l4 + 13];
    let ip_ok = if packet[0] >> 4 == 4 {
        l4 == 20
            && u16_at(packet, 6) & 0x3fff == 0
            && usize::from(u16_at(packet, 2)) == packet.len()
            && fold(add(0, &packet[..20])) == 0xffff
    } else {
        usize::from(u16_at(packet, 4)) + 40 == packet.len()
    };
    ip_ok
        && data < packet.len()
        && flags & ACK != 0
        && flags & (FIN | SYN | RST | URG | ECE | CWR) == 0
        && tcp_checksum_valid(packet, l4)
}

/// Packets on their way into the device, joined where they can be. Push a
/// batch (in arrival order), then take the packets with [`Coalescer::drain`].
#[derive(Default)]
pub struct Coalescer {
    slots: Vec<Slot>,
    spare: Vec<Vec<u8>>,
}

impl Coalescer {
    pub fn push(&mut self, packet: &[u8]) {
        let layout = tcp_layout(packet);
        let tcp = layout.filter(|&t| joinable(packet, t));
        if let Some(t) = layout
            && let Some(slot) = self.slots.iter_mut().rev().find(|s| s.same_flow(packet, t))
        {
            if tcp.is_some() && slot.continues(packet, t) {
                let payload = &packet[t.1..];
                slot.buf.extend_from_slice(payload);
                slot.segments += 1;
                slot.next_seq = slot.next_seq.wrapping_add(payload.len() as u32);
                let push = packet[t.0 + 13] & PSH;
                slot.buf[VNET_HDR_LEN + t.0 + 13] |= push;
                slot.open = payload.len() == slot.segment && push == 0;
                return;
            }
            // Its flow's packets stay in order (this one may not even be
            // joinable, as a pure ACK): nothing joins the older one.
            slot.open = false;
        }
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(VNET_HDR_LEN, 0);
        buf.extend_from_slice(packet);
        let (segment, next_seq, open) = match tcp {
            Some((l4, data)) => {
                let payload = packet.len() - data;
                (payload, u32_at(packet, l4 + 4).wrapping_add(payload as u32), packet[l4 + 13] & PSH == 0)
            }
            None => (0, 0, false),
        };
        self.slots.push(Slot { buf, tcp, segment, segments: 1, next_seq, open });
    }

    /// Hands each packet, header in front, to `write` with the number of
    /// segments it carries, in order.
    pub fn drain(&mut self, write: &mut dyn FnMut(&[u8], u64)) {
        for mut slot in self.slots.drain(..) {
            let hdr = slot.finish();
            hdr.write(&mut slot.buf[..VNET_HDR_LEN]);
            write(&slot.buf, slot.segments as u64);
            self.spare.push(slot.buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TCP packet: `v6` or IPv4, with `payload` at sequence number `seq`.
    fn tcp_packet(v6: bool, seq: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
        let l4 = if v6 { 40 } else { 20 };
        let mut p = vec![0u8; l4 + 20 + payload.len()];
        if v6 {
            p[0] = 0x60;
            set_u16(&mut p, 4, (20 + payload.len()) as u16);
            p[6] = TCP;
            p[7] = 64;
            p[8..24].copy_from_slice(&"fd00:10:244:1::5".parse::<std::net::Ipv6Addr>().unwrap().octets());
            p[24..40].copy_from_slice(&"fd00:10:244:2::7".parse::<std::net::Ipv6Addr>().unwrap().octets());
        } else {
            p[0] = 0x45;
            let len = p.len() as u16;
            set_u16(&mut p, 2, len);
            set_u16(&mut p, 6, 0x4000);
            p[8] = 64;
            p[9] = TCP;
            p[12..16].copy_from_slice(&[10, 244, 1, 5]);
            p[16..20].copy_from_slice(&[10, 244, 2, 7]);
            ipv4_header_checksum(&mut p, 20);
        }
        set_u16(&mut p, l4, 40000);
        set_u16(&mut p, l4 + 2, 80);
        p[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
        p[l4 + 8..l4 + 12].copy_from_slice(&7u32.to_be_bytes());
        p[l4 + 12] = 5 << 4;
        p[l4 + 13] = flags;
        set_u16(&mut p, l4 + 14, 502);
        p[l4 + 20..].copy_from_slice(payload);
        tcp_checksum(&mut p, l4);
        p
    }

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// What the kernel hands over for `payload` sent with TSO: one packet
    /// with a partial checksum.
    fn gso_packet(v6: bool, payload: &[u8], mss: u16) -> (VnetHdr, Vec<u8>) {
        let l4 = if v6 { 40 } else { 20 };
        let mut p = tcp_packet(v6, 1000, ACK | PSH, payload);
        let pseudo = fold(pseudo_header(&p, p.len() - l4));
        set_u16(&mut p, l4 + 16, pseudo);
        let hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: if v6 { GSO_TCPV6 } else { GSO_TCPV4 },
            hdr_len: (l4 + 20) as u16,
            gso_size: mss,
            csum_start: l4 as u16,
            csum_offset: 16,
        };
        (hdr, p)
    }

    fn cut(hdr: &VnetHdr, packet: &mut [u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        segment(hdr, packet, &mut Vec::new(), &mut |p| out.push(p.to_vec())).expect("segments");
        out
    }

    #[test]
    fn the_header_reads_back_as_written() {
        let hdr = VnetHdr { flags: 1, gso_type: 4, hdr_len: 60, gso_size: 1380, csum_start: 40, csum_offset: 16 };
        let mut b = [0u8; VNET_HDR_LEN];
        hdr.write(&mut b);
        assert_eq!(VnetHdr::parse(&b), Some(hdr));
        assert_eq!(VnetHdr::parse(&b[..9]), None);
    }

    #[test]
    fn a_tso_packet_becomes_the_segments_the_kernel_would_send() {
        for v6 in [false, true] {
            let payload = bytes(10_000);
            let (hdr, mut p) = gso_packet(v6, &payload, 1400);
            assert_eq!(super::segments(&hdr, &p), 8);
            let segments = cut(&hdr, &mut p);
            assert_eq!(segments.len(), 8, "v6 {v6}");
            assert_eq!(super::segments(&VnetHdr::default(), &segments[0]), 1);
            let l4 = if v6 { 40 } else { 20 };
            let mut joined = Vec::new();
            for (i, s) in segments.iter().enumerate() {
                assert!(s.len() <= l4 + 20 + 1400);
                assert!(tcp_checksum_valid(s, l4), "segment {i}: TCP checksum");
                if !v6 {
                    assert_eq!(fold(add(0, &s[..20])), 0xffff, "segment {i}: IPv4 header checksum");
                    assert_eq!(usize::from(u16_at(s, 2)), s.len());
                    assert_eq!(u16_at(s, 4), i as u16, "IPv4 ids count up");
                } else {
                    assert_eq!(usize::from(u16_at(s, 4)) + 40, s.len());
                }
                assert_eq!(u32_at(s, l4 + 4), 1000 + 1400 * i as u32, "sequence number");
                let psh = s[l4 + 13] & PSH != 0;
                assert_eq!(psh, i == 7, "PSH only on the last segment");
                joined.extend_from_slice(&s[l4 + 20..]);
            }
            assert_eq!(joined, payload);
        }
    }

    #[test]
    fn a_partial_checksum_is_completed_and_other_packets_pass_as_they_are() {
        let mut p = tcp_packet(false, 1, ACK, b"hello");
        let full = p.clone();
        let pseudo = fold(pseudo_header(&p, p.len() - 20));
        set_u16(&mut p, 36, pseudo);
        let hdr = VnetHdr { flags: F_NEEDS_CSUM, csum_start: 20, csum_offset: 16, ..VnetHdr::default() };
        assert_eq!(cut(&hdr, &mut p), vec![full.clone()]);
        assert_eq!(cut(&VnetHdr::default(), &mut full.clone()), vec![full]);
    }

    #[test]
    fn malformed_gso_packets_are_refused() {
        let (hdr, mut p) = gso_packet(false, &bytes(3000), 1400);
        let udp = VnetHdr { gso_type: 5, ..hdr };
        assert!(segment(&udp, &mut p.clone(), &mut Vec::new(), &mut |_| ()).is_err());
        let no_size = VnetHdr { gso_size: 0, ..hdr };
        assert!(segment(&no_size, &mut p.clone(), &mut Vec::new(), &mut |_| ()).is_err());
        let wrong_family = VnetHdr { gso_type: GSO_TCPV6, ..hdr };
        assert!(segment(&wrong_family, &mut p.clone(), &mut Vec::new(), &mut |_| ()).is_err());
        p.truncate(30);
        assert!(segment(&hdr, &mut p, &mut Vec::new(), &mut |_| ()).is_err());
        let beyond = VnetHdr { flags: F_NEEDS_CSUM, csum_start: 20, csum_offset: 16, ..VnetHdr::default() };
        assert!(segment(&beyond, &mut [0x45; 30], &mut Vec::new(), &mut |_| ()).is_err());
        let overflowing = VnetHdr { csum_start: u16::MAX, csum_offset: u16::MAX, ..beyond };
        assert!(segment(&overflowing, &mut [0x45; 30], &mut Vec::new(), &mut |_| ()).is_err());
    }

    fn drained(c: &mut Coalescer) -> Vec<(VnetHdr, Vec<u8>)> {
        let mut out = Vec::new();
        c.drain(&mut |b, _| out.push((VnetHdr::parse(b).unwrap(), b[VNET_HDR_LEN..].to_vec())));
        out
    }

    #[test]
    fn segments_of_a_flow_are_joined_and_cut_back_into_the_same_segments() {
        for v6 in [false, true] {
            let (hdr, mut p) = gso_packet(v6, &bytes(20_000), 1400);
            let segments = cut(&hdr, &mut p);
            let mut c = Coalescer::default();
            for s in &segments {
                c.push(s);
            }
            let out = drained(&mut c);
            assert_eq!(out.len(), 1, "one packet (v6 {v6})");
            let (joined_hdr, mut joined) = out.into_iter().next().unwrap();
            assert_eq!(joined_hdr.gso_size, 1400);
            assert_eq!(joined_hdr.flags, F_NEEDS_CSUM);
            assert_eq!(cut(&joined_hdr, &mut joined), segments, "the kernel's GSO gives back the same segments");
        }
    }

    #[test]
    fn what_may_not_be_joined_is_written_as_it_came_in_order() {
        let a = tcp_packet(false, 0, ACK, &bytes(100));
        // A gap, a SYN, a bad checksum, a shorter segment then a longer one.
        let gap = tcp_packet(false, 300, ACK, &bytes(100));
        let syn = tcp_packet(false, 400, SYN, &[]);
        let mut bad = tcp_packet(false, 400, ACK, &bytes(100));
        bad[45] ^= 1;
        let short = tcp_packet(false, 500, ACK, &bytes(50));
        let long = tcp_packet(false, 550, ACK, &bytes(100));
        let udp = {
            let mut p = a.clone();
            p[9] = 17;
            p
        };
        let mut other_flow = tcp_packet(false, 100, ACK, &bytes(100));
        other_flow[16..20].copy_from_slice(&[10, 244, 3, 9]);
        tcp_checksum(&mut other_flow, 20);
        ipv4_header_checksum(&mut other_flow, 20);
        let input = [&a, &other_flow, &gap, &syn, &bad, &short, &long, &udp];
        let mut c = Coalescer::default();
        for p in input {
            c.push(p);
        }
        let out = drained(&mut c);
        assert!(
            out.iter().all(|(h, _)| *h == VnetHdr::default()),
            "nothing joined: {:?}",
            out.iter().map(|o| o.0).collect::<Vec<_>>()
        );
        assert_eq!(out.into_iter().map(|o| o.1).collect::<Vec<_>>(), input.map(|p| p.clone()).to_vec());
    }

    #[test]
    fn a_packet_of_the_flow_that_may_not_join_keeps_later_segments_behind_it() {
        let a = tcp_packet(false, 0, ACK, &bytes(100));
        let window_update = tcp_packet(false, 100, ACK, &[]);
        let b = tcp_packet(false, 100, ACK, &bytes(100));
        let mut c = Coalescer::default();
        for p in [&a, &window_update, &b] {
            c.push(p);
        }
        let out: Vec<Vec<u8>> = drained(&mut c).into_iter().map(|o| o.1).collect();
        assert_eq!(out, vec![a, window_update, b], "in the order they came");
    }

    #[test]
    fn a_segment_with_a_bad_ipv4_header_checksum_is_not_joined() {
        let a = tcp_packet(false, 0, ACK, &bytes(100));
        let mut b = tcp_packet(false, 100, ACK, &bytes(100));
        // Outside the TCP checksum: only the header's own tells.
        b[5] ^= 0x40;
        let mut c = Coalescer::default();
        c.push(&a);
        c.push(&b);
        let out = drained(&mut c);
        assert_eq!(out.len(), 2, "written apart, for the kernel to drop");
        assert_eq!(out[1], (VnetHdr::default(), b));
    }

    #[test]
    fn a_shorter_or_pushed_segment_ends_a_run_and_keeps_its_flag() {
        let mut c = Coalescer::default();
        c.push(&tcp_packet(true, 0, ACK, &bytes(100)));
        c.push(&tcp_packet(true, 100, ACK | PSH, &bytes(100)));
        c.push(&tcp_packet(true, 200, ACK, &bytes(100)));
        c.push(&tcp_packet(true, 300, ACK, &bytes(40)));
        c.push(&tcp_packet(true, 340, ACK, &bytes(40)));
        let out = drained(&mut c);
        let segments: Vec<u16> = out.iter().map(|(h, _)| h.gso_size).collect();
        assert_eq!(segments, vec![100, 100, 0], "runs: [0,100] pushed, [200,300], then the last alone");
        assert_eq!(out[0].1[40 + 13] & PSH, PSH);
        assert_eq!(out[1].1.len(), 40 + 20 + 140);
        assert!(drained(&mut c).is_empty(), "a drain leaves nothing behind");
    }

    proptest::proptest! {
        /// Whatever a peer sends (it reaches the coalescer after the
        /// source check), nothing panics, every packet comes out once, and
        /// a stream's segments cut from a TSO packet come back joined into
        /// packets that cut into the same segments.
        #[test]
        fn any_input_comes_out_whole_and_streams_round_trip(
            garbage in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..80), 0..8),
            flip in proptest::option::of((0usize..100_000, 1u8..=255)),
            len in 1usize..30_000,
            mss in 500u16..1500,
            v6 in proptest::bool::ANY,
        ) {
            let (hdr, mut p) = gso_packet(v6, &bytes(len), mss);
            let segments = cut(&hdr, &mut p);
            let mut c = Coalescer::default();
            for g in &garbage {
                c.push(g);
            }
            for s in &segments {
                c.push(s);
            }
            let mut written = 0u64;
            let mut joined = Vec::new();
            c.drain(&mut |b, n| {
                written += n;
                joined.push((VnetHdr::parse(b).unwrap(), b[VNET_HDR_LEN..].to_vec()));
            });
            proptest::prop_assert_eq!(written, (garbage.len() + segments.len()) as u64);
            let mut again = Vec::new();
            for (h, mut packet) in joined.into_iter().skip(garbage.len()) {
                segment(&h, &mut packet, &mut Vec::new(), &mut |s| again.push(s.to_vec())).unwrap();
            }
            proptest::prop_assert_eq!(&again, &segments);

            // A corrupted segment is never joined into a packet the kernel
            // would trust: it comes out as it went in.
            let mut corrupted = segments.clone();
            if let Some((at, bits)) = flip {
                let s = &mut corrupted[at % segments.len()];
                let i = at % s.len();
                s[i] ^= bits;
            }
            for s in &corrupted {
                c.push(s);
            }
            let mut out = Vec::new();
            c.drain(&mut |b, _| out.push((VnetHdr::parse(b).unwrap(), b[VNET_HDR_LEN..].to_vec())));
            for (h, packet) in out {
                if h != VnetHdr::default() {
                    let l4 = usize::from(h.csum_start);
                    let mut whole = packet.clone();
                    let mut parts = Vec::new();
                    segment(&h, &mut whole, &mut Vec::new(), &mut |s| parts.push(s.to_vec())).unwrap();
                    for part in parts {
                        proptest::prop_assert!(tcp_checksum_valid(&part, l4));
                        proptest::prop_assert!(segments.contains(&part), "a joined part is an original segment");
                    }
                }
            }
        }
    }
}
