//! Keeps the overlay in step with the cluster's Subnets. A watch feeds an
//! in-memory store; every change, and a periodic resync, runs one reconcile
//! pass over all peers (level-triggered: the pass diffs against the kernel,
//! so a missed event or a hand-deleted entry is repaired by the next one).
//!
//! A peer's Subnet status is written by that node's agent, whose token may
//! be stolen: the node addresses it claims are checked against its Node
//! object (written by its kubelet, which no agent token can change), so a
//! node cannot make its peers tunnel or route its pods' traffic to another
//! machine's address.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::watcher;
use weft_api::subnet::Subnet;

use crate::lease::{Condition, publish_condition};
use crate::overlay::{Peer, Reconciler};

/// Field manager for the peer condition (separate from the one that writes
/// node facts, so neither apply removes the other's fields).
const FIELD_MANAGER: &str = "weft-agent-peers";
pub const CONDITION_PEERS: &str = "PeersProgrammed";
/// How long the first pass waits for the Node store.
const NODES_READY: Duration = Duration::from_secs(30);

/// Runs until the watch ends for good (it retries with backoff on errors).
pub async fn run(api: Api<Subnet>, nodes: Api<Node>, reconciler: Arc<Reconciler>, node: String, resync: Duration) {
    let changed = Arc::new(tokio::sync::Notify::new());
    let reader = weft_api::watch::reflect(
        api.clone(),
        watcher::Config::default(),
        "Subnet",
        weft_api::watch::keep_all,
        Some(Arc::clone(&changed)),
    );
    let node_reader =
        weft_api::watch::reflect(nodes, watcher::Config::default(), "Node", addresses_only, Some(Arc::clone(&changed)));
    if reader.wait_until_ready().await.is_err() {
        tracing::error!("the Subnet store was dropped before it was ready");
        return;
    }
    // Peers are not held back for ever by Nodes that cannot be read (a
    // role without them): their claims stay unchecked until the store fills.
    if !matches!(tokio::time::timeout(NODES_READY, node_reader.wait_until_ready()).await, Ok(Ok(()))) {
        tracing::error!(
            "cannot read Nodes: the node addresses peers claim are not checked until Nodes can be read (the agent's role needs list and watch on nodes)"
        );
    }
    let mut last_condition: Option<(bool, String)> = None;
    loop {
        let subnets = reader.state();
        let listed = listed_addresses(&node_reader.state());
        let mut invalid = BTreeMap::new();
        let mut peers = Vec::new();
        for s in subnets.iter().filter(|s| s.spec.node_name != node) {
            let status = s.status.as_ref();
            match Peer::parse(
                &s.spec.node_name,
                &s.spec.cidr,
                &s.spec.cidrs,
                s.spec.backend,
                (status.and_then(|st| st.node_ip.as_deref()), status.and_then(|st| st.node_ipv6.as_deref())),
                status.and_then(|st| st.vtep_mac.as_deref()),
            ) {
                Ok(p) => match (
                    unlisted_claim(&p, listed.get(&p.node_name).map(Vec::as_slice)),
                    wireguard_key(status.and_then(|st| st.wireguard_public_key.as_deref())),
                ) {
                    (Some(why), _) | (None, Err(why)) => {
                        invalid.insert(s.spec.node_name.clone(), why);
                    }
                    (None, Ok(wireguard_key)) => peers.push(Peer {
                        vxlan_underlay: status.and_then(|st| st.vxlan_underlay).unwrap_or_default(),
                        wireguard_key,
                        ..p
                    }),
                },
                Err(e) => {
                    invalid.insert(s.spec.node_name.clone(), e.to_string());
                }
            }
        }
        match reconciler.reconcile(&peers).await {
            Ok(report) => {
                if !report.local.device_changes.is_empty() {
                    tracing::warn!(changes = ?report.local.device_changes, "repaired this node's overlay device");
                }
                for stale in &report.stale_errors {
                    tracing::warn!(error = %stale, "could not remove a stale overlay entry; retrying next pass");
                }
                for (peer, issue) in &report.peer_errors {
                    invalid.insert(peer.clone(), issue.to_string());
                }
                if report.ops_applied > 0 || !invalid.is_empty() {
                    tracing::info!(
                        peers = peers.len(),
                        programmed = report.programmed.len(),
                        ops = report.ops_applied,
                        problems = ?invalid,
                        elapsed_ms = report.elapsed.as_millis() as u64,
                        "overlay reconciled"
                    );
                }
            }
            Err(e) => {
                invalid.insert(node.clone(), format!("this node's overlay: {e}"));
                tracing::error!(error = %e, "overlay reconcile failed");
            }
        }
        let condition = (invalid.is_empty(), describe(&invalid));
        if last_condition.as_ref() != Some(&condition) {
            match publish(&api, &node, &condition).await {
                Ok(()) => last_condition = Some(condition),
                Err(e) => tracing::warn!(error = %e, "cannot publish the PeersProgrammed condition"),
            }
        }
        tokio::select! {
            () = changed.notified() => {}
            () = tokio::time::sleep(resync) => {}
        }
    }
}

