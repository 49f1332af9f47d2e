//! The pods of this node, as the API shows them: ADD reads a pod's host port
//! annotation and container ports here. A watch keeps a local copy (an ADD
//! usually finds its pod without a round trip); a pod not seen yet is read
//! directly.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

/// How long ADD waits for the API before giving up with "try again later".
const GET_TIMEOUT: Duration = Duration::from_secs(5);

pub struct PodCache {
    client: kube::Client,
    store: Store<Pod>,
}

#[derive(Debug, thiserror::Error)]
pub enum PodLookupError {
    #[error("cannot read pod {0} from the Kubernetes API: {1}")]
    Api(String, kube::Error),
    #[error("cannot read pod {0} from the Kubernetes API: no answer within {1:?}")]
    Timeout(String, Duration),
}

impl PodCache {
    /// Starts watching the pods scheduled to `node`.
    pub fn start(client: kube::Client, node: &str) -> Self {
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let store =
            weft_api::watch::reflect(Api::<Pod>::all(client.clone()), config, "Pod", weft_api::watch::keep_all, None);
        Self { client, store }
    }

    /// The labels of namespace `name` (read when a pod asks for automatic
    /// host ports, which its namespace must allow).
    pub async fn namespace_labels(
        &self,
        name: &str,
    ) -> Result<Option<std::collections::BTreeMap<String, String>>, PodLookupError> {
        let api = Api::<Namespace>::all(self.client.clone());
        let what = format!("namespace {name}");
        match tokio::time::timeout(GET_TIMEOUT, api.get_opt(name)).await {
            Err(_) => Err(PodLookupError::Timeout(what, GET_TIMEOUT)),
            Ok(Err(e)) => Err(PodLookupError::Api(what, e)),
            Ok(Ok(ns)) => Ok(ns.and_then(|n| n.metadata.labels)),
        }
    }

    /// The pod `namespace/name`; with `uid`, only that incarnation of it.
    pub async fn get(&self, namespace: &str, name: &str, uid: Option<&str>) -> Result<Option<Pod>, PodLookupError> {
        let matches = |p: &Pod| uid.is_none_or(|u| p.metadata.uid.as_deref() == Some(u));
        if let Some(p) = self.store.get(&ObjectRef::new(name).within(namespace)).filter(|p| matches(p)) {
            return Ok(Some((*p).clone()));
        }
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let what = format!("{namespace}/{name}");
        match tokio::time::timeout(GET_TIMEOUT, api.get_opt(name)).await {
            Err(_) => Err(PodLookupError::Timeout(what, GET_TIMEOUT)),
            Ok(Err(e)) => Err(PodLookupError::Api(what, e)),
            Ok(Ok(p)) => Ok(p.filter(matches)),
        }
    }
}
