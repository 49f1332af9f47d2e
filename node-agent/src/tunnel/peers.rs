//! Which peer node a pod packet goes to, and whether a packet that arrived
//! from a peer may enter: the lookup tables of the userspace datapath, built
//! once per change of peers and read for every packet.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

/// A peer node as the datapath needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelPeer {
    pub node_name: String,
    /// The peer's pod blocks: packets to them go to the peer, and packets
    /// from the peer must come from them.
    pub cidrs: Vec<IpNet>,
    /// Where its datagrams go: its node IP and the backend's port.
    pub endpoint: SocketAddr,
    /// WireGuard only: its public key.
    pub public_key: Option<[u8; 32]>,
}

/// An index into [`Table::peers`].
pub type PeerId = usize;

/// The peers, indexed by pod address (longest prefix), by node address
/// and by public key.
#[derive(Debug, Default)]
pub struct Table {
    peers: Vec<TunnelPeer>,
    /// (network address, prefix length) → peer.
    by_block: HashMap<(IpAddr, u8), PeerId>,
    /// The prefix lengths in use per family, longest first (peers' blocks
    /// are all of one or two lengths, so a lookup is one or two probes).
    lengths_v4: Vec<u8>,
    lengths_v6: Vec<u8>,
    by_endpoint: HashMap<IpAddr, PeerId>,
    by_key: HashMap<[u8; 32], PeerId>,
}

impl Table {
    /// A table of `peers`; the caller has validated them (blocks do not
    /// overlap, node addresses and keys are unique), so on a duplicate the
    /// first peer wins.
    pub fn new(peers: Vec<TunnelPeer>) -> Self {
        let mut t = Table { peers, ..Default::default() };
        for (id, p) in t.peers.iter().enumerate() {
            for block in &p.cidrs {
                let block = block.trunc();
                t.by_block.entry((block.network(), block.prefix_len())).or_insert(id);
                let lengths = if block.addr().is_ipv4() { &mut t.lengths_v4 } else { &mut t.lengths_v6 };
                if !lengths.contains(&block.prefix_len()) {
                    lengths.push(block.prefix_len());
                }
            }
            t.by_endpoint.entry(p.endpoint.ip()).or_insert(id);
            if let Some(key) = p.public_key {
                t.by_key.entry(key).or_insert(id);
            }
        }
        t.lengths_v4.sort_unstable_by(|a, b| b.cmp(a));
        t.lengths_v6.sort_unstable_by(|a, b| b.cmp(a));
        t
    }

    pub fn peers(&self) -> &[TunnelPeer] {
        &self.peers
    }

    pub fn get(&self, id: PeerId) -> Option<&TunnelPeer> {
        self.peers.get(id)
    }

    /// The peer whose pod block holds `dst`.
    pub fn route(&self, dst: IpAddr) -> Option<PeerId> {
        let lengths = if dst.is_ipv4() { &self.lengths_v4 } else { &self.lengths_v6 };
        lengths.iter().find_map(|len| {
            let block = IpNet::new(dst, *len).ok()?.trunc();
            self.by_block.get(&(block.network(), *len)).copied()
        })
    }

    pub fn by_endpoint(&self, ip: IpAddr) -> Option<PeerId> {
        self.by_endpoint.get(&ip).copied()
    }

    pub fn by_key(&self, key: &[u8; 32]) -> Option<PeerId> {
        self.by_key.get(key).copied()
    }

    /// Whether a packet from `src` may come out of peer `id`'s tunnel: its
    /// source must be one of that peer's pod addresses (WireGuard's
    /// cryptokey routing; for udp, a node cannot inject packets in the name
    /// of another node's pods).
    pub fn allows(&self, id: PeerId, src: IpAddr) -> bool {
        self.route(src) == Some(id)
    }
}

/// The source and destination of an IP packet, if it is one.
pub fn addresses(packet: &[u8]) -> Option<(IpAddr, IpAddr)> {
    match packet.first()? >> 4 {
        4 if packet.len() >= 20 => {
            let src: [u8; 4] = packet[12..16].try_into().ok()?;
            let dst: [u8; 4] = packet[16..20].try_into().ok()?;
            Some((src.into(), dst.into()))
        }
        6 if packet.len() >= 40 => {
            let src: [u8; 16] = packet[8..24].try_into().ok()?;
            let dst: [u8; 16] = packet[24..40].try_into().ok()?;
            Some((src.into(), dst.into()))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &str, cidrs: &[&str], endpoint: &str, key: Option<u8>) -> TunnelPeer {
        TunnelPeer {
            node_name: name.into(),
            cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            endpoint: endpoint.parse().unwrap(),
            public_key: key.map(|k| [k; 32]),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn packets_go_to_the_peer_whose_block_holds_their_destination() {
        let t = Table::new(vec![
            peer("n2", &["10.244.2.0/24", "fd00:10:244:2::/64"], "10.0.0.2:8285", Some(2)),
            peer("n3", &["10.244.3.0/24"], "10.0.0.3:8285", None),
            peer("n4", &["10.245.0.0/16"], "10.0.0.4:8285", None),
        ]);
        assert_eq!(t.route(ip("10.244.2.7")), Some(0));
        assert_eq!(t.route(ip("10.244.3.255")), Some(1));
        assert_eq!(t.route(ip("10.245.9.9")), Some(2), "blocks of other lengths");
        assert_eq!(t.route(ip("fd00:10:244:2::9")), Some(0));
        assert_eq!(t.route(ip("10.244.4.1")), None);
        assert_eq!(t.route(ip("fd00:10:244:3::9")), None);
        assert_eq!(t.by_endpoint(ip("10.0.0.3")), Some(1));
        assert_eq!(t.by_key(&[2; 32]), Some(0));
        assert_eq!(t.by_key(&[3; 32]), None);
    }

    #[test]
    fn a_peer_may_send_only_from_its_own_pod_blocks() {
        let t = Table::new(vec![
            peer("n2", &["10.244.2.0/24"], "10.0.0.2:8285", None),
            peer("n3", &["10.244.3.0/24"], "10.0.0.3:8285", None),
        ]);
        assert!(t.allows(0, ip("10.244.2.9")));
        assert!(!t.allows(0, ip("10.244.3.9")), "another node's pod");
        assert!(!t.allows(0, ip("10.244.1.9")), "one of ours");
        assert!(!t.allows(0, ip("192.168.1.1")), "outside the cluster");
    }

    #[test]
    fn addresses_are_read_from_both_families_and_garbage_is_none() {
        let mut v4 = [0u8; 20];
        v4[0] = 0x45;
        v4[12..16].copy_from_slice(&[10, 244, 1, 2]);
        v4[16..20].copy_from_slice(&[10, 244, 2, 3]);
        assert_eq!(addresses(&v4), Some((ip("10.244.1.2"), ip("10.244.2.3"))));
        let mut v6 = [0u8; 40];
        v6[0] = 0x60;
        v6[23] = 1;
        v6[39] = 2;
        assert_eq!(addresses(&v6), Some((ip("::1"), ip("::2"))));
        assert_eq!(addresses(&v4[..19]), None);
        assert_eq!(addresses(&[]), None);
        assert_eq!(addresses(&[0x70; 40]), None);
    }
}
