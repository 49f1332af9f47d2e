//! The policy part against the real nftables, in a network namespace each
//! test creates (never the root namespace's rules): what we write reads
//! back as written (so a converged table means no write), others' iptables
//! rules, nftables tables and ipsets survive, tampering is repaired, the
//! iptables-era engine's chains and sets are removed on upgrade; and
//! (ignored, a benchmark) the new engine beside the old one.
//! Needs root: skips loudly without it, fails under CI=true.

use std::process::Command;

use std::time::{Duration, Instant};

use super::drop_log;
use super::model::{Chain, Match, Peers, PodPolicy, Proto, Rule, Verdict};
use super::render::{self, EGRESS_MAP};
use super::render_iptables_old;
use super::sync::apply;
use crate::dataplane::iptables;
use crate::firewall::Engine;
use crate::firewall::nflog::{Group, Received};
use crate::firewall::nft::Nft;
use crate::test_support::{TestNetns as Ns, require_root};

fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().expect("spawn");
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn pods(extra_port: u16) -> Vec<PodPolicy> {
    let set = Peers::Nets(vec!["10.0.1.0/30".parse().unwrap(), "10.0.2.2/32".parse().unwrap()].into());
    let ingress = Chain {
        rules: vec![
            Rule {
                matches: vec![Match {
                    peers: Peers::Nets(vec!["10.0.1.1/32".parse().unwrap()].into()),
                    proto: None,
                    ports: None,
                }],
                verdict: Verdict::Drop,
                origin: "weft.dev/prod/deny".into(),
                index: 0,
                silent: false,
            },
            Rule {
                matches: vec![
                    Match { peers: set.clone(), proto: Some(Proto::Tcp), ports: Some((5432, 5432)) },
                    Match { peers: Peers::Any, proto: Some(Proto::Udp), ports: Some((8000, extra_port)) },
                    Match { peers: Peers::Any, proto: Some(Proto::Sctp), ports: Some((9, 9)) },
                    Match { peers: set.clone(), proto: Some(Proto::Sctp), ports: None },
                ],
                verdict: Verdict::Allow,
                origin: "prod/allow".into(),
                index: 0,
                silent: false,
            },
        ],
        default_deny: true,
    };
    let egress = Chain {
        rules: vec![Rule {
            matches: vec![Match { peers: set, proto: Some(Proto::Udp), ports: Some((53, 53)) }],
            verdict: Verdict::Allow,
            origin: "prod/dns".into(),
            index: 0,
            silent: false,
        }],
        default_deny: true,
    };
    vec![
        PodPolicy {
            key: "prod/db".into(),
            ips: vec!["10.0.1.2".parse().unwrap()],
            ingress: Some(ingress),
            egress: Some(egress),
        },
        PodPolicy {
            key: "prod/x".into(),
            ips: vec!["10.0.1.9".parse().unwrap()],
            ingress: None,
            egress: Some(Chain { rules: vec![], default_deny: true }),
        },
    ]
}

