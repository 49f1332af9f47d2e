//! Incremental compile, pure: keeps the last snapshot and what each local
//! pod compiled to, and after a change recompiles only the local pods it
//! can affect. Those are the pods a changed policy selects (before or
//! after the change), the local pods that changed themselves, and the pods
//! selected by a policy whose rules resolve differently with a changed pod
//! as it is than as it was (its address, labels, named ports or namespace
//! labels). Everything else is reused as it was, and so is what the rules'
//! peers resolved to where no changed pod contributes to them differently
//! ([`PeerCache`]). A large change (a relist that really differs) and the
//! first pass compile everything. The result is always what [`compile`]
//! would give, which the property test holds it to.
//!
//! [`compile`]: super::model::compile

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::model::{Cluster, Compiler, PeerCache, PodInNs, PodInfo, PodPolicy, PolicyIndex, Reach, name_nodes};
use super::pods::{LocalPods, PodChange};

/// Beyond this many changed pods (counting every pod of a namespace whose
/// labels changed) a full compile is cheaper than finding what they affect.
const MAX_CHANGED_PODS: usize = 256;

/// What a pass compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    /// The local pods under policy, in the snapshot's order (shared with
    /// the next pass, which reuses what did not change).
    pub pods: Vec<Arc<PodPolicy>>,
    /// How many local pods were compiled anew (the others were reused).
    pub recompiled: usize,
    /// Whether everything was compiled (no reuse).
    pub full: bool,
    /// Whether `pods` may differ from the last pass's (always after a full
    /// compile); if not, neither do the rules.
    pub changed: bool,
}

/// The compile state of one node's pods across passes.
pub struct Incremental {
    /// This node's pods, followed from pass to pass.
    local: LocalPods,
    last: Option<Last>,
    /// What the rules' peers resolved to in the passes before.
    peers: PeerCache,
    /// The last pass's policies by namespace, reused while they are the same.
    index: Option<PolicyIndex>,
}

struct Last {
    /// The pass's own snapshot (shared, not copied).
    cluster: Arc<Cluster>,
    /// Every local pod with an address, by key: what it compiled to (None:
    /// no policy selects it).
    pods: HashMap<String, Option<Arc<PodPolicy>>>,
}

impl Incremental {
    pub fn new(node: &str) -> Self {
        Incremental { local: LocalPods::new(node), last: None, peers: PeerCache::default(), index: None }
    }

    /// Forgets the last pass: the next one compiles everything.
    pub fn reset(&mut self) {
        self.last = None;
        self.index = None;
    }

    /// This node's policy for `cluster`.
    pub fn compile(&mut self, cluster: &Arc<Cluster>) -> Compiled {
        let last = self.last.take();
        // After a pass only the pods that changed since are read (at 50,000
        // pods a walk that reads every one costs milliseconds of cache
        // misses); the first pass reads every pod.
        if last.is_none() {
            self.local.reset();
        }
        let (local, changed) = self.local.follow(&cluster.pods);
        let local = local.to_vec();
        let cluster = Arc::clone(cluster);
        let changes =
            last.as_ref().zip(changed.as_deref()).and_then(|(l, c)| Changes::between(&l.cluster, &cluster, c));
        let mut peers = std::mem::take(&mut self.peers);
        match &changes {
            Some(changes) => peers.forget_changed(&changes.versions),
            None => peers.clear(),
        }
        let index = PolicyIndex::reuse_for(self.index.take(), &cluster);
        let compiler = Compiler::with_index(&cluster, &index, peers);
        let stale = last
            .as_ref()
            .zip(changes)
            .map(|(last, changes)| stale_pods(&compiler, &last.cluster, &cluster, changes, &local));
        let mut before = match last {
            // Its cluster shares all but what changed with this one: dropped
            // here, it frees only that.
            Some(Last { pods, .. }) => pods,
            None => HashMap::new(),
        };
        let (mut pods, mut out) = (HashMap::with_capacity(local.len()), Vec::new());
        let (mut recompiled, mut changed) = (0, stale.is_none());
        for (i, pod) in local.iter().enumerate() {
            let key = pod.key();
            let policy = match (&stale, before.remove(&key)) {
                (Some(stale), Some(was)) if !stale[i] => was,
                (_, was) => {
                    recompiled += 1;
                    let policy = compiler.pod_policy(pod).map(Arc::new);
                    changed |= policy.as_deref() != was.flatten().as_deref();
                    policy
                }
            };
            out.extend(policy.clone());
            pods.insert(key, policy);
        }
        // A pod under policy that is no local pod any more.
        changed |= before.values().any(Option::is_some);
        self.peers = compiler.into_cache();
        self.index = Some(index);
        self.last = Some(Last { cluster, pods });
        Compiled { pods: out, recompiled, full: stale.is_none(), changed }
    }
}

/// The pods and namespaces that differ between two passes' clusters.
struct Changes<'c> {
    /// Each changed pod as it was and as it is (None: absent), each in its
    /// namespace's labels then; every pod of a relabelled namespace too.
    versions: Vec<(Option<PodInNs<'c>>, Option<PodInNs<'c>>)>,
    /// The changed pods as they are (a local one among them is recompiled).
    changed_now: Vec<&'c PodInfo>,
    /// The namespaces whose labels changed.
    relabelled: Vec<&'c str>,
}

/// Labels of a namespace that has none (or is gone).
static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

