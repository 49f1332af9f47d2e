//! The node's flow records: a ring of the newest `capacity` records (older
//! ones are pushed out and counted), and a feed of new ones for followers.
//! Records the sources could not read (the kernel dropped them) are counted
//! here too, so that nothing is lost without saying so.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;
use weft_proto::flows::v1::{Filter, Flow, Verdict};

/// Room for new records between two reads of a follower; one that falls
/// further behind is told how many it missed.
const FOLLOW_BUFFER: usize = 1024;

/// Counts of what was not kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Pushed out by newer records.
    pub evicted: u64,
    /// Never recorded: the kernel dropped the events.
    pub lost: u64,
}

pub struct Ring {
    capacity: usize,
    inner: Mutex<Inner>,
    feed: broadcast::Sender<Arc<Flow>>,
}

struct Inner {
    flows: VecDeque<Arc<Flow>>,
    next_seq: u64,
    counts: Counts,
}

impl Ring {
    /// A ring of `capacity` records (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let (feed, _) = broadcast::channel(FOLLOW_BUFFER);
        let inner = Inner { flows: VecDeque::with_capacity(capacity), next_seq: 1, counts: Counts::default() };
        Ring { capacity, inner: Mutex::new(inner), feed }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records `flow` (its `seq` is set here); returns whether an older one was pushed out.
    pub fn push(&self, mut flow: Flow) -> bool {
        let (flow, evicted) = {
            let mut inner = self.lock();
            flow.seq = inner.next_seq;
            inner.next_seq += 1;
            let evicted = inner.flows.len() == self.capacity;
            if evicted {
                inner.flows.pop_front();
                inner.counts.evicted += 1;
            }
            let flow = Arc::new(flow);
            inner.flows.push_back(Arc::clone(&flow));
            (flow, evicted)
        };
        // No follower: nobody to tell.
        let _ = self.feed.send(flow);
        evicted
    }

    /// Counts `n` records the kernel dropped before they could be read.
    pub fn lost(&self, n: u64) {
        self.lock().counts.lost += n;
    }

    pub fn counts(&self) -> Counts {
        self.lock().counts
    }

    /// The newest `limit` (0: all) records `filter` admits, oldest first.
    pub fn list(&self, filter: &Filter, limit: usize) -> Vec<Arc<Flow>> {
        let inner = self.lock();
        let limit = if limit == 0 { usize::MAX } else { limit };
        let mut out: Vec<Arc<Flow>> =
            inner.flows.iter().rev().filter(|f| admits(filter, f)).take(limit).cloned().collect();
        out.reverse();
        out
    }

    /// The records held now and a receiver of every newer one, with no gap
    /// or repeat between them.
    pub fn follow(&self, filter: &Filter) -> (Vec<Arc<Flow>>, broadcast::Receiver<Arc<Flow>>) {
        // Subscribed under the lock: a push either is in the list or comes on the receiver.
        let inner = self.lock();
        let rx = self.feed.subscribe();
        let held = inner.flows.iter().filter(|f| admits(filter, f)).cloned().collect();
        (held, rx)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether `filter` admits `flow`: a pod of one of its namespaces at
/// either end (any, when it names none), its pod at either end, its verdict.
pub fn admits(filter: &Filter, flow: &Flow) -> bool {
    let ends = [flow.source.as_ref(), flow.destination.as_ref()];
    let in_namespaces = filter.namespaces.is_empty()
        || ends.iter().flatten().any(|e| !e.pod.is_empty() && filter.namespaces.contains(&e.namespace));
    let pod_ok = filter.pod.is_empty()
        || ends
            .iter()
            .flatten()
            .any(|e| !e.pod.is_empty() && filter.pod.split_once('/') == Some((e.namespace.as_str(), e.pod.as_str())));
    let verdict_ok = filter.verdict == Verdict::Unspecified as i32 || filter.verdict == flow.verdict;
    in_namespaces && pod_ok && verdict_ok
}

#[cfg(test)]
mod tests {
    use weft_proto::flows::v1::Endpoint;

    use super::*;

    fn flow(src: (&str, &str), dst: (&str, &str), verdict: Verdict) -> Flow {
        let end = |(namespace, pod): (&str, &str)| Endpoint {
            address: "10.0.0.1".into(),
            port: 80,
            namespace: namespace.into(),
            pod: pod.into(),
        };
        Flow { source: Some(end(src)), destination: Some(end(dst)), verdict: verdict as i32, ..Flow::default() }
    }

    #[test]
    fn the_ring_keeps_the_newest_and_counts_what_it_pushes_out() {
        let ring = Ring::new(3);
        for _ in 0..5 {
            ring.push(flow(("a", "x"), ("b", "y"), Verdict::Forwarded));
        }
        let held: Vec<u64> = ring.list(&Filter::default(), 0).iter().map(|f| f.seq).collect();
        assert_eq!(held, vec![3, 4, 5]);
        assert_eq!(ring.list(&Filter::default(), 2).iter().map(|f| f.seq).collect::<Vec<_>>(), vec![4, 5]);
        ring.lost(7);
        assert_eq!(ring.counts(), Counts { evicted: 2, lost: 7 });
    }

    #[test]
    fn filters_match_either_end() {
        let ns = |n: &[&str]| Filter { namespaces: n.iter().map(|s| (*s).into()).collect(), ..Filter::default() };
        let f = flow(("a", "x"), ("", ""), Verdict::Dropped);
        assert!(admits(&ns(&["a"]), &f));
        assert!(!admits(&ns(&["b"]), &f));
        // An end that is no pod belongs to no namespace, not to "".
        assert!(!admits(&ns(&[""]), &f));
        assert!(admits(&Filter { pod: "a/x".into(), ..Filter::default() }, &f));
        assert!(!admits(&Filter { pod: "a/y".into(), ..Filter::default() }, &f));
        assert!(admits(&Filter { verdict: Verdict::Dropped as i32, ..Filter::default() }, &f));
        assert!(!admits(&Filter { verdict: Verdict::Forwarded as i32, ..Filter::default() }, &f));
    }

    #[tokio::test]
    async fn a_follower_gets_what_is_held_then_each_new_record_once() {
        let ring = Ring::new(8);
        ring.push(flow(("a", "x"), ("b", "y"), Verdict::Forwarded));
        ring.push(flow(("c", "z"), ("b", "y"), Verdict::Forwarded));
        let only_a = Filter { namespaces: vec!["a".into()], ..Filter::default() };
        let (held, mut rx) = ring.follow(&only_a);
        assert_eq!(held.iter().map(|f| f.seq).collect::<Vec<_>>(), vec![1]);
        ring.push(flow(("a", "x"), ("b", "y"), Verdict::Dropped));
        assert_eq!(rx.recv().await.expect("the new record").seq, 3);
    }
}
