use super::*;
use crate::firewall::build;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn sample() -> Part {
    let mut p = Part::new("policy");
    p.sets.insert("policy-peers".into(), Set::nets(Family::V4, [net("10.0.0.0/8"), net("10.244.1.5/32")]));
    p.counters.insert("policy-c".into());
    let base = Hook { kind: ChainKind::Filter, point: HookPoint::Forward, priority: FILTER };
    p.chains.insert(
        "policy-forward".into(),
        Chain { hook: Some(base), rules: vec![Rule::new("dispatch", vec![build::jump("policy-pod")])] },
    );
    p.chains.insert(
        "policy-pod".into(),
        Chain {
            hook: None,
            rules: vec![
                Rule::new(
                    "allow",
                    vec![build::addr_in_set(build::Addr::Src, Family::V4, "policy-peers"), build::ret()],
                ),
                Rule::new("deny", vec![build::count_into("policy-c"), build::drop()]),
            ],
        },
    );
    p
}

#[test]
fn a_fresh_table_gets_everything_in_dependency_order_and_then_nothing() {
    let p = sample();
    let ops = diff(&Observed::default(), &p);
    let pos = |f: &dyn Fn(&Op) -> bool| ops.iter().position(f).unwrap();
    assert!(pos(&|o| matches!(o, Op::AddSet(..))) < pos(&|o| matches!(o, Op::AddRule(..))));
    assert!(pos(&|o| matches!(o, Op::AddChain(c, None) if c == "policy-pod")) < pos(&|o| matches!(o, Op::AddRule(..))));
    assert!(pos(&|o| matches!(o, Op::AddCounter(..))) < pos(&|o| matches!(o, Op::AddRule(..))));
    assert_eq!(ops.iter().filter(|o| matches!(o, Op::AddRule(..))).count(), 3);
    assert!(diff(&p.as_observed(), &p).is_empty(), "converged");
}

#[test]
fn only_changed_elements_are_written() {
    let before = sample();
    let mut after = before.clone();
    let peers = after.sets.get_mut("policy-peers").unwrap();
    peers.elements.remove(&Key::Net(net("10.244.1.5/32")));
    peers.elements.insert(Key::addr("10.244.1.6".parse().unwrap()), None);
    assert_eq!(
        diff(&before.as_observed(), &after),
        vec![
            Op::DeleteElements("policy-peers".into(), false, vec![Key::Net(net("10.244.1.5/32"))]),
            Op::AddElements("policy-peers".into(), vec![(Key::Net(net("10.244.1.6/32")), None)]),
        ]
    );
}

#[test]
fn a_rule_added_by_hand_makes_its_chain_rewritten() {
    let p = sample();
    let mut have = p.as_observed();
    have.chains.get_mut("policy-pod").unwrap().rule_ids.insert(0, String::new());
    let ops = diff(&have, &p);
    assert_eq!(ops[0], Op::FlushChain("policy-pod".into()));
    assert_eq!(ops.len(), 3, "flush and the two rules: {ops:?}");
}

#[test]
fn stale_objects_go_after_the_rules_naming_them_are_rewritten() {
    let p = sample();
    let mut have = p.as_observed();
    have.chains.insert("policy-old".into(), ObservedChain { hook: None, rule_ids: vec!["x".into()] });
    have.sets
        .insert("policy-oldset".into(), ObservedSet { kind: Some(SetKind::Nets(Family::V4)), ..Default::default() });
    have.counters.insert("policy-oldcounter".into(), Count::default());
    // The dispatch chain still jumps to the old chain.
    have.chains.get_mut("policy-forward").unwrap().rule_ids = vec!["0000000000000000".into()];
    let ops = diff(&have, &p);
    let pos = |o: Op| ops.iter().position(|x| *x == o).unwrap_or_else(|| panic!("{o:?} missing from {ops:?}"));
    let rewrite = pos(Op::FlushChain("policy-forward".into()));
    assert!(rewrite < pos(Op::FlushChain("policy-old".into())));
    assert!(pos(Op::FlushChain("policy-old".into())) < pos(Op::DeleteChain("policy-old".into())));
    assert!(rewrite < pos(Op::DeleteSet("policy-oldset".into(), false)));
    assert!(rewrite < pos(Op::DeleteCounter("policy-oldcounter".into())));
}

