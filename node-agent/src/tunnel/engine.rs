//! The loops of the userspace datapath, on threads of their own (a packet
//! never waits for the async runtime): one moves packets from the TUN
//! device to UDP, one from UDP to the TUN device, one runs the backend's
//! timers. Each waits at most [`POLL`] for its file descriptor, so a stop
//! is seen within that time.
//!
//! The device has offloads ([`offload`]): a read may be many TCP segments,
//! cut here before they are sealed, and the packets of one received batch
//! are joined per flow before they are written.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::{DirectionLabels, OutcomeLabels};

use super::batch::{self, Outbox, Sent};
use super::offload::{self, Coalescer, VNET_HDR_LEN, VnetHdr};
use super::peers::addresses;
use super::{Encapsulation, Sender, Table, TunnelPeer};

const POLL: u16 = 200;
const TICK: Duration = Duration::from_millis(250);
/// The largest IP packet, plus room for the device's and any backend's
/// header.
const BUFFER: usize = 65_535 + 256;

/// Packet counts: the agent's `tunnel_packets` metric.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub sent: Counter,
    pub received: Counter,
    /// To a cluster address no peer holds (or whose peer has no key).
    pub no_peer: Counter,
    /// From a peer, with a source that is not one of its pods (or to an
    /// address that is not this node's).
    pub spoofed: Counter,
    /// Not from a peer, not authentic, or not a packet.
    pub refused: Counter,
    pub send_errors: Counter,
    /// Reads and writes of the device (one may carry many packets).
    pub device_reads: Counter,
    pub device_writes: Counter,
}

impl Stats {
    /// The counters of `packets` (one per outcome) and `device` (one per
    /// direction).
    pub fn of(packets: &Family<OutcomeLabels, Counter>, device: &Family<DirectionLabels, Counter>) -> Self {
        let c = |outcome| packets.get_or_create(&OutcomeLabels { outcome }).clone();
        let d = |direction| device.get_or_create(&DirectionLabels { direction }).clone();
        Stats {
            sent: c("sent"),
            received: c("received"),
            no_peer: c("no_peer"),
            spoofed: c("spoofed"),
            refused: c("refused"),
            send_errors: c("send_error"),
            device_reads: d("read"),
            device_writes: d("write"),
        }
    }
}

struct Shared {
    encap: Arc<dyn Encapsulation>,
    table: RwLock<Arc<Table>>,
    stop: AtomicBool,
    failure: Mutex<Option<String>>,
    stats: Stats,
    tun: File,
    socket: UdpSocket,
}

impl Shared {
    fn table(&self) -> Arc<Table> {
        self.table.read().map(|t| Arc::clone(&t)).unwrap_or_default()
    }

