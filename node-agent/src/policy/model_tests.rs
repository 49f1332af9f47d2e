//! Truth tables for the policy model: each Kubernetes NetworkPolicy rule and
//! each Weft precedence rule, checked by evaluating the compiled chains.

use serde_json::{Value, json};

use super::*;

pub(crate) const NODE: &str = "n1";

/// A pod with the addresses `ips` (comma-separated, one per family).
pub(crate) fn pod(ns: &str, name: &str, labels: &[(&str, &str)], ips: &str, node: &str) -> PodInfo {
    PodInfo {
        namespace: ns.into(),
        name: name.into(),
        labels: labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
        ips: ips.split(',').map(|ip| ip.parse().unwrap()).collect(),
        node: node.into(),
        ports: vec![],
    }
}

pub(crate) fn with_port(mut p: PodInfo, name: &str, port: u16, proto: Proto) -> PodInfo {
    p.ports.push(NamedPort { name: name.into(), port, proto });
    p
}

/// Namespaces `prod` (team=a, env=prod) and `dev` (team=b); pods:
/// prod/web (10.0.1.1, n1), prod/db (10.0.1.2, n1), prod/cache (10.0.2.1, n2),
/// dev/web (10.0.2.2, n2), dev/tool (10.0.1.3, n1).
pub(crate) fn cluster() -> Cluster {
    let mut c = Cluster::default();
    c.namespaces.insert("prod".into(), [("team", "a"), ("env", "prod")].map(|(k, v)| (k.into(), v.into())).into());
    c.namespaces.insert("dev".into(), [("team".to_owned(), "b".to_owned())].into());
    c.pods = vec![
        with_port(pod("prod", "web", &[("app", "web")], "10.0.1.1", NODE), "http", 8080, Proto::Tcp),
        with_port(pod("prod", "db", &[("app", "db")], "10.0.1.2", NODE), "sql", 5432, Proto::Tcp),
        with_port(pod("prod", "cache", &[("app", "cache")], "10.0.2.1", "n2"), "http", 9090, Proto::Tcp),
        pod("dev", "web", &[("app", "web")], "10.0.2.2", "n2"),
        pod("dev", "tool", &[("app", "tool")], "10.0.1.3", NODE),
    ]
    .into_iter()
    .map(std::sync::Arc::new)
    .collect();
    c
}

pub(crate) fn std_policy(ns: &str, name: &str, spec: Value) -> std::sync::Arc<netv1::NetworkPolicy> {
    std::sync::Arc::new(
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns}, "spec": spec})).unwrap(),
    )
}

pub(crate) fn weft_policy(ns: &str, name: &str, spec: Value) -> std::sync::Arc<wnp::NetworkPolicy> {
    std::sync::Arc::new(
        serde_json::from_value(json!({"apiVersion": "weft.dev/v1alpha1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}))
        .unwrap(),
    )
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Whether `pod` (a local pod key) admits, in `dir`, traffic with `remote`.
fn admitted(c: &Cluster, pod: &str, dir: Direction, remote: &str, proto: Proto, port: u16) -> bool {
    let compiled = compile(c, NODE);
    let Some(p) = compiled.iter().find(|p| p.key == pod) else { return true };
    let chain = match dir {
        Direction::Ingress => &p.ingress,
        Direction::Egress => &p.egress,
    };
    chain.as_ref().is_none_or(|ch| admits(ch, ip(remote), proto, port))
}

fn ing(c: &Cluster, pod: &str, remote: &str, port: u16) -> bool {
    admitted(c, pod, Direction::Ingress, remote, Proto::Tcp, port)
}

fn eg(c: &Cluster, pod: &str, remote: &str, port: u16) -> bool {
    admitted(c, pod, Direction::Egress, remote, Proto::Tcp, port)
}

#[test]
fn no_policy_means_open_and_no_chains() {
    let c = cluster();
    assert!(compile(&c, NODE).is_empty());
    assert!(ing(&c, "prod/web", "1.2.3.4", 80));
}

#[test]
fn empty_pod_selector_selects_every_pod_of_its_namespace_only() {
    let mut c = cluster();
    c.standard.push(std_policy("prod", "deny-all", json!({"podSelector": {}})));
    let compiled = compile(&c, NODE);
    let keys: Vec<&str> = compiled.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, ["prod/db", "prod/web"], "local prod pods only; dev/tool stays open");
    assert!(!ing(&c, "prod/web", "10.0.1.3", 80));
    assert!(ing(&c, "dev/tool", "10.0.1.1", 80));
    // policyTypes defaults to Ingress only: egress stays open.
    assert!(compiled[0].egress.is_none());
    assert!(eg(&c, "prod/web", "8.8.8.8", 53));
}

#[test]
fn policy_types_defaulting() {
    let spec = |v: Value| serde_json::from_value::<netv1::NetworkPolicySpec>(v).unwrap();
    assert_eq!(policy_types(&spec(json!({"podSelector": {}}))), (true, false));
    assert_eq!(policy_types(&spec(json!({"podSelector": {}, "egress": [{}]}))), (true, true));
    assert_eq!(policy_types(&spec(json!({"podSelector": {}, "policyTypes": ["Egress"]}))), (false, true));
    assert_eq!(
        policy_types(&spec(json!({"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress", "Egress"]}))),
        (true, true)
    );
    // An egress-only policy without policyTypes isolates ingress too (deny all ingress).
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "eg",
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "egress": [{"to": [{"ipBlock": {"cidr": "8.8.8.8/32"}}]}]}),
    ));
    assert!(!ing(&c, "prod/web", "10.0.1.2", 80));
    assert!(eg(&c, "prod/web", "8.8.8.8", 53));
    assert!(!eg(&c, "prod/web", "8.8.4.4", 53));
}

