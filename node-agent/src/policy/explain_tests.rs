use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::policy::model::props::{case, naive};
use crate::policy::model::tests::{cluster, std_policy, weft_policy};
use crate::policy::model::{Cluster, Compiler};

fn at<'c>(c: &'c Cluster, key: &str) -> Endpoint<'c> {
    let pod = c.pods.iter().find(|p| p.key() == key).expect("a pod of the fixture");
    Endpoint { addr: pod.ips[0], pod: Some(pod) }
}

#[test]
fn a_deny_all_names_the_isolating_policy_and_refuses() {
    let mut c = cluster();
    c.standard.push(std_policy("prod", "deny-all", json!({"podSelector": {}})));
    let compiler = Compiler::new(&c);
    let e = explain(&compiler, at(&c, "dev/tool"), at(&c, "prod/db"), Proto::Tcp, 5432);
    assert!(!e.allowed);
    assert_eq!(e.egress.decided, Decided::NotSelected);
    assert_eq!(e.ingress.selected_by, vec!["prod/deny-all".to_owned()]);
    assert_eq!(e.ingress.decided, Decided::DefaultDeny);
    assert_eq!(e.refused_by().and_then(|s| s.pod.as_deref()), Some("prod/db"));
}

/// `prod/db`: pods app=db admit app=cache (rule 0), then app=web on 5432 (rule 1).
pub(crate) fn db_admits_cache_then_web_on_5432() -> std::sync::Arc<k8s_openapi::api::networking::v1::NetworkPolicy> {
    std_policy(
        "prod",
        "db",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"app": "cache"}}}]},
            {"from": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": 5432}]}
        ]}),
    )
}

#[test]
fn the_first_matching_rule_decides_with_its_position() {
    let mut c = cluster();
    c.standard.push(db_admits_cache_then_web_on_5432());
    c.weft.push(weft_policy(
        "prod",
        "no-web-8080",
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "priority": 10, "egress": [
            {"action": "Deny", "ports": [{"port": 8080}]}
        ]}),
    ));
    let compiler = Compiler::new(&c);

    let ok = explain(&compiler, at(&c, "prod/web"), at(&c, "prod/db"), Proto::Tcp, 5432);
    assert!(ok.allowed, "{ok:?}");
    assert_eq!(ok.ingress.decided, Decided::Rule { origin: "prod/db".into(), rule: 1, allow: true });
    // web's egress is selected by the Weft policy, whose rule does not match 5432.
    assert_eq!(ok.egress.selected_by, vec!["weft.dev/prod/no-web-8080".to_owned()]);
    assert_eq!(ok.egress.decided, Decided::NoRuleMatched);

    let denied = explain(&compiler, at(&c, "prod/web"), at(&c, "prod/db"), Proto::Tcp, 8080);
    assert!(!denied.allowed);
    let by = Decided::Rule { origin: "weft.dev/prod/no-web-8080".into(), rule: 0, allow: false };
    assert_eq!(denied.egress.decided, by);
    assert_eq!(denied.refused_by().map(|s| s.direction), Some("egress"));

    // Not a pod: no side of its own; the pod's side still decides.
    let outside = Endpoint { addr: "192.0.2.7".parse().unwrap(), pod: None };
    let e = explain(&compiler, outside, at(&c, "prod/db"), Proto::Tcp, 5432);
    assert_eq!((e.egress.pod.as_deref(), e.egress.decided.clone()), (None, Decided::NotSelected));
    assert_eq!(e.ingress.decided, Decided::DefaultDeny);
}

#[test]
fn an_explanation_serialises_for_the_cli() {
    let mut c = cluster();
    c.standard.push(std_policy("prod", "deny-all", json!({"podSelector": {}})));
    let e = explain(&Compiler::new(&c), at(&c, "dev/tool"), at(&c, "prod/db"), Proto::Tcp, 5432);
    let v = serde_json::to_value(&e).unwrap();
    assert_eq!(v["ingress"]["decided"], json!({"by": "defaultDeny"}));
    assert_eq!(v["ingress"]["selectedBy"], json!(["prod/deny-all"]));
    assert_eq!(v["egress"]["decided"], json!({"by": "notSelected"}));
    assert_eq!((v["protocol"].as_str(), v["allowed"].as_bool()), (Some("TCP"), Some(false)));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// For every pair of pods (each on any node), every family they share,
    /// every protocol and the ports policies name: the explanation admits
    /// exactly what the naive reading of the policies admits at both ends,
    /// and names a refusing side exactly when it refuses.
    #[test]
    fn explanations_agree_with_the_naive_reading(case in case()) {
        let c = case.cluster();
        let compiler = Compiler::new(&c);
        for from in &c.pods {
            for to in &c.pods {
                for &dst in &to.ips {
                    let Some(&src) = from.ips.iter().find(|a| a.is_ipv4() == dst.is_ipv4()) else { continue };
                    for proto in [Proto::Tcp, Proto::Udp, Proto::Sctp] {
                        for port in [1, 53, 80, 81, 180, 5432, 8080, 8081, 65535] {
                            let e = explain(
                                &compiler,
                                Endpoint { addr: src, pod: Some(from) },
                                Endpoint { addr: dst, pod: Some(to) },
                                proto,
                                port,
                            );
                            let naive = naive::allowed(&c, from, Direction::Egress, dst, proto, port)
                                && naive::allowed(&c, to, Direction::Ingress, src, proto, port);
                            prop_assert_eq!(e.allowed, naive, "{:?}", e);
                            prop_assert_eq!(e.refused_by().is_some(), !naive);
                        }
                    }
                }
            }
        }
    }
}
