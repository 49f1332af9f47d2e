//! The WireGuard protocol between nodes (boringtun's `noise` module: Noise
//! IK handshake, ChaCha20-Poly1305, replay protection, rekeying): the same
//! wire format as the kernel's and wireguard-go, so any WireGuard peer
//! configured with a node's published key can talk to it.
//!
//! Each peer node is one `Tunn`, created when its public key first appears
//! and kept while the key stays (a resync never restarts a session). A
//! datagram names its peer by the receiver index this node handed out, or,
//! for a handshake initiation, by the initiator's static key, which only
//! this node's private key can decrypt. Endpoints are the peers' node
//! addresses from the API, never learned from packets (no roaming), and
//! set again on every change of peers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::{Packet, Tunn, TunnResult};
use boringtun::x25519::{PublicKey, StaticSecret};

use super::{Encapsulation, Sender, Table, TunnelPeer};

pub const DEFAULT_PORT: u16 = 51820;
/// Bytes each packet grows by, besides the underlay's IP and UDP headers:
/// type, receiver index, counter, and the Poly1305 tag.
pub const OVERHEAD: u32 = 32;
/// Peers' indices are 24 bits; the low 8 are the session's.
const MAX_INDEX: u32 = (1 << 24) - 1;

pub struct WireGuard {
    keys: RwLock<(StaticSecret, PublicKey)>,
    state: RwLock<State>,
    next_index: AtomicU32,
}

#[derive(Default)]
struct State {
    by_key: HashMap<[u8; 32], Arc<Peer>>,
    by_index: HashMap<u32, Arc<Peer>>,
}

struct Peer {
    key: [u8; 32],
    /// Not yet greeted: the next tick starts a handshake, so that a
    /// restarted node (whose peers still hold sessions it has forgotten)
    /// is reachable again at once, not when their sessions expire.
    fresh: AtomicBool,
    session: Mutex<Session>,
}

struct Session {
    tunn: Tunn,
    endpoint: SocketAddr,
}

impl WireGuard {
    pub fn new(private: StaticSecret) -> Self {
        let public = PublicKey::from(&private);
        Self { keys: RwLock::new((private, public)), state: RwLock::default(), next_index: AtomicU32::new(1) }
    }

    pub fn public_key(&self) -> [u8; 32] {
        self.keys.read().map(|k| *k.1.as_bytes()).unwrap_or_default()
    }

    fn private_key(&self) -> Option<StaticSecret> {
        self.keys.read().ok().map(|k| k.0.clone())
    }

    fn peer_of(&self, packet: &Packet<'_>) -> Option<Arc<Peer>> {
        let state = self.state.read().ok()?;
        let index = match packet {
            Packet::HandshakeInit(init) => {
                let half = {
                    let keys = self.keys.read().ok()?;
                    parse_handshake_anon(&keys.0, &keys.1, init).ok()?
                };
                return state.by_key.get(&half.peer_static_public).cloned();
            }
            Packet::HandshakeResponse(p) => p.receiver_idx,
            Packet::PacketCookieReply(p) => p.receiver_idx,
            Packet::PacketData(p) => p.receiver_idx,
        };
        state.by_index.get(&(index >> 8)).cloned()
    }

    fn allocate_index(&self, state: &State) -> u32 {
        loop {
            let i = self.next_index.fetch_add(1, Ordering::Relaxed) & MAX_INDEX;
            if i != 0 && !state.by_index.contains_key(&i) {
                return i;
            }
        }
    }
}

impl Encapsulation for WireGuard {
    fn set_peers(&self, table: &Table) {
        let Some(private) = self.private_key() else { return };
        let Ok(mut state) = self.state.write() else { return };
        let mut keep: HashMap<[u8; 32], Arc<Peer>> = HashMap::new();
        for p in table.peers() {
            let Some(key) = p.public_key else { continue };
            if key == self.public_key() {
                continue;
            }
            let peer = match state.by_key.get(&key) {
                Some(peer) => {
                    if let Ok(mut s) = peer.session.lock() {
                        s.endpoint = p.endpoint;
                    }
                    Arc::clone(peer)
                }
                None => {
                    let index = self.allocate_index(&state);
                    let tunn = Tunn::new(private.clone(), PublicKey::from(key), None, None, index, None);
                    let peer = Arc::new(Peer {
                        key,
                        fresh: AtomicBool::new(true),
                        session: Mutex::new(Session { tunn, endpoint: p.endpoint }),
                    });
                    state.by_index.insert(index, Arc::clone(&peer));
                    peer
                }
            };
            keep.insert(key, peer);
        }
        state.by_index.retain(|_, p| keep.contains_key(&p.key));
        state.by_key = keep;
    }

    fn seal<'a>(&self, peer: &TunnelPeer, packet: &'a [u8], out: &'a mut [u8]) -> Option<&'a [u8]> {
        let key = peer.public_key?;
        let peer = self.state.read().ok()?.by_key.get(&key).cloned()?;
        let mut session = peer.session.lock().ok()?;
        match session.tunn.encapsulate(packet, out) {
            TunnResult::WriteToNetwork(datagram) => Some(datagram),
            // Queued until the handshake completes.
            _ => None,
        }
    }

