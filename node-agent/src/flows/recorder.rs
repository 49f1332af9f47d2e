//! Reads the kernel's conntrack events on a thread of its own and takes
//! the drop log's records (as its `Sink`); makes flow records of those
//! that concern this node's pods, into the ring and the metrics.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use weft_proto::flows::v1::Flow;

use super::annotate::{self, Index};
use super::metrics::FlowMetrics;
use super::ring::Ring;
use crate::dataplane::conntrack_events::{self, Events};
use crate::dataplane::sysctl;
use crate::policy::drop_log::{Dropped, Sink};
use crate::policy::sync::Latest;

/// How long a read waits before looking again (nothing depends on it).
const READ_WAIT: Duration = Duration::from_secs(1);
/// Pause after a failed read, so that a broken socket does not spin.
const AFTER_ERROR: Duration = Duration::from_secs(1);
/// After a small batch, the reader waits this long for events to gather
/// (records appear at most this much later).
const COALESCE: Duration = Duration::from_millis(20);
const COALESCE_BELOW: usize = 128;
/// The address index is rebuilt from a newer policy pass at most this
/// often: at 50,000 pods a rebuild takes milliseconds, and passes can come
/// every few milliseconds under churn …
const REINDEX_EVERY: Duration = Duration::from_secs(1);
/// … or as soon as a newer pass exists when an event has an end it cannot
/// name (a new pod's first connections, which would otherwise go
/// unrecorded, or unnamed, for up to a second), and for every drop (the
/// policy that dropped it may be newer than the index, which would name
/// the default deny) …
const REINDEX_ON_MISS: Duration = Duration::ZERO;
/// … but never sooner than this many times what the last rebuild took
/// after it, so rebuilds take at most a twentieth of a CPU however fast
/// passes come (a rebuild of 5 ms waits 100 ms; one of 50 µs, 1 ms).
const REBUILD_SHARE: u32 = 20;

pub struct Recorder {
    node: String,
    ring: Arc<Ring>,
    metrics: Arc<FlowMetrics>,
    /// Denies answer (the agent's deny action is reject).
    rejects: bool,
    index: Mutex<Indexed>,
    /// [`REINDEX_EVERY`], [`REINDEX_ON_MISS`] (tests set others).
    reindex: (Duration, Duration),
}

struct Indexed {
    latest: watch::Receiver<Option<Arc<Latest>>>,
    index: Arc<Index>,
    /// When the index was last built, and what that took.
    built: Option<(Instant, Duration)>,
}

impl Recorder {
    pub fn new(
        node: &str,
        ring: Arc<Ring>,
        metrics: Arc<FlowMetrics>,
        rejects: bool,
        latest: watch::Receiver<Option<Arc<Latest>>>,
    ) -> Self {
        let index = Mutex::new(Indexed { latest, index: Arc::new(Index::empty(node)), built: None });
        Recorder { node: node.to_owned(), ring, metrics, rejects, index, reindex: (REINDEX_EVERY, REINDEX_ON_MISS) }
    }

