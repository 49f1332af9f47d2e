//! Routes, neighbour entries and VXLAN FDB entries of the overlay: reading
//! what the kernel has and applying single operations. Which entries should
//! exist is decided by `overlay::diff`.

use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::{Handle, RouteMessageBuilder};

use super::entries::{Dev, Entry, Fdb, Mac, Neigh, Observed, ObservedNeigh, ObservedRoute, Op, RTPROT_WEFT, Route};
use super::{DataplaneError, dump, errno, op};

/// Interface indices the overlay's logical devices map to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Devices {
    /// The VXLAN device, when it exists.
    pub vxlan: Option<u32>,
    pub underlay: u32,
    /// The TUN device, with the udp and wireguard backends.
    pub tunnel: Option<u32>,
}

impl Devices {
    fn dev(&self, index: u32) -> Dev {
        if Some(index) == self.vxlan {
            Dev::Vxlan
        } else if Some(index) == self.tunnel {
            Dev::Tunnel
        } else if index == self.underlay {
            Dev::Underlay
        } else {
            Dev::Other(index)
        }
    }

    fn index(&self, dev: Dev) -> Result<u32, DataplaneError> {
        match dev {
            Dev::Vxlan => {
                self.vxlan.ok_or_else(|| DataplaneError::Unexpected("the VXLAN device does not exist".into()))
            }
            Dev::Tunnel => {
                self.tunnel.ok_or_else(|| DataplaneError::Unexpected("the TUN device does not exist".into()))
            }
            Dev::Underlay => Ok(self.underlay),
            Dev::Other(i) => Ok(i),
        }
    }
}

/// Reads the main table's unicast routes (both families) and the
/// neighbour and FDB entries of the VXLAN device.
pub async fn observe(h: &Handle, devs: &Devices) -> Result<Observed, DataplaneError> {
    let mut out = Observed::default();
    for msg in super::link::main_table_routes(h).await? {
        if let Some(r) = observed_route(&msg, devs) {
            out.routes.insert(r.route.key(), r);
        }
    }
    let Some(vxlan) = devs.vxlan else { return Ok(out) };

    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        for msg in dump("list neighbours", || h.neighbours().get().set_address_family(family).execute()).await? {
            if msg.header.ifindex != vxlan {
                continue;
            }
            if let Some(ip) = neigh_dst(&msg) {
                let permanent = msg.header.state == NeighbourState::Permanent;
                out.neighs.insert(ip, ObservedNeigh { ip, mac: neigh_lladdr(&msg), permanent });
            }
        }
    }

    for msg in
        dump("list FDB entries", || h.neighbours().get().set_address_family(AddressFamily::Bridge).execute()).await?
    {
        if msg.header.ifindex != vxlan {
            continue;
        }
        if let (Some(mac), Some(dst)) = (neigh_lladdr(&msg), neigh_dst(&msg)) {
            out.fdb.entry(mac).or_default().push(dst);
        }
    }
    Ok(out)
}

fn observed_route(msg: &RouteMessage, devs: &Devices) -> Option<ObservedRoute> {
    let h = &msg.header;
    let unspecified = match h.address_family {
        AddressFamily::Inet => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        AddressFamily::Inet6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        _ => return None,
    };
    if h.kind != RouteType::Unicast {
        return None;
    }
    let mut table = u32::from(h.table);
    let (mut dst, mut via, mut oif, mut metric) = (None, None, None, 0);
    for a in &msg.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(RouteAddress::Inet(d)) => dst = Some(IpAddr::V4(*d)),
            RouteAttribute::Destination(RouteAddress::Inet6(d)) => dst = Some(IpAddr::V6(*d)),
            RouteAttribute::Gateway(RouteAddress::Inet(g)) => via = Some(IpAddr::V4(*g)),
            RouteAttribute::Gateway(RouteAddress::Inet6(g)) => via = Some(IpAddr::V6(*g)),
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Priority(p) => metric = *p,
            _ => {}
        }
    }
    if table != u32::from(RouteHeader::RT_TABLE_MAIN) {
        return None;
    }
    let dst = IpNet::new(dst.unwrap_or(unspecified), h.destination_prefix_length).ok()?;
    let route = Route {
        dst,
        metric,
        // Directly connected routes have no gateway.
        via: via.unwrap_or(unspecified),
        // Multipath routes have no single device.
        dev: devs.dev(oif.unwrap_or(0)),
        onlink: h.flags.contains(RouteFlags::Onlink),
    };
    Some(ObservedRoute { route, proto: u8::from(h.protocol) })
}

fn neigh_dst(msg: &NeighbourMessage) -> Option<IpAddr> {
    msg.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
        // Bridge-family (FDB) messages carry the remote IP without a family
        // the parser knows; its length tells.
        NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => match b.len() {
            4 => <[u8; 4]>::try_from(b.as_slice()).ok().map(IpAddr::from),
            16 => <[u8; 16]>::try_from(b.as_slice()).ok().map(IpAddr::from),
            _ => None,
        },
        _ => None,
    })
}

