//! The overlay's desired state, computed purely from this node's facts and
//! the peers' Subnets. Flannel's design: in VXLAN mode each peer gets
//!
//! - `route <peer CIDR> via <peer VTEP IP> dev weft.1 onlink`,
//! - `neigh <peer VTEP IP> lladdr <peer VTEP MAC> dev weft.1 permanent`,
//! - `fdb <peer VTEP MAC> dev weft.1 dst <peer node IP> self permanent`,
//!
//! where the VTEP IP is the network address of the peer's pod CIDR (like
//! flannel's `.0/32` on `flannel.1`). A dual-stack peer's IPv6 block gets
//! the same route and neighbour entry with the IPv6 block's network address
//! as VTEP address, over the same device and FDB entry (IPv6 inside VXLAN
//! over the IPv4 underlay); both nodes must have an IPv6 block. With
//! `vxlan_underlay` IPv6 the FDB entries point at the peers' IPv6 node
//! addresses instead, and both families travel over the IPv6 underlay.
//! In host-gw mode each peer gets
//! `route <peer CIDR> via <peer node IP> dev <underlay>`, which only works when
//! the peer is on the same L2 segment, and a dual-stack peer that publishes
//! its IPv6 node address also `route <peer IPv6 block> via <peer node IPv6>
//! dev <underlay> onlink` (on the same segment, whatever prefix the IPv6
//! addresses have). With `direct_routing`, peers on our L2 segment get the
//! host-gw routes and the others the VXLAN entries; a direct peer without
//! an IPv6 node address has its IPv6 block reached over VXLAN.
//!
//! In an IPv6-only cluster the pod CIDR, node IP and cluster CIDR are all
//! IPv6 and the same entries are made in that family (the VTEP address is
//! the block's network address, the FDB entry points at the node IP); a
//! peer whose node IP is of the other family than ours is refused.
//!
//! Bad peer data never panics and never blocks other peers: it yields a
//! per-peer [`PeerError`] for the caller to report (Subnet conditions).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv6Net};

use super::entries::{Dev, EntryKey, Fdb, Mac, Neigh, Route, RouteKey};

/// How traffic to a peer's pods travels: the Subnet API's own type.
pub use weft_api::Backend;
pub use weft_api::VxlanUnderlay;

/// This node, as far as the desired state depends on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Local {
    /// Peers with this name are this node's own Subnet and are skipped.
    pub node_name: String,
    /// The node IP with the prefix length of the underlay interface: peers
    /// inside this subnet are on our L2 segment. IPv4, or IPv6 in an
    /// IPv6-only cluster, like `pod_cidr` and `cluster_cidr`.
    pub underlay: IpNet,
    pub pod_cidr: IpNet,
    /// This node's IPv6 block in a dual-stack cluster.
    pub pod_cidr6: Option<Ipv6Net>,
    pub cluster_cidr: IpNet,
    pub backend: Backend,
    /// VXLAN mode only: host-gw routes for peers on our L2 segment.
    pub direct_routing: bool,
    /// Which node addresses VXLAN tunnels run between: with IPv6 the FDB
    /// entries point at `status.nodeIPv6`, carrying both families inside.
    pub vxlan_underlay: VxlanUnderlay,
    /// The cluster's IPv6 range in a dual-stack cluster: routed into the
    /// TUN device as a whole with the TUN backends.
    pub cluster_cidr6: Option<Ipv6Net>,
    /// The TUN backends' UDP port, the same on every node.
    pub tunnel_port: u16,
}

impl Local {
    pub fn node_ip(&self) -> IpAddr {
        self.underlay.addr()
    }
}

/// Another node's Subnet, as announced by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub node_name: String,
    /// IPv4, or IPv6 in an IPv6-only cluster.
    pub pod_cidr: IpNet,
    /// The peer's IPv6 block (`spec.cidrs`) beside an IPv4 `pod_cidr`, in a
    /// dual-stack cluster.
    pub pod_cidr6: Option<Ipv6Net>,
    pub node_ip: IpAddr,
    /// The peer's IPv6 node address (`status.nodeIPv6`): host-gw's next hop
    /// for its IPv6 block.
    pub node_ipv6: Option<Ipv6Addr>,
    pub vtep_mac: Option<[u8; 6]>,
    /// The backend the peer runs.
    pub backend: Backend,
    /// Which of its addresses the peer's VXLAN device sends from
    /// (`status.vxlanUnderlay`; IPv4 when unset, as before it existed).
    pub vxlan_underlay: VxlanUnderlay,
    /// The peer's WireGuard public key (`status.wireguardPublicKey`).
    pub wireguard_key: Option<[u8; 32]>,
}

impl Peer {
    /// A peer from a Subnet's string fields (`spec.cidr`, `spec.cidrs`,
    /// `status.nodeIP`, `status.nodeIPv6`, `status.vtepMAC`). Malformed or
    /// missing data is a per-peer error like any other; a missing VTEP MAC
    /// is only an error once VXLAN needs it.
    pub fn parse(
        node_name: &str,
        cidr: &str,
        cidrs: &[String],
        backend: Backend,
        (node_ip, node_ipv6): (Option<&str>, Option<&str>),
        vtep_mac: Option<&str>,
    ) -> Result<Self, PeerError> {
        let malformed = |field: &'static str, value: &str| PeerError::Malformed { field, value: value.to_owned() };
        let pod_cidr = cidr.parse::<IpNet>().map_err(|_| malformed("cidr", cidr))?;
        if pod_cidr != pod_cidr.trunc() {
            return Err(malformed("cidr (host bits set)", cidr));
        }
        let mut pod_cidr6 = None;
        for c in cidrs {
            match c.parse::<IpNet>().map_err(|_| malformed("cidrs", c))? {
                n if n == pod_cidr => {}
                IpNet::V6(n) if n != n.trunc() => return Err(malformed("cidrs (host bits set)", c)),
                IpNet::V6(_) if pod_cidr.addr().is_ipv6() => return Err(malformed("cidrs (a second IPv6 block)", c)),
                IpNet::V6(n) => pod_cidr6 = Some(n),
                IpNet::V4(_) => {}
            }
        }
        let node_ip = node_ip.ok_or(PeerError::MissingNodeIp)?;
        let node_ip = node_ip.parse::<IpAddr>().map_err(|_| malformed("nodeIP", node_ip))?;
        let node_ipv6 = match node_ipv6 {
            Some(text) => match text.parse::<Ipv6Addr>() {
                Ok(ip) if !(ip.is_unspecified() || ip.is_loopback() || ip.is_multicast()) => Some(ip),
                _ => return Err(malformed("nodeIPv6", text)),
            },
            None => None,
        };
        let vtep_mac = match vtep_mac {
            Some(m) => Some(m.parse::<Mac>().map_err(|_| malformed("vtepMAC", m))?.0),
            None => None,
        };
        Ok(Peer {
            node_name: node_name.to_owned(),
            pod_cidr,
            pod_cidr6,
            node_ip,
            node_ipv6,
            vtep_mac,
            backend,
            vxlan_underlay: VxlanUnderlay::Ipv4,
            wireguard_key: None,
        })
    }
}

