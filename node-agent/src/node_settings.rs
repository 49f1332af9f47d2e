//! The node settings an overlay node needs, kept level-triggered:
//! forwarding of each family its pods have (pods on other nodes are reached
//! through it) and the masquerade rules for pod traffic
//! leaving the cluster (IPv6 too where its pods' addresses are not routable
//! beyond the node, or as `--ipv6-masquerade` says), and the drop of
//! pods' own overlay packets ([`encapsulation_guard`]). A `sysctl --system`
//! or a firewall reload undoes them silently; they are checked at start-up
//! and every resync period, and put back with a warning and a count in
//! `weft_agent_node_setting_repairs_total`.

use std::sync::Arc;
use std::time::Duration;

use ipnet::{Ipv4Net, Ipv6Net};

use crate::dataplane::{ipv6_reach, sysctl};
use crate::encapsulation_guard::{self, Encapsulation};
use crate::masquerade::{self, Ranges};
use crate::metrics::Metrics;

/// Whether IPv6 pod traffic leaving the cluster is masqueraded (agent flag
/// `--ipv6-masquerade`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Ipv6Masquerade {
    /// Masquerade unless the pods' IPv6 block is globally routable (not
    /// unique local) and the node itself has routable IPv6.
    #[default]
    Auto,
    On,
    Off,
}

impl Ipv6Masquerade {
    /// Whether traffic from `pods` is masqueraded on a node that has
    /// (`node_routable`) or has not a default IPv6 route and a global address.
    pub fn applies(self, pods: Ipv6Net, node_routable: bool) -> bool {
        match self {
            Ipv6Masquerade::On => true,
            Ipv6Masquerade::Off => false,
            Ipv6Masquerade::Auto => !(node_routable && is_global_unicast(pods)),
        }
    }
}

/// 2000::/3: the only IPv6 unicast routed on the internet.
fn is_global_unicast(net: Ipv6Net) -> bool {
    net.network().segments()[0] & 0xe000 == 0x2000
}

/// What this node keeps: its pod blocks and the cluster's ranges, IPv4
/// (all but IPv6-only nodes) and IPv6 (dual-stack and IPv6-only nodes).
#[derive(Debug, Clone, Copy)]
pub struct NodeSettings {
    pub ipv4: Option<Ranges<Ipv4Net>>,
    pub ipv6: Option<Ipv6Settings>,
    /// The overlay's UDP port when its packets are not authenticated
    /// (VXLAN, udp): pods may not send to it.
    pub encapsulation_port: Option<u16>,
}

#[derive(Debug, Clone, Copy)]
pub struct Ipv6Settings {
    pub pods: Ipv6Net,
    /// The cluster's IPv6 range; without it nothing IPv6 is masqueraded
    /// (pod-to-pod traffic could not be told from traffic leaving).
    pub cluster: Option<Ipv6Net>,
    pub masquerade: Ipv6Masquerade,
}

impl NodeSettings {
    /// The IPv6 ranges to masquerade, if any, on a node that has
    /// (`node_routable`) routable IPv6 or not. Pure.
    pub fn ipv6_masquerade(&self, node_routable: bool) -> Option<Ranges<Ipv6Net>> {
        let v6 = self.ipv6?;
        let cluster = v6.cluster?;
        v6.masquerade.applies(v6.pods, node_routable).then_some(Ranges { pods: v6.pods, cluster })
    }

    /// What the encapsulation guard drops: UDP to the overlay's port from
    /// the cluster's pod ranges (this node's IPv6 block when the cluster's
    /// IPv6 range is not known). Pure.
    pub fn encapsulation(&self) -> Option<Encapsulation> {
        let port = self.encapsulation_port?;
        let v4 = self.ipv4.map(|r| r.cluster.into());
        let v6 = self.ipv6.map(|v6| v6.cluster.unwrap_or(v6.pods).into());
        Some(Encapsulation { port, pods: v4.into_iter().chain(v6).collect() })
    }
}

