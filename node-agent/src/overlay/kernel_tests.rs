//! The overlay against real kernels: network namespaces built by each test
//! (an underlay bridge in its own namespace, "node" namespaces attached to
//! it, a "pod" namespace behind each node's bridge) and always removed, also
//! on panic. The reconciler runs on a thread that has entered the node's
//! namespace, so nothing here touches the root namespace's links, routes or
//! iptables, and pings only target addresses inside these namespaces.
//!
//! Needs root: without it these tests skip loudly, and fail under CI=true.
//! Run: `cargo test -p weft-agent overlay::kernel_tests` (as root).
//! Scale benchmark: `cargo test -p weft-agent --release bench_thousand_peers -- --ignored --nocapture`.

use std::fs::File;
use std::future::Future;
use std::net::Ipv4Addr;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use ipnet::Ipv4Net;
use nix::sched::{CloneFlags, setns};
use rtnetlink::Handle;

use super::desired::VxlanUnderlay;
use super::{Backend, LocalVtep, OverlayConfig, Peer, PeerError, PeerIssue, PeerPath, Reconciler, Report};
use crate::masquerade;
use crate::test_support::require_root;
use crate::tunnel::engine::Stats;

const CLUSTER: &str = "10.244.0.0/16";

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A network namespace this test created; deleted on drop.
struct Ns {
    name: String,
}

impl Ns {
    fn new(tag: &str) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!("wovl-{tag}-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        run("ip", &["netns", "add", &name]);
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    fn ip(&self, args: &[&str]) -> String {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    fn exec(&self, cmd: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, cmd])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cmd} in {}: {e}", self.name))
    }

    fn sh(&self, cmd: &str, args: &[&str]) -> String {
        let out = self.exec(cmd, args);
        assert!(out.status.success(), "{cmd} {args:?} in {}: {}", self.name, String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Continuous ping (every 10 ms) in the background.
    fn background_ping(&self, ip: &str, count: u32) -> std::process::Child {
        Command::new("ip")
            .args(["netns", "exec", &self.name, "ping", "-q", "-i", "0.01", "-W", "1", "-c", &count.to_string(), ip])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn ping")
    }

    fn ping(&self, ip: &str) -> bool {
        // A few tries: the first packets may wait for ARP on the bridges.
        (0..3).any(|_| self.exec("ping", &["-c", "1", "-W", "1", "-q", ip]).status.success())
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Runs `f` on a thread inside the namespace at `path`, with its own runtime
/// and a netlink handle opened there. Panics inside are re-raised here.
fn in_ns<F, Fut, T>(path: String, f: F) -> T
where
    F: FnOnce(Handle) -> Fut + Send + 'static,
    Fut: Future<Output = T>,
    T: Send + 'static,
{
    let t = std::thread::spawn(move || {
        let file = File::open(&path).expect("open netns");
        // If this fails the thread stops here, never acting on the root namespace.
        setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let (conn, handle, _) = rtnetlink::new_connection().expect("netlink");
            tokio::spawn(conn);
            f(handle).await
        })
    });
    t.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// True when a TCP connection from `from` to `ip` in `to` carries a message
/// both ways.
fn tcp_works(from: &Ns, to: &Ns, ip: &str) -> bool {
    tcp_echo(from, to, ip, b"weft!".to_vec())
}

/// True when `payload`, sent over a TCP connection from `from` to `ip` in
/// `to`, comes back intact. The server and client run on threads inside
/// the namespaces.
fn tcp_echo(from: &Ns, to: &Ns, ip: &str, payload: Vec<u8>) -> bool {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::time::Duration;

    let enter = |path: String| {
        let file = File::open(path).expect("open netns");
        setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
    };
    let addr: SocketAddr = format!("{ip}:7000").parse().unwrap();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let to_path = to.path();
    let len = payload.len();
    let server = std::thread::spawn(move || {
        enter(to_path);
        let listener = TcpListener::bind(addr).expect("bind");
        ready_tx.send(()).unwrap();
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).and_then(|()| s.write_all(&buf)).is_ok()
    });
    ready_rx.recv().unwrap();
    let from_path = from.path();
    let client = std::thread::spawn(move || {
        enter(from_path);
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(3)) else { return false };
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut buf = vec![0u8; payload.len()];
        s.write_all(&payload).and_then(|()| s.read_exact(&mut buf)).is_ok() && buf == payload
    });
    let ok = client.join().unwrap();
    // When the client failed, the server may still be blocked in accept():
    // leave it (the test fails anyway) rather than hang on join.
    if !ok {
        return false;
    }
    server.join().unwrap()
}

struct Node {
    name: String,
    ip: Ipv4Addr,
    cidr: Ipv4Net,
    ns: Ns,
    pod: Ns,
}

impl Node {
    fn pod_ip(&self) -> String {
        Ipv4Addr::from(u32::from(self.cidr.network()) + 2).to_string()
    }

    fn config(&self, backend: Backend, direct_routing: bool) -> OverlayConfig {
        let mut c = OverlayConfig::new(&self.name, self.ip.into(), self.cidr.into(), CLUSTER.parse().unwrap(), backend);
        // Exercise the checksum workaround whatever this kernel needs.
        c.tx_checksum_workaround = true;
        c.direct_routing = direct_routing;
        c
    }
}

/// Nodes on an underlay bridge. `subnets[i]` is the third octet of node i's
/// underlay address (192.168.<subnet>.<i+1>/24); the underlay namespace
/// routes between the subnets (it has .254 in each), like a ToR router.
struct Cluster {
    /// Kept for its drop: the underlay namespace lives as long as the nodes.
    _underlay: Ns,
    nodes: Vec<Node>,
}

