//! The agent's Prometheus metrics (documented in docs/metrics.md).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub verb: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub verb: &'static str,
    pub code: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    pub verb: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
}

type HistogramFamily = Family<VerbLabels, Histogram, fn() -> Histogram>;

pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub duration: HistogramFamily,
    pub ipam_addresses: Family<StateLabels, Gauge>,
    pub released_on_start: Counter,
}

fn latency_histogram() -> Histogram {
    // 0.25 ms .. ~4 s
    Histogram::new(exponential_buckets(0.000_25, 2.0, 15))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("weft_agent");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "cni_requests",
            "CNI requests served, by verb and result (success or error)",
            requests.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register("cni_errors", "CNI requests that failed, by verb and CNI error code", errors.clone());
        let duration: HistogramFamily = Family::new_with_constructor(latency_histogram);
        registry.register_with_unit(
            "cni_request_duration",
            "Time to serve a CNI request, by verb",
            Unit::Seconds,
            duration.clone(),
        );
        let ipam_addresses = Family::<StateLabels, Gauge>::default();
        registry.register(
            "ipam_addresses",
            "Pod addresses of this node's pod CIDR, by state (allocated or free)",
            ipam_addresses.clone(),
        );
        let released_on_start = Counter::default();
        registry.register(
            "ipam_released_on_start",
            "Allocations released by start-up reconciliation (their ADD never finished or their pod is gone)",
            released_on_start.clone(),
        );
        Self { registry, requests, errors, duration, ipam_addresses, released_on_start }
    }
}

impl Metrics {
    pub fn set_ipam_usage(&self, (allocated, free): (u64, u64)) {
        self.ipam_addresses.get_or_create(&StateLabels { state: "allocated" }).set(allocated as i64);
        self.ipam_addresses.get_or_create(&StateLabels { state: "free" }).set(free as i64);
    }

    pub fn observe(&self, verb: &'static str, seconds: f64, error_code: Option<u32>) {
        let result = if error_code.is_some() { "error" } else { "success" };
        self.requests.get_or_create(&RequestLabels { verb, result }).inc();
        if let Some(code) = error_code {
            self.errors.get_or_create(&ErrorLabels { verb, code }).inc();
        }
        self.duration.get_or_create(&VerbLabels { verb }).observe(seconds);
    }

    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Content type of the OpenMetrics exposition prometheus-client writes.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the classic Prometheus text format.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Picks the exposition format from the request's `Accept` header, as the
/// official client libraries do: OpenMetrics when asked for (Prometheus asks
/// for it), else the classic text format (curl, `promtool check metrics`).
/// Returns the content type and the body.
pub fn negotiate(accept: Option<&str>, openmetrics: String) -> (&'static str, String) {
    if accept.is_some_and(|a| a.contains("application/openmetrics-text")) {
        (OPENMETRICS, openmetrics)
    } else {
        (PROMETHEUS_TEXT, to_prometheus_text(&openmetrics))
    }
}

/// Converts OpenMetrics text into the Prometheus text format 0.0.4: a counter
/// family is named with its `_total` suffix (as its samples are), and the
/// `# UNIT` and `# EOF` lines, which that format does not have, are dropped.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| Some((p, line.strip_prefix(p)?.split_once(' ')?)));
        match meta {
            Some((prefix, (name, rest))) if counters.contains(name) => {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(rest);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_text_names_counter_families_with_total() {
        let om = "# HELP x_requests Requests.\n# TYPE x_requests counter\nx_requests_total{a=\"b\"} 1\n\
                  # HELP x_duration_seconds Time.\n# TYPE x_duration_seconds histogram\n# UNIT x_duration_seconds seconds\n\
                  x_duration_seconds_count 0\n# EOF\n";
        let text = to_prometheus_text(om);
        assert_eq!(
            text,
            "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\nx_requests_total{a=\"b\"} 1\n\
             # HELP x_duration_seconds Time.\n# TYPE x_duration_seconds histogram\nx_duration_seconds_count 0\n"
        );
        assert_eq!(
            negotiate(Some("application/openmetrics-text;version=1.0.0,text/plain;q=0.5"), om.into()).0,
            OPENMETRICS
        );
        assert_eq!(negotiate(Some("*/*"), om.into()).0, PROMETHEUS_TEXT);
        assert_eq!(negotiate(None, om.into()).1, text);
    }
}