/// What one [`ensure`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Pass {
    /// The settings someone had undone and that were put back.
    pub repaired: Vec<&'static str>,
    /// Whether the node has routable IPv6, when `auto` asked.
    pub ipv6_routable: Option<bool>,
}

/// What an overlay node needs: forwarding, masquerading of traffic from
/// its pods leaving the cluster, and the encapsulation guard. `last_routable`: the previous pass's
/// answer, so that a changed `auto` decision is not taken for a repair, and
/// kept when the node's routes cannot be read. Blocking (sysctl and procfs
/// files, nft): call off the runtime.
pub fn ensure(settings: &NodeSettings, last_routable: Option<bool>) -> anyhow::Result<Pass> {
    let mut repaired = Vec::new();
    if settings.ipv4.is_some() && sysctl::ensure_ipv4_forwarding()? {
        repaired.push("ip_forward");
    }
    if settings.ipv6.is_some() && sysctl::ensure_ipv6_forwarding()? {
        repaired.push("ipv6_forwarding");
    }
    // Only asked when it can matter: /proc reads are cheap, but not free.
    let auto = settings.ipv6.is_some_and(|v6| v6.masquerade == Ipv6Masquerade::Auto);
    let ipv6_routable = auto.then(|| match ipv6_reach::routable_ipv6() {
        Ok(routable) => routable,
        // The IPv4 rules are checked all the same; IPv6 keeps its last
        // decision (masquerading when there is none).
        Err(e) => {
            tracing::warn!(error = %e, "cannot tell whether this node has routable IPv6; keeping the last decision");
            last_routable.unwrap_or(false)
        }
    });
    let decided_again = last_routable.is_some() && ipv6_routable != last_routable;
    if decided_again {
        let now = if ipv6_routable == Some(true) { "no longer masqueraded" } else { "masqueraded" };
        tracing::info!("this node's routable IPv6 changed: IPv6 traffic leaving the cluster is {now} from now on");
    }
    let wrote = masquerade::ensure(settings.ipv4, settings.ipv6_masquerade(ipv6_routable.unwrap_or(false)))?;
    if wrote && !decided_again {
        repaired.push("masquerade");
    }
    if encapsulation_guard::ensure(settings.encapsulation().as_ref())? {
        repaired.push("encapsulation guard");
    }
    Ok(Pass { repaired, ipv6_routable })
}