#[test]
fn rules_round_trip_converge_and_leave_others_alone() {
    if !require_root() {
        return;
    }
    let ns = Ns::new();
    ns.run(|| {
        // Someone else's rules, before us: iptables (nft backend and legacy),
        // ipset and an nftables table.
        let foreign =
            "*filter\n:OTHER-FWD - [0:0]\n-A FORWARD -j OTHER-FWD\n-A OTHER-FWD -s 192.0.2.0/24 -j ACCEPT\nCOMMIT\n";
        iptables::restore(foreign).expect("foreign rules");
        sh("iptables-legacy", &["-N", "LEGACY-FWD"]);
        sh("iptables-legacy", &["-A", "FORWARD", "-s", "198.51.100.0/24", "-j", "LEGACY-FWD"]);
        sh("ipset", &["create", "other-set", "hash:ip"]);
        sh("nft", &["add table ip other; add chain ip other forward-other { type filter hook forward priority 0; }; add rule ip other forward-other ip saddr 192.0.2.1 counter"]);
        let engine = Engine::new(Nft::default());
        let full = |d: &render::Desired| apply(&engine, d, true, None).expect("apply");

        let want = render::render(&pods(8080), None);
        assert!(full(&want), "first apply writes");
        assert!(!full(&want), "converged: nft shows back what we wrote");
        let table = sh("nft", &["list", "table", "inet", "weft"]);
        assert!(table.contains("sctp dport 9"), "SCTP rules compile: {table}");
        assert!(table.contains("ip saddr vmap @policy-egress") && table.contains("ip daddr vmap @policy-ingress"));

        // Tampering: a chain flushed, a set member removed, a map element deleted.
        let chain = want.part.chains.keys().find(|c| c.starts_with("policy-in-")).unwrap().clone();
        sh("nft", &["flush", "chain", "inet", "weft", &chain]);
        let set = want.part.sets.keys().find(|s| s.starts_with("policy-set-")).unwrap().clone();
        sh("nft", &["delete", "element", "inet", "weft", &set, "{ 10.0.2.2 }"]);
        sh("nft", &["delete", "element", "inet", "weft", EGRESS_MAP, "{ 10.0.1.9 }"]);
        assert!(full(&want), "tampering is repaired");
        assert!(!full(&want), "after repair");
        assert!(sh("nft", &["list", "set", "inet", "weft", &set]).contains("10.0.2.2"));
        assert!(sh("nft", &["list", "map", "inet", "weft", EGRESS_MAP]).contains("10.0.1.9"));

        // A change, written without reading the kernel: only the changed
        // chain is replaced, the old one goes.
        let changed = render::render(&pods(8090), None);
        assert!(apply(&engine, &changed, false, None).expect("change"));
        let table = sh("nft", &["list", "table", "inet", "weft"]);
        assert!(!table.contains(&format!("chain {chain} ")), "old chain deleted:\n{table}");
        assert!(table.contains("udp dport 8000-8090"), "{table}");
        assert!(!full(&changed), "converged after change");

        // Nothing of ours is left but the base chain and empty maps when no
        // pod is under policy; the foreign rules, set and table stay.
        let empty = render::render(&[], None);
        assert!(full(&empty));
        let table = sh("nft", &["list", "table", "inet", "weft"]);
        assert!(!table.contains("policy-in-") && !table.contains("policy-set-"), "{table}");
        assert!(iptables::save("filter").expect("save").contains("-A OTHER-FWD -s 192.0.2.0/24 -j ACCEPT"));
        assert_eq!(sh("ipset", &["list", "-n"]).trim(), "other-set");
        assert!(sh("nft", &["list", "table", "ip", "other"]).contains("ip saddr 192.0.2.1 counter"));
        let legacy = sh("iptables-legacy-save", &["-t", "filter"]);
        assert!(legacy.contains("-A FORWARD -s 198.51.100.0/24 -j LEGACY-FWD"), "{legacy}");
        assert!(engine.remove(render::OWNER).expect("remove"));
        assert!(!sh("nft", &["list", "table", "inet", "weft"]).contains("policy-"));
    });
}

#[test]
fn ipv6_peers_and_pods_round_trip_beside_ipv4_ones() {
    if !require_root() {
        return;
    }
    let ns = Ns::new();
    ns.run(|| {
        let mut dual = pods(8080);
        let v6 = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        dual[0].ips.push(v6("fd00::2"));
        dual[1].ips = vec![v6("fd00::9")];
        let both = Peers::Nets(
            ["10.0.1.1/32", "fd00::1/128", "fd00:1::/64", "fd00:2::/64"].map(|n| n.parse().unwrap()).into(),
        );
        let rule = Rule {
            matches: vec![Match { peers: both, proto: Some(Proto::Tcp), ports: Some((80, 80)) }],
            verdict: Verdict::Allow,
            origin: "prod/web".into(),
            index: 0,
            silent: false,
        };
        dual[0].ingress.as_mut().unwrap().rules.push(rule);
        let engine = Engine::new(Nft::default());
        let want = render::render(&dual, None);
        assert!(apply(&engine, &want, true, None).expect("apply"), "first apply writes");
        assert!(
            !apply(&engine, &want, true, None).expect("again"),
            "converged: IPv6 sets and maps read back as written"
        );
        let table = sh("nft", &["list", "table", "inet", "weft"]);
        assert!(table.contains("ip6 saddr vmap @policy-egress6") && table.contains("ip6 daddr vmap @policy-ingress6"));
        assert!(
            table.contains("ip6 saddr @policy-set-") && table.contains("ip saddr 10.0.1.1 tcp dport 80"),
            "{table}"
        );
        let ingress6 = sh("nft", &["list", "map", "inet", "weft", render::INGRESS_MAP6]);
        assert!(ingress6.contains("fd00::2 : jump policy-in-"), "{ingress6}");
        let egress6 = sh("nft", &["list", "map", "inet", "weft", render::EGRESS_MAP6]);
        assert!(egress6.contains("fd00::2") && egress6.contains("fd00::9"), "{egress6}");
        assert!(
            !sh("nft", &["list", "map", "inet", "weft", EGRESS_MAP]).contains("10.0.1.9"),
            "prod/x is IPv6-only now"
        );
    });
}

