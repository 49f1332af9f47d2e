//! Operator configuration from flags and environment (later: Helm values).

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use ipnet::IpNet;

use crate::ipam::{IpamError, Pool, same_family};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Vxlan,
    HostGw,
    Udp,
    Wireguard,
}

impl From<BackendArg> for weft_api::Backend {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Vxlan => weft_api::Backend::Vxlan,
            BackendArg::HostGw => weft_api::Backend::HostGw,
            BackendArg::Udp => weft_api::Backend::Udp,
            BackendArg::Wireguard => weft_api::Backend::Wireguard,
        }
    }
}

/// Weft operator: hands out per-node Subnet leases from the cluster CIDR.
#[derive(Debug, Clone, Parser)]
#[command(name = "weft-operator", version)]
pub struct Config {
    /// Cluster pod CIDR that node subnets are carved from.
    #[arg(long, env = "WEFT_CLUSTER_CIDR", default_value = "10.244.0.0/16")]
    pub cluster_cidr: IpNet,

    /// Prefix length of each node's subnet.
    #[arg(long, env = "WEFT_NODE_PREFIX_LENGTH", default_value_t = 24)]
    pub node_prefix_length: u8,

    /// A cluster CIDR of the other address family, for dual-stack: every
    /// node's Subnet then lists a block of each (`spec.cidrs`).
    #[arg(long, env = "WEFT_SECONDARY_CLUSTER_CIDR")]
    pub secondary_cluster_cidr: Option<IpNet>,

    /// Prefix length of each node's block of the secondary cluster CIDR
    /// (default: /64 for IPv6, /24 for IPv4).
    #[arg(long, env = "WEFT_SECONDARY_NODE_PREFIX_LENGTH")]
    pub secondary_node_prefix_length: Option<u8>,

    /// Encapsulation between nodes.
    #[arg(long, env = "WEFT_BACKEND", value_enum, default_value = "vxlan")]
    pub backend: BackendArg,

    /// VXLAN network identifier written into vxlan Subnets.
    #[arg(long, env = "WEFT_VNI", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16_777_215))]
    pub vni: u32,

    /// MTU override for pod interfaces (default: agents derive it).
    #[arg(long, env = "WEFT_MTU", value_parser = clap::value_parser!(u32).range(576..=9216))]
    pub mtu: Option<u32>,

    /// Only manage Nodes matching this label selector (default: all).
    #[arg(long, env = "WEFT_NODE_SELECTOR")]
    pub node_selector: Option<String>,

    /// Address of the /metrics, /healthz and /readyz server.
    #[arg(long, env = "WEFT_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,

    /// Use a Lease so that only one replica allocates at a time.
    #[arg(long, env = "WEFT_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,

    /// Namespace of the leader-election Lease.
    #[arg(long, env = "WEFT_LEADER_ELECTION_NAMESPACE", default_value = "kube-system")]
    pub leader_election_namespace: String,

    /// Name of the leader-election Lease.
    #[arg(long, env = "WEFT_LEADER_ELECTION_NAME", default_value = "weft-operator")]
    pub leader_election_name: String,

    /// Identity in the Lease (default: POD_NAME, else hostname-pid).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// Seconds a Lease stays valid without renewal.
    #[arg(long, env = "WEFT_LEASE_DURATION_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub lease_duration_seconds: u32,

    /// Seconds the leader keeps trying to renew before giving up leadership.
    #[arg(long, env = "WEFT_RENEW_DEADLINE_SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub renew_deadline_seconds: u32,

    /// Seconds between acquire/renew attempts.
    #[arg(long, env = "WEFT_RETRY_PERIOD_SECONDS", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=600))]
    pub retry_period_seconds: u32,

    /// Seconds a Node must stay absent before its Subnet is withdrawn (a
    /// node that re-registers keeps its lease), and that the agent of a gone
    /// node is given to let the block go itself.
    #[arg(long, env = "WEFT_RELEASE_GRACE_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u32).range(0..=86400))]
    pub release_grace_seconds: u32,

