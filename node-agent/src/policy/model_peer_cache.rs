//! What rules' peers resolved to, kept from one pass to the next.
//!
//! A peer set (the addresses a rule's peers match) and an egress rule's
//! named-port matches depend on the pods and namespaces only through what
//! each pod contributes to them: its addresses when a pod peer matches it,
//! its addresses and named ports when it is a destination. With 50,000 pods
//! resolving one spec reads thousands of them, and a pass after a single
//! pod's change would resolve every spec of the pods it recompiles again.
//! So the resolutions stay, keyed by the spec's value, and a change forgets
//! only those a changed pod contributes to differently as it is than as it
//! was (`forget_changed`). A relist or a resync starts them afresh (`clear`),
//! which also drops the specs of policies that are gone.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::{Match, Peer, PeerSpec, Peers, PodInNs, Proto, Seen, what_peers_see};

/// [`Peer`], owning what it refers to.
#[derive(Debug, Clone)]
enum OwnedPeer {
    Pods { ns: Option<LabelSelector>, pods: Option<LabelSelector> },
    Block { cidr: String, except: Vec<String> },
    Nodes(LabelSelector),
    Nothing,
}

impl OwnedPeer {
    fn of(peer: &Peer<'_>) -> Self {
        match peer {
            Peer::Pods { ns, pods } => OwnedPeer::Pods { ns: ns.cloned(), pods: pods.cloned() },
            Peer::Block { cidr, except } => OwnedPeer::Block { cidr: (*cidr).to_owned(), except: except.to_vec() },
            Peer::Nodes(sel) => OwnedPeer::Nodes((*sel).clone()),
            Peer::Nothing => OwnedPeer::Nothing,
        }
    }

    fn as_peer(&self) -> Peer<'_> {
        match self {
            OwnedPeer::Pods { ns, pods } => Peer::Pods { ns: ns.as_ref(), pods: pods.as_ref() },
            OwnedPeer::Block { cidr, except } => Peer::Block { cidr, except },
            OwnedPeer::Nodes(sel) => Peer::Nodes(sel),
            OwnedPeer::Nothing => Peer::Nothing,
        }
    }
}

/// One spec and what it resolved to.
#[derive(Debug)]
struct Entry {
    list: Vec<OwnedPeer>,
    own_ns: Option<String>,
    /// Its peer set, once resolved.
    set: Option<Peers>,
    /// Its egress matches for a named port, by protocol and name.
    named: Vec<((Proto, String), Vec<Match>)>,
}

impl Entry {
    fn spec(&self) -> PeerSpec<'_> {
        PeerSpec { list: self.list.iter().map(OwnedPeer::as_peer).collect(), own_ns: self.own_ns.as_deref() }
    }

    /// Whether it is `spec`'s entry (compared in place: every lookup asks).
    fn is_for(&self, spec: &PeerSpec<'_>) -> bool {
        self.own_ns.as_deref() == spec.own_ns
            && self.list.len() == spec.list.len()
            && self.list.iter().zip(&spec.list).all(|(mine, theirs)| mine.as_peer() == *theirs)
    }
}

/// Resolved peers by spec, across passes.
#[derive(Debug, Default)]
pub struct PeerCache {
    /// By the spec's hash; a bucket holds the specs that share it.
    entries: HashMap<u64, Vec<Entry>>,
}

/// What `spec` reads of `pod`, as peers and as destinations of a named
/// port (an absent pod: nothing).
fn sees<'p>(spec: &PeerSpec<'_>, pod: Option<PodInNs<'p>>) -> Seen<'p> {
    pod.map(|pod| what_peers_see(spec, true, pod)).unwrap_or_default()
}

fn hash_of(spec: &PeerSpec<'_>) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    spec.hash(&mut h);
    h.finish()
}

impl PeerCache {
    /// How many specs it holds.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.values().map(Vec::len).sum()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets everything: the next pass resolves every spec anew.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Forgets the specs that any of `changes` (a pod as it was and as it
    /// is, each with its namespace's labels then; None: absent)
    /// contributes to differently now. What a spec resolved to can change
    /// only through such a pod: the others are as they were.
    pub fn forget_changed(&mut self, changes: &[(Option<PodInNs<'_>>, Option<PodInNs<'_>>)]) {
        if changes.is_empty() {
            return;
        }
        self.entries.retain(|_, bucket| {
            bucket.retain(|entry| {
                let spec = entry.spec();
                changes.iter().all(|(was, is)| sees(&spec, *was) == sees(&spec, *is))
            });
            !bucket.is_empty()
        });
    }

    fn entry(&mut self, spec: &PeerSpec<'_>) -> &mut Entry {
        let bucket = self.entries.entry(hash_of(spec)).or_default();
        let at = match bucket.iter().position(|e| e.is_for(spec)) {
            Some(at) => at,
            None => {
                let list = spec.list.iter().map(OwnedPeer::of).collect();
                bucket.push(Entry { list, own_ns: spec.own_ns.map(str::to_owned), set: None, named: Vec::new() });
                bucket.len() - 1
            }
        };
        &mut bucket[at]
    }

