//! Standard (`networking.k8s.io/v1`) NetworkPolicies the agents refuse:
//! one whose rules compile to more than `weft_api::standard_policy::MAX_COST`
//! entries isolates the pods it selects and admits nothing (the agents fail
//! closed, see `weft_api::standard_policy`). The object has no status to say
//! so; this controller tells its owner with a Warning Event on it, once per
//! generation, and counts refused policies in a metric.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use weft_api::standard_policy::refusal;

use crate::leader::{NotLeader, Term};
use crate::metrics::Metrics;

const CONTROLLER: &str = "standard-networkpolicy";
/// The Event's reason (`kubectl get events --field-selector reason=…`).
pub const REASON: &str = "PolicyRefused";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reporting the refusal of NetworkPolicy {namespace}/{name}: {source}")]
    Event { namespace: String, name: String, source: kube::Error },
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
}

struct Ctx {
    policies: Store<NetworkPolicy>,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    term: Term,
    /// The generation each refused policy was last reported at (an Event
    /// published): a policy is reported again only when it changes (or the
    /// operator restarts). Its size is the refused-policy gauge.
    reported: Mutex<HashMap<ObjectRef<NetworkPolicy>, Option<i64>>>,
}

impl Ctx {
    fn reported(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectRef<NetworkPolicy>, Option<i64>>> {
        self.reported.lock().unwrap_or_else(|p| p.into_inner())
    }
}

async fn reconcile(policy: Arc<NetworkPolicy>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_inner(&policy, &ctx).await;
    ctx.metrics.observe(CONTROLLER, started.elapsed(), result.is_err());
    // The refused policies are those reported and still there (a deleted
    // one is not reconciled: it leaves the map here), without costing every
    // policy again on each reconcile.
    let refused = {
        let mut reported = ctx.reported();
        reported.retain(|key, _| ctx.policies.get(key).is_some());
        reported.len()
    };
    ctx.metrics.standard_policies_refused.set(i64::try_from(refused).unwrap_or(i64::MAX));
    result
}

async fn reconcile_inner(policy: &NetworkPolicy, ctx: &Ctx) -> Result<Action, Error> {
    let key = ObjectRef::from_obj(policy);
    let generation = policy.metadata.generation;
    let why = if policy.metadata.deletion_timestamp.is_some() { None } else { policy.spec.as_ref().and_then(refusal) };
    let Some(why) = why else {
        ctx.reported().remove(&key);
        return Ok(Action::await_change());
    };
    if ctx.reported().get(&key) == Some(&generation) {
        return Ok(Action::await_change());
    }
    ctx.term.check()?;
    let (namespace, name) = (policy.namespace().unwrap_or_default(), policy.name_any());
    tracing::warn!(%namespace, %name, "standard NetworkPolicy {why}");
    let event = Event {
        type_: EventType::Warning,
        reason: REASON.into(),
        note: Some(format!("Weft {why}")),
        action: "Enforce".into(),
        secondary: None,
    };
    ctx.recorder.publish(&event, &policy.object_ref(&())).await.map_err(|source| Error::Event {
        namespace,
        name,
        source,
    })?;
    ctx.reported().insert(key, generation);
    Ok(Action::await_change())
}

fn error_policy(_p: Arc<NetworkPolicy>, error: &Error, _ctx: Arc<Ctx>) -> Action {
    tracing::warn!(%error, "standard NetworkPolicy reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Runs the controller until its watch ends.
pub async fn run(client: Client, recorder: Recorder, metrics: Arc<Metrics>, term: Term) {
    let api: Api<NetworkPolicy> = Api::all(client);
    let ctrl = Controller::new(api, watcher::Config::default());
    let ctx = Arc::new(Ctx { policies: ctrl.store(), recorder, metrics, term, reported: Mutex::default() });
    ctrl.run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "standard networkpolicy controller event");
            }
        })
        .await;
}
