//! The newest version of each object known to this replica beyond its
//! cache: what a controller's own watch of the kind saw (the cache is a
//! different watch and may lag behind the event that triggered a
//! reconcile), and what this replica wrote (the API's answer). A reconcile
//! so works from the cache, or from its own write, and reads the object
//! from the API only when the watch saw something newer than both. For
//! Subnets in the node reconciler and Nodes in the Subnet reconciler: a
//! burst of joining nodes triggers each reconciler several times per node
//! (the Subnet created, its status written, kubelet's updates of the Node),
//! and a quorum read on each was most of the operator's requests, while a
//! stale Subnet without the `Allocated` condition made it write that again.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

/// How long a sighting the cache has not caught up with is kept when the
/// table is large: the reconcile it triggered runs long before.
const KEEP: Duration = Duration::from_secs(300);
/// Above this many entries, old sightings are pruned on insert.
const PRUNE_ABOVE: usize = 1024;

/// Per name (of a cluster-scoped kind), the newest version seen or written
/// that the cache did not hold yet. Deleted objects included: a watch's
/// delete event carries the resourceVersion of the deletion.
pub struct Sightings<K>(Mutex<HashMap<String, Sighting<K>>>);

struct Sighting<K> {
    version: u64,
    /// This replica's write of exactly `version`, when it made it.
    written: Option<K>,
    at: Instant,
}

/// Where a reconcile gets its copy of an object from.
#[derive(Debug)]
pub enum Freshest<K> {
    /// The cache's copy (or its absence) is as new as anything known.
    Cache,
    /// This replica's own write is newer than the cache's copy.
    Written(Box<K>),
    /// The watch saw a version newer than both: read it from the API.
    Read,
}

impl<K> Default for Sightings<K> {
    fn default() -> Self {
        Sightings(Mutex::default())
    }
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Sightings<K> {
    // Plain data; a panic elsewhere cannot leave it torn.
    fn table(&self) -> MutexGuard<'_, HashMap<String, Sighting<K>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Called for every event of the trigger watch, before the reconcile it
    /// triggers: notes `seen` unless `cache` already holds it or newer.
    pub fn saw(&self, seen: &K, cache: &Store<K>) {
        // An unparseable version is treated as newer than anything cached.
        let version = version(seen).unwrap_or(u64::MAX);
        self.note(seen, version, None, cache);
    }

    /// Notes this replica's write (the API's answer to it).
    pub fn wrote(&self, written: &K, cache: &Store<K>) {
        if let Some(version) = version(written) {
            self.note(written, version, Some(written.clone()), cache);
        }
    }

    fn note(&self, object: &K, version: u64, written: Option<K>, cache: &Store<K>) {
        let name = object.name_any();
        let cached = cache.get(&ObjectRef::new(&name));
        let mut table = self.table();
        if cached.is_some_and(|c| !lags(Some(version), self::version(c.as_ref()))) {
            table.remove(&name);
            return;
        }
        if table.len() > PRUNE_ABOVE {
            table.retain(|_, s| s.at.elapsed() < KEEP);
        }
        let at = Instant::now();
        match table.get_mut(&name) {
            Some(s) if s.version > version => s.at = at,
            // The watch's event of this replica's own write keeps the copy.
            Some(s) if s.version == version && written.is_none() => s.at = at,
            _ => {
                table.insert(name, Sighting { version, written, at });
            }
        }
    }

    /// Where the newest copy of object `name` is, given the cache's.
    /// Forgets what the cache has caught up with.
    pub fn freshest(&self, name: &str, cached: Option<&K>) -> Freshest<K> {
        let mut table = self.table();
        let Some(sighting) = table.get(name) else {
            return match cached {
                Some(c) if version(c).is_none() => Freshest::Read,
                _ => Freshest::Cache,
            };
        };
        if let Some(c) = cached
            && !lags(Some(sighting.version), version(c))
        {
            table.remove(name);
            return Freshest::Cache;
        }
        match &sighting.written {
            Some(w) => Freshest::Written(Box::new(w.clone())),
            // Also when the cache shows nothing: the sighting may be of a
            // creation it has not seen, or of a deletion it has applied.
            None => Freshest::Read,
        }
    }
}

fn version(object: &impl Resource) -> Option<u64> {
    object.meta().resource_version.as_deref().and_then(|v| v.parse().ok())
}

/// Whether a cached copy of version `cached` (`None`: not a number) is
/// older than the sighting `seen` (`None`: nothing seen the cache lacked).
/// Pure. A copy whose version cannot be compared is distrusted.
fn lags(seen: Option<u64>, cached: Option<u64>) -> bool {
    match (seen, cached) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(s), Some(c)) => s > c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock_api::store as cache;
    use k8s_openapi::api::core::v1::Node;
    use weft_api::Subnet;

    fn subnet(name: &str, rv: &str) -> Subnet {
        crate::mock_api::subnet_at(name, "10.0.0.0/24", rv)
    }