impl Cluster {
    fn new(subnets: &[u8]) -> Self {
        let underlay = Ns::new("ul");
        underlay.ip(&["link", "add", "br0", "type", "bridge"]);
        underlay.ip(&["link", "set", "br0", "up"]);
        let mut distinct: Vec<u8> = subnets.to_vec();
        distinct.dedup();
        for s in &distinct {
            underlay.ip(&["addr", "add", &format!("192.168.{s}.254/24"), "dev", "br0"]);
        }
        underlay.sh("sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
        let mut nodes = Vec::new();
        for (i, s) in subnets.iter().enumerate() {
            let n = i + 1;
            let ns = Ns::new(&format!("n{n}"));
            let pod = Ns::new(&format!("p{n}"));
            let port = format!("port{n}");
            underlay.ip(&["link", "add", &port, "type", "veth", "peer", "name", "ul", "netns", &ns.name]);
            underlay.ip(&["link", "set", &port, "master", "br0", "up"]);
            let ip: Ipv4Addr = format!("192.168.{s}.{n}").parse().unwrap();
            ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "ul"]);
            ns.ip(&["link", "set", "ul", "up"]);
            for other in distinct.iter().filter(|o| *o != s) {
                ns.ip(&["route", "add", &format!("192.168.{other}.0/24"), "via", &format!("192.168.{s}.254")]);
            }
            ns.sh("sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
            // The pod side, as weft-agent's single-node datapath sets it up.
            let cidr: Ipv4Net = format!("10.244.{n}.0/24").parse().unwrap();
            ns.ip(&["link", "add", "weft0", "type", "bridge"]);
            ns.ip(&["addr", "add", &format!("10.244.{n}.1/24"), "dev", "weft0"]);
            ns.ip(&["link", "set", "weft0", "up"]);
            ns.ip(&["link", "add", "vpod", "type", "veth", "peer", "name", "eth0", "netns", &pod.name]);
            ns.ip(&["link", "set", "vpod", "master", "weft0", "up"]);
            pod.ip(&["addr", "add", &format!("10.244.{n}.2/24"), "dev", "eth0"]);
            pod.ip(&["link", "set", "eth0", "up"]);
            pod.ip(&["route", "add", "default", "via", &format!("10.244.{n}.1")]);
            nodes.push(Node { name: format!("node-{n}"), ip, cidr, ns, pod });
        }
        Self { _underlay: underlay, nodes }
    }

    /// Makes the nodes dual-stack: node i+1 gets fd00:250::<i+1>/64 on the
    /// underlay and the IPv6 block `block6(i)` (::1 on its bridge, ::2 on
    /// its pod, which routes IPv6 through it), and forwards IPv6.
    fn add_ipv6(&self) {
        for (i, n) in self.nodes.iter().enumerate() {
            let block = block6(i);
            let host = |h: u128| std::net::Ipv6Addr::from(u128::from(block.network()) | h);
            n.ns.ip(&["addr", "add", &format!("{}/64", node_ipv6(i)), "dev", "ul", "nodad"]);
            n.ns.ip(&["addr", "add", &format!("{}/64", host(1)), "dev", "weft0", "nodad"]);
            n.pod.ip(&["addr", "add", &format!("{}/64", host(2)), "dev", "eth0", "nodad"]);
            n.pod.ip(&["-6", "route", "add", "default", "via", &host(1).to_string()]);
            n.ns.sh("sysctl", &["-qw", "net.ipv6.conf.all.forwarding=1"]);
        }
    }

    /// What each node announces (VTEP MAC etc.), from a first `ensure_local`.
    fn announce(&self, backend: Backend, direct_routing: bool) -> Vec<LocalVtep> {
        self.nodes
            .iter()
            .map(|n| {
                let cfg = n.config(backend, direct_routing);
                in_ns(n.ns.path(), move |h| async move {
                    Reconciler::new(h, cfg).unwrap().ensure_local().await.expect("ensure_local")
                })
            })
            .collect()
    }

    fn peers(&self, announced: &[LocalVtep]) -> Vec<Peer> {
        self.nodes
            .iter()
            .zip(announced)
            .map(|(n, a)| Peer {
                node_name: n.name.clone(),
                pod_cidr: n.cidr.into(),
                pod_cidr6: None,
                node_ip: n.ip.into(),
                node_ipv6: None,
                vtep_mac: a.vtep_mac.map(|m| m.0),
                backend: a.backend,
                vxlan_underlay: VxlanUnderlay::Ipv4,
                wireguard_key: a.wireguard_public_key,
            })
            .collect()
    }
}

/// Node i's IPv6 block, in [`Cluster::add_ipv6`].
fn block6(i: usize) -> ipnet::Ipv6Net {
    format!("fd00:10:244:{}::/64", i + 1).parse().unwrap()
}

/// Node i's IPv6 underlay address, in [`Cluster::add_ipv6`].
fn node_ipv6(i: usize) -> std::net::Ipv6Addr {
    format!("fd00:250::{}", i + 1).parse().unwrap()
}

/// The address of node i's pod in its IPv6 block.
fn pod_ipv6(i: usize) -> String {
    std::net::Ipv6Addr::from(u128::from(block6(i).network()) | 2).to_string()
}

/// One reconcile of node `n` by a fresh Reconciler (as after a restart).
fn reconcile(n: &Node, cfg: OverlayConfig, peers: Vec<Peer>) -> Report {
    in_ns(
        n.ns.path(),
        move |h| async move { Reconciler::new(h, cfg).unwrap().reconcile(&peers).await.expect("reconcile") },
    )
}

fn assert_clean(r: &Report, peers: usize) {
    assert!(r.peer_errors.is_empty(), "peer errors: {:?}", r.peer_errors);
    assert!(r.stale_errors.is_empty(), "stale errors: {:?}", r.stale_errors);
    assert_eq!(r.ops_applied, r.ops_planned);
    assert_eq!(r.programmed.len(), peers);
}

fn all_pairs_ping(c: &Cluster) {
    for a in &c.nodes {
        for b in c.nodes.iter().filter(|b| b.name != a.name) {
            assert!(a.pod.ping(&b.pod_ip()), "pod on {} cannot reach pod on {}", a.name, b.name);
        }
    }
}

