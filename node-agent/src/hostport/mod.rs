//! Host ports: automatic (pod annotation) and fixed (runtime `portMappings`)
//! host ports forwarded to pods, recorded durably on the node.
//!
//! The record on disk is the truth: ADD allocates and records before it
//! programs DNAT, DEL removes the record and the rules using only the
//! record (never the API), and a periodic full sync makes the nat table
//! match the records again whatever happened to it. Objects in the API
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
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use ipnet::Ipv4Net;
use weft_api::Protocol;
use weft_proto::ErrorCode;
use weft_proto::cni::v1::CniError;

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

impl HostPortError {
    pub fn to_cni(&self) -> CniError {
        let code = match self {
            HostPortError::Request(_) => ErrorCode::InvalidConfig,
            HostPortError::Store(StoreError::Exhausted { .. }) => ErrorCode::HostPortsExhausted,
            HostPortError::Store(StoreError::Conflict { .. }) => ErrorCode::HostPortConflict,
            _ => ErrorCode::Internal,
        };
        code.error(self.to_string())
    }
}

/// Who the ports are for.
#[derive(Debug, Clone, Default)]
pub struct PodIdentity {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

pub struct HostPorts {
    store: std::sync::Arc<store::Store>,
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
    pub fn open(dir: &Path, range: PortRange, pod_cidr: Ipv4Net) -> Result<Self, StoreError> {
        Ok(Self {
            store: std::sync::Arc::new(store::Store::open(dir, range)?),
            pod_cidr,
            iptables: tokio::sync::Mutex::new(()),
            dirty: AtomicBool::new(true),
            changed: tokio::sync::Notify::new(),
        })
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

    /// Allocates, records and forwards the ports `wanted` for the pod at
    /// `pod_ip`. `None` when nothing was asked for.
    pub async fn add(
        &self,
        key: &Key,
        pod: &PodIdentity,
        pod_ip: Ipv4Addr,
        wanted: Vec<Wanted>,
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
        let alloc = tokio::task::block_in_place(|| {
            let bound = range::bound_ports();
            self.store.allocate(key, draft, &wanted, |p, n| bound.contains(&(p, n)))
        })?;
        // The record's fsyncs overlap with the rules. A crash in between
        // leaves rules without a record (the start-up sync removes them) or
        // a record without rules (the start-up sync adds them).
        let store = std::sync::Arc::clone(&self.store);
        let owned_key = key.clone();
        let persist = tokio::task::spawn_blocking(move || store.persist(&owned_key));
        let (persisted, programmed) =
            tokio::join!(persist, self.program(Some(rules::append_text(&alloc, self.pod_cidr))));
        let failure = match (persisted, programmed) {
            (_, Err(e)) => Some(e),
            (Ok(Err(e)), Ok(())) => Some(HostPortError::Store(e)),
            (Err(join), Ok(())) => Some(HostPortError::Task(join)),
            (Ok(Ok(())), Ok(())) => None,
        };
        if let Some(e) = failure {
            if let Err(undo) = self.release(key).await {
                tracing::error!(error = %undo, "could not undo a host port allocation");
            }
            return Err(e);
        }
        // A UDP flow to the port from before the rule existed would keep
        // bypassing the DNAT: forget it.
        conntrack::flush_udp(udp_ports(&alloc)).await;
        self.changed.notify_one();
        Ok(Some(alloc))
    }

    /// Removes the record and the rules of `key`. Succeeds when there is nothing to remove.
    pub async fn release(&self, key: &Key) -> Result<(), HostPortError> {
        let Some(alloc) = tokio::task::block_in_place(|| self.store.release(key))? else {
            if self.dirty.load(Ordering::Acquire) {
                self.program(None).await?;
            }
            return Ok(());
        };
        self.program(Some(rules::delete_text(&alloc, self.pod_cidr))).await?;
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
    async fn program(&self, incremental: Option<String>) -> Result<(), HostPortError> {
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