fn neigh_lladdr(msg: &NeighbourMessage) -> Option<Mac> {
    msg.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::LinkLayerAddress(b) => Mac::from_slice(b),
        _ => None,
    })
}

/// Applies one operation. Deleting what is already gone succeeds.
pub async fn apply(h: &Handle, devs: &Devices, o: &Op) -> Result<(), DataplaneError> {
    let what = o.to_string();
    let result = match o {
        Op::Add(e) | Op::Replace(e) => {
            let replace = matches!(o, Op::Replace(_));
            match e {
                Entry::Route(r) => add_route(h, devs, r, replace).await?,
                Entry::Neigh(n) => add_neigh(h, devs, n, replace).await?,
                Entry::Fdb(f) => add_fdb(h, devs, f, replace).await?,
            }
        }
        Op::Delete(e) => {
            let r = match e {
                Entry::Route(r) => h.route().del(route_message(devs, r, true)?).execute().await,
                Entry::Neigh(n) => h.neighbours().del(neigh_del_message(devs, n)?).execute().await,
                Entry::Fdb(f) => h.neighbours().del(fdb_del_message(devs, f)?).execute().await,
            };
            match r {
                Err(e) if matches!(errno(&e), Some(libc::ENOENT) | Some(libc::ESRCH)) => Ok(()),
                other => other,
            }
        }
    };
    result.map_err(op(what))
}

async fn add_route(
    h: &Handle,
    devs: &Devices,
    r: &Route,
    replace: bool,
) -> Result<Result<(), rtnetlink::Error>, DataplaneError> {
    let req = h.route().add(route_message(devs, r, false)?);
    Ok(if replace { req.replace() } else { req }.execute().await)
}

async fn add_neigh(
    h: &Handle,
    devs: &Devices,
    n: &Neigh,
    replace: bool,
) -> Result<Result<(), rtnetlink::Error>, DataplaneError> {
    let req =
        h.neighbours().add(devs.index(Dev::Vxlan)?, n.ip).link_layer_address(&n.mac.0).state(NeighbourState::Permanent);
    Ok(if replace { req.replace() } else { req }.execute().await)
}

async fn add_fdb(
    h: &Handle,
    devs: &Devices,
    f: &Fdb,
    replace: bool,
) -> Result<Result<(), rtnetlink::Error>, DataplaneError> {
    // NTF_SELF: the entry belongs to the VXLAN device's own FDB, like
    // `bridge fdb append <mac> dev weft.1 dst <ip> self permanent`.
    let req = h
        .neighbours()
        .add_bridge(devs.index(Dev::Vxlan)?, &f.mac.0)
        .destination(f.dst)
        .flags(NeighbourFlags::Own)
        .state(NeighbourState::Permanent);
    Ok(if replace { req.replace() } else { req }.execute().await)
}

/// A route message marked as Weft's. For deletion the scope is left open
/// (RT_SCOPE_NOWHERE matches any), like `ip route del` does.
fn route_message(devs: &Devices, r: &Route, delete: bool) -> Result<RouteMessage, DataplaneError> {
    let invalid = |e| DataplaneError::Unexpected(format!("{r}: {e}"));
    let mut b = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(r.dst.addr(), r.dst.prefix_len())
        .map_err(invalid)?
        .output_interface(devs.index(r.dev)?)
        .protocol(RouteProtocol::from(RTPROT_WEFT));
    if !r.via.is_unspecified() {
        b = b.gateway(r.via).map_err(invalid)?;
    }
    if r.metric != 0 {
        b = b.priority(r.metric);
    }
    if r.onlink {
        b = b.onlink();
    }
    if delete {
        b = b.scope(RouteScope::NoWhere);
    }
    Ok(b.build())
}

fn neigh_del_message(devs: &Devices, n: &Neigh) -> Result<NeighbourMessage, DataplaneError> {
    let mut m = NeighbourMessage::default();
    m.header.family = if n.ip.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    m.header.ifindex = devs.index(Dev::Vxlan)?;
    m.attributes.push(NeighbourAttribute::Destination(neigh_address(n.ip)));
    Ok(m)
}

/// Deletes only the remote `f.dst` of the MAC's entry, which removes the
/// whole entry when it was the last remote.
fn fdb_del_message(devs: &Devices, f: &Fdb) -> Result<NeighbourMessage, DataplaneError> {
    let mut m = NeighbourMessage::default();
    m.header.family = AddressFamily::Bridge;
    m.header.ifindex = devs.index(Dev::Vxlan)?;
    m.header.flags = NeighbourFlags::Own;
    m.header.state = NeighbourState::Permanent;
    m.attributes.push(NeighbourAttribute::LinkLayerAddress(f.mac.0.to_vec()));
    m.attributes.push(NeighbourAttribute::Destination(neigh_address(f.dst)));
    Ok(m)
}

fn neigh_address(ip: IpAddr) -> NeighbourAddress {
    match ip {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }
}
