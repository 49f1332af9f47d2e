//! The kernel entries the overlay is made of — routes, neighbour (ARP) entries
//! and VXLAN FDB entries — as plain values, shared by the overlay's desired
//! state, what this layer observes and the operations it applies. Addresses
//! are `IpAddr`/`IpNet` so that IPv6 can be added without changing these types.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

/// Route protocol number marking routes Weft created ('W'). Unassigned in
/// /etc/iproute2/rt_protos; `ip route show proto 0x57` lists ours.
pub const RTPROT_WEFT: u8 = 0x57;

/// A 48-bit Ethernet address.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 6]
    }

    /// Group bit set: multicast, including broadcast.
    pub fn is_multicast(&self) -> bool {
        self.0[0] & 0x01 != 0
    }

    /// Usable as a VTEP's unicast address.
    pub fn is_valid_unicast(&self) -> bool {
        !self.is_zero() && !self.is_multicast()
    }

    /// From a netlink link-layer address attribute; `None` unless 6 bytes.
    pub fn from_slice(b: &[u8]) -> Option<Self> {
        <[u8; 6]>::try_from(b).ok().map(Mac)
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MAC address {0:?} (expected six hex octets separated by ':')")]
pub struct ParseMacError(pub String);

impl std::str::FromStr for Mac {
    type Err = ParseMacError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for slot in &mut out {
            let p = parts.next().ok_or_else(|| ParseMacError(s.to_owned()))?;
            if p.len() != 2 {
                return Err(ParseMacError(s.to_owned()));
            }
            *slot = u8::from_str_radix(p, 16).map_err(|_| ParseMacError(s.to_owned()))?;
        }
        if parts.next().is_some() {
            return Err(ParseMacError(s.to_owned()));
        }
        Ok(Mac(out))
    }
}

/// In files (IPAM records) as its text, `02:ab:…`.
impl serde::Serialize for Mac {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Mac {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The device a route leaves through, as the overlay sees it. The kernel
/// layer maps these to interface indices and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dev {
    /// The VXLAN device (`weft.1`).
    Vxlan,
    /// The underlay interface carrying the node IP.
    Underlay,
    /// The TUN device of the udp and wireguard backends.
    Tunnel,
    /// Any other interface, by index (only ever observed, never desired).
    Other(u32),
}

/// Identity of a route in the main table: the kernel allows one route per
/// destination and metric (we never set TOS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouteKey {
    pub dst: IpNet,
    pub metric: u32,
}

/// A unicast route in the main table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: IpNet,
    pub metric: u32,
    pub via: IpAddr,
    pub dev: Dev,
    pub onlink: bool,
}

impl Route {
    pub fn key(&self) -> RouteKey {
        RouteKey { dst: self.dst, metric: self.metric }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "route {} via {} dev {:?}", self.dst, self.via, self.dev)?;
        if self.metric != 0 {
            write!(f, " metric {}", self.metric)?;
        }
        if self.onlink {
            f.write_str(" onlink")?;
        }
        Ok(())
    }
}

/// A permanent neighbour entry on the VXLAN device: peer VTEP IP → VTEP MAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Neigh {
    pub ip: IpAddr,
    pub mac: Mac,
}

impl fmt::Display for Neigh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "neighbour {} lladdr {}", self.ip, self.mac)
    }
}

/// A static FDB entry on the VXLAN device: VTEP MAC → peer node IP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fdb {
    pub mac: Mac,
    pub dst: IpAddr,
}

impl fmt::Display for Fdb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fdb {} dst {}", self.mac, self.dst)
    }
}

/// Any one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Route(Route),
    Neigh(Neigh),
    Fdb(Fdb),
}

impl Entry {
    pub fn key(&self) -> EntryKey {
        match self {
            Entry::Route(r) => EntryKey::Route(r.key()),
            Entry::Neigh(n) => EntryKey::Neigh(n.ip),
            Entry::Fdb(f) => EntryKey::Fdb(f.mac),
        }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Route(r) => r.fmt(f),
            Entry::Neigh(n) => n.fmt(f),
            Entry::Fdb(x) => x.fmt(f),
        }
    }
}

/// What identifies an entry within its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntryKey {
    Route(RouteKey),
    Neigh(IpAddr),
    Fdb(Mac),
}

/// A route in the main table as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedRoute {
    pub route: Route,
    pub proto: u8,
}

/// A neighbour entry on the VXLAN device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedNeigh {
    pub ip: IpAddr,
    pub mac: Option<Mac>,
    /// NUD_PERMANENT: set by someone, not learned by the kernel.
    pub permanent: bool,
}

/// The kernel's current state, as far as the overlay cares.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Unicast routes of the main table (any protocol, any device).
    pub routes: BTreeMap<RouteKey, ObservedRoute>,
    /// Neighbour entries on the VXLAN device.
    pub neighs: BTreeMap<IpAddr, ObservedNeigh>,
    /// FDB entries on the VXLAN device: MAC → remote destinations, in the
    /// kernel's order (the first is the one NLM_F_REPLACE replaces).
    pub fdb: BTreeMap<Mac, Vec<IpAddr>>,
}

/// One kernel operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Add(Entry),
    Replace(Entry),
    Delete(Entry),
}

impl Op {
    pub fn entry(&self) -> &Entry {
        match self {
            Op::Add(e) | Op::Replace(e) | Op::Delete(e) => e,
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Add(e) => write!(f, "add {e}"),
            Op::Replace(e) => write!(f, "replace {e}"),
            Op::Delete(e) => write!(f, "delete {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_classification() {
        assert!(Mac([0; 6]).is_zero());
        assert!(!Mac([0; 6]).is_valid_unicast());
        assert!(Mac([0xff; 6]).is_multicast());
        assert!(Mac([0x01, 0, 0x5e, 0, 0, 1]).is_multicast());
        assert!(Mac([0x02, 0x57, 1, 2, 3, 4]).is_valid_unicast());
    }

    #[test]
    fn mac_parses_and_prints() {
        let m: Mac = "0a:58:ff:00:e3:37".parse().unwrap();
        assert_eq!(m, Mac([0x0a, 0x58, 0xff, 0x00, 0xe3, 0x37]));
        assert_eq!(m.to_string(), "0a:58:ff:00:e3:37");
        for bad in ["", "0a:58:ff:00:e3", "0a:58:ff:00:e3:37:00", "0a:58:ff:00:e3:zz", "a:58:ff:00:e3:37"] {
            assert!(bad.parse::<Mac>().is_err(), "{bad}");
        }
        assert_eq!(Mac::from_slice(&[1, 2, 3]), None);
        assert_eq!(Mac::from_slice(&[2, 0, 0, 0, 0, 1]), Some(Mac([2, 0, 0, 0, 0, 1])));
    }
}
