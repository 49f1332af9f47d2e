//! Weft on real nodes with the wireguard backend, dual-stack: kubelet and
//! containerd exec weft-cni, Weft installed by its chart with
//! `network.backend=wireguard`. Each node publishes its own key, the
//! cluster's ranges go into the TUN device, pods reach each other across
//! nodes over both families (TCP and UDP) and through a Service, and a
//! hostile pod gets past no policy (`weft_e2e::cluster::hostile`) with the
//! agent's datapath between the nodes. The sandbox's `sandbox_tunnel`
//! captures the underlay and meets a stock WireGuard peer.
//!
//! `WEFT_E2E_TUNNEL_BACKEND=udp` runs the same test on flannel's udp
//! backend (by hand: CI runs wireguard, the one of the two that has more
//! to break).

use std::time::Duration;

use weft_e2e::cluster::testing::{Cluster, eventually, kubectl_ok, node_exec};
use weft_e2e::cluster::workloads::{HTTP_PORT, http_hostname, namespace, pod_ips, pods_and_a_service_connect};

#[test]
fn dual_stack_pods_and_services_connect_over_wireguard() {
    let backend = std::env::var("WEFT_E2E_TUNNEL_BACKEND").unwrap_or_else(|_| "wireguard".into());
    assert!(["wireguard", "udp"].contains(&backend.as_str()), "WEFT_E2E_TUNNEL_BACKEND: {backend}");
    let args = ["--backend", &backend, "--set", "network.ipv6ClusterCIDR=fd00:10:244::/56"];
    let Some(_cluster) = Cluster::shared(&args) else { return };
    if backend == "wireguard" {
        let keys: Vec<String> = ["node-1", "node-2"]
            .iter()
            .map(|n| kubectl_ok(&["get", "subnet", n, "-o", "jsonpath={.status.wireguardPublicKey}"]).trim().to_owned())
            .collect();
        assert!(keys.iter().all(|k| k.len() == 44) && keys[0] != keys[1], "{keys:?}");
    }
    let (_, routes) = node_exec("node-1", &["ip", "-6", "route", "show", "dev", "weft-tun"]);
    assert!(routes.contains("fd00:10:244::/56"), "the cluster's IPv6 range goes into the TUN device: {routes}");

    let ns = "weft-e2e";
    namespace(ns, &[]);
    pods_and_a_service_connect(ns);
    let [a, b, c] = ["a", "b", "c"].map(|p| pod_ips(ns, p));
    for (from, to, target) in [("a", "b", &b[1]), ("a", "c", &c[1]), ("c", "a", &a[1])] {
        let answer = eventually(&format!("{from} → {to} over IPv6"), Duration::from_secs(60), || {
            http_hostname(ns, from, &format!("[{target}]:{HTTP_PORT}"))
        });
        assert_eq!(answer, to);
    }

    weft_e2e::cluster::hostile::attacks_fail("weft-hostile");
}
