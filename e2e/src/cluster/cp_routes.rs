//! Routes from the control plane to pods. In a kubeadm cluster the control
//! plane is a node running the pod network, so kube-apiserver reaches pods
//! (`pods/proxy`, which the upstream DNS tests read their results through,
//! webhooks, aggregated APIs). Here it is a namespace without kubelet or
//! Weft, so the supervisor keeps one route per Subnet block: the node's pod
//! range via the node's underlay address of that family, as host-gw would.
//! Level-triggered: the Subnets are read every few seconds and the
//! difference applied.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use kube::api::{Api, ListParams};
use weft_api::subnet::Subnet;

use super::CP_NS;
use crate::sandbox::ip;

fn in_clusters(clusters: &[IpNet], net: &IpNet) -> bool {
    clusters.iter().any(|c| c.contains(net))
}

/// Pod block → gateway (the node's address of the block's family) for every
/// Subnet block inside `clusters` whose node has published that address:
/// the IPv4 block via `nodeIP`, the IPv6 block via `nodeIPv6` (dual-stack)
/// or, in an IPv6-only cluster, via `nodeIP`.
pub fn desired(subnets: &[Subnet], clusters: &[IpNet]) -> BTreeMap<IpNet, String> {
    let mut want = BTreeMap::new();
    for s in subnets {
        let Some(status) = s.status.as_ref() else { continue };
        let node_ips: Vec<IpAddr> =
            [&status.node_ip, &status.node_ipv6].into_iter().flatten().filter_map(|a| a.parse().ok()).collect();
        let blocks = if s.spec.cidrs.is_empty() { std::slice::from_ref(&s.spec.cidr) } else { &s.spec.cidrs[..] };
        for block in blocks.iter().filter_map(|b| b.parse::<IpNet>().ok()).filter(|b| in_clusters(clusters, b)) {
            if let Some(via) = node_ips.iter().find(|a| a.is_ipv4() == matches!(block, IpNet::V4(_))) {
                want.insert(block, via.to_string());
            }
        }
    }
    want
}

/// The routes into the cluster ranges the namespace has (`ip -j route`, of
/// either family).
pub fn parse_current(json: &str, clusters: &[IpNet]) -> BTreeMap<IpNet, String> {
    let routes: Vec<serde_json::Value> = serde_json::from_str(json).unwrap_or_default();
    routes
        .iter()
        .filter_map(|r| {
            let dst: IpNet = r["dst"].as_str()?.parse().ok()?;
            in_clusters(clusters, &dst).then(|| (dst, r["gateway"].as_str().unwrap_or_default().to_owned()))
        })
        .collect()
}

fn sync_once(subnets: &[Subnet], clusters: &[IpNet]) -> anyhow::Result<()> {
    let want = desired(subnets, clusters);
    let mut have = BTreeMap::new();
    for family in ["-4", "-6"] {
        have.extend(parse_current(&ip(&["-n", CP_NS, "-j", family, "route", "show"])?, clusters));
    }
    for (dst, via) in &want {
        if have.get(dst) != Some(via) {
            ip(&["-n", CP_NS, "route", "replace", &dst.to_string(), "via", via])?;
        }
    }
    for dst in have.keys().filter(|d| !want.contains_key(d)) {
        ip(&["-n", CP_NS, "route", "del", &dst.to_string()])?;
    }
    Ok(())
}

/// Keeps the routes into `clusters` (the cluster's pod ranges) until the
/// task is dropped.
pub async fn keep(client: kube::Client, clusters: Vec<IpNet>) {
    let api: Api<Subnet> = Api::all(client);
    loop {
        match api.list(&ListParams::default()).await {
            Ok(list) => {
                let (items, clusters) = (list.items, clusters.clone());
                match tokio::task::spawn_blocking(move || sync_once(&items, &clusters)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => eprintln!("control plane routes: {e:#}"),
                    Err(e) => eprintln!("control plane routes: {e}"),
                }
            }
            Err(e) => eprintln!("control plane routes: listing Subnets: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn subnet(node: &str, cidrs: &[&str], status: serde_json::Value) -> Subnet {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": node},
            "spec": {"nodeName": node, "cidr": cidrs[0], "cidrs": cidrs, "backend": "vxlan"},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn one_route_per_published_block_and_only_cluster_routes_are_ours() {
        let subnets = [
            subnet("node-1", &["10.244.1.0/24"], json!({"nodeIP": "10.251.0.11"})),
            subnet("node-2", &["10.244.0.0/24"], serde_json::Value::Null),
            subnet("node-3", &["10.244.2.0/24"], json!({"nodeIP": "not-an-ip"})),
            // Outside the cluster's ranges: not ours to route.
            subnet("node-4", &["192.168.5.0/24"], json!({"nodeIP": "10.251.0.14"})),
        ];
        let clusters = ["10.244.0.0/16".parse().unwrap(), "fd00:10:244::/56".parse().unwrap()];
        let want = desired(&subnets, &clusters);
        assert_eq!(want.len(), 1);
        assert_eq!(want[&"10.244.1.0/24".parse().unwrap()], "10.251.0.11");
        let json = r#"[{"dst":"10.251.0.0/24","dev":"cp","protocol":"kernel"},
                       {"dst":"10.244.7.0/24","gateway":"10.251.0.17","dev":"cp"},
                       {"dst":"fd00:10:244:3::/64","gateway":"fd00:251::13","dev":"cp"}]"#;
        let have = parse_current(json, &clusters);
        assert_eq!(have.keys().map(ToString::to_string).collect::<Vec<_>>(), ["10.244.7.0/24", "fd00:10:244:3::/64"]);
        assert_eq!(parse_current(json, &clusters[..1]).len(), 1, "an IPv4 cluster owns no IPv6 route");
    }

    #[test]
    fn each_block_goes_via_the_node_address_of_its_family() {
        let dual = subnet(
            "node-1",
            &["10.244.1.0/24", "fd00:10:244:1::/64"],
            json!({"nodeIP": "10.251.0.11", "nodeIPv6": "fd00:251::b"}),
        );
        let v6_only = subnet("node-2", &["fd00:10:244:2::/64"], json!({"nodeIP": "fd00:251::c"}));
        // A dual-stack node that has not published its IPv6 address yet.
        let half = subnet("node-3", &["10.244.3.0/24", "fd00:10:244:3::/64"], json!({"nodeIP": "10.251.0.13"}));
        let clusters = ["10.244.0.0/16".parse().unwrap(), "fd00:10:244::/56".parse().unwrap()];
        let want = desired(&[dual, v6_only, half], &clusters);
        let got: Vec<(String, &str)> = want.iter().map(|(k, v)| (k.to_string(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("10.244.1.0/24".to_owned(), "10.251.0.11"),
                ("10.244.3.0/24".to_owned(), "10.251.0.13"),
                ("fd00:10:244:1::/64".to_owned(), "fd00:251::b"),
                ("fd00:10:244:2::/64".to_owned(), "fd00:251::c"),
            ]
        );
    }
}
