//! TUN devices, the kernel end of the userspace backends (udp, wireguard):
//! the kernel routes pod packets for other nodes into the device, the agent
//! reads them as whole IP packets and writes the ones it receives back.
//!
//! The device is persistent (TUNSETPERSIST): it, its address and the routes
//! through it outlive the agent, so a restarted agent attaches to the same
//! device and nothing has to be reprogrammed while traffic waits.
//!
//! Every packet carries a `virtio_net_hdr` (IFF_VNET_HDR), and the device
//! takes and hands over TCP packets of up to 64 KiB with partial checksums
//! (TUNSETOFFLOAD: checksum, TSO for both families), as a NIC with those
//! offloads does: the caller cuts and joins segments.

use std::ffi::CString;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use ipnet::IpNet;
use netlink_packet_route::link::LinkMessage;
use rtnetlink::{Handle, LinkUnspec};

use super::{DataplaneError, kernel_op, link, op, underlay};

const TUN_PATH: &str = "/dev/net/tun";
// <linux/if_tun.h>
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags.
#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Opens (creating it if needed) the TUN device `name` in the calling
/// thread's network namespace, with vnet headers and offloads, and makes it
/// persistent. Fails with a clear error when a device of that name exists
/// and is not a TUN device.
pub fn open(name: &str) -> Result<OwnedFd, DataplaneError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.bytes().any(|b| b == b'/' || b.is_ascii_whitespace()) {
        return Err(DataplaneError::Unexpected(format!("{name:?} is not a usable interface name")));
    }
    let path = CString::new(TUN_PATH).map_err(|e| DataplaneError::Unexpected(e.to_string()))?;
    // SAFETY: a NUL-terminated path; the returned descriptor is owned below.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(kernel_op(format!("open {TUN_PATH} (is the tun module loaded?)"))(std::io::Error::last_os_error()));
    }
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: IFF_TUN | IFF_NO_PI | IFF_VNET_HDR, _pad: [0; 22] };
    for (dst, src) in req.name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
        let e = std::io::Error::last_os_error();
        let hint = match e.raw_os_error() {
            Some(libc::EINVAL) | Some(libc::EBUSY) => " (a device of that name exists and is not a TUN device of ours)",
            _ => "",
        };
        return Err(kernel_op(format!("attach TUN device {name}{hint}"))(e));
    }
    // SAFETY: TUNSETOFFLOAD takes an integer argument. Without offloads
    // (an old kernel) packets still come with a header, one at a time.
    let offloads = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6;
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETOFFLOAD, offloads as libc::c_ulong) } < 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(device = name, error = %e, "no offloads on the TUN device: one packet per read and write");
    }
    // SAFETY: TUNSETPERSIST takes an integer argument.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        return Err(kernel_op(format!("make TUN device {name} persistent"))(std::io::Error::last_os_error()));
    }
    Ok(fd)
}

/// Brings the device `name` to the given MTU and addresses (its only ones of
/// those families; the kernel's IPv6 link-local address stays) and up.
/// Returns its index and what had to change.
pub async fn configure(
    h: &Handle,
    name: &str,
    mtu: u32,
    addresses: &[IpNet],
) -> Result<(u32, Vec<String>), DataplaneError> {
    let l: LinkMessage = link::by_name(h, name)
        .await?
        .ok_or_else(|| DataplaneError::Unexpected(format!("TUN device {name} does not exist")))?;
    let index = l.header.index;
    let mut changes = Vec::new();
    if underlay::mtu_of(&l) != Some(mtu) {
        h.link()
            .set(LinkUnspec::new_with_index(index).mtu(mtu).build())
            .execute()
            .await
            .map_err(op(format!("set MTU on {name}")))?;
        changes.push(format!("MTU set to {mtu}"));
    }
    for address in addresses {
        changes.extend(link::ensure_only_address(h, index, name, *address).await?);
    }
    if !link::is_up(&l) {
        h.link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(op(format!("set {name} up")))?;
        changes.push("set up".into());
    }
    Ok((index, changes))
}

/// The MTU of pod packets through a TUN backend over an underlay of
/// `underlay_mtu`: the underlay's IP and UDP headers and the backend's own
/// `overhead` per packet are taken off.
pub fn mtu_for(underlay_mtu: u32, underlay_ip: IpAddr, overhead: u32) -> u32 {
    let ip_udp = if underlay_ip.is_ipv6() { 40 + 8 } else { 20 + 8 };
    underlay_mtu.saturating_sub(ip_udp + overhead)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_takes_off_the_underlay_headers_and_the_backend_overhead() {
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let v6: IpAddr = "fd00::1".parse().unwrap();
        // flannel's udp: 1472 on a 1500 underlay; WireGuard's 60/80 bytes.
        assert_eq!(mtu_for(1500, v4, 0), 1472);
        assert_eq!(mtu_for(1500, v4, 32), 1440);
        assert_eq!(mtu_for(1500, v6, 32), 1420);
    }

    #[test]
    fn names_the_kernel_would_misread_are_refused() {
        for bad in ["", "a-name-far-too-long", "a/b", "a b"] {
            assert!(open(bad).is_err(), "{bad:?}");
        }
    }
}