/// Why a peer cannot be programmed. Shown to users in Subnet conditions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    #[error("malformed {field} {value:?}")]
    Malformed { field: &'static str, value: String },
    #[error("no node IP published yet")]
    MissingNodeIp,
    #[error("more than one Subnet for node {0}")]
    DuplicateNodeName(String),
    #[error("pod CIDR {peer} overlaps this node's pod CIDR {local}")]
    CidrOverlapsLocal { peer: IpNet, local: IpNet },
    #[error("IPv6 block {peer} overlaps this node's IPv6 block {local}")]
    Ipv6BlockOverlapsLocal { peer: Ipv6Net, local: Ipv6Net },
    #[error("pod CIDR {peer} overlaps pod CIDR {other_cidr} of node {other}")]
    CidrOverlapsPeer { peer: IpNet, other: String, other_cidr: IpNet },
    #[error("pod CIDR {peer} is outside the cluster CIDR {cluster}")]
    CidrOutsideCluster { peer: IpNet, cluster: IpNet },
    #[error("node IP {0} is not a usable unicast address")]
    InvalidNodeIp(IpAddr),
    #[error("node IP {peer} is not of the family of this node's IP {local}")]
    NodeIpFamily { peer: IpAddr, local: IpAddr },
    #[error("node IP {0} is this node's own IP")]
    NodeIpIsLocal(IpAddr),
    #[error("node IP {node_ip} is not on this node's L2 segment {underlay}, which host-gw requires")]
    NotOnSameL2 { node_ip: IpAddr, underlay: IpNet },
    #[error("no VTEP MAC address announced, which VXLAN requires")]
    MissingVtepMac,
    #[error("no IPv6 node address published (status.nodeIPv6), which VXLAN over IPv6 requires")]
    MissingNodeIpv6,
    #[error(
        "peer tunnels VXLAN over {peer}, this node over {local}: network.vxlanUnderlay must be the same on every node"
    )]
    VxlanUnderlayMismatch { local: VxlanUnderlay, peer: VxlanUnderlay },
    #[error("VTEP MAC address {0} is {reason}", reason = if .0.is_zero() { "all zeros" } else { "a multicast/broadcast address" })]
    InvalidVtepMac(Mac),
    #[error("VTEP MAC address {mac} is also announced by node {other}")]
    DuplicateVtepMac { mac: Mac, other: String },
    #[error("peer runs the {peer} backend, this node runs {local}")]
    BackendMismatch { local: String, peer: Backend },
    #[error("no WireGuard public key published (status.wireguardPublicKey): no traffic is sent to it, never in clear")]
    MissingWireguardKey,
    #[error("WireGuard public key is also published by node {other}")]
    DuplicateWireguardKey { other: String },
}

/// How a valid peer is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerPath {
    HostGw,
    Vxlan(Mac),
    /// Through the TUN device and the agent (udp, wireguard).
    Tunnel,
}

/// Everything that must exist in the kernel, plus the peers that could not
/// be programmed. Maps are keyed like the kernel keys its tables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    pub routes: BTreeMap<RouteKey, Route>,
    /// VTEP IP → VTEP MAC, on the VXLAN device.
    pub neighs: BTreeMap<IpAddr, Neigh>,
    /// VTEP MAC → node IP, on the VXLAN device.
    pub fdb: BTreeMap<Mac, Fdb>,
    /// The peer (node name) each entry exists for, to attribute failures.
    pub owners: HashMap<EntryKey, String>,
    /// Peers that were skipped, by node name.
    pub errors: BTreeMap<String, PeerError>,
    /// How each programmed peer is reached, by node name.
    pub paths: BTreeMap<String, PeerPath>,
    /// TUN backends: the peers the agent's datapath sends to.
    pub tunnel_peers: Vec<crate::tunnel::TunnelPeer>,
}

/// Computes the desired state. Deterministic; never fails as a whole.
pub fn compute(local: &Local, peers: &[Peer]) -> Desired {
    let mut out = Desired::default();

    let mut counts: HashMap<&str, usize> = HashMap::new();
    for p in peers {
        *counts.entry(p.node_name.as_str()).or_default() += 1;
    }

    // Per-peer checks first, so one bad peer cannot get a good one rejected
    // by the cross-peer checks below.
    let mut valid: Vec<(&Peer, PeerPath)> = Vec::with_capacity(peers.len());
    for p in peers {
        if p.node_name == local.node_name {
            continue;
        }
        if counts[p.node_name.as_str()] > 1 {
            out.errors.insert(p.node_name.clone(), PeerError::DuplicateNodeName(p.node_name.clone()));
            continue;
        }
        match check_peer(local, p) {
            Ok(path) => valid.push((p, path)),
            Err(e) => {
                out.errors.insert(p.node_name.clone(), e);
            }
        }
    }

    let mut rejected = overlapping_cidrs(&valid);
    rejected.extend(duplicate_macs(local, &valid));
    rejected.extend(duplicate_keys(&valid));
    for (p, path) in valid {
        if let Some(e) = rejected.remove(&p.node_name) {
            out.errors.insert(p.node_name.clone(), e);
            continue;
        }
        add_entries(&mut out, local, p, path);
        out.paths.insert(p.node_name.clone(), path);
    }
    if local.backend.uses_tunnel() {
        add_tunnel_routes(&mut out, local);
    }
    out
}