#[test]
fn the_iptables_era_policy_is_removed_on_upgrade_and_only_it() {
    if !require_root() {
        return;
    }
    let ns = Ns::new();
    ns.run(|| {
        iptables::restore("*filter\n:OTHER-FWD - [0:0]\n-A FORWARD -j OTHER-FWD\nCOMMIT\n").expect("foreign");
        sh("ipset", &["create", "other-set", "hash:ip"]);
        // What an iptables-era agent left: chains, a jump from FORWARD, sets.
        assert!(render_iptables_old::apply(&render_iptables_old::render(&pods(8080))).expect("old engine"));
        assert!(sh("ipset", &["list", "-n"]).contains("weft-pol-"));
        assert!(crate::firewall::legacy::remove_policy().expect("remove"));
        assert!(!crate::firewall::legacy::remove_policy().expect("again"), "nothing left the second time");
        let save = iptables::save("filter").expect("save");
        assert!(!save.contains("WEFT"), "{save}");
        assert!(save.contains("-A FORWARD -j OTHER-FWD"), "{save}");
        assert_eq!(sh("ipset", &["list", "-n"]).trim(), "other-set");
    });
}

/// Every policy, direction and verdict has its counter in the kernel.
#[test]
fn each_policy_direction_and_verdict_has_a_kernel_counter() {
    if !require_root() {
        return;
    }
    let ns = Ns::new();
    ns.run(|| {
        let engine = Engine::new(Nft::default());
        let want = render::render(&pods(8080), None);
        apply(&engine, &want, true, None).expect("apply");
        let counts = engine.counters(render::OWNER).expect("counters");
        assert_eq!(counts.keys().collect::<Vec<_>>(), want.counters.keys().collect::<Vec<_>>());
        assert_eq!(want.counters.len(), 7, "{:?}", want.counters.values());
    });
}

