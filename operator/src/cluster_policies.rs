//! ClusterNetworkPolicy status (when Weft enforces them): the `Accepted`
//! condition on each, True when the agents enforce it as written, False with
//! the reason and what the agents do instead when they cannot
//! (`weft_api::cluster_network_policy::problems`, the same check the agents
//! apply: an oversized policy or an unsupported peer fails closed).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use weft_api::cluster_network_policy::{CONDITION_ACCEPTED, ClusterNetworkPolicy, ClusterNetworkPolicySpec, problems};

use crate::leader::{NotLeader, Term};
use crate::metrics::Metrics;
use crate::policies::accepted_condition;

const FIELD_MANAGER: &str = "weft-operator-cluster-policies";
const CONTROLLER: &str = "clusternetworkpolicy";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("updating the status of ClusterNetworkPolicy {name}: {source}")]
    Status { name: String, source: kube::Error },
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
}

struct Ctx {
    client: Client,
    metrics: Arc<Metrics>,
    term: Term,
    resync: Duration,
}

/// What the `Accepted` condition should say: (accepted, reason, message).
pub fn desired_condition(spec: &ClusterNetworkPolicySpec) -> (bool, &'static str, String) {
    let found = problems(spec);
    match found.first() {
        None => (true, "Enforced", "enforced by Weft as written".to_owned()),
        Some((reason, _)) => {
            let all: Vec<&str> = found.iter().map(|(_, text)| text.as_str()).collect();
            (false, reason, format!("enforced failing closed: {}", all.join("; ")))
        }
    }
}

async fn reconcile(policy: Arc<ClusterNetworkPolicy>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&policy, &ctx).await;
    ctx.metrics.observe(CONTROLLER, started.elapsed(), result.is_err());
    result
}

async fn reconcile_inner(policy: &ClusterNetworkPolicy, ctx: &Ctx) -> Result<Action, Error> {
    let (accepted, reason, message) = desired_condition(&policy.spec);
    let conditions = policy.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    let current = conditions.iter().find(|c| c.type_ == CONDITION_ACCEPTED);
    let Some(condition) = accepted_condition(current, accepted, reason, message, policy.metadata.generation) else {
        return Ok(Action::requeue(ctx.resync));
    };
    // Server-side apply of this one condition: the list is a map by type,
    // so conditions other controllers set stay.
    let patch = json!({
        "apiVersion": "policy.networking.k8s.io/v1beta1",
        "kind": "ClusterNetworkPolicy",
        "status": {"conditions": [condition]},
    });
    let name = policy.name_any();
    let api: Api<ClusterNetworkPolicy> = Api::all(ctx.client.clone());
    ctx.term.check()?;
    match api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch)).await {
        Ok(_) => {
            if !accepted {
                tracing::info!(%name, reason, "ClusterNetworkPolicy enforced failing closed");
            }
            Ok(Action::requeue(ctx.resync))
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Action::await_change()),
        Err(source) => Err(Error::Status { name, source }),
    }
}

fn error_policy(_p: Arc<ClusterNetworkPolicy>, error: &Error, _ctx: Arc<Ctx>) -> Action {
    tracing::warn!(%error, "ClusterNetworkPolicy reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Runs the controller until its watch ends.
pub async fn run(client: Client, metrics: Arc<Metrics>, term: Term, resync: Duration) {
    let api: Api<ClusterNetworkPolicy> = Api::all(client.clone());
    let ctx = Arc::new(Ctx { client, metrics, term, resync });
    Controller::new(api, watcher::Config::default())
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "clusternetworkpolicy controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_condition_says_how_the_policy_is_enforced() {
        let spec = |egress: serde_json::Value| -> ClusterNetworkPolicySpec {
            serde_json::from_value(
                json!({"tier": "Baseline", "priority": 5, "subject": {"namespaces": {}}, "egress": egress}),
            )
            .unwrap()
        };
        let (ok, reason, _) =
            desired_condition(&spec(json!([{"action": "Deny", "to": [{"networks": ["0.0.0.0/0"]}]}])));
        assert_eq!((ok, reason), (true, "Enforced"));
        let (ok, reason, message) =
            desired_condition(&spec(json!([{"action": "Deny", "to": [{"domainNames": ["*.example.com"]}]}])));
        assert_eq!((ok, reason), (false, "DomainNamesUnsupported"));
        assert!(message.starts_with("enforced failing closed: egress rule 0"), "{message}");
    }
}
