//! Policy metrics of the agent (documented in docs/metrics.md), registered
//! into the agent's registry by `crate::metrics`.

use std::collections::HashMap;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use super::render::DropCounter;

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

pub struct PolicyMetrics {
    pub policies: Family<KindLabels, Gauge>,
    pub local_pods: Gauge,
    pub rules: Gauge,
    pub ipsets: Gauge,
    pub syncs: Family<ResultLabels, Counter>,
    pub sync_duration: Histogram,
    pub dropped: Family<DropLabels, Counter>,
    /// Last packet count seen per DROP rule, to turn kernel counters (reset
    /// when a chain is rewritten) into a monotonic counter.
    last_drops: Mutex<HashMap<String, u64>>,
}

impl PolicyMetrics {
    pub fn register(registry: &mut Registry) -> PolicyMetrics {
        let m = PolicyMetrics {
            policies: Family::default(),
            local_pods: Gauge::default(),
            rules: Gauge::default(),
            ipsets: Gauge::default(),
            syncs: Family::default(),
            // 1 ms .. ~33 s
            sync_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            dropped: Family::default(),
            last_drops: Mutex::new(HashMap::new()),
        };
        registry.register(
            "policy_network_policies",
            "NetworkPolicies the agent knows, by kind (standard, weft; invalid Weft policies excluded)",
            m.policies.clone(),
        );
        registry.register("policy_local_pods", "Local pods under at least one policy", m.local_pods.clone());
        registry.register("policy_rules", "iptables rules programmed in Weft's policy chains", m.rules.clone());
        registry.register("policy_ipsets", "ipsets Weft's policy rules use", m.ipsets.clone());
        registry.register("policy_syncs", "Policy syncs, by result (unchanged, applied, error)", m.syncs.clone());
        registry.register_with_unit(
            "policy_sync_duration",
            "Time to compute and apply the policy rules (full sync)",
            Unit::Seconds,
            m.sync_duration.clone(),
        );
        registry.register(
            "policy_dropped_packets",
            "Packets dropped by policy, by Weft policy (weft.dev/ns/name), default-deny or invalid, and direction",
            m.dropped.clone(),
        );
        m
    }

    /// Adds what the kernel's DROP counters gained since the last read.
    pub fn observe_drops(&self, drops: &[DropCounter]) {
        let mut last = self.last_drops.lock().unwrap_or_else(|p| p.into_inner());
        let mut seen = HashMap::with_capacity(drops.len());
        for d in drops {
            let before = last.get(&d.rule).copied().unwrap_or(0);
            // A smaller count means the rule was rewritten: it counted from zero.
            let delta = if d.packets >= before { d.packets - before } else { d.packets };
            if delta > 0 {
                self.dropped
                    .get_or_create(&DropLabels { policy: d.policy.clone(), direction: d.direction.as_str() })
                    .inc_by(delta);
            }
            seen.insert(d.rule.clone(), d.packets);
        }
        *last = seen;
    }
}
