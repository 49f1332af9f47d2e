//! Allocation records: one file per address in the state directory, written
//! atomically (temp file, then rename), so a record is either whole or absent.
//!
//! An ADD reserves an address in memory (`pending`), writes its record while
//! it builds the dataplane, and only answers once both are done. Whether an
//! attachment is complete is never taken from disk: start-up reconciliation
//! checks each record against the kernel and removes what an interrupted ADD
//! left half-made.
//!
//! Records are not fsynced. They describe network namespaces and veths,
//! which no reboot survives: an agent crash keeps the page cache (so every
//! written record), and after a power loss every record is stale anyway and
//! reconciliation releases it. A power loss may leave a record empty or
//! torn; one written before the current boot is dropped on load. Skipping
//! the two fsyncs takes about 1.5 ms off every ADD and DEL on a plain disk.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use weft_api::Protocol;

use super::pool::Pool;
use crate::attachment::Attachment;
use crate::dataplane::entries::Mac;

/// An attachment is identified by container ID and interface name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub container_id: String,
    pub ifname: String,
}

/// One host port forwarded to an attachment: kept in its record, so that an
/// ADD writes one file and DEL needs nothing else to remove the rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mapping {
    pub protocol: Protocol,
    pub container_port: u16,
    pub host_port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ip: Option<std::net::IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Picked from the range (annotation) rather than fixed (pod spec hostPort).
    pub auto: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    pub host_veth: String,
    /// `namespace/name` of the pod when the runtime said (K8S_POD_*).
    #[serde(default)]
    pub pod: String,
    /// The pod's UID, when known (K8S_POD_UID or the API).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_uid: String,
    /// Host ports forwarded to this attachment: recorded here so that an ADD
    /// writes one record, and DEL needs nothing else to remove them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_ports: Vec<Mapping>,
    /// How the pod was attached; records from before the choice existed are bridged.
    #[serde(default, skip_serializing_if = "Attachment::is_bridge")]
    pub attachment: Attachment,
    /// Whether the pod also got the IPv6 address of its IPv4 host number in
    /// the node's IPv6 block (a dual-stack node).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ipv6: bool,
    /// The MAC of the pod's end of its veth; absent in records of agents
    /// that derived it again each time (`attach::names::pod_mac`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_mac: Option<Mac>,
}

