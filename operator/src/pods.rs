//! The operator's one Pod cache, shared by the host port and policy
//! controllers, and what it keeps of each Pod: only what they read
//! (identity, labels, the host port addresses annotation, host networking,
//! phase). A cluster's Pod objects are mostly container specs and statuses;
//! keeping them whole would make the operator's memory grow with everything
//! pods carry.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::Notify;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use weft_api::host_port::ADDRESSES_ANNOTATION;

/// The shared cache and how its users hear of changes.
pub struct Cache {
    pub store: Store<Pod>,
    /// Notified after each change (the host port pass runs over all pods).
    pub changed: Arc<Notify>,
    /// The namespace of each pod taken in (the policies of that namespace
    /// count their pods again).
    pub touched: UnboundedReceiver<String>,
}

/// Starts the one cluster-wide Pod watch.
pub fn cache(client: Client) -> Cache {
    let changed = Arc::new(Notify::new());
    let (tx, touched) = unbounded_channel();
    let notify = changed.clone();
    let store = weft_api::watch::reflect_with(Api::all(client), watcher::Config::default(), "Pod", trim, move |pod| {
        notify.notify_one();
        if let Some(ns) = pod.and_then(|p| p.metadata.namespace.clone()) {
            // The receiver lives as long as the policy controller.
            let _ = tx.send(ns);
        }
    });
    Cache { store, changed, touched }
}

/// Reduces a Pod to what the operator reads (before it is cached).
pub fn trim(pod: &mut Pod) {
    let meta = &mut pod.metadata;
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|k, _| k == ADDRESSES_ANNOTATION);
    }
    let host_network = pod.spec.as_ref().and_then(|s| s.host_network);
    pod.spec = Some(PodSpec { host_network, ..PodSpec::default() });
    let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
    pod.status = Some(PodStatus { phase, ..PodStatus::default() });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_what_the_controllers_read_and_nothing_else() {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop", "uid": "u1", "labels": {"app": "web"},
                "annotations": {ADDRESSES_ANNOTATION: "{}", "kubectl.kubernetes.io/last-applied-configuration": "x".repeat(1000)},
                "managedFields": [{"manager": "kubectl"}]},
            "spec": {"hostNetwork": true, "nodeName": "n1", "containers": [{"name": "c", "image": "nginx", "env": [{"name": "A", "value": "b"}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "containerStatuses": []},
        }))
        .expect("pod");
        trim(&mut pod);
        let json = serde_json::to_value(&pod).expect("json");
        assert_eq!(json["metadata"]["labels"]["app"], "web");
        assert_eq!(json["metadata"]["uid"], "u1");
        assert_eq!(json["metadata"]["annotations"].as_object().map(|a| a.len()), Some(1));
        assert!(json["metadata"].get("managedFields").is_none());
        assert_eq!(json["spec"]["hostNetwork"], true);
        assert_eq!(json["spec"]["containers"], serde_json::json!([]));
        assert_eq!(json["status"], serde_json::json!({"phase": "Running"}));
    }
}
