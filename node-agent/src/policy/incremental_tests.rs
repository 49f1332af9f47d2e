use std::sync::Arc;

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::json;

use super::*;
use crate::policy::model::props::{self, Case};
use crate::policy::model::tests::{NODE, cluster, cluster_policy, std_policy, weft_policy};
use crate::policy::model::{Proto, compile};
use crate::policy::render::{DropLog, Renderer, render};

/// Runs a pass and checks it against a full compile; returns how many
/// pods it recompiled.
fn pass(inc: &mut Incremental, c: &Cluster) -> usize {
    pass_changed(inc, c).0
}

/// Also whether the pass says its result changed.
fn pass_changed(inc: &mut Incremental, c: &Cluster) -> (usize, bool) {
    let out = inc.compile(&Arc::new(c.clone()));
    assert_eq!(unshared(&out), compile(c, NODE), "the incremental pass differs from a full compile");
    (out.recompiled, out.changed)
}

fn unshared(c: &Compiled) -> Vec<PodPolicy> {
    c.pods.iter().map(|p| (**p).clone()).collect()
}

fn set_pod(c: &mut Cluster, key: &str, change: impl FnOnce(&mut PodInfo)) {
    let (ns, name) = key.split_once('/').unwrap();
    change(Arc::make_mut(c.pods.get_mut(ns, name).unwrap()));
}

/// The local pods of `cluster()` with an address: prod/web, prod/db, dev/tool.
const LOCAL: usize = 3;

#[test]
fn a_pass_with_nothing_changed_recompiles_nothing() {
    let mut c = cluster();
    c.standard = vec![std_policy(
        "prod",
        "db",
        json!({"podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
    )];
    let mut inc = Incremental::new(NODE);
    let first = inc.compile(&Arc::new(c.clone()));
    assert!(first.full && first.changed);
    assert_eq!(first.recompiled, LOCAL);
    assert_eq!(pass_changed(&mut inc, &c), (0, false));
    // A relist: every object new, none different.
    let mut relisted = c.clone();
    relisted.pods = c.pods.iter().map(|p| Arc::new((**p).clone())).collect();
    relisted.standard = c.standard.iter().map(|p| Arc::new((**p).clone())).collect();
    let again = inc.compile(&Arc::new(relisted.clone()));
    assert!(!again.full && !again.changed);
    assert_eq!(again.recompiled, 0);
    inc.reset();
    assert!(inc.compile(&Arc::new(c.clone())).full, "after a reset everything is compiled");
}

#[test]
fn a_peer_s_change_recompiles_only_the_pods_whose_rules_name_it() {
    let mut c = cluster();
    c.standard = vec![
        std_policy(
            "prod",
            "db",
            json!({"podSelector": {"matchLabels": {"app": "db"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "cache"}}}]}]}),
        ),
        std_policy(
            "prod",
            "web",
            json!({"podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
        ),
    ];
    let mut inc = Incremental::new(NODE);
    pass(&mut inc, &c);
    // prod/cache is on the other node; prod/db's rule names it.
    set_pod(&mut c, "prod/cache", |p| p.ips = vec!["10.0.2.9".parse().unwrap()]);
    assert_eq!(pass_changed(&mut inc, &c), (1, true), "prod/db only");
    // dev/web: "app=web" of prod/web's rule means prod's pods only.
    set_pod(&mut c, "dev/web", |p| p.ips = vec!["10.0.2.8".parse().unwrap()]);
    assert_eq!(pass_changed(&mut inc, &c), (0, false));
    // A pod that comes into a rule's selector, and one that leaves it.
    set_pod(&mut c, "dev/tool", |p| {
        p.labels.insert("app".into(), "cache".into());
    });
    assert_eq!(
        pass_changed(&mut inc, &c),
        (1, false),
        "dev/tool itself, under no policy still; a dev pod is no peer of a prod-only rule"
    );
    c.pods.remove("prod", "cache");
    assert_eq!(pass(&mut inc, &c), 1, "prod/db only");
}

#[test]
fn a_policy_change_recompiles_the_pods_it_selects_before_and_after() {
    let mut c = cluster();
    let spec = |app: &str| json!({"podSelector": {"matchLabels": {"app": app}}, "ingress": []});
    c.standard = vec![std_policy("prod", "np", spec("web"))];
    c.weft = vec![weft_policy("dev", "w", json!({"podSelector": {}, "ingress": [{"action": "Deny"}]}))];
    let mut inc = Incremental::new(NODE);
    pass(&mut inc, &c);
    c.standard = vec![std_policy("prod", "np", spec("db"))];
    assert_eq!(pass(&mut inc, &c), 2, "prod/web leaves it, prod/db comes in");
    assert!(inc.compile(&Arc::new(c.clone())).pods.iter().all(|p| p.key != "prod/web"));
    c.weft.clear();
    assert_eq!(pass(&mut inc, &c), 1, "dev/tool");
}