#[test]
fn vxlan_cross_node_pods_reach_each_other_and_peers_come_and_go() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50, 50]);
    let announced = c.announce(Backend::Vxlan, false);
    let peers = c.peers(&announced);
    for n in &c.nodes {
        let r = reconcile(n, n.config(Backend::Vxlan, false), peers.clone());
        assert_clean(&r, 2);
        assert_eq!(r.ops_planned, 6, "route + neighbour + FDB entry per peer");
        assert!(r.programmed.values().all(|p| matches!(p, PeerPath::Vxlan(_))));
        assert_eq!(r.local.pod_mtu, 1450);
    }
    all_pairs_ping(&c);
    assert!(tcp_works(&c.nodes[0].pod, &c.nodes[2].pod, &c.nodes[2].pod_ip()), "TCP across nodes");

    // Pods at the announced MTU get full-size packets through unfragmented.
    for n in &c.nodes[..2] {
        n.pod.ip(&["link", "set", "eth0", "mtu", "1450"]);
    }
    let full = c.nodes[0].pod.exec("ping", &["-c", "1", "-W", "2", "-M", "do", "-s", "1422", &c.nodes[1].pod_ip()]);
    assert!(full.status.success(), "1450-byte packets across VXLAN: {}", String::from_utf8_lossy(&full.stdout));

    let n1 = &c.nodes[0];
    let link = n1.ns.ip(&["-d", "link", "show", "weft.1"]);
    for want in ["mtu 1450", "vxlan id 1", "local 192.168.50.1", "dev ul", "dstport 8472", "nolearning"] {
        assert!(link.contains(want), "weft.1 lacks {want:?}: {link}");
    }
    assert!(n1.ns.ip(&["-4", "addr", "show", "dev", "weft.1"]).contains("inet 10.244.1.0/32"));
    let offload = n1.ns.sh("ethtool", &["-k", "weft.1"]);
    assert!(offload.contains("tx-checksumming: off"), "{offload}");
    let routes = n1.ns.ip(&["route", "show", "proto", "0x57"]);
    assert!(routes.contains("10.244.2.0/24 via 10.244.2.0 dev weft.1 onlink"), "{routes}");
    let fdb = n1.ns.sh("bridge", &["fdb", "show", "dev", "weft.1"]);
    let mac2 = announced[1].vtep_mac.unwrap().to_string();
    assert!(fdb.contains(&format!("{mac2} dst 192.168.50.2 self permanent")), "{fdb}");
    let neigh = n1.ns.ip(&["neigh", "show", "dev", "weft.1"]);
    assert!(neigh.contains(&format!("10.244.2.0 lladdr {mac2} PERMANENT")), "{neigh}");

    // Restart: a fresh reconciler adopts the state and changes nothing, and
    // traffic across the restarts of both ends sees no loss.
    let index_before = n1.ns.ip(&["-o", "link", "show", "weft.1"]);
    let (n2, n3) = (&c.nodes[1], &c.nodes[2]);
    let ping = n2.pod.background_ping(&n3.pod_ip(), 150);
    for n in &c.nodes {
        let r = reconcile(n, n.config(Backend::Vxlan, false), peers.clone());
        assert_clean(&r, 2);
        assert_eq!(r.ops_planned, 0, "restart must not touch correct state");
        assert!(r.local.device_changes.is_empty(), "{:?}", r.local.device_changes);
    }
    let out = ping.wait_with_output().unwrap();
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.contains(" 0% packet loss"), "traffic across restarts: {summary}");
    assert_eq!(index_before, n1.ns.ip(&["-o", "link", "show", "weft.1"]), "weft.1 was not recreated");

    // Entries the agent did not create survive, on its device or not.
    n1.ns.ip(&["route", "add", "10.244.200.0/24", "via", "192.168.50.3", "dev", "ul"]);
    n1.ns.ip(&["route", "add", "10.99.0.0/24", "via", "10.244.3.0", "dev", "weft.1", "onlink"]);

    // node-3 leaves: exactly its three entries go from node-1.
    let without3: Vec<Peer> = peers.iter().filter(|p| p.node_name != "node-3").cloned().collect();
    let r = reconcile(n1, n1.config(Backend::Vxlan, false), without3.clone());
    assert_clean(&r, 1);
    assert_eq!(r.ops_planned, 3);
    let routes = n1.ns.ip(&["route", "show"]);
    assert!(!routes.contains("10.244.3.0/24"), "{routes}");
    assert!(routes.contains("10.244.2.0/24 via 10.244.2.0 dev weft.1"), "{routes}");
    assert!(routes.contains("10.244.200.0/24 via 192.168.50.3 dev ul"), "foreign route removed: {routes}");
    assert!(routes.contains("10.99.0.0/24 via 10.244.3.0 dev weft.1"), "foreign route removed: {routes}");
    let mac3 = announced[2].vtep_mac.unwrap().to_string();
    assert!(!n1.ns.sh("bridge", &["fdb", "show", "dev", "weft.1"]).contains(&mac3));
    assert!(!n1.ns.ip(&["neigh", "show", "dev", "weft.1"]).contains("10.244.3.0 "));
    assert!(n1.pod.ping(&n2.pod_ip()));
    assert!(!n1.pod.ping(&n3.pod_ip()), "node-3 is gone from node-1's datapath");
    assert_eq!(reconcile(n1, n1.config(Backend::Vxlan, false), without3).ops_planned, 0);

    // And comes back without anyone restarting.
    let r = reconcile(n1, n1.config(Backend::Vxlan, false), peers.clone());
    assert_eq!((r.ops_planned, r.ops_applied), (3, 3));
    assert!(n1.pod.ping(&n3.pod_ip()));
}

#[test]
fn vxlan_bad_peer_data_is_reported_not_fatal() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    let announced = c.announce(Backend::Vxlan, false);
    let mut peers = c.peers(&announced);
    peers.push(Peer {
        node_name: "node-bad-mac".into(),
        pod_cidr: "10.244.9.0/24".parse().unwrap(),
        pod_cidr6: None,
        node_ip: "192.168.50.9".parse().unwrap(),
        node_ipv6: None,
        vtep_mac: Some([0xff; 6]),
        backend: Backend::Vxlan,
        vxlan_underlay: VxlanUnderlay::Ipv4,
        wireguard_key: None,
    });
    peers.push(Peer {
        node_name: "node-no-vtep".into(),
        pod_cidr: "10.244.10.0/24".parse().unwrap(),
        pod_cidr6: None,
        node_ip: "192.168.50.10".parse().unwrap(),
        node_ipv6: None,
        vtep_mac: None,
        backend: Backend::Vxlan,
        vxlan_underlay: VxlanUnderlay::Ipv4,
        wireguard_key: None,
    });
    let n1 = &c.nodes[0];
    let r = reconcile(n1, n1.config(Backend::Vxlan, false), peers);
    assert_eq!(r.programmed.len(), 1);
    assert!(matches!(r.peer_errors["node-bad-mac"], PeerIssue::Invalid(PeerError::InvalidVtepMac(_))));
    assert!(matches!(r.peer_errors["node-no-vtep"], PeerIssue::Invalid(PeerError::MissingVtepMac)));

    // A foreign route where a peer's must go is a conflict, left in place.
    n1.ns.ip(&["route", "replace", "10.244.2.0/24", "via", "192.168.50.2", "dev", "ul"]);
    let r = reconcile(n1, n1.config(Backend::Vxlan, false), c.peers(&announced));
    // The stale Weft route for 10.244.2.0/24 was replaced by hand: the
    // neighbour and FDB entries stay (they are desired), the route is foreign.
    assert!(matches!(r.peer_errors["node-2"], PeerIssue::Conflict(_)), "{:?}", r.peer_errors);
    assert!(n1.ns.ip(&["route", "show", "10.244.2.0/24"]).contains("via 192.168.50.2 dev ul"));
}