#[test]
fn egress_only_policy_types_leaves_ingress_open() {
    let mut c = cluster();
    c.standard.push(std_policy("prod", "eg", json!({"podSelector": {}, "policyTypes": ["Egress"]})));
    assert!(ing(&c, "prod/web", "10.0.2.2", 80));
    assert!(!eg(&c, "prod/web", "10.0.2.2", 80), "egress deny-all");
}

#[test]
fn pod_selector_peer_is_in_the_policy_namespace() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "p",
        json!({"podSelector": {"matchLabels": {"app": "db"}},
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.1", 5432), "prod/web");
    assert!(!ing(&c, "prod/db", "10.0.2.2", 5432), "dev/web has the label but another namespace");
    assert!(!ing(&c, "prod/db", "10.0.1.3", 5432));
    assert!(ing(&c, "prod/web", "10.0.1.3", 80), "web not selected");
}

#[test]
fn namespace_selector_peer_and_both_is_and_and_two_peers_or() {
    let base = cluster();
    let nsel = json!({"namespaceSelector": {"matchLabels": {"team": "b"}}});
    let psel = json!({"podSelector": {"matchLabels": {"app": "web"}}});
    let both =
        json!({"namespaceSelector": {"matchLabels": {"team": "b"}}, "podSelector": {"matchLabels": {"app": "web"}}});
    let with = |from: Value| {
        let mut c = base.clone();
        c.standard.push(std_policy(
            "prod",
            "p",
            json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": from}]}),
        ));
        c
    };
    // namespaceSelector alone: every pod of team=b namespaces.
    let c = with(json!([nsel]));
    assert!(ing(&c, "prod/db", "10.0.2.2", 1) && ing(&c, "prod/db", "10.0.1.3", 1));
    assert!(!ing(&c, "prod/db", "10.0.1.1", 1));
    // Both in one peer: AND — dev pods labelled app=web only.
    let c = with(json!([both]));
    assert!(ing(&c, "prod/db", "10.0.2.2", 1));
    assert!(!ing(&c, "prod/db", "10.0.1.3", 1), "dev/tool: namespace yes, label no");
    assert!(!ing(&c, "prod/db", "10.0.1.1", 1), "prod/web: label yes, namespace no");
    // Two peers: OR.
    let c = with(json!([nsel, psel]));
    assert!(
        ing(&c, "prod/db", "10.0.2.2", 1) && ing(&c, "prod/db", "10.0.1.3", 1) && ing(&c, "prod/db", "10.0.1.1", 1)
    );
    assert!(!ing(&c, "prod/db", "10.0.2.1", 1), "prod/cache matches neither");
    // An empty namespaceSelector selects all namespaces.
    let c = with(json!([{"namespaceSelector": {}}]));
    assert!(ing(&c, "prod/db", "10.0.2.2", 1) && ing(&c, "prod/db", "10.0.2.1", 1));
    assert!(!ing(&c, "prod/db", "192.168.1.1", 1), "not a pod");
    // matchExpressions on namespaces.
    let c = with(json!([{"namespaceSelector": {"matchExpressions": [{"key": "env", "operator": "DoesNotExist"}]}}]));
    assert!(ing(&c, "prod/db", "10.0.2.2", 1) && !ing(&c, "prod/db", "10.0.2.1", 1));
}

#[test]
fn ip_block_with_except() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "p",
        json!({"podSelector": {"matchLabels": {"app": "db"}},
               "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.2.0/24", "10.0.1.3/32"]}}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.1", 1));
    assert!(ing(&c, "prod/db", "10.0.200.9", 1), "any address of the block, pod or not");
    assert!(!ing(&c, "prod/db", "10.0.2.2", 1), "excepted /24");
    assert!(!ing(&c, "prod/db", "10.0.1.3", 1), "excepted /32");
    assert!(!ing(&c, "prod/db", "10.1.0.1", 1), "outside the block");
    let p = &compile(&c, NODE)[0];
    let Peers::Nets(nets) = &p.ingress.as_ref().unwrap().rules[0].matches[0].peers else { panic!("nets") };
    assert!(nets.len() < 20, "except is compiled to a few CIDRs: {nets:?}");
}

