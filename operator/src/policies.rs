//! The weft.dev NetworkPolicy controller: validates what the CRD schema
//! cannot (`weft_api::network_policy::validate`, the same check the agents
//! apply before enforcing a policy) and keeps each policy's status: the
//! `Accepted` condition (False with every problem when rejected) and
//! `selectedPods`, the pods of its namespace it currently selects.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use weft_api::NetworkPolicy;
use weft_api::network_policy::{CONDITION_ACCEPTED, validate};

use crate::leader::{NotLeader, Term};
use crate::metrics::Metrics;

const FIELD_MANAGER: &str = "weft-operator-policies";
const CONTROLLER: &str = "networkpolicy";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("updating the status of NetworkPolicy {namespace}/{name}: {source}")]
    Status { namespace: String, name: String, source: kube::Error },
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
}

struct Ctx {
    client: Client,
    pods: Store<Pod>,
    policies: Store<NetworkPolicy>,
    metrics: Arc<Metrics>,
    term: Term,
    resync: Duration,
}

/// Pods a policy can select: addressed by the pod network and not finished.
pub fn counts(pod: &Pod) -> bool {
    let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    !host_network && !matches!(phase, Some("Succeeded" | "Failed"))
}

/// What the status should say: (accepted, reason, message, selected pods).
pub fn desired_status(policy: &NetworkPolicy, pods: &[Arc<Pod>]) -> (bool, &'static str, String, i32) {
    let ns = policy.namespace().unwrap_or_default();
    let selected = pods
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()) && counts(p))
        .filter(|p| weft_api::selector::matches(&policy.spec.pod_selector, p.labels()))
        .count() as i32;
    let problems = validate(&policy.spec);
    if problems.is_empty() {
        (true, "Valid", format!("enforced for the {selected} selected pod(s)"), selected)
    } else {
        (false, "Invalid", format!("rejected, not enforced: {}", problems.join("; ")), selected)
    }
}

async fn reconcile(policy: Arc<NetworkPolicy>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&policy, &ctx).await;
    ctx.metrics.observe(CONTROLLER, started.elapsed(), result.is_err());
    let (accepted, rejected) = ctx
        .policies
        .state()
        .iter()
        .fold((0, 0), |(a, r), p| if validate(&p.spec).is_empty() { (a + 1, r) } else { (a, r + 1) });
    ctx.metrics.set_network_policies(accepted, rejected);
    result
}

async fn reconcile_inner(policy: &NetworkPolicy, ctx: &Ctx) -> Result<Action, Error> {
    let (accepted, reason, message, selected) = desired_status(policy, &ctx.pods.state());
    let status = policy.status.clone().unwrap_or_default();
    let current = status.conditions.iter().find(|c| c.type_ == CONDITION_ACCEPTED);
    let generation = policy.metadata.generation;
    let condition = accepted_condition(current, accepted, reason, message, generation);
    let unchanged = condition.is_none() && status.selected_pods == selected && status.observed_generation == generation;
    if unchanged {
        return Ok(Action::requeue(ctx.resync));
    }
    let condition = condition.or_else(|| current.cloned());
    let patch = json!({
        "apiVersion": "weft.dev/v1alpha1",
        "kind": "NetworkPolicy",
        "status": {"conditions": [condition], "selectedPods": selected, "observedGeneration": generation},
    });
    let (namespace, name) = (policy.namespace().unwrap_or_default(), policy.name_any());
    let api: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &namespace);
    ctx.term.check()?;
    match api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch)).await {
        Ok(_) => {
            if !accepted {
                tracing::info!(%namespace, %name, "Weft NetworkPolicy rejected");
            }
            Ok(Action::requeue(ctx.resync))
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Action::await_change()),
        Err(source) => Err(Error::Status { namespace, name, source }),
    }
}

