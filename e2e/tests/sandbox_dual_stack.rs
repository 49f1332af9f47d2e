//! A dual-stack node (the operator given an IPv6 cluster CIDR besides the
//! IPv4 one): the Subnet leases a block of each family, every bridged pod
//! gets an address of each on its interface with both default routes, the
//! ADD result lists both, and policy decides IPv6 traffic as it decides
//! IPv4 traffic (the same probe matrices over both families), while an
//! `ipBlock` only ever matches addresses of its own family. Host ports
//! answer on the node's IPv6 address too. A VM runtime's pod (TC redirect
//! to a guest) gets both families from the result. Two nodes, bridged pods
//! on the VXLAN backend and routed pods on host-gw (IPv6 blocks routed to
//! the nodes' IPv6 addresses): prod/db is on the other node than the rest, so every matrix
//! crosses between nodes over IPv6 too.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{
    Up, apply, assert_overlay_converged, assert_reaches, db_ingress_policy, expect_matrix, host_port_addresses,
    kubectl, ns_of, ok, weft_deny_to_web,
};

const IPV6_CLUSTER_CIDR: &str = "fd00:10:244::/56";
const PODS: [&str; 3] = ["dev/client", "prod/db", "prod/web"];

/// Each pod's node.
fn node_of(pod: &str) -> &'static str {
    if pod == "prod/db" { "node-2" } else { "node-1" }
}

/// A node's IPv6 block, from its Subnet.
fn block6_of(node: &str) -> ipnet::Ipv6Net {
    let subnet: Value = serde_json::from_str(&kubectl(&["get", "subnet", node, "-o", "json"])).expect("JSON");
    let cidrs: Vec<&str> =
        subnet["spec"]["cidrs"].as_array().expect("cidrs").iter().filter_map(Value::as_str).collect();
    assert_eq!(cidrs.len(), 2, "{subnet}");
    assert_eq!(cidrs[0], subnet["spec"]["cidr"].as_str().expect("cidr"));
    cidrs[1].parse().expect("an IPv6 block")
}
const CONVERGE: Duration = Duration::from_secs(60);

fn ip_json(netns: &str, args: &[&str]) -> Value {
    let out = Command::new("ip").args(["-j", "-n", netns]).args(args).output().expect("ip");
    assert!(out.status.success(), "ip -n {netns} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("ip JSON")
}

/// (IPv4, IPv6) of a pod, from `weft-sandbox pods`.
fn pod_ips(key: &str) -> (String, String) {
    let pods = ok(&["pods"]);
    let line = pods.lines().find(|l| l.starts_with(&format!("{key} "))).unwrap_or_else(|| panic!("no {key}"));
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[2].to_owned(), fields[3].to_owned())
}

/// Waits until the probe matrix of [`PODS`] over `family` equals `expect(from, to)`.
#[track_caller]
fn expect_family(step: &str, family: &str, protocol: &str, port: u16, expect: &dyn Fn(&str, &str) -> bool) {
    expect_matrix(&PODS, (step, family, protocol, port), CONVERGE, expect);
}

/// The same expectation over both families.
#[track_caller]
fn expect_both(step: &str, protocol: &str, port: u16, expect: impl Fn(&str, &str) -> bool) {
    for family in ["ipv4", "ipv6"] {
        expect_family(step, family, protocol, port, &expect);
    }
}

#[test]
fn dual_stack_over_vxlan() {
    dual_stack_pods_get_both_families_and_policy_treats_them_alike("vxlan");
}

/// Routed pods (a /128 besides the /32) over host-gw. (Bridged pods over
/// host-gw are not run again here: bridged pods are the VXLAN run's, and
/// host-gw's IPv6 routes to the peers' node addresses are this run's; the
/// kernel test `ipv6_blocks_are_routed_over_host_gw_to_the_peers_ipv6_address`
/// has bridged pods on host-gw. It keeps CI within its hour.)
#[test]
fn dual_stack_routed_over_host_gw() {
    dual_stack_pods_get_both_families_and_policy_treats_them_alike("host-gw+routed");
}