#[test]
fn several_peers_across_rules_and_policies_are_unioned() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "a",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.1.1/32"}}]}]}),
    ));
    c.standard.push(std_policy(
        "prod",
        "b",
        json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.2.2/32"}}], "ports": [{"port": 5432}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.1", 1));
    assert!(ing(&c, "prod/db", "10.0.2.2", 5432));
    assert!(!ing(&c, "prod/db", "10.0.2.2", 5433));
    assert!(!ing(&c, "prod/db", "10.0.1.3", 5432));
}

#[test]
fn ports_by_number_range_protocol_and_empty_rule() {
    let base = cluster();
    let with = |ports: Value| {
        let mut c = base.clone();
        c.standard.push(std_policy(
            "prod",
            "p",
            json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"ports": ports}]}),
        ));
        c
    };
    let c = with(json!([{"port": 80}]));
    assert!(ing(&c, "prod/db", "1.1.1.1", 80) && !ing(&c, "prod/db", "1.1.1.1", 81));
    assert!(!admitted(&c, "prod/db", Direction::Ingress, "1.1.1.1", Proto::Udp, 80), "protocol defaults to TCP");
    let c = with(json!([{"port": 8000, "endPort": 8080}]));
    assert!(ing(&c, "prod/db", "1.1.1.1", 8000) && ing(&c, "prod/db", "1.1.1.1", 8080));
    assert!(!ing(&c, "prod/db", "1.1.1.1", 7999) && !ing(&c, "prod/db", "1.1.1.1", 8081));
    let c = with(json!([{"protocol": "UDP", "port": 53}, {"protocol": "SCTP"}]));
    assert!(admitted(&c, "prod/db", Direction::Ingress, "1.1.1.1", Proto::Udp, 53));
    assert!(!admitted(&c, "prod/db", Direction::Ingress, "1.1.1.1", Proto::Tcp, 53));
    assert!(admitted(&c, "prod/db", Direction::Ingress, "1.1.1.1", Proto::Sctp, 9999), "SCTP, every port");
    // An ingress rule with neither from nor ports admits everything.
    let mut c = base.clone();
    c.standard.push(std_policy("prod", "p", json!({"podSelector": {}, "ingress": [{}]})));
    assert!(admitted(&c, "prod/db", Direction::Ingress, "1.1.1.1", Proto::Udp, 7));
    // ingress: [] (present but empty) denies all.
    let mut c = base.clone();
    c.standard.push(std_policy("prod", "p", json!({"podSelector": {}, "ingress": []})));
    assert!(!ing(&c, "prod/db", "10.0.1.1", 80));
}

#[test]
fn named_ports_resolve_against_the_destination_pod() {
    let mut c = cluster();
    // Ingress: "http" is 8080 on prod/web; prod/db has no "http" port.
    c.standard.push(std_policy("prod", "p", json!({"podSelector": {}, "ingress": [{"ports": [{"port": "http"}]}]})));
    assert!(ing(&c, "prod/web", "1.1.1.1", 8080));
    assert!(!ing(&c, "prod/web", "1.1.1.1", 9090));
    assert!(!ing(&c, "prod/db", "1.1.1.1", 8080), "db has no port named http: nothing admitted");
    assert!(!admitted(&c, "prod/web", Direction::Ingress, "1.1.1.1", Proto::Udp, 8080), "name and protocol");
    // Egress: each destination's own number: prod/web→8080, prod/cache→9090.
    let mut c = cluster();
    c.standard.push(std_policy(
        "dev",
        "e",
        json!({"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"ports": [{"port": "http"}]}]}),
    ));
    assert!(eg(&c, "dev/tool", "10.0.1.1", 8080));
    assert!(!eg(&c, "dev/tool", "10.0.1.1", 9090));
    assert!(eg(&c, "dev/tool", "10.0.2.1", 9090));
    assert!(!eg(&c, "dev/tool", "10.0.2.1", 8080));
    assert!(!eg(&c, "dev/tool", "10.0.1.2", 5432));
    // A numeric string is a number.
    let mut c = cluster();
    c.standard.push(std_policy("prod", "p", json!({"podSelector": {}, "ingress": [{"ports": [{"port": "5432"}]}]})));
    assert!(ing(&c, "prod/db", "1.1.1.1", 5432));
}

#[test]
fn egress_peers_and_ports() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "e",
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Egress"],
               "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "db"}}}], "ports": [{"port": 5432}]},
                          {"to": [{"namespaceSelector": {}}], "ports": [{"protocol": "UDP", "port": 53}]}]}),
    ));
    assert!(eg(&c, "prod/web", "10.0.1.2", 5432));
    assert!(!eg(&c, "prod/web", "10.0.1.2", 80));
    assert!(!eg(&c, "prod/web", "10.0.2.1", 5432));
    assert!(admitted(&c, "prod/web", Direction::Egress, "10.0.2.2", Proto::Udp, 53));
    assert!(!admitted(&c, "prod/web", Direction::Egress, "8.8.8.8", Proto::Udp, 53));
    assert!(ing(&c, "prod/web", "8.8.8.8", 80), "ingress open");
}