#[test]
fn vxlan_device_is_repaired_or_recreated_as_needed() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    let n1 = &c.nodes[0];
    let ensure = |cfg: OverlayConfig| {
        in_ns(n1.ns.path(), move |h| async move { Reconciler::new(h, cfg).unwrap().ensure_local().await.unwrap() })
    };
    let cfg = n1.config(Backend::Vxlan, false);

    // A device of the wrong VNI is not adopted.
    n1.ns.ip(&["link", "add", "weft.1", "type", "vxlan", "id", "42", "dstport", "8472", "dev", "ul"]);
    let l = ensure(cfg.clone());
    assert!(l.device_changes.iter().any(|c| c.starts_with("recreated: VNI")), "{:?}", l.device_changes);
    assert!(n1.ns.ip(&["-d", "link", "show", "weft.1"]).contains("vxlan id 1 "));

    // Drift that can be fixed in place is fixed in place.
    let index = n1.ns.ip(&["-o", "link", "show", "weft.1"]);
    n1.ns.ip(&["link", "set", "weft.1", "mtu", "1300", "down"]);
    n1.ns.ip(&["addr", "add", "10.9.9.9/32", "dev", "weft.1"]);
    n1.ns.sh("ethtool", &["-K", "weft.1", "tx", "on"]);
    let l = ensure(cfg.clone());
    for want in ["MTU set to 1450", "stale address removed", "set up", "tx checksum offload turned off"] {
        assert!(l.device_changes.iter().any(|c| c == want), "{want}: {:?}", l.device_changes);
    }
    assert_eq!(n1.ns.ip(&["-o", "link", "show", "weft.1"]).split(':').next(), index.split(':').next());
    assert!(ensure(cfg.clone()).device_changes.is_empty());

    // An MTU override wins over detection and reaches the pods' MTU.
    let mut small = cfg.clone();
    small.mtu = Some(1400);
    assert_eq!(ensure(small).pod_mtu, 1400);

    // A deleted device comes back with its entries on the next reconcile.
    let announced = c.announce(Backend::Vxlan, false);
    let peers = c.peers(&announced);
    for n in &c.nodes {
        assert_clean(&reconcile(n, n.config(Backend::Vxlan, false), peers.clone()), 1);
    }
    n1.ns.ip(&["link", "del", "weft.1"]);
    let r = reconcile(n1, cfg, peers);
    assert_eq!(r.local.device_changes[0], "created");
    assert!(r.local.device_changes.iter().any(|c| c == "tx checksum offload turned off"));
    assert_eq!(r.ops_applied, 3);
    all_pairs_ping(&c);
}

#[test]
fn host_gw_routes_via_node_ips_and_rejects_peers_off_l2() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    let announced = c.announce(Backend::HostGw, false);
    assert!(announced.iter().all(|a| a.vtep_mac.is_none() && a.pod_mtu == 1500));
    let mut peers = c.peers(&announced);
    peers.push(Peer {
        node_name: "node-far".into(),
        pod_cidr: "10.244.9.0/24".parse().unwrap(),
        pod_cidr6: None,
        node_ip: "192.168.60.9".parse().unwrap(),
        node_ipv6: None,
        vtep_mac: None,
        backend: Backend::HostGw,
        vxlan_underlay: VxlanUnderlay::Ipv4,
        wireguard_key: None,
    });
    for n in &c.nodes {
        let r = reconcile(n, n.config(Backend::HostGw, false), peers.clone());
        assert_eq!(r.programmed.len(), 1);
        assert!(matches!(r.peer_errors["node-far"], PeerIssue::Invalid(PeerError::NotOnSameL2 { .. })));
        assert_eq!(r.ops_planned, 1);
        assert!(n.ns.ip(&["link", "show"]).lines().all(|l| !l.contains("weft.1")), "no VXLAN device in host-gw mode");
    }
    all_pairs_ping(&c);
    assert!(tcp_works(&c.nodes[1].pod, &c.nodes[0].pod, &c.nodes[0].pod_ip()), "TCP across nodes");
    let routes = c.nodes[0].ns.ip(&["route", "show", "proto", "0x57"]);
    assert_eq!(routes.trim(), "10.244.2.0/24 via 192.168.50.2 dev ul");
    for n in &c.nodes {
        assert_eq!(reconcile(n, n.config(Backend::HostGw, false), peers.clone()).ops_planned, 0);
    }
}

#[test]
fn direct_routing_mixes_host_gw_and_vxlan_across_a_router() {
    if !require_root() {
        return;
    }
    // node-1 and node-2 share 192.168.50.0/24; node-3 is on 192.168.60.0/24.
    let c = Cluster::new(&[50, 50, 60]);
    let announced = c.announce(Backend::Vxlan, true);
    let peers = c.peers(&announced);
    let reports: Vec<Report> =
        c.nodes.iter().map(|n| reconcile(n, n.config(Backend::Vxlan, true), peers.clone())).collect();
    for r in &reports {
        assert_clean(r, 2);
    }
    assert_eq!(reports[0].programmed["node-2"], PeerPath::HostGw);
    assert!(matches!(reports[0].programmed["node-3"], PeerPath::Vxlan(_)));
    assert!(matches!(reports[2].programmed["node-1"], PeerPath::Vxlan(_)));
    all_pairs_ping(&c);
    let routes = c.nodes[0].ns.ip(&["route", "show", "proto", "0x57"]);
    assert!(routes.contains("10.244.2.0/24 via 192.168.50.2 dev ul"), "{routes}");
    assert!(routes.contains("10.244.3.0/24 via 10.244.3.0 dev weft.1 onlink"), "{routes}");
}