/// `backend`: `vxlan`, `host-gw`, or `host-gw+routed` (routed pods).
fn dual_stack_pods_get_both_families_and_policy_treats_them_alike(backend: &str) {
    let secondary = format!("--operator-arg=--secondary-cluster-cidr={IPV6_CLUSTER_CIDR}");
    let agents = format!("--agent-arg=--ipv6-cluster-cidr={IPV6_CLUSTER_CIDR}");
    let (backend, routed) = match backend.strip_suffix("+routed") {
        Some(b) => (b, true),
        None => (backend, false),
    };
    let mut args = vec!["--nodes", "2", "--backend", backend, &secondary, &agents];
    if routed {
        args.push("--agent-arg=--pod-attachment=routed");
    }
    let Some(_up) = Up::start(&args, &[]) else { return };

    // The leases: one block of each family per node.
    let block6 = block6_of(node_of("prod/db"));
    assert!(IPV6_CLUSTER_CIDR.parse::<ipnet::Ipv6Net>().expect("cidr").contains(&block6), "{block6}");
    assert_ne!(block6_of("node-1"), block6);

    kubectl(&["create", "namespace", "prod"]);
    kubectl(&["create", "namespace", "dev"]);
    kubectl(&["label", "namespace", "dev", "team=b"]);
    for key in PODS {
        let (ns, name) = key.split_once('/').expect("key");
        let label = format!("app={name}");
        let node = node_of(key);
        ok(&["add-pod", name, "-n", ns, "--node", node, "-l", &label, "-p", "80/tcp", "-p", "dns=53/udp"]);
    }

    // Addresses: the IPv6 one has the IPv4 one's host number, both are on
    // eth0 with a default route each, and the Pod's status lists both.
    let (v4, v6) = pod_ips("prod/db");
    let v6: std::net::Ipv6Addr = v6.parse().unwrap_or_else(|_| panic!("prod/db has no IPv6 address: {v6}"));
    assert!(block6.contains(&v6), "{v6} outside {block6}");
    let host4 = v4.parse::<std::net::Ipv4Addr>().expect("IPv4").octets()[3];
    assert_eq!(u128::from(v6) & 0xff, u128::from(host4), "{v4} and {v6}");
    let netns = "weft-sbx-pod-prod-db";
    let addrs = ip_json(netns, &["-6", "addr", "show", "eth0", "scope", "global"]);
    // (`ip -j` lists the entries its filter left out as `{}`.)
    let on_eth0: Vec<&Value> =
        addrs[0]["addr_info"].as_array().expect("addr_info").iter().filter(|a| a.get("local").is_some()).collect();
    assert_eq!(on_eth0.len(), 1, "{addrs}");
    assert_eq!(on_eth0[0]["local"], v6.to_string());
    assert_eq!(on_eth0[0]["prefixlen"], if routed { 128 } else { 64 }, "{addrs}");
    assert!(on_eth0[0].get("tentative").is_none(), "no duplicate address detection: {addrs}");
    let routes = ip_json(netns, &["-6", "route", "show", "default"]);
    let gateway6 = std::net::Ipv6Addr::from(u128::from(block6.network()) | 1);
    assert_eq!(routes[0]["gateway"], gateway6.to_string(), "{routes}");
    let bridge = ip_json("weft-sbx-node-2", &["-6", "addr", "show", "weft0", "scope", "global"]);
    assert_eq!(bridge[0]["addr_info"][0]["local"], gateway6.to_string(), "the gateway on the bridge: {bridge}");
    let pod: Value = serde_json::from_str(&kubectl(&["get", "pod", "db", "-n", "prod", "-o", "json"])).expect("JSON");
    let listed: Vec<&str> =
        pod["status"]["podIPs"].as_array().expect("podIPs").iter().filter_map(|p| p["ip"].as_str()).collect();
    assert_eq!(listed, [v4.as_str(), v6.to_string().as_str()]);

    // The sandbox has no routable IPv6 (unique local blocks, no IPv6
    // default route): IPv6 traffic leaving the cluster is masqueraded, and
    // pod-to-pod IPv6 keeps its source.
    let nat = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-node-2", "nft", "list", "chain", "inet", "weft", "masquerade-postrouting"])
        .output()
        .expect("nft");
    let nat = String::from_utf8_lossy(&nat.stdout);
    let kept = format!("ip6 saddr {block6} ip6 daddr {IPV6_CLUSTER_CIDR}");
    assert!(nat.contains(&kept), "{nat}");
    assert!(nat.contains(&format!("ip6 saddr {block6} counter name \"masquerade-masqueraded\" masquerade")), "{nat}");

    // Each node publishes its IPv6 address; host-gw routes the other
    // node's IPv6 block to it.
    let node2_v6 = weft_e2e::sandbox::node_ipv6(weft_e2e::sandbox::node_ip(2));
    let subnet: Value = serde_json::from_str(&kubectl(&["get", "subnet", "node-2", "-o", "json"])).expect("JSON");
    assert_eq!(subnet["status"]["nodeIPv6"], node2_v6.to_string(), "{subnet}");
    let routes = ip_json("weft-sbx-node-1", &["-6", "route", "show", &block6.to_string()]);
    let want = if backend == "host-gw" { node2_v6.to_string() } else { block6.network().to_string() };
    assert_eq!(routes[0]["gateway"], want, "{routes}");

    // The overlay converged: no pass fought the kernel over an entry (an
    // IPv6 route whose metric differed from the kernel's was deleted and
    // re-added every few milliseconds, and traffic saw "no route").
    assert_overlay_converged(&["node-1", "node-2"]);

    // No policy: everything is open, over both families.
    expect_both("default allow", "tcp", 80, |_, _| true);
    expect_both("default allow", "udp", 53, |_, _| true);

    // Host ports answer on the node's IPv6 address too: from the other
    // node, the pod's own node, a pod on each node and the pod itself
    // (hairpin), and the allocation lists both node addresses.
    ok(&[
        "add-pod",
        "hp",
        "--node",
        "node-1",
        "-p",
        "http=8080/tcp",
        "-p",
        "dns=53/udp",
        "-a",
        "weft.dev/host-ports=http, dns",
    ]);
    let node1_v6 = weft_e2e::sandbox::node_ipv6(weft_e2e::sandbox::node_ip(1));
    let listed = host_port_addresses("hp", 2, CONVERGE);
    let at = |proto: &str| {
        let suffix = format!("/{proto}");
        let v6: Vec<&String> =
            listed.iter().filter(|a| a.starts_with(&format!("[{node1_v6}]:")) && a.ends_with(&suffix)).collect();
        assert_eq!(v6.len(), 1, "{listed:?}");
        v6[0].trim_end_matches(&suffix).to_owned()
    };
    let (http6, dns6) = (at("TCP"), at("UDP"));
    for from in ["node-2", "node-1", "dev/client", "prod/db", "default/hp"] {
        for (protocol, target) in [("tcp", &http6), ("udp", &dns6)] {
            assert_reaches(from, protocol, target, "default/hp", CONVERGE);
        }
    }
    ok(&["del-pod", "hp"]);

    // A VM runtime's pod (Kata's tcfilter mode, `add-pod --vm`) takes both
    // addresses and both default routes from the result alone, and talks
    // IPv6 through the TC redirect, on its node and across; its host port
    // answers on the node's IPv6 address.
    kubectl(&["label", "namespace", "dev", "weft.dev/host-ports=allowed"]);
    ok(&["add-pod", "vm", "-n", "dev", "--node", "node-1", "--vm", "-p", "80/tcp", "-a", "weft.dev/host-ports=80"]);
    let vm_port6 =
        host_port_addresses("vm", 2, CONVERGE).into_iter().find(|a| a.starts_with('[')).expect("an IPv6 address");
    let vm_port6 = vm_port6.trim_end_matches("/TCP").to_owned();
    assert_reaches("node-2", "tcp", &vm_port6, "dev/vm", CONVERGE);
    let (_, vm6) = pod_ips("dev/vm");
    let guest = ip_json("weft-sbx-vm-dev-vm", &["-6", "addr", "show", "eth0", "scope", "global"]);
    assert_eq!(guest[0]["addr_info"][0]["local"], vm6, "the guest holds the IPv6 address: {guest}");
    let (_, db6) = pod_ips("prod/db");
    let (_, web6) = pod_ips("prod/web");
    for (from, target, want) in [
        ("dev/vm", format!("[{db6}]:80"), "prod/db"),
        ("dev/vm", format!("[{web6}]:80"), "prod/web"),
        ("prod/db", format!("[{vm6}]:80"), "dev/vm"),
    ] {
        assert_reaches(from, "tcp", &target, want, CONVERGE);
    }
    ok(&["del-pod", "vm", "-n", "dev"]);

    // Pod and namespace selectors admit every address of the pods they select.
    apply(&db_ingress_policy("{namespaceSelector: {matchLabels: {team: b}}}"));
    expect_both("namespaceSelector", "tcp", 80, |from, to| to != "prod/db" || ns_of(from) == "dev");
    expect_both("a TCP-less policy isolates UDP too", "udp", 53, |from, to| to != "prod/db" || ns_of(from) == "dev");

    // An IPv4 ipBlock never matches an IPv6 peer, and the other way round.
    apply(&db_ingress_policy("{ipBlock: {cidr: 0.0.0.0/0}}"));
    expect_family("0.0.0.0/0 admits every IPv4 peer", "ipv4", "tcp", 80, &|_, _| true);
    expect_family("0.0.0.0/0 admits no IPv6 peer", "ipv6", "tcp", 80, &|_, to| to != "prod/db");
    let (_, client6) = pod_ips("dev/client");
    apply(&db_ingress_policy(&format!("{{ipBlock: {{cidr: '::/0', except: ['{client6}/128']}}}}")));
    expect_family("::/0 admits no IPv4 peer", "ipv4", "tcp", 80, &|_, to| to != "prod/db");
    expect_family("::/0 except the client", "ipv6", "tcp", 80, &|from, to| to != "prod/db" || from != "dev/client");

    // Weft's own policy over IPv6: a Deny of one IPv6 address beats an Allow.
    kubectl(&["delete", "networkpolicy", "--all", "-n", "prod"]);
    apply(&weft_deny_to_web(&format!("{client6}/128")));
    expect_family("a Weft Deny of an IPv6 address", "ipv6", "tcp", 80, &|from, to| {
        to != "prod/web" || from != "dev/client"
    });
    expect_family("leaves IPv4 alone", "ipv4", "tcp", 80, &|_, _| true);
    kubectl(&["delete", "networkpolicies.weft.dev", "--all", "-n", "prod"]);
    expect_both("policies gone", "tcp", 80, |_, _| true);

    // DEL: nothing of the pods stays on the node.
    for key in PODS {
        let (ns, name) = key.split_once('/').expect("key");
        ok(&["del-pod", name, "-n", ns]);
    }
    for node in ["node-1", "node-2"] {
        let links = ip_json(&format!("weft-sbx-{node}"), &["link", "show"]);
        let links = links.as_array().expect("links");
        let veths: Vec<&str> =
            links.iter().filter_map(|l| l["ifname"].as_str()).filter(|n| n.starts_with("weftv")).collect();
        assert!(veths.is_empty(), "host veths left on {node}: {veths:?}");
    }
}
