//! The node settings an overlay node needs, kept level-triggered: IPv4
//! forwarding (pods on other nodes are reached through it; IPv6 forwarding
//! too on a dual-stack node) and the
//! masquerade rules for pod traffic leaving the cluster. A `sysctl --system`
//! or a firewall reload undoes them silently; they are checked at start-up
//! and every resync period, and put back with a warning and a count in
//! `weft_agent_node_setting_repairs_total`.

use std::sync::Arc;
use std::time::Duration;

use ipnet::Ipv4Net;

use crate::agent::Agent;
use crate::dataplane::{masquerade, sysctl};

/// What an overlay node needs: forwarding, and masquerading of traffic from
/// `pod_cidr` leaving `cluster_cidr`. Returns the settings that had to be
/// put back. Blocking (sysctl files, iptables): call off the runtime.
pub fn ensure(pod_cidr: Ipv4Net, cluster_cidr: Ipv4Net, ipv6: bool) -> anyhow::Result<Vec<&'static str>> {
    let mut repaired = Vec::new();
    if sysctl::ensure_ipv4_forwarding()? {
        repaired.push("ip_forward");
    }
    if ipv6 && sysctl::ensure_ipv6_forwarding()? {
        repaired.push("ipv6_forwarding");
    }
    if masquerade::ensure(pod_cidr, cluster_cidr)? {
        repaired.push("masquerade");
    }
    Ok(repaired)
}

/// Checks every `period`, for as long as the agent runs (the first check is
/// start-up's own, in `setup_overlay`).
pub async fn run(agent: Arc<Agent>, pod_cidr: Ipv4Net, cluster_cidr: Ipv4Net, period: Duration) {
    loop {
        tokio::time::sleep(period).await;
        let ipv6 = agent.ipv6.is_some();
        match tokio::task::spawn_blocking(move || ensure(pod_cidr, cluster_cidr, ipv6)).await {
            Ok(Ok(repaired)) => {
                for setting in repaired {
                    tracing::warn!(setting, "a node setting the overlay needs had been undone; put it back");
                    agent.metrics.node_setting_repaired(setting);
                }
            }
            Ok(Err(e)) => tracing::error!(error = %e, "cannot check the overlay's node settings"),
            Err(e) => tracing::error!(error = %e, "the node settings task failed"),
        }
    }
}
