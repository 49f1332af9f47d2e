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
// The iptables rules this engine replaced, kept outside `src/` for the
// upgrade test and the benchmark beside the new one.
#[cfg(test)]
#[path = "../../old_engines/hostport_iptables.rs"]
mod rules_iptables_old;
pub mod store;

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use weft_api::Protocol;

use crate::firewall::nft::Nft;
use crate::firewall::ruleset::Part;
use crate::firewall::{Engine, FirewallError};
use crate::ipam::Key;
pub use range::PortRange;
pub use request::Wanted;
pub use rules::PodBlocks;
pub use store::{Allocation, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum HostPortError {
    #[error(transparent)]
    Request(#[from] request::RequestError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot program host port DNAT: {0}")]
    Firewall(#[from] FirewallError),
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
    pods: PodBlocks,
    engine: Arc<Engine<Nft>>,
    /// The host port part as the records want it, kept up to date one host
    /// port at a time. Locked by one firewall write at a time (in a
    /// blocking thread), which also orders the writes.
    part: Arc<Mutex<Part>>,
    /// Wakes the publisher when records change.
    pub changed: tokio::sync::Notify,
}

impl HostPorts {
    /// `existing`: the allocations in the IPAM records.
    pub fn new(range: PortRange, pods: PodBlocks, existing: Vec<Allocation>) -> Self {
        let part = rules::part(&existing, pods);
        Self {
            store: store::Store::new(range, existing),
            pods,
            engine: Arc::new(Engine::new(Nft::default())),
            part: Arc::new(Mutex::new(part)),
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

    /// Takes host ports for `wanted` for the pod at `pod_ips` (its pool
    /// address first, then on a dual-stack node its IPv6 address): all or
    /// nothing, nothing is written. `None` when nothing was asked for.
    pub fn reserve(
        &self,
        key: &Key,
        pod: &PodIdentity,
        pod_ips: &[IpAddr],
        wanted: &[Wanted],
    ) -> Result<Option<Allocation>, HostPortError> {
        if wanted.is_empty() {
            return Ok(None);
        }
        let Some(&pod_ip) = pod_ips.first() else {
            return Err(request::RequestError::PortMappings("the pod has no address".into()).into());
        };
        let pod_ipv6 = match pod_ip {
            IpAddr::V4(_) => pod_ips.iter().find_map(|ip| match ip {
                IpAddr::V6(v6) if self.pods.ipv6.is_some() => Some(*v6),
                _ => None,
            }),
            IpAddr::V6(_) => None,
        };
        let has = |family_v4: bool| pod_ip.is_ipv4() == family_v4 || (!family_v4 && pod_ipv6.is_some());
        if let Some(ip) = wanted.iter().filter_map(|w| w.host_ip).find(|ip| !has(ip.is_ipv4())) {
            let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
            let why =
                format!("hostIP {ip} is an {family} address, and this pod has no {family} address to forward it to");
            return Err(request::RequestError::PortMappings(why).into());
        }
        let draft = Allocation {
            container_id: key.container_id.clone(),
            ifname: key.ifname.clone(),
            pod_namespace: pod.namespace.clone(),
            pod_name: pod.name.clone(),
            pod_uid: pod.uid.clone(),
            pod_ip,
            pod_ipv6,
            ports: Vec::new(),
        };
        Ok(Some(self.store.allocate(key, draft, wanted, range::in_use)?))
    }

    /// Forwards the ports of a reserved allocation. On error the caller
    /// tears the attachment down (which releases the ports).
    pub async fn program(&self, alloc: Option<&Allocation>) -> Result<(), HostPortError> {
        let Some(alloc) = alloc else { return Ok(()) };
        self.write(alloc.ports.iter().map(rules::port).collect(), false).await?;
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
            // Nothing to free; a write only happens if an earlier one failed.
            self.write(Vec::new(), false).await?;
            return Ok(());
        };
        self.write(alloc.ports.iter().map(rules::port).collect(), false).await?;
        conntrack::flush_udp(udp_ports(&alloc)).await;
        self.changed.notify_one();
        Ok(())
    }

    /// Makes the kernel match the records; `Ok(true)` when something had to be written.
    pub async fn sync(&self) -> Result<bool, HostPortError> {
        self.write(Vec::new(), true).await
    }

    /// Brings the part's host ports `ports` in line with the records and
    /// writes the difference: only what changed when the kernel is known to
    /// hold the part as last applied, else (or with `full`) after reading it.
    async fn write(&self, ports: Vec<rules::Port>, full: bool) -> Result<bool, HostPortError> {
        let (engine, part, pods) = (self.engine.clone(), self.part.clone(), self.pods);
        // Only the allocations on the host ports concerned: an ADD costs the
        // same whatever the number of host ports on the node.
        let allocations = match full {
            true => self.store.all(),
            false => self.store.matching(|a| a.ports.iter().any(|m| ports.contains(&rules::port(m)))),
        };
        let wrote = tokio::task::spawn_blocking(move || {
            let mut part = part.lock().unwrap_or_else(|p| p.into_inner());
            if full {
                *part = rules::part(&allocations, pods);
                engine.sync(&part)
            } else {
                rules::refresh(&mut part, &ports, &allocations, pods);
                engine.update(&part)
            }
        })
        .await??;
        Ok(wrote)
    }

    /// Whether the kernel forwards every port of `key`'s allocation (CHECK).
    pub async fn check(&self, key: &Key) -> Result<(), String> {
        let Some(alloc) = self.store.get(key) else { return Ok(()) };
        let engine = self.engine.clone();
        let observed = tokio::task::spawn_blocking(move || engine.observe(rules::OWNER))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        match rules::missing(&observed, &alloc, self.pods) {
            None => Ok(()),
            Some(problem) => Err(problem),
        }
    }
}

fn udp_ports(a: &Allocation) -> Vec<u16> {
    a.ports.iter().filter(|m| m.protocol == Protocol::Udp).map(|m| m.host_port).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_ip_needs_a_pod_with_an_ipv6_address() {
        let blocks =
            PodBlocks { pool: "10.244.1.0/24".parse().unwrap(), ipv6: Some("fd00:10:244:1::/64".parse().unwrap()) };
        let hp = HostPorts::new("20000-20009".parse().unwrap(), blocks, vec![]);
        let wanted = [Wanted {
            protocol: Protocol::Tcp,
            container_port: 80,
            host_port: Some(20001),
            host_ip: Some("fd00:250::b".parse().unwrap()),
            name: None,
        }];
        let key = Key { container_id: "c1".into(), ifname: "eth0".into() };
        let pod = PodIdentity::default();
        let v4: IpAddr = "10.244.1.5".parse().unwrap();
        let err = hp.reserve(&key, &pod, &[v4], &wanted).unwrap_err();
        assert!(err.to_string().contains("hostIP fd00:250::b is an IPv6 address, and this pod has no IPv6"), "{err}");
        assert!(hp.all().is_empty(), "nothing was taken");
        let ipv6 = "fd00:10:244:1::5".parse().unwrap();
        let a = hp.reserve(&key, &pod, &[v4, IpAddr::V6(ipv6)], &wanted).unwrap().unwrap();
        assert_eq!((a.pod_ipv6, a.ports[0].host_port), (Some(ipv6), 20001));
    }

    #[test]
    fn an_ipv6_only_pod_forwards_ipv6_host_ips_and_refuses_ipv4_ones() {
        let blocks = PodBlocks { pool: "fd00:10:244:1::/64".parse().unwrap(), ipv6: None };
        let hp = HostPorts::new("20000-20009".parse().unwrap(), blocks, vec![]);
        let want = |host_ip: &str| {
            [Wanted {
                protocol: Protocol::Tcp,
                container_port: 80,
                host_port: Some(20001),
                host_ip: Some(host_ip.parse().unwrap()),
                name: None,
            }]
        };
        let key = Key { container_id: "c1".into(), ifname: "eth0".into() };
        let pod = PodIdentity::default();
        let pod_ip: IpAddr = "fd00:10:244:1::5".parse().unwrap();
        let err = hp.reserve(&key, &pod, &[pod_ip], &want("192.168.0.2")).unwrap_err();
        assert!(err.to_string().contains("hostIP 192.168.0.2 is an IPv4 address, and this pod has no IPv4"), "{err}");
        let a = hp.reserve(&key, &pod, &[pod_ip], &want("fd00:250::b")).unwrap().unwrap();
        assert_eq!((a.pod_ip, a.pod_ipv6), (pod_ip, None));
    }
}
