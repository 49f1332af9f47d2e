//! Routes from the control plane to pods. In a kubeadm cluster the control
//! plane is a node running the pod network, so kube-apiserver reaches pods
//! (`pods/proxy`, which the upstream DNS tests read their results through,
//! webhooks, aggregated APIs). Here it is a namespace without kubelet or
//! Weft, so the supervisor keeps one route per Subnet: the node's pod range
//! via the node's underlay address, as host-gw would. Level-triggered: the
//! Subnets are read every few seconds and the difference applied.

use std::collections::BTreeMap;
use std::time::Duration;

use ipnet::Ipv4Net;
use kube::api::{Api, ListParams};
use weft_api::subnet::Subnet;

use super::{CLUSTER_CIDR, CP_NS};
use crate::sandbox::ip;

/// Pod range → gateway (the node's address) for every Subnet whose node has
/// published its address.
pub fn desired(subnets: &[Subnet]) -> BTreeMap<Ipv4Net, String> {
    subnets
        .iter()
        .filter_map(|s| {
            let cidr: Ipv4Net = s.spec.cidr.parse().ok()?;
            let via = s.status.as_ref()?.node_ip.clone()?;
            via.parse::<std::net::Ipv4Addr>().ok()?;
            Some((cidr, via))
        })
        .collect()
}

/// The routes into the cluster range the namespace has (`ip -j route`).
pub fn parse_current(json: &str, cluster: Ipv4Net) -> BTreeMap<Ipv4Net, String> {
    let routes: Vec<serde_json::Value> = serde_json::from_str(json).unwrap_or_default();
    routes
        .iter()
        .filter_map(|r| {
            let dst: Ipv4Net = r["dst"].as_str()?.parse().ok()?;
            cluster.contains(&dst).then(|| (dst, r["gateway"].as_str().unwrap_or_default().to_owned()))
        })
        .collect()
}

fn sync_once(subnets: &[Subnet], cluster: Ipv4Net) -> anyhow::Result<()> {
    let want = desired(subnets);
    let have = parse_current(&ip(&["-n", CP_NS, "-j", "-4", "route", "show"])?, cluster);
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

/// Keeps the routes until the task is dropped.
pub async fn keep(client: kube::Client) {
    let Ok(cluster) = CLUSTER_CIDR.parse::<Ipv4Net>() else { return };
    let api: Api<Subnet> = Api::all(client);
    loop {
        match api.list(&ListParams::default()).await {
            Ok(list) => {
                let items = list.items;
                match tokio::task::spawn_blocking(move || sync_once(&items, cluster)).await {
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

    fn subnet(node: &str, cidr: &str, node_ip: Option<&str>) -> Subnet {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": node},
            "spec": {"nodeName": node, "cidr": cidr, "backend": "vxlan"},
            "status": node_ip.map(|ip| serde_json::json!({"nodeIP": ip})),
        }))
        .unwrap()
    }

    #[test]
    fn one_route_per_published_subnet_and_only_cluster_routes_are_ours() {
        let subnets = [
            subnet("node-1", "10.244.1.0/24", Some("10.251.0.11")),
            subnet("node-2", "10.244.0.0/24", None),
            subnet("node-3", "10.244.2.0/24", Some("not-an-ip")),
        ];
        let want = desired(&subnets);
        assert_eq!(want.len(), 1);
        assert_eq!(want[&"10.244.1.0/24".parse().unwrap()], "10.251.0.11");
        let json = r#"[{"dst":"10.251.0.0/24","dev":"cp","protocol":"kernel"},
                       {"dst":"10.244.7.0/24","gateway":"10.251.0.17","dev":"cp"}]"#;
        let have = parse_current(json, CLUSTER_CIDR.parse().unwrap());
        assert_eq!(have.keys().map(ToString::to_string).collect::<Vec<_>>(), ["10.244.7.0/24"]);
    }
}
