//! Reading an attachment from the kernel, for CHECK and start-up
//! reconciliation. Every call has a deadline; what cannot be read inside the
//! pod is recorded as such ([`ObservedPod::Unreadable`]), never guessed.

use std::net::IpAddr;
use std::path::Path;

use super::Attacher;
use super::observed::{ObservedHost, ObservedPod, PodIface};
use super::{AttachError, KERNEL_TIMEOUT, deadline, driver};
use crate::dataplane::netns::{Netns, NetnsError};
use crate::dataplane::{DataplaneError, link};
use crate::ipam::Record;

impl Attacher {
    /// The node's end of `record`'s attachment; `None` when its host veth
    /// does not exist.
    pub(super) async fn observe_host(&self, ip: IpAddr, record: &Record) -> Result<Option<ObservedHost>, AttachError> {
        let Some(veth) = deadline("look up the host veth", link::by_name(&self.host, &record.host_veth)).await? else {
            return Ok(None);
        };
        let bridge = deadline("look up the bridge", link::by_name(&self.host, &self.config.bridge)).await?;
        let mut unrouted = Vec::new();
        if driver(record.attachment).routes_to_pod() {
            let present = deadline("list the node's routes", link::pod_routes(&self.host)).await?;
            let index = veth.header.index;
            let addresses = self.pod_addresses(ip, record).into_iter().map(|a| a.address.addr());
            unrouted.extend(addresses.filter(|a| !present.contains(&(*a, index))));
        }
        Ok(Some(ObservedHost {
            name: record.host_veth.clone(),
            ip,
            up: link::is_up(&veth),
            controller: link::controller_of(&veth),
            bridge_name: self.config.bridge.clone(),
            bridge: bridge.map(|b| b.header.index),
            unrouted,
        }))
    }
}

/// The pod's end: interface `ifname` and the default routes in the network
/// namespace at `netns`.
pub(super) async fn observe_pod(netns: &Path, ifname: &str) -> ObservedPod {
    let pod = match tokio::time::timeout(KERNEL_TIMEOUT, Netns::open(netns)).await {
        Err(_) => return ObservedPod::Unreadable(format!("opening {} took over {KERNEL_TIMEOUT:?}", netns.display())),
        Ok(Err(NetnsError::Missing(_))) => return ObservedPod::Gone,
        Ok(Err(e)) => return ObservedPod::Unreadable(e.to_string()),
        Ok(Ok(pod)) => pod,
    };
    let read = async {
        let iface = match link::by_name(&pod.handle, ifname).await? {
            Some(l) => Some(PodIface {
                up: link::is_up(&l),
                addresses: link::all_addresses(&pod.handle, l.header.index).await?,
            }),
            None => None,
        };
        let gateways = link::all_default_gateways(&pod.handle).await?;
        Ok::<_, DataplaneError>(ObservedPod::Seen { iface, gateways })
    };
    deadline("read the pod's interface and routes", read)
        .await
        .unwrap_or_else(|e| ObservedPod::Unreadable(e.to_string()))
}
