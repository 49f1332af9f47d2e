//! Weft dual-stack on real nodes: kubelets with both node addresses, both
//! Service ranges, kube-proxy proxying both families, Weft installed by its
//! chart with `network.ipv6ClusterCIDR`. Pods get both addresses (in their
//! status, from weft-cni's result), reach each other across nodes over IPv6
//! (TCP and UDP, VXLAN), an IPv6 Service through kube-proxy reaches its pod,
//! and a spec `hostPort` answers on the node's IPv6 address. NetworkPolicy
//! decides both families alike, and an `ipBlock` matches only its own
//! family, and a hostile pod gets past it in neither
//! (`weft_e2e::cluster::hostile`). Agents here learn other nodes' pods
//! from PodEndpoints (`podEndpoints.enabled`), the label change included.
//! The VXLAN
//! tunnels run over the IPv6 underlay (`network.vxlanUnderlay=ipv6`), so
//! IPv4 pod traffic crosses inside IPv6 packets, with the 70-byte overhead
//! taken off the pods' MTU. (`sandbox_dual_stack` runs VXLAN over IPv4.)

use std::time::Duration;

use weft_e2e::cluster::testing::{Cluster, apply, eventually, kubectl_ok, node_exec, pod_exec};
use weft_e2e::cluster::workloads::{HTTP_PORT, TestPod, assert_tcp_and_udp, http_hostname, namespace, pod_ips};

const IPV6_CLUSTER_CIDR: &str = "fd00:10:244::/56";
const HOST_PORT: u16 = 18090;

