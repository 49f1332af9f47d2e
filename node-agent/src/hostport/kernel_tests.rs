//! Host ports against a real kernel, in a throwaway network namespace:
//! what ADD/DEL/sync write to Weft's nftables table, that other components'
//! iptables and nftables rules survive, the upgrade from the iptables-era
//! chains, and (ignored, a benchmark) 1,000 allocations with the nftables
//! engine beside the iptables one it replaced. Needs root; fails under
//! CI=true without it.

use std::fs::File;
use std::process::Command;
use std::time::Instant;

use nix::sched::{CloneFlags, setns};
use weft_api::Protocol;

use super::{HostPorts, PodBlocks, PodIdentity, Wanted, rules, rules_iptables_old};
use crate::ipam::Key;
use crate::test_support::require_root;

/// A namespace removed on drop.
struct Ns(String);

impl Ns {
    fn new(tag: &str) -> Self {
        let name = format!("whp-{tag}-{}", std::process::id());
        let ok = Command::new("ip").args(["netns", "add", &name]).status().is_ok_and(|s| s.success());
        assert!(ok, "cannot create netns {name}");
        Ns(name)
    }

    /// What `cmd args` prints in the namespace (it must succeed).
    fn sh(&self, cmd: &str, args: &[&str]) -> String {
        let out = Command::new("ip").args(["netns", "exec", &self.0, cmd]).args(args).output().expect(cmd);
        assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn nat(&self) -> String {
        self.sh("iptables-save", &["-t", "nat"])
    }

    fn weft(&self) -> String {
        self.sh("nft", &["list", "table", "inet", "weft"])
    }

    /// Runs `f` on a multi-threaded runtime whose threads all live in the namespace.
    fn run<T: Send + 'static>(&self, f: impl AsyncFnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let file = File::open(&path).expect("open netns");
            // If this fails the thread stops here, never acting on the root namespace.
            setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
            // Threads inherit the namespace of the thread that creates them.
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
            rt.block_on(f())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn key(i: usize) -> Key {
    Key { container_id: format!("c{i:04}"), ifname: "eth0".into() }
}

fn pod(i: usize) -> PodIdentity {
    PodIdentity { namespace: "default".into(), name: format!("p{i}"), uid: String::new() }
}

fn auto(protocol: Protocol, port: u16) -> Wanted {
    Wanted { protocol, container_port: port, host_port: None, host_ip: None, name: None }
}

#[test]
fn add_release_and_sync_write_exactly_our_rules() {
    if !require_root() {
        return;
    }
    let ns = Ns::new("rules");
    // Someone else's rules, there before us: iptables (nft backend) and a table of their own.
    ns.sh("iptables", &["-t", "nat", "-N", "OTHER"]);
    ns.sh("iptables", &["-t", "nat", "-A", "PREROUTING", "-j", "OTHER"]);
    ns.sh("iptables", &["-t", "nat", "-A", "OTHER", "-p", "tcp", "--dport", "20000", "-j", "RETURN"]);
    ns.sh("nft", &["add table ip other; add chain ip other pre { type nat hook prerouting priority -100; }; add rule ip other pre tcp dport 20000 counter"]);
    let port = ns.run(async move || {
        let hp = HostPorts::new(
            "20000-20099".parse().unwrap(),
            PodBlocks { pool: "10.244.1.0/24".parse().unwrap(), ipv6: None },
            vec![],
        );
        hp.sync().await.unwrap();
        let ip = "10.244.1.5".parse().unwrap();
        let a = hp.reserve(&key(1), &pod(1), &[ip], &[auto(Protocol::Tcp, 80), auto(Protocol::Udp, 53)]).unwrap();
        hp.program(a.as_ref()).await.unwrap();
        let a = a.unwrap();
        assert_eq!(a.ports.len(), 2);
        hp.check(&key(1)).await.unwrap();
        // Converged: a sync writes nothing.
        assert!(!hp.sync().await.unwrap());
        // A flushed chain is rewritten; CHECK notices before that.
        let chain = rules::chain_name(rules::port(&a.ports[0]));
        // (This thread is in the namespace already.)
        let nft = |args: &[&str]| Command::new("nft").args(args).status().is_ok_and(|s| s.success());
        assert!(nft(&["flush", "chain", "inet", "weft", &chain]));
        assert!(hp.check(&key(1)).await.unwrap_err().contains("host port rule missing"));
        assert!(hp.sync().await.unwrap());
        hp.check(&key(1)).await.unwrap();
        // A deleted table is made again.
        assert!(nft(&["delete", "table", "inet", "weft"]));
        assert!(hp.check(&key(1)).await.unwrap_err().contains("not in the nftables map"));
        assert!(hp.sync().await.unwrap());
        hp.check(&key(1)).await.unwrap();
        hp.release(&key(1)).await.unwrap();
        hp.release(&key(1)).await.unwrap();
        assert!(hp.all().is_empty());
        a.ports[0].host_port
    });
    let nat = ns.nat();
    assert!(
        nat.contains("-A PREROUTING -j OTHER") && nat.contains("-A OTHER -p tcp -m tcp --dport 20000 -j RETURN"),
        "{nat}"
    );
    assert!(ns.sh("nft", &["list", "table", "ip", "other"]).contains("tcp dport 20000 counter"));
    let weft = ns.weft();
    assert!(!weft.contains(&format!("hostport-tcp-{port}")), "rules left after release:\n{weft}");
    assert_eq!(weft.matches("vmap @hostport-ports").count(), 2, "one lookup each from prerouting and output:\n{weft}");
}

/// Runs `f` on a new thread inside namespace `ns`.
fn spawn_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> std::thread::JoinHandle<T> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = File::open(&path).expect("open netns");
        setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
}

/// A dual-stack pod's host port over IPv6 as over IPv4: a client reaches
/// it at the node's addresses of both families (keeping its own source),
/// and the pod reaches itself through the node's IPv6 address (hairpin:
/// masqueraded, so the answer comes back through the node).
#[test]
fn a_dual_stack_pod_is_reached_at_both_node_addresses_and_from_itself() {
    if !require_root() {
        return;
    }
    let (node, client, pod_ns) = (Ns::new("node6"), Ns::new("client6"), Ns::new("pod6"));
    let ip = |ns: &Ns, args: &[&str]| {
        let ok = Command::new("ip").args(["-n", &ns.0]).args(args).status().is_ok_and(|s| s.success());
        assert!(ok, "ip -n {} {args:?}", ns.0);
    };
    // (namespace, its end, the node's end, its addresses, the node's addresses)
    let links = [
        (&pod_ns, "p", ["10.244.1.5/24", "fd00:10:244:1::5/64"], ["10.244.1.1/24", "fd00:10:244:1::1/64"]),
        (&client, "c", ["10.250.0.2/24", "fd00:250::2/64"], ["10.250.0.11/24", "fd00:250::11/64"]),
    ];
    for (ns, peer, own, node_side) in links {
        ip(ns, &["link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", &node.0]);
        for (n, dev, addrs) in [(ns, "eth0", own), (&node, peer, node_side)] {
            for a in addrs {
                let no_dad = if a.contains(':') { &["nodad"][..] } else { &[] };
                ip(n, &[&["addr", "add", a, "dev", dev][..], no_dad].concat());
            }
            ip(n, &["link", "set", dev, "up"]);
        }
    }
    ip(&pod_ns, &["route", "add", "default", "via", "10.244.1.1"]);
    ip(&pod_ns, &["-6", "route", "add", "default", "via", "fd00:10:244:1::1"]);
    node.sh("sysctl", &["-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"]);

    let port = node.run(async move || {
        let blocks =
            PodBlocks { pool: "10.244.1.0/24".parse().unwrap(), ipv6: Some("fd00:10:244:1::/64".parse().unwrap()) };
        let hp = HostPorts::new("20000-20099".parse().unwrap(), blocks, vec![]);
        let ips = ["10.244.1.5".parse().unwrap(), "fd00:10:244:1::5".parse().unwrap()];
        let a = hp.reserve(&key(1), &pod(1), &ips, &[auto(Protocol::Tcp, 8080)]).unwrap();
        hp.program(a.as_ref()).await.unwrap();
        hp.check(&key(1)).await.unwrap();
        assert!(!hp.sync().await.unwrap(), "converged");
        a.unwrap().ports[0].host_port
    });

    // The pod answers each connection with the address it came from.
    let listener = spawn_in(&pod_ns.0, || std::net::TcpListener::bind("[::]:8080").expect("listen"));
    let listener = listener.join().expect("listener");
    let server = std::thread::spawn(move || {
        for conn in listener.incoming().take(3) {
            let mut conn = conn.expect("accept");
            let peer = conn.peer_addr().expect("peer").ip().to_canonical();
            let _ = std::io::Write::write_all(&mut conn, peer.to_string().as_bytes());
        }
    });
    let ask = |ns: &Ns, target: String| {
        spawn_in(&ns.0, move || {
            let addr: std::net::SocketAddr = target.parse().expect("address");
            // Fresh links: until neighbour discovery settles a connect may
            // be told "no route to host".
            let deadline = Instant::now() + std::time::Duration::from_secs(10);
            let mut conn = loop {
                match std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5)) {
                    Ok(conn) => break conn,
                    Err(e) if Instant::now() > deadline => panic!("connect {target}: {e}"),
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
                }
            };
            conn.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
            let mut seen = String::new();
            std::io::Read::read_to_string(&mut conn, &mut seen).expect("read");
            seen
        })
        .join()
        .expect("client")
    };
    assert_eq!(ask(&client, format!("[fd00:250::11]:{port}")), "fd00:250::2", "over IPv6, the source is kept");
    assert_eq!(ask(&client, format!("10.250.0.11:{port}")), "10.250.0.2", "over IPv4");
    assert_eq!(ask(&pod_ns, format!("[fd00:250::11]:{port}")), "fd00:10:244:1::1", "hairpin: through the node");
    server.join().expect("server");
    let weft = node.weft();
    assert!(weft.contains("dnat ip6 to [fd00:10:244:1::5]:8080"), "{weft}");
}