/// Checks every `period`, for as long as the agent runs (the first check is
/// start-up's own, in `setup_overlay`: `first_routable` is its answer).
pub async fn run(metrics: Arc<Metrics>, settings: NodeSettings, period: Duration, first_routable: Option<bool>) {
    let mut last_routable = first_routable;
    loop {
        tokio::time::sleep(period).await;
        match tokio::task::spawn_blocking(move || ensure(&settings, last_routable)).await {
            Ok(Ok(pass)) => {
                last_routable = pass.ipv6_routable;
                for setting in pass.repaired {
                    tracing::warn!(setting, "a node setting the overlay needs had been undone; put it back");
                    metrics.node_setting_repaired(setting);
                }
            }
            Ok(Err(e)) => tracing::error!(error = %e, "cannot check the overlay's node settings"),
            Err(e) => tracing::error!(error = %e, "the node settings task failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pods6: &str, cluster6: Option<&str>, masquerade: Ipv6Masquerade) -> NodeSettings {
        NodeSettings {
            ipv4: Some(Ranges { pods: "10.244.1.0/24".parse().unwrap(), cluster: "10.244.0.0/16".parse().unwrap() }),
            ipv6: Some(Ipv6Settings {
                pods: pods6.parse().unwrap(),
                cluster: cluster6.map(|c| c.parse().unwrap()),
                masquerade,
            }),
            encapsulation_port: None,
        }
    }

    #[test]
    fn auto_masquerades_unless_both_the_block_and_the_node_are_routable() {
        use Ipv6Masquerade::Auto;
        let ula = settings("fd00:10:244:1::/64", Some("fd00:10:244::/56"), Auto);
        let global = settings("2001:db8:0:1::/64", Some("2001:db8::/56"), Auto);
        assert!(ula.ipv6_masquerade(false).is_some());
        assert!(ula.ipv6_masquerade(true).is_some(), "unique local addresses go nowhere beyond the site");
        assert!(global.ipv6_masquerade(false).is_some(), "the node itself cannot route them");
        assert_eq!(global.ipv6_masquerade(true), None, "routable pods keep their addresses");
        let r = ula.ipv6_masquerade(true).unwrap();
        assert_eq!(
            (r.pods.to_string(), r.cluster.to_string()),
            ("fd00:10:244:1::/64".into(), "fd00:10:244::/56".into())
        );
    }

    #[test]
    fn on_and_off_override_what_the_node_has() {
        for routable in [false, true] {
            let on = settings("2001:db8:0:1::/64", Some("2001:db8::/56"), Ipv6Masquerade::On);
            let off = settings("fd00:10:244:1::/64", Some("fd00:10:244::/56"), Ipv6Masquerade::Off);
            assert!(on.ipv6_masquerade(routable).is_some());
            assert_eq!(off.ipv6_masquerade(routable), None);
        }
    }

    #[test]
    fn without_the_cluster_range_or_an_ipv6_block_nothing_ipv6_is_masqueraded() {
        assert_eq!(settings("fd00:10:244:1::/64", None, Ipv6Masquerade::On).ipv6_masquerade(false), None);
        let v4_only = NodeSettings { ipv6: None, ..settings("fd00::/64", None, Ipv6Masquerade::On) };
        assert_eq!(v4_only.ipv6_masquerade(false), None);
    }

    #[test]
    fn the_encapsulation_guard_covers_the_cluster_of_each_family_and_only_an_unauthenticated_port() {
        let dual = settings("fd00:10:244:1::/64", Some("fd00:10:244::/56"), Ipv6Masquerade::Auto);
        assert_eq!(dual.encapsulation(), None, "no port (host-gw, wireguard): nothing to guard");
        let nets = |s: &NodeSettings| -> Vec<String> {
            s.encapsulation().expect("guarded").pods.iter().map(ToString::to_string).collect()
        };
        let vxlan = NodeSettings { encapsulation_port: Some(8472), ..dual };
        assert_eq!(vxlan.encapsulation().map(|e| e.port), Some(8472));
        assert_eq!(nets(&vxlan), ["10.244.0.0/16", "fd00:10:244::/56"]);
        let no_range6 = NodeSettings {
            encapsulation_port: Some(8285),
            ..settings("fd00:10:244:1::/64", None, Ipv6Masquerade::Auto)
        };
        assert_eq!(nets(&no_range6), ["10.244.0.0/16", "fd00:10:244:1::/64"], "this node's block at least");
        let v4_only = NodeSettings { ipv6: None, ..vxlan };
        assert_eq!(nets(&v4_only), ["10.244.0.0/16"]);
    }
}

/// In namespaces the test creates: pod -- node -- outside, over IPv6, with
/// an outside that has no route back to pods (only masqueraded traffic
/// returns). Needs root: skips loudly without it, fails under CI=true.
#[cfg(test)]
mod kernel_tests {
    use std::process::Command;

    use super::*;
    use crate::test_support::{TestNetns as Ns, require_root};

    fn ip(ns: &Ns, args: &[&str]) {
        let out = Command::new("ip").args(["-n", ns.name()]).args(args).output().expect("ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn ping6(from: &Ns, to: &str) -> bool {
        let args = ["netns", "exec", from.name(), "ping", "-6", "-c1", "-W1", to];
        Command::new("ip").args(args).output().expect("ping").status.success()
    }

    /// (node, pod, outside); the pod is fd00/2001:db8 `pods`::2 behind the node's ::1.
    fn topology(pods: &str) -> (Ns, Ns, Ns) {
        let (node, pod, outside) = (Ns::new(), Ns::new(), Ns::new());
        ip(&node, &["link", "add", "vpod", "type", "veth", "peer", "name", "eth0", "netns", pod.name()]);
        ip(&node, &["link", "add", "ul", "type", "veth", "peer", "name", "eth0", "netns", outside.name()]);
        ip(&node, &["addr", "add", &format!("{pods}1/64"), "dev", "vpod", "nodad"]);
        ip(&node, &["addr", "add", "2001:db8:50::1/64", "dev", "ul", "nodad"]);
        ip(&pod, &["addr", "add", &format!("{pods}2/64"), "dev", "eth0", "nodad"]);
        ip(&outside, &["addr", "add", "2001:db8:50::254/64", "dev", "eth0", "nodad"]);
        for (ns, dev) in [(&node, "vpod"), (&node, "ul"), (&pod, "eth0"), (&outside, "eth0")] {
            ip(ns, &["link", "set", dev, "up"]);
        }
        ip(&pod, &["route", "add", "default", "via", &format!("{pods}1")]);
        (node, pod, outside)
    }

    fn settings(pods: &str) -> NodeSettings {
        NodeSettings {
            ipv4: Some(Ranges { pods: "10.244.1.0/24".parse().unwrap(), cluster: "10.244.0.0/16".parse().unwrap() }),
            ipv6: Some(Ipv6Settings {
                pods: format!("{pods}/64").parse().unwrap(),
                cluster: Some(format!("{pods}/56").parse().unwrap()),
                masquerade: Ipv6Masquerade::Auto,
            }),
            encapsulation_port: None,
        }
    }

    #[test]
    fn auto_masquerades_ipv6_until_the_node_has_routable_ipv6() {
        if !require_root() {
            return;
        }
        // Global pod addresses, on a node with a global address but no
        // default route yet: not routable beyond the node, so masqueraded.
        let pods = "2001:db8:244:100::";
        let (node, pod, _outside) = topology(pods);
        let s = settings(pods);
        assert!(!node.run(|| ipv6_reach::routable_ipv6().expect("read procfs")));
        let first = node.run(move || ensure(&s, None).expect("ensure"));
        assert_eq!(first.ipv6_routable, Some(false));
        assert!(ping6(&pod, "2001:db8:50::254"), "masqueraded: the outside answers the node's address");

        // A default route: the node routes IPv6, the pods' global addresses
        // are kept (and the outside, without a route back, cannot answer).
        ip(&node, &["route", "add", "default", "via", "2001:db8:50::254"]);
        assert!(node.run(|| ipv6_reach::routable_ipv6().expect("read procfs")));
        let pass = node.run(move || ensure(&s, Some(false)).expect("ensure"));
        // The rules changed because the decision did: not a repair.
        assert_eq!(pass, Pass { repaired: vec![], ipv6_routable: Some(true) }, "the IPv6 rules went");
        assert!(!ping6(&pod, "2001:db8:50::254"), "the pod's own address is kept");
        // Rules removed behind our back are a repair.
        assert!(node.run(masquerade::remove).expect("remove"));
        let pass = node.run(move || ensure(&s, Some(true)).expect("ensure"));
        assert_eq!(pass.repaired, ["masquerade"]);
    }

    #[test]
    fn unique_local_pod_addresses_are_masqueraded_even_on_a_routable_node() {
        if !require_root() {
            return;
        }
        let pods = "fd00:10:244:100::";
        let (node, pod, _outside) = topology(pods);
        ip(&node, &["route", "add", "default", "via", "2001:db8:50::254"]);
        let s = settings(pods);
        node.run(move || ensure(&s, None).expect("ensure"));
        assert!(ping6(&pod, "2001:db8:50::254"));
        let off = NodeSettings { ipv6: s.ipv6.map(|v6| Ipv6Settings { masquerade: Ipv6Masquerade::Off, ..v6 }), ..s };
        node.run(move || ensure(&off, None).expect("ensure"));
        assert!(!ping6(&pod, "2001:db8:50::254"), "off: nothing IPv6 is masqueraded");
    }
}
