//! Weft IPv6-only on real nodes: kubelets with their IPv6 node address
//! alone, an IPv6 Service range (the `kubernetes` Service too), kube-proxy on
//! IPv6, Weft installed by its chart with `network.clusterCIDR=null` and
//! `network.ipv6ClusterCIDR`. Each node leases one IPv6 block and tunnels
//! VXLAN from its IPv6 node address; pods get one IPv6 address (their
//! status lists it alone), reach each other across nodes (TCP and UDP), a
//! Service through kube-proxy reaches its pod, a spec `hostPort` answers on
//! the node's address, and NetworkPolicy decides IPv6 traffic, also against
//! a hostile pod (`weft_e2e::cluster::hostile`).

use std::time::Duration;

use weft_e2e::cluster::testing::{Cluster, apply, eventually, kubectl_ok, node_exec};
use weft_e2e::cluster::workloads::{HTTP_PORT, TestPod, assert_tcp_and_udp, http_hostname, namespace, pod_ips};

const CLUSTER_CIDR6: &str = "fd00:10:244::/56";
const HOST_PORT: u16 = 18091;

#[test]
fn ipv6_only_pods_services_and_host_ports_on_real_nodes() {
    let v4 = "network.clusterCIDR=null";
    let v6 = format!("network.ipv6ClusterCIDR={CLUSTER_CIDR6}");
    let Some(cluster) = Cluster::shared(&["--backend", "vxlan", "--set", v4, "--set", &v6]) else { return };
    let v6_of = |name: &str| {
        let node = cluster.state.nodes.iter().find(|n| n.name == name).unwrap_or_else(|| panic!("no {name}"));
        weft_e2e::sandbox::node_ipv6(node.ip).to_string()
    };
    let node2_v6 = v6_of("node-2");

    // The node reports its IPv6 address alone; its Subnet is one IPv6
    // block, and its agent publishes that address and tunnels from it.
    let internal =
        kubectl_ok(&["get", "node", "node-2", "-o", "jsonpath={.status.addresses[?(@.type=='InternalIP')].address}"]);
    assert_eq!(internal.trim(), node2_v6);
    let subnet = kubectl_ok(&[
        "get",
        "subnet",
        "node-2",
        "-o",
        "jsonpath={.spec.cidr} {.status.nodeIP} {.status.vxlanUnderlay}",
    ]);
    let fields: Vec<&str> = subnet.split_whitespace().collect();
    let block: ipnet::Ipv6Net = fields[0].parse().unwrap_or_else(|_| panic!("not an IPv6 block: {subnet}"));
    assert!(CLUSTER_CIDR6.parse::<ipnet::Ipv6Net>().expect("cidr").contains(&block), "{subnet}");
    assert_eq!(fields[1..], [node2_v6.as_str(), "ipv6"], "{subnet}");
    let (_, device) = node_exec("node-1", &["ip", "-d", "link", "show", "weft.1"]);
    assert!(device.contains(&format!("local {}", v6_of("node-1"))), "{device}");

    let ns = "weft-ipv6-only";
    namespace(ns, &[]);
    let pod = |name, node, host_port| TestPod { namespace: ns, name, node, host_port, ..Default::default() };
    pod("a", "node-1", None).run();
    pod("c", "node-2", Some(HOST_PORT)).run();
    kubectl_ok(&["label", "pod", "-n", ns, "c", "app=c"]);
    let (a, c) = (pod_ips(ns, "a"), pod_ips(ns, "c"));
    assert_eq!(c.len(), 1, "one address: {c:?}");
    let c6: std::net::Ipv6Addr = c[0].parse().unwrap_or_else(|_| panic!("not IPv6: {c:?}"));
    assert!(block.contains(&c6), "{c6} outside node-2's block {block}");

    // Across nodes, both ways, TCP and UDP.
    for (from, to, target) in [("a", "c", &c[0]), ("c", "a", &a[0])] {
        assert_tcp_and_udp(ns, from, target, to);
    }

    // A Service through kube-proxy: IPv6, the cluster's only family.
    apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: c, namespace: {ns}}}\n\
         spec:\n  selector: {{app: c}}\n  ports: [{{port: 80, targetPort: {HTTP_PORT}}}]\n"
    ));
    let service_ip = kubectl_ok(&["get", "svc", "-n", ns, "c", "-o", "jsonpath={.spec.clusterIP}"]);
    let service_ip = service_ip.trim();
    assert!(service_ip.starts_with("fd00:96::"), "an IPv6 cluster IP: {service_ip}");
    let answer = eventually("the Service to answer", Duration::from_secs(60), || {
        http_hostname(ns, "a", &format!("[{service_ip}]:80"))
    });
    assert_eq!(answer, "c");

    // c's spec hostPort on node-2's address, from a pod on node-1.
    let answer = eventually("the host port on node-2's address", Duration::from_secs(60), || {
        http_hostname(ns, "a", &format!("[{node2_v6}]:{HOST_PORT}"))
    });
    assert_eq!(answer, "c");

    // Policy: c admits role=client pods only, then only a's /128.
    let reaches = || http_hostname(ns, "a", &format!("[{}]:{HTTP_PORT}", c[0])).is_some();
    let expect = |want: bool, what: &str| {
        eventually(what, Duration::from_secs(60), || (reaches() == want).then_some(()));
    };
    let policy = |from: &str| {
        apply(&format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: c-ingress, namespace: {ns}}}\n\
             spec:\n  podSelector: {{matchLabels: {{app: c}}}}\n  ingress: [{{from: [{from}]}}]\n"
        ))
    };
    policy("{podSelector: {matchLabels: {role: client}}}");
    expect(false, "a (no role) refused by c");
    kubectl_ok(&["label", "pod", "-n", ns, "a", "role=client"]);
    expect(true, "a (role=client) admitted by c");
    policy(&format!("{{ipBlock: {{cidr: '{}/128'}}}}", a[0]));
    expect(true, "c admitting a's /128");
    policy("{ipBlock: {cidr: '10.0.0.0/8'}}");
    expect(false, "an IPv4 block never matches a");
    kubectl_ok(&["delete", "networkpolicy", "-n", ns, "c-ingress"]);
    expect(true, "no policy: a reaches c");

    // The hostile pod's attacks, over IPv6 only.
    weft_e2e::cluster::hostile::attacks_fail("weft-hostile");
}