/// IPv6 blocks are routed over VXLAN beside the IPv4 ones, and a second
/// pass finds nothing to do (the kernel lists IPv6 routes with metric 1024;
/// a desired route without it was deleted and re-added on every pass).
#[test]
fn ipv6_blocks_are_routed_over_vxlan_and_converge() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    c.add_ipv6();
    let announced = c.announce(Backend::Vxlan, false);
    let mut peers = c.peers(&announced);
    for (i, p) in peers.iter_mut().enumerate() {
        p.pod_cidr6 = Some(block6(i));
    }
    for (i, n) in c.nodes.iter().enumerate() {
        let mut cfg = n.config(Backend::Vxlan, false);
        cfg.pod_cidr6 = Some(block6(i));
        let first = reconcile(n, cfg.clone(), peers.clone());
        assert_clean(&first, 1);
        assert_eq!(first.ops_planned, 5, "a route and a neighbour per family, one FDB entry");
        let second = reconcile(n, cfg, peers.clone());
        assert_clean(&second, 1);
        assert_eq!(second.ops_planned, 0, "converged on {}", n.name);
    }
    let routes = c.nodes[0].ns.ip(&["-6", "route", "show", "proto", "0x57"]);
    assert!(routes.contains("fd00:10:244:2::/64 via fd00:10:244:2:: dev weft.1"), "{routes}");
    assert!(c.nodes[0].pod.ping(&pod_ipv6(1)), "IPv6 pod to pod over VXLAN");
    assert!(tcp_works(&c.nodes[1].pod, &c.nodes[0].pod, &format!("[{}]", pod_ipv6(0))), "TCP over IPv6");
}

/// VXLAN over the IPv6 underlay: the device sends from the node's IPv6
/// address, the FDB entry points at the peer's, and the device MTU leaves
/// room for the 70-byte IPv6 outer headers: pods with that MTU send
/// full-sized packets of both families across, unfragmented.
#[test]
fn both_families_travel_over_vxlan_on_an_ipv6_underlay() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    c.add_ipv6();
    let config = |i: usize, n: &Node| {
        let mut cfg = n.config(Backend::Vxlan, false);
        cfg.pod_cidr6 = Some(block6(i));
        cfg.node_ipv6 = Some(node_ipv6(i));
        cfg.vxlan_underlay = VxlanUnderlay::Ipv6;
        cfg
    };
    let announced: Vec<LocalVtep> = c
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let cfg = config(i, n);
            in_ns(n.ns.path(), move |h| async move { Reconciler::new(h, cfg).unwrap().ensure_local().await.unwrap() })
        })
        .collect();
    assert!(announced.iter().all(|a| a.pod_mtu == 1500 - 70), "{announced:?}");
    let mut peers = c.peers(&announced);
    for (i, p) in peers.iter_mut().enumerate() {
        p.pod_cidr6 = Some(block6(i));
        p.node_ipv6 = Some(node_ipv6(i));
        p.vxlan_underlay = VxlanUnderlay::Ipv6;
    }
    for (i, n) in c.nodes.iter().enumerate() {
        let first = reconcile(n, config(i, n), peers.clone());
        assert_clean(&first, 1);
        assert_eq!(first.ops_planned, 5, "a route and a neighbour per family, one FDB entry");
        let second = reconcile(n, config(i, n), peers.clone());
        assert_eq!((second.ops_planned, second.local.device_changes.len()), (0, 0), "converged on {}", n.name);
        n.pod.ip(&["link", "set", "eth0", "mtu", &announced[i].pod_mtu.to_string()]);
    }
    let device = c.nodes[0].ns.ip(&["-d", "link", "show", "weft.1"]);
    assert!(device.contains("local fd00:250::1"), "{device}");
    let fdb = c.nodes[0].ns.sh("bridge", &["fdb", "show", "dev", "weft.1"]);
    assert!(fdb.contains("dst fd00:250::2"), "{fdb}");

    let (pod0, pod1) = (&c.nodes[0].pod, &c.nodes[1].pod);
    assert!(pod0.ping(&c.nodes[1].pod_ip()) && pod0.ping(&pod_ipv6(1)), "pod to pod, both families");
    let full =
        |payload: u32, ip: &str| pod0.exec("ping", &["-c", "1", "-W", "2", "-M", "do", "-s", &payload.to_string(), ip]);
    let mtu = announced[0].pod_mtu;
    assert!(full(mtu - 28, &c.nodes[1].pod_ip()).status.success(), "an MTU-sized IPv4 packet");
    assert!(full(mtu - 48, &pod_ipv6(1)).status.success(), "an MTU-sized IPv6 packet");
    assert!(tcp_works(pod1, pod0, &c.nodes[0].pod_ip()), "TCP over IPv4");
    assert!(tcp_works(pod1, pod0, &format!("[{}]", pod_ipv6(0))), "TCP over IPv6");
}

