//! The cluster's pods as a pass sees them: a persistent map by (namespace,
//! name), shared with the watch's cache. Taking a pass's snapshot, finding
//! what changed since the pass before, and dropping the snapshot it
//! replaces each touch only the parts of the map that differ, not every
//! pod: at 50,000 pods a copy as a `Vec` touched each one (its reference
//! count) three times per pass, milliseconds of cache misses on a loaded
//! node.

use std::sync::Arc;

use imbl::ordmap::DiffItem;
use weft_api::watch::{Key, Projected};

use super::model::PodInfo;

/// Pods by (namespace, name), in that order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pods(Projected<PodInfo>);

/// A pod as it was and as it is (None: absent).
pub type PodChange = (Option<Arc<PodInfo>>, Option<Arc<PodInfo>>);

fn key_of(pod: &PodInfo) -> Key {
    (pod.namespace.clone(), pod.name.clone())
}

impl Pods {
    /// The pods of a projection's map (kept by their namespace and name).
    pub fn from_map(map: Projected<PodInfo>) -> Self {
        Pods(map)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every pod, by namespace and name.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Arc<PodInfo>> + '_ {
        self.0.values()
    }

    /// The pods of namespace `ns`, by name.
    pub fn in_namespace<'p>(&'p self, ns: &str) -> impl Iterator<Item = &'p Arc<PodInfo>> + 'p {
        let ns = ns.to_owned();
        let start = (ns.clone(), String::new());
        self.0.range(start..).take_while(move |((n, _), _)| *n == ns).map(|(_, p)| p)
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<&Arc<PodInfo>> {
        self.0.get(&(namespace.to_owned(), name.to_owned()))
    }

    /// The pod `namespace/name` to change in this map only (the copies
    /// this one shares it with keep theirs).
    pub fn get_mut(&mut self, namespace: &str, name: &str) -> Option<&mut Arc<PodInfo>> {
        self.0.get_mut(&(namespace.to_owned(), name.to_owned()))
    }

    /// Adds `pod`, or replaces the one of its namespace and name.
    pub fn insert(&mut self, pod: Arc<PodInfo>) -> Option<Arc<PodInfo>> {
        self.0.insert(key_of(&pod), pod)
    }

    pub fn remove(&mut self, namespace: &str, name: &str) -> Option<Arc<PodInfo>> {
        self.0.remove(&(namespace.to_owned(), name.to_owned()))
    }

    /// Keeps the pods `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&PodInfo) -> bool) {
        let gone: Vec<Key> = self.0.iter().filter(|(_, p)| !keep(p)).map(|(k, _)| k.clone()).collect();
        for k in gone {
            self.0.remove(&k);
        }
    }

    /// The pods that differ from `self` in `new` (as they were, as they
    /// are), in key order. Parts of the maps they share are skipped
    /// unread; an equal pod in another object is no change.
    pub fn changes(&self, new: &Pods) -> Vec<PodChange> {
        self.0
            .diff(&new.0)
            .map(|d| match d {
                DiffItem::Add(_, is) => (None, Some(Arc::clone(is))),
                DiffItem::Update { old: (_, was), new: (_, is) } => (Some(Arc::clone(was)), Some(Arc::clone(is))),
                DiffItem::Remove(_, was) => (Some(Arc::clone(was)), None),
            })
            .collect()
    }
}

/// One node's pods with an address, followed from snapshot to snapshot by
/// what changed between them: only the first snapshot (or the first after
/// [`reset`](Self::reset)) is read in whole.
#[derive(Debug)]
pub struct LocalPods {
    node: String,
    /// The snapshot the last call followed, and its local pods in key order.
    last: Option<(Pods, Vec<Arc<PodInfo>>)>,
}

/// Whether `pod` is on `node` and has an address (it gets rules then).
fn is_local(pod: &PodInfo, node: &str) -> bool {
    pod.node == node && !pod.ips.is_empty()
}

impl LocalPods {
    pub fn new(node: &str) -> Self {
        LocalPods { node: node.to_owned(), last: None }
    }

    /// The next call reads every pod.
    pub fn reset(&mut self) {
        self.last = None;
    }

    /// This node's pods in `pods`, in key order, and what changed since
    /// the snapshot of the call before (None: there was none).
    pub fn follow(&mut self, pods: &Pods) -> (&[Arc<PodInfo>], Option<Vec<PodChange>>) {
        let (local, changed) = match self.last.take() {
            Some((last, before)) => {
                let changed = last.changes(pods);
                (local_after(&before, &changed, &self.node), Some(changed))
            }
            None => (pods.iter().filter(|p| is_local(p, &self.node)).cloned().collect(), None),
        };
        let (_, local) = self.last.insert((pods.clone(), local));
        (local, changed)
    }
}

/// This node's pods with an address after `changed`, from `before`, in
/// key order.
fn local_after(before: &[Arc<PodInfo>], changed: &[PodChange], node: &str) -> Vec<Arc<PodInfo>> {
    fn key(p: &Arc<PodInfo>) -> (&str, &str) {
        (&p.namespace, &p.name)
    }
    // By key: an unchanged pod may be held as an earlier, equal object.
    let gone: std::collections::HashSet<(&str, &str)> =
        changed.iter().filter_map(|(was, _)| was.as_ref().map(key)).collect();
    let mut local: Vec<Arc<PodInfo>> = before.iter().filter(|p| !gone.contains(&key(p))).cloned().collect();
    let came = changed.iter().filter_map(|(_, is)| is.as_ref()).filter(|p| is_local(p, node));
    local.extend(came.cloned());
    // In key order, as a pass that reads every pod lists them (those that
    // came are behind the others).
    if !local.is_sorted_by(|a, b| key(a) <= key(b)) {
        local.sort_by(|a, b| key(a).cmp(&key(b)));
    }
    local
}