#[test]
fn names_over_the_comment_limit_are_written_and_converge() {
    if !require_root() {
        return;
    }
    let ns = Ns::new("long");
    ns.run(async move || {
        let hp = HostPorts::new(
            "20000-20099".parse().unwrap(),
            PodBlocks { pool: "10.244.1.0/24".parse().unwrap(), ipv6: None },
            vec![],
        );
        // The longest names Kubernetes allows: 63 + 253 characters.
        let long = PodIdentity { namespace: "n".repeat(63), name: "p".repeat(253), uid: String::new() };
        let a = hp.reserve(&key(1), &long, &["10.244.1.5".parse().unwrap()], &[auto(Protocol::Tcp, 80)]).unwrap();
        hp.program(a.as_ref()).await.unwrap();
        hp.check(&key(1)).await.unwrap();
        assert!(!hp.sync().await.unwrap(), "a sync after the ADD rewrote the rules: the comment does not converge");
    });
    assert_eq!(ns.weft().matches(" nnn").count(), 2, "{}", ns.weft());
}

#[test]
fn the_iptables_chains_of_an_earlier_agent_are_removed_and_only_they() {
    if !require_root() {
        return;
    }
    let ns = Ns::new("upgrade");
    let old = rules::tests::alloc("web", "10.244.1.5", &[(Protocol::Tcp, 80, 20000)]);
    let text =
        rules_iptables_old::full_sync_text(&Default::default(), &[old], "10.244.1.0/24".parse().unwrap()).unwrap();
    let masq = "*nat\n:WEFT-POSTROUTING - [0:0]\n-A POSTROUTING -j WEFT-POSTROUTING\n-A WEFT-POSTROUTING -s 10.244.1.0/24 -j MASQUERADE\n\
                :KEEP - [0:0]\n-A POSTROUTING -j KEEP\n-A KEEP -j RETURN\nCOMMIT\n";
    let removed = ns.run(async move || {
        crate::dataplane::iptables::restore(&text).unwrap();
        crate::dataplane::iptables::restore(masq).unwrap();
        let first = crate::firewall::legacy::remove_nat().unwrap();
        let again = crate::firewall::legacy::remove_nat().unwrap();
        (first, again)
    });
    assert_eq!(removed, (true, false), "removed once, then nothing left");
    let nat = ns.nat();
    assert!(!nat.contains("WEFT-"), "{nat}");
    assert!(nat.contains("-A POSTROUTING -j KEEP") && nat.contains("-A KEEP -j RETURN"), "{nat}");
}

