//! Policy metrics of the agent (documented in docs/metrics.md), registered
//! into the agent's registry by `crate::metrics`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use std::collections::BTreeMap;

use super::render::CounterLabels;
use crate::firewall::ruleset::Count;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabels {
    pub policy: String,
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    pub policy: String,
    pub direction: &'static str,
    pub verdict: &'static str,
}

pub struct PolicyMetrics {
    pub policies: Family<KindLabels, Gauge>,
    pub local_pods: Gauge,
    pub rules: Gauge,
    pub sets: Gauge,
    /// Standard policies refused for compiling past a bound (`limits`).
    pub refused: Gauge,
    pub syncs: Family<ResultLabels, Counter>,
    pub sync_duration: Histogram,
    /// Unix time at which the last pass that changed the rules wrote them.
    pub last_write: Gauge<f64, AtomicU64>,
    pub dropped: Family<DropLabels, Counter>,
    pub packets: Family<VerdictLabels, Counter>,
    pub bytes: Family<VerdictLabels, Counter>,
    /// The drop log: records logged, and reads at which the kernel had lost some.
    pub drop_log: Family<ResultLabels, Counter>,
    /// Last count seen per kernel counter, to turn kernel counters (which
    /// start from zero when made anew) into monotonic ones.
    last: Mutex<HashMap<String, Count>>,
}

impl PolicyMetrics {
    pub fn register(registry: &mut Registry) -> PolicyMetrics {
        let m = PolicyMetrics {
            policies: Family::default(),
            local_pods: Gauge::default(),
            rules: Gauge::default(),
            sets: Gauge::default(),
            refused: Gauge::default(),
            syncs: Family::default(),
            // 1 ms .. ~33 s
            sync_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            last_write: Gauge::default(),
            dropped: Family::default(),
            packets: Family::default(),
            bytes: Family::default(),
            drop_log: Family::default(),
            last: Mutex::new(HashMap::new()),
        };
        registry.register(
            "policy_network_policies",
            "NetworkPolicies the agent knows, by kind (standard, weft; invalid Weft policies excluded)",
            m.policies.clone(),
        );
        registry.register("policy_local_pods", "Local pods under at least one policy", m.local_pods.clone());
        registry.register("policy_rules", "nftables rules in Weft's policy chains", m.rules.clone());
        registry.register("policy_sets", "Address sets Weft's policy rules use", m.sets.clone());
        registry.register(
            "policy_refused",
            "Standard NetworkPolicies refused because they compile past the per-policy bound, or on this node past the per-node bound: their pods stay isolated and they admit nothing (each logged; per-node refusals get an Event on the policy)",
            m.refused.clone(),
        );
        registry.register("policy_syncs", "Policy syncs, by result (unchanged, applied, error)", m.syncs.clone());
        registry.register_with_unit(
            "policy_sync_duration",
            "Time to compute and apply the policy rules (full sync)",
            Unit::Seconds,
            m.sync_duration.clone(),
        );
        registry.register_with_unit(
            "policy_last_write_timestamp",
            "Unix time at which the last policy pass that changed the rules wrote them to the kernel (a change is in force from then)",
            Unit::Seconds,
            m.last_write.clone(),
        );
        registry.register(
            "policy_dropped_packets",
            "Packets dropped by policy, by Weft policy (weft.dev/ns/name), default-deny or invalid, and direction",
            m.dropped.clone(),
        );
        registry.register(
            "policy_packets",
            "Packets counted by policy rules, by policy, direction and verdict (allowed, dropped)",
            m.packets.clone(),
        );
        registry.register(
            "policy_drop_log_records",
            "The drop log (off by default): records logged, and reads at which the kernel had dropped records (lost)",
            m.drop_log.clone(),
        );
        registry.register_with_unit(
            "policy",
            "Bytes counted by policy rules, by policy, direction and verdict (allowed, dropped)",
            Unit::Bytes,
            m.bytes.clone(),
        );
        m
    }

    /// Adds what the kernel's policy counters gained since the last read.
    /// `labels` says what each counter counts; counters it does not name are
    /// not Weft's policy counters.
    pub fn observe_counters(&self, counts: &BTreeMap<String, Count>, labels: &BTreeMap<String, CounterLabels>) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let mut seen = HashMap::with_capacity(counts.len());
        for (name, now) in counts {
            let Some(l) = labels.get(name) else { continue };
            let before = last.get(name).copied().unwrap_or_default();
            // A smaller count means the counter was made anew: it counted from zero.
            let gained = |now: u64, before: u64| if now >= before { now - before } else { now };
            let (packets, bytes) = (gained(now.packets, before.packets), gained(now.bytes, before.bytes));
            let direction = l.direction.as_str();
            let v = VerdictLabels { policy: l.policy.clone(), direction, verdict: l.verdict_str() };
            if packets > 0 {
                self.packets.get_or_create(&v).inc_by(packets);
                if l.verdict == super::model::Verdict::Drop {
                    self.dropped.get_or_create(&DropLabels { policy: l.policy.clone(), direction }).inc_by(packets);
                }
            }
            if bytes > 0 {
                self.bytes.get_or_create(&v).inc_by(bytes);
            }
            seen.insert(name.clone(), *now);
        }
        *last = seen;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::model::{Direction, Verdict};

    #[test]
    fn kernel_counters_become_monotonic_per_policy_direction_and_verdict() {
        let m = PolicyMetrics::register(&mut Registry::default());
        let labels: BTreeMap<String, CounterLabels> = [
            (
                "policy-a".to_owned(),
                CounterLabels {
                    policy: "weft.dev/p/deny".into(),
                    direction: Direction::Ingress,
                    verdict: Verdict::Drop,
                },
            ),
            (
                "policy-b".to_owned(),
                CounterLabels { policy: "p/allow".into(), direction: Direction::Egress, verdict: Verdict::Allow },
            ),
        ]
        .into();
        let read = |a: u64, b: u64| {
            let c = |p| Count { packets: p, bytes: p * 100 };
            [("policy-a".to_owned(), c(a)), ("policy-b".to_owned(), c(b)), ("hostport-x".to_owned(), c(9))].into()
        };
        m.observe_counters(&read(5, 2), &labels);
        // policy-a was made anew (its chain's policy went and came back): counts from zero.
        m.observe_counters(&read(3, 7), &labels);
        let v = |policy: &str, direction, verdict| VerdictLabels { policy: policy.into(), direction, verdict };
        assert_eq!(m.packets.get_or_create(&v("weft.dev/p/deny", "ingress", "dropped")).get(), 8);
        assert_eq!(m.bytes.get_or_create(&v("weft.dev/p/deny", "ingress", "dropped")).get(), 800);
        assert_eq!(m.packets.get_or_create(&v("p/allow", "egress", "allowed")).get(), 7);
        let dropped = DropLabels { policy: "weft.dev/p/deny".into(), direction: "ingress" };
        assert_eq!(m.dropped.get_or_create(&dropped).get(), 8);
        assert_eq!(m.dropped.get_or_create(&DropLabels { policy: "p/allow".into(), direction: "egress" }).get(), 0);
    }
}
