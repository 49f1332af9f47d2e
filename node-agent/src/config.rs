//! Agent configuration from flags and environment.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use ipnet::IpNet;

use crate::attachment::Attachment;

#[derive(Debug, Clone, Parser)]
#[command(name = "weft-agent", version, about = "Weft node agent")]
pub struct Config {
    /// This node's name (the Kubernetes Node it runs on).
    #[arg(long, env = "WEFT_NODE_NAME", default_value = "local")]
    pub node_name: String,
    /// A fixed pod CIDR for a node without a Kubernetes API (standalone use
    /// and single-node tests), IPv4 or (IPv6-only pods) IPv6. Without it the
    /// agent waits for its node's Subnet lease from the operator and serves
    /// no CNI request until then.
    #[arg(long, env = "WEFT_POD_CIDR")]
    pub pod_cidr: Option<IpNet>,
    /// With an IPv4 `--pod-cidr`: a fixed IPv6 block too, for dual-stack
    /// pods (a pod's IPv6 address has its IPv4 address's host number).
    #[arg(long, env = "WEFT_POD_IPV6_CIDR", requires = "pod_cidr")]
    pub pod_ipv6_cidr: Option<ipnet::Ipv6Net>,
    /// Kubeconfig to reach the API; without it the in-cluster config (or
    /// $KUBECONFIG) is used.
    #[arg(long, env = "WEFT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's IP on the underlay (the DaemonSet passes status.hostIP):
    /// the next hop and tunnel endpoint other nodes use.
    #[arg(long, env = "WEFT_NODE_IP")]
    pub node_ip: Option<std::net::IpAddr>,
    /// All of this node's IPs, comma-separated (the DaemonSet passes
    /// status.hostIPs): the IPv6 one is the address host ports of
    /// dual-stack pods are published on for IPv6.
    #[arg(long, env = "WEFT_NODE_IPS", value_delimiter = ',')]
    pub node_ips: Vec<std::net::IpAddr>,
    /// Unix socket for weft-cni (created with mode 0600).
    #[arg(long, env = "WEFT_AGENT_SOCKET", default_value = weft_proto::DEFAULT_AGENT_SOCKET)]
    pub socket: PathBuf,
    /// Directory for durable state (IPAM records).
    #[arg(long, env = "WEFT_STATE_DIR", default_value = "/var/lib/weft")]
    pub state_dir: PathBuf,
    /// The node bridge that pod veths are plugged into.
    #[arg(long, env = "WEFT_BRIDGE", default_value = "weft0")]
    pub bridge: String,
    /// How pod veths join the node: `bridge` (ports of --bridge) or `routed`
    /// (a /32 route per pod, no bridge hop; see the README). Pods already
    /// running keep their mode, and new pods join them until the agent starts
    /// on a node without them.
    #[arg(long, env = "WEFT_POD_ATTACHMENT", value_enum, default_value_t = Attachment::Bridge)]
    pub pod_attachment: Attachment,
    /// Pod interface MTU when the network configuration sets none. Default:
    /// the underlay's MTU minus the VXLAN overhead in overlay mode, else 1500.
    #[arg(long, env = "WEFT_MTU", value_parser = clap::value_parser!(u32).range(68..=65535))]
    pub mtu: Option<u32>,
    /// The cluster's pod CIDR (all nodes' Subnets; IPv6 in an IPv6-only
    /// cluster): never masqueraded, and the bound for peer routes. Required
    /// with a Subnet lease.
    #[arg(long, env = "WEFT_CLUSTER_CIDR")]
    pub cluster_cidr: Option<IpNet>,
    /// The cluster's IPv6 pod range (dual-stack; the chart's
    /// network.ipv6ClusterCIDR): IPv6 traffic to it is never masqueraded.
    /// Without it no IPv6 traffic is masqueraded.
    #[arg(long, env = "WEFT_IPV6_CLUSTER_CIDR")]
    pub ipv6_cluster_cidr: Option<ipnet::Ipv6Net>,
    /// Masquerade IPv6 pod traffic leaving the cluster: `auto` does unless
    /// the pods' IPv6 block is global unicast (2000::/3) and the node has a
    /// default IPv6 route and a global address; `on`; `off`.
    #[arg(long, env = "WEFT_IPV6_MASQUERADE", value_enum, default_value_t = crate::node_settings::Ipv6Masquerade::Auto)]
    pub ipv6_masquerade: crate::node_settings::Ipv6Masquerade,
    /// VXLAN network identifier.
    #[arg(long, env = "WEFT_VNI", default_value_t = 1)]
    pub vni: u32,
    /// The udp and wireguard backends' UDP port, the same on every node
    /// (default: 8285 for udp, 51820 for wireguard).
    #[arg(long, env = "WEFT_TUNNEL_PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub tunnel_port: Option<u16>,
    /// wireguard: make a new key pair at start-up (the old key is replaced;
    /// peers take the new public key from this node's Subnet).
    #[arg(long, env = "WEFT_WIREGUARD_ROTATE_KEY")]
    pub wireguard_rotate_key: bool,
    /// Which node addresses VXLAN packets travel between: `ipv4` (the node
    /// IPs) or `ipv6` (the nodes' IPv6 addresses from --node-ips, which
    /// must be on the underlay interface; 70 bytes of overhead instead of
    /// 50). Every node of a cluster must use the same.
    #[arg(long, env = "WEFT_VXLAN_UNDERLAY", value_parser = parse_vxlan_underlay, default_value = "ipv4")]
    pub vxlan_underlay: weft_api::VxlanUnderlay,
    /// With the vxlan backend, route directly (host-gw) to peers on the same L2 segment.
    #[arg(long, env = "WEFT_DIRECT_ROUTING", default_value_t = false)]
    pub direct_routing: bool,
    /// Underlay interface; default: the one that carries --node-ip.
    #[arg(long, env = "WEFT_UNDERLAY_IFACE")]
    pub underlay_iface: Option<String>,
    /// The one resync period of every reconcile loop (overlay, policy, host
    /// ports, repairs, the lease), in seconds; changes apply at once anyway.
    #[arg(long, env = "WEFT_RESYNC_SECONDS", default_value_t = 30)]
    pub resync_seconds: u64,
    /// Range automatic host ports are picked from (pod annotation
    /// `weft.dev/host-ports`). The default stays clear of the NodePort range
    /// and Linux's default ephemeral range.
    #[arg(long, env = "WEFT_HOST_PORT_RANGE", default_value = crate::hostport::range::DEFAULT_RANGE)]
    pub host_port_range: crate::hostport::PortRange,
    /// Enforce NetworkPolicies (standard and weft.dev) for this node's pods.
    #[arg(long, env = "WEFT_NETWORK_POLICY", default_value_t = true, action = clap::ArgAction::Set)]
    pub network_policy: bool,
    /// Also enforce ClusterNetworkPolicies (policy.networking.k8s.io
    /// v1beta1, the SIG Network policy API), whose CRD must be installed.
    #[arg(long, env = "WEFT_CLUSTER_NETWORK_POLICY", default_value_t = false, action = clap::ArgAction::Set)]
    pub cluster_network_policy: bool,
    /// Where policy learns of other nodes' pods: `pods` watches every Pod
    /// in the cluster; `endpoints` watches the PodEndpoints the operator
    /// publishes (its `--publish-pod-endpoints` must be on) and only this
    /// node's Pods, a fraction of the apiserver's work per node at scale.
    #[arg(long, env = "WEFT_POD_SOURCE", value_enum, default_value = "pods")]
    pub pod_source: crate::policy::caches::PodSource,
    /// What a policy's deny does with a packet: `reject` drops it and
    /// answers (a TCP reset, ICMP "administratively prohibited" otherwise),
    /// so the client fails at once; `drop` drops it silently, and the
    /// client waits for its own timeout.
    #[arg(long, env = "WEFT_POLICY_DENY_ACTION", default_value = "reject")]
    pub policy_deny_action: crate::policy::render::DenyAction,
    /// Log packets that policy drops: the NFLOG group the drop rules copy
    /// them to, which this agent reads (one log line per packet). Off
    /// without it. Pick a group no other program on the node reads.
    #[arg(long, env = "WEFT_POLICY_DROP_LOG_GROUP", value_parser = clap::value_parser!(u16).range(1..))]
    pub policy_drop_log_group: Option<u16>,
    /// With the drop log on: at most this many packets a second are logged,
    /// per drop rule.
    #[arg(long, env = "WEFT_POLICY_DROP_LOG_RATE", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub policy_drop_log_rate: u32,
    /// With the drop log on: write a log line per packet logged (off: the
    /// records only feed the flow records).
    #[arg(long, env = "WEFT_POLICY_DROP_LOG_LINES", default_value_t = true, action = clap::ArgAction::Set)]
    pub policy_drop_log_lines: bool,
    /// Record this node's pods' flows (connections opened and closed,
    /// packets policy denied) in a ring of this many records, served on the
    /// agent's socket; 0 turns recording off. Denied packets are recorded
    /// when the drop log is on (`--policy-drop-log-group`).
    #[arg(long, env = "WEFT_FLOWS_CAPACITY", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub flows_capacity: u32,
    /// Also serve the flow records over TCP here, for the operator's
    /// flows.weft.dev API, to --flows-reader only.
    #[arg(long, env = "WEFT_FLOWS_LISTEN", requires = "flows_reader")]
    pub flows_listen: Option<SocketAddr>,
    /// The one user --flows-listen serves (the operator's service account,
    /// `system:serviceaccount:NAMESPACE:NAME`), proven by its token for the
    /// audience flows.weft.dev.
    #[arg(long, env = "WEFT_FLOWS_READER")]
    pub flows_reader: Option<String>,
    /// Addresses for /metrics, /healthz and /readyz, comma-separated (the
    /// chart: loopback for the probes and the node IP for Prometheus).
    #[arg(long, env = "WEFT_METRICS_ADDR", default_value = "0.0.0.0:9646", value_delimiter = ',')]
    pub metrics_addr: Vec<SocketAddr>,
}