    fn open(
        &self,
        from: SocketAddr,
        datagram: &[u8],
        out: &mut [u8],
        send: &mut dyn FnMut(SocketAddr, &[u8]),
        deliver: &mut dyn FnMut(Sender, &[u8]),
    ) -> bool {
        let Ok(packet) = Tunn::parse_incoming_packet(datagram) else { return false };
        let Some(peer) = self.peer_of(&packet) else { return false };
        let Ok(mut session) = peer.session.lock() else { return false };
        let endpoint = session.endpoint;
        match session.tunn.decapsulate(Some(from.ip()), datagram, out) {
            TunnResult::WriteToNetwork(reply) => {
                send(endpoint, reply);
                // Packets queued behind the handshake go out now.
                while let TunnResult::WriteToNetwork(queued) = session.tunn.decapsulate(None, &[], out) {
                    send(endpoint, queued);
                }
                true
            }
            TunnResult::WriteToTunnelV4(packet, _) | TunnResult::WriteToTunnelV6(packet, _) => {
                deliver(Sender::Key(peer.key), packet);
                true
            }
            TunnResult::Done => true,
            TunnResult::Err(_) => false,
        }
    }

    fn set_private_key(&self, private: &StaticSecret) {
        let public = PublicKey::from(private);
        if let Ok(mut keys) = self.keys.write() {
            *keys = (private.clone(), public);
        }
        let Ok(state) = self.state.read() else { return };
        for peer in state.by_key.values() {
            if let Ok(mut session) = peer.session.lock() {
                session.tunn.set_static_private(private.clone(), public, None);
            }
            peer.fresh.store(true, Ordering::Relaxed);
        }
    }

