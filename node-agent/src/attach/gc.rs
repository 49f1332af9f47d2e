//! GC: release every attachment the runtime no longer knows about, and any
//! veth of ours that has no record.

use std::collections::HashSet;

use super::Attacher;
use super::{AttachError, deadline};
use crate::dataplane::link;
use crate::dataplane::link::HOST_VETH_PREFIX;
use crate::ipam::Key;

impl Attacher {
    /// Releases what `valid` does not list; returns how many attachments.
    pub async fn gc(&self, valid: &HashSet<Key>) -> Result<u32, AttachError> {
        let mut released = 0;
        for (ip, record) in self.ipam.all() {
            // A pending record is an ADD in flight, which either finishes or
            // undoes itself (it runs to its end even if weft-cni goes away);
            // it is not the runtime's to list yet.
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

    /// Deletes veths named like ours that no record accounts for (pending
    /// ones included: an ADD in flight holds its record from before its veth).
    pub async fn remove_orphan_veths(&self) -> Result<usize, AttachError> {
        let unreadable = self.ipam.unreadable();
        if !unreadable.is_empty() {
            // One of those veths may be the pod of an unreadable record.
            tracing::warn!(
                records = unreadable.len(),
                "keeping veths without a record while IPAM records are unreadable"
            );
            return Ok(0);
        }
        let known: HashSet<String> = self.ipam.all().into_iter().map(|(_, r)| r.host_veth).collect();
        let veths = deadline("list veths", link::veths_with_prefix(&self.host, HOST_VETH_PREFIX)).await?;
        let mut removed = 0;
        for name in veths.into_iter().filter(|n| !known.contains(n)) {
            tracing::info!(veth = %name, "removing a veth that no allocation accounts for");
            deadline(&format!("delete veth {name}"), link::delete(&self.host, &name)).await?;
            removed += 1;
        }
        Ok(removed)
    }
}
