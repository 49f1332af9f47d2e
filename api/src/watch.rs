//! The one watch → store → "something changed" helper the agent and the
//! operator use for every cache they keep of the API.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use futures::StreamExt;
use imbl::ordmap::Entry;
use kube::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;

/// Keeps a store of what `config` selects from `api`, trimmed by `trim`
/// before it is stored (to keep only what is read). `changed` is notified
/// after the store took in each change, and after a watch error, which the
/// watch retries with backoff. The watch runs until the process ends.
pub fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    trim: fn(&mut K),
    changed: Option<Arc<Notify>>,
) -> Store<K>
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    reflect_with(api, config, what, trim, move |_| {
        if let Some(changed) = &changed {
            changed.notify_one();
        }
    })
}

/// [`reflect`], calling `on_change` after the store took in each change
/// (with the object, as trimmed) and after a watch error (with `None`).
pub fn reflect_with<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    trim: fn(&mut K),
    mut on_change: impl FnMut(Option<&K>) + Send + 'static,
) -> Store<K>
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (reader, writer) = reflector::store();
    let events = watcher(api, config).default_backoff().modify(trim).reflect(writer).touched_objects();
    tokio::spawn(async move {
        futures::pin_mut!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(object) => on_change(Some(&object)),
                Err(e) => {
                    tracing::warn!(error = %e, "{what} watch error; retrying");
                    on_change(None);
                }
            }
        }
    });
    reader
}

/// For [`reflect`] when the whole object is kept.
pub fn keep_all<K>(_: &mut K) {}

/// An object's (namespace, name); empty for a cluster-scoped object's namespace.
pub type Key = (String, String);

/// What [`project`] keeps of each object, by (namespace, name), in that
/// order. A persistent map: a copy ([`Projection::map`]) costs nothing and
/// shares all but what changes after it, so a reader of 50,000 objects
/// takes its copy without touching them and finds what changed since an
/// earlier copy by walking only the parts that differ.
pub type Projected<V> = imbl::OrdMap<Key, Arc<V>>;

/// What changed in a [`project`]ion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Changed {
    /// What is kept of this object.
    One(Key),
    /// Anything: a relist completed, or the watch failed (and is retried).
    All,
}

/// A read-only view of what [`project`] keeps.
#[derive(Clone)]
pub struct Projection<V> {
    current: Arc<std::sync::RwLock<Projected<V>>>,
    ready: tokio::sync::watch::Receiver<bool>,
}

/// The watch ended before its first complete listing.
#[derive(Debug, thiserror::Error)]
#[error("the watch ended before its first listing")]
pub struct NeverReady;

impl<V> Projection<V> {
    /// Everything kept, as it is now (a copy that shares the kept objects
    /// and the map's structure: O(1)).
    pub fn map(&self) -> Projected<V> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Everything kept, ordered by namespace and name.
    pub fn values(&self) -> Vec<Arc<V>> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    /// Everything kept with its key, ordered by namespace and name.
    pub fn entries(&self) -> Vec<(Key, Arc<V>)> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        current.iter().map(|(k, v)| (k.clone(), Arc::clone(v))).collect()
    }

    /// What is kept of the object `key`.
    pub fn get(&self, key: &Key) -> Option<Arc<V>> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }

    /// Waits for the first complete listing.
    pub async fn wait_until_ready(&self) -> Result<(), NeverReady> {
        self.ready.clone().wait_for(|r| *r).await.map(|_| ()).map_err(|_| NeverReady)
    }
}

/// Keeps what `take` says of each object `config` selects from `api` (None:
/// nothing, as if the object were not there), instead of the object: with
/// thousands of objects of which little is read, the cache stays a fraction
/// of a store's size. `changed` is notified after each change to what is
/// kept (an update that changes nothing kept is no change),
/// and after a watch error (retried with backoff). A relist replaces the
/// whole content at once when it completes. The watch runs until the
/// process ends.
pub fn project<K, V>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    take: impl Fn(&K) -> Option<V> + Send + 'static,
    changed: Arc<Notify>,
) -> Projection<V>
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    V: PartialEq + Send + Sync + 'static,
{
    project_with(api, config, what, take, move |_| changed.notify_one())
}

/// [`project`], calling `on_change` with what changed instead of notifying.
pub fn project_with<K, V>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    take: impl Fn(&K) -> Option<V> + Send + 'static,
    mut on_change: impl FnMut(Changed) + Send + 'static,
) -> Projection<V>
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    V: PartialEq + Send + Sync + 'static,
{
    let current: Arc<std::sync::RwLock<Projected<V>>> = Arc::default();
    let (ready_tx, ready) = tokio::sync::watch::channel(false);
    let writer = Arc::clone(&current);
    let events = watcher(api, config).default_backoff();
    tokio::spawn(async move {
        futures::pin_mut!(events);
        let mut relisting = Relisting::default();
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    tracing::warn!(error = %e, "{what} watch error; retrying");
                    on_change(Changed::All);
                    continue;
                }
            };
            let listed = matches!(event, watcher::Event::InitDone);
            let took = relisting.take_in(&writer, event, &take);
            if listed {
                ready_tx.send_replace(true);
            }
            if let Some(changed) = took {
                on_change(changed);
            }
        }
    });
    Projection { current, ready }
}