impl Record {
    pub fn key(&self) -> Key {
        Key { container_id: self.container_id.clone(), ifname: self.ifname.clone() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    #[error("container {} already has interface {} with address {ip}", .key.container_id, .key.ifname)]
    AlreadyAllocated { key: Key, ip: IpAddr },
    #[error("no free address left in pod CIDR {cidr} ({size} addresses, all allocated)")]
    Exhausted { cidr: ipnet::IpNet, size: u64 },
    #[error("IPAM state {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("IPAM record {path} is corrupt: {source}")]
    Corrupt { path: PathBuf, source: serde_json::Error },
}

/// The last address handed out, so that a restarted agent goes on after it
/// instead of handing out the addresses freed last (as host-local keeps
/// `last_reserved_ip`): a freed address may still be in other pods'
/// conntrack entries, peers' caches and policy sets for a while. A dot
/// file, so it is never taken for a record.
const CURSOR: &str = ".last-reserved";

#[derive(Default)]
struct Inner {
    by_ip: BTreeMap<IpAddr, Record>,
    by_key: HashMap<Key, IpAddr>,
    /// Addresses whose ADD is still in flight.
    pending: HashSet<IpAddr>,
    /// Addresses whose record (written in this boot) could not be read:
    /// some pod may hold them, so they are never handed out again.
    unreadable: BTreeMap<IpAddr, PathBuf>,
    last: Option<IpAddr>,
}

pub struct Ipam {
    pool: Pool,
    dir: PathBuf,
    inner: Mutex<Inner>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> IpamError + '_ {
    move |source| IpamError::Io { path: path.to_owned(), source }
}

impl Ipam {
    /// Loads every record in `dir` (created if missing). Records outside the
    /// pool are kept: they still describe addresses that live pods may use.
    pub fn open(pool: Pool, dir: &Path) -> Result<Self, IpamError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let mut inner = Inner::default();
        for entry in fs::read_dir(dir).map_err(io(dir))? {
            let entry = entry.map_err(io(dir))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == CURSOR {
                inner.last = fs::read_to_string(&path).ok().and_then(|t| t.trim().parse().ok());
                continue;
            }
            if name.starts_with('.') {
                // A temp file of an interrupted write: the rename never happened.
                fs::remove_file(&path).map_err(io(&path))?;
                continue;
            }
            let Ok(ip) = name.parse::<IpAddr>() else {
                tracing::warn!(path = %path.display(), "ignoring a file that is not an IPAM record");
                continue;
            };
            let bytes = fs::read(&path).map_err(io(&path))?;
            let record: Record = match serde_json::from_slice(&bytes) {
                Ok(r) => r,
                Err(_) if written_before_boot(&path) => {
                    // Cut short by a power loss; its pod went with the reboot.
                    tracing::warn!(path = %path.display(), "dropping an unreadable record from before the last boot");
                    fs::remove_file(&path).map_err(io(&path))?;
                    continue;
                }
                Err(source) => {
                    // Written in this boot: its pod may be running, and
                    // which pod that is cannot be known. Its address stays
                    // taken; the agent starts anyway.
                    tracing::error!(
                        path = %path.display(), error = %source,
                        "an IPAM record of this boot is unreadable: its address stays reserved until the file is removed (after making sure no pod uses the address)"
                    );
                    inner.unreadable.insert(ip, path);
                    continue;
                }
            };
            inner.by_key.insert(record.key(), ip);
            inner.by_ip.insert(ip, record);
        }
        Ok(Self { pool, dir: dir.to_owned(), inner: Mutex::new(inner) })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent maps (every
        // mutation is a single insert/remove), so poisoning is ignored.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Picks a free address for `record` and holds it as pending. Nothing is
    /// written yet: call [`Ipam::persist`] before the ADD answers.
    pub fn reserve(&self, record: Record) -> Result<IpAddr, IpamError> {
        let key = record.key();
        let mut inner = self.lock();
        if let Some(ip) = inner.by_key.get(&key) {
            return Err(IpamError::AlreadyAllocated { key, ip: *ip });
        }
        let ip = self
            .pool
            .next_free(|ip| inner.by_ip.contains_key(ip) || inner.unreadable.contains_key(ip), inner.last)
            .ok_or(IpamError::Exhausted { cidr: self.pool.cidr(), size: self.pool.size() })?;
        inner.last = Some(ip);
        inner.by_key.insert(key, ip);
        inner.by_ip.insert(ip, record);
        inner.pending.insert(ip);
        Ok(ip)
    }

    /// Adds host ports to a reserved (not yet persisted) record.
    pub fn set_host_ports(&self, ip: IpAddr, pod_uid: &str, ports: Vec<Mapping>) {
        if let Some(r) = self.lock().by_ip.get_mut(&ip) {
            r.pod_uid = pod_uid.to_owned();
            r.host_ports = ports;
        }
    }

    /// Writes the record of a reserved address durably, and the address as
    /// the allocation cursor.
    pub fn persist(&self, ip: IpAddr) -> Result<(), IpamError> {
        let Some(record) = self.lock().by_ip.get(&ip).cloned() else { return Ok(()) };
        self.write(ip, &record)?;
        let cursor = self.dir.join(CURSOR);
        if let Err(e) = fs::write(&cursor, ip.to_string()) {
            // Only the order of later allocations depends on it.
            tracing::warn!(path = %cursor.display(), error = %e, "cannot save the IPAM allocation cursor");
        }
        Ok(())
    }

    /// The ADD of `ip` finished: it is no longer pending.
    pub fn commit(&self, ip: IpAddr) {
        self.lock().pending.remove(&ip);
    }

    /// True while the ADD that reserved `ip` is still running.
    pub fn is_pending(&self, ip: IpAddr) -> bool {
        self.lock().pending.contains(&ip)
    }

    /// Addresses kept out of use because their record is unreadable.
    pub fn unreadable(&self) -> Vec<(IpAddr, PathBuf)> {
        self.lock().unreadable.iter().map(|(ip, p)| (*ip, p.clone())).collect()
    }

    pub fn get(&self, key: &Key) -> Option<(IpAddr, Record)> {
        let inner = self.lock();
        let ip = *inner.by_key.get(key)?;
        inner.by_ip.get(&ip).map(|r| (ip, r.clone()))
    }

    pub fn all(&self) -> Vec<(IpAddr, Record)> {
        self.lock().by_ip.iter().map(|(ip, r)| (*ip, r.clone())).collect()
    }

    /// Releases the address of `key`; `Ok(None)` when it had none.
    pub fn release(&self, key: &Key) -> Result<Option<(IpAddr, Record)>, IpamError> {
        let Some((ip, record)) = self.get(key) else {
            return Ok(None);
        };
        let path = self.dir.join(ip.to_string());
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&path)(e)),
        }
        let mut inner = self.lock();
        inner.by_key.remove(key);
        inner.by_ip.remove(&ip);
        inner.pending.remove(&ip);
        Ok(Some((ip, record)))
    }