/// client 10.0.1.1 -- router (the node: Weft's rules go here) -- pod
/// 10.0.1.2, each its own namespace: (router, client, pod).
fn client_router_pod() -> (Ns, Ns, Ns) {
    let (router, client, pod) = (Ns::new(), Ns::new(), Ns::new());
    let ip = |ns: &Ns, args: &[&str]| {
        sh("ip", &[&["-n", ns.name()], args].concat());
    };
    for (ns, dev, addr, gw) in [(&client, "c", "10.0.1.1", "10.9.0.1"), (&pod, "p", "10.0.1.2", "10.9.1.1")] {
        ip(ns, &["link", "add", "eth0", "type", "veth", "peer", "name", dev, "netns", router.name()]);
        ip(ns, &["addr", "add", &format!("{addr}/32"), "dev", "eth0"]);
        ip(ns, &["link", "set", "eth0", "up"]);
        ip(ns, &["route", "add", gw, "dev", "eth0"]);
        ip(ns, &["route", "add", "default", "via", gw]);
        ip(&router, &["addr", "add", &format!("{gw}/24"), "dev", dev]);
        ip(&router, &["link", "set", dev, "up"]);
        ip(&router, &["route", "add", addr, "dev", dev]);
    }
    sh("ip", &["netns", "exec", router.name(), "sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    (router, client, pod)
}

/// A denied TCP connection is refused at once and a denied UDP datagram
/// answered with ICMP (reject, the default); with the drop action the
/// client hears nothing and its connect times out.
#[test]
fn a_reject_answers_the_client_and_a_drop_leaves_it_waiting() {
    if !require_root() {
        return;
    }
    for action in [render::DenyAction::Reject, render::DenyAction::Drop] {
        let (router, client, _pod) = client_router_pod();
        let want = render::render_denying(&pods(8080), None, action);
        let _engine = router.run(move || {
            let engine = Engine::new(Nft::default());
            apply(&engine, &want, true, None).expect("apply");
            engine
        });
        // The client's TCP to the pod meets the Weft deny of 10.0.1.1.
        let (tcp, udp) = client.run(|| {
            let addr = "10.0.1.2:80".parse().unwrap();
            let tcp =
                std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map(|_| ()).map_err(|e| e.kind());
            let socket = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
            socket.connect("10.0.1.2:7").expect("connect");
            socket.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
            socket.send(b"denied").expect("send");
            let udp = socket.recv(&mut [0; 16]).map(|_| ()).map_err(|e| e.kind());
            (tcp, udp)
        });
        use std::io::ErrorKind::*;
        match action {
            render::DenyAction::Reject => {
                assert_eq!(tcp, Err(ConnectionRefused), "a reset answers the SYN");
                assert!(matches!(udp, Err(HostUnreachable | ConnectionRefused)), "ICMP answers: {udp:?}");
            }
            render::DenyAction::Drop => {
                assert_eq!(tcp, Err(TimedOut), "nothing answers the SYN");
                assert!(matches!(udp, Err(WouldBlock | TimedOut)), "nothing answers: {udp:?}");
            }
        }
    }
}

/// What a pod sends its own node crosses no forward hook: the input chain
/// puts it through the pod's egress chain. What the node sends the pod
/// (kubelet's probes) is not policed, nor are the pod's answers.
#[test]
fn a_pod_s_egress_to_its_own_node_is_policed_and_the_node_s_probes_are_not() {
    if !require_root() {
        return;
    }
    let (router, _client, pod) = client_router_pod();
    let want = render::render(&pods(8080), None);
    let _engine = router.run(move || {
        let engine = Engine::new(Nft::default());
        apply(&engine, &want, true, None).expect("apply");
        engine
    });
    let connect = |addr: &'static str| {
        move || {
            std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2))
                .map(|_| ())
                .map_err(|e| e.kind())
        }
    };
    // A server on the node (kubelet's port), at the pod's gateway address.
    let _node_server = router.run(|| std::net::TcpListener::bind("10.9.1.1:10250").expect("bind on the node"));
    assert_eq!(
        pod.run(connect("10.9.1.1:10250")),
        Err(std::io::ErrorKind::ConnectionRefused),
        "prod/db's egress admits UDP 53 to its peers only: a reset answers"
    );
    let _pod_server = pod.run(|| std::net::TcpListener::bind("10.0.1.2:8080").expect("bind in the pod"));
    assert_eq!(router.run(connect("10.0.1.2:8080")), Ok(()), "the node's probe and the pod's answer pass");
}