/// IPv6-only nodes (node IP, pod block and cluster range all IPv6): over
/// VXLAN the device tunnels from the node IP and carries the block's /128
/// VTEP address, over host-gw the blocks are routed to the peers' node IPs;
/// either way peers get IPv6 entries only, pods talk over IPv6 (MTU-sized
/// packets too), and a second pass finds nothing to do.
#[test]
fn ipv6_only_nodes_reach_each_other_over_vxlan_and_host_gw() {
    if !require_root() {
        return;
    }
    for backend in [Backend::Vxlan, Backend::HostGw] {
        let c = Cluster::new(&[50, 50]);
        c.add_ipv6();
        let config = |i: usize, n: &Node| {
            let cluster = "fd00:10:244::/56".parse().unwrap();
            let mut cfg = OverlayConfig::new(&n.name, node_ipv6(i).into(), block6(i).into(), cluster, backend);
            cfg.tx_checksum_workaround = true;
            cfg
        };
        let announced: Vec<LocalVtep> =
            c.nodes
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let cfg = config(i, n);
                    in_ns(n.ns.path(), move |h| async move {
                        Reconciler::new(h, cfg).unwrap().ensure_local().await.unwrap()
                    })
                })
                .collect();
        let peers: Vec<Peer> = c
            .nodes
            .iter()
            .zip(&announced)
            .enumerate()
            .map(|(i, (n, a))| Peer {
                node_name: n.name.clone(),
                pod_cidr: block6(i).into(),
                pod_cidr6: None,
                node_ip: node_ipv6(i).into(),
                node_ipv6: None,
                vtep_mac: a.vtep_mac.map(|m| m.0),
                backend,
                vxlan_underlay: VxlanUnderlay::Ipv6,
                wireguard_key: None,
            })
            .collect();
        for (i, n) in c.nodes.iter().enumerate() {
            let first = reconcile(n, config(i, n), peers.clone());
            assert_clean(&first, 1);
            let want_ops = if backend == Backend::Vxlan { 3 } else { 1 };
            assert_eq!(first.ops_planned, want_ops, "{backend}: IPv6 entries only");
            let second = reconcile(n, config(i, n), peers.clone());
            assert_eq!((second.ops_planned, second.local.device_changes.len()), (0, 0), "{backend}: converged");
            n.pod.ip(&["link", "set", "eth0", "mtu", &announced[i].pod_mtu.to_string()]);
            let peer_cidr = c.nodes[1 - i].cidr.to_string();
            assert!(!n.ns.ip(&["-4", "route"]).contains(&peer_cidr), "{backend}: no IPv4 route to the peer's pods");
        }
        let node0 = &c.nodes[0].ns;
        if backend == Backend::Vxlan {
            assert_eq!(announced[0].pod_mtu, 1500 - 70);
            let device = node0.ip(&["-d", "link", "show", "weft.1"]);
            assert!(device.contains("local fd00:250::1"), "{device}");
            let vtep = node0.ip(&["-6", "-o", "addr", "show", "dev", "weft.1", "scope", "global"]);
            assert!(vtep.contains("fd00:10:244:1::/128"), "{vtep}");
            let fdb = node0.sh("bridge", &["fdb", "show", "dev", "weft.1"]);
            assert!(fdb.contains("dst fd00:250::2"), "{fdb}");
        } else {
            let route = node0.ip(&["-6", "route", "show", "fd00:10:244:2::/64"]);
            assert!(route.contains("via fd00:250::2 dev ul"), "{route}");
        }
        let (pod0, pod1) = (&c.nodes[0].pod, &c.nodes[1].pod);
        assert!(pod0.ping(&pod_ipv6(1)) && pod1.ping(&pod_ipv6(0)), "{backend}: pod to pod over IPv6");
        let payload = (announced[0].pod_mtu - 48).to_string();
        let full = pod0.exec("ping", &["-c", "1", "-W", "2", "-M", "do", "-s", &payload, &pod_ipv6(1)]);
        assert!(full.status.success(), "{backend}: an MTU-sized IPv6 packet");
        assert!(tcp_works(pod1, pod0, &format!("[{}]", pod_ipv6(0))), "{backend}: TCP over IPv6");
        if backend == Backend::Vxlan {
            // A VTEP whose MAC an older agent derived (FNV-1a) keeps it
            // through an upgrade in place, as changing it would cut the
            // node off until every peer had the new one; another MAC is set right.
            let ensure = |cfg: OverlayConfig| {
                in_ns(
                    node0.path(),
                    move |h| async move { Reconciler::new(h, cfg).unwrap().ensure_local().await.unwrap() },
                )
            };
            let ip = node_ipv6(0).into();
            let legacy = crate::dataplane::entries::Mac(crate::dataplane::vxlan::legacy_mac_for(ip));
            node0.ip(&["link", "set", "weft.1", "address", &legacy.to_string()]);
            let kept = ensure(config(0, &c.nodes[0]));
            assert_eq!((kept.vtep_mac, kept.device_changes.len()), (Some(legacy), 0), "{:?}", kept.device_changes);
            node0.ip(&["link", "set", "weft.1", "address", "02:57:00:00:00:01"]);
            let set = ensure(config(0, &c.nodes[0]));
            assert_eq!(set.vtep_mac, Some(crate::dataplane::entries::Mac(crate::dataplane::vxlan::mac_for(ip))));
            assert_eq!(set.device_changes, ["MAC set"]);
        }
    }
}

/// host-gw routes a dual-stack peer's IPv6 block to the peer's IPv6 node
/// address on the underlay; pods talk over IPv6, and a second pass finds
/// nothing to do.
#[test]
fn ipv6_blocks_are_routed_over_host_gw_to_the_peers_ipv6_address() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    c.add_ipv6();
    let announced = c.announce(Backend::HostGw, false);
    let mut peers = c.peers(&announced);
    for (i, p) in peers.iter_mut().enumerate() {
        p.pod_cidr6 = Some(block6(i));
        p.node_ipv6 = Some(node_ipv6(i));
    }
    for (i, n) in c.nodes.iter().enumerate() {
        let mut cfg = n.config(Backend::HostGw, false);
        cfg.pod_cidr6 = Some(block6(i));
        cfg.cluster_cidr6 = Some("fd00:10:244::/48".parse().unwrap());
        let first = reconcile(n, cfg.clone(), peers.clone());
        assert_clean(&first, 1);
        assert_eq!(first.ops_planned, 2, "a route per family");
        // (A second pass that took our IPv6 route for someone else's would
        // report a conflict here.)
        let second = reconcile(n, cfg, peers.clone());
        assert_clean(&second, 1);
        assert_eq!(second.ops_planned, 0, "converged on {}", n.name);
    }
    let routes = c.nodes[0].ns.ip(&["-6", "route", "show", "proto", "0x57"]);
    assert!(routes.contains("fd00:10:244:2::/64 via fd00:250::2 dev ul"), "{routes}");
    assert!(c.nodes[0].pod.ping(&pod_ipv6(1)), "IPv6 pod to pod over host-gw");
    assert!(tcp_works(&c.nodes[1].pod, &c.nodes[0].pod, &format!("[{}]", pod_ipv6(0))), "TCP over IPv6");
}