#[test]
fn only_local_pods_with_addresses_get_chains() {
    let mut c = cluster();
    c.pods.insert(std::sync::Arc::new(PodInfo { ips: vec![], ..pod("prod", "pending", &[], "0.0.0.0", NODE) }));
    c.standard.push(std_policy("prod", "p", json!({"podSelector": {}})));
    let keys: Vec<String> = compile(&c, NODE).into_iter().map(|p| p.key).collect();
    assert_eq!(keys, ["prod/db", "prod/web"]);
    let keys: Vec<String> = compile(&c, "n2").into_iter().map(|p| p.key).collect();
    assert_eq!(keys, ["prod/cache"]);
}

#[test]
fn label_changes_move_pods_in_and_out() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "p",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}]}),
    ));
    assert!(!ing(&c, "prod/db", "10.0.1.1", 1));
    std::sync::Arc::make_mut(c.pods.get_mut("prod", "web").unwrap()).labels.insert("role".into(), "client".into());
    assert!(ing(&c, "prod/db", "10.0.1.1", 1), "peer gained the label");
    std::sync::Arc::make_mut(c.pods.get_mut("prod", "db").unwrap()).labels.insert("app".into(), "db2".into());
    assert!(compile(&c, NODE).is_empty(), "no longer selected");
}

#[test]
fn weft_deny_beats_standard_allow_and_allow_is_final() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "allow-web",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.1", 5432));
    c.weft.push(weft_policy(
        "prod",
        "deny-web",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "priority": 10,
               "ingress": [{"action": "Deny", "peers": [{"ipBlock": {"cidr": "10.0.1.1/32"}}]}]}),
    ));
    assert!(!ing(&c, "prod/db", "10.0.1.1", 5432), "Weft Deny wins over standard Allow");
    // Weft Allow is final: admitted though the standard policy would drop dev/tool.
    c.weft.push(weft_policy(
        "prod",
        "allow-tool",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "priority": 5,
               "ingress": [{"action": "Allow", "peers": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.3", 5432));
    // Priority orders Weft rules: a higher Allow beats a lower Deny.
    c.weft.push(weft_policy(
        "prod",
        "allow-web-high",
        json!({"podSelector": {}, "priority": 20, "ingress": [{"action": "Allow", "peers": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": 5432}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.1", 5432));
    assert!(!ing(&c, "prod/db", "10.0.1.1", 5433), "the lower Deny still applies to other ports");
    // At equal priority Deny comes first.
    let mut c = cluster();
    for (name, action) in [("a-allow", "Allow"), ("b-deny", "Deny")] {
        c.weft.push(weft_policy(
            "prod",
            name,
            json!({"podSelector": {}, "priority": 7, "ingress": [{"action": action}]}),
        ));
    }
    assert!(!ing(&c, "prod/db", "10.0.1.1", 1));
}

#[test]
fn weft_policy_alone_does_not_isolate() {
    let mut c = cluster();
    c.weft.push(weft_policy(
        "prod",
        "deny-dev",
        json!({"podSelector": {}, "egress": [{"action": "Deny", "peers": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}], "ports": [{"protocol": "UDP", "port": 53}]}]}),
    ));
    assert!(!admitted(&c, "prod/web", Direction::Egress, "10.0.2.2", Proto::Udp, 53));
    assert!(admitted(&c, "prod/web", Direction::Egress, "10.0.2.2", Proto::Tcp, 53));
    assert!(admitted(&c, "prod/web", Direction::Egress, "8.8.8.8", Proto::Udp, 53));
    let p = &compile(&c, NODE)[0];
    assert!(p.ingress.is_none() && !p.egress.as_ref().unwrap().default_deny);
}

#[test]
fn weft_named_ports_and_ranges() {
    let mut c = cluster();
    c.weft.push(weft_policy(
        "prod",
        "w",
        json!({"podSelector": {}, "ingress": [{"action": "Deny", "ports": [{"port": "sql"}, {"protocol": "UDP", "port": 100, "endPort": 200}]}]}),
    ));
    assert!(!ing(&c, "prod/db", "1.1.1.1", 5432));
    assert!(ing(&c, "prod/web", "1.1.1.1", 5432), "web has no port named sql");
    assert!(!admitted(&c, "prod/web", Direction::Ingress, "1.1.1.1", Proto::Udp, 150));
    assert!(admitted(&c, "prod/web", Direction::Ingress, "1.1.1.1", Proto::Udp, 201));
}

#[test]
fn peers_matching_nothing_drop_the_rule_not_the_traffic_check() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "p",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "nobody"}}}]}]}),
    ));
    let p = &compile(&c, NODE)[0];
    let ch = p.ingress.as_ref().unwrap();
    assert!(ch.rules.is_empty() && ch.default_deny);
    assert!(!ing(&c, "prod/db", "10.0.1.1", 1));
}

