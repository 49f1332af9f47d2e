//! The one watch → store → "something changed" helper the agent and the
//! operator use for every cache they keep of the API.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use futures::StreamExt;
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
