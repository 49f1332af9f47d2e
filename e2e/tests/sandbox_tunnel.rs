//! The TUN backends in the sandbox cluster (real control plane, operator,
//! one weft-agent per node namespace): `wireguard` carries pod traffic
//! between nodes only encrypted (a capture on the underlay sees neither the
//! pods' payload nor their addresses), keeps it flowing across an agent
//! restart with the same key; `udp` (flannel's UDP backend) connects pods
//! over its TUN device, and a host port works beside it. Both route the whole cluster range into the device,
//! so nothing for another node leaves in clear by another route.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_e2e::capture::{self, Capture};
use weft_e2e::sandbox::testing::{
    Up, assert_all_allowed, assert_reaches, ip_in_node, ok, probe_all, smuggled_arrives, subnet,
};

fn pod_ip(name: &str) -> Ipv4Addr {
    ok(&["pods"])
        .lines()
        .find(|l| l.starts_with(&format!("default/{name} ")))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("no IPv4 address for pod {name}"))
}

/// UDP datagrams between the two node addresses in `frames` (Ethernet,
/// IPv4), as (source port, destination port).
fn udp_between_nodes(frames: &[Vec<u8>]) -> Vec<(u16, u16)> {
    let nodes = [[10, 250, 0, 11], [10, 250, 0, 12]];
    frames
        .iter()
        .filter(|f| f.len() >= 42 && f[12..14] == [0x08, 0x00] && f[23] == 17)
        .filter(|f| nodes.iter().any(|n| f[26..30] == *n) && nodes.iter().any(|n| f[30..34] == *n))
        .map(|f| {
            let l4 = 14 + usize::from(f[14] & 0x0f) * 4;
            (u16::from_be_bytes([f[l4], f[l4 + 1]]), u16::from_be_bytes([f[l4 + 2], f[l4 + 3]]))
        })
        .collect()
}

#[test]
fn wireguard_carries_pods_traffic_between_nodes_only_encrypted() {
    let Some(_up) = Up::start(&["--nodes", "2", "--backend", "wireguard"], &[]) else { return };
    // The pods' names are the marker: every answer of the probe carries it.
    let ports = ["-p", "80/tcp", "-p", "53/udp"];
    ok(&[&["add-pod", "marker-a", "--node", "node-1"][..], &ports].concat());
    ok(&[&["add-pod", "marker-b", "--node", "node-2", "--host-port", "8088:80/tcp"][..], &ports].concat());

    let keys: Vec<String> = ["node-1", "node-2"]
        .map(|n| subnet(n)["status"]["wireguardPublicKey"].as_str().unwrap_or_default().to_owned())
        .into();
    assert!(keys.iter().all(|k| k.len() == 44) && keys[0] != keys[1], "each node publishes its own key: {keys:?}");
    let device = ip_in_node("node-1", &["link", "show", "weft-tun"]);
    assert!(device.contains("mtu 1440"), "1500 minus WireGuard's 60 bytes over IPv4: {device}");
    let routes = ip_in_node("node-1", &["route", "show", "10.244.0.0/16"]);
    assert!(routes.contains("dev weft-tun"), "the cluster range goes into the TUN device: {routes}");

    let capture = Capture::start("weft-sbx-node-1", "eth0").expect("capture on node-1's underlay");
    assert_all_allowed(&probe_all("tcp", "80"));
    assert_all_allowed(&probe_all("udp", "53"));
    let frames = capture.stop().expect("captured frames");
    let datagrams = udp_between_nodes(&frames);
    assert!(!datagrams.is_empty(), "no UDP between the nodes was captured ({} frames)", frames.len());
    assert!(
        datagrams.iter().all(|(s, d)| *s == 51820 && *d == 51820),
        "between the nodes, UDP only from and to the WireGuard port: {datagrams:?}"
    );
    assert!(!capture::contains(&frames, b"marker-"), "a pod's payload crossed the underlay in clear");
    for pod in ["marker-a", "marker-b"] {
        let ip = pod_ip(pod).octets();
        assert!(!capture::contains(&frames, &ip), "pod {pod}'s address crossed the underlay in clear");
    }
    // A host port beside the tunnel (reached at the node's address, so not
    // through it), from a pod of another node and from that node.
    let node2 = subnet("node-2")["status"]["nodeIP"].as_str().expect("node-2's address").to_owned();
    for from in ["default/marker-a", "node-1"] {
        assert_reaches(from, "tcp", &format!("{node2}:8088"), "default/marker-b", Duration::from_secs(30));
    }

    // An agent restart keeps the key, and traffic comes back by itself
    // within a handshake: the restarted node greets its peers instead of
    // waiting for their sessions (which it has forgotten) to expire, which
    // takes minutes. Five echoes within 10 s.
    let b = pod_ip("marker-b").to_string();
    ok(&["restart-agent", "node-2"]);
    let ping = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-pod-default-marker-a", "ping", "-q", "-c", "5", "-i", "0.2", "-w", "10", &b])
        .output()
        .expect("ping");
    let summary = String::from_utf8_lossy(&ping.stdout);
    eprintln!("after the restart: {}", summary.lines().find(|l| l.contains("loss")).unwrap_or_default());
    assert!(ping.status.success(), "traffic did not come back after the restart: {summary}");
    assert_eq!(subnet("node-2")["status"]["wireguardPublicKey"].as_str(), Some(keys[1].as_str()), "same key");
    assert_all_allowed(&probe_all("tcp", "80"));

    // Rotation on request, under a ping stream (200 echoes 50 ms apart):
    // node-2 makes and publishes a new key, node-1 takes it from the API,
    // and traffic goes on after one handshake.
    let ping = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-pod-default-marker-a", "ping", "-q", "-c", "200", "-i", "0.05"])
        .args(["-W", "1", &b])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ping");
    let request = format!("{}={}", weft_api::subnet::WIREGUARD_KEY_ROTATION, "first");
    ok(&["kubectl", "annotate", "subnet", "node-2", &request]);
    let rotated = weft_e2e::wait::until("node-2's new key", std::time::Duration::from_secs(30), || {
        let key = subnet("node-2")["status"]["wireguardPublicKey"].as_str().map(str::to_owned)?;
        (key != keys[1]).then_some(key)
    });
    assert_eq!(rotated.len(), 44);
    let out = ping.wait_with_output().expect("ping output");
    let summary = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("across the rotation: {}", summary.lines().find(|l| l.contains("loss")).unwrap_or_default());
    let received: u32 = summary
        .lines()
        .find_map(|l| l.split(", ").nth(1)?.strip_suffix(" received")?.parse().ok())
        .unwrap_or_else(|| panic!("no ping summary: {summary}"));
    assert!(received >= 150, "more than a quarter of the echoes lost across the rotation: {summary}");
    assert_all_allowed(&probe_all("tcp", "80"));
}