#[test]
fn dual_stack_pods_services_and_host_ports_on_real_nodes() {
    let set = format!("network.ipv6ClusterCIDR={IPV6_CLUSTER_CIDR}");
    let underlay = "network.vxlanUnderlay=ipv6";
    // Agents learn other nodes' pods from the operator's PodEndpoints here
    // (the other cluster tests watch every Pod, the default).
    let args = ["--backend", "vxlan", "--set", &set, "--set", underlay, "--set", "podEndpoints.enabled=true"];
    let Some(cluster) = Cluster::shared(&args) else { return };
    let v6_of = |name: &str| {
        let node = cluster.state.nodes.iter().find(|n| n.name == name).unwrap_or_else(|| panic!("no {name}"));
        weft_e2e::sandbox::node_ipv6(node.ip).to_string()
    };
    let node2 = cluster.state.nodes.iter().find(|n| n.name == "node-2").expect("node-2");
    let node2_v6 = v6_of("node-2");

    // The tunnel: node-1's VXLAN device sends from its IPv6 address, to
    // node-2's.
    let (_, device) = node_exec("node-1", &["ip", "-d", "link", "show", "weft.1"]);
    assert!(device.contains(&format!("local {}", v6_of("node-1"))), "{device}");
    eventually("node-1's FDB entry for node-2", Duration::from_secs(60), || {
        let (_, fdb) = node_exec("node-1", &["bridge", "fdb", "show", "dev", "weft.1"]);
        fdb.contains(&format!("dst {node2_v6}")).then_some(())
    });

    // The node reports both addresses; its agent publishes the IPv6 one.
    let internal =
        kubectl_ok(&["get", "node", "node-2", "-o", "jsonpath={.status.addresses[?(@.type=='InternalIP')].address}"]);
    assert_eq!(internal.split_whitespace().collect::<Vec<_>>(), [node2.ip.to_string(), node2_v6.clone()]);
    let published =
        kubectl_ok(&["get", "subnet", "node-2", "-o", "jsonpath={.status.nodeIPv6} {.status.vxlanUnderlay}"]);
    assert_eq!(published.trim(), format!("{node2_v6} ipv6"));

    let ns = "weft-dual-stack";
    namespace(ns, &[]);
    let pod = |name, node, host_port| TestPod { namespace: ns, name, node, host_port, ..Default::default() };
    pod("a", "node-1", None).run();
    pod("c", "node-2", Some(HOST_PORT)).run();
    kubectl_ok(&["label", "pod", "-n", ns, "c", "app=c"]);
    let (a, c) = (pod_ips(ns, "a"), pod_ips(ns, "c"));
    let cluster6: ipnet::Ipv6Net = IPV6_CLUSTER_CIDR.parse().expect("cidr");
    for ips in [&a, &c] {
        assert_eq!(ips.len(), 2, "{ips:?}");
        let v6: std::net::Ipv6Addr = ips[1].parse().unwrap_or_else(|_| panic!("no IPv6 address: {ips:?}"));
        assert!(cluster6.contains(&v6), "{v6} outside {IPV6_CLUSTER_CIDR}");
    }

    // Pods leave room for the IPv6 outer headers: the underlay (the node's
    // eth0; `ip`, as the node's /sys is the host's) less 70 bytes.
    let (_, link) = node_exec("node-1", &["ip", "-o", "link", "show", "eth0"]);
    let underlay_mtu: u32 = link
        .split_whitespace()
        .skip_while(|w| *w != "mtu")
        .nth(1)
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("no MTU in {link:?}"));
    let (_, pod_mtu) = pod_exec(ns, "a", &["cat", "/sys/class/net/eth0/mtu"]);
    assert_eq!(pod_mtu.trim().parse::<u32>().ok(), Some(underlay_mtu - 70), "pod MTU {pod_mtu:?}");

    // Across nodes over IPv6, both ways, TCP and UDP; IPv4 too, inside the
    // IPv6 tunnel.
    let answer = eventually("a → c over IPv4 TCP", Duration::from_secs(60), || {
        http_hostname(ns, "a", &format!("{}:{HTTP_PORT}", c[0]))
    });
    assert_eq!(answer, "c");
    for (from, to, target6) in [("a", "c", &c[1]), ("c", "a", &a[1])] {
        assert_tcp_and_udp(ns, from, target6, to);
    }

    // An IPv6-only Service through kube-proxy.
    apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: c6, namespace: {ns}}}\n\
         spec:\n  ipFamilyPolicy: SingleStack\n  ipFamilies: [IPv6]\n  selector: {{app: c}}\n\
         \x20 ports: [{{port: 80, targetPort: {HTTP_PORT}}}]\n"
    ));
    let service_ip = kubectl_ok(&["get", "svc", "-n", ns, "c6", "-o", "jsonpath={.spec.clusterIP}"]);
    let service_ip = service_ip.trim();
    assert!(service_ip.starts_with("fd00:96::"), "an IPv6 cluster IP: {service_ip}");
    let answer = eventually("the IPv6 Service to answer", Duration::from_secs(60), || {
        http_hostname(ns, "a", &format!("[{service_ip}]:80"))
    });
    assert_eq!(answer, "c");

    // c's spec hostPort on node-2's IPv6 address, from a pod on node-1.
    let answer = eventually("the host port on node-2's IPv6 address", Duration::from_secs(60), || {
        http_hostname(ns, "a", &format!("[{node2_v6}]:{HOST_PORT}"))
    });
    assert_eq!(answer, "c");

    // a is published for node-2's agent with both addresses.
    let published = eventually("a's PodEndpoint", Duration::from_secs(60), || {
        let out = kubectl_ok(&[
            "get",
            "podendpoints",
            "-n",
            ns,
            "--ignore-not-found",
            "-o",
            "jsonpath={.items[?(@.metadata.name=='a')].spec.podIPs[*]}",
        ]);
        (!out.trim().is_empty()).then(|| out.trim().to_owned())
    });
    assert_eq!(published.split_whitespace().collect::<Vec<_>>(), [a[0].as_str(), a[1].as_str()]);

    // Policy: c admits role=client pods only, over both families. a is on
    // node-1: node-2's agent sees its label change through its PodEndpoint.
    let reaches = |target: &str| http_hostname(ns, "a", &format!("{target}:{HTTP_PORT}")).is_some();
    let (c4, c6) = (c[0].clone(), format!("[{}]", c[1]));
    let both = |want: (bool, bool), what: &str| {
        eventually(what, Duration::from_secs(60), || ((reaches(&c4), reaches(&c6)) == want).then_some(()))
    };
    let policy = |from: &str| {
        apply(&format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: c-ingress, namespace: {ns}}}\n\
             spec:\n  podSelector: {{matchLabels: {{app: c}}}}\n  ingress: [{{from: [{from}]}}]\n"
        ))
    };
    policy("{podSelector: {matchLabels: {role: client}}}");
    both((false, false), "a (no role) refused by c over IPv4 and IPv6");
    kubectl_ok(&["label", "pod", "-n", ns, "a", "role=client"]);
    both((true, true), "a (role=client) admitted by c over IPv4 and IPv6");
    // An IPv6 block admits a over IPv6 and never matches its IPv4 address.
    policy(&format!("{{ipBlock: {{cidr: {}/128}}}}", a[1]));
    both((false, true), "c admitting only a's IPv6 address");
    kubectl_ok(&["delete", "networkpolicy", "-n", ns, "c-ingress"]);
    both((true, true), "no policy: a reaches c over both families");

    // The hostile pod's attacks, over both families.
    weft_e2e::cluster::hostile::attacks_fail("weft-hostile");
}