impl<'c> Changes<'c> {
    /// From `old` to `new`, whose pods differ by `changed`; None when so
    /// much changed that everything is recompiled.
    fn between(old: &'c Cluster, new: &'c Cluster, changed: &'c [PodChange]) -> Option<Self> {
        // A node relabelled or readdressed changes every rule with a node peer:
        // rare enough to recompile every pod.
        // (Nodes are compared only when a policy names them: most passes have none.)
        if (name_nodes(&old.cluster_policies) || name_nodes(&new.cluster_policies)) && old.nodes != new.nodes {
            return None;
        }
        let old_ns = |ns: &str| old.namespaces.get(ns).unwrap_or(&NO_LABELS);
        let new_ns = |ns: &str| new.namespaces.get(ns).unwrap_or(&NO_LABELS);
        let (mut versions, mut changed_now) = (Vec::new(), Vec::new());
        for (was, is) in changed {
            versions.push((
                was.as_ref().map(|p| (p.as_ref(), old_ns(&p.namespace))),
                is.as_ref().map(|p| (p.as_ref(), new_ns(&p.namespace))),
            ));
            changed_now.extend(is.as_deref());
        }
        // A namespace relabelled: its pods may be peers of other rules now, or no more.
        let mut relabelled: Vec<&str> = Vec::new();
        for ns in old.namespaces.keys().chain(new.namespaces.keys()) {
            if old_ns(ns) != new_ns(ns) && !relabelled.contains(&ns.as_str()) {
                relabelled.push(ns);
            }
        }
        for pod in relabelled.iter().flat_map(|ns| new.pods.in_namespace(ns)) {
            versions.push((Some((pod, old_ns(&pod.namespace))), Some((pod, new_ns(&pod.namespace)))));
        }
        (versions.len() <= MAX_CHANGED_PODS).then_some(Changes { versions, changed_now, relabelled })
    }
}

/// Which of `local` (the local pods of `new`) to recompile after
/// `changes` from `old` to `new`, by index.
fn stale_pods(
    compiler: &Compiler<'_>,
    old: &Cluster,
    new: &Cluster,
    changes: Changes<'_>,
    local: &[Arc<PodInfo>],
) -> Vec<bool> {
    let Changes { versions, changed_now, relabelled } = changes;
    let new_ns = |ns: &str| new.namespaces.get(ns).unwrap_or(&NO_LABELS);

    let mut reach: Vec<Reach<'_>> = Vec::new();
    // Compilation reads a policy's name, namespace and spec only: a status
    // or metadata update is no change.
    for (was, is) in changed_policies(&old.standard, &new.standard, |a, b| a.spec == b.spec) {
        reach.extend(was.and_then(|p| Reach::of_standard(p)));
        reach.extend(is.and_then(|p| Reach::of_standard(p)));
    }
    for (was, is) in changed_policies(&old.weft, &new.weft, |a, b| a.spec == b.spec) {
        reach.extend(was.and_then(|p| Reach::of_weft(p)));
        reach.extend(is.and_then(|p| Reach::of_weft(p)));
    }
    for (was, is) in changed_policies(&old.cluster_policies, &new.cluster_policies, |a, b| a.spec == b.spec) {
        reach.extend(was.map(|p| Reach::of_cluster(p)));
        reach.extend(is.map(|p| Reach::of_cluster(p)));
    }
    for (was, is) in versions {
        reach.extend(compiler.reach_of_rules_changed_by(was, is));
    }
    // ClusterNetworkPolicies select by namespace labels: a relabelled
    // namespace's pods may be selected now, or no more.
    let by_ns_labels = !old.cluster_policies.is_empty() || compiler.has_cluster_policies();

    local
        .iter()
        .map(|pod| {
            changed_now.iter().any(|c| c.namespace == pod.namespace && c.name == pod.name)
                || (by_ns_labels && relabelled.contains(&pod.namespace.as_str()))
                || reach.iter().any(|r| r.selects(pod, new_ns(&pod.namespace)))
        })
        .collect()
}

/// An object as it was and as it is (None: absent).
type Change<'c, V> = (Option<&'c Arc<V>>, Option<&'c Arc<V>>);

/// The policies that differ between `old` and `new` (as they were, as
/// they are; None: absent). The same object, or one `same` says is equal,
/// is no change.
fn changed_policies<'c, K: kube::Resource>(
    old: &'c [Arc<K>],
    new: &'c [Arc<K>],
    same: fn(&K, &K) -> bool,
) -> Vec<Change<'c, K>> {
    let key = |p: &'c Arc<K>| {
        let meta = p.meta();
        (meta.namespace.as_deref().unwrap_or_default(), meta.name.as_deref().unwrap_or_default())
    };
    let mut out = Vec::new();
    // The watch cache lists its objects in the same order until one comes
    // or goes: then they can be compared in place.
    if old.len() == new.len() {
        let in_place = old.iter().zip(new).all(|(a, b)| {
            if Arc::ptr_eq(a, b) {
                return true;
            }
            if key(a) != key(b) {
                return false;
            }
            if !same(a, b) {
                out.push((Some(a), Some(b)));
            }
            true
        });
        if in_place {
            return out;
        }
        out.clear();
    }
    let old: HashMap<_, _> = old.iter().map(|p| (key(p), p)).collect();
    let new: HashMap<_, _> = new.iter().map(|p| (key(p), p)).collect();
    for (k, is) in &new {
        match old.get(k) {
            Some(was) if Arc::ptr_eq(was, is) || same(was, is) => {}
            was => out.push((was.copied(), Some(*is))),
        }
    }
    out.extend(old.iter().filter(|(k, _)| !new.contains_key(*k)).map(|(_, was)| (Some(*was), None)));
    out
}

#[cfg(test)]
#[path = "incremental_tests.rs"]
mod tests;
