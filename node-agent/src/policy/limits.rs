//! The bound on what one standard NetworkPolicy may compile to lives in
//! `weft_api::standard_policy` (the operator reports refusals); this is
//! the agent's side of it.

pub use weft_api::standard_policy::{MAX_COST, standard_cost};

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_refused_policy_isolates_its_pods_and_admits_nothing() {
        use crate::policy::model::tests::{NODE, cluster, std_policy};
        use crate::policy::model::{Proto, admits, compile};
        let mut c = cluster();
        let excepts: Vec<String> = (0..700).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256)).collect();
        let oversized = json!({"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [
            {"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": excepts}}]}]});
        c.standard = vec![std_policy("prod", "huge", oversized)];
        assert!(standard_cost(&c.standard[0].spec.clone().unwrap()) > MAX_COST);
        let pods = compile(&c, NODE);
        let db = pods.iter().find(|p| p.key == "prod/db").expect("prod/db stays under policy");
        let ingress = db.ingress.as_ref().expect("isolated for ingress");
        assert!(ingress.rules.is_empty() && ingress.default_deny, "{ingress:?}");
        assert!(!admits(ingress, "10.200.0.1".parse().unwrap(), Proto::Tcp, 5432));
    }
}
