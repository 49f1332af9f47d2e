//! Links and addresses of pod attachments: the node's bridge, the veth pair of
//! each pod, and what CHECK needs to read back.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use netlink_packet_route::link::{
    InfoBridgePort, InfoData, InfoKind, InfoPortData, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteScope};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use rtnetlink::{
    AddressMessageBuilder, Handle, LinkBridge, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder,
};

use super::netlink_blocking::BlockingNetlink;
use super::netns::BlockingNetns;
use super::{DataplaneError, dump, errno, kernel_op, op};

/// The start of the name of every pod veth's host end: what the guard
/// and GC recognise as Weft's.
pub const HOST_VETH_PREFIX: &str = "weftv";

const ENODEV: i32 = libc::ENODEV;
const EEXIST: i32 = libc::EEXIST;

/// Finds a link by name; `None` when there is no such link.
pub async fn by_name(h: &Handle, name: &str) -> Result<Option<LinkMessage>, DataplaneError> {
    match h.link().get().match_name(name.to_owned()).execute().try_next().await {
        Ok(link) => Ok(link),
        Err(e) if errno(&e) == Some(ENODEV) => Ok(None),
        Err(e) => Err(op(format!("look up link {name}"))(e)),
    }
}

pub fn controller_of(link: &LinkMessage) -> Option<u32> {
    link.attributes.iter().find_map(|a| if let LinkAttribute::Controller(c) = a { Some(*c) } else { None })
}

pub fn name_of(link: &LinkMessage) -> Option<&str> {
    link.attributes.iter().find_map(|a| if let LinkAttribute::IfName(n) = a { Some(n.as_str()) } else { None })
}

fn address_of(link: &LinkMessage) -> Option<&[u8]> {
    link.attributes.iter().find_map(|a| if let LinkAttribute::Address(m) = a { Some(m.as_slice()) } else { None })
}

fn kind_of(link: &LinkMessage) -> Option<&InfoKind> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => {
            infos.iter().find_map(|i| if let LinkInfo::Kind(k) = i { Some(k) } else { None })
        }
        _ => None,
    })
}

pub fn is_up(link: &LinkMessage) -> bool {
    link.header.flags.contains(LinkFlags::Up)
}

/// The bridge's MAC, fixed and derived from the gateway address (its last
/// four bytes for IPv6). A bridge whose MAC was never set takes the lowest
/// MAC of its ports: it would change as pods come and go, leaving every
/// pod's neighbour entry for the gateway stale.
pub fn bridge_mac(gateway: IpAddr) -> [u8; 6] {
    let [a, b, c, d] = match gateway {
        IpAddr::V4(g) => g.octets(),
        IpAddr::V6(g) => {
            let o = g.octets();
            [o[12], o[13], o[14], o[15]]
        }
    };
    [0x02, 0x58, a, b, c, d]
}

/// Makes sure the bridge exists, is up, has its fixed MAC (from the first
/// gateway) and carries every gateway address (one per family). Returns its
/// index. Safe to call concurrently with itself only under the caller's lock
/// (creation races would fail with EEXIST, which is handled).
pub async fn ensure_bridge(h: &Handle, name: &str, gateways: &[IpNet]) -> Result<u32, DataplaneError> {
    let first = gateways.first().ok_or_else(|| DataplaneError::Unexpected(format!("bridge {name}: no gateway")))?;
    let mac = bridge_mac(first.addr());
    let link = match by_name(h, name).await? {
        Some(l) => l,
        None => {
            match h.link().add(LinkBridge::new(name).address(mac.to_vec()).build()).execute().await {
                Ok(()) => {}
                Err(e) if errno(&e) == Some(EEXIST) => {}
                Err(e) => return Err(op(format!("create bridge {name}"))(e)),
            }
            by_name(h, name)
                .await?
                .ok_or_else(|| DataplaneError::Unexpected(format!("bridge {name} vanished after creation")))?
        }
    };
    if kind_of(&link) != Some(&InfoKind::Bridge) {
        return Err(DataplaneError::Unexpected(format!("link {name} exists but is not a bridge")));
    }
    let index = link.header.index;
    if address_of(&link) != Some(&mac[..]) {
        h.link()
            .set(LinkUnspec::new_with_index(index).address(mac.to_vec()).build())
            .execute()
            .await
            .map_err(op(format!("set the MAC of {name}")))?;
    }
    if !is_up(&link) {
        h.link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(op(format!("set {name} up")))?;
    }
    let present = all_addresses(h, index).await?;
    for gateway in gateways.iter().filter(|g| !present.contains(g)) {
        let mut req = h.address().add(index, gateway.addr(), gateway.prefix_len());
        *req.message_mut() = address_message(index, *gateway);
        match req.execute().await {
            Ok(()) => {}
            Err(e) if errno(&e) == Some(EEXIST) => {}
            Err(e) => return Err(op(format!("add {gateway} to {name}"))(e)),
        }
    }
    Ok(index)
}

