//! An IPv6-only sandbox (`up --ipv6-only`: the operator's cluster CIDR and
//! the agents' node IPs are IPv6): each node leases one IPv6 block and
//! tunnels VXLAN from its IPv6 node IP, every pod gets one IPv6 address
//! (listed alone in the Pod's status), pods talk across nodes, policy
//! decides IPv6 traffic (selectors and `ipBlock`s, standard and Weft's own),
//! host ports answer on the node's IPv6 address, a VM runtime's pod works
//! through its TC redirect, only IPv6 is masqueraded, and DEL leaves
//! nothing behind.

use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{
    Up, apply, assert_overlay_converged, assert_reaches, db_ingress_policy, expect_matrix, host_port_addresses,
    kubectl, ns_of, ok, weft_deny_to_web,
};
use weft_e2e::sandbox::{CLUSTER_CIDR6, node_ip, node_ipv6};

const PODS: [&str; 3] = ["dev/client", "prod/db", "prod/web"];
const CONVERGE: Duration = Duration::from_secs(60);

/// Each pod's node: prod/db is alone on node-2, so every matrix crosses nodes.
fn node_of(pod: &str) -> &'static str {
    if pod == "prod/db" { "node-2" } else { "node-1" }
}

/// A pod's one address (the IPv6 column stays empty), from `weft-sandbox pods`.
fn pod_ip(key: &str) -> String {
    let pods = ok(&["pods"]);
    let line = pods.lines().find(|l| l.starts_with(&format!("{key} "))).unwrap_or_else(|| panic!("no {key}"));
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields[3], "-", "one address only: {line}");
    fields[2].to_owned()
}

/// The TCP/80 probe matrix of [`PODS`] over `family` converges to `expect`.
#[track_caller]
fn expect(step: &str, family: &str, expect: &dyn Fn(&str, &str) -> bool) {
    expect_matrix(&PODS, (step, family, "tcp", 80), CONVERGE, expect);
}

