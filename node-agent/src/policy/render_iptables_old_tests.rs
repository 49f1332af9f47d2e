//! Rendering and diffing of the filter table and the ipsets, pure.

use std::net::Ipv4Addr;

use super::*;
use crate::policy::model::{Proto, Rule};

fn net(s: &str) -> Ipv4Net {
    s.parse().unwrap()
}

fn rule(verdict: Verdict, origin: &str, matches: Vec<Match>) -> Rule {
    Rule { matches, verdict, origin: origin.into() }
}

fn pod(key: &str, ip: &str, ingress: Option<Chain>, egress: Option<Chain>) -> PodPolicy {
    PodPolicy { key: key.into(), ip: ip.parse::<Ipv4Addr>().unwrap(), ingress, egress }
}

fn db_chain() -> Chain {
    Chain {
        rules: vec![
            rule(
                Verdict::Drop,
                "weft.dev/prod/deny",
                vec![Match { peers: Peers::Nets(vec![net("10.0.1.1/32")]), proto: None, ports: None }],
            ),
            rule(
                Verdict::Allow,
                "prod/allow",
                vec![
                    Match {
                        peers: Peers::Nets(vec![net("10.0.1.0/30"), net("10.0.2.2/32")]),
                        proto: Some(Proto::Tcp),
                        ports: Some((5432, 5432)),
                    },
                    Match { peers: Peers::Any, proto: Some(Proto::Udp), ports: Some((8000, 8080)) },
                    Match { peers: Peers::Any, proto: Some(Proto::Sctp), ports: Some((9, 9)) },
                ],
            ),
        ],
        default_deny: true,
    }
}

/// What `iptables-save -c -t filter` would print after applying `d`, with
/// someone else's rules around ours and quotes only where iptables puts them.
fn fake_save(d: &Desired) -> String {
    let mut s = String::from(
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-FORWARD - [0:0]\n",
    );
    for name in d.chains.keys() {
        s.push_str(&format!(":{name} - [0:0]\n"));
    }
    s.push_str(&format!("[5:300] {}\n", jump_rule()));
    s.push_str("[9:900] -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n");
    for rules in d.chains.values() {
        for r in rules {
            // iptables-save drops the quotes around comments without spaces.
            let printed =
                if r.contains("\"prod/allow\"") { r.replace("\"prod/allow\"", "prod/allow") } else { r.clone() };
            s.push_str(&format!("[3:180] {printed}\n"));
        }
    }
    s.push_str("[0:0] -A KUBE-FORWARD -j ACCEPT\nCOMMIT\n");
    s
}

#[test]
fn pod_chain_has_invalid_drop_weft_rules_standard_rules_and_default_deny() {
    let d = render(&[pod("prod/db", "10.0.1.2", Some(db_chain()), None)]);
    assert_eq!(d.chains.len(), 2);
    let (name, rules) = d.chains.iter().find(|(n, _)| n.starts_with("WEFT-PI-")).unwrap();
    assert_eq!(name.len(), 24, "fits iptables' 28-character limit");
    let set = d.sets.keys().next().unwrap().clone();
    assert_eq!(set.len(), 25, "fits ipset's 31-character limit");
    let want = [
        format!("-A {name} -m conntrack --ctstate INVALID -m comment --comment \"weft-drop invalid\" -j DROP"),
        format!("-A {name} -s 10.0.1.1/32 -m comment --comment \"weft-drop weft.dev/prod/deny\" -j DROP"),
        format!(
            "-A {name} -p tcp -m set --match-set {set} src -m tcp --dport 5432 -m comment --comment \"prod/allow\" -j RETURN"
        ),
        format!("-A {name} -p udp -m udp --dport 8000:8080 -m comment --comment \"prod/allow\" -j RETURN"),
        format!("-A {name} -p sctp -m sctp --dport 9 -m comment --comment \"prod/allow\" -j RETURN"),
        format!("-A {name} -m comment --comment \"weft-drop default-deny\" -j DROP"),
    ];
    assert_eq!(rules, &want.to_vec());
    assert_eq!(d.sets[&set], vec![net("10.0.1.0/30"), net("10.0.2.2/32")]);
    let fwd = &d.chains[FORWARD_CHAIN];
    assert!(fwd[0].contains("--ctstate RELATED,ESTABLISHED") && fwd[0].ends_with("-j RETURN"), "replies first");
    assert_eq!(fwd[1], format!("-A WEFT-FORWARD -d 10.0.1.2/32 -m comment --comment \"prod/db ingress\" -j {name}"));
    assert_eq!(d.rule_count(), 6 + 2 + 1);
}

