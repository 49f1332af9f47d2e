//! Which host ports are taken on the node, and by whom. The durable copy
//! is part of each attachment's IPAM record (one write per ADD); this index
//! is rebuilt from those records on start, so ports stay unique across
//! restarts and DEL never needs the API to know what to remove.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use weft_api::Protocol;

use super::range::PortRange;
use super::request::Wanted;
use crate::ipam::Key;

pub use crate::ipam::Mapping;

/// The host ports of one attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocation {
    pub container_id: String,
    pub ifname: String,
    pub pod_namespace: String,
    pub pod_name: String,
    #[serde(default)]
    pub pod_uid: String,
    /// The pod's address from the node's pool (IPv4, or IPv6 on an
    /// IPv6-only node).
    pub pod_ip: IpAddr,
    /// The pod's IPv6 address beside an IPv4 one, on a dual-stack node: its
    /// ports are forwarded over IPv6 too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_ipv6: Option<Ipv6Addr>,
    pub ports: Vec<Mapping>,
}

impl Allocation {
    /// The host ports an IPAM record holds, if any.
    /// `ipv6`: the pod's IPv6 address, when its record says it has one.
    pub fn from_record(ip: IpAddr, ipv6: Option<Ipv6Addr>, r: &crate::ipam::Record) -> Option<Allocation> {
        if r.host_ports.is_empty() {
            return None;
        }
        let (namespace, name) = r.pod.split_once('/').unwrap_or_default();
        Some(Allocation {
            container_id: r.container_id.clone(),
            ifname: r.ifname.clone(),
            pod_namespace: namespace.to_owned(),
            pod_name: name.to_owned(),
            pod_uid: r.pod_uid.clone(),
            pod_ip: ip,
            pod_ipv6: ipv6.filter(|_| r.ipv6),
            ports: r.host_ports.clone(),
        })
    }

