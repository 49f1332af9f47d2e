//! Weft on real nodes with the host-gw backend: kubelet and containerd exec
//! weft-cni, Weft installed by its chart; pods reach each other on one node
//! and across nodes (TCP, UDP), and a Service through kube-proxy reaches
//! pods on both nodes. The VXLAN binary (cluster_vxlan.rs) covers the rest.

use weft_e2e::cluster::testing::Cluster;
use weft_e2e::cluster::workloads::{namespace, pods_and_a_service_connect};

#[test]
fn pods_and_services_connect_with_host_gw() {
    let Some(_cluster) = Cluster::shared(&["--backend", "host-gw"]) else { return };
    namespace("weft-e2e", &[]);
    pods_and_a_service_connect("weft-e2e");
}