/// Benchmark: `cargo test -p weft-agent --release thousand_host_port -- --ignored --nocapture`.
/// The nftables engine and the iptables one it replaced, same run, same machine.
#[test]
#[ignore = "benchmark; run explicitly"]
fn thousand_host_port_allocations() {
    if !require_root() {
        return;
    }
    let new = Ns::new("bench-nft").run(async move || {
        let hp = HostPorts::new(
            "20000-29999".parse().unwrap(),
            PodBlocks { pool: "10.244.0.0/16".parse().unwrap(), ipv6: None },
            vec![],
        );
        hp.sync().await.unwrap();
        let mut each = Vec::new();
        for i in 0..1000 {
            let ip = std::net::Ipv4Addr::from(0x0af4_0000u32 + i as u32 + 2).into();
            let a = hp.reserve(&key(i), &pod(i), &[ip], &[auto(Protocol::Tcp, 80)]).unwrap();
            let started = Instant::now();
            hp.program(a.as_ref()).await.unwrap();
            each.push(started.elapsed());
        }
        let mut releases = Vec::new();
        for i in 0..1000 {
            let started = Instant::now();
            hp.release(&key(i)).await.unwrap();
            releases.push(started.elapsed());
        }
        // Restart on an empty table: one full sync programs everything.
        let hp = HostPorts::new(
            "20000-29999".parse().unwrap(),
            PodBlocks { pool: "10.244.0.0/16".parse().unwrap(), ipv6: None },
            vec![],
        );
        for i in 0..1000 {
            let ip = std::net::Ipv4Addr::from(0x0af4_0000u32 + i as u32 + 2).into();
            hp.reserve(&key(i), &pod(i), &[ip], &[auto(Protocol::Tcp, 80)]).unwrap();
        }
        let started = Instant::now();
        assert!(hp.sync().await.unwrap());
        (each, releases, started.elapsed())
    });
    let old = Ns::new("bench-ipt").run(async move || old_engine(1000));
    println!("\nHost ports on one node: 1,000 allocations of one TCP port each, firewall work per operation\n");
    println!("| operation | iptables (before) | nftables (now) | before / now |");
    println!("|---|---:|---:|---:|");
    let row = |what: &str, o: std::time::Duration, n: std::time::Duration| {
        let (o, n) = (o.as_secs_f64() * 1e3, n.as_secs_f64() * 1e3);
        println!("| {what} | {o:.2} ms | {n:.2} ms | {:.1} |", o / n);
    };
    let (p50, p95) = (|v: &[std::time::Duration]| pct(v, 50), |v: &[std::time::Duration]| pct(v, 95));
    row("allocate, median", p50(&old.0), p50(&new.0));
    row("allocate, p95", p95(&old.0), p95(&new.0));
    row("release, median", p50(&old.1), p50(&new.1));
    row("release, p95", p95(&old.1), p95(&new.1));
    row("full sync of 1,000 (restart, empty table)", old.2, new.2);
}

