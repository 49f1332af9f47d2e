//! The userspace datapath of the TUN backends: pod packets for other nodes
//! are read from the TUN device, wrapped by the backend's
//! [`Encapsulation`] and sent over UDP to the peer node's agent, which
//! unwraps them, checks that their source is one of that peer's pods, and
//! writes them into its own TUN device.
//!
//! - [`udp`]: flannel's UDP backend, one packet per datagram, no header.
//! - [`wireguard`]: the WireGuard protocol (Noise handshake,
//!   ChaCha20-Poly1305), interoperable with any WireGuard peer.
//!
//! [`engine`] runs the loops; [`peers`] is the lookup table they share;
//! [`offload`] cuts the device's large TCP packets into segments and joins
//! received ones; [`batch`] sends and receives runs of datagrams.

pub mod batch;
pub mod engine;
pub mod keys;
pub mod offload;
pub mod peers;
pub mod udp;
pub mod wireguard;

use std::net::{IpAddr, SocketAddr};

pub use peers::{Table, TunnelPeer};

/// Which peer an arriving datagram is from, as the backend tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    /// Its source address (udp: nothing else identifies a peer).
    Endpoint(IpAddr),
    /// The peer's static public key (WireGuard: authenticated).
    Key([u8; 32]),
}

/// What a backend does to pod packets between the TUN device and UDP.
/// One instance is shared by the datapath's threads.
pub trait Encapsulation: Send + Sync + 'static {
    /// Takes the new peers (their keys and endpoints); state of peers that
    /// stayed is kept.
    fn set_peers(&self, table: &Table);

    /// The datagram that carries `packet` to `peer` (it may be `packet`
    /// itself, or a handshake that first has to be answered; `None`: not
    /// sendable, counted by the caller).
    fn seal<'a>(&self, peer: &TunnelPeer, packet: &'a [u8], out: &'a mut [u8]) -> Option<&'a [u8]>;

    /// Handles one datagram from `from`: packets for the TUN device go to
    /// `deliver`, protocol replies to `send`. Returns false when the
    /// datagram was not acceptable (counted by the caller).
    fn open(
        &self,
        from: SocketAddr,
        datagram: &[u8],
        out: &mut [u8],
        send: &mut dyn FnMut(SocketAddr, &[u8]),
        deliver: &mut dyn FnMut(Sender, &[u8]),
    ) -> bool;

    /// Called about every 250 ms: timers (handshakes, keepalives).
    fn tick(&self, _send: &mut dyn FnMut(SocketAddr, &[u8])) {}

    /// Replaces this node's private key (wireguard): sessions start over
    /// with every peer at the next tick.
    fn set_private_key(&self, _private: &boringtun::x25519::StaticSecret) {}
}
