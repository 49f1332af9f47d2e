//! The VXLAN device (`weft.1`): created or adopted, with its VTEP address,
//! MTU and MAC, up, and with tx checksum offload off.

use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_route::link::{InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkInfo, LinkMessage};
use rtnetlink::{Handle, LinkUnspec, LinkVxlan};

use super::{DataplaneError, link, op, underlay};

/// VXLAN over IPv4 adds outer Ethernet (14) + IPv4 (20) + UDP (8) + VXLAN (8).
pub const VXLAN_OVERHEAD_V4: u32 = 50;
/// Over IPv6 the outer IP header is 40 bytes instead of 20.
pub const VXLAN_OVERHEAD_V6: u32 = 70;

/// Linux's historic VXLAN port, which flannel uses too (IANA's is 4789).
pub const DEFAULT_PORT: u16 = 8472;

/// The MTU of a VXLAN device over an underlay of `underlay_mtu` whose
/// tunnel endpoints are addresses like `local` (the outer header's family
/// decides; the inner packets' family does not matter).
pub fn mtu_for(underlay_mtu: u32, local: IpAddr) -> u32 {
    let overhead = if local.is_ipv6() { VXLAN_OVERHEAD_V6 } else { VXLAN_OVERHEAD_V4 };
    underlay_mtu.saturating_sub(overhead)
}

/// A stable, locally administered unicast MAC for the VTEP of `node_ip`, so
/// a recreated device keeps the MAC peers already have: an IPv4 address's
/// four bytes, or a hash of all sixteen of an IPv6 one, whose last four
/// bytes alone repeat across prefixes.
pub fn mac_for(node_ip: IpAddr) -> [u8; 6] {
    let [a, b, c, d] = match node_ip {
        IpAddr::V4(ip) => ip.octets(),
        IpAddr::V6(ip) => crate::stable_hash::prefix(&[&ip.octets()]),
    };
    [0x02, 0x57, a, b, c, d]
}

/// [`mac_for`] of agents before SHA-256 (FNV-1a for IPv6; IPv4 is the same).
pub fn legacy_mac_for(node_ip: IpAddr) -> [u8; 6] {
    let [a, b, c, d] = match node_ip {
        IpAddr::V4(ip) => ip.octets(),
        IpAddr::V6(ip) => crate::stable_hash::legacy::fnv1a_32(ip.octets()).to_be_bytes(),
    };
    [0x02, 0x57, a, b, c, d]
}

/// Whether `mac` is one an agent derives from `node_ip`, this one or one
/// before it (a node that upgraded in place keeps its VTEP's MAC).
pub fn is_derived(node_ip: IpAddr, mac: [u8; 6]) -> bool {
    mac == mac_for(node_ip) || mac == legacy_mac_for(node_ip)
}

/// What the device must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanSpec {
    pub name: String,
    pub vni: u32,
    pub port: u16,
    /// Source address of encapsulated packets: the node IP (or its IPv6
    /// address for VXLAN over IPv6).
    pub local: IpAddr,
    pub underlay_index: u32,
    pub mtu: u32,
    pub mac: [u8; 6],
    /// Another MAC the device keeps if it has it (the one an older agent
    /// derived): changing it would cut the node off until every peer had
    /// the new one.
    pub kept_mac: Option<[u8; 6]>,
    /// The VTEP address (pod CIDR network address /32, or /128).
    pub address: IpNet,
    /// Turn tx checksum offload off (see [`disable_tx_checksum`]); only
    /// kernels with the bug need it, and it costs most of the throughput.
    pub tx_checksum_workaround: bool,
}

/// Whether this kernel needs the tx checksum workaround: the bug that made
/// SNATed VXLAN traffic carry bad checksums was fixed in Linux 5.7
/// ("netfilter: nat: never update the UDP checksum when it's 0").
pub fn kernel_needs_tx_checksum_workaround() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|r| release_before_5_7(&r)).unwrap_or(true)
}

/// `release` is a kernel release string such as `6.18.44-fc-v782`.
pub fn release_before_5_7(release: &str) -> bool {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
    match (parts.next(), parts.next()) {
        (Some(major), Some(minor)) => (major, minor) < (5, 7),
        _ => true,
    }
}

/// The device after [`ensure`], and what had to be fixed to get there
/// (empty when the existing device was adopted as it was).
#[derive(Debug, Clone)]
pub struct Vxlan {
    pub index: u32,
    /// Its MAC: the spec's, or the one it kept.
    pub mac: [u8; 6],
    pub changes: Vec<String>,
}