fn pct(v: &[std::time::Duration], p: usize) -> std::time::Duration {
    let mut v = v.to_vec();
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

/// The iptables engine before nftables: per allocation an incremental
/// `iptables-restore` of its rules, per release the matching deletes, a
/// full sync rewriting the chain. Returns (allocate, release, full sync).
fn old_engine(n: usize) -> (Vec<std::time::Duration>, Vec<std::time::Duration>, std::time::Duration) {
    use crate::dataplane::iptables::{restore, save};
    let cidr = "10.244.0.0/16".parse().unwrap();
    let allocs: Vec<_> = (0..n)
        .map(|i| {
            let ip = std::net::Ipv4Addr::from(0x0af4_0000u32 + i as u32 + 2).to_string();
            rules::tests::alloc(&format!("p{i}"), &ip, &[(Protocol::Tcp, 80, 20000 + i as u16)])
        })
        .collect();
    let base = rules_iptables_old::full_sync_text(&Default::default(), &[], cidr).unwrap();
    restore(&base).unwrap();
    let timed = |text: String| {
        let started = Instant::now();
        restore(&text).unwrap();
        started.elapsed()
    };
    let adds = allocs.iter().map(|a| timed(rules_iptables_old::append_text(a, cidr))).collect();
    let dels = allocs.iter().map(|a| timed(rules_iptables_old::delete_text(a, cidr))).collect();
    restore("*nat\n:WEFT-HOSTPORTS - [0:0]\nCOMMIT\n").unwrap();
    let started = Instant::now();
    let saved = rules_iptables_old::parse_save(&save("nat").unwrap());
    restore(&rules_iptables_old::full_sync_text(&saved, &allocs, cidr).unwrap()).unwrap();
    (adds, dels, started.elapsed())
}
