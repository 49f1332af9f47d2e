//! Pods this node's agent has attached, with the addresses their ADD gave
//! them, for the policy loop to use before the API reports them.
//!
//! The API learns a pod's address only after ADD has answered and kubelet
//! has written the pod's status; until then policy would not know the pod
//! and its first connections would be judged by no rule (and stay
//! established after). So ADD registers the pod here, the policy loop
//! compiles it with these addresses at once, and ADD answers only once a
//! pass that included the pod has been applied to the kernel.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{Notify, watch};

/// One attached pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The attachment that registered it (a DEL of an earlier sandbox of the
    /// same pod must not remove a later one's entry).
    pub container_id: String,
    pub ips: Vec<IpAddr>,
    /// Registration order: a pass covers the entries registered before it.
    seq: u64,
    /// A pass that included the pod has reached the kernel.
    applied: bool,
}

#[derive(Default)]
struct Inner {
    /// By `namespace/name`.
    pods: BTreeMap<String, Entry>,
    next_seq: u64,
}

/// What a pass took from the registry: the entries, and up to where.
#[derive(Clone, Debug, Default)]
pub struct Taken {
    pub pods: BTreeMap<String, Entry>,
    pub upto: u64,
}

#[derive(Debug, thiserror::Error)]
#[error(
    "the network policies for {pod} are not in place after {after:?} (the policy loop has not applied them: see the agent's log and weft_agent_policy_syncs_total)"
)]
pub struct NotApplied {
    pub pod: String,
    pub after: Duration,
}

pub struct Attached {
    inner: Mutex<Inner>,
    /// Wakes the policy loop.
    pub changed: std::sync::Arc<Notify>,
    /// Wakes the ADDs waiting for a pass.
    applied: Notify,
    /// Why the last pass could not apply its rules (None: it could).
    failure: watch::Sender<Option<String>>,
}

impl Default for Attached {
    fn default() -> Self {
        Attached::new(std::sync::Arc::default())
    }
}

impl Attached {
    pub fn new(changed: std::sync::Arc<Notify>) -> Self {
        Attached { inner: Mutex::default(), changed, applied: Notify::new(), failure: watch::Sender::new(None) }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers (or replaces) `pod`'s addresses and wakes the policy loop.
    pub fn admit(&self, pod: &str, container_id: &str, ips: Vec<IpAddr>) {
        let mut inner = self.inner();
        inner.next_seq += 1;
        let seq = inner.next_seq;
        let entry = Entry { container_id: container_id.to_owned(), ips, seq, applied: false };
        inner.pods.insert(pod.to_owned(), entry);
        drop(inner);
        self.changed.notify_one();
    }

    /// Forgets `pod` if `container_id` registered it (its DEL).
    pub fn forget(&self, pod: &str, container_id: &str) {
        let mut inner = self.inner();
        if inner.pods.get(pod).is_some_and(|e| e.container_id == container_id) {
            inner.pods.remove(pod);
        }
    }

    /// Waits until a pass that included `pod` was applied, at most `limit`.
    pub async fn wait_applied(&self, pod: &str, limit: Duration) -> Result<(), NotApplied> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.applied.notified();
            tokio::pin!(notified);
            // Registered as a waiter before looking, so no wake-up is missed.
            notified.as_mut().enable();
            match self.inner().pods.get(pod) {
                Some(e) if !e.applied => {}
                // Applied, or forgotten meanwhile (its DEL came): nothing to wait for.
                _ => return Ok(()),
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(NotApplied { pod: pod.to_owned(), after: limit });
            }
        }
    }

    /// Records whether the last pass reached the kernel (for /readyz and
    /// the node's `PolicyApplied` condition).
    pub fn set_failure(&self, failure: Option<String>) {
        self.failure.send_if_modified(|now| {
            let changed = *now != failure;
            *now = failure;
            changed
        });
    }

    /// Why policy is not applied now, if it is not.
    pub fn failure(&self) -> Option<String> {
        self.failure.borrow().clone()
    }

    /// Sees every change of [`failure`](Self::failure).
    pub fn watch_failure(&self) -> watch::Receiver<Option<String>> {
        self.failure.subscribe()
    }

    /// Whether an ADD waits for a pass (the loop then skips its debounce).
    pub fn pending(&self) -> bool {
        self.inner().pods.values().any(|e| !e.applied)
    }

    /// The entries for a pass.
    pub fn take(&self) -> Taken {
        let inner = self.inner();
        Taken { pods: inner.pods.clone(), upto: inner.next_seq }
    }

    /// A pass that took `taken` reached the kernel; `included` says which
    /// of its pods it found in the API (the others wait for a later pass).
    pub fn applied(&self, taken: &Taken, included: impl Fn(&str) -> bool) {
        let mut inner = self.inner();
        for (pod, e) in inner.pods.iter_mut() {
            if e.seq <= taken.upto && !e.applied && included(pod) {
                e.applied = true;
            }
        }
        drop(inner);
        self.applied.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Vec<IpAddr> {
        vec![s.parse().unwrap()]
    }

    #[tokio::test]
    async fn an_add_waits_for_a_pass_that_included_its_pod() {
        let a = std::sync::Arc::new(Attached::default());
        a.admit("prod/web", "c1", ip("10.244.1.5"));
        assert!(a.pending());
        let taken = a.take();
        // A pod registered after the pass took its snapshot is not covered.
        a.admit("prod/db", "c2", ip("10.244.1.6"));
        let waiter = {
            let a = std::sync::Arc::clone(&a);
            tokio::spawn(async move { a.wait_applied("prod/web", Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        // The API did not know prod/web yet: still waiting.
        a.applied(&taken, |_| false);
        assert!(!waiter.is_finished());
        a.applied(&taken, |_| true);
        waiter.await.unwrap().expect("applied");
        assert!(a.pending(), "prod/db came after the pass");
        let late = a.wait_applied("prod/db", Duration::from_millis(50)).await.unwrap_err();
        assert!(late.to_string().contains("prod/db are not in place"), "{late}");
        a.applied(&a.take(), |_| true);
        assert!(!a.pending());
    }

    #[tokio::test]
    async fn a_del_forgets_only_its_own_attachment() {
        let a = Attached::default();
        a.admit("prod/web", "c1", ip("10.244.1.5"));
        a.admit("prod/web", "c2", ip("10.244.1.7"));
        a.forget("prod/web", "c1");
        assert_eq!(a.take().pods["prod/web"].ips, ip("10.244.1.7"));
        a.forget("prod/web", "c2");
        assert!(a.take().pods.is_empty());
        a.wait_applied("prod/web", Duration::from_millis(10)).await.expect("nothing to wait for");
    }
}