#[test]
fn a_namespace_relabel_recompiles_the_pods_whose_rules_select_the_namespace() {
    let mut c = cluster();
    c.standard = vec![std_policy(
        "prod",
        "db",
        json!({"podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}]}]}),
    )];
    let mut inc = Incremental::new(NODE);
    pass(&mut inc, &c);
    c.namespaces.get_mut("dev").unwrap().insert("team".into(), "c".into());
    assert_eq!(pass(&mut inc, &c), 1, "dev's pods are no peers of prod/db any more");
    c.namespaces.get_mut("prod").unwrap().insert("env".into(), "staging".into());
    assert_eq!(pass(&mut inc, &c), 0, "team=b neither before nor after");
    c.namespaces.insert("new".into(), [("team".to_owned(), "b".to_owned())].into());
    assert_eq!(pass(&mut inc, &c), 0, "a namespace with no pods");
}

#[test]
fn cluster_policies_recompile_the_pods_their_subjects_select_also_when_a_namespace_is_relabelled() {
    let mut c = cluster();
    let deny_from_dev = |ns_team: &str| {
        json!({"subject": {"namespaces": {"matchLabels": {"team": ns_team}}},
               "ingress": [{"action": "Deny", "from": [{"namespaces": {"matchLabels": {"team": "b"}}}]}]})
    };
    c.cluster_policies = vec![cluster_policy("cnp", "Admin", 1, deny_from_dev("a"))];
    let mut inc = Incremental::new(NODE);
    assert_eq!(pass(&mut inc, &c), LOCAL);
    assert_eq!(pass(&mut inc, &c), 0);
    c.cluster_policies = vec![cluster_policy("cnp", "Admin", 1, deny_from_dev("b"))];
    assert_eq!(pass(&mut inc, &c), LOCAL, "prod's pods leave the subject, dev/tool comes in");
    // prod labelled team=b: its pods are selected now, and are peers.
    c.namespaces.get_mut("prod").unwrap().insert("team".into(), "b".into());
    pass(&mut inc, &c);
    assert!(inc.compile(&Arc::new(c.clone())).pods.iter().any(|p| p.key == "prod/web"));
    // A dev pod changes its address: the peers of every subject change.
    set_pod(&mut c, "dev/web", |p| p.ips = vec!["10.0.2.9".parse().unwrap()]);
    pass(&mut inc, &c);
    c.cluster_policies.clear();
    pass(&mut inc, &c);
    assert!(inc.compile(&Arc::new(c.clone())).pods.is_empty());
}

#[test]
fn a_destination_s_named_port_counts_for_an_egress_rule_that_names_it() {
    let mut c = cluster();
    c.standard = vec![std_policy(
        "dev",
        "tool",
        json!({"podSelector": {}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": "http"}]}]}),
    )];
    let mut inc = Incremental::new(NODE);
    pass(&mut inc, &c);
    set_pod(&mut c, "prod/cache", |p| p.ports[0].port = 9191);
    assert_eq!(pass(&mut inc, &c), 1, "dev/tool");
    set_pod(&mut c, "prod/db", |p| p.ports[0].proto = Proto::Udp);
    assert_eq!(pass(&mut inc, &c), 2, "prod/db itself, and dev/tool (it may be named)");
}

/// One change to a cluster, drawing new items from a second generated case.
#[derive(Debug, Clone)]
enum Change {
    /// Pod i takes labels, address, node and ports of the other case's pod j.
    Pod(Index, Index),
    RemovePod(Index),
    /// The other case's pod j joins, under a new name.
    AddPod(Index),
    /// Namespace i takes the labels of the other case's namespace j (or loses its entry).
    Namespace(Index, Option<Index>),
    /// The other case's standard (or Weft) policy j replaces the one of its name, or joins.
    SetPolicy(bool, Index),
    RemovePolicy(bool, Index),
    /// Node i takes the labels and addresses of the other case's node j.
    Node(Index, Index),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        3 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| Change::Pod(i, j)),
        1 => any::<Index>().prop_map(Change::RemovePod),
        1 => any::<Index>().prop_map(Change::AddPod),
        2 => (any::<Index>(), any::<Option<Index>>()).prop_map(|(i, j)| Change::Namespace(i, j)),
        2 => (any::<bool>(), any::<Index>()).prop_map(|(w, j)| Change::SetPolicy(w, j)),
        1 => (any::<bool>(), any::<Index>()).prop_map(|(w, j)| Change::RemovePolicy(w, j)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| Change::Node(i, j)),
    ]
}

/// A copy of the pod `i` picks in `c`.
fn nth_pod(c: &Cluster, i: &Index) -> PodInfo {
    c.pods.iter().nth(i.index(c.pods.len())).map(|p| (**p).clone()).unwrap()
}

fn apply(c: &mut Cluster, other: &Case, change: &Change, step: usize) {
    fn upsert<K: kube::Resource>(list: &mut Vec<Arc<K>>, p: K) {
        let key = |p: &K| (p.meta().namespace.clone(), p.meta().name.clone());
        match list.iter().position(|q| key(q) == key(&p)) {
            Some(i) => list[i] = Arc::new(p),
            None => list.push(Arc::new(p)),
        }
    }
    match change {
        Change::Pod(i, j) if !c.pods.is_empty() => {
            let (mut pod, from) = (nth_pod(c, i), j.get(&other.pods));
            (pod.labels, pod.ips, pod.node, pod.ports) =
                (from.labels.clone(), from.ips.clone(), from.node.clone(), from.ports.clone());
            c.pods.insert(Arc::new(pod));
        }
        Change::RemovePod(i) if !c.pods.is_empty() => {
            let pod = nth_pod(c, i);
            c.pods.remove(&pod.namespace, &pod.name);
        }
        Change::AddPod(j) => {
            let mut pod = j.get(&other.pods).clone();
            pod.name = format!("added{step}");
            c.pods.insert(Arc::new(pod));
        }
        Change::Namespace(i, j) if !c.namespaces.is_empty() => {
            let names: Vec<String> = c.namespaces.keys().cloned().collect();
            let name = i.get(&names).clone();
            match j {
                Some(j) => {
                    let labels: Vec<_> = other.namespaces.values().cloned().collect();
                    c.namespaces.insert(name, j.get(&labels).clone());
                }
                None => {
                    c.namespaces.remove(&name);
                }
            }
        }
        Change::SetPolicy(false, j) if !other.standard.is_empty() => {
            upsert(&mut c.standard, serde_json::from_value(j.get(&other.standard).clone()).unwrap())
        }
        Change::SetPolicy(true, j) if !other.weft.is_empty() => {
            upsert(&mut c.weft, serde_json::from_value(j.get(&other.weft).clone()).unwrap())
        }
        Change::RemovePolicy(false, i) if !c.standard.is_empty() => {
            c.standard.remove(i.index(c.standard.len()));
        }
        Change::RemovePolicy(true, i) if !c.weft.is_empty() => {
            c.weft.remove(i.index(c.weft.len()));
        }
        Change::Node(i, j) if !c.nodes.is_empty() => {
            let (i, from) = (i.index(c.nodes.len()), j.get(&other.nodes));
            let mut node = (*c.nodes[i]).clone();
            (node.labels, node.ips) = (from.labels.clone(), from.ips.clone());
            c.nodes[i] = Arc::new(node);
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// After every change of a random sequence, the incremental pass gives
    /// exactly what a full compile of the same snapshot gives (and the pass
    /// before, when it says nothing changed), a renderer patched pass after
    /// pass renders what a fresh one does, and a pass after no change
    /// recompiles nothing.
    #[test]
    fn each_pass_equals_a_full_compile(
        start in props::case(),
        other in props::case(),
        changes in prop::collection::vec(change(), 1..8),
    ) {
        let mut c = start.cluster();
        let mut inc = Incremental::new(props::NODE);
        let mut before = inc.compile(&Arc::new(c.clone()));
        prop_assert!(before.full);
        let log = Some(DropLog { group: 7, per_second: 10 });
        let mut renderer = Renderer::new(log);
        renderer.render(&before.pods);
        for (step, ch) in changes.iter().enumerate() {
            apply(&mut c, &other, ch, step);
            let out = inc.compile(&Arc::new(c.clone()));
            let full = compile(&c, props::NODE);
            prop_assert_eq!(unshared(&out), full.clone(), "after {:?}", ch);
            prop_assert!(
                *renderer.render(&out.pods) == render(&full, log),
                "a render keeping the chains of the passes before differs from a fresh one after {:?}", ch
            );
            if !out.changed {
                prop_assert_eq!(unshared(&out), unshared(&before), "unchanged, it says, after {:?}", ch);
            }
            before = out;
        }
        let again = inc.compile(&Arc::new(c.clone()));
        prop_assert_eq!((again.recompiled, again.changed), (0, false));
    }
}
