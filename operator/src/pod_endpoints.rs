//! PodEndpoints (with `--publish-pod-endpoints`): one per pod that runs on
//! a node with an address, holding what policy reads of it, so that agents
//! watch these instead of every Pod. A Pod changes with each status update
//! of its kubelet; its endpoint is written only when what policy reads
//! changes, so most Pod events stop here instead of reaching every node.
//!
//! Level-triggered: a pass compares the two caches and writes the
//! difference ([`Publisher`], pure). A change of a pod's projection or of an
//! endpoint makes a pass over the pods that changed; the first listing, a
//! relist and the periodic resync make one over all of them.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, Resource};
use serde_json::json;
use weft_api::pod_endpoint::{FIELD_MANAGER, PodEndpoint, PodEndpointSpec};
use weft_api::watch::{self, Changed, Key, Projection};

use crate::leader::{NotLeader, Term};
use crate::metrics::{Metrics, OpLabel};

const CONTROLLER: &str = "podendpoints";
/// Writes in flight at once.
const CONCURRENCY: usize = 64;
/// How long one write may take before it counts as failed.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Changes that arrive together (a pod's labels and its address) are
/// published by one pass. Short: every label change through PodEndpoints
/// waits for it, and changes that come while a pass writes are taken by
/// the next pass anyway (1 ms, as the agent's debounce; it was 5).
const SETTLE: Duration = Duration::from_millis(1);

/// A pod as its endpoint should say it: the endpoint's owner and content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub namespace: String,
    pub name: String,
    /// The pod's UID (the endpoint's owner).
    pub uid: String,
    pub spec: PodEndpointSpec,
}

impl Entry {
    fn key(&self) -> Key {
        (self.namespace.clone(), self.name.clone())
    }
}

/// What is published of `pod`: None for pods without a node or address,
/// in the host network, or finished.
pub fn desired(pod: &Pod) -> Option<Entry> {
    let spec = PodEndpointSpec::of_pod(pod).filter(PodEndpointSpec::is_published)?;
    let meta = pod.meta();
    Some(Entry { namespace: meta.namespace.clone()?, name: meta.name.clone()?, uid: meta.uid.clone()?, spec })
}

/// What an endpoint says, its owner being the pod it names.
pub fn observed(endpoint: &PodEndpoint) -> Option<Entry> {
    let meta = endpoint.meta();
    let owner = meta.owner_references.iter().flatten().find(|o| o.kind == "Pod" && o.api_version == "v1");
    Some(Entry {
        namespace: meta.namespace.clone()?,
        name: meta.name.clone()?,
        uid: owner.map(|o| o.uid.clone()).unwrap_or_default(),
        spec: endpoint.spec.clone(),
    })
}

/// A write the pass makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Create or update the endpoint of this pod.
    Apply(Arc<Entry>),
    /// Delete an endpoint whose pod is gone or no longer published.
    Delete(Key),
}

/// What this replica wrote that its endpoint watch has not shown yet, so
/// that a pass in between does not write it again.
#[derive(Default)]
pub struct Publisher {
    written: HashMap<Key, Written>,
}

/// A write whose result the watch has not shown yet.
#[derive(Debug)]
struct Written {
    /// What was written (None: deleted).
    target: Option<Arc<Entry>>,
    /// What the endpoint was when it was written. While the watch still
    /// shows this, the write is in flight; anything else (someone changed
    /// the endpoint after the write showed, in one batch of watch events)
    /// makes the pass look at it afresh.
    before: Option<Arc<Entry>>,
}

impl Publisher {
    /// The writes that make the endpoints (`observed`) what the pods say
    /// (`desired`); both ordered by namespace and name, as the caches give
    /// them. Writes this replica made that the watch does not show yet are
    /// not planned again; once the watch shows them they are forgotten.
    pub fn plan(&mut self, desired: &[Arc<Entry>], observed: &[Arc<Entry>]) -> Vec<Op> {
        let mut ops = Vec::new();
        let (mut d, mut o) = (desired.iter().peekable(), observed.iter().peekable());
        loop {
            let (want, have) = match (d.peek(), o.peek()) {
                (None, None) => break,
                (Some(w), Some(h)) => match (&w.namespace, &w.name).cmp(&(&h.namespace, &h.name)) {
                    std::cmp::Ordering::Less => (d.next(), None),
                    std::cmp::Ordering::Greater => (None, o.next()),
                    std::cmp::Ordering::Equal => (d.next(), o.next()),
                },
                (Some(_), None) => (d.next(), None),
                (None, Some(_)) => (None, o.next()),
            };
            ops.extend(self.plan_one(want, have));
        }
        ops
    }

