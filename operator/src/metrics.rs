//! Prometheus metrics and the /metrics, /healthz, /readyz HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabel {
    pub controller: &'static str,
}

/// All operator metrics, registered under the `weft_operator_` prefix.
pub struct Metrics {
    registry: Registry,
    /// `state="allocated"|"free"`; f64 because IPv6 pools are huge.
    pub subnet_leases: Family<StateLabel, Gauge<f64, AtomicU64>>,
    pub reconcile: Family<ControllerLabel, Counter>,
    pub reconcile_errors: Family<ControllerLabel, Counter>,
    pub reconcile_duration: Family<ControllerLabel, Histogram>,
    pub pool_exhausted: Counter,
    pub leader: Gauge,
    /// `node`, `state="allocated"|"free"`: each node's host port range.
    pub host_ports: Family<NodeStateLabels, Gauge>,
    pub host_port_collected: Counter,
    /// weft.dev NetworkPolicies by `state` (accepted, rejected).
    pub network_policies: Family<StateLabel, Gauge>,
    pub standard_policies_refused: Gauge,
    pub flows_api_serving: Gauge,
    /// PodEndpoint writes by `op` (apply, delete), failed ones included.
    pub pod_endpoint_writes: Family<OpLabel, Counter>,
    ready: AtomicBool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeStateLabels {
    pub node: String,
    pub state: &'static str,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("weft_operator");
        let subnet_leases = Family::<StateLabel, Gauge<f64, AtomicU64>>::default();
        registry.register("subnet_leases", "Subnet leases by state (allocated, free)", subnet_leases.clone());
        let reconcile = Family::<ControllerLabel, Counter>::default();
        registry.register("reconcile", "Reconciliations run", reconcile.clone());
        let reconcile_errors = Family::<ControllerLabel, Counter>::default();
        registry.register("reconcile_errors", "Reconciliations that failed", reconcile_errors.clone());
        let reconcile_duration = Family::<ControllerLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        registry.register("reconcile_duration_seconds", "Reconciliation latency", reconcile_duration.clone());
        let pool_exhausted = Counter::default();
        registry.register(
            "subnet_pool_exhausted",
            "Allocations that found no free subnet in the cluster CIDR",
            pool_exhausted.clone(),
        );
        let leader = Gauge::default();
        registry.register("leader", "1 while this replica holds the leader Lease", leader.clone());
        let host_ports = Family::<NodeStateLabels, Gauge>::default();
        registry.register(
            "host_ports",
            "Ports of each node's host port range, by node and state (allocated, free)",
            host_ports.clone(),
        );
        let host_port_collected = Counter::default();
        registry.register(
            "host_port_allocations_collected",
            "HostPortAllocations deleted because their pod was gone",
            host_port_collected.clone(),
        );
        let network_policies = Family::<StateLabel, Gauge>::default();
        registry.register(
            "network_policies",
            "weft.dev NetworkPolicies by state (accepted, rejected)",
            network_policies.clone(),
        );
        let standard_policies_refused = Gauge::default();
        registry.register(
            "standard_network_policies_refused",
            "Standard NetworkPolicies over Weft's size bound (the agents isolate their pods and admit nothing)",
            standard_policies_refused.clone(),
        );
        let flows_api_serving = Gauge::default();
        registry.register(
            "flows_api_serving",
            "1 while this replica serves the flows.weft.dev API (--flows-api-addr), else 0",
            flows_api_serving.clone(),
        );
        let pod_endpoint_writes = Family::<OpLabel, Counter>::default();
        registry.register(
            "pod_endpoint_writes",
            "PodEndpoint writes by op (apply, delete), with --publish-pod-endpoints",
            pod_endpoint_writes.clone(),
        );
        Metrics {
            registry,
            pod_endpoint_writes,
            flows_api_serving,
            host_ports,
            host_port_collected,
            subnet_leases,
            reconcile,
            reconcile_errors,
            reconcile_duration,
            pool_exhausted,
            leader,
            network_policies,
            standard_policies_refused,
            ready: AtomicBool::new(false),
        }
    }

    /// Records the lease counts.
    pub fn set_leases(&self, allocated: u128, capacity: u128) {
        // Precision loss above 2^53 is fine for a gauge.
        self.subnet_leases.get_or_create(&StateLabel { state: "allocated" }).set(allocated as f64);
        self.subnet_leases.get_or_create(&StateLabel { state: "free" }).set(capacity.saturating_sub(allocated) as f64);
    }

    /// Replaces the per-node host port gauges (nodes without allocations drop out).
    pub fn set_host_port_pools(&self, pools: &std::collections::HashMap<String, (i32, i32)>) {
        self.host_ports.clear();
        for (node, (used, size)) in pools {
            let label = |state| NodeStateLabels { node: node.clone(), state };
            self.host_ports.get_or_create(&label("allocated")).set(i64::from(*used));
            self.host_ports.get_or_create(&label("free")).set(i64::from(size - used));
        }
    }

    /// Records how many weft.dev NetworkPolicies are accepted and rejected.
    pub fn set_network_policies(&self, accepted: i64, rejected: i64) {
        self.network_policies.get_or_create(&StateLabel { state: "accepted" }).set(accepted);
        self.network_policies.get_or_create(&StateLabel { state: "rejected" }).set(rejected);
    }

    /// Records one reconciliation.
    pub fn observe(&self, controller: &'static str, took: Duration, failed: bool) {
        let label = ControllerLabel { controller };
        self.reconcile.get_or_create(&label).inc();
        if failed {
            self.reconcile_errors.get_or_create(&label).inc();
        }
        self.reconcile_duration.get_or_create(&label).observe(took.as_secs_f64());
    }

    /// /readyz turns 200 once set.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Serves /metrics, /healthz and /readyz until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(metrics);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    axum::serve(listener, app).await
}

async fn render_metrics(State(m): State<Arc<Metrics>>, headers: HeaderMap) -> impl IntoResponse {
    match m.render() {
        Ok(body) => {
            let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
            let (content_type, body) = weft_telemetry::negotiate(accept, body);
            (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], body).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}")).into_response(),
    }
}

async fn readyz(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    if m.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_are_stable() {
        let m = Metrics::new();
        m.set_leases(3, 256);
        m.observe("node", Duration::from_millis(5), true);
        let text = m.render().expect("renders");
        for name in [
            "weft_operator_subnet_leases{state=\"allocated\"} 3.0",
            "weft_operator_subnet_leases{state=\"free\"} 253.0",
            "weft_operator_reconcile_total{controller=\"node\"} 1",
            "weft_operator_reconcile_errors_total{controller=\"node\"} 1",
            "weft_operator_reconcile_duration_seconds_bucket",
        ] {
            assert!(text.contains(name), "missing {name} in:\n{text}");
        }
    }
}
