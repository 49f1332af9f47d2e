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
    let (reader, writer) = reflector::store();
    let events = watcher(api, config).default_backoff().modify(trim).reflect(writer).touched_objects();
    tokio::spawn(async move {
        futures::pin_mut!(events);
        while let Some(event) = events.next().await {
            if let Err(e) = event {
                tracing::warn!(error = %e, "{what} watch error; retrying");
            }
            if let Some(changed) = &changed {
                changed.notify_one();
            }
        }
    });
    reader
}

/// For [`reflect`] when the whole object is kept.
pub fn keep_all<K>(_: &mut K) {}