impl FromIterator<Arc<PodInfo>> for Pods {
    /// A pod after another of the same namespace and name replaces it.
    fn from_iter<I: IntoIterator<Item = Arc<PodInfo>>>(pods: I) -> Self {
        Pods(pods.into_iter().map(|p| (key_of(&p), p)).collect())
    }
}

impl From<Vec<Arc<PodInfo>>> for Pods {
    fn from(pods: Vec<Arc<PodInfo>>) -> Self {
        pods.into_iter().collect()
    }
}

impl<'p> IntoIterator for &'p Pods {
    type Item = &'p Arc<PodInfo>;
    type IntoIter = imbl::ordmap::Values<'p, Key, Arc<PodInfo>, imbl::shared_ptr::DefaultSharedPtr>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::model::NamedPort;

    fn pod(ns: &str, name: &str, app: &str) -> Arc<PodInfo> {
        on(ns, name, app, "n")
    }

    fn on(ns: &str, name: &str, app: &str, node: &str) -> Arc<PodInfo> {
        Arc::new(PodInfo {
            namespace: ns.into(),
            name: name.into(),
            labels: [("app".to_owned(), app.to_owned())].into(),
            ips: vec!["10.0.0.1".parse().unwrap()],
            node: node.into(),
            ports: Vec::<NamedPort>::new(),
        })
    }

    fn names<'p>(pods: impl IntoIterator<Item = &'p Arc<PodInfo>>) -> Vec<String> {
        pods.into_iter().map(|p| p.key()).collect()
    }

    #[test]
    fn pods_are_kept_by_namespace_and_name() {
        let pods: Pods = vec![pod("b", "x", "1"), pod("a", "z", "1"), pod("a", "y", "1"), pod("a", "z", "2")].into();
        assert_eq!(names(&pods), ["a/y", "a/z", "b/x"]);
        assert_eq!(pods.get("a", "z").unwrap().labels["app"], "2", "the later of two with one name");
        assert_eq!(names(pods.in_namespace("a")), ["a/y", "a/z"]);
        assert_eq!(names(pods.in_namespace("b")), ["b/x"]);
        assert!(pods.in_namespace("aa").next().is_none());
    }

    #[test]
    fn changes_are_what_differs_and_a_copy_keeps_its_own() {
        let old: Pods = (0..1000).map(|i| pod("ns", &format!("p{i:04}"), "a")).collect();
        let mut new = old.clone();
        assert!(old.changes(&new).is_empty());
        Arc::make_mut(new.get_mut("ns", "p0500").unwrap()).labels.insert("app".into(), "b".into());
        new.remove("ns", "p0007");
        new.insert(pod("ns", "p0999x", "a"));
        // An equal pod in another object: no change.
        new.insert(pod("ns", "p0300", "a"));
        let changes: Vec<(Option<String>, Option<String>)> = old
            .changes(&new)
            .into_iter()
            .map(|(was, is)| {
                (was.map(|p| format!("{}={}", p.name, p.labels["app"])), is.map(|p| p.labels["app"].clone()))
            })
            .collect();
        assert_eq!(
            changes,
            [
                (Some("p0007=a".to_owned()), None),
                (Some("p0500=a".to_owned()), Some("b".to_owned())),
                (None, Some("a".to_owned()))
            ]
        );
        assert_eq!(old.get("ns", "p0500").unwrap().labels["app"], "a", "the copy before is untouched");
        assert_eq!(old.len(), 1000);
        assert_eq!(new.len(), 1000);
    }

    #[test]
    fn a_nodes_pods_are_followed_by_what_changed() {
        let mut local = LocalPods::new("me");
        let old: Pods = vec![on("n", "a", "x", "me"), on("n", "b", "x", "other"), on("n", "c", "x", "me")].into();
        let (pods, changed) = local.follow(&old);
        assert_eq!((names(pods), changed), (vec!["n/a".to_owned(), "n/c".to_owned()], None), "the first reads all");
        // b moves to this node, d comes elsewhere, c loses its address.
        let mut new = old.clone();
        new.insert(on("n", "b", "x", "me"));
        new.insert(on("n", "d", "x", "other"));
        Arc::make_mut(new.get_mut("n", "c").unwrap()).ips.clear();
        let (pods, changed) = local.follow(&new);
        assert_eq!(names(pods), ["n/a", "n/b"], "in key order");
        assert_eq!(changed.map(|c| c.len()), Some(3));
        // Every pod a new object with the same content (a relist): no
        // change, and the local pods are still the earlier objects.
        let relisted: Pods = new.iter().map(|p| Arc::new((**p).clone())).collect();
        let (pods, changed) = local.follow(&relisted);
        assert_eq!((names(pods), changed.map(|c| c.len())), (vec!["n/a".to_owned(), "n/b".to_owned()], Some(0)));
        // A change of one of them replaces it, not adds to it.
        let mut moved = relisted.clone();
        Arc::make_mut(moved.get_mut("n", "a").unwrap()).labels.insert("app".into(), "y".into());
        let (pods, _) = local.follow(&moved);
        assert_eq!(names(pods), ["n/a", "n/b"]);
        assert_eq!(pods[0].labels["app"], "y");
        local.reset();
        assert_eq!(local.follow(&moved).1, None, "after a reset every pod is read again");
    }
}
