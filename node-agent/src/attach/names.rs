//! Names and MACs of an attachment's veth pair, derived from its key alone
//! (so that DEL and GC find them without a record).

use crate::dataplane::link::HOST_VETH_PREFIX;
use crate::ipam::Key;

/// A hash of an attachment key and a salt, the same in every build.
fn key_hash(key: &Key, salt: u8) -> u64 {
    crate::stable_hash::fnv1a_64(key.container_id.bytes().chain([0]).chain(key.ifname.bytes()).chain([0, salt]))
}

/// The host end of the pod's veth: the prefix and 10 hex digits of a stable
/// hash of (container ID, ifname): unique per attachment, derivable without
/// a record, and recognisable as ours.
pub fn host_veth_name(key: &Key) -> String {
    format!("{HOST_VETH_PREFIX}{:010x}", key_hash(key, 0) & 0xff_ffff_ffff)
}

/// A locally administered unicast MAC for one end of an attachment's veth
/// pair (`pod` picks the end), derived from the key.
pub fn veth_mac(key: &Key, pod: bool) -> [u8; 6] {
    let h = key_hash(key, if pod { 2 } else { 1 }).to_be_bytes();
    [0x02, h[3], h[4], h[5], h[6], h[7]]
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