    /// [`plan`](Self::plan) for the pods `keys` only: what the pods say
    /// (`desired`) and the endpoints (`observed`) are looked up by key.
    pub fn plan_keys(
        &mut self,
        keys: impl IntoIterator<Item = Key>,
        desired: impl Fn(&Key) -> Option<Arc<Entry>>,
        observed: impl Fn(&Key) -> Option<Arc<Entry>>,
    ) -> Vec<Op> {
        keys.into_iter().filter_map(|k| self.plan_one(desired(&k).as_ref(), observed(&k).as_ref())).collect()
    }

    /// The write for one pod, if any: `want` what its endpoint should be
    /// (None: no endpoint), `have` what it is.
    fn plan_one(&mut self, want: Option<&Arc<Entry>>, have: Option<&Arc<Entry>>) -> Option<Op> {
        let key = want.or(have)?.key();
        let still_before = |w: &Written| w.before.as_deref() == have.map(Arc::as_ref);
        if self.written.get(&key).is_some_and(|w| !still_before(w)) {
            self.written.remove(&key);
        }
        let settled = match (want, have) {
            (Some(w), Some(h)) => w == h,
            _ => false,
        };
        let target = want.cloned();
        if settled || self.written.get(&key).is_some_and(|w| w.target == target) {
            return None;
        }
        self.written.insert(key.clone(), Written { target, before: have.cloned() });
        Some(match want {
            Some(w) => Op::Apply(Arc::clone(w)),
            None => Op::Delete(key),
        })
    }

    /// A write failed: the next pass plans it again.
    pub fn failed(&mut self, key: &Key) {
        self.written.remove(key);
    }

