//! The real-node cluster: what users run. A control plane (etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler) and N nodes, each
//! node a network namespace with a mount namespace of its own running
//! containerd (+ runc), kubelet and kube-proxy; Weft installed with
//! `helm install charts/weft` from images built on this machine.
//!
//! Layout (all namespaces are ours, prefixed `weft-k8s-`):
//! ```text
//!   weft-k8s-net     bridge br0: the underlay 10.251.0.0/24
//!   weft-k8s-cp      10.251.0.1: etcd, kube-apiserver :6443, controller-manager, scheduler
//!   weft-k8s-node-N  10.251.0.(10+N): containerd, kubelet, kube-proxy, and the pods'
//!                    weft-agent (DaemonSet) and weft-operator (Deployment)
//! ```
//! Each node's mount namespace binds its own directories over the host paths
//! the chart and the runtime use (`/opt/cni/bin`, `/etc/cni/net.d`,
//! `/run/weft`, `/var/lib/weft`, kubelet's and containerd's), as kind's node
//! containers have their own filesystems. Its processes live in a pids cgroup
//! of its own (`weft-k8s/<node>`, also kubelet's `cgroupRoot`), so removing a
//! node kills exactly what ran there.

pub mod configs;
pub mod cp_routes;
pub mod dns;
pub mod families;
pub mod hostile;
pub mod images;
pub mod node;
pub mod supervise;
pub mod testing;
pub mod workloads;

use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub const NS_PREFIX: &str = "weft-k8s-";
pub const UNDERLAY_NS: &str = "weft-k8s-net";
pub const CP_NS: &str = "weft-k8s-cp";
pub const CP_IP: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 1);
pub const UNDERLAY_PREFIX: u8 = 24;
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// Where the host reaches the apiserver (a forwarder into the cp namespace).
pub const FORWARD_PORT: u16 = 26443;
/// The cgroup (under every v1 controller) holding every node's cgroup.
pub const CGROUP_PARENT: &str = "weft-k8s";
/// Tag of the Weft images built on this machine (`e2e/scripts/build-images.sh`).
pub const IMAGE_TAG: &str = "dev";
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10.1";
/// The kube-dns Service's address: kubelet's clusterDNS.
pub const CLUSTER_DNS_IP: &str = "10.96.0.10";
/// The kube-dns Service's address in an IPv6-only cluster.
pub const CLUSTER_DNS_IP6: &str = "fd00:96::a";

/// Where the cluster keeps its state (`$WEFT_CLUSTER_DIR`, default
/// /var/lib/weft-cluster: on disk, since containerd's images live there).
pub fn state_dir() -> PathBuf {
    std::env::var_os("WEFT_CLUSTER_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/var/lib/weft-cluster"))
}

pub fn node_name(index: usize) -> String {
    format!("node-{index}")
}

pub fn node_netns(name: &str) -> String {
    format!("{NS_PREFIX}{name}")
}

pub fn node_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 251, 0, 10 + index as u8)
}

/// The value the last `--set key=value` of `sets` gives `key` (helm's own
/// rule: a later one wins), as written (`null` included).
pub fn helm_set<'a>(sets: &'a [String], key: &str) -> Option<&'a str> {
    sets.iter().rev().find_map(|s| s.strip_prefix(key)?.strip_prefix('='))
}

/// What `up` leaves for the other commands and the tests.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    pub supervisor_pid: u32,
    /// Kubeconfig for this (the root) namespace, through the forwarder.
    pub kubeconfig: PathBuf,
    pub backend: String,
    pub nodes: Vec<NodeInfo>,
    /// The values `helm install` was given (for `helm upgrade` in tests).
    pub helm_values: Vec<String>,
    /// What a node added later needs.
    pub credentials: node::Credentials,
    pub images: Vec<PathBuf>,
    /// Each node's Ready condition (name, status, message) just before
    /// `helm install`: nodes wait for a pod network.
    pub ready_before_weft: Vec<(String, String, String)>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    pub index: usize,
    pub netns: String,
    pub ip: Ipv4Addr,
}

impl NodeInfo {
    pub fn new(index: usize) -> NodeInfo {
        let name = node_name(index);
        NodeInfo { netns: node_netns(&name), ip: node_ip(index), index, name }
    }

    /// The node's own directories (bound over the host paths in its mount namespace).
    pub fn dir(&self) -> PathBuf {
        state_dir().join("nodes").join(&self.name)
    }

    /// The file holding the node's mount namespace.
    pub fn mount_ns(&self) -> PathBuf {
        state_dir().join("ns").join(&self.name)
    }

    /// The file holding the node's UTS namespace: its own hostname, as a
    /// kind node container has (hostNetwork pods share it).
    pub fn uts_ns(&self) -> PathBuf {
        state_dir().join("ns").join(format!("{}.uts", self.name))
    }

    /// kubelet's `cgroupRoot` and the node's process group, relative to a controller.
    pub fn cgroup(&self) -> String {
        format!("{CGROUP_PARENT}/{}", self.name)
    }
}

impl crate::supervisor::StateFile for State {
    type Node = NodeInfo;
    const WHAT: &'static str = "cluster";
    const UP: &'static str = "e2e/cluster.sh up";
    const DOWN: &'static str = "e2e/cluster.sh down";
    const READY_WAIT: std::time::Duration = std::time::Duration::from_secs(600);
    const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

    fn state_dir() -> PathBuf {
        state_dir()
    }

    fn cleanup_leftovers() {
        supervise::cleanup_leftovers();
    }

    fn nodes(&self) -> &[NodeInfo] {
        &self.nodes
    }
}

impl crate::supervisor::StateNode for NodeInfo {
    fn name(&self) -> &str {
        &self.name
    }
}

/// Names of the cluster's network namespaces that exist now.
pub fn existing_namespaces() -> Vec<String> {
    crate::supervisor::namespaces_with_prefix(NS_PREFIX)
}