    /// (allocated, free) addresses of the pool.
    pub fn usage(&self) -> (u64, u64) {
        let inner = self.lock();
        let taken = inner.by_ip.keys().chain(inner.unreadable.keys());
        let allocated = taken.filter(|ip| self.pool.contains(**ip)).count() as u64;
        (allocated, self.pool.size().saturating_sub(allocated))
    }

    fn write(&self, ip: IpAddr, record: &Record) -> Result<(), IpamError> {
        let path = self.dir.join(ip.to_string());
        let tmp = self.dir.join(format!(".{ip}.tmp"));
        let bytes = serde_json::to_vec(record).map_err(|source| IpamError::Corrupt { path: path.clone(), source })?;
        fs::write(&tmp, &bytes).map_err(io(&tmp))?;
        fs::rename(&tmp, &path).map_err(io(&path))
    }
}

/// True when `path` was last written before this boot (from /proc/stat's
/// btime); false when either time is unknown.
fn written_before_boot(path: &Path) -> bool {
    let Ok(modified) = fs::metadata(path).and_then(|m| m.modified()) else { return false };
    boot_time().is_some_and(|boot| modified < boot)
}

fn boot_time() -> Option<std::time::SystemTime> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let secs = stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn record(id: &str) -> Record {
        Record {
            pod_uid: String::new(),
            host_ports: Vec::new(),
            container_id: id.into(),
            ifname: "eth0".into(),
            netns: "/run/netns/x".into(),
            host_veth: "weftv0".into(),
            pod: String::new(),
            attachment: Attachment::default(),
            ipv6: false,
            pod_mac: None,
        }
    }

    fn ipam(dir: &Path, cidr: &str) -> Ipam {
        Ipam::open(Pool::new(cidr.parse().unwrap()).unwrap(), dir).unwrap()
    }

    #[test]
    fn a_record_keeps_its_pod_mac_and_one_of_an_older_agent_reads_without_it() {
        let mut r = record("c1");
        r.pod_mac = Some(Mac([0x02, 0xab, 0, 0, 0, 1]));
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains(r#""podMac":"02:ab:00:00:00:01""#), "{text}");
        assert_eq!(serde_json::from_str::<Record>(&text).unwrap(), r);
        let older = r#"{"containerId":"c1","ifname":"eth0","netns":"/run/netns/x","hostVeth":"weftv0"}"#;
        assert_eq!(serde_json::from_str::<Record>(older).unwrap().pod_mac, None);
        let bad = r#"{"containerId":"c1","ifname":"eth0","netns":"x","hostVeth":"v","podMac":"02:ab"}"#;
        assert!(serde_json::from_str::<Record>(bad).unwrap_err().to_string().contains("invalid MAC address"));
    }

    #[test]
    fn records_survive_reopen_with_state() {
        let dir = tempfile::tempdir().unwrap();
        let a = ipam(dir.path(), "10.1.0.0/24");
        let ip = a.reserve(record("c1")).unwrap();
        a.persist(ip).unwrap();
        a.commit(ip);
        let ip2 = a.reserve(record("c2")).unwrap();
        assert!(a.is_pending(ip2) && !a.is_pending(ip));
        drop(a);
        let b = ipam(dir.path(), "10.1.0.0/24");
        let key = |id: &str| Key { container_id: id.into(), ifname: "eth0".into() };
        assert_eq!(b.get(&key("c1")).unwrap(), (ip, record("c1")));
        assert!(b.get(&key("c2")).is_none(), "a reservation never persisted is not remembered");
    }

    #[test]
    fn a_reopened_store_goes_on_after_the_last_address_handed_out() {
        let dir = tempfile::tempdir().unwrap();
        let key = |id: &str| Key { container_id: id.into(), ifname: "eth0".into() };
        let a = ipam(dir.path(), "10.1.0.0/24");
        let mut given = Vec::new();
        for id in ["c1", "c2", "c3"] {
            let ip = a.reserve(record(id)).unwrap();
            a.persist(ip).unwrap();
            a.commit(ip);
            given.push(ip);
        }
        for id in ["c1", "c2", "c3"] {
            a.release(&key(id)).unwrap();
        }
        drop(a);
        let b = ipam(dir.path(), "10.1.0.0/24");
        let next = b.reserve(record("c4")).unwrap();
        assert!(!given.contains(&next), "{next} was freed a moment ago; handed out were {given:?}");
        let after = |ip: IpAddr| match ip {
            IpAddr::V4(a) => IpAddr::from(std::net::Ipv4Addr::from(u32::from(a) + 1)),
            IpAddr::V6(a) => IpAddr::from(std::net::Ipv6Addr::from(u128::from(a) + 1)),
        };
        assert_eq!(next, after(given[2]));
        assert!(b.all().iter().all(|(ip, _)| *ip == next), "the cursor is not a record");
    }

    #[test]
    fn a_torn_record_from_before_the_boot_is_dropped_and_one_of_this_boot_keeps_its_address() {
        let dir = tempfile::tempdir().unwrap();
        let torn = dir.path().join("10.1.0.6");
        // What a power loss can leave: the rename landed, the data did not.
        fs::write(&torn, b"").unwrap();
        // Written in this boot: not ours to guess. The agent starts, and the
        // address is never handed out while the file is there.
        let kept = ipam(dir.path(), "10.1.0.4/30");
        assert_eq!(kept.unreadable(), [("10.1.0.6".parse().unwrap(), torn.clone())]);
        assert!(kept.all().is_empty() && torn.exists());
        assert_eq!(kept.usage(), (1, 0));
        assert!(matches!(kept.reserve(record("c1")), Err(IpamError::Exhausted { .. })), "10.1.0.6 is not free");
        let torn = dir.path().join("10.1.0.7");
        fs::write(&torn, b"").unwrap();
        fs::File::options().write(true).open(&torn).unwrap().set_modified(std::time::UNIX_EPOCH).unwrap();
        let a = ipam(dir.path(), "10.1.0.0/24");
        assert!(a.all().is_empty() && !torn.exists());
    }

    #[test]
    fn host_ports_are_part_of_the_record() {
        use crate::hostport::store::Allocation;
        let dir = tempfile::tempdir().unwrap();
        let a = ipam(dir.path(), "10.1.0.0/24");
        let mut r = record("c1");
        r.pod = "default/web".into();
        let ip = a.reserve(r).unwrap();
        let mapping = Mapping {
            protocol: weft_api::Protocol::Udp,
            container_port: 53,
            host_port: 20001,
            host_ip: None,
            name: Some("dns".into()),
            auto: true,
        };
        a.set_host_ports(ip, "uid-1", vec![mapping.clone()]);
        a.persist(ip).unwrap();
        drop(a);
        let b = ipam(dir.path(), "10.1.0.0/24");
        let (ip2, r) = b.get(&Key { container_id: "c1".into(), ifname: "eth0".into() }).unwrap();
        let alloc = Allocation::from_record(ip2, None, &r).unwrap();
        assert_eq!(
            (alloc.pod_namespace.as_str(), alloc.pod_name.as_str(), alloc.pod_uid.as_str()),
            ("default", "web", "uid-1")
        );
        assert_eq!((alloc.pod_ip, alloc.ports), (ip, vec![mapping]));
        assert!(Allocation::from_record(ip2, None, &record("c2")).is_none(), "no host ports, no allocation");
    }

    #[test]
    fn an_ipv6_only_store_keeps_its_records_and_cursor_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let a = ipam(dir.path(), "fd00:10:244:1::/64");
        let ip = a.reserve(record("c1")).unwrap();
        assert_eq!(ip.to_string(), "fd00:10:244:1::2");
        a.persist(ip).unwrap();
        a.commit(ip);
        assert!(dir.path().join("fd00:10:244:1::2").exists(), "one file per address, named by it");
        a.release(&Key { container_id: "c1".into(), ifname: "eth0".into() }).unwrap();
        let ip = a.reserve(record("c2")).unwrap();
        a.persist(ip).unwrap();
        drop(a);
        let b = ipam(dir.path(), "fd00:10:244:1::/64");
        assert_eq!(b.get(&Key { container_id: "c2".into(), ifname: "eth0".into() }).map(|(ip, _)| ip), Some(ip));
        assert_eq!(b.reserve(record("c3")).unwrap().to_string(), "fd00:10:244:1::4", "goes on after the cursor");
        assert_eq!(b.usage(), (2, u64::MAX - 4));
    }

    #[test]
    fn duplicate_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = ipam(dir.path(), "10.1.0.0/24");
        a.reserve(record("c1")).unwrap();
        assert!(matches!(a.reserve(record("c1")), Err(IpamError::AlreadyAllocated { .. })));
    }

    #[test]
    fn exhaustion_is_a_clear_error_and_release_frees() {
        let dir = tempfile::tempdir().unwrap();
        let a = ipam(dir.path(), "10.1.0.0/30");
        a.reserve(record("c1")).unwrap();
        let err = a.reserve(record("c2")).unwrap_err();
        assert!(err.to_string().contains("no free address left in pod CIDR 10.1.0.0/30"), "{err}");
        let key = Key { container_id: "c1".into(), ifname: "eth0".into() };
        assert!(a.release(&key).unwrap().is_some());
        assert!(a.release(&key).unwrap().is_none(), "second release is a no-op");
        a.reserve(record("c2")).unwrap();
        assert_eq!(a.usage(), (1, 0));
    }

    #[test]
    fn concurrent_reservations_never_collide() {
        let dir = tempfile::tempdir().unwrap();
        let a = Arc::new(ipam(dir.path(), "10.1.0.0/24"));
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let a = Arc::clone(&a);
                std::thread::spawn(move || {
                    (0..15)
                        .map(|i| {
                            let ip = a.reserve(record(&format!("c{t}-{i}"))).unwrap();
                            a.persist(ip).unwrap();
                            ip
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<_> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
        all.sort();
        let n = all.len();
        all.dedup();
        assert_eq!(all.len(), n);
        assert_eq!(n, 240);
        drop(a);
        assert_eq!(ipam(dir.path(), "10.1.0.0/24").all().len(), 240, "every record reached the disk");
    }

    #[test]
    fn leftover_temp_files_are_removed_on_open() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(".10.1.0.9.tmp"), b"{").unwrap();
        let a = ipam(dir.path(), "10.1.0.0/24");
        assert!(a.all().is_empty());
        assert!(!dir.path().join(".10.1.0.9.tmp").exists());
    }
}
