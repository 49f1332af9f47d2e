//! Packets a hostile pod writes itself and hides in the overlay's own
//! encapsulation (a plain UDP socket is enough): for showing that a node
//! does not take them for its peers' traffic.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;

/// An IPv4 packet carrying one UDP datagram (no UDP checksum, which IPv4
/// allows), with any source the caller likes.
pub fn ipv4_udp(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let total = u16::try_from(20 + udp_len).expect("a packet under 64 KiB");
    let mut p = Vec::with_capacity(usize::from(total));
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&total.to_be_bytes());
    p.extend_from_slice(&[0, 0, 0x40, 0]); // id 0, don't fragment
    p.extend_from_slice(&[64, 17, 0, 0]); // TTL, UDP, checksum below
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let sum = checksum(&p);
    p[10..12].copy_from_slice(&sum.to_be_bytes());
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&(udp_len as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(payload);
    p
}

/// A VXLAN payload (what goes in the UDP datagram to port 8472): the
/// header with `vni`, and an Ethernet frame to `dst_mac` (the receiving
/// node's VTEP, so that it routes what is inside) carrying `ip_packet`.
pub fn vxlan(vni: u32, dst_mac: [u8; 6], ip_packet: &[u8]) -> Vec<u8> {
    let mut f = vec![0x08, 0, 0, 0];
    f.extend_from_slice(&(vni << 8).to_be_bytes());
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&[0x02, 0x00, 0x5e, 0x00, 0x53, 0x01]); // any unicast source
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(ip_packet);
    f
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text.trim().split(':').map(|b| u8::from_str_radix(b, 16).ok()).collect::<Option<_>>()?;
    bytes.try_into().ok()
}

/// Sends `payload` `count` times from inside the network namespace at
/// `netns` to `to`, as any process of a pod can; how many sends the
/// kernel took (a drop further on is not seen here).
pub fn send_from(netns: impl Into<PathBuf>, to: SocketAddr, payload: Vec<u8>, count: usize) -> std::io::Result<usize> {
    let netns = netns.into();
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&netns)?;
        // This thread only; it ends here.
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        let socket = UdpSocket::bind(if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
        Ok((0..count).filter(|_| socket.send_to(&payload, to).is_ok()).count())
    })
    .join()
    .unwrap_or_else(|_| Err(std::io::Error::other("the sending thread panicked")))
}

/// The Internet checksum of `bytes`.
fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ipv4_header_checksums_to_zero_and_lengths_add_up() {
        let p = ipv4_udp("10.244.1.250".parse().unwrap(), "10.244.2.3".parse().unwrap(), 4000, 5000, b"hi");
        assert_eq!(p.len(), 30);
        assert_eq!(checksum(&p[..20]), 0, "a valid header sums to all ones");
        assert_eq!(u16::from_be_bytes([p[2], p[3]]), 30);
        assert_eq!(u16::from_be_bytes([p[24], p[25]]), 10, "UDP length");
        assert_eq!(&p[12..16], &[10, 244, 1, 250]);
    }

    #[test]
    fn a_vxlan_payload_has_the_flag_the_vni_and_the_inner_frame() {
        let dst = mac("0e:00:0a:fa:00:0c").expect("a MAC");
        let f = vxlan(1, dst, &[0x45]);
        assert_eq!(&f[..8], &[0x08, 0, 0, 0, 0, 0, 1, 0]);
        assert_eq!(&f[8..14], &dst);
        assert_eq!(&f[20..23], &[0x08, 0x00, 0x45]);
        assert_eq!(mac("0e:00:0a"), None);
    }
}