    fn fail(&self, why: String) {
        tracing::error!(error = %why, "tunnel datapath stopped");
        if let Ok(mut f) = self.failure.lock() {
            f.get_or_insert(why);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    fn count(&self, sent: Sent) {
        self.stats.sent.inc_by(sent.datagrams);
        self.stats.send_errors.inc_by(sent.failed);
    }

    fn send(&self, to: SocketAddr, datagram: &[u8]) {
        match self.socket.send_to(datagram, to) {
            Ok(_) => {
                self.stats.sent.inc();
            }
            Err(_) => {
                self.stats.send_errors.inc();
            }
        }
    }
}

/// A running datapath; stopped (threads joined) when dropped. The TUN
/// device stays (it is persistent).
pub struct Datapath {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Datapath {
    /// Starts the loops on `tun` (an attached TUN device with
    /// `IFF_VNET_HDR`) and `socket` (bound to this node's address and the
    /// backend's port).
    pub fn start(
        tun: OwnedFd,
        socket: UdpSocket,
        encap: Arc<dyn Encapsulation>,
        stats: Stats,
    ) -> std::io::Result<Self> {
        // Both are drained until they would block, then polled.
        socket.set_nonblocking(true)?;
        if !batch::enable_gro(&socket) {
            tracing::info!("no UDP GRO on this kernel: one datagram per receive");
        }
        let flags = nix::fcntl::fcntl(&tun, nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&tun, nix::fcntl::FcntlArg::F_SETFL(flags))?;
        let shared = Arc::new(Shared {
            encap,
            table: RwLock::default(),
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
            stats,
            tun: File::from(tun),
            socket,
        });
        let mut threads = Vec::new();
        type Loop = fn(&Shared);
        let loops: [(&str, Loop); 3] =
            [("weft-tun-tx", tun_to_udp), ("weft-tun-rx", udp_to_tun), ("weft-tun-timer", timers)];
        for (name, run) in loops {
            let s = Arc::clone(&shared);
            threads.push(std::thread::Builder::new().name(name.into()).spawn(move || run(&s))?);
        }
        Ok(Datapath { shared, threads })
    }

    /// Replaces the peers (the backend keeps the state of those that stay).
    pub fn set_peers(&self, peers: Vec<TunnelPeer>) {
        let table = Table::new(peers);
        self.shared.encap.set_peers(&table);
        if let Ok(mut t) = self.shared.table.write() {
            *t = Arc::new(table);
        }
    }

    /// Replaces this node's private key (wireguard).
    pub fn set_private_key(&self, private: &boringtun::x25519::StaticSecret) {
        self.shared.encap.set_private_key(private);
    }

    /// Why the datapath stopped by itself (its device deleted), if it did.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().ok().and_then(|f| f.clone())
    }
}

impl Drop for Datapath {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Waits up to [`POLL`] ms for `fd` to be readable; false on stop.
fn readable(s: &Shared, fd: std::os::fd::BorrowedFd<'_>) -> Result<bool, String> {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(POLL)) {
        Ok(0) | Err(nix::errno::Errno::EINTR) => Ok(false),
        Ok(_) => {
            let revents = fds[0].revents().unwrap_or(PollFlags::empty());
            if revents.intersects(PollFlags::POLLERR | PollFlags::POLLHUP | PollFlags::POLLNVAL) {
                return Err(format!("poll: {revents:?}"));
            }
            Ok(!s.stop.load(Ordering::Relaxed))
        }
        Err(e) => Err(format!("poll: {e}")),
    }
}

fn tun_to_udp(s: &Shared) {
    let mut packet = vec![0u8; BUFFER];
    let mut segment = Vec::with_capacity(BUFFER);
    let mut out = vec![0u8; BUFFER];
    let mut tun = &s.tun;
    let mut outbox = Outbox::default();
    while !s.stop.load(Ordering::Relaxed) {
        s.count(outbox.flush(&s.socket));
        match readable(s, s.tun.as_fd()) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => return s.fail(format!("TUN device: {e}")),
        }
        // Everything queued (runs to one peer leave in one send), then
        // back to poll. The peers as of this wake-up: a change is seen at
        // the next one, without a lock per packet.
        let table = s.table();
        loop {
            let n = match tun.read(&mut packet) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return s.fail(format!("cannot read the TUN device: {e}")),
            };
            s.stats.device_reads.inc();
            let Some(hdr) = VnetHdr::parse(&packet[..n]) else { continue };
            let packet = &mut packet[VNET_HDR_LEN..n];
            // Every segment of a read has the same addresses.
            let peer = addresses(packet).and_then(|(_, dst)| table.route(dst)).and_then(|id| table.get(id));
            let Some(peer) = peer else {
                s.stats.no_peer.inc_by(offload::segments(&hdr, packet));
                continue;
            };
            let cut = offload::segment(&hdr, packet, &mut segment, &mut |p| {
                if let Some(datagram) = s.encap.seal(peer, p, &mut out) {
                    s.count(outbox.push(&s.socket, peer.endpoint, datagram));
                }
            });
            if let Err(e) = cut {
                s.stats.send_errors.inc();
                tracing::debug!(error = %e, "a packet from the TUN device could not be cut into segments");
            }
        }
    }
}

fn udp_to_tun(s: &Shared) {
    let mut datagram = vec![0u8; BUFFER];
    let mut out = vec![0u8; BUFFER];
    let mut inbox = Coalescer::default();
    while !s.stop.load(Ordering::Relaxed) {
        match readable(s, s.socket.as_fd()) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => return s.fail(format!("UDP socket: {e}")),
        }
        let table = s.table();
        loop {
            let (from, n, size) = match batch::receive(&s.socket, &mut datagram) {
                Ok(r) => r,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            for one in datagram[..n].chunks(size.max(1)) {
                receive(s, &table, from, one, &mut out, &mut inbox);
            }
            // A received batch's packets, joined per flow, go in now.
            inbox.drain(&mut |packet, segments| write_to_device(s, packet, segments));
        }
    }
}

/// One datagram from the network, through the backend, into `inbox`.
fn receive(s: &Shared, table: &Table, from: SocketAddr, datagram: &[u8], out: &mut [u8], inbox: &mut Coalescer) {
    let mut deliver = |sender: Sender, packet: &[u8]| {
        let peer = match sender {
            Sender::Endpoint(ip) => table.by_endpoint(ip),
            Sender::Key(key) => table.by_key(&key),
        };
        let allowed = match (peer, addresses(packet)) {
            (Some(id), Some((src, dst))) => table.allows(id, src) && table.route(dst).is_none(),
            _ => false,
        };
        if !allowed {
            s.stats.spoofed.inc();
            return;
        }
        inbox.push(packet);
    };
    if !s.encap.open(from, datagram, out, &mut |to, d| s.send(to, d), &mut deliver) {
        s.stats.refused.inc();
    }
}

/// Writes one packet (header in front) carrying `segments` packets.
fn write_to_device(s: &Shared, packet: &[u8], segments: u64) {
    s.stats.device_writes.inc();
    // A TUN device takes one whole packet per write, or none.
    match (&s.tun).write(packet) {
        Ok(n) if n == packet.len() => {
            s.stats.received.inc_by(segments);
        }
        Ok(_) => tracing::debug!("the TUN device took part of a packet"),
        Err(e) => tracing::debug!(error = %e, "cannot write to the TUN device"),
    }
}

