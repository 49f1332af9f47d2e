//! Start-up reconciliation of IPAM records with the kernel, so that an agent
//! killed in the middle of ADDs leaks neither addresses nor interfaces.

use std::path::Path;

use crate::agent::Agent;
use crate::dataplane::link;
use crate::ipam::RecordState;

impl Agent {
    /// Keeps a record only if its ADD finished, its namespace still exists
    /// and its host veth is there; everything else is torn down. Then removes
    /// veths of ours that no record accounts for. Returns how many records
    /// were released.
    pub async fn reconcile_on_start(&self) -> anyhow::Result<usize> {
        let mut released = 0;
        for (ip, record) in self.ipam.all() {
            let veth_present = link::by_name(&self.host, &record.host_veth).await?.is_some();
            let keep = record.state == RecordState::Ready && Path::new(&record.netns).exists() && veth_present;
            if keep {
                continue;
            }
            tracing::info!(
                container = %record.container_id, ifname = %record.ifname, %ip,
                state = ?record.state, veth_present, "releasing an allocation whose pod is gone or whose ADD never finished"
            );
            self.teardown(&record.key(), &record.host_veth).await.map_err(|e| anyhow::anyhow!(e.msg))?;
            released += 1;
        }
        let orphans = self.remove_orphan_veths().await.map_err(|e| anyhow::anyhow!(e.msg))?;
        self.metrics.released_on_start.inc_by(released as u64);
        tracing::info!(released, orphans, "start-up reconciliation done");
        Ok(released)
    }
}