#[test]
fn re_addressed_and_deleted_pods_update_peers_and_chains() {
    let mut c = cluster();
    c.standard.push(std_policy(
        "prod",
        "p",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.1", 1));
    std::sync::Arc::make_mut(c.pods.get_mut("prod", "web").unwrap()).ips = vec![ip("10.0.3.7")];
    assert!(!ing(&c, "prod/db", "10.0.1.1", 1), "the old address is no peer any more");
    assert!(ing(&c, "prod/db", "10.0.3.7", 1));
    std::sync::Arc::make_mut(c.pods.get_mut("prod", "db").unwrap()).ips = vec![ip("10.0.1.20")];
    assert_eq!(compile(&c, NODE)[0].ips, [ip("10.0.1.20")], "the chain follows the selected pod's new address");
    c.pods.remove("prod", "web");
    assert!(!ing(&c, "prod/db", "10.0.3.7", 1), "a deleted pod is no peer");
}

/// The same peer spec in two namespaces: a pod selector without a namespace
/// selector means each policy's own namespace, so the two resolve apart even
/// though a pass resolves equal specs once.
#[test]
fn equal_peer_specs_in_two_namespaces_resolve_to_each_namespace_s_pods() {
    let mut c = cluster();
    let spec = json!({"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]});
    c.standard = vec![std_policy("prod", "from-web", spec.clone()), std_policy("dev", "from-web", spec)];
    // prod/db admits prod/web, not dev/web; dev/tool the other way round.
    assert!(ing(&c, "prod/db", "10.0.1.1", 80));
    assert!(!ing(&c, "prod/db", "10.0.2.2", 80));
    assert!(ing(&c, "dev/tool", "10.0.2.2", 80));
    assert!(!ing(&c, "dev/tool", "10.0.1.1", 80));
    // With a namespace selector the namespace is the selector's: one set.
    let spec = json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {},
        "podSelector": {"matchLabels": {"app": "web"}}}]}]});
    c.standard = vec![std_policy("prod", "from-web", spec.clone()), std_policy("dev", "from-web", spec)];
    for (pod, remote) in [("prod/db", "10.0.1.1"), ("prod/db", "10.0.2.2"), ("dev/tool", "10.0.1.1")] {
        assert!(ing(&c, pod, remote, 80), "{pod} from {remote}");
    }
}

/// `cluster()` with an IPv6 address on every pod: `fd00::<IPv4's last two octets>`.
fn dual_stack_cluster() -> Cluster {
    let mut c = cluster();
    c.pods = c
        .pods
        .iter()
        .map(|p| {
            let mut p = (**p).clone();
            let IpAddr::V4(v4) = p.ips[0] else { unreachable!() };
            let [_, _, a, b] = v4.octets();
            p.ips.push(IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, u16::from(a), u16::from(b))));
            std::sync::Arc::new(p)
        })
        .collect();
    c
}

