//! Host ports: automatic (pod annotation) and fixed (runtime `portMappings`)
//! host ports forwarded to pods, recorded durably on the node.
//!
//! The attachment's IPAM record on disk is the truth: ADD takes the ports,
//! puts them in the record (written once, while the DNAT is programmed),
//! DEL removes the rules using only the record (never the API), and a
//! periodic full sync makes the nat table match the records again whatever
//! happened to it. Objects in the API
//! (`HostPortAllocation`, Events) are published from the records in the
//! background by `publish`, so the API being slow or down never blocks DEL.

pub mod conntrack;
#[cfg(test)]
mod kernel_tests;
pub mod pods;
pub mod publish;
pub mod range;
pub mod request;
pub mod rules;
pub mod store;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};

use ipnet::Ipv4Net;
use weft_api::Protocol;

use crate::dataplane::iptables::{self, IptablesError};
use crate::ipam::Key;
pub use range::PortRange;
pub use request::Wanted;
pub use store::{Allocation, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum HostPortError {
    #[error(transparent)]
    Request(#[from] request::RequestError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot program host port DNAT: {0}")]
    Iptables(#[from] IptablesError),
    #[error("host port task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Who the ports are for.
#[derive(Debug, Clone, Default)]
pub struct PodIdentity {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

pub struct HostPorts {
    store: store::Store,
    pod_cidr: Ipv4Net,
    /// Serialises nat table writes: incremental ones assume the full sync
    /// state they follow.
    iptables: tokio::sync::Mutex<()>,
    /// An incremental write failed: the next write is a full sync.
    dirty: AtomicBool,
    /// Wakes the publisher when records change.
    pub changed: tokio::sync::Notify,
}

impl HostPorts {
    /// `existing`: the allocations in the IPAM records.
    pub fn new(range: PortRange, pod_cidr: Ipv4Net, existing: Vec<Allocation>) -> Self {
        Self {
            store: store::Store::new(range, existing),
            pod_cidr,
            iptables: tokio::sync::Mutex::new(()),
            dirty: AtomicBool::new(true),
            changed: tokio::sync::Notify::new(),
        }
    }

    pub fn range(&self) -> PortRange {
        self.store.range()
    }

    pub fn all(&self) -> Vec<Allocation> {
        self.store.all()
    }

    /// (ports in use, ports in the range).
    pub fn usage(&self) -> (usize, usize) {
        self.store.usage()
    }

    /// Takes host ports for `wanted` for the pod at `pod_ip` (all or
    /// nothing; nothing is written). `None` when nothing was asked for.
    pub fn reserve(
        &self,
        key: &Key,
        pod: &PodIdentity,
        pod_ip: Ipv4Addr,
        wanted: &[Wanted],
    ) -> Result<Option<Allocation>, HostPortError> {
        if wanted.is_empty() {
            return Ok(None);
        }
        let draft = Allocation {
            container_id: key.container_id.clone(),
            ifname: key.ifname.clone(),
            pod_namespace: pod.namespace.clone(),
            pod_name: pod.name.clone(),
            pod_uid: pod.uid.clone(),
            pod_ip,
            ports: Vec::new(),
        };
        Ok(Some(self.store.allocate(key, draft, wanted, range::in_use)?))
    }

    /// Forwards the ports of a reserved allocation. On error the caller
    /// tears the attachment down (which releases the ports).
    pub async fn program(&self, alloc: Option<&Allocation>) -> Result<(), HostPortError> {
        let Some(alloc) = alloc else { return Ok(()) };
        self.write(Some(rules::append_text(alloc, self.pod_cidr))).await?;
        // A UDP flow to the port from before the rule existed would keep
        // bypassing the DNAT: forget it.
        conntrack::flush_udp(udp_ports(alloc)).await;
        self.changed.notify_one();
        Ok(())
    }

    /// Frees the ports of `key` and removes their rules (the caller removes
    /// the record). Succeeds when there is nothing to remove.
    pub async fn release(&self, key: &Key) -> Result<(), HostPortError> {
        let Some(alloc) = self.store.release(key) else {
            if self.dirty.load(Ordering::Acquire) {
                self.write(None).await?;
            }
            return Ok(());
        };
        self.write(Some(rules::delete_text(&alloc, self.pod_cidr))).await?;
        conntrack::flush_udp(udp_ports(&alloc)).await;
        self.changed.notify_one();
        Ok(())
    }

    /// Makes the nat table match the records; `Ok(true)` when something had to be written.
    pub async fn sync(&self) -> Result<bool, HostPortError> {
        let _turn = self.iptables.lock().await;
        self.full_sync().await
    }

    /// Applies `incremental` when the table is known to be in sync, else
    /// (or when it fails) a full sync.
    async fn write(&self, incremental: Option<String>) -> Result<(), HostPortError> {
        let _turn = self.iptables.lock().await;
        if let Some(text) = incremental.filter(|_| !self.dirty.load(Ordering::Acquire)) {
            match tokio::task::spawn_blocking(move || iptables::restore(&text)).await? {
                Ok(()) => return Ok(()),
                Err(e) => tracing::warn!(error = %e, "incremental host port update failed; rewriting our chains"),
            }
        }
        self.full_sync().await.map(|_| ())
    }

    async fn full_sync(&self) -> Result<bool, HostPortError> {
        self.dirty.store(true, Ordering::Release);
        let allocations = self.store.all();
        let pod_cidr = self.pod_cidr;
        let wrote = tokio::task::spawn_blocking(move || -> Result<bool, IptablesError> {
            let saved = rules::parse_save(&iptables::save("nat")?);
            match rules::full_sync_text(&saved, &allocations, pod_cidr) {
                None => Ok(false),
                Some(text) => iptables::restore(&text).map(|()| true),
            }
        })
        .await??;
        self.dirty.store(false, Ordering::Release);
        Ok(wrote)
    }

    /// Whether the nat table forwards every port of `key`'s allocation (CHECK).
    pub async fn check(&self, key: &Key) -> Result<(), String> {
        let Some(alloc) = self.store.get(key) else { return Ok(()) };
        let want = rules::allocation_rules(&alloc, self.pod_cidr);
        let save = tokio::task::spawn_blocking(|| iptables::save("nat"))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let saved = rules::parse_save(&save);
        let have = saved.chain.unwrap_or_default();
        match want.iter().find(|r| !have.contains(r)) {
            None => Ok(()),
            Some(missing) => Err(format!("host port rule missing from the nat table: {missing}")),
        }
    }
}

fn udp_ports(a: &Allocation) -> Vec<u16> {
    a.ports.iter().filter(|m| m.protocol == Protocol::Udp).map(|m| m.host_port).collect()
}