#[test]
fn masquerade_only_traffic_leaving_the_cluster() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    let announced = c.announce(Backend::Vxlan, false);
    let peers = c.peers(&announced);
    for n in &c.nodes {
        assert_clean(&reconcile(n, n.config(Backend::Vxlan, false), peers.clone()), 1);
    }
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    // The underlay router has no route back to pods: only masqueraded pings return.
    assert!(!n1.pod.ping("192.168.50.254"));

    let masq = |n: &Node| {
        let ranges = masquerade::Ranges { pods: n.cidr, cluster: CLUSTER.parse().unwrap() };
        in_ns(n.ns.path(), move |_| async move { masquerade::ensure(Some(ranges), None).expect("masquerade") })
    };
    assert!(masq(n1), "first ensure writes");
    assert!(!masq(n1), "second ensure finds everything in place");
    let table = n1.ns.sh("nft", &["list", "table", "inet", "weft"]);
    assert_eq!(table.matches("chain masquerade-postrouting").count(), 1, "{table}");
    assert!(n1.pod.ping("192.168.50.254"), "pod traffic to outside the cluster is masqueraded");

    // Pod-to-pod is counted as kept, never as masqueraded.
    let counters = || {
        let listing = n1.ns.sh("nft", &["-j", "list", "table", "inet", "weft"]);
        let c = crate::firewall::nft::parse_listing(&listing).expect("nft listing").counters;
        (c[masquerade::KEPT].packets, c[masquerade::MASQUERADED].packets)
    };
    let (kept_before, masq_before) = counters();
    assert!(n1.pod.ping(&n2.pod_ip()));
    let (kept_after, masq_after) = counters();
    assert!(kept_after > kept_before, "pod-to-pod went through the rule that keeps the source");
    assert_eq!(masq_after, masq_before, "pod-to-pod was not masqueraded");

    let removed = in_ns(n1.ns.path(), |_| async { masquerade::remove().expect("remove") });
    assert!(removed);
    assert!(!n1.ns.sh("nft", &["list", "table", "inet", "weft"]).contains("masquerade"));
}

#[test]
fn peer_changes_are_applied_in_place_and_converge() {
    if !require_root() {
        return;
    }
    let c = Cluster::new(&[50, 50]);
    let n1 = &c.nodes[0];
    let peer = |ip: &str, mac: u8| Peer {
        node_name: "node-x".into(),
        pod_cidr: "10.244.7.0/24".parse().unwrap(),
        pod_cidr6: None,
        node_ip: ip.parse().unwrap(),
        node_ipv6: None,
        vtep_mac: Some([0x02, 0x57, 0, 0, 0, mac]),
        backend: Backend::Vxlan,
        vxlan_underlay: VxlanUnderlay::Ipv4,
        wireguard_key: None,
    };
    let step = |cfg: OverlayConfig, peers: Vec<Peer>| {
        let r = reconcile(n1, cfg.clone(), peers.clone());
        assert!(r.peer_errors.is_empty() && r.stale_errors.is_empty(), "{:?} {:?}", r.peer_errors, r.stale_errors);
        assert_eq!(r.ops_applied, r.ops_planned);
        assert_eq!(reconcile(n1, cfg, peers).ops_planned, 0, "converged after one pass");
        r.ops_planned
    };
    let vx = n1.config(Backend::Vxlan, false);
    let fdb = || n1.ns.sh("bridge", &["fdb", "show", "dev", "weft.1"]);

    assert_eq!(step(vx.clone(), vec![peer("192.168.50.7", 1)]), 3);
    // New node IP: the FDB entry's remote is replaced.
    assert_eq!(step(vx.clone(), vec![peer("192.168.50.8", 1)]), 1);
    assert!(fdb().contains("02:57:00:00:00:01 dst 192.168.50.8 self permanent"), "{}", fdb());
    assert!(!fdb().contains("192.168.50.7"));
    // New VTEP MAC: neighbour replaced, FDB entry swapped.
    assert_eq!(step(vx.clone(), vec![peer("192.168.50.8", 2)]), 3);
    assert!(!fdb().contains("02:57:00:00:00:01"), "{}", fdb());
    assert!(n1.ns.ip(&["neigh", "show", "dev", "weft.1"]).contains("10.244.7.0 lladdr 02:57:00:00:00:02 PERMANENT"));
    // Direct routing puts the same peer on host-gw: the route moves to the
    // underlay, the L2 entries go.
    let mut direct = vx.clone();
    direct.direct_routing = true;
    assert_eq!(step(direct, vec![peer("192.168.50.8", 2)]), 3);
    assert_eq!(n1.ns.ip(&["route", "show", "proto", "0x57"]).trim(), "10.244.7.0/24 via 192.168.50.8 dev ul");
    assert!(!fdb().contains("02:57:00:00:00:02"));
    // Back to VXLAN, then to host-gw mode, which removes what VXLAN left.
    assert_eq!(step(vx, vec![peer("192.168.50.8", 2)]), 3);
    let hg = n1.config(Backend::HostGw, false);
    let mut p = peer("192.168.50.8", 2);
    p.backend = Backend::HostGw;
    assert_eq!(step(hg.clone(), vec![p]), 3);
    assert_eq!(n1.ns.ip(&["route", "show", "proto", "0x57"]).trim(), "10.244.7.0/24 via 192.168.50.8 dev ul");
    assert!(n1.ns.ip(&["neigh", "show", "dev", "weft.1"]).trim().is_empty());
    // No peers: nothing of ours is left.
    assert_eq!(step(hg, vec![]), 1);
    assert!(n1.ns.ip(&["route", "show", "proto", "0x57"]).trim().is_empty());
}

