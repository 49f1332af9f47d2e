//! Tells operators, where they look, when this node cannot apply network
//! policy: a `PolicyApplied` condition on the node's Subnet (`kubectl get
//! subnets -o wide`, `kubectl describe subnet`) and an Event on the Node
//! when policy stops being applied and when it is applied again; a Warning
//! Event on each standard policy refused for this node's bound.
//! Meanwhile the rules last applied stay in force and new pods wait at ADD
//! (`sync`); `/readyz` says the same.

use std::time::Duration;

use kube::Client;
use kube::api::Api;
use tokio::sync::watch;
use weft_api::subnet::Subnet;

use super::limits;
use crate::events::{self, Kind, Regarding};
use crate::lease::{Condition, publish_condition};

pub const CONDITION_POLICY: &str = "PolicyApplied";
/// A manager of its own: its apply leaves the other conditions alone.
const FIELD_MANAGER: &str = "weft-agent-policy";
/// Between tries to write the condition when the API refuses it.
const RETRY: Duration = Duration::from_secs(5);

/// The condition that says `failure` (None: nothing failed).
pub fn condition(failure: Option<&str>) -> Condition {
    match failure {
        None => Condition {
            kind: CONDITION_POLICY,
            ok: true,
            reason: "Applied",
            message: "every policy pass on this node reached the kernel".to_owned(),
        },
        Some(why) => Condition {
            kind: CONDITION_POLICY,
            ok: false,
            reason: "NotApplied",
            message: format!(
                "network policy changes are not applied on this node (the rules last applied stay in force, new pods wait at ADD): {why}"
            ),
        },
    }
}

/// The Event for going from failing or not (`was_failing`) to `failure`:
/// one when policy stops being applied and one when it is again.
pub fn event(was_failing: bool, failure: Option<&str>) -> Option<(Kind, &'static str, String)> {
    match (was_failing, failure) {
        (false, Some(why)) => Some((
            Kind::Warning,
            "PolicyNotApplied",
            format!("Weft cannot apply network policy on this node; the rules last applied stay in force: {why}"),
        )),
        (true, None) => {
            Some((Kind::Normal, "PolicyApplied", "Weft applies network policy on this node again".to_owned()))
        }
        _ => None,
    }
}

/// Runs for the agent's lifetime, reporting each change of `failure`.
pub async fn run(api: Api<Subnet>, node: String, mut failure: watch::Receiver<Option<String>>) {
    let client = api.clone().into_client();
    let (mut published, mut failing) = (None::<Condition>, false);
    loop {
        let now = failure.borrow_and_update().clone();
        if let Some((kind, reason, message)) = event(failing, now.as_deref()) {
            events::record(&client, &node, Regarding::node(&node), kind, reason, message);
        }
        failing = now.is_some();
        let want = condition(now.as_deref());
        let mut retry = false;
        if published.as_ref() != Some(&want) {
            match publish_condition(&api, &node, FIELD_MANAGER, &want).await {
                Ok(()) => published = Some(want),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot publish the {CONDITION_POLICY} condition; retrying");
                    retry = true;
                }
            }
        }
        if !retry {
            if failure.changed().await.is_err() {
                return;
            }
            continue;
        }
        tokio::select! {
            changed = failure.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(RETRY) => {}
        }
    }
}

/// Logs and puts a Warning Event on each standard policy newly refused
/// for this node's bound (`was`: those refused the pass before).
pub fn node_refusals(client: &Client, node: &str, now: &[limits::NodeRefusal], was: &[limits::NodeRefusal]) {
    let key = |r: &limits::NodeRefusal| (r.namespace.clone(), r.name.clone(), r.uid.clone());
    let was: std::collections::HashSet<_> = was.iter().map(key).collect();
    for r in now.iter().filter(|r| !was.contains(&key(r))) {
        let message = limits::node_refusal_message(r, node);
        tracing::error!(policy = %format!("{}/{}", r.namespace, r.name), "{message}");
        let regarding = Regarding {
            api_version: "networking.k8s.io/v1",
            kind: "NetworkPolicy",
            namespace: r.namespace.clone(),
            name: r.name.clone(),
            uid: r.uid.clone(),
        };
        events::record(client, node, regarding, Kind::Warning, "PolicyRefused", message);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_a_false_condition_that_says_why_and_what_stays() {
        let c = condition(Some("nft: No buffer space available"));
        assert!(!c.ok && c.reason == "NotApplied" && c.kind == CONDITION_POLICY);
        assert!(
            c.message.contains("No buffer space") && c.message.contains("last applied stay in force"),
            "{}",
            c.message
        );
        assert!(condition(None).ok);
    }

    #[test]
    fn events_mark_the_start_and_the_end_of_a_failure_only() {
        assert_eq!(event(false, None), None);
        let (kind, reason, message) = event(false, Some("why")).expect("a failure starts");
        assert_eq!((kind, reason), (Kind::Warning, "PolicyNotApplied"));
        assert!(message.contains("why"));
        // A failure that goes on (perhaps with another message) is not news.
        assert_eq!(event(true, Some("other")), None);
        assert_eq!(event(true, None).map(|e| (e.0, e.1)), Some((Kind::Normal, "PolicyApplied")));
    }
}
