//! flannel's UDP backend: each pod packet travels as the whole payload of
//! one UDP datagram (port 8285), nothing added. A datagram is accepted only
//! from a peer's node address, and (by the engine) only with a source of
//! that peer's pods. The underlay is trusted as with VXLAN: nothing is
//! encrypted or authenticated.

use std::net::SocketAddr;

use super::{Encapsulation, Sender, Table, TunnelPeer};

pub const DEFAULT_PORT: u16 = 8285;
/// Bytes each packet grows by, besides the underlay's IP and UDP headers.
pub const OVERHEAD: u32 = 0;

#[derive(Debug, Default)]
pub struct Udp;

impl Encapsulation for Udp {
    fn set_peers(&self, _table: &Table) {}

    fn seal<'a>(&self, _peer: &TunnelPeer, packet: &'a [u8], _out: &'a mut [u8]) -> Option<&'a [u8]> {
        Some(packet)
    }

    fn open(
        &self,
        from: SocketAddr,
        datagram: &[u8],
        _out: &mut [u8],
        _send: &mut dyn FnMut(SocketAddr, &[u8]),
        deliver: &mut dyn FnMut(Sender, &[u8]),
    ) -> bool {
        deliver(Sender::Endpoint(from.ip()), datagram);
        true
    }
}