    pub fn key(&self) -> Key {
        Key { container_id: self.container_id.clone(), ifname: self.ifname.clone() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no free {protocol} host port left in {range} ({used} in use by pods, the rest bound by host processes)")]
    Exhausted { protocol: Protocol, range: PortRange, used: usize },
    #[error("host port {port}/{protocol} is already used by {owner}")]
    Conflict { port: u16, protocol: Protocol, owner: String },
}

/// A host port is one (protocol, port) on one node address or on all of them
/// (`None`): as the scheduler's host-port check, two uses clash unless both
/// name an address and the addresses differ.
type PortKey = (Protocol, u16);

fn addresses_overlap(a: Option<IpAddr>, b: Option<IpAddr>) -> bool {
    a.is_none() || b.is_none() || a == b
}

#[derive(Default)]
struct Inner {
    by_key: HashMap<Key, Allocation>,
    /// Who uses each port, on which address.
    taken: HashMap<PortKey, Vec<(Option<IpAddr>, Key)>>,
    /// Per protocol, where the next automatic search starts, so freed ports
    /// are not reused at once.
    cursor: HashMap<Protocol, u16>,
}

pub struct Store {
    range: PortRange,
    inner: Mutex<Inner>,
}

impl Store {
    /// The index of `existing` allocations (from the IPAM records).
    pub fn new(range: PortRange, existing: Vec<Allocation>) -> Self {
        let mut inner = Inner::default();
        for a in existing {
            inner.take(&a.key(), &a.ports);
            inner.by_key.insert(a.key(), a);
        }
        Self { range, inner: Mutex::new(inner) }
    }

    pub fn range(&self) -> PortRange {
        self.range
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way that matters more than losing the agent: keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Picks ports for `wanted` (all or nothing) and takes them. `bound`
    /// says whether a host process holds a port.
    pub fn allocate(
        &self,
        key: &Key,
        mut alloc: Allocation,
        wanted: &[Wanted],
        bound: impl Fn(Protocol, u16) -> bool,
    ) -> Result<Allocation, StoreError> {
        let mut inner = self.lock();
        let picked_overlaps = |picked: &[Mapping], k: PortKey, ip: Option<IpAddr>| {
            picked.iter().any(|m| (m.protocol, m.host_port) == k && addresses_overlap(m.host_ip, ip))
        };
        // Fixed ports first, so that automatic ones never take them.
        for w in wanted.iter().filter(|w| w.host_port.is_some()) {
            let port = w.host_port.unwrap_or_default();
            let k = (w.protocol, port);
            if let Some(owner) = inner.owner(k, w.host_ip) {
                return Err(StoreError::Conflict { port, protocol: w.protocol, owner });
            }
            if picked_overlaps(&alloc.ports, k, w.host_ip) {
                return Err(StoreError::Conflict { port, protocol: w.protocol, owner: "this pod already".into() });
            }
            if bound(w.protocol, port) {
                return Err(StoreError::Conflict { port, protocol: w.protocol, owner: "a process on the node".into() });
            }
            alloc.ports.push(mapping(w, port));
        }
        for w in wanted.iter().filter(|w| w.host_port.is_none()) {
            let mut found = None;
            let mut port = inner.cursor.get(&w.protocol).copied().unwrap_or(self.range.first);
            for _ in 0..self.range.len() {
                let k = (w.protocol, port);
                if inner.owner(k, w.host_ip).is_none()
                    && !picked_overlaps(&alloc.ports, k, w.host_ip)
                    && !bound(w.protocol, port)
                {
                    found = Some(port);
                    break;
                }
                port = self.range.next(port);
            }
            let Some(port) = found else {
                let used = inner.taken.keys().filter(|(p, n)| *p == w.protocol && self.range.contains(*n)).count();
                return Err(StoreError::Exhausted { protocol: w.protocol, range: self.range, used });
            };
            inner.cursor.insert(w.protocol, self.range.next(port));
            alloc.ports.push(mapping(w, port));
        }
        inner.take(key, &alloc.ports);
        inner.by_key.insert(key.clone(), alloc.clone());
        Ok(alloc)
    }

    pub fn get(&self, key: &Key) -> Option<Allocation> {
        self.lock().by_key.get(key).cloned()
    }

    pub fn all(&self) -> Vec<Allocation> {
        self.matching(|_| true)
    }

    /// The allocations `wanted` picks, in record order, cloning only those.
    pub fn matching(&self, wanted: impl Fn(&Allocation) -> bool) -> Vec<Allocation> {
        let mut v: Vec<Allocation> = self.lock().by_key.values().filter(|a| wanted(a)).cloned().collect();
        v.sort_by(|a, b| (&a.container_id, &a.ifname).cmp(&(&b.container_id, &b.ifname)));
        v
    }

    /// (ports in use, ports in the range).
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.taken.keys().filter(|(_, n)| self.range.contains(*n)).count(), self.range.len())
    }

    /// Frees the ports of `key`; returns what it held (`None` when nothing).
    pub fn release(&self, key: &Key) -> Option<Allocation> {
        let mut inner = self.lock();
        let alloc = inner.by_key.remove(key)?;
        for m in &alloc.ports {
            let k = (m.protocol, m.host_port);
            if let Some(users) = inner.taken.get_mut(&k) {
                users.retain(|(_, k)| k != key);
                if users.is_empty() {
                    inner.taken.remove(&k);
                }
            }
        }
        Some(alloc)
    }
}

impl Inner {
    fn take(&mut self, key: &Key, ports: &[Mapping]) {
        for m in ports {
            self.taken.entry((m.protocol, m.host_port)).or_default().push((m.host_ip, key.clone()));
        }
    }

