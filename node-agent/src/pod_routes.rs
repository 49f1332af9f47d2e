//! The node's routes to routed pods (see `attachment`), kept level-triggered:
//! at start-up and every resync period, a finished routed pod whose /32 route
//! is missing gets it back, with its neighbour entry. A route someone deleted
//! comes back, and so do the routes the kernel flushes along with weft0's
//! gateway address (their source), since the bridge is set up again first.

use std::sync::Arc;
use std::time::Duration;

use crate::agent::{Agent, veth_mac};
use crate::attachment::Attachment;
use crate::dataplane::netlink_blocking::BlockingNetlink;
use crate::dataplane::{DataplaneError, kernel_op, link};

impl Agent {
    /// Restores what is missing; returns how many pods needed it.
    pub async fn repair_pod_routes(&self) -> Result<u64, DataplaneError> {
        let ipam = &self.ipam;
        let routed: Vec<_> = ipam
            .all()
            .into_iter()
            .filter(|(ip, r)| r.attachment == Attachment::Routed && !ipam.is_pending(*ip))
            .collect();
        if routed.is_empty() {
            return Ok(0);
        }
        self.ensure_bridge(true).await.map_err(|e| DataplaneError::Unexpected(e.msg))?;
        let present = link::pod_routes(&self.host).await?;
        let gateway = ipam.pool().gateway();
        // Repairs are rare and each takes the kernel microseconds: the
        // blocking socket ADD uses serves here as well.
        let mut nl = BlockingNetlink::new().map_err(kernel_op("open a netlink socket"))?;
        let mut restored = 0;
        for (ip, record) in routed {
            // No veth: a DEL or GC is removing this pod, or reconciliation will.
            let Some(veth) = link::by_name(&self.host, &record.host_veth).await? else { continue };
            let index = veth.header.index;
            if present.contains(&(ip, index)) {
                continue;
            }
            let pod_mac = veth_mac(&record.key(), true);
            match link::route_to_pod(&mut nl, index, ip, gateway, pod_mac) {
                Ok(()) => {
                    tracing::warn!(container = %record.container_id, %ip, veth = %record.host_veth, "restored the missing route to a routed pod");
                    restored += 1;
                }
                // One pod's failure (its veth going away meanwhile) must not
                // keep the others unrepaired.
                Err(e) => {
                    tracing::error!(container = %record.container_id, %ip, error = %e, "cannot restore the route to a routed pod")
                }
            }
        }
        self.metrics.pod_route_repairs.inc_by(restored);
        Ok(restored)
    }
}

/// Repairs every resync period, for as long as the agent runs.
pub async fn run(agent: Arc<Agent>) {
    let period = Duration::from_secs(agent.config.resync_seconds.max(1));
    loop {
        tokio::time::sleep(period).await;
        if let Err(e) = agent.repair_pod_routes().await {
            tracing::error!(error = %e, "cannot check the routes to routed pods");
        }
    }
}