#[test]
fn udp_backend_carries_pods_traffic_through_its_tun_device() {
    let Some(_up) = Up::start(&["--nodes", "2", "--backend", "udp"], &[]) else { return };
    let ports = ["-p", "80/tcp", "-p", "53/udp"];
    ok(&[&["add-pod", "a", "--node", "node-1"][..], &ports].concat());
    ok(&[&["add-pod", "b", "--node", "node-2"][..], &ports].concat());
    ok(&[&["add-pod", "c", "--node", "node-2", "--host-port", "8088:80/tcp"][..], &ports].concat());
    let device = ip_in_node("node-2", &["link", "show", "weft-tun"]);
    assert!(device.contains("mtu 1472"), "1500 minus the IPv4 and UDP headers: {device}");
    // A host port of a node with a TUN backend, from a pod of another node
    // and from that node itself.
    let node2 = subnet("node-2")["status"]["nodeIP"].as_str().expect("node-2's address").to_owned();
    for from in ["default/a", "node-1"] {
        assert_reaches(from, "tcp", &format!("{node2}:8088"), "default/c", Duration::from_secs(30));
    }

    let capture = Capture::start("weft-sbx-node-1", "eth0").expect("capture on node-1's underlay");
    assert_all_allowed(&probe_all("tcp", "80"));
    assert_all_allowed(&probe_all("udp", "53"));
    let datagrams = udp_between_nodes(&capture.stop().expect("captured frames"));
    assert!(
        !datagrams.is_empty() && datagrams.iter().all(|(s, d)| *s == 8285 && *d == 8285),
        "pods' packets travel as UDP between the nodes' port 8285: {datagrams:?}"
    );

    // A pod's own udp-backend packet (a bare IPv4 packet in a datagram to
    // port 8285) with a made-up source of its node's block: masqueraded,
    // it would come from node-1's address and pass for node-1's traffic.
    let made_up = pod_ip("a").octets().map(|o| o.to_string());
    let src = format!("{}.{}.{}.250", made_up[0], made_up[1], made_up[2]);
    let b = pod_ip("b").to_string();
    let target = format!("{node2}:8285").parse().expect("an address");
    assert!(
        !smuggled_arrives("default/a", target, None, &src, &b, "node-2"),
        "node-2 took a pod's own packet to {target} for node-1's traffic"
    );
}

