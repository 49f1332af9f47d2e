//! STATUS (and /readyz): ready when an ADD could succeed now. It only
//! observes, takes no lock ADD takes, uses a netlink socket ADD does not
//! and changes nothing: it is served to anyone who can reach the node, and
//! repairs are the repair loop's.

use super::Attacher;
use super::{AttachError, deadline};
use crate::dataplane::link;

impl Attacher {
    pub async fn readiness(&self) -> Result<(), AttachError> {
        if let Some(why) = self.lease.reason() {
            return Err(AttachError::NotReady(format!("this node's pod CIDR lease is withdrawn: {why}")));
        }
        let bridge = &self.config.bridge;
        let not_ready = |why: String| AttachError::NotReady(format!("the pod network is not set up: {why}"));
        let Some(link) = deadline("look up the bridge", link::by_name(&self.health, bridge)).await? else {
            return Err(not_ready(format!("bridge {bridge} is missing")));
        };
        if !link::is_up(&link) {
            return Err(not_ready(format!("bridge {bridge} is down")));
        }
        let addresses =
            deadline("list the bridge's addresses", link::all_addresses(&self.health, link.header.index)).await?;
        if let Some(gateway) = self.gateways().into_iter().find(|g| !addresses.contains(g)) {
            return Err(not_ready(format!("bridge {bridge} lacks the gateway address {gateway}")));
        }
        let dir = self.config.state_dir.join("ipam");
        if !dir.is_dir() {
            return Err(AttachError::NotReady(format!("IPAM state directory {} is missing", dir.display())));
        }
        let (_, free) = self.ipam.usage();
        if free == 0 {
            return Err(AttachError::NoAddressLeft(format!("no free pod address left in {}", self.ipam.pool().cidr())));
        }
        Ok(())
    }
}
