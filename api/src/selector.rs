//! Label selectors (`metav1.LabelSelector`) as Kubernetes evaluates them:
//! `matchLabels` and every `matchExpressions` entry must hold; an empty
//! selector matches everything. Shared by the agent and the operator so they
//! agree on what a policy selects.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Whether `labels` satisfy `sel`. An invalid expression (unknown operator,
/// missing values) matches nothing, as the apiserver would refuse it.
pub fn matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = sel.match_labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
    by_labels
        && sel.match_expressions.iter().flatten().all(|e| {
            let values = e.values.as_deref().unwrap_or_default();
            let value = labels.get(&e.key);
            match e.operator.as_str() {
                "In" => !values.is_empty() && value.is_some_and(|v| values.contains(v)),
                "NotIn" => !values.is_empty() && value.is_none_or(|v| !values.contains(v)),
                "Exists" => values.is_empty() && value.is_some(),
                "DoesNotExist" => values.is_empty() && value.is_none(),
                _ => false,
            }
        })
}

/// Appends to `problems` what is wrong with `sel` (reported at `at`).
pub fn validate(sel: &LabelSelector, at: &str, problems: &mut Vec<String>) {
    for (i, e) in sel.match_expressions.iter().flatten().enumerate() {
        let n = e.values.as_ref().map_or(0, Vec::len);
        let ok = match e.operator.as_str() {
            "In" | "NotIn" => n > 0,
            "Exists" | "DoesNotExist" => n == 0,
            other => {
                problems.push(format!(
                    "{at}.matchExpressions[{i}].operator: {other:?} is not one of In, NotIn, Exists, DoesNotExist"
                ));
                continue;
            }
        };
        if !ok {
            problems.push(format!(
                "{at}.matchExpressions[{i}]: operator {} {} values",
                e.operator,
                if n == 0 { "needs" } else { "takes no" }
            ));
        }
        if e.key.is_empty() {
            problems.push(format!("{at}.matchExpressions[{i}].key must not be empty"));
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelector {
        LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: key.into(),
                operator: op.into(),
                values: (!values.is_empty()).then(|| values.iter().map(|v| (*v).to_owned()).collect()),
            }]),
            ..Default::default()
        }
    }

    #[test]
    fn selectors_match_like_kubernetes() {
        let web = labels(&[("app", "web"), ("tier", "front")]);
        assert!(matches(&LabelSelector::default(), &web), "empty selects all");
        assert!(matches(&LabelSelector::default(), &BTreeMap::new()));
        let ml = LabelSelector { match_labels: Some(labels(&[("app", "web")])), ..Default::default() };
        assert!(matches(&ml, &web));
        assert!(!matches(&ml, &labels(&[("app", "db")])));
        assert!(matches(&expr("app", "In", &["web", "api"]), &web));
        assert!(!matches(&expr("app", "In", &["db"]), &web));
        assert!(!matches(&expr("app", "NotIn", &["web"]), &web));
        assert!(matches(&expr("missing", "NotIn", &["x"]), &web), "NotIn holds for an absent key");
        assert!(matches(&expr("tier", "Exists", &[]), &web));
        assert!(!matches(&expr("tier", "DoesNotExist", &[]), &web));
        assert!(!matches(&expr("tier", "Bogus", &[]), &web));
        let both = LabelSelector { match_labels: Some(labels(&[("app", "web")])), ..expr("tier", "In", &["back"]) };
        assert!(!matches(&both, &web), "matchLabels AND matchExpressions");
    }

    #[test]
    fn invalid_expressions_are_reported() {
        let mut p = Vec::new();
        validate(&expr("app", "In", &[]), "spec.podSelector", &mut p);
        validate(&expr("app", "Exists", &["x"]), "spec.podSelector", &mut p);
        validate(&expr("app", "Near", &[]), "spec.podSelector", &mut p);
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p[0].contains("operator In needs values"), "{p:?}");
        assert!(p[1].contains("operator Exists takes no values"), "{p:?}");
        assert!(p[2].contains("\"Near\" is not one of In, NotIn, Exists, DoesNotExist"), "{p:?}");
    }

    mod properties {
        use super::*;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
        use proptest::prelude::*;

        fn requirement() -> impl Strategy<Value = LabelSelectorRequirement> {
            (
                "[a-c]",
                prop_oneof![Just("In"), Just("NotIn"), Just("Exists"), Just("DoesNotExist"), Just("in"), Just("")],
                prop::option::of(prop::collection::vec("[x-z]", 0..3)),
            )
                .prop_map(|(key, op, values)| LabelSelectorRequirement {
                    key,
                    operator: op.to_owned(),
                    values,
                })
        }

        proptest! {
            /// A selector the validator refuses matches no labels at all (so
            /// a policy that slipped past validation cannot select widely),
            /// and a valid one agrees with a plain reading of its rules.
            #[test]
            fn invalid_selectors_match_nothing_and_valid_ones_follow_their_rules(
                exprs in prop::collection::vec(requirement(), 0..4),
                labels in prop::collection::btree_map("[a-c]", "[x-z]", 0..3),
            ) {
                let sel = LabelSelector { match_expressions: Some(exprs.clone()), match_labels: None };
                let mut problems = Vec::new();
                validate(&sel, "spec.podSelector", &mut problems);
                if !problems.is_empty() {
                    prop_assert!(!matches(&sel, &labels), "invalid {:?} matched {:?}", problems, labels);
                    return Ok(());
                }
                let expected = exprs.iter().all(|e| {
                    let has = labels.get(&e.key);
                    let in_values = has.is_some_and(|v| e.values.iter().flatten().any(|x| x == v));
                    match e.operator.as_str() {
                        "In" => in_values,
                        "NotIn" => !in_values,
                        "Exists" => has.is_some(),
                        _ => has.is_none(),
                    }
                });
                prop_assert_eq!(matches(&sel, &labels), expected);
            }
        }
    }
}