/// 1,000 peers programmed into one node: full programming time, the cost of
/// one change, and the no-op resync. Prints a small table.
#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn bench_thousand_peers() {
    if !require_root() {
        return;
    }
    let node = Ns::new("bench");
    node.ip(&["link", "add", "ul", "type", "veth", "peer", "name", "ulpeer"]);
    node.ip(&["link", "set", "ulpeer", "up"]);
    node.ip(&["addr", "add", "172.16.0.1/16", "dev", "ul"]);
    node.ip(&["link", "set", "ul", "up"]);
    let mut cfg = OverlayConfig::new(
        "self",
        "172.16.0.1".parse().unwrap(),
        "10.0.0.0/24".parse().unwrap(),
        "10.0.0.0/8".parse().unwrap(),
        Backend::Vxlan,
    );
    cfg.underlay = Some("ul".into());
    let mut peers: Vec<Peer> = (1..=1000u32)
        .map(|i| {
            let [_, _, hi, lo] = i.to_be_bytes();
            Peer {
                node_name: format!("peer-{i}"),
                pod_cidr: Ipv4Net::new(Ipv4Addr::new(10, hi, lo, 0), 24).unwrap().into(),
                pod_cidr6: None,
                node_ip: Ipv4Addr::new(172, 17, hi, lo).into(),
                node_ipv6: None,
                vtep_mac: Some([0x02, 0x57, 0, 0, hi, lo]),
                backend: Backend::Vxlan,
                vxlan_underlay: VxlanUnderlay::Ipv4,
                wireguard_key: None,
            }
        })
        .collect();
    let run = |peers: &[Peer]| {
        let (cfg, peers) = (cfg.clone(), peers.to_vec());
        in_ns(node.path(), move |h| async move { Reconciler::new(h, cfg).unwrap().reconcile(&peers).await.unwrap() })
    };
    let full = run(&peers);
    assert_clean(&full, 1000);
    let noop = run(&peers);
    peers[499].node_ip = Ipv4Addr::new(172, 18, 0, 1).into();
    peers[500].vtep_mac = Some([0x02, 0x57, 9, 9, 9, 9]);
    let change = run(&peers);
    assert_eq!(noop.ops_planned, 0);
    assert!(change.ops_planned <= 4, "two changed peers: {}", change.ops_planned);
    eprintln!("| step                         | ops  | time      |");
    eprintln!("|------------------------------|------|-----------|");
    for (what, r) in [("program 1,000 peers", &full), ("resync, nothing changed", &noop), ("2 peers changed", &change)]
    {
        eprintln!("| {what:<28} | {:>4} | {:>7.1?} |", r.ops_applied, r.elapsed);
    }
}

/// A reconciler that keeps running after its reconcile: the TUN backends'
/// datapath lives as long as it does (its threads and sockets stay in the
/// node's namespace; its netlink handle does not outlive the pass).
fn reconcile_and_keep(n: &Node, cfg: OverlayConfig, peers: Vec<Peer>, stats: Stats) -> (Reconciler, Report) {
    in_ns(n.ns.path(), move |h| async move {
        let r = Reconciler::new(h, cfg).unwrap().with_tunnel_stats(stats);
        let report = r.reconcile(&peers).await.expect("reconcile");
        (r, report)
    })
}

/// Node `i`'s configuration on a TUN backend, dual-stack.
fn tunnel_config(i: usize, n: &Node, backend: Backend, keys: &std::path::Path) -> OverlayConfig {
    let mut cfg = n.config(backend, false);
    cfg.pod_cidr6 = Some(block6(i));
    cfg.cluster_cidr6 = Some("fd00:10:244::/56".parse().unwrap());
    if backend == Backend::Wireguard {
        let dir = keys.join(&n.name);
        cfg.wireguard_key = Some(crate::tunnel::keys::load_or_create(&dir, false).expect("a key"));
    }
    cfg
}

#[test]
fn tun_backends_carry_pods_across_nodes_and_a_restart_adopts_the_device() {
    if !require_root() {
        return;
    }
    for backend in [Backend::Udp, Backend::Wireguard] {
        let keys = tempfile::tempdir().unwrap();
        let c = Cluster::new(&[50, 50]);
        c.add_ipv6();
        let announced: Vec<LocalVtep> = c
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let cfg = tunnel_config(i, n, backend, keys.path());
                reconcile_and_keep(n, cfg, vec![], Stats::default()).1.local
            })
            .collect();
        assert_eq!(announced[0].pod_mtu, if backend == Backend::Udp { 1472 } else { 1440 }, "{backend}");
        assert_eq!(announced[0].wireguard_public_key.is_some(), backend == Backend::Wireguard);
        let mut peers = c.peers(&announced);
        for (i, p) in peers.iter_mut().enumerate() {
            p.pod_cidr6 = Some(block6(i));
        }
        let stats = [Stats::default(), Stats::default()];
        let mut running: Vec<Reconciler> = c
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let cfg = tunnel_config(i, n, backend, keys.path());
                let (r, report) = reconcile_and_keep(n, cfg, peers.clone(), stats[i].clone());
                assert_clean(&report, 1);
                assert!(report.programmed.values().all(|p| *p == PeerPath::Tunnel));
                r
            })
            .collect();
        let routes = c.nodes[0].ns.ip(&["route", "show", CLUSTER]);
        assert!(routes.contains("dev weft-tun"), "{backend}: {routes}");
        all_pairs_ping(&c);
        assert!(tcp_works(&c.nodes[0].pod, &c.nodes[1].pod, &c.nodes[1].pod_ip()), "{backend}: TCP across nodes");

        // A bulk transfer both ways, over each family, arrives intact
        // through the offloads: the device hands over many segments per
        // read and takes many per write (one read per packet would mean no
        // TSO; one write per packet, nothing joined).
        let payload: Vec<u8> = (0..4usize << 20).map(|i| (i * 31 + i / 977) as u8).collect();
        for to in [c.nodes[1].pod_ip(), format!("[{}]", pod_ipv6(1))] {
            let (reads, writes) = (stats[0].device_reads.get(), stats[1].device_writes.get());
            let (sent, received) = (stats[0].sent.get(), stats[1].received.get());
            assert!(tcp_echo(&c.nodes[0].pod, &c.nodes[1].pod, &to, payload.clone()), "{backend} {to}: 4 MiB each way");
            let per_read = (stats[0].sent.get() - sent) as f64 / (stats[0].device_reads.get() - reads) as f64;
            let per_write =
                (stats[1].received.get() - received) as f64 / (stats[1].device_writes.get() - writes) as f64;
            eprintln!(
                "{backend} {to}: {per_read:.1} datagrams per device read, {per_write:.1} packets per device write"
            );
            assert!(
                per_read > 2.0 && per_write > 2.0,
                "{backend} {to}: offloads in effect: {per_read:.1}, {per_write:.1}"
            );
        }

        // A restart: the device, its address and route stayed; the new
        // datapath attaches to it and traffic flows again.
        drop(running.pop());
        assert!(c.nodes[1].ns.ip(&["link", "show", "weft-tun"]).contains("weft-tun"), "the device persists");
        let cfg = tunnel_config(1, &c.nodes[1], backend, keys.path());
        let (again, report) = reconcile_and_keep(&c.nodes[1], cfg, peers, Stats::default());
        assert_eq!(report.ops_planned, 0, "{backend}: the route was kept");
        assert!(
            report.local.device_changes.iter().any(|ch| ch == "datapath started"),
            "{:?}",
            report.local.device_changes
        );
        running.push(again);
        all_pairs_ping(&c);
        drop(running);
    }
}
