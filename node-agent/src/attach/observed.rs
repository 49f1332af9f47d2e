//! An attachment as read from the kernel, and the pure judgements made on
//! it: CHECK's "does it look as ADD left it" and start-up reconciliation's
//! "keep, keep but report, or release". Reading is `observe`'s job.

use std::net::IpAddr;

use ipnet::IpNet;

use super::Driver;
use crate::dataplane::link::PodAddress;

/// The node's end of an attachment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedHost {
    /// The host veth's name.
    pub name: String,
    /// The pod's pool address.
    pub ip: IpAddr,
    pub up: bool,
    /// The index of the link the host veth is a port of.
    pub controller: Option<u32>,
    pub bridge_name: String,
    /// The node bridge's index, when it exists.
    pub bridge: Option<u32>,
    /// The pod's addresses the node has no /32 (/128) route to on the host
    /// veth (routed pods; always empty for bridged ones).
    pub unrouted: Vec<IpAddr>,
}

/// The pod's end, inside its network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObservedPod {
    /// The namespace path no longer exists: the sandbox is gone.
    Gone,
    /// The namespace could not be read (entered, or asked over netlink);
    /// says why. Nothing about the pod is known.
    Unreadable(String),
    Seen {
        /// The pod's interface, when present.
        iface: Option<PodIface>,
        /// Gateways of the pod's default routes (main table, both families).
        gateways: Vec<IpAddr>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIface {
    pub up: bool,
    /// Both families.
    pub addresses: Vec<IpNet>,
}

/// What a finished ADD leaves, for one attachment.
pub struct Expected<'a> {
    pub driver: &'a dyn Driver,
    pub ifname: &'a str,
    /// One per family, the pool's first.
    pub addresses: Vec<PodAddress>,
}

/// CHECK: the attachment looks exactly as ADD left it; `Err` says what differs.
pub fn compare(want: &Expected<'_>, host: Option<&ObservedHost>, pod: &ObservedPod) -> Result<(), String> {
    let host = host.ok_or("the host veth is missing")?;
    if !host.up {
        return Err(format!("host veth {} is down", host.name));
    }
    want.driver.check_host(host)?;
    pod_matches(want, pod)
}

fn pod_matches(want: &Expected<'_>, pod: &ObservedPod) -> Result<(), String> {
    let ifname = want.ifname;
    let (iface, gateways) = match pod {
        ObservedPod::Gone => return Err("the pod's network namespace is gone".into()),
        ObservedPod::Unreadable(why) => return Err(format!("pod network namespace: {why}")),
        ObservedPod::Seen { iface, gateways } => (iface, gateways),
    };
    let iface = iface.as_ref().ok_or_else(|| format!("interface {ifname} is missing in the pod"))?;
    if !iface.up {
        return Err(format!("interface {ifname} is down"));
    }
    for &PodAddress { address, gateway } in &want.addresses {
        if !iface.addresses.contains(&address) {
            let has: Vec<String> = iface.addresses.iter().map(ToString::to_string).collect();
            return Err(format!("interface {ifname} lacks address {address} (has {has:?})"));
        }
        if !gateways.contains(&gateway) {
            return Err(format!("the pod has no default route via {gateway}"));
        }
    }
    Ok(())
}

/// Start-up reconciliation's judgement of one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// As ADD left it.
    Keep,
    /// Kept, but it could not be verified or differs from what ADD left
    /// (another interface's route, an in-pod VPN, a VM runtime that moved the
    /// address, an interrupted ADD the runtime will DEL): says what.
    KeepUnverified(String),
    /// Certainly gone: its resources can be released.
    Release(String),
}