#[test]
fn pod_peers_admit_every_address_of_the_pods_they_select() {
    let mut c = dual_stack_cluster();
    c.standard.push(std_policy(
        "prod",
        "db-from-web",
        json!({"podSelector": {"matchLabels": {"app": "db"}},
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
    ));
    assert!(ing(&c, "prod/db", "10.0.1.1", 5432));
    assert!(ing(&c, "prod/db", "fd00::1:1", 5432), "prod/web's IPv6 address");
    assert!(!ing(&c, "prod/db", "fd00::1:3", 5432), "dev/tool's IPv6 address");
    assert!(!ing(&c, "prod/db", "10.0.1.3", 5432));
    let compiled = compile(&c, NODE);
    let db = compiled.iter().find(|p| p.key == "prod/db").unwrap();
    assert_eq!(db.ips, [ip("10.0.1.2"), ip("fd00::1:2")], "both addresses reach the dispatch maps");
}

#[test]
fn an_ip_block_matches_only_addresses_of_its_own_family() {
    let mut c = dual_stack_cluster();
    c.standard.push(std_policy(
        "prod",
        "blocks",
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Egress"],
               "ingress": [{"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}],
               "egress": [{"to": [{"ipBlock": {"cidr": "::/0", "except": ["fd00::1:0/112"]}}]}]}),
    ));
    assert!(ing(&c, "prod/web", "192.0.2.1", 80));
    assert!(!ing(&c, "prod/web", "2001:db8::1", 80), "0.0.0.0/0 is every IPv4 address, no IPv6 one");
    assert!(!ing(&c, "prod/web", "::ffff:192.0.2.1", 80), "nor an IPv4-mapped IPv6 one");
    assert!(eg(&c, "prod/web", "2001:db8::1", 80));
    assert!(!eg(&c, "prod/web", "fd00::1:2", 80), "the except");
    assert!(eg(&c, "prod/web", "fd00::2:1", 80));
    assert!(!eg(&c, "prod/web", "10.0.2.1", 80), "::/0 is no IPv4 address");
}

#[test]
fn a_named_egress_port_through_a_block_admits_only_the_addresses_inside_it() {
    let mut c = dual_stack_cluster();
    c.standard.push(std_policy(
        "prod",
        "to-http",
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Egress"],
               "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": "http"}]}]}),
    ));
    assert!(eg(&c, "prod/web", "10.0.2.1", 9090), "prod/cache names 9090 http");
    assert!(!eg(&c, "prod/web", "fd00::2:1", 9090), "its IPv6 address is outside the block");
}

