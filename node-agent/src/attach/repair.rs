//! The node's side of its attachments, kept level-triggered: at start-up and
//! every resync period the bridge is set up again if it went (with its
//! gateway address), the node settings the pods' mode needs are turned back
//! on, and a finished routed pod whose /32 (or /128) route is missing gets it back
//! with its neighbour entry (a route someone deleted, or the routes the
//! kernel flushed along with weft0's gateway address, their source), and
//! the pods' source guard is written again if someone changed it.
//! Health checks only observe; repairs happen here.

use std::sync::Arc;

use super::Attacher;
use super::names::pod_mac;
use super::{AttachError, driver, off_thread};
use crate::dataplane::link::{self, PodAddress};
use crate::dataplane::netlink_blocking::BlockingNetlink;
use crate::dataplane::{DataplaneError, kernel_op};
use crate::guard::Write;

impl Attacher {
    /// Restores the routes to routed pods that are missing; returns how many pods needed it.
    pub async fn repair_pod_routes(&self) -> Result<u64, AttachError> {
        let ipam = &self.ipam;
        let routed: Vec<_> = ipam
            .all()
            .into_iter()
            .filter(|(ip, r)| driver(r.attachment).routes_to_pod() && !ipam.is_pending(*ip))
            .collect();
        if routed.is_empty() {
            return Ok(0);
        }
        let kernel = |what: &str| {
            let what = what.to_owned();
            move |source| AttachError::Kernel { what, source }
        };
        let present = link::pod_routes(&self.host).await.map_err(kernel("list the node's routes"))?;
        // Repairs are rare and each takes the kernel microseconds: the
        // blocking socket ADD uses serves here as well.
        let mut nl = BlockingNetlink::new().map_err(kernel_op("open a netlink socket")).map_err(kernel("repair"))?;
        let mut restored = 0;
        for (ip, record) in routed {
            // No veth: a DEL or GC is removing this pod, or reconciliation will.
            let Some(veth) =
                link::by_name(&self.host, &record.host_veth).await.map_err(kernel("look up a host veth"))?
            else {
                continue;
            };
            let index = veth.header.index;
            let addresses: Vec<_> = self.pod_addresses(ip, &record).iter().map(PodAddress::pair).collect();
            if addresses.iter().all(|(a, _)| present.contains(&(*a, index))) {
                continue;
            }
            let pod_mac = pod_mac(&record);
            match link::route_to_pod(&mut nl, index, &addresses, pod_mac) {
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

    /// One pass of the repair loop: the bridge, the node settings of the
    /// mode new pods get, the routes to routed pods.
    pub async fn repair_node_side(&self) -> Result<(), AttachError> {
        self.ensure_bridge(true).await?;
        let mode = self.attachment();
        let ipv6 = self.ipv6_pods();
        let repaired =
            off_thread("check node settings", move || driver(mode).ensure_node_settings(ipv6)).await?.map_err(
                |source: DataplaneError| AttachError::Kernel { what: format!("node settings for {mode} pods"), source },
            )?;
        for setting in repaired {
            tracing::warn!(%mode, setting, "a node setting {mode} pods need had been turned off; turned it back on");
            self.metrics.node_setting_repaired(setting);
        }
        self.repair_pod_routes().await?;
        let guard = self.guard_pods(Write::Full).await?;
        if guard.changed {
            tracing::warn!("the pods' source guard had been changed or removed; wrote it again");
            self.metrics.guard_repairs.inc();
        }
        if let Some(dropped) = guard.dropped {
            self.metrics.guard_dropped.set(i64::try_from(dropped).unwrap_or(i64::MAX));
        }
        Ok(())
    }
}

/// Repairs every resync period, for as long as the agent runs.
pub async fn run(attacher: Arc<Attacher>) {
    let period = attacher.config.resync();
    loop {
        tokio::time::sleep(period).await;
        if let Err(e) = attacher.repair_node_side().await {
            tracing::error!(error = %e, "cannot repair the node's side of its pods");
        }
    }
}
