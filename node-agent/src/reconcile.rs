//! Start-up reconciliation of IPAM records with the kernel, so that an agent
//! killed in the middle of ADDs leaks neither addresses nor interfaces.

use std::net::Ipv4Addr;
use std::path::Path;

use crate::agent::Agent;
use crate::dataplane::link;
use crate::ipam::{Pool, Record};
use crate::netns::Netns;

impl Agent {
    /// Keeps a record only if its host veth exists and the pod's interface
    /// carries the address and routes via the gateway, as a finished ADD
    /// leaves it; everything else is torn down. Then removes veths of ours
    /// that no record accounts for, restores missing routes to routed pods,
    /// and settles how new pods are attached. Returns how many records were
    /// released.
    pub async fn reconcile_on_start(&self) -> anyhow::Result<usize> {
        let mut released = 0;
        let pool = *self.ipam.pool();
        for (ip, record) in self.ipam.all() {
            let veth_present = link::by_name(&self.host, &record.host_veth).await?.is_some();
            let complete = veth_present && self.attachment_complete(ip, &record, &pool).await;
            if complete {
                continue;
            }
            tracing::info!(
                container = %record.container_id, ifname = %record.ifname, %ip,
                veth_present, "releasing an allocation whose pod is gone or whose ADD never finished"
            );
            self.teardown(&record.key(), &record.host_veth).await.map_err(|e| anyhow::anyhow!(e.msg))?;
            released += 1;
        }
        let orphans = self.remove_orphan_veths().await.map_err(|e| anyhow::anyhow!(e.msg))?;
        // Routed pods kept are reached through their own routes: put back any
        // that went (with weft0's address, say) while the agent was down.
        self.repair_pod_routes().await?;
        self.metrics.released_on_start.inc_by(released as u64);
        let attachment = self.settle_attachment();
        tracing::info!(released, orphans, %attachment, "start-up reconciliation done");
        Ok(released)
    }

    async fn attachment_complete(&self, ip: Ipv4Addr, record: &Record, pool: &Pool) -> bool {
        let address = record.attachment.pod_address(ip, pool.cidr());
        let Ok(pod) = Netns::open(Path::new(&record.netns)).await else { return false };
        link::pod_is_attached(&pod, &record.ifname, address, pool.gateway()).await.unwrap_or(false)
    }
}