#[test]
fn egress_matches_destinations_and_is_dispatched_by_source_before_ingress() {
    let eg = Chain {
        rules: vec![rule(
            Verdict::Allow,
            "prod/e",
            vec![Match {
                peers: Peers::Nets(vec![net("10.0.0.0/30"), net("10.0.9.9/32")]),
                proto: Some(Proto::Udp),
                ports: Some((53, 53)),
            }],
        )],
        default_deny: true,
    };
    let d = render(&[pod("prod/a", "10.0.1.5", Some(db_chain()), Some(eg))]);
    let fwd = &d.chains[FORWARD_CHAIN];
    assert!(fwd[1].starts_with("-A WEFT-FORWARD -s 10.0.1.5/32") && fwd[1].contains("-j WEFT-PE-"), "{fwd:?}");
    assert!(fwd[2].starts_with("-A WEFT-FORWARD -d 10.0.1.5/32") && fwd[2].contains("-j WEFT-PI-"), "{fwd:?}");
    let pe = d.chains.iter().find(|(n, _)| n.starts_with("WEFT-PE-")).unwrap().1;
    assert!(pe[1].contains("-m set --match-set weft-pol-") && pe[1].contains(" dst -m udp --dport 53"), "{pe:?}");
}

#[test]
fn pods_with_the_same_policy_share_a_chain_and_names_are_stable() {
    let a =
        render(&[pod("prod/a", "10.0.1.2", Some(db_chain()), None), pod("prod/b", "10.0.1.3", Some(db_chain()), None)]);
    assert_eq!(a.chains.len(), 2, "one shared pod chain plus WEFT-FORWARD");
    assert_eq!(a.chains[FORWARD_CHAIN].len(), 3);
    assert_eq!(
        a,
        render(&[pod("prod/a", "10.0.1.2", Some(db_chain()), None), pod("prod/b", "10.0.1.3", Some(db_chain()), None)])
    );
}

#[test]
fn fresh_table_gets_declarations_before_rules_and_one_jump_first() {
    let d = render(&[pod("prod/db", "10.0.1.2", Some(db_chain()), None)]);
    let t = restore_text(&Current::default(), &d).unwrap();
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines[0], "*filter");
    let last_decl = lines.iter().rposition(|l| l.starts_with(':')).unwrap();
    let first_rule = lines.iter().position(|l| l.starts_with("-A ")).unwrap();
    assert!(last_decl < first_rule, "{t}");
    assert!(t.contains("-I FORWARD 1 -m comment --comment \"weft: network policy\" -j WEFT-FORWARD"));
    assert!(
        !t.contains(":FORWARD") && !t.contains(" -F ") && !t.contains("\n-F"),
        "never declares or flushes others' chains: {t}"
    );
    assert_eq!(*lines.last().unwrap(), "COMMIT");
}

#[test]
fn converged_table_needs_no_write_and_foreign_rules_are_left_alone() {
    let d = render(&[pod("prod/db", "10.0.1.2", Some(db_chain()), None)]);
    let cur = parse_save(&fake_save(&d));
    assert!(cur.jump_first);
    assert!(!cur.chains.contains_key("KUBE-FORWARD"));
    assert_eq!(restore_text(&cur, &d), None);
}

#[test]
fn an_update_rewrites_only_what_changed() {
    let one = pod("prod/db", "10.0.1.2", Some(db_chain()), None);
    let before = render(std::slice::from_ref(&one));
    let cur = parse_save(&fake_save(&before));
    // A second pod with another policy: its chain and the dispatch chain are written, db's chain is not.
    let other = Chain { rules: vec![], default_deny: true };
    let after = render(&[one.clone(), pod("prod/web", "10.0.1.3", Some(other), None)]);
    let t = restore_text(&cur, &after).unwrap();
    let db_chain_name = before.chains.keys().find(|n| n.starts_with("WEFT-PI-")).unwrap();
    assert!(!t.contains(&format!(":{db_chain_name}")), "unchanged chain rewritten:\n{t}");
    assert!(t.contains(":WEFT-FORWARD - [0:0]"));
    assert!(!t.contains("FORWARD 1"), "the jump stays");
    // Removing the policy: the old chain is flushed and deleted after the dispatch chain changed.
    let t = restore_text(&cur, &render(&[])).unwrap();
    let x = t.find(&format!("-X {db_chain_name}")).unwrap();
    assert!(t.find("-A WEFT-FORWARD").unwrap() < x, "{t}");
    assert!(t.contains(&format!(":{db_chain_name} - [0:0]")));
}

