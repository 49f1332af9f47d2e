//! The source guard's view of this node's attachments: every record's host
//! veth, pod MAC and addresses (see `crate::guard`).

use super::AttachError;
use crate::agent::{Agent, veth_mac};
use crate::guard::{GuardedPort, Write};

impl Agent {
    /// Makes the source guard allow exactly the pods in the IPAM records,
    /// but not those whose ADD is still running: an ADD opens its pod's
    /// veth last. `Ok(true)` when something had to be written.
    pub async fn guard_pods(&self, how: Write) -> Result<bool, AttachError> {
        self.guard.write(how, || self.guarded_ports()).await.map_err(|e| AttachError::Internal(e.to_string()))
    }

    fn guarded_ports(&self) -> Vec<GuardedPort> {
        self.ipam
            .all()
            .into_iter()
            .filter(|(ip, _)| !self.ipam.is_pending(*ip))
            .map(|(ip, record)| GuardedPort {
                pod_mac: veth_mac(&record.key(), true),
                addrs: self.pod_addresses(ip, &record).iter().map(|a| a.address.addr()).collect(),
                mode: record.attachment,
                host_veth: record.host_veth,
            })
            .collect()
    }

    /// Reads the guard's drop counters into the metrics.
    pub async fn count_guard_drops(&self) {
        match self.guard.dropped().await {
            Ok(n) => drop(self.metrics.guard_dropped.set(i64::try_from(n).unwrap_or(i64::MAX))),
            Err(e) => tracing::warn!(error = %e, "cannot read the source guard's counters"),
        }
    }
}