/// Creates the device or adopts an existing one. Attributes that cannot be
/// changed in place (VNI, port, local address, underlay, learning) make it
/// be recreated; MTU, MAC, addresses and state are fixed in place.
pub async fn ensure(h: &Handle, spec: &VxlanSpec) -> Result<Vxlan, DataplaneError> {
    let mut changes = Vec::new();
    let mut existing = link::by_name(h, &spec.name).await?;
    if let Some(l) = &existing
        && let Some(why) = incompatible(l, spec)
    {
        tracing::warn!(device = %spec.name, reason = %why, "recreating the VXLAN device");
        h.link().del(l.header.index).execute().await.map_err(op(format!("delete {}", spec.name)))?;
        changes.push(format!("recreated: {why}"));
        existing = None;
    }
    let l = match existing {
        Some(l) => l,
        None => {
            let builder = LinkVxlan::new(&spec.name, spec.vni).dev(spec.underlay_index);
            let builder = match spec.local {
                IpAddr::V4(ip) => builder.local(ip),
                IpAddr::V6(ip) => builder.local6(ip),
            };
            let msg = builder.port(spec.port).learning(false).mtu(spec.mtu).address(spec.mac.to_vec()).up().build();
            h.link().add(msg).execute().await.map_err(op(format!("create VXLAN device {}", spec.name)))?;
            if changes.is_empty() {
                changes.push("created".into());
            }
            link::by_name(h, &spec.name)
                .await?
                .ok_or_else(|| DataplaneError::Unexpected(format!("{} vanished after creation", spec.name)))?
        }
    };
    let index = l.header.index;
    if underlay::mtu_of(&l) != Some(spec.mtu) {
        set(h, LinkUnspec::new_with_index(index).mtu(spec.mtu).build(), &spec.name, "set MTU").await?;
        changes.push(format!("MTU set to {}", spec.mtu));
    }
    let mac = spec.kept_mac.filter(|kept| mac_of(&l) == Some(*kept)).unwrap_or(spec.mac);
    if mac_of(&l) != Some(mac) {
        set(h, LinkUnspec::new_with_index(index).address(mac.to_vec()).build(), &spec.name, "set MAC").await?;
        changes.push("MAC set".into());
    }
    changes.extend(link::ensure_only_address(h, index, &spec.name, spec.address).await?);
    if !link::is_up(&l) {
        set(h, LinkUnspec::new_with_index(index).up().build(), &spec.name, "set up").await?;
        changes.push("set up".into());
    }
    // Inline, not on a blocking thread: two non-blocking ioctls, and they must
    // run in this thread's network namespace, the one `h` operates in.
    if spec.tx_checksum_workaround && disable_tx_checksum(&spec.name)? {
        changes.push("tx checksum offload turned off".into());
    }
    Ok(Vxlan { index, mac, changes })
}

async fn set(h: &Handle, msg: LinkMessage, name: &str, what: &str) -> Result<(), DataplaneError> {
    h.link().set(msg).execute().await.map_err(op(format!("{what} on {name}")))
}

/// Why an existing link cannot be adopted as the device, if it cannot.
fn incompatible(l: &LinkMessage, spec: &VxlanSpec) -> Option<String> {
    let infos = l.attributes.iter().find_map(|a| if let LinkAttribute::LinkInfo(i) = a { Some(i) } else { None });
    let Some(infos) = infos else { return Some("not a VXLAN device".into()) };
    if !infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Vxlan))) {
        return Some("not a VXLAN device".into());
    }
    let data = infos.iter().find_map(|i| if let LinkInfo::Data(InfoData::Vxlan(d)) = i { Some(d) } else { None });
    let data = data.map(Vec::as_slice).unwrap_or_default();
    let (mut vni, mut port, mut local, mut dev, mut learning) = (None, None, None, None, None);
    for d in data {
        match d {
            InfoVxlan::Id(v) => vni = Some(*v),
            InfoVxlan::Port(p) => port = Some(*p),
            InfoVxlan::Local(a) => local = Some(IpAddr::V4(*a)),
            InfoVxlan::Local6(a) => local = Some(IpAddr::V6(*a)),
            InfoVxlan::Link(i) => dev = Some(*i),
            InfoVxlan::Learning(b) => learning = Some(*b),
            _ => {}
        }
    }
    if vni != Some(spec.vni) {
        return Some(format!("VNI {vni:?}, want {}", spec.vni));
    }
    if port != Some(spec.port) {
        return Some(format!("port {port:?}, want {}", spec.port));
    }
    if local != Some(spec.local) {
        return Some(format!("local address {local:?}, want {}", spec.local));
    }
    if dev != Some(spec.underlay_index) {
        return Some(format!("underlay interface {dev:?}, want {}", spec.underlay_index));
    }
    if learning != Some(false) {
        return Some("MAC learning is on".into());
    }
    None
}

fn mac_of(l: &LinkMessage) -> Option<[u8; 6]> {
    l.attributes.iter().find_map(|a| match a {
        LinkAttribute::Address(b) => <[u8; 6]>::try_from(b.as_slice()).ok(),
        _ => None,
    })
}