/// A relist in progress: its objects, swapped in whole when it completes.
struct Relisting<V>(Option<Projected<V>>);

impl<V> Default for Relisting<V> {
    fn default() -> Self {
        Relisting(None)
    }
}

impl<V: PartialEq> Relisting<V> {
    /// Takes `event` into `current`; what changed in it, if anything.
    fn take_in<K: kube::Resource>(
        &mut self,
        current: &std::sync::RwLock<Projected<V>>,
        event: watcher::Event<K>,
        take: &impl Fn(&K) -> Option<V>,
    ) -> Option<Changed> {
        let key = |o: &K| (o.meta().namespace.clone().unwrap_or_default(), o.meta().name.clone().unwrap_or_default());
        let write = || current.write().unwrap_or_else(|p| p.into_inner());
        match event {
            watcher::Event::Apply(o) => {
                let mut kept = write();
                let key = key(&o);
                let changed = match take(&o) {
                    Some(v) => match kept.entry(key.clone()) {
                        // Most updates (a pod's status, say) change nothing kept.
                        Entry::Occupied(e) if **e.get() == v => false,
                        Entry::Occupied(mut e) => {
                            e.insert(Arc::new(v));
                            true
                        }
                        Entry::Vacant(e) => {
                            e.insert(Arc::new(v));
                            true
                        }
                    },
                    None => kept.remove(&key).is_some(),
                };
                changed.then_some(Changed::One(key))
            }
            watcher::Event::Delete(o) => {
                let key = key(&o);
                write().remove(&key).is_some().then_some(Changed::One(key))
            }
            watcher::Event::Init => {
                self.0 = Some(Projected::new());
                None
            }
            watcher::Event::InitApply(o) => {
                if let (Some(list), Some(v)) = (self.0.as_mut(), take(&o)) {
                    list.insert(key(&o), Arc::new(v));
                }
                None
            }
            watcher::Event::InitDone => {
                *write() = self.0.take().unwrap_or_default();
                Some(Changed::All)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use watcher::Event;

    fn cm(name: &str, value: Option<&str>) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.namespace = Some("ns".into());
        cm.metadata.name = Some(name.into());
        cm.data = value.map(|v| [("v".to_owned(), v.to_owned())].into());
        cm
    }

    /// What the projection keeps of a ConfigMap: its value, if it has one.
    fn value(cm: &ConfigMap) -> Option<String> {
        cm.data.as_ref()?.get("v").cloned()
    }

    fn kept(current: &std::sync::RwLock<Projected<String>>) -> Vec<(String, String)> {
        current.read().unwrap().iter().map(|((_, n), v)| (n.clone(), (**v).clone())).collect()
    }

    #[test]
    fn a_projection_follows_changes_and_swaps_a_relist_in_whole() {
        let current = std::sync::RwLock::new(Projected::new());
        let mut relisting = Relisting::default();
        let mut feed = |e: Event<ConfigMap>| relisting.take_in(&current, e, &value);
        let one = |name: &str| Some(Changed::One(("ns".into(), name.into())));
        assert_eq!(feed(Event::Init), None);
        assert_eq!(feed(Event::InitApply(cm("a", Some("1")))), None);
        assert_eq!(feed(Event::InitApply(cm("skipped", None))), None);
        assert!(kept(&current).is_empty(), "nothing before the listing completes");
        assert_eq!(feed(Event::InitDone), Some(Changed::All));
        assert_eq!(kept(&current), [("a".into(), "1".into())]);
        assert_eq!(feed(Event::Apply(cm("b", Some("2")))), one("b"));
        assert_eq!(feed(Event::Apply(cm("a", Some("3")))), one("a"));
        assert_eq!(feed(Event::Apply(cm("a", Some("3")))), None, "nothing kept changed");
        assert_eq!(feed(Event::Apply(cm("gone", None))), None, "nothing was kept of it");
        assert_eq!(kept(&current), [("a".into(), "3".into()), ("b".into(), "2".into())]);
        // An object that no longer projects to anything is dropped.
        assert_eq!(feed(Event::Apply(cm("b", None))), one("b"));
        assert_eq!(feed(Event::Delete(cm("a", Some("3")))), one("a"));
        assert_eq!(feed(Event::Delete(cm("a", Some("3")))), None, "already gone");
        assert!(kept(&current).is_empty());
        // A relist: the old content stays until it completes, then only
        // what was listed is left.
        feed(Event::Apply(cm("old", Some("x"))));
        feed(Event::Init);
        feed(Event::InitApply(cm("new", Some("y"))));
        assert_eq!(kept(&current), [("old".into(), "x".into())]);
        feed(Event::InitDone);
        assert_eq!(kept(&current), [("new".into(), "y".into())]);
    }
}