    /// Forgets every write (the resync trusts only the caches).
    pub fn forget(&mut self) {
        self.written.clear();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing PodEndpoint {namespace}/{name}: {source}")]
    Write { namespace: String, name: String, source: kube::Error },
    #[error("writing PodEndpoint {namespace}/{name}: no answer within {WRITE_TIMEOUT:?}")]
    Timeout { namespace: String, name: String },
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
}

/// The pods whose endpoint a pass looks at.
#[derive(Default)]
struct Dirty {
    all: bool,
    keys: BTreeSet<Key>,
}

impl Dirty {
    fn mark(&mut self, changed: Changed) {
        match changed {
            Changed::One(key) => {
                if !self.all {
                    self.keys.insert(key);
                }
            }
            Changed::All => {
                self.all = true;
                self.keys.clear();
            }
        }
    }
}

/// Runs until the process ends.
pub async fn run(client: Client, metrics: Arc<Metrics>, resync: Duration, term: Term) {
    let changed = Arc::new(tokio::sync::Notify::new());
    let dirty = Arc::new(Mutex::new(Dirty { all: true, keys: BTreeSet::new() }));
    let on_change = || {
        let (dirty, changed) = (Arc::clone(&dirty), Arc::clone(&changed));
        move |c: Changed| {
            dirty.lock().unwrap_or_else(|p| p.into_inner()).mark(c);
            changed.notify_one();
        }
    };
    let pods: Projection<Entry> =
        watch::project_with(Api::<Pod>::all(client.clone()), watcher::Config::default(), "Pod", desired, on_change());
    let endpoints: Projection<Entry> = watch::project_with(
        Api::<PodEndpoint>::all(client.clone()),
        watcher::Config::default(),
        "PodEndpoint",
        observed,
        on_change(),
    );
    if pods.wait_until_ready().await.is_err() || endpoints.wait_until_ready().await.is_err() {
        tracing::error!("the PodEndpoint controller's caches were dropped before they were ready");
        return;
    }
    tracing::info!("publishing PodEndpoints");
    let mut publisher = Publisher::default();
    let mut last_resync = Instant::now();
    loop {
        let started = Instant::now();
        if last_resync.elapsed() >= resync {
            publisher.forget();
            dirty.lock().unwrap_or_else(|p| p.into_inner()).mark(Changed::All);
            last_resync = Instant::now();
        }
        let Dirty { all, keys } = std::mem::take(&mut *dirty.lock().unwrap_or_else(|p| p.into_inner()));
        let ops = if all {
            publisher.plan(&pods.values(), &endpoints.values())
        } else {
            publisher.plan_keys(keys, |k| pods.get(k), |k| endpoints.get(k))
        };
        let failed = write(&client, &term, &metrics, &mut publisher, ops).await;
        metrics.observe(CONTROLLER, started.elapsed(), !failed.is_empty());
        let wait =
            if failed.is_empty() { resync.saturating_sub(last_resync.elapsed()) } else { Duration::from_secs(1) };
        {
            let mut dirty = dirty.lock().unwrap_or_else(|p| p.into_inner());
            failed.into_iter().for_each(|k| dirty.mark(Changed::One(k)));
        }
        tokio::select! {
            _ = changed.notified() => tokio::time::sleep(SETTLE).await,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Makes `ops`, [`CONCURRENCY`] at a time; returns the pods whose write
/// failed (logged; the next pass plans them again).
async fn write(client: &Client, term: &Term, metrics: &Metrics, publisher: &mut Publisher, ops: Vec<Op>) -> Vec<Key> {
    let writes = futures::stream::iter(ops).map(|op| async move {
        let (key, label) = match &op {
            Op::Apply(e) => (e.key(), "apply"),
            Op::Delete(key) => (key.clone(), "delete"),
        };
        metrics.pod_endpoint_writes.get_or_create(&OpLabel { op: label }).inc();
        (write_one(client, term, op).await, key)
    });
    let results: Vec<_> = writes.buffer_unordered(CONCURRENCY).collect().await;
    let mut failed = Vec::new();
    for (result, key) in results {
        if let Err(error) = result {
            publisher.failed(&key);
            match error {
                Error::NotLeader(_) => tracing::debug!(%error, "PodEndpoint write skipped"),
                _ => tracing::warn!(%error, "PodEndpoint write failed; retrying"),
            }
            failed.push(key);
        }
    }
    failed
}

async fn write_one(client: &Client, term: &Term, op: Op) -> Result<(), Error> {
    term.check()?;
    let (namespace, name) = match &op {
        Op::Apply(e) => (e.namespace.clone(), e.name.clone()),
        Op::Delete((namespace, name)) => (namespace.clone(), name.clone()),
    };
    let api = Api::<PodEndpoint>::namespaced(client.clone(), &namespace);
    let call = async {
        match &op {
            Op::Apply(e) => {
                let body = apply_body(e);
                api.patch(&e.name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(body)).await.map(drop)
            }
            Op::Delete(_) => match api.delete(&name, &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                other => other.map(drop),
            },
        }
    };
    match tokio::time::timeout(WRITE_TIMEOUT, call).await {
        Err(_) => Err(Error::Timeout { namespace, name }),
        Ok(result) => result.map_err(|source| Error::Write { namespace, name, source }),
    }
}

/// The server-side apply of `e`'s endpoint, owned by its pod (the garbage
/// collector deletes it with the pod).
pub fn apply_body(e: &Entry) -> serde_json::Value {
    json!({
        "apiVersion": "weft.dev/v1alpha1",
        "kind": "PodEndpoint",
        "metadata": {
            "name": e.name,
            "namespace": e.namespace,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": e.name, "uid": e.uid}],
        },
        "spec": e.spec,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn entry(name: &str, uid: &str, ip: &str, app: &str) -> Arc<Entry> {
        Arc::new(Entry {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
            spec: PodEndpointSpec {
                node_name: "n1".into(),
                pod_ips: vec![ip.parse().unwrap()],
                labels: BTreeMap::from([("app".to_owned(), app.to_owned())]),
                ports: Vec::new(),
            },
        })
    }

    fn key(name: &str) -> Key {
        ("ns".into(), name.into())
    }

    #[test]
    fn a_pass_creates_updates_and_deletes_what_differs() {
        let (a, b, c) = (
            entry("a", "u1", "10.0.0.1", "web"),
            entry("b", "u2", "10.0.0.2", "db"),
            entry("c", "u3", "10.0.0.3", "x"),
        );
        let relabelled = entry("b", "u2", "10.0.0.2", "web");
        let recreated = entry("c", "u4", "10.0.0.3", "x");
        let gone = entry("d", "u5", "10.0.0.4", "y");
        let desired = [Arc::clone(&a), Arc::clone(&relabelled), Arc::clone(&recreated)];
        let observed = [a, b, c, gone];
        let ops = Publisher::default().plan(&desired, &observed);
        assert_eq!(
            ops,
            [Op::Apply(relabelled), Op::Apply(recreated), Op::Delete(key("d"))],
            "the same pod is no write; new labels and a new owner (the pod recreated) are; an endpoint without its pod goes"
        );
        let new = entry("n", "u6", "10.0.0.6", "z");
        assert_eq!(Publisher::default().plan(std::slice::from_ref(&new), &[]), [Op::Apply(new)]);
    }

    #[test]
    fn a_write_is_not_made_again_until_the_watch_shows_it_or_it_failed() {
        let mut p = Publisher::default();
        let old = entry("a", "u1", "10.0.0.1", "web");
        let new = entry("a", "u1", "10.0.0.1", "db");
        let observed = [Arc::clone(&old)];
        assert_eq!(p.plan(std::slice::from_ref(&new), &observed), [Op::Apply(Arc::clone(&new))]);
        assert!(p.plan(std::slice::from_ref(&new), &observed).is_empty(), "in flight: not written twice");
        p.failed(&key("a"));
        assert_eq!(p.plan(std::slice::from_ref(&new), &observed).len(), 1, "a failed write is made again");
        // The watch shows it: forgotten, so that a later change back is written.
        assert!(p.plan(std::slice::from_ref(&new), std::slice::from_ref(&new)).is_empty());
        assert!(p.written.is_empty());
        assert_eq!(p.plan(std::slice::from_ref(&old), std::slice::from_ref(&new)), [Op::Apply(Arc::clone(&old))]);
        // A delete in flight, then the pod back before the watch showed it.
        let mut p = Publisher::default();
        assert_eq!(p.plan(&[], std::slice::from_ref(&old)), [Op::Delete(key("a"))]);
        assert!(p.plan(&[], std::slice::from_ref(&old)).is_empty());
        assert_eq!(p.plan(std::slice::from_ref(&new), std::slice::from_ref(&old)), [Op::Apply(new)]);
        p.forget();
        assert!(p.written.is_empty());
    }

    #[test]
    fn an_endpoint_changed_by_hand_after_a_write_is_put_back_even_if_the_watch_skipped_the_write() {
        let mut p = Publisher::default();
        let old = entry("a", "u1", "10.0.0.1", "web");
        let new = entry("a", "u1", "10.0.0.1", "db");
        let forged = entry("a", "u1", "10.0.0.1", "forged");
        assert_eq!(p.plan(std::slice::from_ref(&new), std::slice::from_ref(&old)), [Op::Apply(Arc::clone(&new))]);
        // The pass runs only after both the write and a forgery arrived:
        // its cache shows the forgery, never the write.
        assert_eq!(
            p.plan(std::slice::from_ref(&new), std::slice::from_ref(&forged)),
            [Op::Apply(Arc::clone(&new))],
            "the endpoint is no longer what it was before the write: written again"
        );
        // Our delete not shown yet, and the endpoint changed meanwhile by
        // someone else: deleted again.
        let mut p = Publisher::default();
        assert_eq!(p.plan(&[], std::slice::from_ref(&old)), [Op::Delete(key("a"))]);
        assert_eq!(p.plan(&[], std::slice::from_ref(&forged)), [Op::Delete(key("a"))]);
    }

    #[test]
    fn a_pass_over_the_changed_pods_plans_what_a_full_pass_would_for_them() {
        let (a, b) = (entry("a", "u1", "10.0.0.1", "web"), entry("b", "u2", "10.0.0.2", "db"));
        let relabelled = entry("b", "u2", "10.0.0.2", "web");
        let desired = BTreeMap::from([(key("a"), Arc::clone(&a)), (key("b"), Arc::clone(&relabelled))]);
        let observed = BTreeMap::from([(key("b"), b), (key("gone"), entry("gone", "u9", "10.0.0.9", "x"))]);
        let keys = [key("a"), key("b"), key("gone"), key("never")];
        let ops = Publisher::default().plan_keys(keys, |k| desired.get(k).cloned(), |k| observed.get(k).cloned());
        assert_eq!(ops, [Op::Apply(a), Op::Apply(relabelled), Op::Delete(key("gone"))]);
        let d: Vec<_> = desired.values().cloned().collect();
        let o: Vec<_> = observed.values().cloned().collect();
        assert_eq!(Publisher::default().plan(&d, &o), ops, "the same as a full pass");
        let only_b =
            Publisher::default().plan_keys([key("b")], |k| desired.get(k).cloned(), |k| observed.get(k).cloned());
        assert_eq!(only_b.len(), 1, "pods not named are not looked at");
    }

    #[test]
    fn changes_mark_their_pods_until_a_relist_marks_all() {
        let mut dirty = Dirty::default();
        dirty.mark(Changed::One(key("a")));
        dirty.mark(Changed::One(key("a")));
        assert_eq!(dirty.keys.len(), 1);
        dirty.mark(Changed::All);
        dirty.mark(Changed::One(key("b")));
        assert!(dirty.all && dirty.keys.is_empty(), "a full pass covers every pod");
    }

    #[test]
    fn only_running_addressed_pods_are_published_and_owned_by_their_pod() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "prod", "uid": "u-1", "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": []},
            "status": {"podIPs": [{"ip": "10.0.0.5"}]}
        }))
        .unwrap();
        let e = desired(&pod).unwrap();
        assert_eq!((e.namespace.as_str(), e.name.as_str(), e.uid.as_str()), ("prod", "web", "u-1"));
        let body = apply_body(&e);
        let mut endpoint: PodEndpoint = serde_json::from_value(body).unwrap();
        endpoint.metadata.owner_references.as_mut().unwrap()[0].controller = None;
        assert_eq!(observed(&endpoint).as_ref(), Some(&e), "what is applied is read back as the same entry");
        let mut pending = pod.clone();
        pending.status = None;
        assert_eq!(desired(&pending), None, "no address: not published");
        let mut unowned = endpoint;
        unowned.metadata.owner_references = None;
        assert_ne!(observed(&unowned).as_ref(), Some(&e), "an endpoint without its owner is written again");
    }
}