/// wireguard-go in a namespace of its own on the underlay, configured with
/// `wg`; killed (and its namespace removed) when dropped.
struct StockPeer {
    netns: &'static str,
    daemon: std::process::Child,
}

impl StockPeer {
    fn exec(&self, args: &[&str]) -> std::process::Output {
        Command::new("ip").args(["netns", "exec", self.netns]).args(args).output().expect("ip netns exec")
    }

    #[track_caller]
    fn run(&self, args: &[&str]) -> String {
        let out = self.exec(args);
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{args:?} in the stock peer's namespace failed: {text}");
        text
    }
}

impl Drop for StockPeer {
    fn drop(&mut self) {
        // SIGTERM: wireguard-go then removes its control socket (shared by
        // every namespace in /var/run/wireguard).
        let pid = nix::unistd::Pid::from_raw(self.daemon.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.daemon.wait();
        let _ = Command::new("ip").args(["netns", "del", self.netns]).status();
    }
}

fn tool(name: &str) -> std::path::PathBuf {
    weft_e2e::control_plane::tools_dir().join(name)
}

fn wg_present() -> bool {
    Command::new("wg").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Interoperability: a stock WireGuard implementation (wireguard-go, set up
/// with Debian's `wg`) is a peer of a Weft node using only what the API
/// holds: the node's published key, and the stock peer's key and address
/// written into a Subnet's status. Traffic flows both ways, so the wire
/// format is WireGuard's own, not a private framing. Until the status is
/// written the node sends the stock peer nothing.
#[test]
fn a_stock_wireguard_peer_exchanges_traffic_with_a_weft_node() {
    let tools = [
        ("wireguard-go (e2e/scripts/build-tools.sh)", tool("wireguard-go").is_file()),
        ("wg (Debian wireguard-tools)", wg_present()),
    ];
    let Some(_up) = Up::start(&["--nodes", "1", "--backend", "wireguard"], &tools) else { return };
    ok(&["add-pod", "a", "--node", "node-1", "-p", "80/tcp"]);
    let node1 = subnet("node-1");
    let (node1_key, node1_cidr) = (
        node1["status"]["wireguardPublicKey"].as_str().expect("node-1's key").to_owned(),
        node1["spec"]["cidr"].as_str().expect("node-1's block").to_owned(),
    );

    // The stock peer is a node as far as the API goes: a Node, its lease,
    // and the status its agent would publish.
    let node = "stock-wireguard";
    weft_e2e::sandbox::testing::apply(&format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {node}}}\n"));
    let cidr = weft_e2e::wait::until("the stock peer's lease", std::time::Duration::from_secs(30), || {
        subnet_if_any(node).and_then(|s| s["spec"]["cidr"].as_str().map(str::to_owned))
    });
    let private = Command::new("wg").arg("genkey").output().expect("wg genkey").stdout;
    let mut pubkey = Command::new("wg")
        .arg("pubkey")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("wg pubkey");
    std::io::Write::write_all(pubkey.stdin.as_mut().expect("stdin"), &private).expect("write the key");
    let public = String::from_utf8(pubkey.wait_with_output().expect("wg pubkey").stdout).expect("utf-8");
    let netns = "weft-sbx-stockwg";
    weft_e2e::sandbox::nodes::attach_to_underlay(netns, "swg", "10.250.0.50".parse().expect("address"))
        .expect("the stock peer's namespace");
    let daemon = Command::new("ip")
        .args(["netns", "exec", netns])
        .arg(tool("wireguard-go"))
        .args(["-f", "wg0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("wireguard-go");
    let peer = StockPeer { netns, daemon };
    weft_e2e::wait::until("wireguard-go's wg0", std::time::Duration::from_secs(10), || {
        peer.exec(&["ip", "link", "show", "wg0"]).status.success().then_some(())
    });
    let key_file = tempfile::NamedTempFile::new().expect("key file");
    std::fs::write(key_file.path(), &private).expect("write the private key");
    let block: ipnet::Ipv4Net = cidr.parse().expect("an IPv4 block");
    let stock_ip = block.hosts().next().expect("a host address").to_string();
    peer.run(&["wg", "set", "wg0", "private-key", key_file.path().to_str().expect("path"), "listen-port", "51820"]);
    peer.run(&["wg", "set", "wg0", "peer", &node1_key, "endpoint", "10.250.0.11:51820", "allowed-ips", &node1_cidr]);
    peer.run(&["ip", "addr", "add", &format!("{stock_ip}/32"), "dev", "wg0"]);
    peer.run(&["ip", "link", "set", "wg0", "mtu", "1420", "up"]);
    peer.run(&["ip", "route", "add", &node1_cidr, "dev", "wg0"]);

    // Weft → stock: pod a pings the stock peer every 10 ms (timestamped)
    // while the stock peer's status is written: from then on node-1 has a
    // peer for its block, and the first echo back marks encrypted traffic
    // flowing (printed: the time from a new node's Subnet to traffic).
    let pinger = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-pod-default-a", "ping", "-D", "-i", "0.01", "-c", "500", "-W", "1"])
        .arg(&stock_ip)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ping");
    let status = serde_json::json!({"status": {"nodeIP": "10.250.0.50", "wireguardPublicKey": public.trim()}});
    let written = std::time::SystemTime::now();
    ok(&["kubectl", "patch", "subnet", node, "--subresource=status", "--type=merge", "-p", &status.to_string()]);
    let echoes = String::from_utf8_lossy(&pinger.wait_with_output().expect("ping output").stdout).into_owned();
    let first = echoes
        .lines()
        .filter(|l| l.contains("bytes from"))
        .find_map(|l| l.strip_prefix('[')?.split(']').next()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("pod a never reached the stock peer: {echoes}"));
    let since = written.duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    assert!(first > since, "an echo came back before the stock peer's Subnet was written: {echoes}");
    eprintln!("a new node's Subnet to encrypted traffic: {:.0} ms (kubectl patch included)", (first - since) * 1000.0);

    // Stock → Weft as well.
    let a = pod_ip("a").to_string();
    let from_stock = peer.exec(&["ping", "-c", "3", "-W", "2", &a]);
    assert!(from_stock.status.success(), "the stock peer cannot reach pod a");
    let from_pod = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-pod-default-a", "ping", "-c", "3", "-W", "2", &stock_ip])
        .output()
        .expect("ping");
    assert!(
        from_pod.status.success(),
        "pod a cannot reach the stock peer: {}",
        String::from_utf8_lossy(&from_pod.stdout)
    );
    let handshakes = peer.run(&["wg", "show", "wg0", "latest-handshakes"]);
    assert!(handshakes.contains(&node1_key) && !handshakes.trim_end().ends_with("\t0"), "{handshakes}");
    drop(peer);
    ok(&["kubectl", "delete", "node", node]);
}

fn subnet_if_any(node: &str) -> Option<Value> {
    let (found, out) = weft_e2e::sandbox::testing::run(&["kubectl", "get", "subnet", node, "-o", "json"]);
    if !found {
        return None;
    }
    serde_json::from_str(&out).ok()
}

/// An IPv6-only cluster over wireguard: tunnels between the nodes' IPv6
/// addresses, 80 bytes taken off the MTU, the cluster's IPv6 range in the
/// device, pods reaching each other over TCP and UDP.
#[test]
fn wireguard_connects_an_ipv6_only_cluster() {
    let Some(_up) = Up::start(&["--nodes", "2", "--ipv6-only", "--backend", "wireguard"], &[]) else { return };
    let ports = ["-p", "80/tcp", "-p", "53/udp"];
    ok(&[&["add-pod", "a", "--node", "node-1"][..], &ports].concat());
    ok(&[&["add-pod", "b", "--node", "node-2"][..], &ports].concat());
    let device = ip_in_node("node-1", &["link", "show", "weft-tun"]);
    assert!(device.contains("mtu 1420"), "1500 minus WireGuard's 80 bytes over IPv6: {device}");
    let routes = ip_in_node("node-1", &["-6", "route", "show", "dev", "weft-tun"]);
    assert!(routes.contains("fd00:10:244::/56"), "{routes}");
    for protocol in [("tcp", "80"), ("udp", "53")] {
        let m: Value =
            serde_json::from_str(&ok(&["probe", "--protocol", protocol.0, "--port", protocol.1, "--family", "ipv6"]))
                .expect("probe JSON");
        assert_all_allowed(&m);
    }
}