/// The `Accepted` condition to write, or None when `current` says the same
/// already (of this generation). Its transition time moves only when its
/// status flips.
pub fn accepted_condition(
    current: Option<&Condition>,
    accepted: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Option<Condition> {
    let want_status = if accepted { "True" } else { "False" };
    if current.is_some_and(|c| {
        c.status == want_status && c.reason == reason && c.message == message && c.observed_generation == generation
    }) {
        return None;
    }
    let since = match current {
        Some(c) if c.status == want_status => c.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    Some(Condition {
        type_: CONDITION_ACCEPTED.into(),
        status: want_status.into(),
        reason: reason.into(),
        message,
        last_transition_time: since,
        observed_generation: generation,
    })
}

fn error_policy(_p: Arc<NetworkPolicy>, error: &Error, _ctx: Arc<Ctx>) -> Action {
    tracing::warn!(%error, "NetworkPolicy reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Runs the controller until its watches end. `pods` is the operator's
/// shared Pod cache; `touched` names the namespace of each pod it took in,
/// which triggers that namespace's policies.
pub async fn run(
    client: Client,
    pods: Store<Pod>,
    touched: tokio::sync::mpsc::UnboundedReceiver<String>,
    metrics: Arc<Metrics>,
    term: Term,
    resync: Duration,
) {
    let policies_api: Api<NetworkPolicy> = Api::all(client.clone());
    let ctrl = Controller::new(policies_api, watcher::Config::default());
    let policies = ctrl.store();
    let by_namespace = policies.clone();
    let triggers = tokio_stream::wrappers::UnboundedReceiverStream::new(touched).flat_map(move |ns: String| {
        let refs: Vec<ObjectRef<NetworkPolicy>> = by_namespace
            .state()
            .iter()
            .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
            .map(|p| ObjectRef::from_obj(&**p))
            .collect();
        futures::stream::iter(refs)
    });
    let ctx = Arc::new(Ctx { client, pods, policies, metrics, term, resync });
    ctrl.reconcile_on(triggers)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "networkpolicy controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, app: &str, phase: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": ns, "labels": {"app": app}},
                "spec": {"containers": []},
                "status": {"phase": phase}
            }))
            .unwrap(),
        )
    }

    fn policy(spec: serde_json::Value) -> NetworkPolicy {
        serde_json::from_value(json!({"apiVersion": "weft.dev/v1alpha1", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": "prod"}, "spec": spec}))
        .unwrap()
    }

    #[test]
    fn status_counts_selected_pods_of_the_namespace_and_reports_problems() {
        let pods = [
            pod("prod", "a", "web", "Running"),
            pod("prod", "b", "web", "Pending"),
            pod("prod", "c", "web", "Succeeded"),
            pod("prod", "d", "db", "Running"),
            pod("dev", "e", "web", "Running"),
        ];
        let ok = policy(json!({"podSelector": {"matchLabels": {"app": "web"}}}));
        let (accepted, reason, message, selected) = desired_status(&ok, &pods);
        assert!(accepted);
        assert_eq!((reason, selected), ("Valid", 2));
        assert!(message.contains("2 selected pod(s)"), "{message}");
        let all = policy(json!({}));
        assert_eq!(desired_status(&all, &pods).3, 3, "an empty selector selects the namespace's live pods");

        let bad = policy(
            json!({"ingress": [{"action": "Deny", "peers": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.1.0.0/24"]}}]}]}),
        );
        let (accepted, reason, message, _) = desired_status(&bad, &pods);
        assert!(!accepted);
        assert_eq!(reason, "Invalid");
        assert_eq!(
            message,
            "rejected, not enforced: spec.ingress[0].peers[0].ipBlock.except[0]: 10.1.0.0/24 is not strictly inside cidr 10.0.0.0/16"
        );
    }

    mod mock_api {
        use super::*;
        use crate::mock_api::{expect, no_more_requests, ok, store};
        use http::Method;

        const STATUS: &str = "/apis/weft.dev/v1alpha1/namespaces/prod/networkpolicies/p/status";

        fn context(policies: Vec<NetworkPolicy>, pods: Vec<Arc<Pod>>) -> (Arc<Ctx>, crate::mock_api::Handle) {
            let (client, handle) = crate::mock_api::client();
            let ctx = Ctx {
                client,
                pods: store(pods.into_iter().map(|p| (*p).clone())),
                policies: store(policies),
                metrics: Arc::new(Metrics::new()),
                term: Term::always(),
                resync: Duration::from_secs(300),
            };
            (Arc::new(ctx), handle)
        }

        #[tokio::test]
        async fn the_status_is_written_once_and_then_left_alone() {
            let mut p = policy(json!({"podSelector": {"matchLabels": {"app": "web"}}}));
            p.metadata.generation = Some(3);
            let pods = vec![pod("prod", "a", "web", "Running"), pod("prod", "b", "db", "Running")];
            let (ctx, mut api) = context(vec![p.clone()], pods.clone());
            let pass = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
            let body = expect(&mut api, Method::PATCH, STATUS, ok(&p)).await;
            let status = &body["status"];
            assert_eq!(status["selectedPods"], 1, "{body}");
            assert_eq!(status["observedGeneration"], 3, "{body}");
            assert_eq!(status["conditions"][0]["status"], "True", "{body}");
            assert_eq!(pass.await.unwrap().unwrap(), Action::requeue(Duration::from_secs(300)));

            // The policy as written back: nothing more to say.
            let mut written = p.clone();
            written.status = serde_json::from_value(body["status"].clone()).ok();
            let (ctx, mut api) = context(vec![written.clone()], pods);
            reconcile(Arc::new(written), ctx).await.unwrap();
            assert!(no_more_requests(&mut api).await, "an unchanged status was written again");
        }

        #[tokio::test]
        async fn a_rejected_policy_says_why_in_its_condition() {
            let p = policy(
                json!({"ingress": [{"action": "Deny", "peers": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.1.0.0/24"]}}]}]}),
            );
            let (ctx, mut api) = context(vec![p.clone()], vec![]);
            let pass = tokio::spawn(reconcile(Arc::new(p.clone()), ctx.clone()));
            let body = expect(&mut api, Method::PATCH, STATUS, ok(&p)).await;
            let condition = &body["status"]["conditions"][0];
            assert_eq!((condition["status"].as_str(), condition["reason"].as_str()), (Some("False"), Some("Invalid")));
            assert!(condition["message"].as_str().is_some_and(|m| m.contains("not strictly inside")), "{body}");
            pass.await.unwrap().unwrap();
            let rejected =
                ctx.metrics.network_policies.get_or_create(&crate::metrics::StateLabel { state: "rejected" }).get();
            assert_eq!(rejected, 1);
        }
    }
}