/// Validates one peer on its own and decides how it is reached.
pub fn check_peer(local: &Local, p: &Peer) -> Result<PeerPath, PeerError> {
    if p.pod_cidr.contains(&local.pod_cidr) || local.pod_cidr.contains(&p.pod_cidr) {
        return Err(PeerError::CidrOverlapsLocal { peer: p.pod_cidr, local: local.pod_cidr });
    }
    if let (Some(peer), Some(local)) = (p.pod_cidr6, local.pod_cidr6)
        && (peer.contains(&local) || local.contains(&peer))
    {
        return Err(PeerError::Ipv6BlockOverlapsLocal { peer, local });
    }
    if !local.cluster_cidr.contains(&p.pod_cidr) {
        return Err(PeerError::CidrOutsideCluster { peer: p.pod_cidr, cluster: local.cluster_cidr });
    }
    let ip = p.node_ip;
    // A link-local IPv6 address names no node without its interface.
    let unusable = match ip {
        IpAddr::V4(v4) => v4.is_broadcast(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || unusable {
        return Err(PeerError::InvalidNodeIp(ip));
    }
    if ip.is_ipv6() != local.node_ip().is_ipv6() {
        return Err(PeerError::NodeIpFamily { peer: ip, local: local.node_ip() });
    }
    if ip == local.node_ip() {
        return Err(PeerError::NodeIpIsLocal(ip));
    }
    // The segment's own network and broadcast addresses are not hosts.
    if let IpNet::V4(underlay) = local.underlay
        && underlay.prefix_len() < 31
        && (ip == IpAddr::V4(underlay.network()) || ip == IpAddr::V4(underlay.broadcast()))
    {
        return Err(PeerError::InvalidNodeIp(ip));
    }
    let same_l2 = local.underlay.contains(&ip);
    let direct = || {
        if same_l2 {
            Ok(PeerPath::HostGw)
        } else {
            Err(PeerError::NotOnSameL2 { node_ip: ip, underlay: local.underlay })
        }
    };
    match (local.backend, local.direct_routing, p.backend) {
        (Backend::HostGw, _, Backend::HostGw) => direct(),
        (Backend::Vxlan, true, _) if same_l2 => Ok(PeerPath::HostGw),
        (Backend::Vxlan, _, Backend::Vxlan) => {
            let mac = vtep_mac(p)?;
            tunnel_endpoint(local, p)?;
            Ok(PeerPath::Vxlan(mac))
        }
        (Backend::Udp, _, Backend::Udp) => Ok(PeerPath::Tunnel),
        (Backend::Wireguard, _, Backend::Wireguard) => match p.wireguard_key {
            Some(_) => Ok(PeerPath::Tunnel),
            None => Err(PeerError::MissingWireguardKey),
        },
        (local_backend, direct_routing, peer) => {
            let local =
                if direct_routing { format!("{local_backend} with direct routing") } else { local_backend.to_string() };
            Err(PeerError::BackendMismatch { local, peer })
        }
    }
}

/// The underlay address VXLAN packets to `p` go to (its FDB entry's `dst`):
/// one device tunnels over one family, which both ends must share.
fn tunnel_endpoint(local: &Local, p: &Peer) -> Result<IpAddr, PeerError> {
    if p.vxlan_underlay != local.vxlan_underlay {
        return Err(PeerError::VxlanUnderlayMismatch { local: local.vxlan_underlay, peer: p.vxlan_underlay });
    }
    match (local.vxlan_underlay, p.node_ip) {
        // An IPv6-only peer's node IP is its IPv6 address.
        (VxlanUnderlay::Ipv6, IpAddr::V6(ip)) => Ok(p.node_ipv6.unwrap_or(ip).into()),
        (VxlanUnderlay::Ipv6, IpAddr::V4(_)) => p.node_ipv6.map(IpAddr::V6).ok_or(PeerError::MissingNodeIpv6),
        (VxlanUnderlay::Ipv4, IpAddr::V4(ip)) => Ok(ip.into()),
        (VxlanUnderlay::Ipv4, ip) => Err(PeerError::NodeIpFamily { peer: ip, local: local.node_ip() }),
    }
}

fn vtep_mac(p: &Peer) -> Result<Mac, PeerError> {
    let mac = Mac(p.vtep_mac.ok_or(PeerError::MissingVtepMac)?);
    if mac.is_valid_unicast() { Ok(mac) } else { Err(PeerError::InvalidVtepMac(mac)) }
}

/// Peers whose CIDRs overlap another valid peer's, each with one culprit.
/// Both sides are rejected: which one is stale cannot be told from here.
/// Sorted by network address, a CIDR that contains others comes right
/// before them, so one sweep finds every overlap in O(n log n).
fn overlapping_cidrs(valid: &[(&Peer, PeerPath)]) -> HashMap<String, PeerError> {
    let mut sorted: Vec<&Peer> = valid.iter().map(|(p, _)| *p).collect();
    sorted.sort_by_key(|p| (p.pod_cidr.network(), p.pod_cidr.prefix_len()));
    let mut out = HashMap::new();
    let mut cover: Option<&Peer> = None;
    for p in sorted {
        match cover {
            Some(c) if c.pod_cidr.contains(&p.pod_cidr) => {
                out.insert(
                    p.node_name.clone(),
                    PeerError::CidrOverlapsPeer {
                        peer: p.pod_cidr,
                        other: c.node_name.clone(),
                        other_cidr: c.pod_cidr,
                    },
                );
                out.entry(c.node_name.clone()).or_insert_with(|| PeerError::CidrOverlapsPeer {
                    peer: c.pod_cidr,
                    other: p.node_name.clone(),
                    other_cidr: p.pod_cidr,
                });
            }
            _ => cover = Some(p),
        }
    }
    out
}

/// Peers announcing the same VTEP MAC that both get an FDB entry (reached
/// over VXLAN, for both families or, with direct routing, for IPv6 only):
/// one FDB entry cannot point at two nodes. An agent's VTEP MAC is derived
/// from its node IP (by this agent, or by an older one that the node
/// upgraded from), so when exactly one of them announces a MAC of its own
/// node IP, that one keeps it and the others are rejected (a node copying
/// another's MAC cuts off only itself); otherwise all are.
fn duplicate_macs(local: &Local, valid: &[(&Peer, PeerPath)]) -> HashMap<String, PeerError> {
    let mut by_mac: HashMap<Mac, Vec<&str>> = HashMap::new();
    for (p, path) in valid {
        let ipv6 = p.pod_cidr6.filter(|_| local.pod_cidr6.is_some()).and_then(|_| ipv6_path(local, p, *path));
        if let Some(mac) = [Some(*path), ipv6].into_iter().flatten().find_map(|path| match path {
            PeerPath::Vxlan(mac) => Some(mac),
            PeerPath::HostGw | PeerPath::Tunnel => None,
        }) {
            by_mac.entry(mac).or_default().push(&p.node_name);
        }
    }
    let natural: HashMap<&str, bool> = valid
        .iter()
        .map(|(p, _)| {
            (p.node_name.as_str(), p.vtep_mac.is_some_and(|m| crate::dataplane::vxlan::is_derived(p.node_ip, m)))
        })
        .collect();
    let mut out = HashMap::new();
    for (mac, names) in by_mac.into_iter().filter(|(_, n)| n.len() > 1) {
        let owners: Vec<&str> = names.iter().copied().filter(|n| natural.get(n) == Some(&true)).collect();
        if let [owner] = owners[..] {
            for name in names.iter().filter(|n| **n != owner) {
                out.insert((*name).to_owned(), PeerError::DuplicateVtepMac { mac, other: owner.to_owned() });
            }
            continue;
        }
        for (i, name) in names.iter().enumerate() {
            let other = names[(i + 1) % names.len()].to_owned();
            out.insert((*name).to_owned(), PeerError::DuplicateVtepMac { mac, other });
        }
    }
    out
}

/// Peers publishing the same WireGuard key: a datagram could not tell them
/// apart, so none of them is programmed.
fn duplicate_keys(valid: &[(&Peer, PeerPath)]) -> HashMap<String, PeerError> {
    let mut by_key: HashMap<[u8; 32], Vec<&str>> = HashMap::new();
    for (p, _) in valid {
        if let Some(key) = p.wireguard_key {
            by_key.entry(key).or_default().push(&p.node_name);
        }
    }
    let mut out = HashMap::new();
    for names in by_key.into_values().filter(|n| n.len() > 1) {
        for (i, name) in names.iter().enumerate() {
            let other = names[(i + 1) % names.len()].to_owned();
            out.insert((*name).to_owned(), PeerError::DuplicateWireguardKey { other });
        }
    }
    out
}

/// TUN backends: the cluster's ranges (each family this node has) go into
/// the TUN device, whatever peers exist: a packet for a node without a
/// usable peer is dropped by the datapath, never sent in clear by another
/// route.
fn add_tunnel_routes(out: &mut Desired, local: &Local) {
    let unspecified = |dst: &IpNet| match dst {
        IpNet::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpNet::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let ipv6 = local.cluster_cidr6.filter(|_| local.pod_cidr6.is_some()).map(IpNet::V6);
    for dst in std::iter::once(local.cluster_cidr.trunc()).chain(ipv6) {
        let route =
            Route { dst, metric: default_metric(&dst), via: unspecified(&dst), dev: Dev::Tunnel, onlink: false };
        out.routes.insert(route.key(), route);
    }
}

/// The metric the kernel gives a route added without one: 0 for IPv4, 1024
/// (IP6_RT_PRIO_USER) for IPv6. Desired routes carry it, so that what the
/// kernel lists equals what we want and a converged node plans nothing.
fn default_metric(dst: &IpNet) -> u32 {
    match dst {
        IpNet::V4(_) => 0,
        IpNet::V6(_) => 1024,
    }
}

/// How a dual-stack peer's IPv6 block is reached, when it is: as its IPv4
/// CIDR, except that host-gw needs the peer's IPv6 node address (a peer
/// of direct routing without one is reached over VXLAN instead, unless the
/// tunnels need that address too).
fn ipv6_path(local: &Local, p: &Peer, path: PeerPath) -> Option<PeerPath> {
    match path {
        PeerPath::HostGw if p.node_ipv6.is_some() => Some(PeerPath::HostGw),
        PeerPath::HostGw if p.backend == Backend::Vxlan && tunnel_endpoint(local, p).is_ok() => {
            vtep_mac(p).ok().map(PeerPath::Vxlan)
        }
        PeerPath::HostGw => None,
        vxlan => Some(vxlan),
    }
}

/// The entries of a valid peer; its IPv6 block's too when both it and this
/// node have one and it can be reached ([`ipv6_path`]).
fn add_entries(out: &mut Desired, local: &Local, p: &Peer, path: PeerPath) {
    if path == PeerPath::Tunnel {
        // One route for the whole cluster goes into the TUN device
        // (add_tunnel_routes); the datapath picks the peer.
        let ipv6 = p.pod_cidr6.filter(|_| local.pod_cidr6.is_some()).map(IpNet::V6);
        out.tunnel_peers.push(crate::tunnel::TunnelPeer {
            node_name: p.node_name.clone(),
            cidrs: std::iter::once(p.pod_cidr.trunc()).chain(ipv6).collect(),
            endpoint: std::net::SocketAddr::new(p.node_ip, local.tunnel_port),
            public_key: p.wireguard_key,
        });
        return;
    }
    let primary = Some((p.pod_cidr.trunc(), path));
    let ipv6 = p
        .pod_cidr6
        .filter(|_| local.pod_cidr6.is_some())
        .and_then(|b| Some((IpNet::V6(b), ipv6_path(local, p, path)?)));
    for (dst, path) in [primary, ipv6].into_iter().flatten() {
        let metric = default_metric(&dst);
        let route = match (path, p.node_ipv6) {
            (PeerPath::HostGw, Some(next_hop)) if dst.addr().is_ipv6() => {
                Route { dst, metric, via: next_hop.into(), dev: Dev::Underlay, onlink: true }
            }
            (PeerPath::HostGw, _) => Route { dst, metric, via: p.node_ip, dev: Dev::Underlay, onlink: false },
            (PeerPath::Vxlan(mac), _) => {
                let vtep = dst.network();
                out.neighs.insert(vtep, Neigh { ip: vtep, mac });
                out.owners.insert(EntryKey::Neigh(vtep), p.node_name.clone());
                // Checked by check_peer (or ipv6_path) before a path is VXLAN.
                let endpoint = tunnel_endpoint(local, p).unwrap_or(p.node_ip);
                out.fdb.insert(mac, Fdb { mac, dst: endpoint });
                out.owners.insert(EntryKey::Fdb(mac), p.node_name.clone());
                Route { dst, metric, via: vtep, dev: Dev::Vxlan, onlink: true }
            }
            // Handled above.
            (PeerPath::Tunnel, _) => continue,
        };
        out.owners.insert(EntryKey::Route(route.key()), p.node_name.clone());
        out.routes.insert(route.key(), route);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local(backend: Backend, direct_routing: bool) -> Local {
        Local {
            node_name: "n1".into(),
            underlay: "192.168.1.1/24".parse().unwrap(),
            pod_cidr: "10.244.1.0/24".parse().unwrap(),
            pod_cidr6: None,
            cluster_cidr: "10.244.0.0/16".parse().unwrap(),
            backend,
            direct_routing,
            vxlan_underlay: VxlanUnderlay::Ipv4,
            cluster_cidr6: None,
            tunnel_port: 8285,
        }
    }

    fn peer(name: &str, cidr: &str, ip: &str, mac: Option<[u8; 6]>, backend: Backend) -> Peer {
        Peer {
            node_name: name.into(),
            pod_cidr: cidr.parse().unwrap(),
            pod_cidr6: None,
            node_ip: ip.parse().unwrap(),
            node_ipv6: None,
            vtep_mac: mac,
            backend,
            vxlan_underlay: VxlanUnderlay::Ipv4,
            wireguard_key: None,
        }
    }

    const M2: [u8; 6] = [0x02, 0x57, 192, 168, 1, 2];
    const M3: [u8; 6] = [0x02, 0x57, 10, 0, 0, 3];

    fn vx(name: &str, cidr: &str, ip: &str, mac: [u8; 6]) -> Peer {
        peer(name, cidr, ip, Some(mac), Backend::Vxlan)
    }

    fn hg(name: &str, cidr: &str, ip: &str) -> Peer {
        peer(name, cidr, ip, None, Backend::HostGw)
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn rkey(s: &str) -> RouteKey {
        RouteKey { dst: net(s), metric: 0 }
    }

    #[test]
    fn vxlan_peer_gets_route_neigh_and_fdb_like_flannel() {
        let d = compute(&local(Backend::Vxlan, false), &[vx("n2", "10.244.2.0/24", "10.0.0.2", M2)]);
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        assert_eq!(
            d.routes[&rkey("10.244.2.0/24")],
            Route { dst: net("10.244.2.0/24"), metric: 0, via: ip("10.244.2.0"), dev: Dev::Vxlan, onlink: true }
        );
        assert_eq!(d.neighs[&ip("10.244.2.0")], Neigh { ip: ip("10.244.2.0"), mac: Mac(M2) });
        assert_eq!(d.fdb[&Mac(M2)], Fdb { mac: Mac(M2), dst: ip("10.0.0.2") });
        assert_eq!(d.paths["n2"], PeerPath::Vxlan(Mac(M2)));
        assert_eq!(d.owners.len(), 3);
        assert!(d.owners.values().all(|o| o == "n2"));
    }

    fn local6(backend: Backend) -> Local {
        Local {
            underlay: net("fd00:250::1/64"),
            pod_cidr: net("fd00:10:244:1::/64"),
            cluster_cidr: net("fd00:10:244::/56"),
            vxlan_underlay: VxlanUnderlay::Ipv6,
            ..local(backend, false)
        }
    }

    /// An IPv6-only cluster: the same entries as IPv4, of the other family.
    #[test]
    fn ipv6_only_peers_get_the_entries_of_their_one_family() {
        let v6 = |name: &str, cidr: &str, node_ip: &str, backend| Peer {
            node_name: name.into(),
            pod_cidr: net(cidr),
            pod_cidr6: None,
            node_ip: ip(node_ip),
            node_ipv6: None,
            vtep_mac: Some(M2),
            backend,
            vxlan_underlay: VxlanUnderlay::Ipv6,
            wireguard_key: None,
        };
        let d = compute(&local6(Backend::Vxlan), &[v6("n2", "fd00:10:244:2::/64", "fd00:251::2", Backend::Vxlan)]);
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        let key = RouteKey { dst: net("fd00:10:244:2::/64"), metric: 1024 };
        let via = ip("fd00:10:244:2::");
        assert_eq!(d.routes[&key], Route { dst: key.dst, metric: 1024, via, dev: Dev::Vxlan, onlink: true });
        assert_eq!(d.neighs[&via], Neigh { ip: via, mac: Mac(M2) });
        assert_eq!(d.fdb[&Mac(M2)], Fdb { mac: Mac(M2), dst: ip("fd00:251::2") }, "to the peer's node IP");

        let d = compute(&local6(Backend::HostGw), &[v6("n2", "fd00:10:244:2::/64", "fd00:250::2", Backend::HostGw)]);
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        let route = &d.routes[&key];
        assert_eq!((route.via, route.dev), (ip("fd00:250::2"), Dev::Underlay));
        let d = compute(&local6(Backend::HostGw), &[v6("n3", "fd00:10:244:3::/64", "fd00:251::3", Backend::HostGw)]);
        assert!(matches!(d.errors["n3"], PeerError::NotOnSameL2 { .. }), "{:?}", d.errors);
        let d = compute(&local6(Backend::Vxlan), &[v6("n4", "fd00:10:244:4::/64", "fe80::4", Backend::Vxlan)]);
        assert_eq!(d.errors["n4"], PeerError::InvalidNodeIp(ip("fe80::4")));

        // A peer of the other family is refused, whichever side is IPv6.
        let d = compute(&local6(Backend::Vxlan), &[v6("n2", "fd00:10:244:2::/64", "10.0.0.2", Backend::Vxlan)]);
        assert!(
            d.errors["n2"].to_string().contains("not of the family of this node's IP fd00:250::1"),
            "{:?}",
            d.errors
        );
        let d = compute(&local6(Backend::Vxlan), &[vx("n2", "10.244.2.0/24", "10.0.0.2", M2)]);
        assert!(matches!(d.errors["n2"], PeerError::CidrOutsideCluster { .. }), "{:?}", d.errors);
        let d =
            compute(&local(Backend::Vxlan, false), &[v6("n2", "fd00:10:244:2::/64", "fd00:251::2", Backend::Vxlan)]);
        assert!(matches!(d.errors["n2"], PeerError::CidrOutsideCluster { .. }), "{:?}", d.errors);
        assert!(d.routes.is_empty());
    }

    #[test]
    fn vxlan_peer_on_another_subnet_is_fine() {
        let d = compute(&local(Backend::Vxlan, false), &[vx("n3", "10.244.3.0/24", "172.16.0.3", M3)]);
        assert!(d.errors.is_empty());
        assert_eq!(d.routes.len(), 1);
    }

    #[test]
    fn host_gw_peer_gets_a_direct_route_only() {
        let d = compute(&local(Backend::HostGw, false), &[hg("n2", "10.244.2.0/24", "192.168.1.2")]);
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        assert_eq!(
            d.routes[&rkey("10.244.2.0/24")],
            Route { dst: net("10.244.2.0/24"), metric: 0, via: ip("192.168.1.2"), dev: Dev::Underlay, onlink: false }
        );
        assert!(d.neighs.is_empty() && d.fdb.is_empty());
        assert_eq!(d.paths["n2"], PeerPath::HostGw);
    }

    #[test]
    fn host_gw_rejects_a_peer_off_our_l2() {
        let d = compute(&local(Backend::HostGw, false), &[hg("n3", "10.244.3.0/24", "192.168.2.3")]);
        assert_eq!(
            d.errors["n3"],
            PeerError::NotOnSameL2 {
                node_ip: "192.168.2.3".parse().unwrap(),
                underlay: "192.168.1.1/24".parse().unwrap()
            }
        );
        assert!(d.routes.is_empty());
    }

    #[test]
    fn direct_routing_uses_host_gw_on_our_l2_and_vxlan_elsewhere() {
        let d = compute(
            &local(Backend::Vxlan, true),
            &[vx("n2", "10.244.2.0/24", "192.168.1.2", M2), vx("n3", "10.244.3.0/24", "192.168.2.3", M3)],
        );
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        assert_eq!(d.paths["n2"], PeerPath::HostGw);
        assert_eq!(d.paths["n3"], PeerPath::Vxlan(Mac(M3)));
        assert_eq!(d.routes[&rkey("10.244.2.0/24")].dev, Dev::Underlay);
        assert_eq!(d.routes[&rkey("10.244.3.0/24")].dev, Dev::Vxlan);
        assert_eq!(d.neighs.len(), 1);
        assert_eq!(d.fdb.len(), 1);
    }

    #[test]
    fn direct_routing_on_our_l2_needs_no_mac() {
        let d =
            compute(&local(Backend::Vxlan, true), &[peer("n2", "10.244.2.0/24", "192.168.1.2", None, Backend::Vxlan)]);
        assert!(d.errors.is_empty());
        assert_eq!(d.paths["n2"], PeerPath::HostGw);
    }

    #[test]
    fn vxlan_mac_problems_are_per_peer_errors() {
        let d = compute(
            &local(Backend::Vxlan, false),
            &[
                peer("missing", "10.244.2.0/24", "10.0.0.2", None, Backend::Vxlan),
                vx("zero", "10.244.3.0/24", "10.0.0.3", [0; 6]),
                vx("mcast", "10.244.4.0/24", "10.0.0.4", [0x01, 0x00, 0x5e, 0, 0, 1]),
                vx("bcast", "10.244.5.0/24", "10.0.0.5", [0xff; 6]),
                vx("good", "10.244.6.0/24", "10.0.0.6", M2),
            ],
        );
        assert_eq!(d.errors["missing"], PeerError::MissingVtepMac);
        assert_eq!(d.errors["zero"], PeerError::InvalidVtepMac(Mac([0; 6])));
        assert!(matches!(d.errors["mcast"], PeerError::InvalidVtepMac(_)));
        assert!(matches!(d.errors["bcast"], PeerError::InvalidVtepMac(_)));
        assert!(d.errors["zero"].to_string().contains("all zeros"));
        assert!(d.errors["bcast"].to_string().contains("multicast"));
        assert_eq!(d.errors.len(), 4);
        assert_eq!(d.routes.len(), 1, "the good peer is still programmed");
    }

    #[test]
    fn overlap_with_our_cidr_is_rejected_both_ways() {
        let l = local(Backend::Vxlan, false);
        for cidr in ["10.244.1.0/24", "10.244.1.128/25", "10.244.0.0/23"] {
            let d = compute(&l, &[vx("n2", cidr, "10.0.0.2", M2)]);
            assert!(matches!(d.errors["n2"], PeerError::CidrOverlapsLocal { .. }), "{cidr}: {:?}", d.errors);
            assert!(d.routes.is_empty());
        }
    }

    #[test]
    fn cidr_outside_the_cluster_is_rejected() {
        let d = compute(&local(Backend::Vxlan, false), &[vx("n2", "10.245.2.0/24", "10.0.0.2", M2)]);
        assert!(matches!(d.errors["n2"], PeerError::CidrOutsideCluster { .. }));
        // A CIDR containing the whole cluster also overlaps ours.
        let d = compute(&local(Backend::Vxlan, false), &[vx("n2", "0.0.0.0/0", "10.0.0.2", M2)]);
        assert!(matches!(d.errors["n2"], PeerError::CidrOverlapsLocal { .. }));
    }

    #[test]
    fn overlapping_peers_are_both_rejected_and_others_kept() {
        let d = compute(
            &local(Backend::Vxlan, false),
            &[
                vx("a", "10.244.2.0/23", "10.0.0.2", [2, 0, 0, 0, 0, 2]),
                vx("b", "10.244.3.0/24", "10.0.0.3", [2, 0, 0, 0, 0, 3]),
                vx("c", "10.244.8.0/24", "10.0.0.8", [2, 0, 0, 0, 0, 8]),
                vx("d", "10.244.8.0/24", "10.0.0.9", [2, 0, 0, 0, 0, 9]),
                vx("e", "10.244.9.0/24", "10.0.0.10", [2, 0, 0, 0, 0, 10]),
            ],
        );
        for n in ["a", "b", "c", "d"] {
            assert!(matches!(d.errors[n], PeerError::CidrOverlapsPeer { .. }), "{n}: {:?}", d.errors);
        }
        assert!(matches!(&d.errors["b"], PeerError::CidrOverlapsPeer { other, .. } if other == "a"));
        assert_eq!(d.paths.keys().collect::<Vec<_>>(), ["e"]);
    }

    #[test]
    fn a_cidr_covering_several_peers_rejects_all_of_them() {
        let d = compute(
            &local(Backend::Vxlan, false),
            &[
                vx("big", "10.244.16.0/20", "10.0.0.2", [2, 0, 0, 0, 0, 2]),
                vx("x", "10.244.17.0/24", "10.0.0.3", [2, 0, 0, 0, 0, 3]),
                vx("y", "10.244.30.0/24", "10.0.0.4", [2, 0, 0, 0, 0, 4]),
            ],
        );
        assert_eq!(d.errors.len(), 3, "{:?}", d.errors);
    }

    #[test]
    fn an_invalid_peer_does_not_get_a_valid_one_rejected() {
        // "bad" overlaps "good" but is already invalid (no MAC).
        let d = compute(
            &local(Backend::Vxlan, false),
            &[
                peer("bad", "10.244.2.0/24", "10.0.0.2", None, Backend::Vxlan),
                vx("good", "10.244.2.0/24", "10.0.0.3", M3),
            ],
        );
        assert_eq!(d.errors.len(), 1);
        assert_eq!(d.errors["bad"], PeerError::MissingVtepMac);
        assert!(d.paths.contains_key("good"));
    }

    #[test]
    fn duplicate_vtep_macs_are_rejected() {
        let d = compute(
            &local(Backend::Vxlan, false),
            &[vx("a", "10.244.2.0/24", "10.0.0.2", M2), vx("b", "10.244.3.0/24", "10.0.0.3", M2)],
        );
        assert!(matches!(&d.errors["a"], PeerError::DuplicateVtepMac { other, .. } if other == "b"));
        assert!(matches!(&d.errors["b"], PeerError::DuplicateVtepMac { other, .. } if other == "a"));
        assert!(d.fdb.is_empty());
    }

    #[test]
    fn a_node_copying_another_s_vtep_mac_cuts_off_only_itself() {
        let owned = crate::dataplane::vxlan::mac_for(ip("10.0.0.2"));
        let (victim, thief) =
            (vx("victim", "10.244.2.0/24", "10.0.0.2", owned), vx("thief", "10.244.3.0/24", "10.0.0.3", owned));
        for peers in [[victim.clone(), thief.clone()], [thief, victim]] {
            let d = compute(&local(Backend::Vxlan, false), &peers);
            assert!(d.paths.contains_key("victim"), "{:?}", d.errors);
            assert!(!d.errors.contains_key("victim"));
            assert!(matches!(&d.errors["thief"], PeerError::DuplicateVtepMac { other, .. } if other == "victim"));
            assert_eq!(d.fdb.len(), 1);
            assert!(d.fdb.values().all(|f| f.dst == ip("10.0.0.2")), "{:?}", d.fdb);
        }
    }

    #[test]
    fn an_ipv6_node_keeping_the_vtep_mac_an_older_agent_derived_is_not_cut_off_by_a_copy() {
        let owned = crate::dataplane::vxlan::legacy_mac_for(ip("fd00:250::2"));
        let v6 = |p: Peer| Peer { vxlan_underlay: VxlanUnderlay::Ipv6, ..p };
        let victim = v6(vx("victim", "fd00:10:244:2::/64", "fd00:250::2", owned));
        let thief = v6(vx("thief", "fd00:10:244:3::/64", "fd00:250::3", owned));
        let d = compute(&local6(Backend::Vxlan), &[victim, thief]);
        assert!(d.paths.contains_key("victim"), "{:?}", d.errors);
        assert!(matches!(&d.errors["thief"], PeerError::DuplicateVtepMac { other, .. } if other == "victim"));
    }

    #[test]
    fn same_mac_is_fine_when_only_one_uses_vxlan() {
        let d = compute(
            &local(Backend::Vxlan, true),
            &[vx("a", "10.244.2.0/24", "192.168.1.2", M2), vx("b", "10.244.3.0/24", "10.0.0.3", M2)],
        );
        assert!(d.errors.is_empty(), "{:?}", d.errors);
    }

    #[test]
    fn bad_node_ips_are_rejected() {
        let l = local(Backend::Vxlan, false);
        for bad in ["0.0.0.0", "127.0.0.1", "224.0.0.1", "255.255.255.255", "192.168.1.0", "192.168.1.255"] {
            let d = compute(&l, &[vx("n2", "10.244.2.0/24", bad, M2)]);
            assert_eq!(d.errors["n2"], PeerError::InvalidNodeIp(bad.parse().unwrap()), "{bad}");
        }
        let d = compute(&l, &[vx("n2", "10.244.2.0/24", "192.168.1.1", M2)]);
        assert_eq!(d.errors["n2"], PeerError::NodeIpIsLocal("192.168.1.1".parse().unwrap()));
    }

    #[test]
    fn backend_mismatches_are_rejected() {
        let d = compute(&local(Backend::HostGw, false), &[vx("n2", "10.244.2.0/24", "192.168.1.2", M2)]);
        assert_eq!(d.errors["n2"], PeerError::BackendMismatch { local: "host-gw".into(), peer: Backend::Vxlan });
        let d = compute(&local(Backend::Vxlan, false), &[hg("n2", "10.244.2.0/24", "192.168.1.2")]);
        assert!(matches!(d.errors["n2"], PeerError::BackendMismatch { .. }));
        // With direct routing a host-gw peer on our L2 is reachable; off it, not.
        let d = compute(&local(Backend::Vxlan, true), &[hg("n2", "10.244.2.0/24", "192.168.1.2")]);
        assert!(d.errors.is_empty());
        let d = compute(&local(Backend::Vxlan, true), &[hg("n3", "10.244.3.0/24", "10.0.0.3")]);
        assert!(d.errors["n3"].to_string().contains("direct routing"));
    }

    #[test]
    fn own_subnet_is_skipped_and_duplicates_rejected() {
        let d = compute(
            &local(Backend::Vxlan, false),
            &[
                vx("n1", "10.244.1.0/24", "192.168.1.1", M2),
                vx("n2", "10.244.2.0/24", "10.0.0.2", M2),
                vx("n2", "10.244.3.0/24", "10.0.0.3", M3),
            ],
        );
        assert_eq!(d.errors.len(), 1);
        assert_eq!(d.errors["n2"], PeerError::DuplicateNodeName("n2".into()));
        assert!(d.routes.is_empty());
    }

    #[test]
    fn peers_parse_from_subnet_strings() {
        let mac = Some("02:57:0A:00:00:02");
        let p = Peer::parse("n2", "10.244.2.0/24", &[], Backend::Vxlan, (Some("10.0.0.2"), None), mac).unwrap();
        assert_eq!(p, vx("n2", "10.244.2.0/24", "10.0.0.2", [2, 0x57, 10, 0, 0, 2]));
        let p = Peer::parse("n2", "10.244.2.0/24", &[], Backend::HostGw, (Some("10.0.0.2"), None), None).unwrap();
        assert_eq!(p.vtep_mac, None);
        let dual = ["10.244.2.0/24".to_owned(), "fd00:0:0:2::/64".to_owned()];
        let p = Peer::parse("n2", "10.244.2.0/24", &dual, Backend::Vxlan, (Some("10.0.0.2"), None), mac).unwrap();
        assert_eq!(p.pod_cidr6, Some("fd00:0:0:2::/64".parse().unwrap()));
        let bad = ["fd00:0:0:2::1/64".to_owned()];
        let e = Peer::parse("n2", "10.244.2.0/24", &bad, Backend::Vxlan, (Some("10.0.0.2"), None), mac).unwrap_err();
        assert!(matches!(e, PeerError::Malformed { field: "cidrs (host bits set)", .. }), "{e}");
        let err = |cidr, ip, mac| Peer::parse("n2", cidr, &[], Backend::Vxlan, (ip, None), mac).unwrap_err();
        assert_eq!(err("10.244.2.0/24", None, None), PeerError::MissingNodeIp);
        assert!(matches!(err("10.244.2.0", Some("10.0.0.2"), None), PeerError::Malformed { field: "cidr", .. }));
        assert!(matches!(err("10.244.2.0/24", Some("10.0.0"), None), PeerError::Malformed { field: "nodeIP", .. }));
        assert!(matches!(
            err("10.244.2.0/24", Some("10.0.0.2"), Some("zz")),
            PeerError::Malformed { field: "vtepMAC", .. }
        ));
        assert!(matches!(err("10.244.2.1/24", Some("10.0.0.2"), None), PeerError::Malformed { .. }));
        let v6_only = |cidrs: &[&str]| {
            let cidrs: Vec<String> = cidrs.iter().map(|c| (*c).to_owned()).collect();
            Peer::parse("n2", "fd00:10:244:2::/64", &cidrs, Backend::Vxlan, (Some("fd00:250::2"), None), None)
        };
        let p = v6_only(&["fd00:10:244:2::/64"]).unwrap();
        assert_eq!((p.pod_cidr, p.pod_cidr6, p.node_ip), (net("fd00:10:244:2::/64"), None, ip("fd00:250::2")));
        let e = v6_only(&["fd00:10:244:2::/64", "fd00:10:244:3::/64"]).unwrap_err();
        assert!(matches!(e, PeerError::Malformed { field: "cidrs (a second IPv6 block)", .. }), "{e}");
        let with_v6 = |v6| Peer::parse("n2", "10.244.2.0/24", &[], Backend::HostGw, (Some("10.0.0.2"), Some(v6)), None);
        assert_eq!(with_v6("fd00:250::2").unwrap().node_ipv6, Some("fd00:250::2".parse().unwrap()));
        for bad in ["10.0.0.2", "::", "ff02::1", "fd00::zz"] {
            assert!(matches!(with_v6(bad), Err(PeerError::Malformed { field: "nodeIPv6", .. })), "{bad}");
        }
    }

    #[test]
    fn a_dual_stack_vxlan_peer_gets_an_ipv6_route_and_neighbour_on_the_same_fdb_entry() {
        let mut l = local(Backend::Vxlan, false);
        l.pod_cidr6 = Some("fd00:0:0:1::/64".parse().unwrap());
        let mut p = vx("n2", "10.244.2.0/24", "192.168.1.2", M2);
        p.pod_cidr6 = Some("fd00:0:0:2::/64".parse().unwrap());
        let d = compute(&l, std::slice::from_ref(&p));
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        let routes: Vec<String> = d.routes.values().map(ToString::to_string).collect();
        assert_eq!(routes.len(), 2, "{routes:?}");
        let vtep6: IpAddr = "fd00:0:0:2::".parse().unwrap();
        let v6 = d.routes.values().find(|r| r.dst.to_string() == "fd00:0:0:2::/64").expect("IPv6 route");
        assert_eq!((v6.via, v6.dev, v6.onlink), (vtep6, Dev::Vxlan, true));
        assert_eq!(d.neighs[&vtep6].mac, Mac(M2));
        assert_eq!(d.fdb.len(), 1, "one FDB entry carries both families");

        // This node single-stack, or the peer reached by host-gw without
        // an IPv6 node address: IPv4 only.
        let d = compute(&local(Backend::Vxlan, false), std::slice::from_ref(&p));
        assert_eq!(d.routes.len(), 1);
        let mut hg_local = local(Backend::HostGw, false);
        hg_local.pod_cidr6 = l.pod_cidr6;
        let mut h = hg("n2", "10.244.2.0/24", "192.168.1.2");
        h.pod_cidr6 = p.pod_cidr6;
        assert_eq!(compute(&hg_local, std::slice::from_ref(&h)).routes.len(), 1);

        // With its IPv6 node address: routed to it on the underlay, on-link.
        h.node_ipv6 = Some("fd00:250::2".parse().unwrap());
        let d = compute(&hg_local, std::slice::from_ref(&h));
        let v6 = d.routes.values().find(|r| r.dst.to_string() == "fd00:0:0:2::/64").expect("IPv6 host-gw route");
        assert_eq!(
            (v6.via, v6.dev, v6.onlink, v6.metric),
            (IpAddr::from(h.node_ipv6.unwrap()), Dev::Underlay, true, 1024)
        );
        assert!(d.neighs.is_empty() && d.fdb.is_empty());

        // Direct routing: a peer on our segment takes host-gw for IPv6 when
        // it publishes an IPv6 node address, else VXLAN for IPv6 only.
        let mut direct = local(Backend::Vxlan, true);
        direct.pod_cidr6 = l.pod_cidr6;
        let d = compute(&direct, std::slice::from_ref(&p));
        let v4 = d.routes.values().find(|r| r.dst.addr().is_ipv4()).expect("IPv4 route");
        let v6 = d.routes.values().find(|r| r.dst.addr().is_ipv6()).expect("IPv6 route");
        assert_eq!((v4.dev, v6.dev, v6.via), (Dev::Underlay, Dev::Vxlan, vtep6));
        assert_eq!((d.neighs.len(), d.fdb.len()), (1, 1));
        p.node_ipv6 = h.node_ipv6;
        let d = compute(&direct, std::slice::from_ref(&p));
        assert!(d.routes.values().all(|r| r.dev == Dev::Underlay) && d.routes.len() == 2, "{:?}", d.routes);
        assert!(d.neighs.is_empty() && d.fdb.is_empty());

        // Two such direct peers with one VTEP MAC would share an FDB entry.
        let mut twin = p.clone();
        (twin.node_name, twin.pod_cidr, twin.node_ip) =
            ("n3".into(), "10.244.3.0/24".parse().unwrap(), "192.168.1.3".parse().unwrap());
        twin.pod_cidr6 = Some("fd00:0:0:3::/64".parse().unwrap());
        let (mut lone, mut twin6) = (p.clone(), twin.clone());
        (lone.node_ipv6, twin6.node_ipv6) = (None, None);
        let d = compute(&direct, &[lone, twin6]);
        // n2's MAC is the one its node IP gives: n3 copied it, and only n3 is cut off.
        assert!(
            matches!(d.errors.get("n3"), Some(PeerError::DuplicateVtepMac { other, .. }) if other == "n2"),
            "{:?}",
            d.errors
        );
        assert!(!d.errors.contains_key("n2"));
        // Reached by host-gw for both families, they need no FDB entry.
        assert!(compute(&direct, &[p.clone(), twin]).errors.is_empty());

        // An IPv6 block overlapping ours is refused like an IPv4 one.
        p.pod_cidr6 = Some("fd00::/48".parse().unwrap());
        let d = compute(&l, &[p]);
        assert!(matches!(d.errors["n2"], PeerError::Ipv6BlockOverlapsLocal { .. }), "{:?}", d.errors);
    }

    #[test]
    fn vxlan_over_ipv6_points_the_fdb_entry_at_the_peers_ipv6_address() {
        let mut l = local(Backend::Vxlan, false);
        l.vxlan_underlay = VxlanUnderlay::Ipv6;
        l.pod_cidr6 = Some("fd00:0:0:1::/64".parse().unwrap());
        let mut p = vx("n2", "10.244.2.0/24", "192.168.1.2", M2);
        p.pod_cidr6 = Some("fd00:0:0:2::/64".parse().unwrap());
        p.node_ipv6 = Some("fd00:250::2".parse().unwrap());

        // A peer tunnelling over the other family cannot be reached, either
        // way round; the message says what to fix.
        let d = compute(&l, std::slice::from_ref(&p));
        let e = &d.errors["n2"];
        assert_eq!(e, &PeerError::VxlanUnderlayMismatch { local: VxlanUnderlay::Ipv6, peer: VxlanUnderlay::Ipv4 });
        assert!(e.to_string().contains("over IPv4, this node over IPv6: network.vxlanUnderlay"), "{e}");
        assert!(d.routes.is_empty() && d.fdb.is_empty());
        p.vxlan_underlay = VxlanUnderlay::Ipv6;
        let mut d = compute(&local(Backend::Vxlan, false), std::slice::from_ref(&p));
        assert!(matches!(d.errors.remove("n2"), Some(PeerError::VxlanUnderlayMismatch { .. })));

        // Without a published IPv6 node address the peer cannot be reached.
        p.node_ipv6 = None;
        let d = compute(&l, std::slice::from_ref(&p));
        assert_eq!(d.errors.get("n2"), Some(&PeerError::MissingNodeIpv6));
        assert!(d.routes.is_empty() && d.fdb.is_empty());

        // With one: both blocks over VXLAN, one FDB entry to that address.
        p.node_ipv6 = Some("fd00:250::2".parse().unwrap());
        let d = compute(&l, std::slice::from_ref(&p));
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        assert_eq!(d.routes.len(), 2);
        assert!(d.routes.values().all(|r| r.dev == Dev::Vxlan), "{:?}", d.routes);
        assert_eq!(d.fdb.values().map(|f| f.dst).collect::<Vec<_>>(), [ip("fd00:250::2")]);
        // A single-stack cluster can tunnel over IPv6 too.
        let (mut v4_local, mut v4_peer) = (l.clone(), p.clone());
        (v4_local.pod_cidr6, v4_peer.pod_cidr6) = (None, None);
        let d = compute(&v4_local, &[v4_peer]);
        assert_eq!((d.routes.len(), d.fdb[&Mac(M2)].dst), (1, ip("fd00:250::2")));

        // Direct routing: a peer on our segment without an IPv6 address gets
        // host-gw for IPv4; its IPv6 block has no path (the tunnel needs that
        // address), so it is left out rather than sent to the IPv4 address.
        l.direct_routing = true;
        p.node_ipv6 = None;
        let d = compute(&l, std::slice::from_ref(&p));
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        assert_eq!(d.routes.len(), 1);
        assert!(d.routes.values().all(|r| r.dev == Dev::Underlay && r.dst.addr().is_ipv4()));
        assert!(d.fdb.is_empty());
    }

    #[test]
    fn no_peers_no_entries() {
        assert_eq!(compute(&local(Backend::Vxlan, false), &[]), Desired::default());
    }

    #[test]
    fn deterministic_whatever_the_peer_order() {
        let mut peers: Vec<Peer> = (2..50u8)
            .map(|i| vx(&format!("n{i}"), &format!("10.244.{i}.0/24"), &format!("10.0.0.{i}"), [2, 0, 0, 0, 0, i]))
            .collect();
        let l = local(Backend::Vxlan, false);
        let a = compute(&l, &peers);
        peers.reverse();
        assert_eq!(a, compute(&l, &peers));
        assert_eq!(a.routes.len(), 48);
    }

    #[test]
    fn a_thousand_peers_are_computed() {
        let peers: Vec<Peer> = (0..1000u32)
            .map(|i| {
                let b = i.to_be_bytes();
                vx(
                    &format!("peer{i}"),
                    &format!("10.{}.{}.0/24", 100 + b[2], b[3]),
                    &format!("172.16.{}.{}", b[2] + 1, b[3]),
                    [2, 0, 0, 0, b[2], b[3]],
                )
            })
            .collect();
        let mut l = local(Backend::Vxlan, false);
        l.cluster_cidr = "10.0.0.0/8".parse().unwrap();
        let d = compute(&l, &peers);
        assert!(d.errors.is_empty(), "{:?}", d.errors.iter().next());
        assert_eq!((d.routes.len(), d.neighs.len(), d.fdb.len()), (1000, 1000, 1000));
    }

    fn wg(name: &str, cidr: &str, ip: &str, key: Option<u8>) -> Peer {
        Peer { wireguard_key: key.map(|k| [k; 32]), ..peer(name, cidr, ip, None, Backend::Wireguard) }
    }

    fn tunnel_local(backend: Backend) -> Local {
        Local { tunnel_port: 51820, ..local(backend, false) }
    }

    #[test]
    fn tunnel_backends_route_the_cluster_into_the_device_and_hand_peers_to_the_datapath() {
        let d = compute(
            &tunnel_local(Backend::Wireguard),
            &[wg("n2", "10.244.2.0/24", "10.0.0.2", Some(2)), wg("n3", "10.244.3.0/24", "10.0.0.3", Some(3))],
        );
        // One route for the whole cluster, whatever the peers: nothing for a
        // node leaves by another route.
        let routes: Vec<&Route> = d.routes.values().collect();
        assert_eq!(routes.len(), 1, "{routes:?}");
        assert_eq!((routes[0].dst, routes[0].dev, routes[0].via), (net("10.244.0.0/16"), Dev::Tunnel, ip("0.0.0.0")));
        assert!(d.neighs.is_empty() && d.fdb.is_empty());
        assert_eq!(d.paths.values().copied().collect::<Vec<_>>(), vec![PeerPath::Tunnel; 2]);
        let endpoints: Vec<String> = d.tunnel_peers.iter().map(|p| p.endpoint.to_string()).collect();
        assert_eq!(endpoints, ["10.0.0.2:51820", "10.0.0.3:51820"]);
        assert_eq!(d.tunnel_peers[0].public_key, Some([2; 32]));
        assert_eq!(d.tunnel_peers[0].cidrs, vec![net("10.244.2.0/24")]);

        let none = compute(&tunnel_local(Backend::Udp), &[]);
        assert_eq!(none.routes.len(), 1, "the route stands without peers");
    }

    #[test]
    fn a_wireguard_peer_without_a_key_or_with_anothers_gets_nothing() {
        let d = compute(
            &tunnel_local(Backend::Wireguard),
            &[
                wg("keyless", "10.244.2.0/24", "10.0.0.2", None),
                wg("n3", "10.244.3.0/24", "10.0.0.3", Some(7)),
                wg("copy", "10.244.4.0/24", "10.0.0.4", Some(7)),
                wg("n5", "10.244.5.0/24", "10.0.0.5", Some(5)),
                peer("vx", "10.244.6.0/24", "10.0.0.6", Some(M2), Backend::Vxlan),
                peer("udp", "10.244.7.0/24", "10.0.0.7", None, Backend::Udp),
            ],
        );
        assert_eq!(d.errors["keyless"], PeerError::MissingWireguardKey);
        assert!(d.errors["keyless"].to_string().contains("never in clear"));
        assert!(matches!(d.errors["n3"], PeerError::DuplicateWireguardKey { .. }));
        assert!(matches!(d.errors["copy"], PeerError::DuplicateWireguardKey { .. }));
        assert!(matches!(d.errors["vx"], PeerError::BackendMismatch { .. }));
        assert!(matches!(d.errors["udp"], PeerError::BackendMismatch { .. }));
        let programmed: Vec<&str> = d.tunnel_peers.iter().map(|p| p.node_name.as_str()).collect();
        assert_eq!(programmed, ["n5"]);
    }

    #[test]
    fn a_dual_stack_tunnel_routes_both_ranges_and_carries_both_blocks() {
        let local = Local {
            pod_cidr6: Some("fd00:10:244:1::/64".parse().unwrap()),
            cluster_cidr6: Some("fd00:10:244::/56".parse().unwrap()),
            ..tunnel_local(Backend::Udp)
        };
        let p = Peer {
            pod_cidr6: Some("fd00:10:244:2::/64".parse().unwrap()),
            ..peer("n2", "10.244.2.0/24", "10.0.0.2", None, Backend::Udp)
        };
        let d = compute(&local, &[p]);
        let dsts: Vec<IpNet> = d.routes.values().map(|r| r.dst).collect();
        assert_eq!(dsts, [net("10.244.0.0/16"), net("fd00:10:244::/56")]);
        assert_eq!(d.tunnel_peers[0].cidrs, [net("10.244.2.0/24"), net("fd00:10:244:2::/64")]);
    }
}