    /// The peer set of `spec`, resolved by `resolve` when not known.
    pub(super) fn set(&mut self, spec: &PeerSpec<'_>, resolve: impl FnOnce() -> Peers) -> Peers {
        let entry = self.entry(spec);
        entry.set.get_or_insert_with(resolve).clone()
    }

    /// The egress matches of `spec` for the named port `name` of `proto`,
    /// resolved by `resolve` when not known.
    pub(super) fn named(
        &mut self,
        spec: &PeerSpec<'_>,
        proto: Proto,
        name: &str,
        resolve: impl FnOnce() -> Vec<Match>,
    ) -> Vec<Match> {
        let entry = self.entry(spec);
        if let Some((_, matches)) = entry.named.iter().find(|((p, n), _)| *p == proto && n == name) {
            return matches.clone();
        }
        let matches = resolve();
        entry.named.push(((proto, name.to_owned()), matches.clone()));
        matches
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::super::{NamedPort, PodInfo};
    use super::*;

    fn app(value: &str) -> LabelSelector {
        LabelSelector { match_labels: Some([("app".to_owned(), value.to_owned())].into()), ..Default::default() }
    }

    fn pod(namespace: &str, app: &str, ip: &str, port: u16) -> PodInfo {
        PodInfo {
            namespace: namespace.into(),
            name: "p".into(),
            labels: [("app".to_owned(), app.to_owned())].into(),
            ips: vec![ip.parse().unwrap()],
            node: "n".into(),
            ports: vec![NamedPort { name: "http".into(), port, proto: Proto::Tcp }],
        }
    }

    /// A cache holding `specs`, each with a peer set and a named port resolved.
    fn holding(specs: &[&PeerSpec<'_>]) -> PeerCache {
        let mut cache = PeerCache::default();
        for spec in specs {
            cache.set(spec, || Peers::Any);
            cache.named(spec, Proto::Tcp, "http", Vec::new);
        }
        cache
    }

    #[test]
    fn a_known_spec_is_resolved_once() {
        let web = app("web");
        let (a, b) = (PeerSpec::new(vec![Peer::Pods { ns: None, pods: Some(&web) }], "a"), app("web"));
        // An equal spec from another policy's objects is the same spec.
        let same = PeerSpec::new(vec![Peer::Pods { ns: None, pods: Some(&b) }], "a");
        let mut cache = holding(&[&a]);
        assert_eq!(cache.set(&same, || unreachable!("resolved again")), Peers::Any);
        assert!(cache.named(&same, Proto::Tcp, "http", || unreachable!("resolved again")).is_empty());
        // Another namespace, protocol or name is another resolution.
        let other_ns = PeerSpec::new(vec![Peer::Pods { ns: None, pods: Some(&b) }], "b");
        assert_eq!(cache.set(&other_ns, || Peers::Nets(Arc::from([]))), Peers::Nets(Arc::from([])));
        let mut resolved = false;
        cache.named(&a, Proto::Udp, "http", || {
            resolved = true;
            Vec::new()
        });
        assert!(resolved);
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn a_pod_change_forgets_only_the_specs_it_contributes_to_differently() {
        let (web, db) = (app("web"), app("db"));
        let web_peers = PeerSpec::new(vec![Peer::Pods { ns: None, pods: Some(&web) }], "a");
        let db_peers = PeerSpec::new(vec![Peer::Pods { ns: None, pods: Some(&db) }], "a");
        // No peers: every pod is a destination of a named port.
        let anyone = PeerSpec::new(Vec::new(), "a");
        let block = PeerSpec::new(vec![Peer::Block { cidr: "10.0.0.0/8", except: &[] }], "a");
        let labels = BTreeMap::new();
        let in_ns = |p| Some((p, &labels));
        let still = |cache: &PeerCache, spec: &PeerSpec<'_>| cache.entries.values().flatten().any(|e| e.is_for(spec));
        let all = [&web_peers, &db_peers, &anyone, &block];

        // Relabelled from web to api: the web peers lose it; the others
        // read its address and port only, and those are as they were.
        let (was, is) = (pod("a", "web", "10.0.0.1", 80), pod("a", "api", "10.0.0.1", 80));
        let mut cache = holding(&all);
        cache.forget_changed(&[(in_ns(&was), in_ns(&is))]);
        assert!(!still(&cache, &web_peers));
        assert!(still(&cache, &db_peers) && still(&cache, &anyone) && still(&cache, &block));

        // Its named port renumbered: every spec it is a destination of.
        let is = pod("a", "web", "10.0.0.1", 8080);
        let mut cache = holding(&all);
        cache.forget_changed(&[(in_ns(&was), in_ns(&is))]);
        assert!(!still(&cache, &web_peers) && !still(&cache, &anyone) && !still(&cache, &block));
        assert!(still(&cache, &db_peers));

        // A new db pod of another namespace: no own-namespace peer of "a" matches it.
        let elsewhere = pod("b", "db", "10.0.0.2", 80);
        let mut cache = holding(&all);
        cache.forget_changed(&[(None, in_ns(&elsewhere))]);
        assert!(still(&cache, &web_peers) && still(&cache, &db_peers) && !still(&cache, &anyone));

        // A pod gone.
        let mut cache = holding(&all);
        cache.forget_changed(&[(in_ns(&was), None)]);
        assert!(!still(&cache, &web_peers) && still(&cache, &db_peers));
    }
}
