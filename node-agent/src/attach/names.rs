//! Names and MACs of an attachment's veth pair, derived from its key alone
//! (so that DEL and GC find them without a record). The record keeps both
//! the host veth's name and the pod's MAC, and they are read from there.

use crate::dataplane::link::HOST_VETH_PREFIX;
use crate::ipam::{Key, Record};
use crate::stable_hash;

/// 8 bytes of SHA-256 of an attachment key and a salt.
fn key_hash(key: &Key, salt: u8) -> [u8; 8] {
    stable_hash::prefix(&[key.container_id.as_bytes(), key.ifname.as_bytes(), &[salt]])
}

/// The host end of the pod's veth: the prefix and 10 hex digits of a hash
/// of (container ID, ifname): unique per attachment, derivable without a
/// record, and recognisable as ours. (A name already taken fails the ADD:
/// the kernel never merges two veths.)
pub fn host_veth_name(key: &Key) -> String {
    format!("{HOST_VETH_PREFIX}{}", stable_hash::hex(&key_hash(key, 0)[..5]))
}

/// A locally administered unicast MAC for one end of an attachment's veth
/// pair (`pod` picks the end), derived from the key.
pub fn veth_mac(key: &Key, pod: bool) -> [u8; 6] {
    let h = key_hash(key, if pod { 2 } else { 1 });
    [0x02, h[0], h[1], h[2], h[3], h[4]]
}

/// The MAC the pod's end of its veth was given: as recorded, or for a
/// record of an agent that did not record it, as that agent derived it.
pub fn pod_mac(record: &Record) -> [u8; 6] {
    record.pod_mac.map(|m| m.0).unwrap_or_else(|| legacy_veth_mac(&record.key(), true))
}

/// [`veth_mac`] of agents before SHA-256 (FNV-1a).
fn legacy_veth_mac(key: &Key, pod: bool) -> [u8; 6] {
    let salt = if pod { 2 } else { 1 };
    let h =
        stable_hash::legacy::fnv1a_64(key.container_id.bytes().chain([0]).chain(key.ifname.bytes()).chain([0, salt]))
            .to_be_bytes();
    [0x02, h[3], h[4], h[5], h[6], h[7]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::entries::Mac;

    fn key(ifname: &str) -> Key {
        Key { container_id: "abc".into(), ifname: ifname.into() }
    }

    #[test]
    fn host_veth_names_fit_and_differ() {
        let a = host_veth_name(&key("eth0"));
        let b = host_veth_name(&key("eth1"));
        assert_eq!(a.len(), 15);
        assert!(a.starts_with(HOST_VETH_PREFIX));
        assert_ne!(a, b);
        assert_eq!(a, host_veth_name(&key("eth0")));
    }

    #[test]
    fn veth_macs_are_local_unicast_and_differ_per_end() {
        let (host, pod) = (veth_mac(&key("eth0"), false), veth_mac(&key("eth0"), true));
        assert_ne!(host, pod);
        for mac in [host, pod] {
            assert_eq!(mac[0] & 0x03, 0x02, "locally administered, unicast: {mac:?}");
        }
    }

    #[test]
    fn a_record_of_an_older_agent_keeps_the_mac_that_agent_gave_its_pod() {
        let mut record = Record { container_id: "abc".into(), ifname: "eth0".into(), ..Default::default() };
        // What agents with FNV-1a names gave this pod (their test vector).
        let fnv = [0x02, 0xbb, 0x7e, 0x79, 0xbb, 0x86];
        assert_eq!(legacy_veth_mac(&record.key(), true), fnv);
        assert_eq!(pod_mac(&record), fnv);
        assert_ne!(veth_mac(&record.key(), true), fnv, "new pods get SHA-256 MACs");
        record.pod_mac = Some(Mac(veth_mac(&record.key(), true)));
        assert_eq!(pod_mac(&record), veth_mac(&record.key(), true));
    }
}