fn netns_sh(netns: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("ip").args(["netns", "exec", netns]).args(args).output().expect("ip netns");
    assert!(out.status.success(), "{args:?} in {netns}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn ipv6_only_pods_across_nodes_over_vxlan() {
    let Some(_up) = Up::start(&["--nodes", "2", "--backend", "vxlan", "--ipv6-only"], &[]) else { return };

    // The leases and what each agent publishes: IPv6 alone.
    let cluster: ipnet::Ipv6Net = CLUSTER_CIDR6.parse().expect("cluster CIDR");
    let mut blocks = Vec::new();
    for (i, node) in ["node-1", "node-2"].iter().enumerate() {
        let subnet: Value = serde_json::from_str(&kubectl(&["get", "subnet", node, "-o", "json"])).expect("JSON");
        let cidr = subnet["spec"]["cidr"].as_str().expect("cidr");
        let block: ipnet::Ipv6Net = cidr.parse().unwrap_or_else(|_| panic!("{node} leases {cidr}, not IPv6"));
        assert!(cluster.contains(&block) && block.prefix_len() == 64, "{subnet}");
        let cidrs: Vec<&str> =
            subnet["spec"]["cidrs"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        assert!(cidrs.iter().all(|c| *c == cidr), "one block: {subnet}");
        let node_ip6 = node_ipv6(node_ip(i + 1)).to_string();
        let status = &subnet["status"];
        assert_eq!((status["nodeIP"].as_str(), status["vxlanUnderlay"].as_str()), (Some(&*node_ip6), Some("ipv6")));
        blocks.push(block);
    }
    let device = netns_sh("weft-sbx-node-1", &["ip", "-d", "link", "show", "weft.1"]);
    assert!(device.contains(&format!("local {}", node_ipv6(node_ip(1)))), "{device}");

    kubectl(&["create", "namespace", "prod"]);
    kubectl(&["create", "namespace", "dev"]);
    kubectl(&["label", "namespace", "dev", "team=b"]);
    for key in PODS {
        let (ns, name) = key.split_once('/').expect("key");
        let label = format!("app={name}");
        ok(&["add-pod", name, "-n", ns, "--node", node_of(key), "-l", &label, "-p", "80/tcp"]);
    }
    let db: std::net::Ipv6Addr = pod_ip("prod/db").parse().expect("an IPv6 address");
    assert!(blocks[1].contains(&db), "{db} outside node-2's block {}", blocks[1]);
    let eth0 = netns_sh("weft-sbx-pod-prod-db", &["ip", "-o", "addr", "show", "eth0"]);
    assert!(!eth0.contains("inet "), "no IPv4 address: {eth0}");
    let pod: Value = serde_json::from_str(&kubectl(&["get", "pod", "db", "-n", "prod", "-o", "json"])).expect("JSON");
    let listed: Vec<&str> =
        pod["status"]["podIPs"].as_array().expect("podIPs").iter().filter_map(|p| p["ip"].as_str()).collect();
    assert_eq!(listed, [db.to_string()]);

    // Only IPv6 is masqueraded, and pod-to-pod keeps its source.
    let nat = netns_sh("weft-sbx-node-2", &["nft", "list", "chain", "inet", "weft", "masquerade-postrouting"]);
    assert!(nat.contains(&format!("ip6 saddr {} ip6 daddr {CLUSTER_CIDR6}", blocks[1])), "{nat}");
    assert!(!nat.contains("ip saddr"), "nothing IPv4: {nat}");

    expect("default allow", "ipv6", &|_, _| true);
    expect("no IPv4 anywhere", "ipv4", &|_, _| false);

    apply(&db_ingress_policy("{namespaceSelector: {matchLabels: {team: b}}}"));
    expect("namespaceSelector", "ipv6", &|from, to| to != "prod/db" || ns_of(from) == "dev");
    let client = pod_ip("dev/client");
    apply(&db_ingress_policy(&format!("{{ipBlock: {{cidr: '::/0', except: ['{client}/128']}}}}")));
    expect("::/0 except the client", "ipv6", &|from, to| to != "prod/db" || from != "dev/client");
    kubectl(&["delete", "networkpolicy", "--all", "-n", "prod"]);
    apply(&weft_deny_to_web(&format!("{client}/128")));
    expect("a Weft Deny of an IPv6 address", "ipv6", &|from, to| to != "prod/web" || from != "dev/client");
    kubectl(&["delete", "networkpolicies.weft.dev", "--all", "-n", "prod"]);
    expect("policies gone", "ipv6", &|_, _| true);

    // A host port answers on the node's IPv6 address, from the other node
    // and from a pod, and the allocation lists that address alone.
    ok(&["add-pod", "hp", "--node", "node-1", "-p", "http=8080/tcp", "-a", "weft.dev/host-ports=http"]);
    let listed = host_port_addresses("hp", 1, CONVERGE);
    assert_eq!(listed.len(), 1, "{listed:?}");
    let prefix = format!("[{}]:", node_ipv6(node_ip(1)));
    assert!(listed[0].starts_with(&prefix) && listed[0].ends_with("/TCP"), "{listed:?}");
    let target = listed[0].trim_end_matches("/TCP").to_owned();
    for from in ["node-2", "prod/db"] {
        assert_reaches(from, "tcp", &target, "default/hp", CONVERGE);
    }
    ok(&["del-pod", "hp"]);

    // A VM runtime's pod (Kata's tcfilter mode) takes its one IPv6 address
    // and routes from the result alone, and talks through the TC redirect
    // on its node and across.
    ok(&["add-pod", "vm", "-n", "dev", "--node", "node-1", "--vm", "-p", "80/tcp"]);
    let vm = pod_ip("dev/vm");
    let guest = netns_sh("weft-sbx-vm-dev-vm", &["ip", "-o", "addr", "show", "eth0", "scope", "global"]);
    assert!(guest.contains(&format!("{vm}/")) && !guest.contains("inet "), "the guest holds the address: {guest}");
    let web = pod_ip("prod/web");
    for (from, target, want) in [
        ("dev/vm", format!("[{db}]:80"), "prod/db"),
        ("dev/vm", format!("[{web}]:80"), "prod/web"),
        ("prod/db", format!("[{vm}]:80"), "dev/vm"),
    ] {
        assert_reaches(from, "tcp", &target, want, CONVERGE);
    }
    ok(&["del-pod", "vm", "-n", "dev"]);

    // The overlay converged without fighting the kernel.
    assert_overlay_converged(&["node-1", "node-2"]);

    // DEL: nothing of the pods stays on the nodes.
    for key in PODS {
        let (ns, name) = key.split_once('/').expect("key");
        ok(&["del-pod", name, "-n", ns]);
    }
    for node in ["weft-sbx-node-1", "weft-sbx-node-2"] {
        let links = netns_sh(node, &["ip", "-o", "link"]);
        assert!(!links.contains("weftv"), "a veth is left on {node}: {links}");
        let routes = netns_sh(node, &["ip", "-6", "route"]);
        assert!(!routes.contains(&format!("{db} ")), "{node}: {routes}");
    }
}
