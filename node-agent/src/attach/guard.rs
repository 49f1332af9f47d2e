//! The source guard's view of this node's attachments: every record's host
//! veth, pod MAC and addresses (see `crate::guard`).

use super::AttachError;
use super::Attacher;
use super::names::pod_mac;
use crate::guard::{GuardedPort, Write, Written};

impl Attacher {
    /// Makes the source guard allow exactly the pods in the IPAM records,
    /// but not those whose ADD is still running: an ADD opens its pod's
    /// veth last.
    pub async fn guard_pods(&self, how: Write) -> Result<Written, AttachError> {
        self.guard.write(how, || self.guarded_ports()).await.map_err(|e| AttachError::Internal(e.to_string()))
    }

    fn guarded_ports(&self) -> Vec<GuardedPort> {
        self.ipam
            .all()
            .into_iter()
            .filter(|(ip, _)| !self.ipam.is_pending(*ip))
            .map(|(ip, record)| GuardedPort {
                pod_mac: pod_mac(&record),
                addrs: self.pod_addresses(ip, &record).iter().map(|a| a.address.addr()).collect(),
                mode: record.attachment,
                host_veth: record.host_veth,
            })
            .collect()
    }
}