fn timers(s: &Shared) {
    while !s.stop.load(Ordering::Relaxed) {
        std::thread::park_timeout(TICK);
        s.encap.tick(&mut |to, d| s.send(to, d));
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::time::{Duration, Instant};

    use nix::sys::socket::{AddressFamily, SockFlag, SockType, setsockopt, socketpair, sockopt};
    use nix::sys::time::TimeVal;

    use super::*;
    use crate::tunnel::udp::Udp;

    /// A packet device for the engine without root: one end of a
    /// SOCK_SEQPACKET pair keeps packet boundaries as a TUN device does
    /// (the test writes and reads each packet behind a vnet header). The
    /// test's end waits at most 5 s for a packet.
    fn fake_tun() -> (OwnedFd, File) {
        let (engine, test) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).expect("socketpair");
        setsockopt(&test, sockopt::ReceiveTimeout, &TimeVal::new(5, 0)).expect("receive timeout");
        (engine, File::from(test))
    }

    fn packet(src: &str, dst: &str, marker: u8) -> Vec<u8> {
        let (IpAddr::V4(src), IpAddr::V4(dst)) = (src.parse().unwrap(), dst.parse().unwrap()) else {
            panic!("IPv4 addresses")
        };
        let mut p = vec![0u8; 28];
        p[0] = 0x45;
        p[9] = 17;
        p[12..16].copy_from_slice(&src.octets());
        p[16..20].copy_from_slice(&dst.octets());
        p[27] = marker;
        p
    }

    fn next(pods: &mut File) -> Vec<u8> {
        let mut buf = [0u8; 2048];
        let n = pods.read(&mut buf).expect("a packet within 5 s");
        assert_eq!(VnetHdr::parse(&buf[..n]), Some(VnetHdr::default()), "a plain packet's header");
        buf[VNET_HDR_LEN..n].to_vec()
    }

    /// Hands `packet` to the engine as the kernel would, behind a header.
    fn send(pods: &mut File, packet: &[u8]) {
        pods.write_all(&[&[0u8; VNET_HDR_LEN][..], packet].concat()).unwrap();
    }

    fn peer(name: &str, cidr: &str, endpoint: &UdpSocket) -> TunnelPeer {
        let endpoint = endpoint.local_addr().expect("bound");
        TunnelPeer { node_name: name.into(), cidrs: vec![cidr.parse().unwrap()], endpoint, public_key: None }
    }

    #[test]
    fn udp_datapath_carries_packets_and_refuses_forged_ones() {
        let (tun, mut pods) = fake_tun();
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let local = socket.local_addr().unwrap();
        let [node2, node3, stranger] =
            ["127.0.0.2:0", "127.0.0.3:0", "127.0.0.4:0"].map(|a| UdpSocket::bind(a).unwrap());
        node2.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let stats = Stats::default();
        let datapath = Datapath::start(tun, socket, Arc::new(Udp), stats.clone()).unwrap();
        datapath.set_peers(vec![peer("node-2", "10.244.2.0/24", &node2), peer("node-3", "10.244.3.0/24", &node3)]);

        // Out: a packet for node-2's pods goes to node-2, as it is.
        let out = packet("10.244.1.5", "10.244.2.7", 1);
        send(&mut pods, &out);
        let mut buf = [0u8; 2048];
        let (n, from) = node2.recv_from(&mut buf).expect("node-2 receives the packet");
        assert_eq!((&buf[..n], from), (&out[..], local));
        // A cluster address nobody holds: dropped, counted.
        send(&mut pods, &packet("10.244.1.5", "10.244.9.9", 2));

        // In: forged datagrams first, then a genuine one; only that one may
        // come out of the device. Not from a peer; from node-3 with node-2's
        // pod as source; from node-2 to another node's pod (a relay).
        stranger.send_to(&packet("10.244.2.7", "10.244.1.5", 3), local).unwrap();
        node3.send_to(&packet("10.244.2.7", "10.244.1.5", 4), local).unwrap();
        node2.send_to(&packet("10.244.2.7", "10.244.3.8", 5), local).unwrap();
        node2.send_to(&packet("10.244.2.7", "10.244.1.5", 6), local).unwrap();
        assert_eq!(next(&mut pods), packet("10.244.2.7", "10.244.1.5", 6), "the first packet delivered");

        let deadline = Instant::now() + Duration::from_secs(5);
        // Counted after the write that the test may see first.
        while stats.spoofed.get() < 3 || stats.no_peer.get() < 1 || stats.received.get() < 1 {
            let counts = (stats.spoofed.get(), stats.no_peer.get(), stats.received.get());
            assert!(Instant::now() < deadline, "spoofed, no_peer and received counted: {counts:?}");
            std::thread::yield_now();
        }
        assert_eq!((stats.received.get(), stats.sent.get()), (1, 1));

        // A peer that is gone gets nothing through.
        datapath.set_peers(vec![peer("node-3", "10.244.3.0/24", &node3)]);
        node2.send_to(&packet("10.244.2.7", "10.244.1.5", 7), local).unwrap();
        node3.send_to(&packet("10.244.3.8", "10.244.1.5", 8), local).unwrap();
        assert_eq!(next(&mut pods), packet("10.244.3.8", "10.244.1.5", 8));
        drop(datapath);
    }
}