/// An address message of either family. IPv6 ones skip duplicate address
/// detection (`nodad`): the address is ours by lease, and a tentative one
/// would make the first packets fail.
pub fn address_message(index: u32, net: IpNet) -> AddressMessage {
    match net {
        IpNet::V4(n) => AddressMessageBuilder::<Ipv4Addr>::new().index(index).address(n.addr(), n.prefix_len()).build(),
        IpNet::V6(n) => {
            let mut msg =
                AddressMessageBuilder::<Ipv6Addr>::new().index(index).address(n.addr(), n.prefix_len()).build();
            msg.attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
            msg
        }
    }
}

/// Makes `address` the only address of its family on device `name` (a
/// device of ours: VXLAN or TUN); the kernel's IPv6 link-local address
/// stays. Returns what changed.
pub async fn ensure_only_address(
    h: &Handle,
    index: u32,
    name: &str,
    address: IpNet,
) -> Result<Vec<String>, DataplaneError> {
    let mut changes = Vec::new();
    let mut found = false;
    let mut stale: Vec<AddressMessage> = Vec::new();
    for msg in dump("list addresses", || h.address().get().set_link_index_filter(index).execute()).await? {
        let same_family = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(IpAddr::V4(ip)) if address.addr().is_ipv4() => Some(IpAddr::V4(*ip)),
            AddressAttribute::Address(IpAddr::V6(ip)) if address.addr().is_ipv6() && !ip.is_unicast_link_local() => {
                Some(IpAddr::V6(*ip))
            }
            _ => None,
        });
        match same_family {
            Some(ip) if ip == address.addr() && msg.header.prefix_len == address.prefix_len() => found = true,
            Some(_) => stale.push(msg),
            None => {}
        }
    }
    for msg in stale {
        h.address().del(msg).execute().await.map_err(op(format!("remove a stale address from {}", name)))?;
        changes.push("stale address removed".into());
    }
    if !found {
        let mut req = h.address().add(index, address.addr(), address.prefix_len());
        *req.message_mut() = address_message(index, address);
        match req.execute().await {
            Ok(()) => changes.push(format!("address {} added", address)),
            Err(e) if errno(&e) == Some(libc::EEXIST) => {}
            Err(e) => return Err(op(format!("add {} to {}", address, name))(e)),
        }
    }
    Ok(changes)
}

/// Addresses of both families on a link, with their prefix lengths.
pub async fn all_addresses(h: &Handle, index: u32) -> Result<Vec<IpNet>, DataplaneError> {
    let mut out = Vec::new();
    for msg in dump("list addresses", || h.address().get().set_link_index_filter(index).execute()).await? {
        for a in &msg.attributes {
            if let AddressAttribute::Address(ip) = a
                && let Ok(net) = IpNet::new(*ip, msg.header.prefix_len)
            {
                out.push(net);
            }
        }
    }
    Ok(out)
}

/// Every route of the main table, IPv4 then IPv6. One dump at a time: the
/// kernel refuses a dump on a socket whose previous dump is unfinished
/// (EBUSY), and rtnetlink sends a request as soon as it is built, so the
/// second request is built only once the first answer is read to its end.
pub async fn main_table_routes(h: &Handle) -> Result<Vec<RouteMessage>, DataplaneError> {
    let mut out =
        dump("list routes", || h.route().get(RouteMessageBuilder::<Ipv4Addr>::new().build()).execute()).await?;
    out.extend(
        dump("list IPv6 routes", || h.route().get(RouteMessageBuilder::<Ipv6Addr>::new().build()).execute()).await?,
    );
    Ok(out)
}