    /// What `freshest` answered: where from, and the written copy's version.
    fn from<K: Resource>(f: Freshest<K>) -> String {
        match f {
            Freshest::Cache => "cache".into(),
            Freshest::Read => "read".into(),
            Freshest::Written(s) => format!("written {}", s.resource_version().unwrap_or_default()),
        }
    }

    #[test]
    fn versions_compare_as_numbers_and_odd_ones_are_distrusted() {
        assert!(!lags(None, Some(5)), "nothing seen: the cache is trusted");
        assert!(!lags(Some(5), Some(5)));
        assert!(!lags(Some(5), Some(9)), "the cache is ahead");
        assert!(lags(Some(10), Some(9)), "as numbers, not strings");
        assert!(lags(None, None), "an unparseable cached version");
        let sightings = Sightings::<Subnet>::default();
        assert_eq!(from(sightings.freshest("n1", Some(&subnet("n1", "x")))), "read");
        assert_eq!(from(sightings.freshest("n1", None)), "cache");
    }

    #[test]
    fn an_event_the_cache_lacks_makes_it_read_until_the_cache_catches_up() {
        let sightings = Sightings::default();
        let old = subnet("n1", "100");
        let stale = cache([old.clone()]);
        // The trigger watch saw the deletion (its version) first.
        sightings.saw(&subnet("n1", "120"), &stale);
        assert_eq!(from(sightings.freshest("n1", Some(&old))), "read", "the cache still holds the deleted Subnet");
        assert_eq!(from(sightings.freshest("n1", Some(&old))), "read", "until it catches up");
        assert_eq!(from(sightings.freshest("n1", None)), "read", "gone from the cache, or not there yet?");
        assert_eq!(from(sightings.freshest("n1", Some(&subnet("n1", "120")))), "cache");
        assert!(sightings.table().is_empty(), "forgotten once caught up");
        assert_eq!(from(sightings.freshest("n1", Some(&old))), "cache", "a later reconcile trusts the cache again");
    }

    #[test]
    fn events_the_cache_already_holds_are_not_kept() {
        let sightings = Sightings::default();
        let current = subnet("n1", "100");
        let fresh = cache([current.clone()]);
        sightings.saw(&subnet("n1", "100"), &fresh);
        sightings.saw(&subnet("n1", "90"), &fresh);
        sightings.wrote(&subnet("n1", "100"), &fresh);
        assert!(sightings.table().is_empty());
        assert_eq!(from(sightings.freshest("n1", Some(&current))), "cache");
        // An odd version from the watch is taken as newer than the cache.
        sightings.saw(&subnet("n1", "x"), &fresh);
        assert_eq!(from(sightings.freshest("n1", Some(&current))), "read");
    }

    #[test]
    fn this_replica_s_write_is_used_until_the_cache_or_a_newer_event_passes_it() {
        let sightings = Sightings::default();
        let empty = cache([]);
        let created = subnet("n1", "100");
        let allocated = subnet("n1", "101");
        sightings.wrote(&created, &empty);
        sightings.wrote(&allocated, &empty);
        // The watch's events of both writes arrive after them.
        sightings.saw(&created, &empty);
        sightings.saw(&allocated, &empty);
        assert_eq!(from(sightings.freshest("n1", None)), "written 101", "the cache shows nothing yet");
        assert_eq!(from(sightings.freshest("n1", Some(&created))), "written 101", "the cache shows the create only");
        // Someone else's change, seen by the watch: read it.
        sightings.saw(&subnet("n1", "105"), &empty);
        assert_eq!(from(sightings.freshest("n1", Some(&created))), "read");
        assert_eq!(from(sightings.freshest("n1", Some(&subnet("n1", "105")))), "cache");
    }

    #[test]
    fn a_deleted_node_the_cache_still_shows_is_read() {
        let node = |rv: &str| -> Node {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "n1", "resourceVersion": rv}}))
                .expect("node")
        };
        let sightings = Sightings::<Node>::default();
        let stale = cache([node("7")]);
        assert_eq!(from(sightings.freshest("n1", Some(&node("7")))), "cache");
        sightings.saw(&node("9"), &stale);
        assert_eq!(from(sightings.freshest("n1", Some(&node("7")))), "read");
        let created_meanwhile = cache([]);
        sightings.saw(&node("11"), &created_meanwhile);
        assert_eq!(from(sightings.freshest("n1", None)), "read", "the cache has not seen the node yet");
    }

    #[test]
    fn a_later_older_event_does_not_lower_the_sighting() {
        let sightings = Sightings::default();
        let empty = cache([]);
        sightings.saw(&subnet("n1", "130"), &empty);
        sightings.saw(&subnet("n1", "120"), &empty);
        sightings.wrote(&subnet("n1", "125"), &empty);
        assert_eq!(from(sightings.freshest("n1", Some(&subnet("n1", "125")))), "read");
        assert_eq!(from(sightings.freshest("n1", Some(&subnet("n1", "130")))), "cache");
    }
}