#[test]
fn unreadable_elements_or_another_type_are_replaced_whole() {
    let p = sample();
    let mut have = p.as_observed();
    have.sets.get_mut("policy-peers").unwrap().unreadable = 1;
    let ops = diff(&have, &p);
    assert_eq!(ops[0], Op::FlushSet("policy-peers".into(), false));
    assert!(matches!(&ops[1], Op::AddElements(_, e) if e.len() == 2), "{ops:?}");
    have.sets.get_mut("policy-peers").unwrap().kind = None;
    let ops = diff(&have, &p);
    assert_eq!(
        ops[..2],
        [Op::DeleteSet("policy-peers".into(), false), Op::AddSet("policy-peers".into(), SetKind::Nets(Family::V4))]
    );
}

#[test]
fn a_base_chain_with_another_hook_is_made_anew() {
    let p = sample();
    let mut have = p.as_observed();
    have.chains.get_mut("policy-forward").unwrap().hook =
        Some(Hook { kind: ChainKind::Filter, point: HookPoint::Forward, priority: 10 });
    let ops = diff(&have, &p);
    assert_eq!(
        ops[..3],
        [
            Op::FlushChain("policy-forward".into()),
            Op::DeleteChain("policy-forward".into()),
            Op::AddChain("policy-forward".into(), p.chains["policy-forward"].hook)
        ]
    );
}

#[test]
fn other_parts_objects_are_never_named() {
    let mut all = sample().as_observed();
    all.chains.insert("hostport-prerouting".into(), ObservedChain::default());
    all.sets.insert("hostport-ports".into(), ObservedSet::default());
    all.counters.insert("masquerade-kept".into(), Count::default());
    let ops = diff(&all.of("policy"), &Part::new("policy"));
    assert!(!ops.is_empty());
    assert!(format!("{ops:?}").matches("hostport").count() + format!("{ops:?}").matches("masquerade").count() == 0);
}

#[test]
fn rule_ids_depend_on_statements_and_text_and_comments_are_bounded() {
    let a = Rule::new("x", vec![build::drop()]);
    assert_eq!(a, Rule::new("x", vec![build::drop()]));
    assert_ne!(a.id(), Rule::new("x", vec![build::accept()]).id());
    assert_ne!(a.id(), Rule::new("y", vec![build::drop()]).id());
    let long = Rule::new(&"é\n".repeat(200), vec![build::drop()]);
    assert_eq!(long.comment.len(), 128);
    assert!(long.comment.bytes().all(|b| b.is_ascii_graphic() || b == b' '), "{}", long.comment);
    assert_eq!(long.id().len(), 32);
}

#[test]
fn applying_a_diff_to_what_was_there_gives_what_was_wanted() {
    let want = sample();
    // From nothing, from a tampered state, and from another part's state.
    let mut tampered = want.as_observed();
    tampered.chains.get_mut("policy-pod").unwrap().rule_ids.insert(0, String::new());
    tampered.sets.get_mut("policy-peers").unwrap().unreadable = 2;
    tampered.chains.insert("policy-old".into(), ObservedChain { hook: None, rule_ids: vec!["x".into()] });
    tampered.counters.insert("policy-oldcounter".into(), Count::default());
    for mut have in [Observed::default(), tampered, Part::new("policy").as_observed()] {
        let ops = diff(&have, &want);
        have.apply(&ops);
        assert_eq!(have, want.as_observed());
        assert!(diff(&have, &want).is_empty());
    }
}