    fn tick(&self, send: &mut dyn FnMut(SocketAddr, &[u8])) {
        let peers: Vec<Arc<Peer>> = match self.state.read() {
            Ok(state) => state.by_key.values().cloned().collect(),
            Err(_) => return,
        };
        let mut out = [0u8; 256];
        for peer in peers {
            let Ok(mut session) = peer.session.lock() else { continue };
            let endpoint = session.endpoint;
            if peer.fresh.swap(false, Ordering::Relaxed)
                && let TunnResult::WriteToNetwork(datagram) = session.tunn.format_handshake_initiation(&mut out, false)
            {
                send(endpoint, datagram);
            }
            if let TunnResult::WriteToNetwork(datagram) = session.tunn.update_timers(&mut out) {
                send(endpoint, datagram);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(seed: u8) -> WireGuard {
        WireGuard::new(StaticSecret::from([seed; 32]))
    }

    fn peer_of(wg: &WireGuard, name: &str, cidr: &str, endpoint: &str) -> TunnelPeer {
        TunnelPeer {
            node_name: name.into(),
            cidrs: vec![cidr.parse().unwrap()],
            endpoint: endpoint.parse().unwrap(),
            public_key: Some(wg.public_key()),
        }
    }

    /// Carries datagrams between two nodes in memory until both are quiet;
    /// returns what each delivered to its TUN device.
    fn exchange(a: &WireGuard, b: &WireGuard, first: Vec<u8>) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let (from_a, from_b): (SocketAddr, SocketAddr) =
            ("10.0.0.1:51820".parse().unwrap(), "10.0.0.2:51820".parse().unwrap());
        let mut to_b = vec![first];
        let mut to_a: Vec<Vec<u8>> = Vec::new();
        let (mut at_a, mut at_b) = (Vec::new(), Vec::new());
        let mut out = vec![0u8; 2048];
        for _ in 0..10 {
            for d in std::mem::take(&mut to_b) {
                b.open(from_a, &d, &mut out, &mut |_, r| to_a.push(r.to_vec()), &mut |s, p| {
                    assert_eq!(s, Sender::Key(a.public_key()));
                    at_b.push(p.to_vec())
                });
            }
            for d in std::mem::take(&mut to_a) {
                a.open(from_b, &d, &mut out, &mut |_, r| to_b.push(r.to_vec()), &mut |_, p| at_a.push(p.to_vec()));
            }
            if to_a.is_empty() && to_b.is_empty() {
                break;
            }
        }
        (at_a, at_b)
    }

    fn ipv4_packet(marker: &[u8]) -> Vec<u8> {
        let len = 20 + marker.len();
        let mut p = vec![0u8; len];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        p[8] = 64;
        p[9] = 17;
        p[12..16].copy_from_slice(&[10, 244, 1, 2]);
        p[16..20].copy_from_slice(&[10, 244, 2, 3]);
        p[20..].copy_from_slice(marker);
        p
    }

    #[test]
    fn a_packet_waits_for_the_handshake_then_arrives_encrypted() {
        let (a, b) = (node(1), node(2));
        let peer_b = peer_of(&b, "b", "10.244.2.0/24", "10.0.0.2:51820");
        a.set_peers(&Table::new(vec![peer_b.clone()]));
        b.set_peers(&Table::new(vec![peer_of(&a, "a", "10.244.1.0/24", "10.0.0.1:51820")]));
        let packet = ipv4_packet(b"a marker string");
        let mut out = vec![0u8; 2048];
        let first = a.seal(&peer_b, &packet, &mut out).expect("a handshake initiation").to_vec();
        assert_eq!(first.len(), 148, "the first datagram is the handshake");
        let (_, at_b) = exchange(&a, &b, first);
        assert_eq!(at_b, vec![packet.clone()], "the queued packet follows the handshake");

        let sealed = a.seal(&peer_b, &packet, &mut out).expect("data").to_vec();
        assert_eq!(sealed.len(), packet.len() + 32, "the header (16 bytes) and the tag (16)");
        assert!(!sealed.windows(6).any(|w| w == b"marker"), "no plaintext on the wire");
        let (_, at_b) = exchange(&a, &b, sealed.clone());
        assert_eq!(at_b, vec![packet]);
        let (_, replayed) = exchange(&a, &b, sealed);
        assert!(replayed.is_empty(), "a replayed datagram is refused");
    }

    #[test]
    fn a_new_peer_is_greeted_once_at_the_next_tick() {
        let (a, b) = (node(1), node(2));
        a.set_peers(&Table::new(vec![peer_of(&b, "b", "10.244.2.0/24", "10.0.0.2:51820")]));
        let mut sent = Vec::new();
        a.tick(&mut |to, d| sent.push((to, d.len())));
        assert_eq!(sent, vec![("10.0.0.2:51820".parse().unwrap(), 148)], "one handshake initiation");
        sent.clear();
        a.set_peers(&Table::new(vec![peer_of(&b, "b", "10.244.2.0/24", "10.0.0.2:51820")]));
        a.tick(&mut |to, d| sent.push((to, d.len())));
        assert!(sent.is_empty(), "a resync greets nobody again: {sent:?}");
    }

    #[test]
    fn after_a_rotation_peers_that_took_the_new_key_talk_again() {
        let (a, b) = (node(1), node(2));
        let peer_b = peer_of(&b, "b", "10.244.2.0/24", "10.0.0.2:51820");
        a.set_peers(&Table::new(vec![peer_b.clone()]));
        b.set_peers(&Table::new(vec![peer_of(&a, "a", "10.244.1.0/24", "10.0.0.1:51820")]));
        let packet = ipv4_packet(b"before");
        let mut out = vec![0u8; 2048];
        let first = a.seal(&peer_b, &packet, &mut out).expect("initiation").to_vec();
        assert_eq!(exchange(&a, &b, first).1, vec![packet]);

        a.set_private_key(&StaticSecret::from([9; 32]));
        assert_eq!(a.public_key(), *PublicKey::from(&StaticSecret::from([9; 32])).as_bytes());
        // b still knows a's old key: a's handshakes are refused until b
        // takes the new key from the API.
        let mut greetings = Vec::new();
        a.tick(&mut |_, d| greetings.push(d.to_vec()));
        assert_eq!(greetings.len(), 1, "a greets b at once with its new key");
        let (_, none) = exchange(&a, &b, greetings.remove(0));
        assert!(none.is_empty());
        // b takes a's new key from the API: a new session, both ways.
        let peer_a = peer_of(&a, "a", "10.244.1.0/24", "10.0.0.1:51820");
        b.set_peers(&Table::new(vec![peer_a.clone()]));
        let back = ipv4_packet(b"after");
        let init = b.seal(&peer_a, &back, &mut out).expect("an initiation to a's new key").to_vec();
        assert_eq!(exchange(&b, &a, init).1, vec![back]);
    }

    #[test]
    fn strangers_and_forgotten_peers_are_refused() {
        let (a, b, stranger) = (node(1), node(2), node(3));
        b.set_peers(&Table::new(vec![peer_of(&a, "a", "10.244.1.0/24", "10.0.0.1:51820")]));
        // The stranger knows b's key but b does not know the stranger's.
        let to_b = peer_of(&b, "b", "10.244.2.0/24", "10.0.0.2:51820");
        stranger.set_peers(&Table::new(vec![to_b.clone()]));
        let mut out = vec![0u8; 2048];
        let init = stranger.seal(&to_b, &ipv4_packet(b"x"), &mut out).expect("initiation").to_vec();
        let mut replies = 0;
        assert!(!b.open("10.0.0.9:51820".parse().unwrap(), &init, &mut out, &mut |_, _| replies += 1, &mut |_, _| {}));
        assert_eq!(replies, 0);
        assert!(!b.open("10.0.0.9:1".parse().unwrap(), b"garbage", &mut out, &mut |_, _| {}, &mut |_, _| {}));

        // a is a peer until b's table drops it.
        a.set_peers(&Table::new(vec![to_b.clone()]));
        let init = a.seal(&to_b, &ipv4_packet(b"x"), &mut out).expect("initiation").to_vec();
        b.set_peers(&Table::new(vec![]));
        assert!(!b.open("10.0.0.1:51820".parse().unwrap(), &init, &mut out, &mut |_, _| {}, &mut |_, _| {}));
    }
}