/// Gateways of default routes in the main table, both families.
pub async fn all_default_gateways(h: &Handle) -> Result<Vec<IpAddr>, DataplaneError> {
    let mut out = Vec::new();
    for r in main_table_routes(h).await?.iter().filter(|r| r.header.destination_prefix_length == 0) {
        for a in &r.attributes {
            match a {
                RouteAttribute::Gateway(RouteAddress::Inet(gw)) => out.push(IpAddr::V4(*gw)),
                RouteAttribute::Gateway(RouteAddress::Inet6(gw)) => out.push(IpAddr::V6(*gw)),
                _ => {}
            }
        }
    }
    Ok(out)
}

/// What one pod attachment should look like.
pub struct AttachSpec {
    pub host_veth: String,
    pub ifname: String,
    /// The pod's addresses, one per family, the primary one first.
    pub addresses: Vec<PodAddress>,
    pub mtu: u32,
    /// MACs are chosen by the caller so that the result needs no read-back.
    pub host_mac: [u8; 6],
    pub pod_mac: [u8; 6],
}

/// One address of a pod as its interface carries it (see the attachment
/// driver's `pod_address`), and that family's gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodAddress {
    pub address: IpNet,
    pub gateway: IpAddr,
}

impl PodAddress {
    /// (pod address, gateway), as [`route_to_pod`] takes them.
    pub fn pair(&self) -> (IpAddr, IpAddr) {
        (self.address.addr(), self.gateway)
    }
}

/// One netlink request on the node, in the batch that creates a veth pair,
/// and what it does (for the error).
pub struct HostRequest {
    pub message: RouteNetlinkMessage,
    pub flags: u16,
    pub what: String,
}

/// The hairpin option of a bridge port (it needs the port to exist, so it
/// rides after the veth's creation; sysfs would spin on the RTNL lock while
/// the new link settles: 2 ms).
pub fn hairpin(port: &str) -> HostRequest {
    let mut hairpin = LinkUnspec::new_with_name(port).build();
    hairpin.attributes.push(LinkAttribute::LinkInfo(vec![LinkInfo::PortData(InfoPortData::BridgePort(vec![
        InfoBridgePort::HairpinMode(true),
    ]))]));
    HostRequest {
        message: RouteNetlinkMessage::NewLink(hairpin),
        flags: 0,
        what: format!("set hairpin mode on {port}"),
    }
}

/// A link's own message (its index), as an answer of the batch.
pub fn look_up(name: &str) -> HostRequest {
    HostRequest {
        message: RouteNetlinkMessage::GetLink(LinkUnspec::new_with_name(name).build()),
        flags: 0,
        what: format!("look up {name}"),
    }
}

/// A neighbour entry on the node (made or replaced).
pub fn set_neighbour(index: u32, ip: IpAddr, mac: [u8; 6], state: NeighbourState) -> HostRequest {
    HostRequest {
        message: RouteNetlinkMessage::NewNeighbour(neighbour(index, ip, mac, state)),
        flags: NLM_F_CREATE | NLM_F_REPLACE,
        what: format!("set the node's neighbour entry of {ip}"),
    }
}