/// `ipv4` or `ipv6` (the Subnet status spells it the same).
fn parse_vxlan_underlay(text: &str) -> Result<weft_api::VxlanUnderlay, String> {
    match text {
        "ipv4" => Ok(weft_api::VxlanUnderlay::Ipv4),
        "ipv6" => Ok(weft_api::VxlanUnderlay::Ipv6),
        _ => Err(format!("{text:?} is not one of ipv4, ipv6")),
    }
}

impl Config {
    /// This node's IPv6 address: the first of `--node-ips`.
    pub fn node_ipv6(&self) -> Option<std::net::Ipv6Addr> {
        self.node_ips.iter().find_map(|ip| match ip {
            std::net::IpAddr::V6(v6) => Some(*v6),
            std::net::IpAddr::V4(_) => None,
        })
    }

    /// The policy drop log, if it is on.
    pub fn drop_log(&self) -> Option<crate::policy::render::DropLog> {
        self.policy_drop_log_group
            .map(|group| crate::policy::render::DropLog { group, per_second: self.policy_drop_log_rate })
    }

    /// The resync period every reconcile loop uses.
    pub fn resync(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.resync_seconds.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vxlan_underlay_is_ipv4_unless_told_and_a_typo_is_refused() {
        let parse = |args: &[&str]| Config::try_parse_from([&["weft-agent"], args].concat());
        assert_eq!(parse(&[]).expect("defaults").vxlan_underlay, weft_api::VxlanUnderlay::Ipv4);
        let v6 = parse(&["--vxlan-underlay", "ipv6"]).expect("ipv6");
        assert_eq!(v6.vxlan_underlay, weft_api::VxlanUnderlay::Ipv6);
        let err = parse(&["--vxlan-underlay", "IPv6"]).expect_err("a typo").to_string();
        assert!(err.contains("\"IPv6\" is not one of ipv4, ipv6"), "{err}");
    }
}
