//! Flow metrics (documented in docs/metrics.md): records by event and
//! verdict, records by namespace pair with the pairs capped (the first
//! [`MAX_PAIRS`] seen keep their names, later ones count as `other`), and
//! what was not kept.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Distinct namespace pairs with labels of their own, per agent run.
pub const MAX_PAIRS: usize = 200;
/// The label of both namespaces of pairs past the cap.
const OTHER: &str = "other";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RecordLabels {
    pub event: &'static str,
    pub verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PairLabels {
    pub source_namespace: String,
    pub destination_namespace: String,
    pub verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Default)]
pub struct FlowMetrics {
    pub records: Family<RecordLabels, Counter>,
    pub pairs: Family<PairLabels, Counter>,
    /// Records not kept, by reason: `kernel` (the kernel dropped events),
    /// `follower` (a follower read too slowly).
    pub lost: Family<ReasonLabels, Counter>,
    pub evicted: Counter,
    named: Mutex<HashSet<(String, String)>>,
}

impl FlowMetrics {
    pub fn register(registry: &mut Registry) -> std::sync::Arc<FlowMetrics> {
        let m = FlowMetrics::default();
        registry.register(
            "flow_records",
            "Flow records made, by event (opened, closed, denied) and verdict",
            m.records.clone(),
        );
        registry.register(
            "flow_namespace_pairs",
            "Flow records by source and destination namespace (\"\" for an end that is no pod; the first 200 pairs by name, later ones as \"other\") and verdict",
            m.pairs.clone(),
        );
        registry.register(
            "flows_lost",
            "Flow records never made or never delivered, by reason (kernel: events the kernel dropped; follower: records a follower read too slowly to get)",
            m.lost.clone(),
        );
        registry.register("flows_evicted", "Flow records pushed out of the ring by newer ones", m.evicted.clone());
        std::sync::Arc::new(m)
    }

    /// Counts a record of `event`, `verdict` between the two namespaces.
    pub fn record(&self, event: &'static str, verdict: &'static str, src_ns: &str, dst_ns: &str) {
        self.records.get_or_create(&RecordLabels { event, verdict }).inc();
        let (s, d) = self.pair(src_ns, dst_ns);
        self.pairs.get_or_create(&PairLabels { source_namespace: s, destination_namespace: d, verdict }).inc();
    }

    /// The labels of a pair: its names while under the cap.
    fn pair(&self, src: &str, dst: &str) -> (String, String) {
        let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        let key = (src.to_owned(), dst.to_owned());
        if named.contains(&key) {
            return key;
        }
        if named.len() < MAX_PAIRS {
            named.insert(key.clone());
            return key;
        }
        (OTHER.to_owned(), OTHER.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_pairs_are_capped() {
        let m = FlowMetrics::default();
        for i in 0..MAX_PAIRS {
            m.record("opened", "forwarded", &format!("ns{i}"), "");
        }
        m.record("opened", "forwarded", "late", "x");
        m.record("opened", "forwarded", "ns0", "");
        let other =
            PairLabels { source_namespace: OTHER.into(), destination_namespace: OTHER.into(), verdict: "forwarded" };
        assert_eq!(m.pairs.get_or_create(&other).get(), 1);
        let first =
            PairLabels { source_namespace: "ns0".into(), destination_namespace: "".into(), verdict: "forwarded" };
        assert_eq!(m.pairs.get_or_create(&first).get(), 2);
        assert_eq!(
            m.records.get_or_create(&RecordLabels { event: "opened", verdict: "forwarded" }).get(),
            MAX_PAIRS as u64 + 2
        );
    }
}