#[test]
fn tampering_is_detected() {
    let d = render(&[pod("prod/db", "10.0.1.2", Some(db_chain()), None)]);
    let save = fake_save(&d);
    // A rule deleted from our chain.
    let tampered: String = save.lines().filter(|l| !l.contains("default-deny")).map(|l| format!("{l}\n")).collect();
    let t = restore_text(&parse_save(&tampered), &d).unwrap();
    assert!(t.contains("weft-drop default-deny"));
    // The jump moved below someone else's rule, or duplicated.
    let moved =
        save.replace("[5:300] -A FORWARD -m comment --comment \"weft: network policy\" -j WEFT-FORWARD\n", "").replace(
            "-A KUBE-FORWARD -j ACCEPT",
            "-A KUBE-FORWARD -j ACCEPT\n-A FORWARD -m comment --comment \"weft: network policy\" -j WEFT-FORWARD",
        );
    let cur = parse_save(&moved);
    assert!(!cur.jump_first && cur.jumps.len() == 1);
    let t = restore_text(&cur, &d).unwrap();
    assert!(t.find("-D FORWARD").unwrap() < t.find("-I FORWARD 1").unwrap());
}

#[test]
fn drop_counters_are_read_per_policy_and_direction() {
    let d = render(&[pod("prod/db", "10.0.1.2", Some(db_chain()), None)]);
    let cur = parse_save(&fake_save(&d));
    let policies: Vec<(&str, u64)> = cur.drops.iter().map(|c| (c.policy.as_str(), c.packets)).collect();
    assert_eq!(policies, [("invalid", 3), ("weft.dev/prod/deny", 3), ("default-deny", 3)]);
    assert!(cur.drops.iter().all(|c| c.direction == Direction::Ingress));
}

#[test]
fn removal_deletes_jump_and_chains() {
    let d = render(&[pod("prod/db", "10.0.1.2", Some(db_chain()), None)]);
    let t = removal_text(&parse_save(&fake_save(&d))).unwrap();
    assert!(t.contains("-D FORWARD -m comment --comment \"weft: network policy\" -j WEFT-FORWARD"));
    assert!(t.find("-D FORWARD").unwrap() < t.find("-X WEFT-FORWARD").unwrap());
    assert_eq!(removal_text(&Current::default()), None);
}

#[test]
fn ipsets_are_created_repaired_and_destroyed() {
    let d = render(&[pod("prod/db", "10.0.1.2", Some(db_chain()), None)]);
    let name = d.sets.keys().next().unwrap().clone();
    let (before, after) = ipset_texts(&BTreeMap::new(), &d);
    assert_eq!(
        before.unwrap(),
        format!("create {name} hash:net family inet maxelem 65536\nadd {name} 10.0.1.0/30\nadd {name} 10.0.2.2\n")
    );
    assert_eq!(after, None);
    let saved = format!(
        "create {name} hash:net family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1\nadd {name} 10.0.2.2\nadd {name} 10.0.1.0/30\n\
         create weft-pol-0000000000000000 hash:net family inet\ncreate other-set hash:ip family inet\nadd other-set 1.2.3.4\n"
    );
    let cur = parse_sets(&saved);
    assert_eq!(cur.len(), 2, "only our sets: {cur:?}");
    let (before, after) = ipset_texts(&cur, &d);
    assert_eq!(before, None, "converged");
    assert_eq!(after.unwrap(), "destroy weft-pol-0000000000000000\n");
    let tampered = parse_sets(&format!("create {name} hash:net family inet\nadd {name} 10.0.2.2\n"));
    assert!(ipset_texts(&tampered, &d).0.unwrap().starts_with(&format!("flush {name}\n")));
}