#[test]
fn a_pod_with_only_an_ipv6_address_is_a_peer_and_gets_chains() {
    let mut c = cluster();
    c.pods.insert(std::sync::Arc::new(pod("prod", "v6", &[("app", "web")], "fd00::9", NODE)));
    c.standard.push(std_policy(
        "prod",
        "db-from-web",
        json!({"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
    ));
    assert!(ing(&c, "prod/db", "fd00::9", 80));
    assert!(!ing(&c, "prod/v6", "fd00::8", 80));
    assert!(ing(&c, "prod/v6", "10.0.1.1", 80));
}

pub(crate) fn cluster_policy(
    name: &str,
    tier: &str,
    priority: i32,
    spec: Value,
) -> std::sync::Arc<ClusterNetworkPolicy> {
    let mut spec = spec;
    spec["tier"] = tier.into();
    spec["priority"] = priority.into();
    std::sync::Arc::new(
        serde_json::from_value(json!({"apiVersion": "policy.networking.k8s.io/v1beta1",
            "kind": "ClusterNetworkPolicy", "metadata": {"name": name}, "spec": spec}))
        .unwrap(),
    )
}

/// Ingress of every pod of namespaces labelled `team: a` (prod): `action`
/// for traffic from `from` (a peer), on `protocols`.
fn prod_ingress(action: &str, from: Value, protocols: Value) -> Value {
    json!({"subject": {"namespaces": {"matchLabels": {"team": "a"}}},
           "ingress": [{"action": action, "from": [from], "protocols": protocols}]})
}

#[test]
fn admin_tier_comes_before_namespace_policies_and_baseline_after() {
    let dev = json!({"namespaces": {"matchLabels": {"team": "b"}}});
    let mut c = cluster();
    // The namespace admits dev/tool (10.0.1.3) to prod/web; Admin denies all of dev.
    c.standard.push(std_policy(
        "prod",
        "web",
        json!({"podSelector": {"matchLabels": {"app": "web"}},
               "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}]}]}),
    ));
    c.cluster_policies.push(cluster_policy("no-dev", "Admin", 10, prod_ingress("Deny", dev.clone(), json!([]))));
    assert!(!ing(&c, "prod/web", "10.0.1.3", 80), "Admin Deny overrides the namespace's allow");
    let web = compile(&c, NODE).into_iter().find(|p| p.key == "prod/web").expect("prod/web");
    let rules = &web.ingress.as_ref().expect("ingress").rules;
    assert!(rules[0].silent && !rules[1].silent, "an Admin Deny drops without an answer: {rules:?}");
    // Accept at a lower number (higher precedence) wins over it, for TCP 80 only.
    c.cluster_policies.push(cluster_policy(
        "dev-http",
        "Admin",
        5,
        prod_ingress("Accept", dev.clone(), json!([{"tcp": {"destinationPort": {"number": 80}}}])),
    ));
    assert!(ing(&c, "prod/web", "10.0.1.3", 80));
    assert!(!ing(&c, "prod/web", "10.0.1.3", 81));
    // Baseline applies to pods no NetworkPolicy isolates (prod/db), not to prod/web.
    c.cluster_policies.clear();
    c.cluster_policies.push(cluster_policy("baseline-deny", "Baseline", 1, prod_ingress("Deny", dev, json!([]))));
    assert!(!ing(&c, "prod/db", "10.0.1.3", 80), "Baseline denies where no NetworkPolicy speaks");
    assert!(ing(&c, "prod/db", "10.0.2.1", 80), "and admits the rest");
    assert!(ing(&c, "prod/web", "10.0.1.3", 80), "the namespace's policy decides for the pods it isolates");
    assert!(ing(&c, "dev/tool", "10.0.1.3", 80), "dev is not the subject");
}

#[test]
fn admin_pass_hands_what_it_matches_to_the_namespace_policies_and_then_to_baseline() {
    let dev = json!({"namespaces": {"matchLabels": {"team": "b"}}});
    let anyone = json!({"namespaces": {}});
    let mut c = cluster();
    // Admin: pass dev on TCP 80-90, then deny everyone; Baseline: deny dev.
    c.cluster_policies.push(cluster_policy(
        "pass-dev",
        "Admin",
        1,
        prod_ingress("Pass", dev.clone(), json!([{"tcp": {"destinationPort": {"range": {"start": 80, "end": 90}}}}])),
    ));
    c.cluster_policies.push(cluster_policy("deny-all", "Admin", 2, prod_ingress("Deny", anyone, json!([]))));
    c.cluster_policies.push(cluster_policy("baseline", "Baseline", 1, prod_ingress("Deny", dev, json!([]))));
    // prod/db: no NetworkPolicy, so what Admin passes meets Baseline's deny.
    assert!(!ing(&c, "prod/db", "10.0.1.3", 80));
    // prod/web: a NetworkPolicy admits dev on 80 only: what passes is decided there.
    c.standard.push(std_policy(
        "prod",
        "web",
        json!({"podSelector": {"matchLabels": {"app": "web"}},
               "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}],
                            "ports": [{"port": 80}]}]}),
    ));
    assert!(ing(&c, "prod/web", "10.0.1.3", 80), "passed, then admitted by the NetworkPolicy");
    assert!(!ing(&c, "prod/web", "10.0.1.3", 85), "passed, then isolated by the NetworkPolicy");
    assert!(!ing(&c, "prod/web", "10.0.1.3", 91), "not passed: Admin's deny");
    assert!(!ing(&c, "prod/web", "10.0.2.1", 80), "prod/cache is not passed: Admin's deny");
    // Without any NetworkPolicy or Baseline rule, what passes is admitted.
    c.standard.clear();
    c.cluster_policies.retain(|p| p.spec.tier == weft_api::cluster_network_policy::Tier::Admin);
    assert!(ing(&c, "prod/web", "10.0.1.3", 85));
    assert!(!ing(&c, "prod/web", "10.0.1.3", 91));
}

#[test]
fn cluster_policy_peers_and_subjects_by_pods_and_networks() {
    let mut c = cluster();
    c.cluster_policies.push(cluster_policy(
        "db-egress",
        "Admin",
        1,
        // No namespaceSelector: the pods of every namespace.
        json!({"subject": {"pods": {"podSelector": {"matchLabels": {"app": "db"}}}},
               "egress": [
                 {"action": "Accept", "to": [{"pods": {"namespaceSelector": {"matchLabels": {"team": "b"}},
                                                       "podSelector": {"matchLabels": {"app": "tool"}}}}]},
                 {"action": "Accept", "to": [{"networks": ["192.0.2.0/24"]}],
                  "protocols": [{"udp": {}}]},
                 {"action": "Deny", "to": [{"networks": ["0.0.0.0/0"]}]}]}),
    ));
    let udp = |remote: &str| admitted(&c, "prod/db", Direction::Egress, remote, Proto::Udp, 53);
    assert!(eg(&c, "prod/db", "10.0.1.3", 5432), "dev/tool by namespace and pod selector");
    assert!(!eg(&c, "prod/db", "10.0.2.2", 80), "dev/web is not app=tool");
    assert!(udp("192.0.2.7") && !eg(&c, "prod/db", "192.0.2.7", 53), "the network on UDP only");
    assert!(!eg(&c, "prod/db", "8.8.8.8", 443));
    assert!(eg(&c, "prod/web", "8.8.8.8", 443), "prod/web is not the subject");
    // A peer by pod labels alone: dev/web and prod/web (app=web, any namespace).
    c.cluster_policies = vec![cluster_policy(
        "no-web",
        "Admin",
        1,
        json!({"subject": {"namespaces": {}},
               "ingress": [{"action": "Deny", "from": [{"pods": {"podSelector": {"matchLabels": {"app": "web"}}}}]}]}),
    )];
    assert!(!ing(&c, "prod/db", "10.0.2.2", 80) && !ing(&c, "prod/db", "10.0.1.1", 80));
    assert!(ing(&c, "prod/db", "10.0.1.3", 80), "dev/tool is no web pod");
}

#[test]
fn node_peers_match_the_addresses_of_the_nodes_their_selector_picks() {
    let node = |name: &str, zone: &str, ips: &[&str]| {
        std::sync::Arc::new(NodeInfo {
            name: name.into(),
            labels: [("zone".to_owned(), zone.to_owned())].into(),
            ips: ips.iter().map(|a| a.parse().unwrap()).collect(),
        })
    };
    let mut c = cluster();
    c.nodes = vec![node("n1", "a", &["192.168.1.1", "fd00:1::1"]), node("n2", "b", &["192.168.1.2"])];
    c.cluster_policies = vec![cluster_policy(
        "nodes",
        "Admin",
        1,
        json!({"subject": {"namespaces": {"matchLabels": {"team": "a"}}},
               "egress": [{"action": "Accept", "to": [{"nodes": {"matchLabels": {"zone": "a"}}}],
                           "protocols": [{"tcp": {"destinationPort": {"number": 10250}}}]},
                          {"action": "Deny", "to": [{"nodes": {}}]}]}),
    )];
    assert!(eg(&c, "prod/web", "192.168.1.1", 10250) && eg(&c, "prod/web", "fd00:1::1", 10250));
    assert!(!eg(&c, "prod/web", "192.168.1.1", 22), "zone a on another port: the Deny of every node");
    assert!(!eg(&c, "prod/web", "192.168.1.2", 10250), "zone b is no peer of the Accept");
    assert!(eg(&c, "prod/web", "10.0.2.1", 80), "a pod is no node");
}

#[test]
fn every_rule_of_an_oversized_cluster_policy_fails_closed() {
    // 25 rules of 25 protocol entries to 40 networks: 25,000, over the limit.
    let nets: Vec<String> = (0..40).map(|i| format!("10.{i}.0.0/16")).collect();
    let protos: Vec<Value> = (1..=25).map(|p| json!({"tcp": {"destinationPort": {"number": p}}})).collect();
    let big = |action: &str| {
        let rule = json!({"action": action, "to": [{"networks": nets}], "protocols": protos});
        json!({"subject": {"namespaces": {"matchLabels": {"team": "a"}}}, "egress": vec![rule; 25]})
    };
    let mut c = cluster();
    c.cluster_policies = vec![cluster_policy("big", "Admin", 1, big("Accept"))];
    assert!(eg(&c, "prod/web", "10.0.2.1", 80), "its Accepts match nothing: on to the default");
    c.cluster_policies = vec![cluster_policy("big", "Admin", 1, big("Deny"))];
    assert!(!eg(&c, "prod/web", "8.8.8.8", 53), "its Denies deny everything, also outside its networks");
    assert!(eg(&c, "dev/web", "8.8.8.8", 53), "not its subject");
}

#[test]
fn peers_weft_cannot_match_fail_closed_and_a_baseline_pass_accepts() {
    let by_domain = json!({"domainNames": ["example.com"]});
    let egress = |action: &str| {
        json!({"subject": {"namespaces": {"matchLabels": {"team": "a"}}},
               "egress": [{"action": action, "to": [by_domain.clone()]}]})
    };
    let mut c = cluster();
    c.cluster_policies = vec![cluster_policy("domains", "Admin", 1, egress("Accept"))];
    assert!(eg(&c, "prod/web", "10.0.2.1", 80), "an Accept of peers it cannot match matches nothing");
    for action in ["Deny", "Pass"] {
        c.cluster_policies = vec![cluster_policy("domains", "Admin", 1, egress(action))];
        assert!(!eg(&c, "prod/web", "10.0.2.1", 80), "a {action} of peers it cannot match denies all");
        assert!(!eg(&c, "prod/web", "8.8.8.8", 53));
    }
    // Baseline: Pass goes on to the default (accept), past later Baseline rules.
    let dev = json!({"namespaces": {"matchLabels": {"team": "b"}}});
    c.cluster_policies = vec![
        cluster_policy("pass", "Baseline", 1, prod_ingress("Pass", dev.clone(), json!([]))),
        cluster_policy("deny", "Baseline", 2, prod_ingress("Deny", dev, json!([]))),
    ];
    assert!(ing(&c, "prod/db", "10.0.1.3", 80));
}