/// A peer's published WireGuard key; the CRD's pattern checks the text,
/// this its length too.
fn wireguard_key(text: Option<&str>) -> Result<Option<[u8; 32]>, String> {
    match text {
        None => Ok(None),
        Some(t) => crate::tunnel::keys::decode(t)
            .map(Some)
            .ok_or_else(|| format!("malformed wireguardPublicKey {t:?}: not a base64 32-byte key")),
    }
}

/// Keeps of a Node only its name and the addresses it lists (every agent
/// holds every Node).
fn addresses_only(node: &mut Node) {
    let addresses = node.status.take().and_then(|s| s.addresses);
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    node.metadata.labels = None;
    node.spec = None;
    node.status = Some(k8s_openapi::api::core::v1::NodeStatus { addresses, ..Default::default() });
}

/// The addresses each Node lists, by node name (unparsable ones left out).
fn listed_addresses(nodes: &[Arc<Node>]) -> HashMap<String, Vec<IpAddr>> {
    nodes
        .iter()
        .filter_map(|n| {
            let addresses = n.status.as_ref()?.addresses.as_ref()?;
            let ips = addresses.iter().filter_map(|a| a.address.parse().ok()).collect();
            Some((n.metadata.name.clone()?, ips))
        })
        .collect()
}

/// Why a peer's claimed node addresses are not to be trusted: one that its
/// Node does not list. A peer whose Node is absent or lists no address yet
/// keeps its claim (a Node being registered again, or without status yet,
/// is a brief state, and no agent token can delete or write a Node).
pub fn unlisted_claim(peer: &Peer, listed: Option<&[IpAddr]>) -> Option<String> {
    let listed = listed.filter(|l| !l.is_empty())?;
    let claimed = std::iter::once(peer.node_ip).chain(peer.node_ipv6.map(IpAddr::V6));
    let unlisted: Vec<String> = claimed.filter(|ip| !listed.contains(ip)).map(|ip| ip.to_string()).collect();
    (!unlisted.is_empty()).then(|| {
        let listed: Vec<String> = listed.iter().map(IpAddr::to_string).collect();
        format!(
            "claims node address {} that its Node does not list ({}); not programmed",
            unlisted.join(", "),
            listed.join(", ")
        )
    })
}

fn describe(invalid: &BTreeMap<String, String>) -> String {
    if invalid.is_empty() {
        return "every peer is programmed (its routes, and its neighbour and FDB entries or its tunnel)".to_owned();
    }
    invalid.iter().map(|(peer, why)| format!("{peer}: {why}")).collect::<Vec<_>>().join("; ")
}

async fn publish(api: &Api<Subnet>, node: &str, (ok, message): &(bool, String)) -> Result<(), kube::Error> {
    let reason = if *ok { "AllPeersProgrammed" } else { "PeerProblems" };
    let condition = Condition { kind: CONDITION_PEERS, ok: *ok, reason, message: message.clone() };
    publish_condition(api, node, FIELD_MANAGER, &condition).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(node_ip: &str, node_ipv6: Option<&str>) -> Peer {
        let p = Peer::parse("node-2", "10.244.2.0/24", &[], weft_api::Backend::Vxlan, (Some(node_ip), node_ipv6), None);
        p.expect("a valid peer")
    }

    #[test]
    fn a_claimed_address_the_node_does_not_list_is_refused() {
        let listed: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()];
        assert_eq!(unlisted_claim(&peer("10.0.0.2", Some("fd00::2")), Some(&listed)), None);
        assert_eq!(unlisted_claim(&peer("10.0.0.2", None), Some(&listed)), None);
        let why = unlisted_claim(&peer("10.0.0.1", None), Some(&listed)).expect("another node's address");
        assert!(why.contains("10.0.0.1") && why.contains("10.0.0.2, fd00::2"), "{why}");
        let why = unlisted_claim(&peer("10.0.0.2", Some("fd00::1")), Some(&listed)).expect("another IPv6 address");
        assert!(why.contains("fd00::1") && !why.contains("address 10.0.0.2"), "{why}");
    }

    #[test]
    fn a_node_absent_or_listing_nothing_leaves_the_claim_alone() {
        assert_eq!(unlisted_claim(&peer("10.0.0.9", None), None), None);
        assert_eq!(unlisted_claim(&peer("10.0.0.9", None), Some(&[])), None);
    }

    #[test]
    fn only_names_and_addresses_of_nodes_are_kept() {
        let mut node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-2", "labels": {"a": "b"}, "annotations": {"c": "d"}},
            "spec": {"podCIDR": "10.244.2.0/24"},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.2"}, {"type": "Hostname", "address": "node-2"}],
                       "capacity": {"cpu": "2"}},
        }))
        .expect("a Node");
        addresses_only(&mut node);
        assert_eq!(node.metadata.labels, None);
        assert_eq!(node.spec, None);
        let listed = listed_addresses(&[Arc::new(node)]);
        assert_eq!(listed["node-2"], vec!["10.0.0.2".parse::<IpAddr>().unwrap()]);
    }
}