/// With the drop log on, a packet a policy drops on its way through the
/// node reaches the reader of the NFLOG group with its policy, direction,
/// addresses and port, and is still dropped (the drop counter counts it).
#[test]
fn a_dropped_packet_is_logged_with_its_policy_and_still_dropped() {
    if !require_root() {
        return;
    }
    let (router, client, _pod) = client_router_pod();
    let want = render::render(&pods(8080), Some(render::DropLog { group: 7, per_second: 100 }));
    let labels = want.counters.clone();
    // Bound in the router's namespace, as the agent binds in its node's.
    let mut group = router.run(|| Group::bind(7).expect("bind NFLOG group 7"));
    let engine = router.run(move || {
        let engine = Engine::new(Nft::default());
        apply(&engine, &want, true, None).expect("apply");
        engine
    });
    let sent = Instant::now();
    client.run(|| {
        let socket = std::net::UdpSocket::bind("0.0.0.0:40007").expect("bind");
        socket.send_to(b"denied", "10.0.1.2:7").expect("send");
    });

    // Sent on at once, not held for the kernel's one-second flush (its
    // default batching): a denied connection's flow record depends on it.
    let deadline = sent + Duration::from_millis(900);
    let record = loop {
        assert!(Instant::now() < deadline, "nothing logged within 900 ms");
        match group.recv(Duration::from_millis(200)).expect("read the group") {
            Received::Packets(records) => {
                if let Some(r) = records.into_iter().next() {
                    break r;
                }
            }
            Received::Lost => panic!("records lost"),
        }
    };
    let d = drop_log::describe(&record, &labels);
    assert_eq!(d.policy.as_deref(), Some("weft.dev/prod/deny"), "{record:?}");
    assert_eq!(d.direction, Some("ingress"));
    assert_eq!((d.src, d.dst), (Some("10.0.1.1".parse().unwrap()), Some("10.0.1.2".parse().unwrap())));
    assert_eq!((d.proto.as_deref(), d.sport, d.dport), (Some("udp"), Some(40007), Some(7)));

    let counts = router.run(move || engine.counters(render::OWNER).expect("counters"));
    let dropped = counts[&record.prefix];
    assert_eq!(dropped.packets, 1, "the logged packet was dropped, once: {counts:?}");
}

/// Benchmark: `cargo test -p weft-agent --release policy::kernel_tests::engines -- --ignored --nocapture`.
/// The same compiled policy for many local pods applied by the iptables
/// engine and by the nftables one, same run, same machine.
#[test]
#[ignore = "benchmark; run explicitly"]
fn engines_side_by_side() {
    if !require_root() {
        return;
    }
    const PODS: usize = 100;
    let many = |extra: u16| -> Vec<PodPolicy> {
        (0..PODS)
            .flat_map(|i| {
                pods(8080 + (i % 50) as u16 + extra).into_iter().enumerate().map(move |(j, mut p)| {
                    p.key = format!("prod/p{i}-{j}");
                    p.ips = vec![std::net::Ipv4Addr::from(0x0a01_0000u32 + (i * 2 + j) as u32 + 2).into()];
                    p
                })
            })
            .collect()
    };
    let (first, second) = (many(0), many(1));
    let timed = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };
    let old = Ns::new().run({
        let (first, second) = (first.clone(), second.clone());
        move || {
            let (a, b) = (render_iptables_old::render(&first), render_iptables_old::render(&second));
            let apply = |d| render_iptables_old::apply(d).expect("old apply");
            let fresh = timed(&mut || assert!(apply(&a)));
            let same = timed(&mut || assert!(!apply(&a)));
            let change = timed(&mut || assert!(apply(&b)));
            (fresh, same, change)
        }
    });
    let new = Ns::new().run(move || {
        let (a, b) = (render::render(&first, None), render::render(&second, None));
        let engine = Engine::new(Nft::default());
        let fresh = timed(&mut || assert!(apply(&engine, &a, true, None).expect("apply")));
        let same = timed(&mut || assert!(!apply(&engine, &a, true, None).expect("apply")));
        let change = timed(&mut || assert!(apply(&engine, &b, false, None).expect("apply")));
        (fresh, same, change)
    });
    println!("\nPolicy for {} local pods ({PODS} distinct chains per direction), kernel work\n", PODS * 2);
    println!("| operation | iptables + ipset (before) | nftables (now) | before / now |");
    println!("|---|---:|---:|---:|");
    let row = |what: &str, o: Duration, n: Duration| {
        let (o, n) = (o.as_secs_f64() * 1e3, n.as_secs_f64() * 1e3);
        println!("| {what} | {o:.1} ms | {n:.1} ms | {:.1} |", o / n);
    };
    row("first apply (empty kernel)", old.0, new.0);
    row("resync, nothing to write (reads the kernel)", old.1, new.1);
    row("a change of half the pods' ports", old.2, new.2);
}
