//! weft-cni and weft-agent on one node, exec'd exactly as a container runtime
//! does. Every test creates its own node and pod namespaces and removes them.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::{Value, json};
use weft_e2e::agent::{Agent, Node};
use weft_e2e::cni::{self, Container, Weft};
use weft_e2e::netns::Netns;
use weft_e2e::{bins, prereq, wait};

fn node(tag: &str, cidr: &str) -> Option<Node> {
    Node::start(tag, cidr)
}

fn which(cmd: &str) -> bool {
    prereq::have(cmd)
}

fn veths(node: &Netns) -> Vec<String> {
    node.links().into_iter().filter(|l| l.starts_with("weftv")).collect()
}

#[test]
fn verbs_follow_the_spec() {
    let Some(n) = node("verbs", "10.200.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    let c = Container::new("verbs1", &pod);

    // ADD gives a correctly addressed interface with a default route.
    let add = weft.add(&c);
    let result = add.assert_ok().json();
    assert_eq!(result["cniVersion"], "1.1.0");
    let ip = cni::pod_ip(&result);
    assert!(ip.starts_with("10.200.0."), "{result}");
    assert_eq!(result["ips"][0]["gateway"], "10.200.0.1");
    assert_eq!(result["interfaces"][1]["sandbox"], pod.path());
    assert!(pod.ip(&["-o", "addr", "show", "eth0"]).contains(&format!("{ip}/24")));
    assert!(pod.ip(&["route", "show", "default"]).contains("via 10.200.0.1"));
    assert!(pod.ping("10.200.0.1"), "pod cannot reach its gateway");

    // ADD of an existing container+ifname errors and changes nothing.
    let dup = weft.add(&c);
    assert_eq!(dup.code(), 101, "{}", dup.stdout);
    assert!(dup.msg().contains("already has interface eth0"), "{}", dup.msg());
    assert_eq!(n.agent.ipam_records().len(), 1);

    // CHECK passes, then detects a deleted route and a deleted address.
    weft.check(&c, &result).assert_ok();
    pod.ip(&["route", "del", "default"]);
    let chk = weft.check(&c, &result);
    assert_eq!(chk.code(), 103);
    assert!(chk.msg().contains("default route"), "{}", chk.msg());
    pod.ip(&["route", "add", "default", "via", "10.200.0.1"]);
    weft.check(&c, &result).assert_ok();
    pod.ip(&["addr", "del", &format!("{ip}/24"), "dev", "eth0"]);
    let chk = weft.check(&c, &result);
    assert_eq!(chk.code(), 103);
    assert!(chk.msg().contains("lacks address"), "{}", chk.msg());

    // CHECK of an unknown container is code 3.
    let other = Container::new("nosuch", &pod);
    assert_eq!(weft.check(&other, &result).code(), 3);

    // STATUS is ready while the agent runs.
    weft.status().assert_ok();

    // DEL without prevResult, then again: both succeed and nothing remains.
    weft.del(&c, None).assert_ok();
    weft.del(&c, Some(&result)).assert_ok();
    assert!(veths(&n.ns).is_empty(), "veth left behind: {:?}", veths(&n.ns));
    assert!(n.agent.ipam_records().is_empty());
    assert!(!pod.links().contains(&"eth0".to_owned()));
}

#[test]
fn dual_stack_pods_get_and_keep_both_addresses() {
    let Some(mut n) = Node::start_with("dual", "10.201.0.0/24", &["--pod-ipv6-cidr", "fd00:201::/64"], &[]) else {
        return;
    };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    let c = Container::new("dual1", &pod);

    // ADD: both addresses with their gateways and default routes, in the
    // result (both on interface 1, the pod's) and on eth0.
    let result = weft.add(&c).assert_ok().json();
    let (ip, ip6) = (cni::pod_ip(&result), cni::pod_ip6(&result).expect("an IPv6 address"));
    let host = ip.rsplit('.').next().expect("host number");
    assert_eq!(ip6, format!("fd00:201::{:x}", host.parse::<u8>().expect("number")), "{result}");
    assert_eq!(result["ips"][1]["gateway"], "fd00:201::1");
    assert_eq!(result["ips"][1]["interface"], 1);
    let routes: Vec<&str> =
        result["routes"].as_array().expect("routes").iter().filter_map(|r| r["dst"].as_str()).collect();
    assert_eq!(routes, ["0.0.0.0/0", "::/0"]);
    assert!(pod.ip(&["-6", "-o", "addr", "show", "eth0"]).contains(&format!("{ip6}/64")));
    assert!(pod.ip(&["-6", "route", "show", "default"]).contains("via fd00:201::1"));
    assert!(n.ns.ip(&["-6", "-o", "addr", "show", "weft0"]).contains("fd00:201::1/64"), "the gateway on the bridge");
    // The node knows the pod's MAC for its IPv6 address from the start, as
    // for its IPv4 one (a previous holder's entry would be stale).
    let mac = result["interfaces"][1]["mac"].as_str().expect("pod MAC");
    let neigh = n.ns.ip(&["-6", "neigh", "show", &ip6, "dev", "weft0"]);
    assert!(neigh.contains(&format!("lladdr {mac}")), "{neigh}");
    let ping6 = std::process::Command::new("ip")
        .args(["netns", "exec", pod.name(), "ping", "-6", "-c", "1", "-W", "2", "fd00:201::1"])
        .status()
        .expect("ping");
    assert!(ping6.success(), "the pod cannot reach its IPv6 gateway");

    // CHECK passes, and misses the IPv6 address and route like the IPv4 ones.
    weft.check(&c, &result).assert_ok();
    pod.ip(&["-6", "route", "del", "default"]);
    let chk = weft.check(&c, &result);
    assert_eq!(chk.code(), 103);
    assert!(chk.msg().contains("no default route via fd00:201::1"), "{}", chk.msg());
    pod.ip(&["-6", "route", "add", "default", "via", "fd00:201::1", "dev", "eth0", "onlink"]);
    weft.check(&c, &result).assert_ok();
    let mut v4_only = result.clone();
    v4_only["ips"].as_array_mut().expect("ips").truncate(1);
    let chk = weft.check(&c, &v4_only);
    assert!(chk.msg().contains(&format!("prevResult does not list address {ip6}/64")), "{}", chk.msg());

    // A restarted agent keeps the pod (verified with both addresses).
    n.agent.kill9();
    n.agent.restart(&n.ns);
    weft.check(&c, &result).assert_ok();
    pod.ip(&["-6", "addr", "del", &format!("{ip6}/64"), "dev", "eth0"]);
    let chk = weft.check(&c, &result);
    assert!(chk.msg().contains(&format!("lacks address {ip6}/64")), "{}", chk.msg());

    weft.del(&c, Some(&result)).assert_ok();
    assert!(veths(&n.ns).is_empty(), "veth left behind: {:?}", veths(&n.ns));
    assert!(n.agent.ipam_records().is_empty());
}

#[test]
fn shipped_static_cni_needs_no_libraries_and_serves_the_verbs() {
    let plugin = bins::static_cni();
    if !prereq::require("WEFT_STATIC_CNI (built by cni-plugin/build-static.sh; e2e/test.sh sets it)", plugin.is_some())
    {
        return;
    }
    let Some(n) = node("static", "10.209.0.0/24") else { return };
    let Some(plugin) = plugin else { return };
    // Copied onto nodes with any C library: no interpreter, no shared libraries.
    let ldd = std::process::Command::new("ldd").arg(&plugin).output().expect("ldd");
    let ldd_text = String::from_utf8_lossy(&ldd.stdout).into_owned() + &String::from_utf8_lossy(&ldd.stderr);
    assert!(!ldd.status.success() && ldd_text.contains("not a dynamic executable"), "{ldd_text}");

    let weft = Weft { plugin, ..Weft::new(&n.ns, &n.agent.socket) };
    let version = cni::exec_raw(&n.ns, &weft.plugin, &[("CNI_COMMAND", "VERSION")], br#"{"cniVersion":"1.1.0"}"#);
    assert!(version.assert_ok().json()["supportedVersions"].to_string().contains("1.1.0"), "{}", version.stdout);
    let pod = Netns::new("pod");
    let c = Container::new("static1", &pod);
    let result = weft.add(&c).assert_ok().json();
    assert!(pod.ping("10.209.0.1"), "pod cannot reach its gateway");
    weft.check(&c, &result).assert_ok();
    weft.status().assert_ok();
    weft.del(&c, Some(&result)).assert_ok();
    assert!(veths(&n.ns).is_empty() && n.agent.ipam_records().is_empty());
}

#[test]
fn the_gateway_mac_stays_as_pods_come_and_go() {
    let Some(n) = node("brmac", "10.210.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let bridge_mac =
        || n.ns.ip(&["-br", "link", "show", "weft0"]).split_whitespace().nth(2).unwrap_or_default().to_owned();
    // 02:58 and the gateway address 10.210.0.1.
    let fixed = "02:58:0a:d2:00:01";
    let (pa, pb) = (Netns::new("pod"), Netns::new("pod"));
    let (a, b) = (Container::new("brmac-a", &pa), Container::new("brmac-b", &pb));
    weft.add(&a).assert_ok();
    weft.add(&b).assert_ok();
    assert_eq!(bridge_mac(), fixed);
    // A bridge whose MAC is not set takes its lowest port MAC: it would
    // change here, whichever of the two pods goes first.
    weft.del(&a, None).assert_ok();
    assert_eq!(bridge_mac(), fixed);
    assert!(pb.ping("10.210.0.1"));
    weft.del(&b, None).assert_ok();
    assert_eq!(bridge_mac(), fixed);
}

#[test]
fn a_restarted_agent_hands_out_fresh_addresses_and_a_reused_one_is_reached_at_once() {
    let Some(mut n) = node("reuse", "10.219.0.0/24") else { return };
    let (pa, pb) = (Netns::new("pod"), Netns::new("pod"));
    let (a, b) = (Container::new("reuse-a", &pa), Container::new("reuse-b", &pb));
    let ip_a = {
        let weft = Weft::new(&n.ns, &n.agent.socket);
        let ip = cni::pod_ip(&weft.add(&a).assert_ok().json());
        // The node learns the pod's MAC, as when it forwards traffic to it.
        assert!(n.ns.ping(&ip), "the node cannot reach {ip}");
        weft.del(&a, None).assert_ok();
        ip
    };
    // The address just freed is not handed out again after a restart.
    n.agent.restart(&n.ns);
    let weft = Weft::new(&n.ns, &n.agent.socket);
    wait::until("the restarted agent", Duration::from_secs(30), || weft.status().success.then_some(()));
    let last: std::net::Ipv4Addr = ip_a.parse().expect("pod address");
    let next = std::net::Ipv4Addr::from(u32::from(last) + 1).to_string();
    // The bridge lost its carrier with its last port. The kernel flushes
    // its neighbours for that later, off the request path (link watch,
    // which sets the operational state too): wait for it, or the flush
    // could come after the entries below and take the new pod's as well.
    wait::until("the bridge without ports to be down", Duration::from_secs(10), || {
        let state = n.ns.ip(&["-br", "link", "show", "weft0"]);
        (state.split_whitespace().nth(1) == Some("DOWN")).then_some(())
    });
    // Whatever a previous holder of the next address left on the bridge:
    // an entry the kernel still believes, with another MAC.
    n.ns.ip(&["neigh", "replace", &next, "lladdr", "02:00:00:00:00:99", "dev", "weft0", "nud", "reachable"]);
    let ip_b = cni::pod_ip(&weft.add(&b).assert_ok().json());
    assert_eq!(ip_b, next, "the restarted agent did not go on after {ip_a}");
    let pod_mac = pb.ip(&["-br", "link", "show", "eth0"]).split_whitespace().nth(2).unwrap_or_default().to_owned();
    let entry = n.ns.ip(&["neigh", "show", &ip_b, "dev", "weft0"]);
    // ADD replaced the stale entry with the pod's MAC. The bridge's first
    // port turns its carrier on later (link watch again), and a carrier
    // event seen while it is still off flushes the bridge's neighbours,
    // the new entry with them (seen in two CI runs): an absent entry is
    // resolved by ARP at once, a stale one would not be.
    assert!(!entry.contains("02:00:00:00:00:99"), "the node still has the stale entry for {ip_b}: {entry}");
    assert!(
        entry.trim().is_empty() || entry.contains(&pod_mac),
        "the node's entry for {ip_b} is not the new pod's ({pod_mac}): {entry}"
    );
    assert!(n.ns.ping(&ip_b), "the node cannot reach the new pod at once");
    weft.del(&b, None).assert_ok();
}

#[test]
fn the_veth_pair_has_one_queue_per_end_and_hairpin_on() {
    let Some(n) = node("vshape", "10.211.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    let c = Container::new("vshape1", &pod);
    weft.add(&c).assert_ok();
    let [host] = veths(&n.ns).try_into().expect("one host veth");
    let host_end = n.ns.ip(&["-d", "link", "show", &host]);
    let pod_end = pod.ip(&["-d", "link", "show", "eth0"]);
    for (end, details) in [("host", &host_end), ("pod", &pod_end)] {
        assert!(details.contains("numtxqueues 1 numrxqueues 1"), "{end} end has more queues:\n{details}");
    }
    // A pod reaching its own host port comes back through the port it left by.
    assert!(host_end.contains("hairpin on"), "hairpin is off:\n{host_end}");
    weft.del(&c, None).assert_ok();
}

#[test]
fn the_agent_turns_bridge_netfilter_on() {
    if !prereq::require_root() || !prereq::require("ip (iproute2)", which("ip")) {
        return;
    }
    let ns = Netns::new("brnf");
    let knob = "/proc/sys/net/bridge/bridge-nf-call-iptables";
    let read = || String::from_utf8_lossy(&ns.exec("cat", &[knob]).stdout).trim().to_owned();
    // Off in the node's namespace, as on a host where nothing turned it on.
    assert!(ns.exec("sh", &["-c", &format!("echo 0 > {knob}")]).status.success(), "cannot turn it off");
    assert_eq!(read(), "0");
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = Agent::start(&ns, "10.212.0.0/24", dir.path());
    // Ready means it is on: bridged traffic between local pods meets policy.
    assert_eq!(read(), "1");
    drop(agent);
}

#[test]
fn routed_attachment_reaches_pods_without_the_bridge_and_is_adopted() {
    if !prereq::require_root() || !prereq::require("ip (iproute2)", which("ip")) {
        return;
    }
    let ns = Netns::new("routed");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut agent = Agent::start_with(&ns, "10.213.0.0/24", dir.path(), &["--pod-attachment", "routed"]);
    let weft = Weft::new(&ns, &agent.socket);
    let (p1, p2) = (Netns::new("pod"), Netns::new("pod"));
    let (c1, c2) = (Container::new("routed1", &p1), Container::new("routed2", &p2));
    let r1 = weft.add(&c1).assert_ok().json();
    let r2 = weft.add(&c2).assert_ok().json();
    let (ip1, ip2) = (cni::pod_ip(&r1), cni::pod_ip(&r2));

    // The pod carries its address alone and reaches the gateway on-link.
    assert_eq!(r1["ips"][0]["address"], format!("{ip1}/32"), "{r1}");
    assert_eq!(r1["ips"][0]["gateway"], "10.213.0.1");
    assert!(p1.ip(&["-o", "addr", "show", "eth0"]).contains(&format!("{ip1}/32")));
    let default = p1.ip(&["route", "show", "default"]);
    assert!(default.contains("via 10.213.0.1 dev eth0") && default.contains("onlink"), "{default}");
    // The host end has no master; the node routes to the pod on it.
    let host = r1["interfaces"][0]["name"].as_str().expect("host veth").to_owned();
    let host_end = ns.ip(&["-d", "link", "show", &host]);
    assert!(!host_end.contains("master"), "routed host end is a bridge port:\n{host_end}");
    let route = ns.ip(&["route", "show", &format!("{ip1}/32")]);
    assert!(route.contains(&format!("dev {host} ")) && route.contains("scope link src 10.213.0.1"), "{route}");

    // Pods reach each other, the gateway and the node reaches them, and no
    // side had to ARP: both ends' entries are permanent.
    assert!(p1.ping(&ip2) && p2.ping(&ip1), "routed pods cannot reach each other");
    assert!(p1.ping("10.213.0.1") && ns.ping(&ip1), "pod and node cannot reach each other");
    assert!(p1.ip(&["neigh", "show", "10.213.0.1"]).contains("PERMANENT"));
    assert!(ns.ip(&["neigh", "show", &ip1]).contains("PERMANENT"));

    // CHECK passes, and detects a missing route on the node.
    weft.check(&c1, &r1).assert_ok();
    ns.ip(&["route", "del", &format!("{ip1}/32")]);
    let chk = weft.check(&c1, &r1);
    assert_eq!(chk.code(), 103, "{}", chk.stdout);
    assert!(chk.msg().contains(&format!("no route to {ip1}")), "{}", chk.msg());

    // A restarted agent adopts the pods and puts the routes back, even when
    // the bridge holding their source address went too (and took them along).
    ns.ip(&["link", "del", "weft0"]);
    assert!(!ns.ip(&["route"]).contains(&format!("{ip2} ")), "routes to pods outlived their source address");
    agent.restart(&ns);
    weft.check(&c1, &r1).assert_ok();
    assert!(p2.ping(&ip1), "pod unreachable after the agent's restart");

    // Configured for the bridge while routed pods run, the agent keeps routing
    // new pods (a bridged pod could not reach them) and says why.
    // (Resync every second from here on, for the repair below.)
    agent.stop();
    let agent = Agent::start_with(&ns, "10.213.0.0/24", dir.path(), &["--resync-seconds", "1"]);
    let p3 = Netns::new("pod");
    let c3 = Container::new("routed3", &p3);
    let r3 = weft.add(&c3).assert_ok().json();
    let ip3 = cni::pod_ip(&r3);
    assert_eq!(r3["ips"][0]["address"], format!("{ip3}/32"), "{r3}");
    assert!(p3.ping(&ip1), "a pod added after the switch cannot reach the others");
    assert!(agent.log_text().contains("new pods are attached routed too"), "{}", agent.log_text());

    // A route deleted while the agent runs comes back at its next resync.
    ns.ip(&["route", "del", &format!("{ip2}/32")]);
    wait::until("the periodic resync to restore the route", Duration::from_secs(15), || {
        weft.check(&c2, &r2).success.then_some(())
    });
    assert!(p1.ping(&ip2), "pod unreachable after its route was restored");

    // DEL removes the veths, their routes and the records.
    for c in [&c1, &c2, &c3] {
        weft.del(c, None).assert_ok();
    }
    assert!(veths(&ns).is_empty(), "veth left behind: {:?}", veths(&ns));
    let routes = ns.ip(&["route"]);
    assert!([&ip1, &ip2, &ip3].iter().all(|ip| !routes.contains(&format!("{ip} "))), "{routes}");
    assert!(agent.ipam_records().is_empty());
    drop(agent);
}

/// Routed dual-stack pods carry their IPv6 address as a /128 too, with an
/// on-link default route via the IPv6 gateway; the node routes each /128 to
/// its host veth, both sides' neighbour entries are permanent, and CHECK
/// and the repair loop treat the IPv6 route like the IPv4 one.
#[test]
fn routed_dual_stack_pods_carry_their_ipv6_address_alone() {
    let args = ["--pod-attachment", "routed", "--pod-ipv6-cidr", "fd00:214::/64", "--resync-seconds", "1"];
    let Some(n) = Node::start_with("routed6", "10.214.0.0/24", &args, &[]) else {
        return;
    };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let (p1, p2) = (Netns::new("pod"), Netns::new("pod"));
    let (c1, c2) = (Container::new("routed61", &p1), Container::new("routed62", &p2));
    let r1 = weft.add(&c1).assert_ok().json();
    let r2 = weft.add(&c2).assert_ok().json();
    let (a1, a2) = (cni::pod_ip6(&r1).expect("IPv6"), cni::pod_ip6(&r2).expect("IPv6"));

    assert_eq!(r1["ips"][1]["address"], format!("{a1}/128"), "{r1}");
    assert_eq!(r1["ips"][1]["gateway"], "fd00:214::1");
    let routes = cni::routes(&r1);
    assert_eq!(routes, ["10.214.0.1/32 ", "0.0.0.0/0 10.214.0.1", "fd00:214::1/128 ", "::/0 fd00:214::1"]);
    assert!(p1.ip(&["-6", "-o", "addr", "show", "eth0", "scope", "global"]).contains(&format!("{a1}/128")));
    let default = p1.ip(&["-6", "route", "show", "default"]);
    assert!(default.contains("via fd00:214::1 dev eth0") && default.contains("onlink"), "{default}");
    let host = r1["interfaces"][0]["name"].as_str().expect("host veth").to_owned();
    let route = n.ns.ip(&["-6", "route", "show", &format!("{a1}/128")]);
    assert!(route.contains(&format!("dev {host} ")) && route.contains("src fd00:214::1"), "{route}");
    assert!(p1.ip(&["-6", "neigh", "show", "fd00:214::1"]).contains("PERMANENT"));
    assert!(n.ns.ip(&["-6", "neigh", "show", &a1]).contains("PERMANENT"));
    // The host end answers for the gateway (a VM guest resolves it itself).
    let proxy = n.ns.ip(&["-6", "neigh", "show", "proxy", "dev", &host]);
    assert!(proxy.contains("fd00:214::1"), "{proxy}");
    assert!(p1.ping(&a2) && p2.ping(&a1), "routed pods cannot reach each other over IPv6");
    assert!(n.ns.ping(&a1) && p1.ping("fd00:214::1"), "pod and node cannot reach each other over IPv6");

    // CHECK misses the node's IPv6 route; the next resync puts it back.
    weft.check(&c1, &r1).assert_ok();
    n.ns.ip(&["-6", "route", "del", &format!("{a1}/128")]);
    let chk = weft.check(&c1, &r1);
    assert_eq!(chk.code(), 103, "{}", chk.stdout);
    assert!(chk.msg().contains(&format!("no route to {a1} via {host}")), "{}", chk.msg());
    wait::until("the periodic resync to restore the IPv6 route", Duration::from_secs(15), || {
        weft.check(&c1, &r1).success.then_some(())
    });
    assert!(p2.ping(&a1), "pod unreachable over IPv6 after its route was restored");

    for c in [&c1, &c2] {
        weft.del(c, None).assert_ok();
    }
    assert!(veths(&n.ns).is_empty(), "veth left behind: {:?}", veths(&n.ns));
    let routes = n.ns.ip(&["-6", "route"]);
    assert!(!routes.contains(&a1) && !routes.contains(&a2), "{routes}");
    assert!(n.agent.ipam_records().is_empty());
}

#[test]
fn del_without_netns_and_after_the_netns_is_gone() {
    let Some(n) = node("delns", "10.201.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    let c = Container::new("delns1", &pod);
    weft.add(&c).assert_ok();
    drop(pod); // the runtime removed the namespace first
    let no_netns = Container { netns: None, ..c.clone() };
    weft.del(&no_netns, None).assert_ok();
    weft.del(&c, None).assert_ok();
    assert!(veths(&n.ns).is_empty());
    assert!(n.agent.ipam_records().is_empty());
}

#[test]
fn gc_keeps_valid_attachments_and_frees_the_rest() {
    let Some(n) = node("gc", "10.202.0.0/24") else { return };
    gc_keeps_valid_attachments(&n, "10.202.0.1");
}

/// GC of routed dual-stack pods: the freed pods' /32 and /128 routes go
/// with them, the kept pods' stay.
#[test]
fn gc_of_routed_dual_stack_pods_frees_both_families() {
    let args = ["--pod-attachment", "routed", "--pod-ipv6-cidr", "fd00:202::/64"];
    let Some(n) = Node::start_with("gc6", "10.217.0.0/24", &args, &[]) else { return };
    let _pods = gc_keeps_valid_attachments(&n, "10.217.0.1");
    let routes = n.ns.ip(&["-6", "route", "show", "root", "fd00:202::/64"]);
    let pod_routes: Vec<&str> = routes.lines().filter(|l| l.starts_with("fd00:202::") && !l.contains("/64")).collect();
    assert_eq!(pod_routes.len(), 1, "one pod left, one /128 route:\n{routes}");
    assert!(n.ns.ip(&["-4", "route"]).lines().filter(|l| l.contains("10.217.0.") && !l.contains('/')).count() == 1);
}

/// An IPv6 `--pod-cidr` gives IPv6-only pods, bridged and routed: one
/// address each, its gateway and routes in the result, pods and node reach
/// each other, CHECK and a restart keep them, a host IP of the family the
/// pod lacks is refused, and GC frees them with their routes.
#[test]
fn ipv6_only_pods_have_one_ipv6_address_in_both_modes() {
    for (mode, cidr, prefix) in [("bridge", "fd00:218::/64", 64), ("routed", "fd00:219::/64", 128)] {
        let args = ["--pod-attachment", mode];
        let Some(mut n) = Node::start_with(&format!("v6{mode}"), cidr, &args, &[]) else { return };
        let gateway = cidr.replace("::/64", "::1");
        let weft = Weft::new(&n.ns, &n.agent.socket);
        let (p1, p2) = (Netns::new("pod"), Netns::new("pod"));
        let (c1, c2) = (Container::new(format!("{mode}61"), &p1), Container::new(format!("{mode}62"), &p2));
        let r1 = weft.add(&c1).assert_ok().json();
        let r2 = weft.add(&c2).assert_ok().json();
        let (a1, a2) = (cni::pod_ip(&r1), cni::pod_ip(&r2));
        assert_eq!(r1["ips"].as_array().map(Vec::len), Some(1), "{mode}: {r1}");
        assert_eq!(r1["ips"][0]["address"], format!("{a1}/{prefix}"), "{mode}: {r1}");
        assert_eq!((r1["ips"][0]["gateway"].as_str(), r1["ips"][0]["interface"].as_u64()), (Some(&*gateway), Some(1)));
        let routes = cni::routes(&r1);
        let want_routes = match mode {
            "routed" => vec![format!("{gateway}/128 "), format!("::/0 {gateway}")],
            _ => vec![format!("::/0 {gateway}")],
        };
        assert_eq!(routes, want_routes, "{mode}");
        assert!(p1.ip(&["-4", "-o", "addr", "show", "eth0"]).trim().is_empty(), "{mode}: no IPv4 address");
        assert!(p1.ip(&["-6", "-o", "addr", "show", "eth0", "scope", "global"]).contains(&format!("{a1}/{prefix}")));
        assert!(n.ns.ip(&["-6", "-o", "addr", "show", "weft0"]).contains(&format!("{gateway}/64")), "{mode}");
        assert!(p1.ping(&a2) && p2.ping(&a1), "{mode}: IPv6-only pods cannot reach each other");
        assert!(n.ns.ping(&a1) && p1.ping(&gateway), "{mode}: pod and node cannot reach each other");
        weft.check(&c1, &r1).assert_ok();
        let ready = weft.status();
        assert!(ready.success, "{mode}: STATUS: {}", ready.stdout);

        // A host port on an IPv4 host IP has nowhere to go.
        let mut conf = weft.conf.clone();
        conf["runtimeConfig"] = json!({"portMappings": [{"hostPort": 20080, "containerPort": 80, "protocol": "tcp", "hostIP": "192.0.2.1"}]});
        let p3 = Netns::new("pod");
        let c3 = Container::new(format!("{mode}63"), &p3);
        let refused = cni::exec(&n.ns, &bins::weft("weft-cni"), "ADD", &c3, &conf);
        assert!(refused.msg().contains("hostIP 192.0.2.1 is an IPv4 address, and this pod has no IPv4"), "{mode}");
        assert_eq!(n.agent.ipam_records().len(), 2, "{mode}: the refused ADD took no address");

        // A restarted agent keeps and verifies them.
        n.agent.kill9();
        n.agent.restart(&n.ns);
        weft.check(&c1, &r1).assert_ok();
        weft.check(&c2, &r2).assert_ok();

        weft.gc(&[&c2]).assert_ok();
        assert_eq!(n.agent.ipam_records().len(), 1, "{mode}");
        assert!(p2.ping(&gateway), "{mode}: the kept pod lost connectivity");
        weft.gc(&[]).assert_ok();
        assert!(veths(&n.ns).is_empty() && n.agent.ipam_records().is_empty(), "{mode}: {:?}", veths(&n.ns));
        let routes = n.ns.ip(&["-6", "route"]);
        assert!(!routes.contains(&format!("{a1} ")) && !routes.contains(&format!("{a2} ")), "{mode}: {routes}");
    }
}

/// Four pods, GC keeping two, a stray veth removed; then GC keeping one
/// under the older draft key. `gateway`: the pods' IPv4 gateway. Returns
/// the pods' namespaces (the one kept lives as long as they do).
fn gc_keeps_valid_attachments(n: &Node, gateway: &str) -> Vec<Netns> {
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pods: Vec<Netns> = (0..4).map(|_| Netns::new("pod")).collect();
    let cs: Vec<Container> = pods.iter().enumerate().map(|(i, p)| Container::new(format!("gc{i}"), p)).collect();
    for c in &cs {
        weft.add(c).assert_ok();
    }
    // A veth that no allocation accounts for (e.g. left by a crashed runtime).
    n.ns.ip(&["link", "add", "weftv0000000bad", "type", "veth", "peer", "name", "strayp"]);
    weft.gc(&[&cs[0], &cs[2]]).assert_ok();
    let mut left = veths(&n.ns);
    left.sort();
    assert_eq!(left.len(), 2, "{left:?}");
    assert_eq!(n.agent.ipam_records().len(), 2);
    assert!(pods[0].ping(gateway) && pods[2].ping(gateway), "valid pods lost connectivity");
    assert!(!pods[1].links().contains(&"eth0".to_owned()));
    // The older draft key works too.
    let mut conf = weft.conf.clone();
    conf["cni.dev/attachments"] = json!([{"containerID": cs[0].id, "ifname": "eth0"}]);
    cni::exec_raw(&n.ns, &weft.plugin, &[("CNI_COMMAND", "GC")], conf.to_string().as_bytes()).assert_ok();
    assert_eq!(n.agent.ipam_records().len(), 1);
    pods
}

#[test]
fn agent_down_fails_fast_with_try_again_and_status_50() {
    let Some(mut n) = node("down", "10.203.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    weft.status().assert_ok();
    n.agent.stop();
    let status = weft.status();
    assert_eq!(status.code(), 50, "{}", status.stdout);
    let pod = Netns::new("pod");
    let c = Container::new("down1", &pod);
    let add = weft.add(&c);
    assert_eq!(add.code(), 11);
    assert!(add.msg().contains("weft-agent"), "{}", add.msg());
    // Bounded: the connect timeout is 2 s; far below any runtime's own timeout.
    assert!(add.elapsed < Duration::from_secs(10), "ADD hung for {:?}", add.elapsed);
    assert_eq!(weft.del(&c, None).code(), 11);
    assert_eq!(weft.check(&c, &json!({"ips": []})).code(), 11);

    // A socket file with nobody listening behaves the same.
    std::os::unix::net::UnixListener::bind(&n.agent.socket).map(drop).expect("stale socket");
    assert_eq!(weft.status().code(), 50);
    assert_eq!(weft.add(&c).code(), 11);
}

#[test]
fn chained_with_reference_portmap() {
    let Some(n) = node("chain", "10.204.0.0/24") else { return };
    if !prereq::require("reference portmap plugin", bins::reference("portmap").exists())
        || !prereq::require("iptables", which("iptables"))
    {
        return;
    }
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    let c = Container::new("chain1", &pod);
    let portmap = bins::reference("portmap");
    let portmap_conf = |prev: &Value| {
        json!({
            "cniVersion": "1.0.0", "name": "weft", "type": "portmap",
            "capabilities": {"portMappings": true},
            "runtimeConfig": {"portMappings": [{"hostPort": 18080, "containerPort": 80, "protocol": "tcp"}]},
            "prevResult": prev,
        })
    };
    let mut conf = weft.conf.clone();
    conf["cniVersion"] = json!("1.0.0");
    let weft_result = cni::exec(&n.ns, &weft.plugin, "ADD", &c, &conf).assert_ok().json();
    let chained = cni::exec(&n.ns, &portmap, "ADD", &c, &portmap_conf(&weft_result)).assert_ok().json();
    // prevResult flowed through portmap unchanged.
    assert_eq!(chained["ips"], weft_result["ips"]);
    assert_eq!(chained["interfaces"], weft_result["interfaces"]);
    let nat = String::from_utf8_lossy(&n.ns.exec("iptables", &["-t", "nat", "-S"]).stdout).into_owned();
    assert!(nat.contains("18080") && nat.contains(&cni::pod_ip(&weft_result)), "portmap rules missing:\n{nat}");
    // CHECK down the chain: weft with the chained result as prevResult.
    cni::exec(&n.ns, &weft.plugin, "CHECK", &c, &cni::with_prev(&conf, Some(&chained))).assert_ok();
    // DEL in reverse order.
    cni::exec(&n.ns, &portmap, "DEL", &c, &portmap_conf(&chained)).assert_ok();
    cni::exec(&n.ns, &weft.plugin, "DEL", &c, &cni::with_prev(&conf, Some(&chained))).assert_ok();
    assert!(veths(&n.ns).is_empty());
}

#[test]
fn hundred_concurrent_adds_then_dels() {
    let Some(n) = node("burst", "10.205.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pods: Vec<Netns> = (0..100).map(|_| Netns::new("p")).collect();
    let cs: Vec<Container> = pods.iter().enumerate().map(|(i, p)| Container::new(format!("burst{i}"), p)).collect();
    let results: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = cs.iter().map(|c| s.spawn(|| weft.add(c))).collect();
        handles.into_iter().map(|h| h.join().expect("ADD thread").assert_ok().json()).collect()
    });
    let ips: Vec<String> = results.iter().map(cni::pod_ip).collect();
    assert_eq!(ips.iter().collect::<HashSet<_>>().len(), 100, "duplicate addresses: {ips:?}");
    assert_eq!(n.agent.ipam_records().len(), 100);
    assert_eq!(veths(&n.ns).len(), 100);
    // Every pod reaches the gateway and its neighbour (a ring covers every pod both ways).
    std::thread::scope(|s| {
        for (i, pod) in pods.iter().enumerate() {
            let next = &ips[(i + 1) % ips.len()];
            s.spawn(move || {
                assert!(pod.ping("10.205.0.1"), "pod {i} cannot reach the gateway");
                assert!(pod.ping(next), "pod {i} cannot reach {next}");
            });
        }
    });
    std::thread::scope(|s| {
        for c in &cs {
            let weft = &weft;
            s.spawn(move || weft.del(c, None).assert_ok().success);
        }
    });
    assert!(veths(&n.ns).is_empty(), "veths left: {:?}", veths(&n.ns));
    assert!(n.agent.ipam_records().is_empty(), "allocations left: {:?}", n.agent.ipam_records());
}

#[test]
fn kill9_during_add_burst_leaks_nothing() {
    let Some(mut n) = node("crash", "10.206.0.0/24") else { return };
    kill9_during_add_burst(&mut n);
}

/// The same with routed dual-stack pods: afterwards no /32 or /128 route
/// to a pod is left on the node.
#[test]
fn kill9_during_a_routed_dual_stack_add_burst_leaks_nothing() {
    let args = ["--pod-attachment", "routed", "--pod-ipv6-cidr", "fd00:206::/64"];
    let Some(mut n) = Node::start_with("crash6", "10.218.0.0/24", &args, &[]) else { return };
    kill9_during_add_burst(&mut n);
    let leftover: Vec<String> = [n.ns.ip(&["-4", "route"]), n.ns.ip(&["-6", "route"])]
        .iter()
        .flat_map(|r| {
            r.lines().filter(|l| l.starts_with("10.218.0.") || l.starts_with("fd00:206::")).map(str::to_owned)
        })
        .filter(|l| !l.contains("/64") && !l.contains("/24"))
        .collect();
    assert!(leftover.is_empty(), "routes to pods left behind: {leftover:?}");
}

/// 60 concurrent ADDs, the agent killed with SIGKILL in the middle, a
/// restart, retries and DELs: nothing leaks.
fn kill9_during_add_burst(n: &mut Node) {
    let pods: Vec<Netns> = (0..60).map(|_| Netns::new("p")).collect();
    let cs: Vec<Container> = pods.iter().enumerate().map(|(i, p)| Container::new(format!("crash{i}"), p)).collect();
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let state_dir = n.agent.state_dir.clone();
    let outcomes: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = cs.iter().map(|c| s.spawn(|| weft.add(c).success)).collect();
        // Kill the agent once part of the burst has reached IPAM.
        wait::until("ten allocations", Duration::from_secs(60), || {
            let records =
                |d: std::fs::ReadDir| d.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count();
            let n = std::fs::read_dir(state_dir.join("ipam")).map(records).unwrap_or(0);
            (n >= 10).then_some(())
        });
        n.agent.kill9();
        handles.into_iter().map(|h| h.join().expect("ADD thread")).collect()
    });
    let failed = outcomes.iter().filter(|ok| !**ok).count();
    assert!(failed > 0, "the kill came too late to interrupt anything");
    n.agent.restart(&n.ns);

    // After start-up reconciliation: one record per veth and vice versa, and
    // every address on a pod's interface has its record. (An interface whose
    // ADD was cut short may lack its address: it is kept, and the runtime's
    // DEL below removes it.)
    let records = n.agent.ipam_records();
    let vs = veths(&n.ns);
    assert_eq!(records.len(), vs.len(), "records {records:?} vs veths {vs:?}");
    for (pod, ok) in pods.iter().zip(&outcomes) {
        let has_eth0 = pod.links().contains(&"eth0".to_owned());
        if *ok {
            assert!(has_eth0, "a pod whose ADD succeeded lost its interface");
        }
        if has_eth0 {
            let addr = pod.ip(&["-o", "-4", "addr", "show", "eth0"]);
            if let Some(ip) = addr.split_whitespace().nth(3).and_then(|a| a.split('/').next()) {
                assert!(records.contains(&ip.to_owned()), "pod has {ip} but no record");
            } else {
                assert!(!ok, "a pod whose ADD succeeded has no address");
            }
        }
    }
    // The runtime retries what failed; then DEL everything: nothing left.
    for (c, ok) in cs.iter().zip(&outcomes) {
        if !ok {
            weft.del(c, None).assert_ok();
            weft.add(c).assert_ok();
        }
    }
    assert_eq!(n.agent.ipam_records().len(), 60);
    for c in &cs {
        weft.del(c, None).assert_ok();
    }
    assert!(veths(&n.ns).is_empty());
    assert!(n.agent.ipam_records().is_empty());
}

#[test]
fn exhausted_pool_gives_a_clear_error_and_status_51() {
    let Some(n) = node("full", "10.207.0.0/29") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pods: Vec<Netns> = (0..6).map(|_| Netns::new("p")).collect();
    for (i, p) in pods.iter().take(5).enumerate() {
        weft.add(&Container::new(format!("full{i}"), p)).assert_ok();
    }
    let full = weft.add(&Container::new("full5", &pods[5]));
    assert_eq!(full.code(), 102);
    assert!(full.msg().contains("no free address left in pod CIDR 10.207.0.0/29"), "{}", full.msg());
    assert!(!pods[5].links().contains(&"eth0".to_owned()), "a failed ADD left an interface");
    assert_eq!(weft.status().code(), 51);
}

#[test]
fn add_with_missing_netns_allocates_nothing() {
    let Some(n) = node("nons", "10.208.0.0/24") else { return };
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let c =
        Container { id: "nons1".into(), netns: Some("/run/netns/weft-does-not-exist".into()), ifname: "eth0".into() };
    let out = weft.add(&c);
    assert_eq!(out.code(), 4);
    assert!(out.msg().contains("/run/netns/weft-does-not-exist"), "{}", out.msg());
    assert!(n.agent.ipam_records().is_empty());
}

#[test]
fn agent_metrics_count_requests() {
    let Some(n) = node("metrics", "10.209.0.0/24") else { return };
    if !prereq::require("curl", which("curl")) {
        return;
    }
    let weft = Weft::new(&n.ns, &n.agent.socket);
    let pod = Netns::new("pod");
    weft.add(&Container::new("m1", &pod)).assert_ok();
    let body =
        String::from_utf8_lossy(&n.ns.exec("curl", &["-sf", "http://127.0.0.1:9646/metrics"]).stdout).into_owned();
    assert!(body.contains(r#"weft_agent_cni_requests_total{verb="ADD",result="success"} 1"#), "{body}");
    assert!(body.contains(r#"weft_agent_ipam_addresses{state="allocated"} 1"#), "{body}");
    assert!(body.contains("weft_agent_cni_request_duration_seconds_bucket"), "{body}");
    let ready = n.ns.exec("curl", &["-sf", "http://127.0.0.1:9646/readyz"]);
    assert!(ready.status.success());
}
