//! The agent's shared state: configuration, IPAM, the node's netlink handle
//! and metrics. The CNI verbs are implemented on it in `cni_server/`.

use rtnetlink::Handle;
use weft_proto::ErrorCode;
use weft_proto::cni::v1::CniError;

use crate::config::Config;
use crate::dataplane::link;
use crate::ipam::{Ipam, IpamError, Key};
use crate::metrics::Metrics;

/// Host ends of pod veths are named `weftv` + 10 hex digits of a stable hash
/// of (container ID, ifname): unique per attachment, derivable without a
/// record, and recognisable as ours.
pub const HOST_VETH_PREFIX: &str = "weftv";

pub struct Agent {
    pub config: Config,
    pub ipam: Ipam,
    pub host: Handle,
    pub metrics: Metrics,
    bridge_lock: tokio::sync::Mutex<()>,
}

impl Agent {
    pub fn new(config: Config, ipam: Ipam, host: Handle) -> Self {
        Self { config, ipam, host, metrics: Metrics::default(), bridge_lock: tokio::sync::Mutex::new(()) }
    }

    /// The bridge with the gateway address, created when missing. Returns its index.
    pub async fn ensure_bridge(&self) -> Result<u32, CniError> {
        let _guard = self.bridge_lock.lock().await;
        link::ensure_bridge(&self.host, &self.config.bridge, self.ipam.pool().gateway_net())
            .await
            .map_err(|e| ErrorCode::Internal.error(format!("cannot set up bridge {}: {e}", self.config.bridge)))
    }

    /// Deletes the host veth of an attachment and releases its address.
    /// Idempotent: both steps succeed when there is nothing left to remove.
    pub async fn teardown(&self, key: &Key, host_veth: &str) -> Result<(), CniError> {
        link::delete(&self.host, host_veth)
            .await
            .map_err(|e| ErrorCode::Internal.error(format!("cannot delete veth {host_veth}: {e}")))?;
        tokio::task::block_in_place(|| self.ipam.release(key)).map_err(ipam_error)?;
        Ok(())
    }
}

pub fn host_veth_name(key: &Key) -> String {
    // FNV-1a: stable across Rust versions, unlike std's DefaultHasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.container_id.bytes().chain([0]).chain(key.ifname.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{HOST_VETH_PREFIX}{:010x}", h & 0xff_ffff_ffff)
}

pub fn ipam_error(e: IpamError) -> CniError {
    let code = match &e {
        IpamError::AlreadyAllocated { .. } => ErrorCode::AlreadyExists,
        IpamError::Exhausted { .. } => ErrorCode::PoolExhausted,
        IpamError::Io { .. } | IpamError::Corrupt { .. } => ErrorCode::Internal,
    };
    code.error(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_veth_names_fit_and_differ() {
        let a = host_veth_name(&Key { container_id: "abc".into(), ifname: "eth0".into() });
        let b = host_veth_name(&Key { container_id: "abc".into(), ifname: "eth1".into() });
        assert_eq!(a.len(), 15);
        assert!(a.starts_with(HOST_VETH_PREFIX));
        assert_ne!(a, b);
        assert_eq!(a, host_veth_name(&Key { container_id: "abc".into(), ifname: "eth0".into() }));
    }
}
