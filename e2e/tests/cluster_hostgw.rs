//! Weft on real nodes with the host-gw backend, dual-stack, and pods
//! attached routed (`agent.podAttachment=routed`: a /32 and a /128 per pod,
//! no bridge): kubelet and containerd exec weft-cni, Weft installed by its
//! chart; pods reach each other on one node and across nodes (TCP, UDP,
//! both families; IPv6 blocks routed to the nodes' IPv6 addresses), a
//! Service through kube-proxy reaches pods on both nodes, and a hostile
//! routed pod gets past no policy (`weft_e2e::cluster::hostile`). The VXLAN
//! binaries (cluster_vxlan.rs, cluster_dual_stack.rs) cover the rest.

use std::time::Duration;

use weft_e2e::cluster::testing::{Cluster, eventually, kubectl_ok, node_exec};
use weft_e2e::cluster::workloads::{HTTP_PORT, http_hostname, namespace, pod_ips, pods_and_a_service_connect};

#[test]
fn routed_dual_stack_pods_and_services_connect_with_host_gw() {
    let sets = ["network.ipv6ClusterCIDR=fd00:10:244::/56", "agent.podAttachment=routed"];
    let args = ["--backend", "host-gw", "--set", sets[0], "--set", sets[1]];
    let Some(_cluster) = Cluster::shared(&args) else { return };
    let ns = "weft-e2e";
    namespace(ns, &[]);
    pods_and_a_service_connect(ns);

    // Routed: each pod's addresses are host routes on its own veth, no bridge.
    let [a, c] = ["a", "c"].map(|p| pod_ips(ns, p));
    let (_, routes) = node_exec("node-1", &["ip", "-6", "route", "show", &format!("{}/128", a[1])]);
    assert!(routes.contains("dev weftv"), "a's /128 on its host veth: {routes}");
    let subnet = kubectl_ok(&["get", "subnet", "node-2", "-o", "jsonpath={.status.nodeIPv6}"]);
    let (_, routes) = node_exec("node-1", &["ip", "-6", "route", "show", "proto", "0x57"]);
    assert!(routes.contains(&format!("via {}", subnet.trim())), "node-2's IPv6 block via its address: {routes}");

    // IPv6 on one node (a → b) and across nodes, both ways.
    let b = pod_ips(ns, "b");
    for (from, to, target) in [("a", "b", &b[1]), ("a", "c", &c[1]), ("c", "a", &a[1])] {
        let answer = eventually(&format!("{from} → {to} over IPv6"), Duration::from_secs(60), || {
            http_hostname(ns, from, &format!("[{target}]:{HTTP_PORT}"))
        });
        assert_eq!(answer, to);
    }

    // The hostile pod's attacks, against routed pods, both families.
    weft_e2e::cluster::hostile::attacks_fail("weft-hostile");
}
