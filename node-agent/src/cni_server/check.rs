//! CHECK: the attachment still looks as ADD left it, and prevResult agrees.

use std::path::Path;

use ipnet::Ipv4Net;
use weft_proto::ErrorCode;
use weft_proto::cni::v1::{CniError, CniRequest};

use super::key_of;
use crate::agent::Agent;
use crate::attachment::Attachment;
use crate::dataplane::link;
use crate::netns::Netns;

fn failed(msg: String) -> CniError {
    ErrorCode::CheckFailed.error(msg)
}

fn internal(e: impl std::fmt::Display) -> CniError {
    ErrorCode::Internal.error(e.to_string())
}

impl Agent {
    pub async fn check(&self, req: &CniRequest) -> Result<(), CniError> {
        let key = key_of(req)?;
        let Some((ip, record)) = self.ipam.get(&key) else {
            return Err(ErrorCode::UnknownContainer
                .error(format!("no attachment for container {} interface {}", key.container_id, key.ifname)));
        };
        if self.ipam.is_pending(ip) {
            return Err(failed(format!("the ADD of {} has not finished", key.container_id)));
        }
        let pool = *self.ipam.pool();
        let address = record.attachment.pod_address(ip, pool.cidr());
        check_prev_result(&req.prev_result_json, &address)?;

        let host = link::by_name(&self.host, &record.host_veth)
            .await
            .map_err(internal)?
            .ok_or_else(|| failed(format!("host veth {} is missing", record.host_veth)))?;
        if !link::is_up(&host) {
            return Err(failed(format!("host veth {} is down", record.host_veth)));
        }
        match record.attachment {
            Attachment::Bridge => {
                let bridge = link::by_name(&self.host, &self.config.bridge)
                    .await
                    .map_err(internal)?
                    .ok_or_else(|| failed(format!("bridge {} is missing", self.config.bridge)))?;
                if link::controller_of(&host) != Some(bridge.header.index) {
                    return Err(failed(format!(
                        "host veth {} is not attached to bridge {}",
                        record.host_veth, self.config.bridge
                    )));
                }
            }
            Attachment::Routed => {
                if !link::pod_routes(&self.host).await.map_err(internal)?.contains(&(ip, host.header.index)) {
                    return Err(failed(format!("the node has no route to {ip} via {}", record.host_veth)));
                }
            }
        }

        let netns = if req.netns.is_empty() { record.netns.as_str() } else { req.netns.as_str() };
        let pod = Netns::open(Path::new(netns)).await.map_err(|e| failed(format!("pod network namespace: {e}")))?;
        let iface = link::by_name(&pod.handle, &key.ifname)
            .await
            .map_err(internal)?
            .ok_or_else(|| failed(format!("interface {} is missing in {netns}", key.ifname)))?;
        if !link::is_up(&iface) {
            return Err(failed(format!("interface {} is down", key.ifname)));
        }
        let addrs = link::addresses(&pod.handle, iface.header.index).await.map_err(internal)?;
        if !addrs.contains(&address) {
            return Err(failed(format!("interface {} lacks address {address} (has {addrs:?})", key.ifname)));
        }
        let gws = link::default_gateways(&pod.handle).await.map_err(internal)?;
        if !gws.contains(&pool.gateway()) {
            return Err(failed(format!("the pod has no default route via {}", pool.gateway())));
        }
        self.hostports.check(&key).await.map_err(failed)
    }
}

/// prevResult must list this attachment's address.
fn check_prev_result(prev: &[u8], address: &Ipv4Net) -> Result<(), CniError> {
    if prev.is_empty() {
        return Err(ErrorCode::InvalidConfig.error("CHECK needs prevResult"));
    }
    let v: serde_json::Value = serde_json::from_slice(prev)
        .map_err(|e| ErrorCode::Decode.error(format!("prevResult is not valid JSON: {e}")))?;
    let listed: Vec<&str> = v
        .get("ips")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|ip| ip.get("address").and_then(|s| s.as_str())).collect())
        .unwrap_or_default();
    let want = address.to_string();
    // Compare addresses only: another plugin may print the prefix differently.
    let ip = address.addr().to_string();
    if listed.iter().any(|a| a.split('/').next() == Some(ip.as_str())) {
        Ok(())
    } else {
        Err(failed(format!("prevResult does not list address {want} (lists {listed:?})")))
    }
}