    /// The one resync period of every controller (Subnets, host ports,
    /// policies), in seconds; changes are acted on at once anyway.
    #[arg(long, env = "WEFT_RESYNC_SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=86400))]
    pub resync_seconds: u32,

    /// Keep the status of ClusterNetworkPolicies (policy.networking.k8s.io
    /// v1beta1), which the agents enforce with the same setting.
    #[arg(long, env = "WEFT_CLUSTER_NETWORK_POLICY", default_value_t = false, action = clap::ArgAction::Set)]
    pub cluster_network_policy: bool,
    /// Publish a PodEndpoint (what policy reads of a pod) for every pod on
    /// the pod network, for agents run with `--pod-source endpoints`: they
    /// then watch those instead of every Pod. Its CRD must be installed.
    #[arg(long, env = "WEFT_PUBLISH_POD_ENDPOINTS", default_value_t = false, action = clap::ArgAction::Set)]
    pub publish_pod_endpoints: bool,

    /// Serve flows.weft.dev (every node's flow records through the
    /// Kubernetes API, as RBAC lets each caller read them) on this address;
    /// off without it. Needs --flows-api-cert and --flows-api-key.
    #[arg(long, env = "WEFT_FLOWS_API_ADDR", requires_all = ["flows_api_cert", "flows_api_key"])]
    pub flows_api_addr: Option<SocketAddr>,

    /// The flows API's serving certificate (PEM; the APIService's caBundle signs it).
    #[arg(long, env = "WEFT_FLOWS_API_CERT")]
    pub flows_api_cert: Option<std::path::PathBuf>,

    /// The flows API's serving key (PEM).
    #[arg(long, env = "WEFT_FLOWS_API_KEY")]
    pub flows_api_key: Option<std::path::PathBuf>,

    /// The operator's service account token for the agents' flows listeners
    /// (projected, audience flows.weft.dev).
    #[arg(long, env = "WEFT_FLOWS_TOKEN_FILE", default_value = "/var/run/secrets/weft/flows/token")]
    pub flows_token_file: std::path::PathBuf,

    /// Where the agents are: their namespace, label selector and flows port.
    #[arg(long, env = "WEFT_FLOWS_AGENT_NAMESPACE", default_value = "weft-system")]
    pub flows_agent_namespace: String,

    #[arg(
        long,
        env = "WEFT_FLOWS_AGENT_SELECTOR",
        default_value = "app.kubernetes.io/name=weft,app.kubernetes.io/component=agent"
    )]
    pub flows_agent_selector: String,

    #[arg(long, env = "WEFT_FLOWS_AGENT_PORT", default_value_t = 9654)]
    pub flows_agent_port: u16,

    /// Maximum reconciles running at once per controller. Nodes waiting
    /// for a lease are served in batches of those waiting: at 64, 1,000
    /// joining nodes took 5.1–5.5 s to lease; at 256, 3.7–4.2 s.
    #[arg(long, env = "WEFT_CONCURRENCY", default_value_t = 256)]
    pub concurrency: u16,

    /// Delete every Subnet and HostPortAllocation, then exit (the chart's
    /// post-delete hook, after the agents and the operator are gone).
    #[arg(long)]
    pub uninstall: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid --cluster-cidr/--node-prefix-length: {0}")]
    Pool(#[from] IpamError),
    #[error("invalid --secondary-cluster-cidr/--secondary-node-prefix-length: {0}")]
    SecondaryPool(IpamError),
    #[error("--secondary-cluster-cidr {secondary} must be of the other address family than --cluster-cidr {primary}")]
    SameFamily { primary: IpNet, secondary: IpNet },
    #[error("--renew-deadline-seconds ({renew}) must be below --lease-duration-seconds ({lease})")]
    RenewDeadline { renew: u32, lease: u32 },
}

