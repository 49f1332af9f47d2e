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
pub struct SettingLabels {
    pub setting: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    pub direction: &'static str,
}

type HistogramFamily = Family<VerbLabels, Histogram, fn() -> Histogram>;

/// The overlay's peer passes (cheap to clone: each field is a shared handle).
#[derive(Clone)]
pub struct OverlayMetrics {
    pub passes: Counter,
    pub pass_duration: Histogram,
    pub peers_programmed: Gauge,
}

impl OverlayMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = OverlayMetrics {
            passes: Counter::default(),
            pass_duration: latency_histogram(),
            peers_programmed: Gauge::default(),
        };
        registry.register(
            "overlay_passes",
            "Overlay passes run: each diffs every peer's routes, neighbour and FDB entries (or tunnel peers) against the kernel; run on a change to a peer's Subnet or Node addresses and each resync",
            metrics.passes.clone(),
        );
        registry.register_with_unit(
            "overlay_pass_duration",
            "Time of an overlay pass, from reading the kernel to the last change applied",
            Unit::Seconds,
            metrics.pass_duration.clone(),
        );
        registry.register(
            "overlay_peers_programmed",
            "Peers the last overlay pass left programmed (the others are named in the Subnet's PeersProgrammed condition)",
            metrics.peers_programmed.clone(),
        );
        metrics
    }
}

pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub duration: HistogramFamily,
    pub ipam_addresses: Family<StateLabels, Gauge>,
    pub released_on_start: Counter,
    pub unverified_attachments: Gauge,
    pub unreadable_records: Gauge,
    pub lease_withdrawn: Gauge,
    pub host_ports: Family<StateLabels, Gauge>,
    pub host_port_repairs: Counter,
    pub pod_route_repairs: Counter,
    pub node_setting_repairs: Family<SettingLabels, Counter>,
    /// Frames the source guard dropped, as its kernel counters last read.
    pub guard_dropped: Gauge,
    pub guard_repairs: Counter,
    /// udp and wireguard: packets through the agent's datapath, by outcome.
    pub tunnel_packets: Family<OutcomeLabels, Counter>,
    /// udp and wireguard: reads and writes of the TUN device (with its
    /// offloads, one carries many packets).
    pub tunnel_device_operations: Family<DirectionLabels, Counter>,
    pub policy: std::sync::Arc<crate::policy::metrics::PolicyMetrics>,
    /// 1 when the last readiness check (/readyz) failed, else 0 (also before the first).
    pub not_ready: Gauge,
    pub flows: std::sync::Arc<crate::flows::metrics::FlowMetrics>,
    pub overlay: OverlayMetrics,
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
            "Allocations released by start-up reconciliation (their host veth or network namespace is gone)",
            released_on_start.clone(),
        );
        let unverified_attachments = Gauge::default();
        registry.register(
            "attachments_unverified",
            "Attachments kept by start-up reconciliation although they could not be verified (unreadable network namespace, changed routes or addresses); each is logged",
            unverified_attachments.clone(),
        );
        let unreadable_records = Gauge::default();
        registry.register(
            "ipam_records_unreadable",
            "IPAM records of this boot that could not be read: their addresses stay reserved (and veths without a record are kept) until an admin removes the files, each logged with its path",
            unreadable_records.clone(),
        );
        let lease_withdrawn = Gauge::default();
        registry.register(
            "lease_withdrawn",
            "1 while this node's Subnet lease is withdrawn (deleted or changed): no new pods are attached until the pods using it are gone and the agent restarts with a new lease",
            lease_withdrawn.clone(),
        );
        let host_ports = Family::<StateLabels, Gauge>::default();
        registry.register(
            "host_ports",
            "Ports of this node's host port range, by state (allocated or free)",
            host_ports.clone(),
        );
        let host_port_repairs = Counter::default();
        registry.register(
            "host_port_rule_repairs",
            "Times the periodic sync found the host port rules changed by someone else and rewrote them",
            host_port_repairs.clone(),
        );
        let pod_route_repairs = Counter::default();
        registry.register(
            "pod_route_repairs",
            "Routed pods whose route the agent found missing and restored (at start-up and each resync)",
            pod_route_repairs.clone(),
        );
        let node_setting_repairs = Family::<SettingLabels, Counter>::default();
        registry.register(
            "node_setting_repairs",
            "Node settings (ip_forward, ipv6_forwarding, masquerade, bridge_netfilter) found undone and put back, by setting",
            node_setting_repairs.clone(),
        );
        let guard_dropped = Gauge::default();
        registry.register(
            "source_guard_dropped_frames",
            "Frames from this node's pods that the source guard dropped (a source address, MAC or ARP/ND claim not the pod's own, link-local, broadcast or multicast); the kernel's counter, reset when the guard's table is rewritten",
            guard_dropped.clone(),
        );
        let guard_repairs = Counter::default();
        registry.register(
            "source_guard_repairs",
            "Times the periodic sync found the source guard's rules or sets changed by someone else and rewrote them",
            guard_repairs.clone(),
        );
        let tunnel_packets = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "tunnel_packets",
            "udp and wireguard backends: datagrams sent and packets delivered to pods (sent, received), and packets dropped: to a cluster address no usable peer holds (no_peer), from a peer with a source not of its pods or for another node (spoofed), not from a peer or not authentic (refused), failed sends (send_error)",
            tunnel_packets.clone(),
        );
        let tunnel_device_operations = Family::<DirectionLabels, Counter>::default();
        registry.register(
            "tunnel_device_operations",
            "udp and wireguard backends: reads (direction=read) and writes (direction=write) of the TUN device; with its offloads one carries up to 64 KiB of a TCP stream, so packets per operation shows them working",
            tunnel_device_operations.clone(),
        );
        let policy = std::sync::Arc::new(crate::policy::metrics::PolicyMetrics::register(&mut registry));
        let flows = crate::flows::metrics::FlowMetrics::register(&mut registry);
        let overlay = OverlayMetrics::register(&mut registry);
        let not_ready = Gauge::default();
        registry.register(
            "not_ready",
            "1 when the agent's last readiness check (/readyz, which kubelet's probe calls) failed, else 0 (also before the first)",
            not_ready.clone(),
        );
        Self {
            registry,
            requests,
            errors,
            duration,
            ipam_addresses,
            released_on_start,
            unverified_attachments,
            unreadable_records,
            lease_withdrawn,
            host_ports,
            host_port_repairs,
            pod_route_repairs,
            node_setting_repairs,
            guard_dropped,
            guard_repairs,
            tunnel_packets,
            tunnel_device_operations,
            policy,
            not_ready,
            flows,
            overlay,
        }
    }
}

impl Metrics {
    pub fn set_ipam_usage(&self, (allocated, free): (u64, u64)) {
        self.ipam_addresses.get_or_create(&StateLabels { state: "allocated" }).set(allocated as i64);
        self.ipam_addresses.get_or_create(&StateLabels { state: "free" }).set(free as i64);
    }

    pub fn set_host_port_usage(&self, (used, size): (usize, usize)) {
        self.host_ports.get_or_create(&StateLabels { state: "allocated" }).set(used as i64);
        self.host_ports.get_or_create(&StateLabels { state: "free" }).set(size.saturating_sub(used) as i64);
    }

    pub fn node_setting_repaired(&self, setting: &'static str) {
        self.node_setting_repairs.get_or_create(&SettingLabels { setting }).inc();
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
