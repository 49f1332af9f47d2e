//! The pod address families of a cluster (IPv4, dual-stack, IPv6-only),
//! read from the chart values it is installed with; what kubelets, the
//! control plane and the Services get follows from them.

use anyhow::Context;

/// The pod address families of a cluster, from the chart values it is
/// installed with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Families {
    Ipv4,
    /// `--set network.ipv6ClusterCIDR=…`: dual-stack, with this IPv6 pod
    /// range; both node addresses on each kubelet, both Service ranges and
    /// kube-proxy on both families.
    DualStack(String),
    /// `network.ipv6ClusterCIDR` with `network.clusterCIDR=null`: IPv6-only,
    /// with this pod range; kubelets, Services and kube-proxy on IPv6 alone.
    Ipv6Only(String),
}

impl Families {
    /// The kube-dns Service's address: kubelet's clusterDNS.
    pub fn dns_ip(&self) -> &'static str {
        match self {
            Families::Ipv6Only(_) => super::CLUSTER_DNS_IP6,
            _ => super::CLUSTER_DNS_IP,
        }
    }

    /// A node's addresses in the cluster's families, IPv4 first (kubelet's
    /// `--node-ip`).
    pub fn node_ips(&self, node: &super::NodeInfo) -> Vec<std::net::IpAddr> {
        let v6 = crate::sandbox::node_ipv6(node.ip).into();
        match self {
            Families::Ipv4 => vec![node.ip.into()],
            Families::DualStack(_) => vec![node.ip.into(), v6],
            Families::Ipv6Only(_) => vec![v6],
        }
    }

    /// The pod ranges of the cluster, IPv4 first.
    pub fn cluster_cidrs(&self) -> anyhow::Result<Vec<ipnet::IpNet>> {
        let ranges: Vec<&str> = match self {
            Families::Ipv4 => vec![super::CLUSTER_CIDR],
            Families::DualStack(v6) => vec![super::CLUSTER_CIDR, v6],
            Families::Ipv6Only(v6) => vec![v6],
        };
        ranges.iter().map(|r| r.parse().with_context(|| format!("cluster CIDR {r:?}"))).collect()
    }

    pub fn of(helm_sets: &[String]) -> Self {
        let v4_dropped = super::helm_set(helm_sets, "network.clusterCIDR") == Some("null");
        match super::helm_set(helm_sets, "network.ipv6ClusterCIDR").filter(|v| *v != "null") {
            None => Families::Ipv4,
            Some(v6) if v4_dropped => Families::Ipv6Only(v6.to_owned()),
            Some(v6) => Families::DualStack(v6.to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_families_follow_the_last_chart_values() {
        let of = |sets: &[&str]| Families::of(&sets.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        let v6 = "network.ipv6ClusterCIDR=fd00:10:244::/56";
        assert_eq!(of(&[]), Families::Ipv4);
        assert_eq!(of(&[v6]), Families::DualStack("fd00:10:244::/56".into()));
        assert_eq!(of(&[v6, "network.clusterCIDR=null"]), Families::Ipv6Only("fd00:10:244::/56".into()));
        let back = ["network.clusterCIDR=null", "network.clusterCIDR=10.244.0.0/16", v6];
        assert_eq!(of(&back), Families::DualStack("fd00:10:244::/56".into()), "a later IPv4 CIDR wins");
        assert_eq!(of(&[v6, "network.ipv6ClusterCIDR=null"]), Families::Ipv4);
        assert_eq!(of(&[v6, "network.clusterCIDR=null"]).dns_ip(), "fd00:96::a");
        let ranges = |f: Families| f.cluster_cidrs().unwrap().iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(ranges(of(&[v6])), ["10.244.0.0/16", "fd00:10:244::/56"]);
        assert_eq!(ranges(of(&[v6, "network.clusterCIDR=null"])), ["fd00:10:244::/56"]);
        let err = of(&["network.ipv6ClusterCIDR=fd00::/999"]).cluster_cidrs().unwrap_err();
        assert!(format!("{err:#}").contains("fd00::/999"), "{err:#}");
    }

    #[test]
    fn a_node_has_an_address_of_each_family_of_the_cluster() {
        let node = crate::cluster::NodeInfo::new(2);
        let ips = |f: Families| f.node_ips(&node).iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(ips(Families::Ipv4), ["10.251.0.12"]);
        let dual = Families::DualStack("fd00:10:244::/56".into());
        assert_eq!(ips(dual), ["10.251.0.12", "fd00:250::c"]);
        assert_eq!(ips(Families::Ipv6Only("fd00:10:244::/56".into())), ["fd00:250::c"]);
    }
}