const ETHTOOL_GTXCSUM: u32 = 0x16;
const ETHTOOL_STXCSUM: u32 = 0x17;

/// `struct ethtool_value` from <linux/ethtool.h>.
#[repr(C)]
struct EthtoolValue {
    cmd: u32,
    data: u32,
}

/// Turns off tx checksum offload on `ifname`; `Ok(true)` when it was on.
///
/// Why: with offload on, the kernel may leave the inner packet's checksum to
/// "hardware" that a VXLAN device does not have; some kernels then emit bad
/// checksums for encapsulated traffic (notably SNATed with --random-fully),
/// which receivers drop — the 63-second delays flannel users hit and fixed
/// with `ethtool -K flannel.1 tx-checksum-ip-generic off`. Software checksums
/// cost little at VXLAN rates. Done with the SIOCETHTOOL ioctl
/// (ETHTOOL_STXCSUM) rather than the ethtool binary, which the product must
/// not depend on. Acts in the calling thread's network namespace.
pub fn disable_tx_checksum(ifname: &str) -> Result<bool, DataplaneError> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    let fail = |what: &str, e: std::io::Error| DataplaneError::Unexpected(format!("{what} on {ifname}: {e}"));
    if ifname.len() >= libc::IFNAMSIZ {
        return Err(DataplaneError::Unexpected(format!("interface name {ifname} is too long")));
    }
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(fail("open an ioctl socket", std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a freshly opened descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };

    let ethtool = |cmd: u32, data: u32| -> std::io::Result<u32> {
        let mut value = EthtoolValue { cmd, data };
        // SAFETY: ifreq is plain old data; all-zeros is a valid value.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in ifr.ifr_name.iter_mut().zip(ifname.bytes()) {
            *dst = src as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = (&mut value as *mut EthtoolValue).cast();
        // SAFETY: SIOCETHTOOL reads ifr (NUL-terminated name, checked length
        // above) and reads/writes the ethtool_value it points to, which
        // outlives the call.
        let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCETHTOOL as _, &mut ifr) };
        if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(value.data) }
    };
    if ethtool(ETHTOOL_GTXCSUM, 0).map_err(|e| fail("read tx checksum offload", e))? == 0 {
        return Ok(false);
    }
    ethtool(ETHTOOL_STXCSUM, 0).map_err(|e| fail("turn off tx checksum offload", e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_workaround_only_before_linux_5_7() {
        assert!(release_before_5_7("4.19.0-18-amd64"));
        assert!(release_before_5_7("5.6.19"));
        assert!(!release_before_5_7("5.7.0"));
        assert!(!release_before_5_7("6.18.44-fc-v782"));
        assert!(release_before_5_7("garbage"), "unknown kernels get the safe setting");
    }

    #[test]
    fn mtu_leaves_room_for_the_encapsulation() {
        let (v4, v6): (IpAddr, IpAddr) = ("10.0.0.1".parse().expect("v4"), "fd00::1".parse().expect("v6"));
        assert_eq!(mtu_for(1500, v4), 1450);
        assert_eq!(mtu_for(9000, v4), 8950);
        assert_eq!(mtu_for(20, v4), 0);
        assert_eq!(mtu_for(1500, v6), 1430, "an IPv6 underlay's outer header is 20 bytes longer");
    }

    #[test]
    fn vtep_mac_is_stable_unicast_and_local() {
        let m = mac_for(std::net::Ipv4Addr::new(192, 168, 1, 7).into());
        assert_eq!(m, [0x02, 0x57, 192, 168, 1, 7]);
        assert_eq!(m[0] & 0x01, 0, "unicast");
        assert_eq!(m[0] & 0x02, 0x02, "locally administered");
        let v6 = |s: &str| mac_for(s.parse().unwrap());
        assert_eq!(v6("fd00:250::2"), v6("fd00:250::2"), "stable");
        assert_ne!(v6("fd00:250::2"), v6("fd00:251::2"), "the same host number in another prefix");
        assert_eq!(&v6("fd00:250::2")[..2], &[0x02, 0x57]);
        // What FNV-1a gave before (for fd00:250::2, computed apart) is
        // still recognised as derived, and no longer given.
        let ip: IpAddr = "fd00:250::2".parse().unwrap();
        let fnv = legacy_mac_for(ip);
        assert_ne!(fnv, mac_for(ip));
        assert!(is_derived(ip, fnv) && is_derived(ip, mac_for(ip)));
        assert!(!is_derived(ip, legacy_mac_for("fd00:250::3".parse().unwrap())));
        assert_eq!(legacy_mac_for(m_ip()), mac_for(m_ip()), "IPv4 MACs did not change");
    }

    fn m_ip() -> IpAddr {
        std::net::Ipv4Addr::new(192, 168, 1, 7).into()
    }
}