    /// Who already uses port `k` on an address overlapping `ip`.
    fn owner(&self, k: PortKey, ip: Option<IpAddr>) -> Option<String> {
        let (_, owner) = self.taken.get(&k)?.iter().find(|(used, _)| addresses_overlap(*used, ip))?;
        Some(match self.by_key.get(owner) {
            Some(a) => format!("pod {}/{}", a.pod_namespace, a.pod_name),
            None => format!("container {}", owner.container_id),
        })
    }
}

fn mapping(w: &Wanted, host_port: u16) -> Mapping {
    Mapping {
        protocol: w.protocol,
        container_port: w.container_port,
        host_port,
        host_ip: w.host_ip,
        name: w.name.clone(),
        auto: w.host_port.is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> Key {
        Key { container_id: id.into(), ifname: "eth0".into() }
    }

    fn alloc(id: &str) -> Allocation {
        Allocation {
            container_id: id.into(),
            ifname: "eth0".into(),
            pod_namespace: "default".into(),
            pod_name: id.into(),
            pod_uid: String::new(),
            pod_ip: "10.244.1.2".parse().unwrap(),
            pod_ipv6: None,
            ports: vec![],
        }
    }

    fn auto(proto: Protocol, port: u16) -> Wanted {
        Wanted { protocol: proto, container_port: port, host_port: None, host_ip: None, name: None }
    }

    fn fixed(port: u16) -> Wanted {
        Wanted { protocol: Protocol::Tcp, container_port: 80, host_port: Some(port), host_ip: None, name: None }
    }

    const RANGE: PortRange = PortRange { first: 20000, last: 20003 };

    #[test]
    fn ports_are_distinct_survive_a_rebuild_and_are_reused_after_release() {
        let s = Store::new(RANGE, vec![]);
        let a = s.allocate(&key("a"), alloc("a"), &[auto(Protocol::Tcp, 80), auto(Protocol::Tcp, 81)], |_, _| false);
        let a = a.unwrap();
        assert_eq!(a.ports.iter().map(|m| m.host_port).collect::<Vec<_>>(), vec![20000, 20001]);
        // UDP has its own space.
        let u = s.allocate(&key("u"), alloc("u"), &[auto(Protocol::Udp, 53)], |_, _| false).unwrap();
        assert_eq!(u.ports[0].host_port, 20000);
        // What start-up does: rebuild from the records.
        let s = Store::new(RANGE, s.all());
        assert_eq!(s.get(&key("a")), Some(a));
        let b = s.allocate(&key("b"), alloc("b"), &[auto(Protocol::Tcp, 80), auto(Protocol::Tcp, 81)], |_, _| false);
        assert_eq!(b.unwrap().ports.iter().map(|m| m.host_port).collect::<Vec<_>>(), vec![20002, 20003]);
        let e = s.allocate(&key("c"), alloc("c"), &[auto(Protocol::Tcp, 80)], |_, _| false).unwrap_err();
        assert!(e.to_string().contains("no free TCP host port left in 20000-20003"), "{e}");
        assert!(s.get(&key("c")).is_none(), "a failed allocation records nothing");
        assert!(s.release(&key("a")).is_some());
        assert!(s.release(&key("a")).is_none(), "releasing twice is harmless");
        let c = s.allocate(&key("c"), alloc("c"), &[auto(Protocol::Tcp, 80)], |_, _| false).unwrap();
        assert_eq!(c.ports[0].host_port, 20000);
        assert_eq!(s.usage(), (4, 4));
    }

    #[test]
    fn bound_ports_and_fixed_ports_are_skipped() {
        let s = Store::new(RANGE, vec![]);
        let a = s.allocate(&key("a"), alloc("a"), &[auto(Protocol::Tcp, 80), fixed(20001)], |_, p| p == 20000).unwrap();
        let ports: Vec<_> = a.ports.iter().map(|m| (m.host_port, m.auto)).collect();
        assert_eq!(ports, vec![(20001, false), (20002, true)]);
        let e = s.allocate(&key("b"), alloc("b"), &[fixed(20001)], |_, _| false).unwrap_err();
        assert!(e.to_string().contains("already used by pod default/a"), "{e}");
        let e = s.allocate(&key("b"), alloc("b"), &[fixed(8080)], |_, p| p == 8080).unwrap_err();
        assert!(e.to_string().contains("a process on the node"), "{e}");
    }

    fn fixed_on(proto: Protocol, port: u16, ip: Option<&str>) -> Wanted {
        Wanted { host_ip: ip.map(|ip| ip.parse().unwrap()), protocol: proto, ..fixed(port) }
    }

    #[test]
    fn the_same_port_on_different_addresses_or_protocols_does_not_clash() {
        // The upstream HostPort conformance test: 127.0.0.1 and the node
        // address share TCP port 54323, and UDP on the node address too.
        let s = Store::new(RANGE, vec![]);
        let local = Some("127.0.0.1");
        let node = Some("10.251.0.12");
        s.allocate(&key("a"), alloc("a"), &[fixed_on(Protocol::Tcp, 54323, local)], |_, _| false).unwrap();
        s.allocate(&key("b"), alloc("b"), &[fixed_on(Protocol::Tcp, 54323, node)], |_, _| false).unwrap();
        s.allocate(&key("c"), alloc("c"), &[fixed_on(Protocol::Udp, 54323, node)], |_, _| false).unwrap();
        // The same address, or all addresses, clash with any of them.
        let e = s.allocate(&key("d"), alloc("d"), &[fixed_on(Protocol::Tcp, 54323, node)], |_, _| false).unwrap_err();
        assert!(e.to_string().contains("already used by pod default/b"), "{e}");
        let e = s.allocate(&key("d"), alloc("d"), &[fixed_on(Protocol::Udp, 54323, None)], |_, _| false).unwrap_err();
        assert!(e.to_string().contains("already used by pod default/c"), "{e}");
        // Within one pod too.
        let both = [fixed_on(Protocol::Tcp, 7000, None), fixed_on(Protocol::Tcp, 7000, local)];
        let e = s.allocate(&key("d"), alloc("d"), &both, |_, _| false).unwrap_err();
        assert!(e.to_string().contains("this pod already"), "{e}");
        // Releasing one user frees only its address; a rebuild keeps all.
        assert!(s.release(&key("a")).is_some());
        let s = Store::new(RANGE, s.all());
        s.allocate(&key("e"), alloc("e"), &[fixed_on(Protocol::Tcp, 54323, local)], |_, _| false).unwrap();
        let e = s.allocate(&key("f"), alloc("f"), &[fixed_on(Protocol::Tcp, 54323, None)], |_, _| false).unwrap_err();
        assert!(e.to_string().contains("already used by pod default/"), "{e}");
    }

    #[test]
    fn concurrent_allocations_never_share_a_port() {
        let s = std::sync::Arc::new(Store::new(PortRange { first: 30000, last: 30199 }, vec![]));
        let handles: Vec<_> = (0..50)
            .map(|i| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let id = format!("p{i}");
                    s.allocate(&key(&id), alloc(&id), &[auto(Protocol::Tcp, 80), auto(Protocol::Tcp, 81)], |_, _| false)
                        .unwrap()
                })
            })
            .collect();
        let mut ports: Vec<u16> =
            handles.into_iter().flat_map(|h| h.join().unwrap().ports.into_iter().map(|m| m.host_port)).collect();
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 100);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        const SMALL: PortRange = PortRange { first: 30000, last: 30007 };
        const IPS: [Option<IpAddr>; 4] = [
            None,
            Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1))),
            Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2))),
            Some(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1))),
        ];

        fn wanted() -> impl Strategy<Value = Wanted> {
            (any::<bool>(), prop::option::of(0u16..10), 0usize..IPS.len()).prop_map(|(udp, fixed, ip)| Wanted {
                protocol: if udp { Protocol::Udp } else { Protocol::Tcp },
                container_port: 80,
                // Fixed ports partly outside the range, as spec hostPorts may be.
                host_port: fixed.map(|o| SMALL.first - 1 + o),
                // Only fixed ports name an address (the annotation has none).
                host_ip: fixed.and(IPS[ip]),
                name: None,
            })
        }

        #[derive(Debug, Clone)]
        enum Op {
            Allocate(Vec<Wanted>),
            Release(usize),
        }

        fn ops() -> impl Strategy<Value = Vec<Op>> {
            let op = prop_oneof![
                3 => prop::collection::vec(wanted(), 1..4).prop_map(Op::Allocate),
                1 => any::<usize>().prop_map(Op::Release),
            ];
            prop::collection::vec(op, 1..60)
        }

        fn clash(a: &Mapping, b: &Mapping) -> bool {
            (a.protocol, a.host_port) == (b.protocol, b.host_port) && addresses_overlap(a.host_ip, b.host_ip)
        }

        proptest! {
            /// Under any sequence of ADDs and DELs (with a port bound by a
            /// host process): no two mappings clash, automatic ports stay in
            /// the range, a failed allocation changes nothing, and exhaustion
            /// is reported only when the range has no room for the request.
            #[test]
            fn host_ports_are_never_handed_out_twice(ops in ops(), bound_port in 0u16..8) {
                let store = Store::new(SMALL, Vec::new());
                let bound = |_: Protocol, p: u16| p == SMALL.first + bound_port;
                let mut live: Vec<Key> = Vec::new();
                for (n, op) in ops.into_iter().enumerate() {
                    match op {
                        Op::Allocate(wanted) => {
                            let id = format!("c{n}");
                            let before = store.all();
                            match store.allocate(&key(&id), alloc(&id), &wanted, bound) {
                                Ok(a) => {
                                    prop_assert_eq!(a.ports.len(), wanted.len());
                                    for m in a.ports.iter().filter(|m| m.auto) {
                                        prop_assert!(SMALL.contains(m.host_port), "{:?} outside the range", m);
                                        prop_assert!(!bound(m.protocol, m.host_port));
                                    }
                                    live.push(key(&id));
                                }
                                Err(e) => {
                                    prop_assert_eq!(&store.all(), &before, "a failed allocation changed the index");
                                    if let StoreError::Exhausted { protocol, .. } = e {
                                        // Automatic ports are on every address: a port is
                                        // free for them when nobody uses it at all.
                                        let in_use: Vec<u16> = before
                                            .iter()
                                            .flat_map(|a| a.ports.clone())
                                            .filter(|m| m.protocol == protocol)
                                            .map(|m| m.host_port)
                                            .chain(wanted.iter().filter(|w| w.protocol == protocol).filter_map(|w| w.host_port))
                                            .collect();
                                        let free = (SMALL.first..=SMALL.last)
                                            .filter(|p| !bound(protocol, *p) && !in_use.contains(p))
                                            .count();
                                        let asked =
                                            wanted.iter().filter(|w| w.protocol == protocol && w.host_port.is_none()).count();
                                        prop_assert!(free < asked, "exhausted with {} free for {} wanted", free, asked);
                                    }
                                }
                            }
                        }
                        Op::Release(i) if !live.is_empty() => {
                            let k = live.remove(i % live.len());
                            prop_assert!(store.release(&k).is_some());
                            prop_assert!(store.release(&k).is_none(), "released twice");
                        }
                        Op::Release(_) => {}
                    }
                    let all: Vec<(Key, Mapping)> =
                        store.all().into_iter().flat_map(|a| a.ports.iter().map(|m| (a.key(), m.clone())).collect::<Vec<_>>()).collect();
                    for (i, (ka, a)) in all.iter().enumerate() {
                        for (kb, b) in &all[i + 1..] {
                            prop_assert!(!clash(a, b), "{:?} of {:?} clashes with {:?} of {:?}", a, ka, b, kb);
                        }
                    }
                }
            }
        }
    }
}