    /// Starts reading conntrack events in the caller's network namespace
    /// (the node's), on a thread of its own. A bind error is logged there:
    /// flows then show denied packets only.
    pub fn start_connections(self: &Arc<Self>) -> std::io::Result<()> {
        let me = Arc::clone(self);
        std::thread::Builder::new().name("flow-conntrack".into()).spawn(move || {
            match sysctl::ensure_conntrack_accounting() {
                Ok(true) => tracing::info!("flows: turned on connection tracking's packet and byte counters"),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "flows: cannot turn on conntrack counters; closed flows show none")
                }
            }
            match Events::bind() {
                Ok(events) => me.read_forever(events),
                Err(e) => {
                    tracing::error!(error = %e, "flows: cannot read conntrack events; only denied packets are recorded")
                }
            }
        })?;
        Ok(())
    }

    fn read_forever(&self, mut events: Events) {
        tracing::info!(node = %self.node, capacity = self.ring.capacity(), "flows: recording this node's pods' connections");
        loop {
            match events.recv(READ_WAIT) {
                Ok(got) => {
                    if got.lost {
                        self.kernel_lost();
                    }
                    if got.events.is_empty() {
                        continue;
                    }
                    self.record(&got.events, now_ms());
                    // Let events gather before the next wake-up: woken per
                    // event, the thread spent most of its time switching in
                    // and out. The socket's buffer holds far more than
                    // arrives meanwhile; a full batch goes on at once.
                    if got.events.len() < COALESCE_BELOW {
                        std::thread::sleep(COALESCE);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "flows: reading conntrack events failed");
                    std::thread::sleep(AFTER_ERROR);
                }
            }
        }
    }

    /// Records a batch of connection events. An event naming no local pod,
    /// or an address the index cannot name (perhaps a pod that just started:
    /// its first connections), is looked at again with a newer index, which
    /// is then due sooner ([`REINDEX_ON_MISS`]; an address outside the pods
    /// costs a look at whether a newer pass exists).
    fn record(&self, events: &[conntrack_events::Event], now: u64) {
        let index = self.index(self.reindex.0);
        let mut again = Vec::new();
        for e in events {
            match annotate::connection(&index, e, now) {
                Some(flow) if names_both(&flow) => self.push(flow),
                annotated => again.push((e, annotated)),
            }
        }
        if again.is_empty() {
            return;
        }
        let fresh = self.index(self.reindex.1);
        let newer = !Arc::ptr_eq(&fresh, &index);
        for (e, annotated) in again {
            let flow = if newer { annotate::connection(&fresh, e, now) } else { annotated };
            if let Some(flow) = flow {
                self.push(flow);
            }
        }
    }

    fn push(&self, flow: Flow) {
        // Counted first, from the record's own names: no copies per record.
        let src_ns = flow.source.as_ref().map_or("", |e| e.namespace.as_str());
        let dst_ns = flow.destination.as_ref().map_or("", |e| e.namespace.as_str());
        self.metrics.record(event_name(flow.event), verdict_name(flow.verdict), src_ns, dst_ns);
        if self.ring.push(flow) {
            self.metrics.evicted.inc();
        }
    }

    fn kernel_lost(&self) {
        // ENOBUFS says some were dropped, not how many: at least one.
        self.ring.lost(1);
        self.metrics.lost.get_or_create(&super::metrics::ReasonLabels { reason: "kernel" }).inc();
    }

    /// The index of the latest policy pass, rebuilt when it is at least
    /// `min_age` old (and within [`REBUILD_SHARE`]).
    fn index(&self, min_age: Duration) -> Arc<Index> {
        let mut ix = self.index.lock().unwrap_or_else(|p| p.into_inner());
        let due = ix.built.is_none_or(|(at, took)| rebuild_due(at.elapsed(), took, min_age));
        if due && ix.latest.has_changed().unwrap_or(false) {
            let latest = ix.latest.borrow_and_update().clone();
            if let Some(latest) = latest {
                let started = Instant::now();
                ix.index = Arc::new(Index::new(&self.node, &latest));
                ix.built = Some((Instant::now(), started.elapsed()));
            }
        }
        Arc::clone(&ix.index)
    }
}

/// Whether an index built `age` ago, in `took`, may be rebuilt by a caller
/// that wants one at most `min_age` old. Pure.
fn rebuild_due(age: Duration, took: Duration, min_age: Duration) -> bool {
    age >= min_age.max(took.saturating_mul(REBUILD_SHARE))
}

/// Whether a record names the pods at both ends.
fn names_both(f: &Flow) -> bool {
    [&f.source, &f.destination].iter().all(|e| e.as_ref().is_some_and(|e| !e.pod.is_empty()))
}

impl Sink for Recorder {
    fn dropped(&self, d: &Dropped) {
        if let Some(flow) = annotate::denied(&self.index(self.reindex.1), d, self.rejects, now_ms()) {
            self.push(flow);
        }
    }

    fn lost(&self) {
        self.kernel_lost();
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or_default()
}

pub use weft_proto::flows_json::{event_name, verdict_name};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::metrics::ReasonLabels;

    impl Recorder {
        /// As if the last rebuild had cost nothing (its budget is tested apart).
        fn free_rebuilds(&self) {
            if let Some((_, took)) = &mut self.index.lock().unwrap().built {
                *took = Duration::ZERO;
            }
        }
    }