/// Only what is certainly gone is released: the runtime never repeats an
/// ADD, so releasing a pod that still runs would disconnect it for good.
/// Anything merely odd is kept and reported; the runtime's DEL (or GC)
/// removes it when its pod goes.
pub fn on_start(want: &Expected<'_>, host: Option<&ObservedHost>, pod: &ObservedPod) -> Verdict {
    let Some(host) = host else {
        // Deleting either end of a veth deletes both: the pod has no
        // interface of ours left.
        return Verdict::Release("its host veth is gone".into());
    };
    if *pod == ObservedPod::Gone {
        // The path is gone, but a veth's two ends go together: the pod's
        // end still lives in some namespace (one whose bind mount was
        // removed, a runtime that keeps namespaces elsewhere).
        return Verdict::KeepUnverified(format!(
            "its network namespace path is gone, but its host veth {} still exists",
            host.name
        ));
    }
    let host_ok = if host.up { want.driver.check_host(host) } else { Err(format!("host veth {} is down", host.name)) };
    match host_ok.and_then(|()| pod_matches(want, pod)) {
        Ok(()) => Verdict::Keep,
        Err(why) => Verdict::KeepUnverified(why),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::attach::driver;
    use crate::attachment::Attachment;

    pub(crate) fn host() -> ObservedHost {
        ObservedHost {
            name: "weftv0123456789".into(),
            ip: "10.1.2.7".parse().expect("ip"),
            up: true,
            controller: Some(4),
            bridge_name: "weft0".into(),
            bridge: Some(4),
            unrouted: Vec::new(),
        }
    }

    fn seen() -> ObservedPod {
        ObservedPod::Seen {
            iface: Some(PodIface { up: true, addresses: vec!["10.1.2.7/24".parse().expect("net")] }),
            gateways: vec!["10.1.2.1".parse().expect("gw")],
        }
    }

    fn pod_address(address: &str, gateway: &str) -> PodAddress {
        PodAddress { address: address.parse().expect("net"), gateway: gateway.parse().expect("gw") }
    }

    fn want() -> Expected<'static> {
        Expected {
            driver: driver(Attachment::Bridge),
            ifname: "eth0",
            addresses: vec![pod_address("10.1.2.7/24", "10.1.2.1")],
        }
    }

    #[test]
    fn check_passes_what_add_leaves_and_names_each_difference() {
        let w = want();
        assert_eq!(compare(&w, Some(&host()), &seen()), Ok(()));
        assert!(compare(&w, None, &seen()).unwrap_err().contains("host veth is missing"));
        let down = ObservedHost { up: false, ..host() };
        assert!(compare(&w, Some(&down), &seen()).unwrap_err().contains("is down"));
        let no_route = ObservedPod::Seen {
            iface: Some(PodIface { up: true, addresses: vec![w.addresses[0].address] }),
            gateways: vec!["192.168.9.1".parse().expect("gw")],
        };
        assert!(compare(&w, Some(&host()), &no_route).unwrap_err().contains("no default route via 10.1.2.1"));
        let bare = ObservedPod::Seen { iface: Some(PodIface { up: true, addresses: vec![] }), gateways: vec![] };
        assert!(compare(&w, Some(&host()), &bare).unwrap_err().contains("lacks address 10.1.2.7/24"));
        let unreadable = ObservedPod::Unreadable("permission denied".into());
        assert!(compare(&w, Some(&host()), &unreadable).unwrap_err().contains("permission denied"));
    }

    #[test]
    fn a_dual_stack_pod_needs_its_ipv6_address_and_route_too() {
        let mut w = want();
        w.addresses.push(pod_address("fd00::7/64", "fd00::1"));
        let v4_only = seen();
        assert!(compare(&w, Some(&host()), &v4_only).unwrap_err().contains("lacks address fd00::7/64"));
        let both = |gateways: Vec<IpAddr>| ObservedPod::Seen {
            iface: Some(PodIface {
                up: true,
                addresses: vec!["10.1.2.7/24".parse().expect("net"), "fd00::7/64".parse().expect("net")],
            }),
            gateways,
        };
        let no_route6 = both(vec!["10.1.2.1".parse().expect("gw")]);
        assert!(compare(&w, Some(&host()), &no_route6).unwrap_err().contains("no default route via fd00::1"));
        let ok = both(vec!["10.1.2.1".parse().expect("gw"), "fd00::1".parse().expect("gw")]);
        assert_eq!(compare(&w, Some(&host()), &ok), Ok(()));
        assert_eq!(compare(&want(), Some(&host()), &ok), Ok(()), "an IPv4-only record ignores IPv6");
    }

    #[test]
    fn an_ipv6_only_pod_is_checked_on_its_one_family() {
        let w = Expected { addresses: vec![pod_address("fd00::7/64", "fd00::1")], ..want() };
        let pod = |addresses: Vec<IpNet>, gateways: Vec<IpAddr>| ObservedPod::Seen {
            iface: Some(PodIface { up: true, addresses }),
            gateways,
        };
        let ok = pod(vec!["fd00::7/64".parse().expect("net")], vec!["fd00::1".parse().expect("gw")]);
        assert_eq!(compare(&w, Some(&host()), &ok), Ok(()));
        let v4 = pod(vec!["10.1.2.7/24".parse().expect("net")], vec!["10.1.2.1".parse().expect("gw")]);
        assert!(compare(&w, Some(&host()), &v4).unwrap_err().contains("lacks address fd00::7/64"));
    }

    #[test]
    fn start_up_releases_only_what_is_certainly_gone() {
        let w = want();
        assert_eq!(on_start(&w, Some(&host()), &seen()), Verdict::Keep);
        assert!(matches!(on_start(&w, None, &seen()), Verdict::Release(_)));
        assert!(matches!(on_start(&w, None, &ObservedPod::Gone), Verdict::Release(_)));
        // Its namespace path gone but its veth there: the pod may still run.
        let kept = on_start(&w, Some(&host()), &ObservedPod::Gone);
        assert!(
            matches!(&kept, Verdict::KeepUnverified(why) if why.contains("host veth weftv0123456789 still exists")),
            "{kept:?}"
        );
        // A replaced default route, an unreadable namespace, an address
        // moved elsewhere, a veth taken off the bridge: kept and reported.
        let vpn = ObservedPod::Seen {
            iface: Some(PodIface { up: true, addresses: vec![w.addresses[0].address] }),
            gateways: vec!["172.16.0.1".parse().expect("gw")],
        };
        let unreadable = ObservedPod::Unreadable("cannot enter".into());
        let moved = ObservedPod::Seen { iface: Some(PodIface { up: true, addresses: vec![] }), gateways: vec![] };
        let off_bridge = ObservedHost { controller: None, ..host() };
        for (h, p) in [(host(), vpn), (host(), unreadable), (host(), moved), (off_bridge, seen())] {
            assert!(matches!(on_start(&w, Some(&h), &p), Verdict::KeepUnverified(_)), "{h:?} {p:?}");
        }
    }
}
