//! Fewer syscalls per packet: datagrams to one peer leave in one `sendmsg`
//! with UDP GSO (the kernel cuts the buffer into equal datagrams, the last
//! one possibly shorter), and arrive with UDP GRO (one `recvmsg` returns a
//! run of datagrams of one size). A kernel without either gets one datagram
//! per call, as before.

use std::io::{IoSlice, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg, sendmsg};

/// The kernel's limits on one GSO send: 64 segments, and a UDP payload.
const MAX_SEGMENTS: usize = 64;
const MAX_BYTES: usize = 65_000;

/// Datagrams queued for one destination, sent by [`Outbox::flush`].
pub struct Outbox {
    buf: Vec<u8>,
    to: Option<SocketAddr>,
    size: usize,
    count: usize,
    /// A shorter datagram ends a GSO run.
    closed: bool,
    gso: bool,
}

/// What a flush did, for the counters.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub datagrams: u64,
    pub failed: u64,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox { buf: Vec::with_capacity(MAX_BYTES), to: None, size: 0, count: 0, closed: false, gso: true }
    }
}

impl Outbox {
    /// Queues `datagram` for `to`, first sending what is queued when it
    /// cannot join it.
    pub fn push(&mut self, socket: &UdpSocket, to: SocketAddr, datagram: &[u8]) -> Sent {
        let joins = self.count > 0
            && self.gso
            && self.to == Some(to)
            && !self.closed
            && datagram.len() <= self.size
            && self.buf.len() + datagram.len() <= MAX_BYTES
            && self.count < MAX_SEGMENTS;
        let sent = if self.count > 0 && !joins { self.flush(socket) } else { Sent::default() };
        if self.count == 0 {
            self.to = Some(to);
            self.size = datagram.len();
        }
        self.buf.extend_from_slice(datagram);
        self.count += 1;
        self.closed |= datagram.len() < self.size;
        sent
    }

    /// Sends what is queued.
    pub fn flush(&mut self, socket: &UdpSocket) -> Sent {
        let Some(to) = self.to.take() else { return Sent::default() };
        let count = self.count as u64;
        let mut sent = Sent::default();
        if self.count > 1 && self.gso {
            match send_segments(socket, to, &self.buf, self.size) {
                Ok(()) => sent.datagrams = count,
                // No GSO here (or not for this route): one at a time from now on.
                Err(nix::errno::Errno::EIO | nix::errno::Errno::EINVAL | nix::errno::Errno::ENOPROTOOPT) => {
                    self.gso = false;
                }
                Err(_) => sent.failed = count,
            }
        }
        if sent == Sent::default() {
            for d in self.buf.chunks(self.size.max(1)) {
                match socket.send_to(d, to) {
                    Ok(_) => sent.datagrams += 1,
                    Err(_) => sent.failed += 1,
                }
            }
        }
        self.buf.clear();
        self.count = 0;
        self.closed = false;
        sent
    }
}

fn send_segments(socket: &UdpSocket, to: SocketAddr, buf: &[u8], size: usize) -> nix::Result<()> {
    let segment = u16::try_from(size).map_err(|_| nix::errno::Errno::EINVAL)?;
    let address = SockaddrStorage::from(to);
    let cmsg = [ControlMessage::UdpGsoSegments(&segment)];
    sendmsg(socket.as_raw_fd(), &[IoSlice::new(buf)], &cmsg, MsgFlags::empty(), Some(&address)).map(|_| ())
}

/// Asks the kernel to coalesce arriving datagrams (UDP GRO); false when it
/// cannot.
pub fn enable_gro(socket: &UdpSocket) -> bool {
    nix::sys::socket::setsockopt(socket, nix::sys::socket::sockopt::UdpGroSegment, &true).is_ok()
}

/// Receives a run of datagrams into `buf`: their source, the bytes read and
/// the size of each datagram in them (the last may be shorter).
pub fn receive(socket: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(SocketAddr, usize, usize)> {
    let mut cmsg = nix::cmsg_space!(i32);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrStorage>(socket.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
        .map_err(std::io::Error::from)?;
    let n = msg.bytes;
    let mut size = n;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::UdpGroSegments(s) = c
                && s > 0
            {
                size = s as usize;
            }
        }
    }
    let from = msg
        .address
        .and_then(|a| {
            a.as_sockaddr_in()
                .map(|v4| SocketAddr::from((v4.ip(), v4.port())))
                .or_else(|| a.as_sockaddr_in6().map(|v6| SocketAddr::from((v6.ip(), v6.port()))))
        })
        .ok_or_else(|| std::io::Error::other("a datagram without a source address"))?;
    Ok((from, n, size))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_run_to_one_peer_arrives_as_the_datagrams_it_was() {
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let gro = enable_gro(&rx);
        rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let to = rx.local_addr().unwrap();
        let mut outbox = Outbox::default();
        let datagrams: Vec<Vec<u8>> =
            (0u8..10).map(|i| vec![i; if i == 9 { 300 } else { 1000 }]).chain([vec![77; 1000]]).collect();
        let mut sent = 0;
        for d in &datagrams {
            sent += outbox.push(&tx, to, d).datagrams;
        }
        sent += outbox.flush(&tx).datagrams;
        assert_eq!(sent, 11);

        let mut got = Vec::new();
        let mut buf = vec![0u8; 65_536];
        while got.len() < datagrams.len() {
            let (from, n, size) = receive(&rx, &mut buf).expect("datagrams");
            assert_eq!(from, tx.local_addr().unwrap());
            got.extend(buf[..n].chunks(size).map(<[u8]>::to_vec));
        }
        assert_eq!(got, datagrams, "the same datagrams in the same order (GRO: {gro})");
    }
}
