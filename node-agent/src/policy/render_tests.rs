//! Rendering of the policy part, pure.

use std::net::IpAddr;

use super::*;
use crate::firewall::ruleset::{Observed, Op, diff};
use crate::policy::model::{Proto, Rule};

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn rule(verdict: Verdict, origin: &str, matches: Vec<Match>) -> Rule {
    Rule { matches, verdict, origin: origin.into(), index: 0, silent: false }
}

/// A pod with the addresses `ips` (comma-separated).
fn pod(key: &str, ips: &str, ingress: Option<Chain>, egress: Option<Chain>) -> PodPolicy {
    PodPolicy {
        key: key.into(),
        ips: ips.split(',').map(|ip| ip.parse::<IpAddr>().unwrap()).collect(),
        ingress,
        egress,
    }
}

fn db_chain() -> Chain {
    Chain {
        rules: vec![
            rule(
                Verdict::Drop,
                "weft.dev/prod/deny",
                vec![Match { peers: Peers::Nets(vec![net("10.0.1.1/32")].into()), proto: None, ports: None }],
            ),
            rule(
                Verdict::Allow,
                "prod/allow",
                vec![
                    Match {
                        peers: Peers::Nets(vec![net("10.0.1.0/30"), net("10.0.2.2/32")].into()),
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

/// The named counter a rendered rule counts into.
fn counter_of(rule: &str) -> &str {
    rule.split(r#"{"counter":""#).nth(1).and_then(|r| r.split('"').next()).expect("counter")
}

fn json(r: &crate::firewall::ruleset::Rule) -> String {
    serde_json::to_string(&r.stmts).unwrap()
}

fn pod_chains<'a>(d: &'a Desired, tag: &str) -> Vec<&'a crate::firewall::ruleset::Chain> {
    d.part.chains.iter().filter(|(n, _)| n.starts_with(&format!("policy-{tag}-"))).map(|(_, c)| c).collect()
}

#[test]
fn pod_chain_has_invalid_drop_weft_rules_standard_rules_and_default_deny() {
    let d = render(&[pod("prod/db", "10.0.1.5", Some(db_chain()), None)], None);
    let chains = pod_chains(&d, "in");
    assert_eq!(chains.len(), 1);
    let rules: Vec<String> = chains[0].rules.iter().map(json).collect();
    assert_eq!(
        rules.len(),
        8,
        "invalid, the Weft deny (TCP, rest), three allows, default deny (TCP, rest): {rules:#?}"
    );
    // Invalid packets are dropped, never answered.
    assert!(rules[0].contains(r#""invalid""#) && rules[0].ends_with(r#"{"drop":null}]"#), "{}", rules[0]);
    // A deny of any protocol: a reset for TCP, ICMP for the rest, one counter.
    let (tcp, rest) = (&rules[1], &rules[2]);
    assert!(tcp.contains(r#""right":"10.0.1.1""#) && tcp.contains(r#""key":"l4proto"}},"right":"tcp""#), "{tcp}");
    assert!(tcp.ends_with(r#"{"reject":{"type":"tcp reset"}}]"#), "{tcp}");
    assert!(rest.contains(r#""right":"10.0.1.1""#) && !rest.contains("l4proto"), "{rest}");
    assert!(rest.ends_with(r#"{"reject":{"type":"icmpx","expr":"admin-prohibited"}}]"#), "{rest}");
    assert_eq!(counter_of(tcp), counter_of(rest));
    let rules: Vec<String> = [&rules[..2], &rules[3..]].concat();
    assert!(rules[6].ends_with(r#"{"reject":{"type":"icmpx","expr":"admin-prohibited"}}]"#), "{}", rules[6]);
    assert!(!rules[6].contains("match"), "{}", rules[6]);
    // Two peers: an address set, matched as the source of ingress.
    let set = set_name(&[net("10.0.1.0/30"), net("10.0.2.2/32")]);
    assert!(rules[2].contains(&format!(r#""field":"saddr"}}}},"right":"@{set}""#)), "{}", rules[2]);
    assert!(rules[2].contains(r#""field":"dport"}},"right":5432"#) && rules[2].ends_with(r#"{"return":null}]"#));
    assert!(rules[3].contains(r#"{"range":[8000,8080]}"#), "{}", rules[3]);
    assert!(rules[4].contains(r#""protocol":"sctp","field":"dport"}},"right":9"#), "{}", rules[4]);
    assert!(rules[5].ends_with(r#"{"reject":{"type":"tcp reset"}}]"#), "{}", rules[5]);
    assert_eq!(d.part.sets[&set].elements.len(), 2);
    assert_eq!(
        d.part.sets[INGRESS_MAP].elements[&Key::addr("10.0.1.5".parse().unwrap())].as_deref(),
        Some(d.part.chains.iter().find(|(_, c)| std::ptr::eq(*c, chains[0])).unwrap().0.as_str())
    );
    assert!(d.part.sets[EGRESS_MAP].elements.is_empty());
}

#[test]
fn with_the_drop_log_each_drop_is_preceded_by_a_limited_copy_to_the_group_and_nothing_else_changes() {
    let pods = [pod("prod/db", "10.0.1.5", Some(db_chain()), None)];
    let plain: Vec<String> =
        pod_chains(&render_denying(&pods, None, DenyAction::Drop), "in")[0].rules.iter().map(json).collect();
    assert!(plain.iter().all(|r| !r.contains(r#""log""#)), "off by default: {plain:#?}");

    let d = render_denying(&pods, Some(DropLog { group: 7, per_second: 5 }), DenyAction::Drop);
    let logged: Vec<String> = pod_chains(&d, "in")[0].rules.iter().map(json).collect();
    // invalid, the Weft deny and the default deny each get a log rule first.
    assert_eq!(logged.len(), plain.len() + 3, "{logged:#?}");
    let mut plain_rules = plain.iter();
    let mut i = 0;
    while i < logged.len() {
        let rule = &logged[i];
        if rule.contains(r#""log""#) {
            let drop = &logged[i + 1];
            let counter = counter_of(drop);
            assert!(counter.starts_with("policy-count-in-dropped-"), "{drop}");
            assert!(rule.contains(&format!(r#""prefix":"{counter}""#)) && rule.contains(r#""group":7"#), "{rule}");
            assert!(rule.contains(r#""limit":{"rate":5,"rate_unit":"packets","per":"second","burst":5}"#), "{rule}");
            assert!(!rule.contains("drop") || rule.contains("dropped"), "the log rule itself drops nothing: {rule}");
            // Same match as the drop it precedes.
            assert_eq!(rule.split(r#"{"limit""#).next(), drop.split(r#"{"counter""#).next(), "{rule}\n{drop}");
            i += 1;
            continue;
        }
        assert_eq!(Some(rule), plain_rules.next(), "every other rule is as without the log");
        i += 1;
    }
    assert_eq!(d.counters, render(&pods, None).counters, "the same counters");
}

/// A policy change is a netlink batch, not an `nft` run, with or without
/// the drop log and whichever the deny action: every rule of a pod chain
/// is one `nfnl_rule` encodes.
#[test]
fn every_pod_chain_rule_goes_over_netlink_with_or_without_the_drop_log() {
    use crate::firewall::nfnl_rule;
    use crate::firewall::ruleset::TableFamily;
    let pods = [pod("prod/db", "10.0.1.5,fd00::5", Some(db_chain()), Some(db_chain()))];
    for log in [None, Some(DropLog { group: 7, per_second: 5 })] {
        for deny in [DenyAction::Drop, DenyAction::Reject] {
            let d = render_denying(&pods, log, deny);
            for dir in ["in", "eg"] {
                for rule in &pod_chains(&d, dir)[0].rules {
                    assert!(nfnl_rule::encode(rule, TableFamily::Inet).is_some(), "{log:?} {deny:?}: {}", json(rule));
                }
            }
        }
    }
}

#[test]
fn with_the_drop_action_each_deny_is_one_silent_drop() {
    let pods = [pod("prod/db", "10.0.1.5", Some(db_chain()), None)];
    let d = render_denying(&pods, None, DenyAction::Drop);
    let rules: Vec<String> = pod_chains(&d, "in")[0].rules.iter().map(json).collect();
    assert_eq!(rules.len(), 6, "invalid, the Weft deny, three allows, default deny: {rules:#?}");
    for i in [0, 1, 5] {
        assert!(rules[i].ends_with(r#"{"drop":null}]"#) && !rules[i].contains("reject"), "{}", rules[i]);
    }
    assert_eq!(d.counters, render(&pods, None).counters, "the same counters either way");
}

#[test]
fn a_deny_of_one_protocol_is_answered_as_that_protocol_is() {
    let deny = |proto| Chain {
        rules: vec![rule(Verdict::Drop, "weft.dev/prod/deny", vec![Match { peers: Peers::Any, proto, ports: None }])],
        default_deny: false,
    };
    let ending = |proto| {
        let d = render(&[pod("prod/db", "10.0.1.5", Some(deny(proto)), None)], None);
        let rules: Vec<String> = pod_chains(&d, "in")[0].rules.iter().map(json).collect();
        assert_eq!(rules.len(), 2, "invalid, the deny: {rules:#?}");
        rules[1].rsplit(r#"{"counter""#).next().unwrap().to_owned()
    };
    assert!(ending(Some(Proto::Tcp)).contains(r#"{"reject":{"type":"tcp reset"}}"#));
    for proto in [Proto::Udp, Proto::Sctp] {
        assert!(ending(Some(proto)).contains(r#""expr":"admin-prohibited""#), "{proto:?}");
    }
}

#[test]
fn deny_actions_parse_from_their_flag_values() {
    assert_eq!("reject".parse::<DenyAction>(), Ok(DenyAction::Reject));
    assert_eq!("drop".parse::<DenyAction>(), Ok(DenyAction::Drop));
    assert!("DROP".parse::<DenyAction>().unwrap_err().contains("expected reject or drop"));
}

#[test]
fn every_rule_counts_into_its_policy_s_counter() {
    let d = render(&[pod("prod/db", "10.0.1.5", Some(db_chain()), None)], None);
    let mut labels: Vec<(String, &str)> = d.counters.values().map(|l| (l.policy.clone(), l.verdict_str())).collect();
    labels.sort();
    assert_eq!(
        labels,
        [
            ("default-deny".to_owned(), "dropped"),
            ("invalid".to_owned(), "dropped"),
            ("prod/allow".to_owned(), "allowed"),
            ("weft.dev/prod/deny".to_owned(), "dropped"),
        ]
    );
    assert!(d.counters.values().all(|l| l.direction == Direction::Ingress));
    assert_eq!(d.part.counters, d.counters.keys().cloned().collect());
    for c in pod_chains(&d, "in")[0].rules.iter() {
        assert!(d.counters.keys().any(|name| json(c).contains(&format!(r#"{{"counter":"{name}"}}"#))), "{}", json(c));
    }
}

#[test]
fn egress_matches_destinations_and_is_dispatched_by_source() {
    let eg = Chain {
        rules: vec![rule(
            Verdict::Allow,
            "prod/e",
            vec![Match {
                peers: Peers::Nets(vec![net("10.0.0.0/30"), net("10.0.9.9/32")].into()),
                proto: Some(Proto::Udp),
                ports: Some((53, 53)),
            }],
        )],
        default_deny: true,
    };
    let d = render(&[pod("prod/a", "10.0.1.5", Some(db_chain()), Some(eg))], None);
    let fwd: Vec<String> = d.part.chains["policy-forward"].rules.iter().map(json).collect();
    assert!(fwd[0].contains("established") && fwd[0].ends_with(r#"{"accept":null}]"#), "{}", fwd[0]);
    assert!(fwd[1].contains(r#""protocol":"ip","field":"saddr"}},"data":"@policy-egress""#), "{}", fwd[1]);
    assert!(fwd[2].contains(r#""protocol":"ip6","field":"saddr"}},"data":"@policy-egress6""#), "{}", fwd[2]);
    assert!(fwd[3].contains(r#""protocol":"ip","field":"daddr"}},"data":"@policy-ingress""#), "{}", fwd[3]);
    assert!(fwd[4].contains(r#""protocol":"ip6","field":"daddr"}},"data":"@policy-ingress6""#), "{}", fwd[4]);
    let pe = pod_chains(&d, "eg");
    assert!(json(&pe[0].rules[1]).contains(r#""field":"daddr"}},"right":"@policy-set-"#), "{}", json(&pe[0].rules[1]));
    let ip = Key::addr("10.0.1.5".parse().unwrap());
    assert!(d.part.sets[EGRESS_MAP].elements[&ip].as_deref().unwrap().starts_with("policy-eg-"));
}

#[test]
fn pods_with_the_same_policy_share_a_chain_and_names_are_stable() {
    let two = || {
        render(
            &[pod("prod/a", "10.0.1.2", Some(db_chain()), None), pod("prod/b", "10.0.1.3", Some(db_chain()), None)],
            None,
        )
    };
    let a = two();
    assert_eq!(pod_chains(&a, "in").len(), 1, "one shared pod chain");
    assert_eq!(a.part.sets[INGRESS_MAP].elements.len(), 2);
    assert_eq!(a, two());
    assert!(diff(&Observed::default(), &a.part).iter().any(|o| matches!(o, Op::AddChain(..))));
    assert!(diff(&a.part.as_observed(), &two().part).is_empty(), "converged");
}

#[test]
fn a_new_pod_with_a_known_policy_is_one_map_element() {
    let one = render(&[pod("prod/a", "10.0.1.2", Some(db_chain()), None)], None);
    let two = render(
        &[pod("prod/a", "10.0.1.2", Some(db_chain()), None), pod("prod/b", "10.0.1.3", Some(db_chain()), None)],
        None,
    );
    let ops = diff(&one.part.as_observed(), &two.part);
    assert_eq!(ops.len(), 1, "{ops:?}");
    assert!(matches!(&ops[0], Op::AddElements(m, e) if m == INGRESS_MAP && e.len() == 1));
}

#[test]
fn a_changed_peer_set_replaces_the_set_and_the_chains_naming_it_only() {
    let before = render(&[pod("prod/db", "10.0.1.5", Some(db_chain()), None)], None);
    let mut changed = db_chain();
    changed.rules[1].matches[0].peers = Peers::Nets(vec![net("10.0.1.0/30"), net("10.0.2.3/32")].into());
    let after = render(&[pod("prod/db", "10.0.1.5", Some(changed), None)], None);
    let ops = diff(&before.part.as_observed(), &after.part);
    let adds = ops.iter().filter(|o| matches!(o, Op::AddSet(..))).count();
    let dels = ops.iter().filter(|o| matches!(o, Op::DeleteSet(..))).count();
    assert_eq!((adds, dels), (1, 1), "{ops:?}");
    assert!(
        !ops.iter().any(|o| matches!(o, Op::FlushChain(c) if c == "policy-forward")),
        "the base chain stays: {ops:?}"
    );
    assert!(ops.iter().any(|o| matches!(o, Op::DeleteElements(m, _, _) | Op::AddElements(m, _) if m == INGRESS_MAP)));
}

#[test]
fn no_policy_leaves_the_base_chain_and_empty_maps() {
    let d = render(&[], None);
    assert_eq!(d.part.chains.len(), 2, "{:?}", d.part.chains.keys());
    assert_eq!(d.part.sets.len(), 4, "a map per direction and family");
    assert!(d.part.sets.values().all(|m| m.elements.is_empty()));
    assert_eq!(d.part.chains["policy-forward"].rules.len(), 5, "replies, then a lookup per direction and family");
    // What a pod sends its own node: its egress maps, after replies and
    // neighbour discovery.
    let input = &d.part.chains["policy-input"];
    assert_eq!(input.hook.map(|h| h.point), Some(crate::firewall::ruleset::HookPoint::Input));
    assert_eq!(input.rules.len(), 4);
}

#[test]
fn peers_of_both_families_become_a_rule_per_family_and_pods_enter_the_maps_of_their_families() {
    let chain = Chain {
        rules: vec![rule(
            Verdict::Allow,
            "prod/allow",
            vec![Match {
                peers: Peers::Nets(vec![net("10.0.1.0/30"), net("10.0.2.2/32"), net("fd00::1/128")].into()),
                proto: Some(Proto::Tcp),
                ports: Some((80, 80)),
            }],
        )],
        default_deny: true,
    };
    let d = render(&[pod("prod/a", "10.0.1.5,fd00::5", Some(chain), None)], None);
    let rules: Vec<String> = pod_chains(&d, "in")[0].rules.iter().map(json).collect();
    assert_eq!(rules.len(), 5, "invalid, IPv4 allow, IPv6 allow, default deny (TCP, rest): {rules:#?}");
    let set = set_name(&[net("10.0.1.0/30"), net("10.0.2.2/32")]);
    assert!(rules[1].contains(&format!(r#""protocol":"ip","field":"saddr"}}}},"right":"@{set}""#)), "{}", rules[1]);
    assert!(rules[2].contains(r#""protocol":"ip6","field":"saddr"}},"right":"fd00::1""#), "{}", rules[2]);
    assert!(rules[1].ends_with(r#"{"return":null}]"#) && rules[2].ends_with(r#"{"return":null}]"#));
    assert_eq!(d.part.sets[&set].kind, SetKind::Nets(Family::V4));
    let v4 = &d.part.sets[INGRESS_MAP];
    let v6 = &d.part.sets[INGRESS_MAP6];
    assert_eq!((v4.kind, v6.kind), (SetKind::AddrJumps(Family::V4), SetKind::AddrJumps(Family::V6)));
    assert_eq!(v4.elements.keys().collect::<Vec<_>>(), [&Key::addr("10.0.1.5".parse().unwrap())]);
    assert_eq!(v6.elements.keys().collect::<Vec<_>>(), [&Key::addr("fd00::5".parse().unwrap())]);
    assert_eq!(v4.elements.values().next(), v6.elements.values().next(), "one chain for both addresses");
    assert!(d.part.sets[EGRESS_MAP6].elements.is_empty());
}

#[test]
fn a_set_of_ipv6_peers_is_an_ipv6_set() {
    let peers = vec![net("fd00::1/128"), net("fd00:1::/64")];
    let chain = Chain {
        rules: vec![rule(
            Verdict::Drop,
            "weft.dev/prod/deny",
            vec![Match { peers: Peers::Nets(peers.clone().into()), proto: None, ports: None }],
        )],
        default_deny: false,
    };
    let d = render(&[pod("prod/a", "fd00::5", None, Some(chain))], None);
    let set = &d.part.sets[&set_name(&peers)];
    assert_eq!(set.kind, SetKind::Nets(Family::V6));
    assert_eq!(set.elements.len(), 2);
    let rules: Vec<String> = pod_chains(&d, "eg")[0].rules.iter().map(json).collect();
    assert!(rules[1].contains(r#""protocol":"ip6","field":"daddr"}},"right":"@policy-set-"#), "{}", rules[1]);
    assert!(d.part.sets[EGRESS_MAP].elements.is_empty() && d.part.sets[EGRESS_MAP6].elements.len() == 1);
}

#[test]
fn a_cluster_policy_deny_drops_without_an_answer_whatever_the_deny_action() {
    let mut chain = db_chain();
    chain.rules[0].origin = "ClusterNetworkPolicy/no-dev".into();
    chain.rules[0].silent = true;
    let d = render(&[pod("prod/db", "10.0.1.5", Some(chain), None)], None);
    let rules: Vec<String> = pod_chains(&d, "in")[0].rules.iter().map(json).collect();
    // One rule for every protocol (no reset or ICMP to tell TCP apart for).
    assert!(rules[1].contains(r#""right":"10.0.1.1""#) && rules[1].ends_with(r#"{"drop":null}]"#), "{}", rules[1]);
    assert!(!rules[2].contains(r#""right":"10.0.1.1""#), "{}", rules[2]);
    // The namespaces' own deny (the default one here) still answers.
    assert!(rules.last().unwrap().contains("reject"), "{rules:#?}");
}