/// Creates the veth pair in one request: the host end up (a port of
/// `controller` when given), the pod end directly inside the pod's namespace
/// under its final name (the kernel refuses to bring a peer up in another
/// namespace at creation); `then` follows in the same batch. Returns the
/// answers of `then`. On failure the caller deletes the host end, which
/// removes the pod end and anything made on it too.
pub fn create_veth(
    host: &mut BlockingNetlink,
    pod: &BlockingNetns,
    spec: &AttachSpec,
    controller: Option<u32>,
    then: Vec<HostRequest>,
) -> Result<Vec<RouteNetlinkMessage>, DataplaneError> {
    use std::os::fd::AsRawFd;
    let mut peer = LinkMessageBuilder::<LinkUnspec>::new()
        .name(spec.ifname.clone())
        .mtu(spec.mtu)
        .address(spec.pod_mac.to_vec())
        .setns_by_fd(pod.file.as_raw_fd())
        .build();
    single_queue(&mut peer);
    let mut veth = LinkVeth::new(&spec.host_veth, &spec.ifname)
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .mtu(spec.mtu)
        .address(spec.host_mac.to_vec());
    if let Some(index) = controller {
        veth = veth.controller(index);
    }
    let mut veth = veth.up().build();
    single_queue(&mut veth);
    let mut what = Vec::with_capacity(then.len());
    let mut requests = vec![(RouteNetlinkMessage::NewLink(veth), NLM_F_CREATE | NLM_F_EXCL)];
    for r in then {
        requests.push((r.message, r.flags));
        what.push(r.what);
    }
    host.batch(requests).map_err(|(at, e)| match at {
        0 if e.raw_os_error() == Some(EEXIST) => DataplaneError::Unexpected(format!(
            "create veth {} / {}: an interface of that name already exists (in the pod or on the node)",
            spec.host_veth, spec.ifname
        )),
        0 => kernel_op(format!("create veth {} / {}", spec.host_veth, spec.ifname))(e),
        n => kernel_op(what.get(n - 1).cloned().unwrap_or_else(|| format!("set up {}", spec.host_veth)))(e),
    })
}

/// The node's side of a routed pod on the host veth with index
/// `host_index`: for each (pod address, gateway) its /32 or /128 route and
/// its neighbour entry, and for IPv6 the gateway's proxy entry, in one
/// datagram. They replace what is there, so ADD and the repair of a
/// missing route share it.
pub fn route_to_pod(
    nl: &mut BlockingNetlink,
    host_index: u32,
    addresses: &[(IpAddr, IpAddr)],
    pod_mac: [u8; 6],
) -> Result<(), DataplaneError> {
    let mut msgs = Vec::new();
    let mut what = Vec::new();
    for &(ip, gateway) in addresses {
        msgs.push(RouteNetlinkMessage::NewRoute(pod_route(ip, host_index, gateway)));
        what.push(format!("add the route to {ip} via link {host_index}"));
        msgs.push(RouteNetlinkMessage::NewNeighbour(neighbour(host_index, ip, pod_mac, NeighbourState::Permanent)));
        what.push(format!("add the neighbour entry of {ip} on link {host_index}"));
        if let IpAddr::V6(gateway) = gateway {
            msgs.push(RouteNetlinkMessage::NewNeighbour(gateway_proxy(host_index, gateway)));
            what.push(format!("add the proxy entry of {gateway} on link {host_index}"));
        }
    }
    let msgs = msgs.into_iter().map(|m| (m, NLM_F_CREATE | NLM_F_REPLACE)).collect();
    nl.batch(msgs)
        .map(drop)
        .map_err(|(at, e)| kernel_op(what.get(at).cloned().unwrap_or_else(|| "route to a pod".into()))(e))
}

/// `ip -6 neigh add proxy <gateway> dev <host veth>`: the host end answers
/// neighbour solicitations for the IPv6 gateway, which is an address of the
/// bridge. The pod's own kernel never asks (its entry for the gateway is
/// permanent), but a VM guest behind a TC redirect sets itself up from the
/// CNI result and resolves the gateway itself. IPv4 needs nothing of the
/// kind: Linux answers ARP for any of the node's addresses on any link.
fn gateway_proxy(index: u32, gateway: Ipv6Addr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = AddressFamily::Inet6;
    m.header.ifindex = index;
    m.header.flags = NeighbourFlags::Proxy;
    m.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::Inet6(gateway)));
    m
}

/// The node's route to a routed pod: `ip/32 dev <host veth> scope link src
/// <gateway>` (`ip/128 … src <gateway>` for IPv6), so the node talks to its
/// pods from the gateway address as it does over the bridge.
fn pod_route(ip: IpAddr, host_index: u32, gateway: IpAddr) -> RouteMessage {
    match (ip, gateway) {
        (IpAddr::V6(ip), IpAddr::V6(gateway)) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(ip, 128)
            .output_interface(host_index)
            .pref_source(gateway)
            .build(),
        (ip, gateway) => {
            let v4 = |a: IpAddr| match a {
                IpAddr::V4(a) => a,
                IpAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
            };
            RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(v4(ip), 32)
                .output_interface(host_index)
                .scope(RouteScope::Link)
                .pref_source(v4(gateway))
                .build()
        }
    }
}

