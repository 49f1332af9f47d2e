//! The underlay interface: the one carrying the node IP, whose MTU bounds
//! the overlay's and whose subnet is the node's L2 segment.

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::Handle;

use super::{DataplaneError, link, op};

/// What the overlay needs to know about the underlay interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Underlay {
    pub index: u32,
    pub name: String,
    pub mtu: u32,
    /// The node IP with the interface's prefix length.
    pub net: IpNet,
}

/// Finds the underlay: the interface `name`, or when `None`, whichever
/// interface carries `node_ip`. Either way `node_ip` must be on it.
pub async fn find(h: &Handle, name: Option<&str>, node_ip: IpAddr) -> Result<Underlay, DataplaneError> {
    let (index, net) = match name {
        Some(name) => {
            let l = link::by_name(h, name)
                .await?
                .ok_or_else(|| DataplaneError::Unexpected(format!("underlay interface {name} does not exist")))?;
            let net =
                link::all_addresses(h, l.header.index).await?.into_iter().find(|n| n.addr() == node_ip).ok_or_else(
                    || {
                        DataplaneError::Unexpected(format!(
                            "node IP {node_ip} is not an address of underlay interface {name}"
                        ))
                    },
                )?;
            (l.header.index, net)
        }
        None => carrying(h, node_ip)
            .await?
            .ok_or_else(|| DataplaneError::Unexpected(format!("no interface carries the node IP {node_ip}")))?,
    };
    let l = by_index(h, index)
        .await?
        .ok_or_else(|| DataplaneError::Unexpected(format!("underlay interface {index} vanished")))?;
    let name = link::name_of(&l).unwrap_or_default().to_owned();
    let mtu =
        mtu_of(&l).ok_or_else(|| DataplaneError::Unexpected(format!("underlay interface {name} reports no MTU")))?;
    Ok(Underlay { index, name, mtu, net })
}

/// Checks that `ip` (such as the node's IPv6 address, the source of VXLAN
/// over IPv6) is an address of the underlay interface.
pub async fn require_address(h: &Handle, ul: &Underlay, ip: IpAddr) -> Result<(), DataplaneError> {
    if link::all_addresses(h, ul.index).await?.iter().any(|n| n.addr() == ip) {
        Ok(())
    } else {
        Err(DataplaneError::Unexpected(format!("{ip} is not an address of the underlay interface {}", ul.name)))
    }
}

/// The interface index and subnet of the address `ip`, if any link has it.
async fn carrying(h: &Handle, ip: IpAddr) -> Result<Option<(u32, IpNet)>, DataplaneError> {
    for msg in super::dump("list addresses", || h.address().get().execute()).await? {
        let has = msg.attributes.iter().any(|a| matches!(a, AddressAttribute::Address(a) if *a == ip));
        if has && let Ok(net) = IpNet::new(ip, msg.header.prefix_len) {
            return Ok(Some((msg.header.index, net)));
        }
    }
    Ok(None)
}

pub async fn by_index(h: &Handle, index: u32) -> Result<Option<LinkMessage>, DataplaneError> {
    match h.link().get().match_index(index).execute().try_next().await {
        Ok(l) => Ok(l),
        Err(e) if super::errno(&e) == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(op(format!("look up link {index}"))(e)),
    }
}

pub fn mtu_of(l: &LinkMessage) -> Option<u32> {
    l.attributes.iter().find_map(|a| if let LinkAttribute::Mtu(m) = a { Some(*m) } else { None })
}
