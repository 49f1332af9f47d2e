//! GC: release every attachment the runtime no longer knows about, and any
//! veth of ours that has no record.

use std::collections::HashSet;

use weft_proto::ErrorCode;
use weft_proto::cni::v1::{CniError, GcRequest};

use crate::agent::{Agent, HOST_VETH_PREFIX};
use crate::dataplane::link;
use crate::ipam::Key;

impl Agent {
    /// Returns how many attachments were released.
    pub async fn gc(&self, req: &GcRequest) -> Result<u32, CniError> {
        let valid: HashSet<Key> = req
            .valid_attachments
            .iter()
            .map(|a| Key { container_id: a.container_id.clone(), ifname: a.ifname.clone() })
            .collect();
        let mut released = 0;
        for (ip, record) in self.ipam.all() {
            // A pending record is an ADD in flight; it is not the runtime's to list yet.
            if self.ipam.is_pending(ip) || valid.contains(&record.key()) {
                continue;
            }
            tracing::info!(container = %record.container_id, ifname = %record.ifname, %ip, "GC releases a stale attachment");
            self.teardown(&record.key(), &record.host_veth).await?;
            released += 1;
        }
        self.remove_orphan_veths().await?;
        Ok(released)
    }

    /// Deletes veths named like ours that no record accounts for.
    pub async fn remove_orphan_veths(&self) -> Result<usize, CniError> {
        let known: HashSet<String> = self.ipam.all().into_iter().map(|(_, r)| r.host_veth).collect();
        let veths = link::veths_with_prefix(&self.host, HOST_VETH_PREFIX)
            .await
            .map_err(|e| ErrorCode::Internal.error(e.to_string()))?;
        let mut removed = 0;
        for name in veths.into_iter().filter(|n| !known.contains(n)) {
            tracing::info!(veth = %name, "removing a veth that no allocation accounts for");
            link::delete(&self.host, &name).await.map_err(|e| ErrorCode::Internal.error(e.to_string()))?;
            removed += 1;
        }
        Ok(removed)
    }
}
