//! DEL: remove the host ports and the veth, release the address. Always
//! idempotent: it succeeds when the namespace, the veth or the record are
//! already gone, and it needs neither prevResult nor CNI_NETNS.

use std::sync::Arc;

use super::Attacher;
use super::names::host_veth_name;
use super::{AttachError, deadline};
use crate::dataplane::link;
use crate::guard::Write;
use crate::ipam::Key;

impl Attacher {
    pub async fn del(&self, key: &Key) -> Result<(), AttachError> {
        // The name is derived from the key, so a lost record cannot leak the veth.
        let host_veth = self.ipam.get(key).map(|(_, r)| r.host_veth).unwrap_or_else(|| host_veth_name(key));
        self.teardown(key, &host_veth).await
    }

    /// Removes an attachment's host ports, deletes its host veth (which
    /// takes the pod's end and the node's route with it) and releases its
    /// address. Idempotent: every step succeeds when there is nothing left.
    pub async fn teardown(&self, key: &Key, host_veth: &str) -> Result<(), AttachError> {
        // The rules and the veth are independent: remove both at once.
        let what = format!("delete veth {host_veth}");
        let (ports, veth) =
            tokio::join!(self.hostports.release(key), deadline(&what, link::delete(&self.host, host_veth)));
        self.metrics.set_host_port_usage(self.hostports.usage());
        ports?;
        veth?;
        let ipam = Arc::clone(&self.ipam);
        let key = key.clone();
        let released = tokio::task::spawn_blocking(move || ipam.release(&key))
            .await
            .map_err(|e| AttachError::Internal(format!("IPAM release task failed: {e}")))??;
        if let (Some(attached), Some((_, record))) = (&self.policy_pods, &released) {
            attached.forget(&record.pod, &record.container_id);
        }
        // The veth is gone, so its elements allow nothing: a failure here
        // costs no isolation, and the next resync removes them.
        if let Err(e) = self.guard_pods(Write::Update).await {
            tracing::warn!(veth = host_veth, error = %e, "cannot remove a deleted pod from the source guard; the next resync will");
        }
        Ok(())
    }
}