impl Config {
    /// The address pool, validated.
    pub fn pool(&self) -> Result<Pool, ConfigError> {
        Ok(Pool::new(self.cluster_cidr, self.node_prefix_length)?)
    }

    /// The pool of the other address family in a dual-stack cluster, validated.
    pub fn secondary_pool(&self) -> Result<Option<Pool>, ConfigError> {
        let Some(secondary) = self.secondary_cluster_cidr else { return Ok(None) };
        let primary = self.cluster_cidr;
        if same_family(&primary, &secondary) {
            return Err(ConfigError::SameFamily { primary, secondary });
        }
        let default_prefix = if matches!(secondary, IpNet::V6(_)) { 64 } else { 24 };
        let prefix = self.secondary_node_prefix_length.unwrap_or(default_prefix);
        Pool::new(secondary, prefix).map(Some).map_err(ConfigError::SecondaryPool)
    }

    /// Checks cross-field constraints.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.pool()?;
        self.secondary_pool()?;
        if self.leader_elect && self.renew_deadline_seconds >= self.lease_duration_seconds {
            return Err(ConfigError::RenewDeadline {
                renew: self.renew_deadline_seconds,
                lease: self.lease_duration_seconds,
            });
        }
        Ok(())
    }

    pub fn lease_duration(&self) -> Duration {
        Duration::from_secs(self.lease_duration_seconds.into())
    }

    pub fn renew_deadline(&self) -> Duration {
        Duration::from_secs(self.renew_deadline_seconds.into())
    }

    pub fn resync(&self) -> Duration {
        Duration::from_secs(self.resync_seconds.into())
    }

    pub fn release_grace(&self) -> Duration {
        Duration::from_secs(self.release_grace_seconds.into())
    }

    pub fn retry_period(&self) -> Duration {
        Duration::from_secs(self.retry_period_seconds.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let cfg = Config::try_parse_from(["weft-operator"]).expect("defaults parse");
        cfg.validate().expect("defaults valid");
        assert_eq!(cfg.pool().expect("pool").capacity(), 256);
    }

    #[test]
    fn rejects_bad_values() {
        assert!(Config::try_parse_from(["x", "--vni", "0"]).is_err());
        assert!(Config::try_parse_from(["x", "--mtu", "100"]).is_err());
        assert!(Config::try_parse_from(["x", "--cluster-cidr", "10.0.0.0/33"]).is_err());
        let cfg = Config::try_parse_from(["x", "--node-prefix-length", "8"]).expect("parses");
        assert!(cfg.validate().is_err());
        let cfg = Config::try_parse_from(["x", "--lease-duration-seconds", "5", "--renew-deadline-seconds", "5"])
            .expect("parses");
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn dual_stack_needs_the_other_family() {
        let dual = Config::try_parse_from(["x", "--secondary-cluster-cidr", "fd00:10:244::/56"]).expect("parses");
        dual.validate().expect("valid");
        assert_eq!(dual.secondary_pool().expect("pool").expect("secondary").capacity(), 256, "/64s of a /56");
        let six_first =
            Config::try_parse_from(["x", "--cluster-cidr", "fd00::/48", "--secondary-cluster-cidr", "10.9.0.0/16"])
                .expect("parses");
        assert_eq!(six_first.secondary_pool().expect("pool").expect("secondary").node_prefix(), 24);
        let same = Config::try_parse_from(["x", "--secondary-cluster-cidr", "10.9.0.0/16"]).expect("parses");
        let e = same.validate().expect_err("same family").to_string();
        assert!(e.contains("other address family"), "{e}");
        let small = Config::try_parse_from([
            "x",
            "--secondary-cluster-cidr",
            "fd00::/64",
            "--secondary-node-prefix-length",
            "56",
        ])
        .expect("parses");
        assert!(small.validate().expect_err("prefix").to_string().contains("--secondary-node-prefix-length"));
    }
}
