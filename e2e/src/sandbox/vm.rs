//! A VM runtime's pod, emulated as Kata's default `tcfilter` mode wires it.
//!
//! After weft-cni's ADD, the runtime creates a tap device (`tap0_kata`) in
//! the pod's namespace for the VM, redirects everything arriving on the pod
//! interface to the tap and everything from the tap out of the pod
//! interface (TC ingress qdiscs, mirred egress redirect), gives the guest's
//! interface the pod interface's MAC, MTU, addresses and routes, and leaves
//! the pod interface without an address. Here the VM is a network namespace
//! of its own and the tap a veth pair, its guest end `eth0` in that
//! namespace; everything the guest gets comes from the CNI result alone, so
//! a result that misses something a VM needs fails here.

use anyhow::{Context, bail};
use serde_json::Value;

use super::{ip, iproute2};

/// The runtime's end of the VM's link, in the pod's namespace.
pub const TAP: &str = "tap0_kata";
/// The guest's interface, in the VM's namespace.
pub const GUEST_IFNAME: &str = "eth0";

/// What the guest's interface gets, read from a CNI result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestInterface {
    pub mac: String,
    pub mtu: u64,
    /// Addresses with their prefix, as listed.
    pub addresses: Vec<String>,
    /// (destination, gateway) in the order listed; no gateway: on-link.
    pub routes: Vec<(String, Option<String>)>,
}

impl GuestInterface {
    /// The configuration of the interface `ifname` inside the sandbox, as a
    /// VM runtime reads it from the ADD result.
    pub fn from_result(result: &Value, ifname: &str) -> anyhow::Result<GuestInterface> {
        let interfaces = result["interfaces"].as_array().context("the result lists no interfaces")?;
        let (index, pod_if) = interfaces
            .iter()
            .enumerate()
            .find(|(_, i)| i["name"] == ifname && i["sandbox"].as_str().is_some_and(|s| !s.is_empty()))
            .with_context(|| format!("the result lists no {ifname} inside the sandbox: {result}"))?;
        let mac = pod_if["mac"].as_str().with_context(|| format!("the result gives {ifname} no MAC"))?.to_owned();
        let mtu = pod_if["mtu"].as_u64().with_context(|| format!("the result gives {ifname} no MTU"))?;
        let addresses: Vec<String> = result["ips"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["interface"].as_u64() == Some(index as u64))
            .filter_map(|a| a["address"].as_str().map(str::to_owned))
            .collect();
        if addresses.is_empty() {
            bail!("the result gives {ifname} no address: {result}");
        }
        let routes = result["routes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                let dst = r["dst"].as_str().with_context(|| format!("a route without dst: {r}"))?;
                Ok((dst.to_owned(), r["gw"].as_str().map(str::to_owned)))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(GuestInterface { mac, mtu, addresses, routes })
    }
}

/// Wires a VM in namespace `guest_netns` (created here) to the pod
/// interface `ifname` of `pod_netns`. On failure the guest namespace is
/// removed again; the pod's namespace is the caller's.
pub fn wire(pod_netns: &str, ifname: &str, guest_netns: &str, guest: &GuestInterface) -> anyhow::Result<()> {
    ip(&["netns", "add", guest_netns])?;
    let wired = wire_into(pod_netns, ifname, guest_netns, guest);
    if wired.is_err() {
        let _ = ip(&["netns", "del", guest_netns]);
    }
    wired.with_context(|| format!("wiring a VM to {ifname} of {pod_netns} as Kata's tcfilter mode does"))
}

fn wire_into(pod_netns: &str, ifname: &str, guest_netns: &str, guest: &GuestInterface) -> anyhow::Result<()> {
    let mtu = guest.mtu.to_string();
    let (pod, vm) = (["-n", pod_netns], ["-n", guest_netns]);
    ip(&[&vm[..], &["link", "set", "lo", "up"]].concat())?;
    // The guest end is made in the guest: the pod has an eth0 already.
    let tap = ["link", "add", TAP, "mtu", &mtu, "type", "veth", "peer", "name", GUEST_IFNAME, "netns", guest_netns];
    ip(&[&pod[..], &tap[..]].concat())?;
    let set = ["link", "set", GUEST_IFNAME, "address", &guest.mac, "mtu", &mtu, "up"];
    ip(&[&vm[..], &set[..]].concat())?;
    for a in &guest.addresses {
        ip(&[&vm[..], &["addr", "add", a, "dev", GUEST_IFNAME]].concat())?;
    }
    for (dst, gw) in &guest.routes {
        let mut route = vec!["route", "add", dst.as_str()];
        if let Some(gw) = gw {
            route.extend(["via", gw.as_str()]);
        }
        route.extend(["dev", GUEST_IFNAME]);
        ip(&[&vm[..], &route[..]].concat())?;
    }
    // The pod interface only carries frames now: the guest owns its addresses.
    ip(&[&pod[..], &["addr", "flush", "dev", ifname]].concat())?;
    ip(&[&pod[..], &["link", "set", TAP, "up"]].concat())?;
    for (from, to) in [(ifname, TAP), (TAP, ifname)] {
        tc(pod_netns, &["qdisc", "add", "dev", from, "ingress"])?;
        let match_all =
            ["filter", "add", "dev", from, "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0"];
        let redirect = ["action", "mirred", "egress", "redirect", "dev", to];
        tc(pod_netns, &[&match_all[..], &redirect[..]].concat())?;
    }
    Ok(())
}

fn tc(netns: &str, args: &[&str]) -> anyhow::Result<String> {
    iproute2("tc", &[&["-n", netns], args].concat())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn result() -> Value {
        json!({"cniVersion": "1.1.0",
            "interfaces": [{"name": "weftv1", "mac": "aa:00:00:00:00:01", "mtu": 1450},
                           {"name": "eth0", "mac": "aa:00:00:00:00:02", "mtu": 1450, "sandbox": "/run/netns/p"}],
            "ips": [{"address": "10.244.1.7/32", "gateway": "10.244.1.1", "interface": 1}],
            "routes": [{"dst": "10.244.1.1/32"}, {"dst": "0.0.0.0/0", "gw": "10.244.1.1"}]})
    }

    #[test]
    fn the_guest_gets_the_pod_interface_from_the_result() {
        let g = GuestInterface::from_result(&result(), "eth0").expect("complete");
        assert_eq!(g.mac, "aa:00:00:00:00:02");
        assert_eq!(g.mtu, 1450);
        assert_eq!(g.addresses, ["10.244.1.7/32"]);
        assert_eq!(
            g.routes,
            [("10.244.1.1/32".to_owned(), None), ("0.0.0.0/0".to_owned(), Some("10.244.1.1".to_owned()))]
        );
    }

    #[test]
    fn a_result_without_what_a_vm_needs_is_refused() {
        for (field, want) in [("mac", "no MAC"), ("mtu", "no MTU")] {
            let mut r = result();
            r["interfaces"][1].as_object_mut().expect("object").remove(field);
            let e = GuestInterface::from_result(&r, "eth0").expect_err(field).to_string();
            assert!(e.contains(want), "{e}");
        }
        let mut r = result();
        r["ips"][0]["interface"] = json!(0);
        assert!(GuestInterface::from_result(&r, "eth0").expect_err("no address").to_string().contains("no address"));
        assert!(GuestInterface::from_result(&result(), "net1").is_err());
    }
}