/// An IPv4 neighbour entry. Permanent ones: routed pods and their node
/// never ARP for each other, so neither end depends on arp_ignore or proxy
/// ARP.
fn neighbour(index: u32, ip: IpAddr, mac: [u8; 6], state: NeighbourState) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.ifindex = index;
    m.header.state = state;
    let (family, address) = match ip {
        IpAddr::V4(ip) => (AddressFamily::Inet, NeighbourAddress::Inet(ip)),
        IpAddr::V6(ip) => (AddressFamily::Inet6, NeighbourAddress::Inet6(ip)),
    };
    m.header.family = family;
    m.attributes.push(NeighbourAttribute::Destination(address));
    m.attributes.push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
    m
}

/// The main table's /32 and /128 routes as (destination, output link) pairs.
pub async fn pod_routes(h: &Handle) -> Result<HashSet<(IpAddr, u32)>, DataplaneError> {
    let mut out = HashSet::new();
    for r in main_table_routes(h).await? {
        let dst = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Destination(RouteAddress::Inet(d)) if r.header.destination_prefix_length == 32 => {
                Some(IpAddr::V4(*d))
            }
            RouteAttribute::Destination(RouteAddress::Inet6(d)) if r.header.destination_prefix_length == 128 => {
                Some(IpAddr::V6(*d))
            }
            _ => None,
        });
        let oif = r.attributes.iter().find_map(|a| if let RouteAttribute::Oif(i) = a { Some(*i) } else { None });
        if let (Some(dst), Some(oif)) = (dst, oif) {
            out.insert((dst, oif));
        }
    }
    Ok(out)
}

/// One rx and one tx queue instead of one per CPU: a plain veth (no XDP)
/// forwards through the backlog of the sending CPU whatever its queue count,
/// while every queue costs sysfs objects at creation (two queues per end:
/// ~0.15 ms of a ~0.6 ms veth creation on this 2-CPU machine; more on
/// larger nodes).
fn single_queue(link: &mut LinkMessage) {
    link.attributes.push(LinkAttribute::NumTxQueues(1));
    link.attributes.push(LinkAttribute::NumRxQueues(1));
}

/// Up, then each family's address and default route, in one batch once
/// the interface's index is known. `gateway_off_subnet`: the gateway is not
/// on the pod's subnet (a /32 address), so the route is on-link and the
/// gateway's MAC (the host end's) is entered up front. IPv6 routes are
/// on-link in any case: the gateway is reachable at once, whether or not
/// the address's prefix route is in place yet (a /128 has none).
pub fn configure_pod(
    nl: &mut BlockingNetlink,
    spec: &AttachSpec,
    gateway_off_subnet: bool,
) -> Result<(), DataplaneError> {
    let ifname = &spec.ifname;
    let found = nl
        .request(RouteNetlinkMessage::GetLink(LinkUnspec::new_with_name(ifname).build()), 0)
        .map_err(kernel_op(format!("look up {ifname} in the pod")))?;
    let Some(RouteNetlinkMessage::NewLink(link)) = found.first() else {
        return Err(DataplaneError::Unexpected(format!("{ifname} did not appear in the pod namespace")));
    };
    let index = link.header.index;
    let mut msgs = vec![(RouteNetlinkMessage::SetLink(LinkUnspec::new_with_index(index).up().build()), 0)];
    let mut what = vec![format!("set {ifname} up")];
    for a in &spec.addresses {
        msgs.push((RouteNetlinkMessage::NewAddress(address_message(index, a.address)), NLM_F_CREATE | NLM_F_EXCL));
        what.push(format!("add {} to {ifname}", a.address));
        let route = match a.gateway {
            IpAddr::V4(gw) => {
                let route = RouteMessageBuilder::<Ipv4Addr>::new().gateway(gw).output_interface(index);
                if gateway_off_subnet { route.onlink() } else { route }.build()
            }
            IpAddr::V6(gw) => {
                RouteMessageBuilder::<Ipv6Addr>::new().gateway(gw).output_interface(index).onlink().build()
            }
        };
        msgs.push((RouteNetlinkMessage::NewRoute(route), NLM_F_CREATE | NLM_F_EXCL));
        what.push(format!("add the default route via {} in the pod", a.gateway));
        if gateway_off_subnet {
            let gateway = neighbour(index, a.gateway, spec.host_mac, NeighbourState::Permanent);
            msgs.push((RouteNetlinkMessage::NewNeighbour(gateway), NLM_F_CREATE | NLM_F_REPLACE));
            what.push(format!("add the neighbour entry of gateway {} in the pod", a.gateway));
        }
    }
    nl.batch(msgs)
        .map(drop)
        .map_err(|(at, e)| kernel_op(what.get(at).cloned().unwrap_or_else(|| format!("configure {ifname}")))(e))
}

