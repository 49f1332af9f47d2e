//! DEL: remove the veth and release the address. Always idempotent: it
//! succeeds when the namespace, the veth or the record are already gone, and
//! it needs neither prevResult nor CNI_NETNS.

use weft_proto::cni::v1::{CniError, CniRequest};

use super::key_of;
use crate::agent::{Agent, host_veth_name};

impl Agent {
    pub async fn del(&self, req: &CniRequest) -> Result<(), CniError> {
        let key = key_of(req)?;
        // The name is derived from the key, so a lost record cannot leak the veth.
        let host_veth = self.ipam.get(&key).map(|(_, r)| r.host_veth).unwrap_or_else(|| host_veth_name(&key));
        self.teardown(&key, &host_veth).await
    }
}
