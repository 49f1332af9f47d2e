//! Links and addresses of pod attachments: the node's bridge, the veth pair of
//! each pod, and what CHECK needs to read back.

use std::net::Ipv4Addr;

use futures::TryStreamExt;
use ipnet::Ipv4Net;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::route::{RouteAddress, RouteAttribute};
use rtnetlink::{Handle, LinkBridge, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder};

use super::{DataplaneError, errno, op};
use crate::netns::Netns;

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

/// Makes sure the bridge exists, is up and carries the gateway address.
/// Returns its index. Safe to call concurrently with itself only under the
/// caller's lock (creation races would fail with EEXIST, which is handled).
pub async fn ensure_bridge(h: &Handle, name: &str, gateway: Ipv4Net) -> Result<u32, DataplaneError> {
    let link = match by_name(h, name).await? {
        Some(l) => l,
        None => {
            match h.link().add(LinkBridge::new(name).build()).execute().await {
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
    if !is_up(&link) {
        h.link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(op(format!("set {name} up")))?;
    }
    if !has_address(h, index, gateway).await? {
        match h.address().add(index, gateway.addr().into(), gateway.prefix_len()).execute().await {
            Ok(()) => {}
            Err(e) if errno(&e) == Some(EEXIST) => {}
            Err(e) => return Err(op(format!("add {gateway} to {name}"))(e)),
        }
    }
    Ok(index)
}

async fn has_address(h: &Handle, index: u32, want: Ipv4Net) -> Result<bool, DataplaneError> {
    Ok(addresses(h, index).await?.contains(&want))
}

/// IPv4 addresses on a link, with their prefix lengths.
pub async fn addresses(h: &Handle, index: u32) -> Result<Vec<Ipv4Net>, DataplaneError> {
    let mut out = Vec::new();
    let mut stream = h.address().get().set_link_index_filter(index).execute();
    while let Some(msg) = stream.try_next().await.map_err(op("list addresses"))? {
        for a in &msg.attributes {
            if let AddressAttribute::Address(std::net::IpAddr::V4(ip)) = a
                && let Ok(net) = Ipv4Net::new(*ip, msg.header.prefix_len)
            {
                out.push(net);
            }
        }
    }
    Ok(out)
}

/// Gateways of IPv4 default routes in the main table.
pub async fn default_gateways(h: &Handle) -> Result<Vec<Ipv4Addr>, DataplaneError> {
    let mut out = Vec::new();
    let mut stream = h.route().get(RouteMessageBuilder::<Ipv4Addr>::new().build()).execute();
    while let Some(r) = stream.try_next().await.map_err(op("list routes"))? {
        if r.header.destination_prefix_length != 0 {
            continue;
        }
        for a in &r.attributes {
            if let RouteAttribute::Gateway(RouteAddress::Inet(gw)) = a {
                out.push(*gw);
            }
        }
    }
    Ok(out)
}

/// What one pod attachment should look like.
pub struct AttachSpec<'a> {
    pub host_veth: &'a str,
    pub ifname: &'a str,
    pub bridge_index: u32,
    /// The pod's address with the pod CIDR's prefix length.
    pub address: Ipv4Net,
    pub gateway: Ipv4Addr,
    pub mtu: u32,
    /// MACs are chosen by the caller so that the result needs no read-back.
    pub host_mac: [u8; 6],
    pub pod_mac: [u8; 6],
}

/// Creates the veth pair in one request: the host end plugged into the
/// bridge and up, the pod end directly inside the pod's namespace under its
/// final name (the kernel refuses to bring a peer up in another namespace at
/// creation). Then address, up and default route in the pod. On failure
/// the host end is deleted, which removes the pod end too.
pub async fn attach(host: &Handle, pod: &Netns, spec: &AttachSpec<'_>) -> Result<(), DataplaneError> {
    use std::os::fd::AsRawFd;
    let peer = LinkMessageBuilder::<LinkUnspec>::new()
        .name(spec.ifname.to_owned())
        .mtu(spec.mtu)
        .address(spec.pod_mac.to_vec())
        .setns_by_fd(pod.file.as_raw_fd())
        .build();
    let veth = LinkVeth::new(spec.host_veth, spec.ifname)
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .mtu(spec.mtu)
        .address(spec.host_mac.to_vec())
        .controller(spec.bridge_index)
        .up()
        .build();
    host.link().add(veth).execute().await.map_err(|e| {
        if errno(&e) == Some(EEXIST) {
            DataplaneError::Unexpected(format!(
                "cannot create veth {} / {}: an interface of that name already exists (in the pod or on the node)",
                spec.host_veth, spec.ifname
            ))
        } else {
            op(format!("create veth {} / {}", spec.host_veth, spec.ifname))(e)
        }
    })?;
    let (configured, hairpin) = tokio::join!(configure_pod(pod, spec), set_hairpin(spec.host_veth));
    if let Err(e) = configured.and(hairpin) {
        if let Err(cleanup) = delete(host, spec.host_veth).await {
            tracing::warn!(veth = spec.host_veth, error = %cleanup, "rollback of a failed ADD could not delete the veth");
        }
        return Err(e);
    }
    Ok(())
}

/// Hairpin mode on the pod's bridge port: with bridge netfilter, a pod's
/// traffic to its own host port is DNATed while being bridged and must be
/// allowed back out of the port it came in on. Written through sysfs: the
/// kernel takes bridge port options only from RTM_NEWLINK, which rtnetlink's
/// `set` does not send.
async fn set_hairpin(host_veth: &str) -> Result<(), DataplaneError> {
    let path = format!("/sys/class/net/{host_veth}/brport/hairpin_mode");
    std::fs::write(&path, b"1")
        .map_err(|e| DataplaneError::Unexpected(format!("cannot set hairpin mode on {host_veth} ({path}): {e}")))
}

async fn configure_pod(pod: &Netns, spec: &AttachSpec<'_>) -> Result<(), DataplaneError> {
    let ph = &pod.handle;
    let index = by_name(ph, spec.ifname)
        .await?
        .ok_or_else(|| DataplaneError::Unexpected(format!("{} did not appear in the pod namespace", spec.ifname)))?
        .header
        .index;
    ph.address()
        .add(index, spec.address.addr().into(), spec.address.prefix_len())
        .execute()
        .await
        .map_err(op(format!("add {} to {}", spec.address, spec.ifname)))?;
    ph.link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(op(format!("set {} up", spec.ifname)))?;
    ph.route()
        .add(RouteMessageBuilder::<Ipv4Addr>::new().gateway(spec.gateway).output_interface(index).build())
        .execute()
        .await
        .map_err(op(format!("add default route via {} in the pod", spec.gateway)))?;
    Ok(())
}

/// True when the pod's interface carries `address` and the pod routes via
/// `gateway`: what a finished ADD leaves.
pub async fn pod_is_attached(
    pod: &Netns,
    ifname: &str,
    address: Ipv4Net,
    gateway: Ipv4Addr,
) -> Result<bool, DataplaneError> {
    let Some(link) = by_name(&pod.handle, ifname).await? else { return Ok(false) };
    Ok(is_up(&link)
        && addresses(&pod.handle, link.header.index).await?.contains(&address)
        && default_gateways(&pod.handle).await?.contains(&gateway))
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
    let mut stream = h.link().get().execute();
    while let Some(link) = stream.try_next().await.map_err(op("list links"))? {
        if kind_of(&link) == Some(&InfoKind::Veth)
            && let Some(name) = name_of(&link)
            && name.starts_with(prefix)
        {
            out.push(name.to_owned());
        }
    }
    Ok(out)
}