    /// What the kernel dropped (ENOBUFS, from either reader) is counted in
    /// the ring's answer and in the metric, at least once per occurrence.
    #[test]
    fn a_kernel_loss_is_counted_in_the_ring_and_the_metric() {
        let (ring, metrics) = (Arc::new(Ring::new(8)), Arc::new(FlowMetrics::default()));
        let (_tx, latest) = watch::channel(None);
        let recorder = Recorder::new("node-1", Arc::clone(&ring), Arc::clone(&metrics), true, latest);
        recorder.lost();
        recorder.lost();
        assert_eq!(ring.counts().lost, 2);
        assert_eq!(metrics.lost.get_or_create(&ReasonLabels { reason: "kernel" }).get(), 2);
    }

    /// A pod that just started connects to a local pod: the index built
    /// before its address was known cannot name it, so its record waits
    /// for the newer pass (due sooner on such a miss) instead of going out
    /// unnamed.
    #[test]
    fn a_new_pods_first_connection_is_named_from_the_newer_pass() {
        use crate::dataplane::conntrack_events::Kind;
        use crate::flows::annotate::tests::{event, snapshot};
        use crate::policy::model::tests::cluster;

        let run = |on_miss: Duration| {
            let ring = Arc::new(Ring::new(8));
            let (tx, latest) = watch::channel(None);
            let mut recorder = Recorder::new("n1", Arc::clone(&ring), Arc::new(FlowMetrics::default()), true, latest);
            recorder.reindex = (Duration::from_secs(3600), on_miss);
            let full = cluster();
            let mut before = full.clone();
            before.pods.retain(|p| !p.ips.contains(&"10.0.2.2".parse().unwrap()));
            tx.send(Some(Arc::new(snapshot(before)))).unwrap();
            // dev/web (10.0.2.2, on another node) to prod/db (local).
            let e = event(Kind::New, "10.0.2.2", "10.0.1.2", 5432);
            recorder.record(std::slice::from_ref(&e), 1);
            recorder.free_rebuilds();
            tx.send(Some(Arc::new(snapshot(full)))).unwrap();
            recorder.record(std::slice::from_ref(&e), 2);
            let filter = weft_proto::flows::v1::Filter::default();
            ring.list(&filter, 0).iter().map(|f| f.source.as_ref().unwrap().pod.clone()).collect::<Vec<_>>()
        };
        assert_eq!(run(Duration::ZERO), ["", "web"]);
        // Not yet due: the record still goes out, unnamed, not lost.
        assert_eq!(run(Duration::from_secs(3600)), ["", ""]);
    }

    /// A policy that isolates a pod is published (before its rules are
    /// applied) right after the index was built for another drop: the
    /// first drop at the end of its chain names it, not the default deny.
    /// With a fixed 100 ms between rebuilds on a miss, it named the default deny.
    #[test]
    fn a_drop_right_after_a_policy_change_names_the_new_policy() {
        use serde_json::json;

        use crate::flows::annotate::tests::{dropped, snapshot};
        use crate::policy::model::tests::{cluster, std_policy};

        let ring = Arc::new(Ring::new(8));
        let (tx, latest) = watch::channel(None);
        let recorder = Recorder::new("n1", Arc::clone(&ring), Arc::new(FlowMetrics::default()), true, latest);
        let before = cluster();
        let mut after = before.clone();
        after.standard.push(std_policy("prod", "deny-all", json!({"podSelector": {}})));
        tx.send(Some(Arc::new(snapshot(before)))).unwrap();
        recorder.dropped(&dropped("invalid"));
        recorder.free_rebuilds();
        tx.send(Some(Arc::new(snapshot(after)))).unwrap();
        recorder.dropped(&dropped(crate::policy::render::DEFAULT_DENY));
        let filter = weft_proto::flows::v1::Filter::default();
        let named: Vec<_> = ring.list(&filter, 0).iter().map(|f| f.policy.clone()).collect();
        assert_eq!(named, ["invalid", "prod/deny-all"]);
    }

    /// Rebuilds wait for the caller's age and for twenty times the last one's cost.
    #[test]
    fn rebuilds_spend_at_most_a_twentieth_of_the_time() {
        let ms = Duration::from_millis;
        assert!(rebuild_due(ms(0), ms(0), ms(0)));
        assert!(!rebuild_due(ms(99), ms(5), ms(0)));
        assert!(rebuild_due(ms(100), ms(5), ms(0)));
        assert!(!rebuild_due(ms(500), ms(5), ms(1000)));
        assert!(rebuild_due(ms(1000), ms(5), ms(1000)));
    }
}
