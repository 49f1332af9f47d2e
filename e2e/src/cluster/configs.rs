//! The configuration files of a node's containerd, kubelet and kube-proxy,
//! rendered from the node's facts. Pure: the paths are the host paths as seen
//! inside the node's mount namespace, where they are the node's own.

use std::path::Path;

use super::families::Families;
use super::{CLUSTER_CIDR, NodeInfo, PAUSE_IMAGE};

/// containerd's socket inside a node.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";

/// containerd 2.x (config version 3). `restrict_oom_score_adj`: root here lacks
/// CAP_SYS_RESOURCE, and without it runc fails to start containers.
/// Loopback is set up by containerd itself; the reference plugins' directory
/// comes second so that a conflist of reference plugins can be compared
/// with Weft on the same nodes. Nothing is read from or written to the
/// host's /etc/containerd or /opt/containerd.
pub fn containerd_toml() -> String {
    format!(
        r#"version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
imports = []
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[debug]
  level = "info"

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = "/var/lib/containerd/opt"

  [plugins.'io.containerd.cri.v1.images']
    snapshotter = "overlayfs"
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = "{PAUSE_IMAGE}"

  [plugins.'io.containerd.cri.v1.runtime']
    enable_selinux = false
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = "/usr/sbin/runc"
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ["/opt/cni/bin", "/usr/lib/cni"]
      conf_dir = "/etc/cni/net.d"
      max_conf_num = 1
      use_internal_loopback = true

  [plugins.'io.containerd.grpc.v1.cri']
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
"#
    )
}

/// kubelet's KubeletConfiguration. cgroup v1 without systemd: cgroupfs, a
/// `cgroupRoot` of the node's own, `failCgroupV1: false`. Eviction thresholds
/// are low because every node shares one disk.
pub fn kubelet_yaml(node: &NodeInfo, ca: &Path, families: &Families) -> String {
    // An IPv6-only node serves the apiserver on its IPv6 address, and its
    // pods' DNS is the IPv6 Service range's.
    let ip = match families {
        Families::Ipv6Only(_) => crate::sandbox::node_ipv6(node.ip).to_string(),
        _ => node.ip.to_string(),
    };
    let dns = families.dns_ip();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
cgroupsPerQOS: true
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{sock}
podLogsDir: /var/log/pods
clusterDomain: cluster.local
clusterDNS: [{dns}]
resolvConf: /etc/resolv.conf
registerNode: true
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 10s
maxPods: 110
"#,
        ca = ca.display(),
        cgroup = node.cgroup(),
        sock = CONTAINERD_SOCKET,
    )
}

/// kube-proxy's proxier. nftables by default: it is where kube-proxy and the
/// distributions are going, and it puts a second component's nftables table
/// beside Weft's on every node. `WEFT_KUBE_PROXY_MODE=iptables` runs the
/// iptables proxier (over iptables-nft) instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    Iptables,
    Nftables,
}

impl ProxyMode {
    pub const ENV: &str = "WEFT_KUBE_PROXY_MODE";

    pub fn from_env() -> Result<Self, String> {
        match std::env::var(Self::ENV) {
            Err(_) => Ok(Self::Nftables),
            Ok(v) => Self::parse(&v),
        }
    }

    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "" | "nftables" => Ok(Self::Nftables),
            "iptables" => Ok(Self::Iptables),
            other => Err(format!("{}={other:?}: expected iptables or nftables", Self::ENV)),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
        }
    }
}

/// kube-proxy's configuration. conntrack sizes stay at the kernel's (a node
/// namespace cannot change the host-wide table size); the TCP timeouts are
/// per namespace, so kube-proxy sets its defaults (established 24 h,
/// CLOSE_WAIT 1 h) as on any node. The pod ranges are those of the
/// cluster's `families`.
pub fn kube_proxy_yaml(node: &NodeInfo, kubeconfig: &Path, mode: ProxyMode, families: &Families) -> String {
    let (cluster_cidr, bind) = match families {
        Families::Ipv4 => (CLUSTER_CIDR.to_owned(), "0.0.0.0"),
        Families::DualStack(v6) => (format!("{CLUSTER_CIDR},{v6}"), "0.0.0.0"),
        // Quoted: a bare `::` is not a YAML scalar.
        Families::Ipv6Only(v6) => (v6.clone(), "'::'"),
    };
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {name}
bindAddress: {bind}
clusterCIDR: {cluster_cidr}
mode: {mode}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
conntrack:
  maxPerCore: 0
  min: 0
"#,
        kubeconfig = kubeconfig.display(),
        name = node.name,
        mode = mode.as_str(),
    )
}

/// A kubeconfig authenticating with a client certificate.
pub fn cert_kubeconfig(server: &str, ca: &Path, user: &str, cert: &Path, key: &Path) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: weft
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {user}
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: weft
  context:
    cluster: weft
    user: {user}
current-context: weft
",
        ca = ca.display(),
        cert = cert.display(),
        key = key.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_node_gets_its_own_address_and_cgroup() {
        let n2 = NodeInfo::new(2);
        let y = kubelet_yaml(&n2, Path::new("/ca.crt"), &Families::Ipv4);
        assert!(y.contains("address: 10.251.0.12\n"), "{y}");
        assert!(y.contains("cgroupRoot: /weft-k8s/node-2\n"), "{y}");
        assert!(y.contains("failCgroupV1: false"));
        let p = kube_proxy_yaml(&n2, Path::new("/kp"), ProxyMode::Nftables, &Families::Ipv4);
        assert!(p.contains("hostnameOverride: node-2\n") && p.contains("mode: nftables\n"), "{p}");
        // kube-proxy sets its conntrack timeouts (per namespace) as on any node.
        assert!(!p.contains("Timeout"), "{p}");
        let dual = Families::DualStack("fd00:10:244::/56".into());
        let p = kube_proxy_yaml(&n2, Path::new("/kp"), ProxyMode::Iptables, &dual);
        assert!(p.contains("mode: iptables\n"), "{p}");
        assert!(p.contains(&format!("clusterCIDR: {CLUSTER_CIDR},fd00:10:244::/56\n")), "{p}");
        let v6 = Families::Ipv6Only("fd00:10:244::/56".into());
        let p = kube_proxy_yaml(&n2, Path::new("/kp"), ProxyMode::Nftables, &v6);
        assert!(p.contains("clusterCIDR: fd00:10:244::/56\n") && p.contains("bindAddress: '::'\n"), "{p}");
        let y = kubelet_yaml(&n2, Path::new("/ca.crt"), &v6);
        assert!(y.contains("address: fd00:250::c\n") && y.contains("clusterDNS: [fd00:96::a]"), "{y}");
        let c = containerd_toml();
        assert!(c.contains(PAUSE_IMAGE) && c.contains("restrict_oom_score_adj = true"));
    }

    #[test]
    fn the_proxy_mode_is_one_of_two_and_a_typo_is_an_error() {
        assert_eq!(ProxyMode::parse(""), Ok(ProxyMode::Nftables));
        assert_eq!(ProxyMode::parse("iptables"), Ok(ProxyMode::Iptables));
        let err = ProxyMode::parse("ipvs").unwrap_err();
        assert!(err.contains("WEFT_KUBE_PROXY_MODE") && err.contains("ipvs"), "{err}");
    }
}