pub fn format_mac(mac: &[u8]) -> String {
    mac.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(":")
}

/// Deletes a link by name; `Ok(false)` when it did not exist.
pub async fn delete(h: &Handle, name: &str) -> Result<bool, DataplaneError> {
    let Some(link) = by_name(h, name).await? else {
        return Ok(false);
    };
    match h.link().del(link.header.index).execute().await {
        Ok(()) => Ok(true),
        Err(e) if errno(&e) == Some(ENODEV) => Ok(false),
        Err(e) => Err(op(format!("delete link {name}"))(e)),
    }
}

/// Names of veth links whose name starts with `prefix`.
pub async fn veths_with_prefix(h: &Handle, prefix: &str) -> Result<Vec<String>, DataplaneError> {
    let mut out = Vec::new();
    for link in dump("list links", || h.link().get().execute()).await? {
        if kind_of(&link) == Some(&InfoKind::Veth)
            && let Some(name) = name_of(&link)
            && name.starts_with(prefix)
        {
            out.push(name.to_owned());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod kernel_tests {
    use super::*;
    use crate::test_support::{TestNetns, require_root};

    /// Both families' default gateways come back from a table long enough
    /// that each dump takes many reads: a second dump requested before the
    /// first is read to its end is refused with EBUSY. Concurrent dumps on
    /// one handle are asked for again until each gets its turn.
    #[test]
    fn default_gateways_are_read_from_a_long_table_one_dump_at_a_time() {
        if !require_root() {
            return;
        }
        let ns = TestNetns::new();
        let mut batch = String::from(
            "link add d0 type veth peer name d1\nlink set d1 up\nlink set d0 up\naddr add 10.99.0.1/16 dev d0\naddr add fd00:99::1/64 dev d0 nodad\n\
             route add default via 10.99.0.254\nroute add default via fd00:99::fe\n",
        );
        for i in 0..4000u32 {
            batch.push_str(&format!("route add 10.{}.{}.0/24 via 10.99.0.2\n", 100 + i / 256, i % 256));
        }
        let mut ip = std::process::Command::new("ip")
            .args(["-n", ns.name(), "-batch", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("ip");
        std::io::Write::write_all(&mut ip.stdin.take().expect("stdin"), batch.as_bytes()).expect("write batch");
        assert!(ip.wait().expect("ip").success(), "ip -batch");

        let (seen, routes) = ns.run(|| {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                let (conn, h, _) = rtnetlink::new_connection().expect("netlink");
                tokio::spawn(conn);
                let mut seen = Vec::new();
                for _ in 0..20 {
                    seen.push(all_default_gateways(&h).await.map_err(|e| e.to_string()));
                }
                // Tasks sharing the handle (as the agent's do) dump at once.
                let tasks: Vec<_> = (0..4)
                    .map(|_| {
                        let h = h.clone();
                        tokio::spawn(async move {
                            let mut lengths = Vec::new();
                            for _ in 0..10 {
                                lengths.push(main_table_routes(&h).await.map(|r| r.len()).map_err(|e| e.to_string()));
                            }
                            lengths
                        })
                    })
                    .collect();
                let mut at_once = Vec::new();
                for t in tasks {
                    at_once.extend(t.await.expect("task"));
                }
                (seen, at_once)
            })
        });
        let want: Vec<IpAddr> = vec!["10.99.0.254".parse().unwrap(), "fd00:99::fe".parse().unwrap()];
        for gateways in seen {
            assert_eq!(gateways, Ok(want.clone()));
        }
        for routes in routes {
            assert!(routes.as_ref().is_ok_and(|n| *n > 4000), "{routes:?}");
        }
    }
}
