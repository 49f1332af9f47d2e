//! The policy renderer against the real iptables and ipset, in a network
//! namespace each test creates (never the root namespace's rules): what we
//! write is exactly what iptables-save shows back (so a converged table
//! means no write), others' rules survive, tampering is repaired.
//! Needs root: skips loudly without it, fails under CI=true.

use std::fs::File;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sched::{CloneFlags, setns};

use super::model::{Chain, Match, Peers, PodPolicy, Proto, Rule, Verdict};
use super::render::{self, FORWARD_CHAIN};
use super::sync::apply;
use crate::dataplane::iptables;
use crate::test_support::require_root;

struct Ns(String);

impl Ns {
    fn new() -> Ns {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!("wpol-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let ok = Command::new("ip").args(["netns", "add", &name]).status().expect("ip").success();
        assert!(ok, "ip netns add {name}");
        Ns(name)
    }

    /// Runs `f` on a thread inside the namespace (its child processes too).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let file = File::open(&path).expect("open netns");
            setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
            f()
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

fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().expect("spawn");
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn pods(extra_port: u16) -> Vec<PodPolicy> {
    let set = Peers::Nets(vec!["10.0.1.0/30".parse().unwrap(), "10.0.2.2/32".parse().unwrap()]);
    let ingress = Chain {
        rules: vec![
            Rule {
                matches: vec![Match {
                    peers: Peers::Nets(vec!["10.0.1.1/32".parse().unwrap()]),
                    proto: None,
                    ports: None,
                }],
                verdict: Verdict::Drop,
                origin: "weft.dev/prod/deny".into(),
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
            },
        ],
        default_deny: true,
    };
    let egress = Chain {
        rules: vec![Rule {
            matches: vec![Match { peers: set, proto: Some(Proto::Udp), ports: Some((53, 53)) }],
            verdict: Verdict::Allow,
            origin: "prod/dns".into(),
        }],
        default_deny: true,
    };
    vec![
        PodPolicy {
            key: "prod/db".into(),
            ip: "10.0.1.2".parse().unwrap(),
            ingress: Some(ingress),
            egress: Some(egress),
        },
        PodPolicy {
            key: "prod/x".into(),
            ip: "10.0.1.9".parse().unwrap(),
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
        // Someone else's chain and rules, before us.
        let foreign =
            "*filter\n:OTHER-FWD - [0:0]\n-A FORWARD -j OTHER-FWD\n-A OTHER-FWD -s 192.0.2.0/24 -j ACCEPT\nCOMMIT\n";
        iptables::restore(foreign).expect("foreign rules");
        sh("ipset", &["create", "other-set", "hash:ip"]);

        let want = render::render(&pods(8080));
        assert!(apply(&want, None).expect("first apply"), "first apply writes");
        assert!(!apply(&want, None).expect("second apply"), "converged: iptables-save shows exactly what we wrote");
        let save = iptables::save("filter").expect("save");
        assert!(
            save.contains(
                "-A FORWARD -m comment --comment \"weft: network policy\" -j WEFT-FORWARD\n-A FORWARD -j OTHER-FWD"
            ),
            "our jump first, theirs kept:\n{save}"
        );
        assert!(save.contains("-A OTHER-FWD -s 192.0.2.0/24 -j ACCEPT"));
        assert!(save.contains("-p sctp -m sctp --dport 9"), "SCTP rules compile: {save}");

        // Tampering: a rule of ours deleted, a set member removed, our jump deleted.
        let chain = want.chains.keys().find(|c| c.starts_with("WEFT-PI-")).unwrap().clone();
        sh("iptables", &["-D", &chain, "-m", "comment", "--comment", "weft-drop default-deny", "-j", "DROP"]);
        let set = want.sets.keys().next().unwrap().clone();
        sh("ipset", &["del", &set, "10.0.2.2"]);
        sh("iptables", &["-D", "FORWARD", "-m", "comment", "--comment", "weft: network policy", "-j", FORWARD_CHAIN]);
        assert!(apply(&want, None).expect("repair"), "tampering is repaired");
        assert!(!apply(&want, None).expect("after repair"));
        assert!(sh("ipset", &["list", &set]).contains("10.0.2.2"));

        // A change: only the changed chain is replaced, the old one and its unused set go.
        let changed = render::render(&pods(8090));
        assert!(apply(&changed, None).expect("change"));
        let save = iptables::save("filter").expect("save");
        assert!(!save.contains(&format!(":{chain} ")), "old chain deleted");
        assert!(save.contains("--dport 8000:8090"));
        assert!(!apply(&changed, None).expect("converged after change"));

        // Everything gone when no pod is under policy, but the foreign rules and set stay.
        let empty = render::render(&[]);
        assert!(apply(&empty, None).expect("empty"));
        let save = iptables::save("filter").expect("save");
        assert!(!save.contains("WEFT-PI-") && !save.contains("WEFT-PE-"), "{save}");
        assert!(save.contains("-A OTHER-FWD -s 192.0.2.0/24 -j ACCEPT"));
        let sets = sh("ipset", &["list", "-n"]);
        assert_eq!(sets.trim(), "other-set", "our sets destroyed, theirs kept");
        let cur = render::parse_save(&iptables::save("filter").expect("save"));
        iptables::restore(&render::removal_text(&cur).expect("removal")).expect("remove");
        assert!(!iptables::save("filter").expect("save").contains("WEFT"));
    });
}
