//! The source guard against a hostile pod, in network namespaces each test
//! creates (a node with pods, never the root namespace's). Each attack is
//! first shown to work without the guard (the code before it), then to
//! fail with it, while the pods' own traffic still flows.
//! Needs root: skips loudly without it, fails under CI=true.

use std::net::Ipv6Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use super::desired::{self, GuardedPort};
use super::{Guard, Write};
use crate::attachment::Attachment;
use crate::test_support::{TestNetns as Ns, require_root};

const MAC_A: [u8; 6] = [2, 0, 0, 0, 0, 0x0a];
const MAC_B: [u8; 6] = [2, 0, 0, 0, 0, 0x0b];

fn run(ns: &Ns, cmd: &str) -> std::process::Output {
    Command::new("ip").args(["netns", "exec", ns.name(), "sh", "-c", cmd]).output().expect("spawn")
}

fn sh(ns: &Ns, cmd: &str) -> String {
    let out = run(ns, cmd);
    assert!(out.status.success(), "{cmd}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ok(ns: &Ns, cmd: &str) -> bool {
    run(ns, cmd).status.success()
}

/// The IPv6 link-local address of `dev`.
fn link_local(ns: &Ns, dev: &str) -> String {
    let out = sh(ns, &format!("ip -6 -o addr show dev {dev} scope link"));
    let addr = out.split_whitespace().skip_while(|w| *w != "inet6").nth(1).expect("fe80 address");
    addr.split('/').next().unwrap_or_default().to_owned()
}

/// What `ping` printed (its answers), whether or not it succeeded.
fn answers(ns: &Ns, args: &str) -> String {
    String::from_utf8_lossy(&run(ns, &format!("ping -c2 -i0.2 -W1 {args}")).stdout).into_owned()
}

fn mac(m: [u8; 6]) -> String {
    crate::dataplane::link::format_mac(&m)
}

/// Waits for `cond`, at most 10 s.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A test pod: host veth, MAC, IPv4 and IPv6 address.
type Spec = (&'static str, [u8; 6], &'static str, Option<&'static str>);

/// A node namespace and two pod namespaces, their veths named as Weft
/// names them. `routed`: no bridge, /32 routes on the host veths.
struct Node {
    node: Ns,
    pods: Vec<(Ns, Spec)>,
    mode: Attachment,
}

impl Node {
    fn new(mode: Attachment, ipv6: bool) -> Node {
        let node = Ns::new();
        sh(&node, "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1 net.ipv6.conf.default.accept_dad=0");
        if mode == Attachment::Bridge {
            sh(&node, "ip link add weft0 type bridge && ip addr add 10.244.1.1/24 dev weft0 && ip link set weft0 up");
            sh(&node, "sysctl -qw net.ipv6.conf.weft0.accept_dad=0 && ip addr add fd00:10:244:1::1/64 dev weft0");
            // The node believes the latest ARP reply at once (the attack's best case).
            sh(&node, "sysctl -qw net.ipv4.neigh.weft0.locktime=0");
        } else {
            sh(&node, "ip link add weft0 type bridge && ip addr add 10.244.1.1/32 dev weft0 && ip link set weft0 up");
        }
        let specs: [Spec; 2] = [
            ("weftv000000000a", MAC_A, "10.244.1.5", ipv6.then_some("fd00:10:244:1::5")),
            ("weftv000000000b", MAC_B, "10.244.1.6", ipv6.then_some("fd00:10:244:1::6")),
        ];
        let mut pods = Vec::new();
        for spec in specs {
            let (veth, pod_mac, ip, ip6) = spec;
            let pod = Ns::new();
            let p = pod.name().to_owned();
            sh(&pod, "sysctl -qw net.ipv6.conf.default.accept_dad=0 net.ipv4.icmp_echo_ignore_broadcasts=0");
            sh(&node, &format!("ip link add {veth} type veth peer name eth0 netns {p}"));
            sh(&pod, &format!("ip link set eth0 address {} && ip link set eth0 up && ip link set lo up", mac(pod_mac)));
            if mode == Attachment::Bridge {
                sh(&node, &format!("ip link set {veth} master weft0 && ip link set {veth} up"));
                sh(&pod, &format!("ip addr add {ip}/24 dev eth0 && ip route add default via 10.244.1.1"));
                if let Some(ip6) = ip6 {
                    sh(&pod, &format!("ip addr add {ip6}/64 dev eth0 && ip -6 route add default via fd00:10:244:1::1"));
                }
            } else {
                sh(&node, &format!("ip link set {veth} up && ip route add {ip}/32 dev {veth} src 10.244.1.1"));
                sh(
                    &pod,
                    &format!("ip addr add {ip}/32 dev eth0 && ip route add default via 10.244.1.1 dev eth0 onlink"),
                );
            }
            // The pod's link-local address, usable at once (no DAD).
            eventually("the pod's link-local address", || {
                sh(&pod, "ip -6 addr show dev eth0 scope link").contains("fe80::")
            });
            pods.push((pod, spec));
        }
        Node { node, pods, mode }
    }

    fn ports(&self, which: &[usize]) -> Vec<GuardedPort> {
        which
            .iter()
            .map(|i| {
                let (_, (veth, pod_mac, ip, ip6)) = &self.pods[*i];
                let mut addrs = vec![ip.parse().unwrap()];
                addrs.extend(ip6.map(|a| a.parse::<std::net::IpAddr>().unwrap()));
                GuardedPort { host_veth: (*veth).into(), pod_mac: *pod_mac, addrs, mode: self.mode }
            })
            .collect()
    }

    fn guard(&self, guard: &Guard, which: &[usize]) {
        write(&self.node, guard, Write::Update, self.ports(which)).expect("guard write");
    }

    /// The node bridge's MAC (the pods' gateway's).
    fn bridge_mac(&self) -> [u8; 6] {
        let text = sh(&self.node, "cat /sys/class/net/weft0/address");
        let bytes: Vec<u8> = text.trim().split(':').map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
        bytes.try_into().unwrap()
    }

    fn pod(&self, i: usize) -> &Ns {
        &self.pods[i].0
    }

    fn link_local(&self, i: usize) -> String {
        link_local(self.pod(i), "eth0")
    }

    /// The drop counter, as a resync reads it (a full write of `which`).
    fn dropped(&self, guard: &Guard, which: &[usize]) -> u64 {
        let written = write(&self.node, guard, Write::Full, self.ports(which)).expect("full write");
        written.dropped.expect("a full write reads the counters")
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// A guard write inside the node's namespace.
fn write(node: &Ns, guard: &Guard, how: Write, ports: Vec<GuardedPort>) -> Result<super::Written, super::GuardError> {
    let (rt, g) = (runtime(), guard.clone());
    node.run(move || rt.block_on(g.write(how, move || ports)))
}

/// Sends one raw Ethernet frame out of `ifname` in the calling thread's namespace.
fn send_frame(ifname: &str, frame: &[u8]) {
    // SAFETY: plain socket calls on a descriptor this function owns.
    unsafe {
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
        assert!(fd >= 0, "packet socket: {}", std::io::Error::last_os_error());
        let name = std::ffi::CString::new(ifname).unwrap();
        let index = libc::if_nametoindex(name.as_ptr());
        assert!(index > 0, "no {ifname}");
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = index as i32;
        addr.sll_halen = 6;
        let sent = libc::sendto(
            fd,
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&addr as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        );
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        assert_eq!(sent, frame.len() as isize, "sendto: {err}");
    }
}

/// An ARP reply "`ip` is at `mac`" from `mac` to `to`.
fn arp_reply(mac: [u8; 6], ip: [u8; 4], to: [u8; 6], to_ip: [u8; 4]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend(to);
    f.extend(mac);
    f.extend([0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 2]);
    f.extend(mac);
    f.extend(ip);
    f.extend(to);
    f.extend(to_ip);
    f.resize(60, 0);
    f
}

/// An ICMPv6 neighbour discovery message (`ty` 135 solicitation, 136
/// advertisement) from `mac`/`src` to `to_mac`/`dst` about `target`, with
/// `mac` as its link-layer address option; an advertisement is solicited
/// and overrides what the receiver knows.
fn neighbour_message(ty: u8, mac: [u8; 6], src: Ipv6Addr, to_mac: [u8; 6], dst: Ipv6Addr, target: Ipv6Addr) -> Vec<u8> {
    let option_type = if ty == 135 { 1 } else { 2 };
    let flags = if ty == 136 { 0x60 } else { 0 };
    let mut icmp = vec![ty, 0, 0, 0, flags, 0, 0, 0];
    icmp.extend(target.octets());
    icmp.extend([option_type, 1]);
    icmp.extend(mac);
    // The checksum covers a pseudo-header: addresses, length, next header.
    let mut sum: u32 = 0;
    let mut pseudo = Vec::new();
    pseudo.extend(src.octets());
    pseudo.extend(dst.octets());
    pseudo.extend((icmp.len() as u32).to_be_bytes());
    pseudo.extend([0, 0, 0, 58]);
    for chunk in pseudo.chunks(2).chain(icmp.chunks(2)) {
        sum += u32::from(u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    icmp[2..4].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    let mut f = Vec::new();
    f.extend(to_mac);
    f.extend(mac);
    f.extend([0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend((icmp.len() as u16).to_be_bytes());
    f.extend([58, 255]);
    f.extend(src.octets());
    f.extend(dst.octets());
    f.extend(icmp);
    f
}

/// Sends `frame` out of the pod's `eth0`, from a thread in its namespace.
fn send_from(pod: &Ns, frame: Vec<u8>) {
    let path = format!("/run/netns/{}", pod.name());
    std::thread::spawn(move || {
        let f = std::fs::File::open(path).unwrap();
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        send_frame("eth0", &frame);
    })
    .join()
    .unwrap();
}

fn node_neighbour_mac(node: &Ns, ip: &str) -> String {
    sh(node, &format!("ip neigh show {ip} dev weft0"))
}

#[test]
fn a_bridged_pod_sends_only_as_itself() {
    if !require_root() {
        return;
    }
    let n = Node::new(Attachment::Bridge, false);
    let (a, b) = (n.pod(0), n.pod(1));
    let ping = |from: &Ns, args: &str| ok(from, &format!("ping -c1 -W1 {args}"));
    sh(a, "ip addr add 10.244.1.99/24 dev eth0");
    let b_ll = n.link_local(1);

    // Without the guard every attack works (Weft before it).
    assert!(ping(a, "-I 10.244.1.99 10.244.1.6"), "a spoofed source reaches the other pod");
    assert!(ping(a, &format!("-6 {b_ll}%eth0")), "IPv6 link-local reaches an IPv4-only pod");
    // (A broadcast also comes back to its sender: only the other pod's answer counts.)
    assert!(answers(a, "-b 10.244.1.255").contains("from 10.244.1.6"), "a broadcast reaches the other pod");
    // ARP: the node learns B's address at A's MAC.
    assert!(ping(&n.node, "10.244.1.6"));
    let bridge_mac = n.bridge_mac();
    let spoof = arp_reply(MAC_A, [10, 244, 1, 6], bridge_mac, [10, 244, 1, 1]);
    // Sent again on each look: the kernel overrides an entry only once a
    // jiffy has passed since its last update (locktime 0), and the node's
    // ping may have updated it a moment before.
    eventually("the node to take the spoofed ARP reply", || {
        send_from(a, spoof.clone());
        node_neighbour_mac(&n.node, "10.244.1.6").contains(&mac(MAC_A))
    });
    sh(&n.node, "ip neigh flush dev weft0");

    let guard = Guard::default();
    n.guard(&guard, &[0, 1]);
    // Their own traffic flows, to each other and to the node.
    assert!(ping(a, "-I 10.244.1.5 10.244.1.6"), "a pod's own address");
    assert!(ping(b, "10.244.1.1"), "to the node");
    // Every attack fails.
    assert!(!ping(a, "-I 10.244.1.99 10.244.1.6"), "a spoofed source is dropped");
    assert!(!ping(a, &format!("-6 {b_ll}%eth0")), "IPv6 link-local between pods is dropped");
    let all_nodes = answers(a, "-6 ff02::1%eth0");
    assert!(!all_nodes.contains(&b_ll), "IPv6 multicast finds no other pod: {all_nodes}");
    let broadcast = answers(a, "-b 10.244.1.255");
    assert!(!broadcast.contains("from 10.244.1.6"), "broadcast is dropped: {broadcast}");
    assert!(ping(&n.node, "10.244.1.6"));
    // Sent again and again for half a second (many jiffies: what refuses
    // it cannot be the kernel's one-jiffy lock), never taken.
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        send_from(a, spoof.clone());
        let entry = node_neighbour_mac(&n.node, "10.244.1.6");
        assert!(!entry.contains(&mac(MAC_A)), "the spoofed ARP reply was taken: {entry}");
    }
    // The reply it sends would land at once; the node's ping proves B still answers at its own MAC.
    assert!(ping(&n.node, "10.244.1.6"));
    let entry = node_neighbour_mac(&n.node, "10.244.1.6");
    assert!(entry.contains(&mac(MAC_B)) && !entry.contains(&mac(MAC_A)), "the spoofed ARP reply was dropped: {entry}");
    // A pod taking another's MAC sends nothing.
    sh(
        a,
        &format!(
            "ip addr flush dev eth0 && ip addr add 10.244.1.6/24 dev eth0 && ip link set eth0 address {}",
            mac(MAC_B)
        ),
    );
    assert!(!ping(a, "10.244.1.1"), "another pod's MAC and address are dropped");
    assert!(n.dropped(&guard, &[0, 1]) > 0, "the drops are counted");

    // A pod the guard forgot (its DEL) sends nothing at all: fails closed.
    n.guard(&guard, &[0]);
    assert!(!ping(b, "10.244.1.1"), "a veth without a record is closed");
}

#[test]
fn a_dual_stack_bridged_pod_keeps_neighbour_discovery_and_its_own_ipv6_only() {
    if !require_root() {
        return;
    }
    let n = Node::new(Attachment::Bridge, true);
    let (a, b) = (n.pod(0), n.pod(1));
    let ping = |from: &Ns, args: &str| ok(from, &format!("ping -c1 -W2 {args}"));
    sh(a, "ip addr add fd00:10:244:1::99/64 dev eth0 nodad");
    let b_ll = n.link_local(1);
    assert!(ping(a, "-I fd00:10:244:1::99 fd00:10:244:1::6"), "without the guard a spoofed IPv6 source works");
    assert!(ping(a, &format!("-6 {b_ll}%eth0")), "and link-local between pods");

    let guard = Guard::default();
    n.guard(&guard, &[0, 1]);
    sh(a, "ip -6 neigh flush dev eth0");
    sh(b, "ip -6 neigh flush dev eth0");
    assert!(ping(a, "-I fd00:10:244:1::5 fd00:10:244:1::6"), "own IPv6 address, neighbour discovery included");
    assert!(ping(b, "fd00:10:244:1::1"), "the gateway over IPv6");
    assert!(ping(a, "-I 10.244.1.5 10.244.1.6"), "and IPv4");
    assert!(!ping(a, "-I fd00:10:244:1::99 fd00:10:244:1::6"), "a spoofed IPv6 source is dropped");
    assert!(!ping(a, &format!("-6 {b_ll}%eth0")), "link-local data between pods is dropped");
    assert!(n.dropped(&guard, &[0, 1]) > 0, "the drops are counted (and the table reads back)");
}

/// Neighbour discovery is how a pod on a bridge could take another's IPv6
/// traffic: an advertisement of the other's address at its own MAC, or a
/// solicitation from the other's address. Both reach the node without the
/// check; with it, neither does, while the pod's own neighbour discovery
/// (from its link-local address too) still works.
#[test]
fn a_bridged_pod_cannot_claim_another_pods_ipv6_address_by_neighbour_discovery() {
    if !require_root() {
        return;
    }
    let n = Node::new(Attachment::Bridge, true);
    let (a, b) = (n.pod(0), n.pod(1));
    let bridge_mac = n.bridge_mac();
    let (a_ip, b_ip, gw): (Ipv6Addr, Ipv6Addr, Ipv6Addr) =
        ("fd00:10:244:1::5".parse().unwrap(), "fd00:10:244:1::6".parse().unwrap(), "fd00:10:244:1::1".parse().unwrap());
    let a_ll: Ipv6Addr = n.link_local(0).parse().unwrap();
    let b_at_a = |node: &Ns| node_neighbour_mac(node, "fd00:10:244:1::6").contains(&mac(MAC_A));
    let ping6 = |from: &Ns, to: &str| ok(from, &format!("ping -c1 -W2 {to}"));
    let advert = neighbour_message(136, MAC_A, a_ip, bridge_mac, gw, b_ip);
    let solicit = neighbour_message(135, MAC_A, b_ip, bridge_mac, gw, gw);

    // Without the check (the guard before it): each one is taken.
    let reset = |node: &Ns| {
        sh(node, "ip -6 neigh flush dev weft0");
        assert!(ping6(node, "fd00:10:244:1::6"), "the node reaches B");
    };
    for (what, frame) in [("advertisement", &advert), ("solicitation", &solicit)] {
        reset(&n.node);
        eventually(&format!("the node to take the spoofed {what}"), || {
            send_from(a, frame.clone());
            b_at_a(&n.node)
        });
    }

    let guard = Guard::default();
    n.guard(&guard, &[0, 1]);
    for (what, frame) in [("advertisement", &advert), ("solicitation", &solicit)] {
        reset(&n.node);
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until {
            send_from(a, frame.clone());
            let entry = node_neighbour_mac(&n.node, "fd00:10:244:1::6");
            assert!(!b_at_a(&n.node), "the spoofed {what} was taken: {entry}");
        }
    }
    // The pod's own: an advertisement of its link-local address, and the
    // neighbour discovery of its own traffic.
    sh(
        &n.node,
        &format!("ip -6 neigh flush dev weft0 && ip -6 neigh add {a_ll} lladdr 02:00:00:00:00:99 dev weft0 nud stale"),
    );
    eventually("the node to take A's advertisement of its own link-local address", || {
        send_from(a, neighbour_message(136, MAC_A, a_ll, bridge_mac, gw, a_ll));
        node_neighbour_mac(&n.node, &a_ll.to_string()).contains(&mac(MAC_A))
    });
    sh(a, "ip -6 neigh flush dev eth0");
    sh(b, "ip -6 neigh flush dev eth0");
    assert!(ping6(a, "-I fd00:10:244:1::5 fd00:10:244:1::6"), "pod to pod over IPv6");
    assert!(ping6(b, "fd00:10:244:1::1"), "pod to gateway over IPv6");
    assert!(n.dropped(&guard, &[0, 1]) > 0, "the spoofed messages are counted");
}

#[test]
fn a_routed_pod_sends_only_from_its_own_addresses() {
    if !require_root() {
        return;
    }
    let n = Node::new(Attachment::Routed, false);
    let a = n.pod(0);
    let ping = |from: &Ns, args: &str| ok(from, &format!("ping -c1 -W1 {args}"));
    sh(a, "ip addr add 10.244.1.99/32 dev eth0");
    sh(&n.node, "ip route add 10.244.1.99/32 dev weftv000000000a");
    assert!(ping(a, "-I 10.244.1.99 10.244.1.6"), "without the guard a spoofed source is routed");
    let node_ll = link_local(&n.node, "weftv000000000a");
    assert!(ping(a, &format!("-6 {node_ll}%eth0")), "and IPv6 link-local to the node");

    let guard = Guard::default();
    n.guard(&guard, &[0, 1]);
    assert!(ping(a, "-I 10.244.1.5 10.244.1.6"), "a pod's own address");
    assert!(!ping(a, "-I 10.244.1.99 10.244.1.6"), "a spoofed source is dropped");
    assert!(!ping(a, &format!("-6 {node_ll}%eth0")), "no IPv6 at all from an IPv4-only pod");
    // The other pod's own address from the wrong veth, too.
    sh(a, "ip addr add 10.244.1.6/32 dev eth0");
    assert!(!ping(a, "-I 10.244.1.6 10.244.1.1"), "another pod's address on this veth is dropped");
}

#[test]
fn a_full_write_puts_back_a_flushed_guard_and_a_converged_one_writes_nothing() {
    if !require_root() {
        return;
    }
    let n = Node::new(Attachment::Bridge, false);
    let guard = Guard::default();
    n.guard(&guard, &[0, 1]);
    let full = |g: &Guard, ports: Vec<GuardedPort>| write(&n.node, g, Write::Full, ports).expect("full write").changed;
    assert!(!full(&guard, n.ports(&[0, 1])), "nothing to write when the kernel holds the guard");
    sh(&n.node, "nft flush ruleset");
    let spoofed = "ping -c1 -W1 -I 10.244.1.99 10.244.1.6";
    sh(n.pod(0), "ip addr add 10.244.1.99/24 dev eth0");
    assert!(ok(n.pod(0), spoofed), "flushed: a spoofed source passes");
    assert!(full(&guard, n.ports(&[0, 1])), "a full write puts it back");
    assert!(!ok(n.pod(0), spoofed));
    let listing = sh(&n.node, "nft list table bridge weft");
    assert!(listing.contains(desired::DROPPED) && listing.contains("weftv000000000a"), "{listing}");
}
