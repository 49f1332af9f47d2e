//! Kubernetes Events the agent records (where `kubectl describe` shows an
//! operator what went wrong), in the background: a failure to record one
//! is logged, never waited for.

use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, PostParams};
use serde_json::json;

/// The object an Event is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regarding {
    pub api_version: &'static str,
    pub kind: &'static str,
    /// Empty for cluster-scoped objects (their Events go to `default`).
    pub namespace: String,
    pub name: String,
    /// Empty when not known.
    pub uid: String,
}

impl Regarding {
    pub fn node(name: &str) -> Self {
        Regarding {
            api_version: "v1",
            kind: "Node",
            namespace: String::new(),
            name: name.to_owned(),
            uid: String::new(),
        }
    }

    fn event_namespace(&self) -> &str {
        if self.namespace.is_empty() { "default" } else { &self.namespace }
    }

    fn describe(&self) -> String {
        match self.namespace.as_str() {
            "" => format!("{} {}", self.kind, self.name),
            ns => format!("{} {ns}/{}", self.kind, self.name),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Normal,
    Warning,
}

/// The Event, as the API takes it (`node`: the reporting agent's node).
pub fn event(node: &str, regarding: &Regarding, kind: Kind, reason: &str, message: &str) -> serde_json::Value {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    json!({
        "metadata": {"generateName": format!("{}.", regarding.name), "namespace": regarding.event_namespace()},
        "involvedObject": {"apiVersion": regarding.api_version, "kind": regarding.kind, "name": regarding.name,
                           "namespace": (!regarding.namespace.is_empty()).then_some(&regarding.namespace),
                           "uid": (!regarding.uid.is_empty()).then_some(&regarding.uid)},
        "reason": reason,
        "message": message,
        "type": match kind { Kind::Normal => "Normal", Kind::Warning => "Warning" },
        "source": {"component": "weft-agent", "host": node},
        "reportingComponent": "weft.dev/weft-agent",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    })
}

/// Records an Event on `regarding`, in the background.
pub fn record(
    client: &kube::Client,
    node: &str,
    regarding: Regarding,
    kind: Kind,
    reason: &'static str,
    message: String,
) {
    if regarding.name.is_empty() {
        return;
    }
    let (client, event) = (client.clone(), event(node, &regarding, kind, reason, &message));
    tokio::spawn(async move {
        let result = match serde_json::from_value::<Event>(event) {
            Ok(ev) => Api::<Event>::namespaced(client, regarding.event_namespace())
                .create(&PostParams::default(), &ev)
                .await
                .map(|_| ()),
            Err(e) => {
                tracing::error!(error = %e, "malformed Event");
                Ok(())
            }
        };
        if let Err(e) = result {
            tracing::warn!(on = %regarding.describe(), reason, error = %e, "cannot record an Event");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_on_a_node_goes_to_default_and_names_no_namespace() {
        let ev = event("node-1", &Regarding::node("node-1"), Kind::Warning, "PolicyNotApplied", "why");
        let ev: Event = serde_json::from_value(ev).expect("an Event");
        assert_eq!(ev.metadata.namespace.as_deref(), Some("default"));
        assert_eq!(ev.involved_object.kind.as_deref(), Some("Node"));
        assert_eq!(ev.involved_object.namespace, None);
        assert_eq!(ev.involved_object.uid, None);
        assert_eq!(ev.type_.as_deref(), Some("Warning"));
        assert_eq!(ev.reporting_instance.as_deref(), Some("node-1"));
    }

    #[test]
    fn an_event_on_a_pod_stays_in_its_namespace() {
        let pod = Regarding {
            api_version: "v1",
            kind: "Pod",
            namespace: "team".into(),
            name: "web".into(),
            uid: "u-1".into(),
        };
        let ev: Event = serde_json::from_value(event("node-1", &pod, Kind::Normal, "R", "m")).expect("an Event");
        assert_eq!(ev.metadata.namespace.as_deref(), Some("team"));
        assert_eq!(ev.metadata.generate_name.as_deref(), Some("web."));
        assert_eq!(ev.involved_object.uid.as_deref(), Some("u-1"));
        assert_eq!(ev.type_.as_deref(), Some("Normal"));
    }
}
