//! CHECK: the attachment still looks as ADD left it, and prevResult agrees.

use std::path::Path;

use ipnet::IpNet;

use super::AttachError;
use super::Attacher;
use super::observe::observe_pod;
use super::observed::{Expected, compare};
use crate::ipam::Key;

impl Attacher {
    /// `netns` is CNI_NETNS when the runtime gave one, else the record's.
    pub async fn check(&self, key: &Key, netns: &str, prev_result: &[u8]) -> Result<(), AttachError> {
        let Some((ip, record)) = self.ipam.get(key) else {
            return Err(AttachError::Unknown { container_id: key.container_id.clone(), ifname: key.ifname.clone() });
        };
        if self.ipam.is_pending(ip) {
            return Err(AttachError::CheckFailed(format!("the ADD of {} has not finished", key.container_id)));
        }
        let want = Expected {
            driver: super::driver(record.attachment),
            ifname: &key.ifname,
            addresses: self.pod_addresses(ip, &record),
        };
        for a in &want.addresses {
            check_prev_result(prev_result, &a.address)?;
        }
        let host = self.observe_host(ip, &record).await?;
        let netns = if netns.is_empty() { record.netns.as_str() } else { netns };
        let pod = observe_pod(Path::new(netns), &key.ifname).await;
        compare(&want, host.as_ref(), &pod).map_err(AttachError::CheckFailed)?;
        self.hostports.check(key).await.map_err(AttachError::CheckFailed)
    }
}

/// prevResult must list this attachment's address (each of them).
fn check_prev_result(prev: &[u8], address: &IpNet) -> Result<(), AttachError> {
    if prev.is_empty() {
        return Err(AttachError::InvalidConfig("CHECK needs prevResult".into()));
    }
    let v: serde_json::Value =
        serde_json::from_slice(prev).map_err(|e| AttachError::Decode(format!("prevResult is not valid JSON: {e}")))?;
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
        Err(AttachError::CheckFailed(format!("prevResult does not list address {want} (lists {listed:?})")))
    }
}
