//! Keeps the overlay in step with the cluster's Subnets. A watch feeds an
//! in-memory projection; every change to what a pass reads, and a periodic
//! resync, runs one reconcile pass over all peers (level-triggered: the
//! pass diffs against the kernel, so a missed event or a hand-deleted entry
//! is repaired by the next one).
//!
//! A peer's Subnet status is written by that node's agent, whose token may
//! be stolen: the node addresses it claims are checked against its Node
//! object (written by its kubelet, which no agent token can change), so a
//! node cannot make its peers tunnel or route its pods' traffic to another
//! machine's address.
//!
//! Every agent watches every Node and Subnet, so what wakes a pass is kept
//! narrow: a Node's status heartbeat or a condition written on a Subnet
//! changes nothing a pass reads and wakes none (at 1,000 nodes those are
//! several writes a second, each of which would otherwise make every agent
//! diff all its peers against the kernel).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::watcher;
use weft_api::subnet::{Subnet, SubnetSpec, SubnetStatus};
use weft_api::watch::Projection;

use crate::lease::{Condition, publish_condition};
use crate::metrics::OverlayMetrics;
use crate::overlay::{Peer, Reconciler};

/// Field manager for the peer condition (separate from the one that writes
/// node facts, so neither apply removes the other's fields).
const FIELD_MANAGER: &str = "weft-agent-peers";
pub const CONDITION_PEERS: &str = "PeersProgrammed";
/// How long the first pass waits for the Node store.
const NODES_READY: Duration = Duration::from_secs(30);

/// What a pass reads of another node's Subnet: its spec and its status
/// without the conditions.
#[derive(Clone, Debug, PartialEq)]
struct PeerClaim {
    spec: SubnetSpec,
    status: SubnetStatus,
}

/// The claim of `subnet`, unless it is `local`'s own (this node's lease is
/// the lease holder's business, not a peer) or has no range yet (its node
/// waits for the pool to have one free: no peer until then).
fn claim_of(subnet: &Subnet, local: &str) -> Option<PeerClaim> {
    (subnet.spec.node_name != local && !subnet.spec.is_pending()).then(|| PeerClaim {
        spec: subnet.spec.clone(),
        status: SubnetStatus { conditions: Vec::new(), ..subnet.status.clone().unwrap_or_default() },
    })
}

/// The addresses a Node lists (unparsable ones left out).
fn listed_of(node: &Node) -> Option<Vec<IpAddr>> {
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    Some(addresses.map(|a| a.iter().filter_map(|a| a.address.parse().ok()).collect()).unwrap_or_default())
}

/// The watches a pass reads: the peers' claims and the Nodes' addresses.
pub struct PeerWatches {
    claims: Projection<PeerClaim>,
    listed: Projection<Vec<IpAddr>>,
    changed: Arc<tokio::sync::Notify>,
}

impl PeerWatches {
    /// Starts both watches for node `local`. They need no lease and no
    /// device, so the agent starts them first: at 1,000 nodes their
    /// listings take longer than the lease and the overlay device.
    pub fn start(subnets: &Api<Subnet>, nodes: Api<Node>, local: &str) -> Self {
        let changed = Arc::new(tokio::sync::Notify::new());
        let local = local.to_owned();
        let claims = weft_api::watch::project(
            subnets.clone(),
            watcher::Config::default(),
            "Subnet",
            move |s: &Subnet| claim_of(s, &local),
            Arc::clone(&changed),
        );
        let listed =
            weft_api::watch::project(nodes, watcher::Config::default(), "Node", listed_of, Arc::clone(&changed));
        PeerWatches { claims, listed, changed }
    }
}

/// Who runs the passes, and where they are counted.
pub struct PeerSync {
    pub subnets: Api<Subnet>,
    pub watches: PeerWatches,
    pub reconciler: Arc<Reconciler>,
    pub node: String,
    pub resync: Duration,
    pub metrics: OverlayMetrics,
}

/// Runs until the process ends (the watches retry with backoff on errors).
pub async fn run(sync: PeerSync) {
    let PeerSync { subnets: api, watches, reconciler, node, resync, metrics } = sync;
    let PeerWatches { claims, listed, changed } = watches;
    if claims.wait_until_ready().await.is_err() {
        tracing::error!("the Subnet watch ended before its first listing");
        return;
    }
    // Peers are not held back for ever by Nodes that cannot be read (a
    // role without them): their claims stay unchecked until the store fills.
    if !matches!(tokio::time::timeout(NODES_READY, listed.wait_until_ready()).await, Ok(Ok(()))) {
        tracing::error!(
            "cannot read Nodes: the node addresses peers claim are not checked until Nodes can be read (the agent's role needs list and watch on nodes)"
        );
    }
    tracing::info!("peers' Subnets and Nodes listed");
    // The first pass reads both listings: the wake-ups they left are done.
    let _ = futures::FutureExt::now_or_never(changed.notified());
    let mut last_condition: Option<(bool, String)> = None;
    loop {
        let subnets = claims.values();
        let listed = listed_by_node(&listed);
        let mut invalid = BTreeMap::new();
        let mut peers = Vec::new();
        for PeerClaim { spec, status } in subnets.iter().map(Arc::as_ref) {
            match Peer::parse(
                &spec.node_name,
                &spec.cidr,
                &spec.cidrs,
                spec.backend,
                (status.node_ip.as_deref(), status.node_ipv6.as_deref()),
                status.vtep_mac.as_deref(),
            ) {
                Ok(p) => match (
                    unlisted_claim(&p, listed.get(&p.node_name).map(|ips| ips.as_slice())),
                    wireguard_key(status.wireguard_public_key.as_deref()),
                ) {
                    (Some(why), _) | (None, Err(why)) => {
                        invalid.insert(spec.node_name.clone(), why);
                    }
                    (None, Ok(wireguard_key)) => peers.push(Peer {
                        vxlan_underlay: status.vxlan_underlay.unwrap_or_default(),
                        wireguard_key,
                        ..p
                    }),
                },
                Err(e) => {
                    invalid.insert(spec.node_name.clone(), e.to_string());
                }
            }
        }
        metrics.passes.inc();
        match reconciler.reconcile(&peers).await {
            Ok(report) => {
                metrics.pass_duration.observe(report.elapsed.as_secs_f64());
                metrics.peers_programmed.set(report.programmed.len() as i64);
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

/// The addresses each Node lists, by node name.
fn listed_by_node(listed: &Projection<Vec<IpAddr>>) -> HashMap<String, Arc<Vec<IpAddr>>> {
    listed.entries().into_iter().map(|((_, name), ips)| (name, ips)).collect()
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
    fn only_what_a_pass_reads_of_a_node_is_kept() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-2", "labels": {"a": "b"}},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.2"}, {"type": "Hostname", "address": "node-2"}],
                       "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-12-06T10:00:00Z"}]},
        }))
        .expect("a Node");
        assert_eq!(listed_of(&node), Some(vec!["10.0.0.2".parse::<IpAddr>().unwrap()]));
        // A heartbeat is no change to what is kept, so it wakes no pass.
        let mut beat = node.clone();
        let conditions = beat.status.as_mut().and_then(|s| s.conditions.as_mut()).expect("conditions");
        conditions[0].last_heartbeat_time = None;
        beat.metadata.labels = None;
        assert_eq!(listed_of(&beat), listed_of(&node));
        assert_eq!(listed_of(&Node::default()), Some(vec![]), "a Node without addresses leaves claims unchecked");
    }

    fn subnet(node: &str, status: serde_json::Value) -> Subnet {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet", "metadata": {"name": node},
            "spec": {"nodeName": node, "cidr": "10.244.2.0/24"}, "status": status,
        }))
        .expect("a Subnet")
    }

    #[test]
    fn a_condition_on_a_peers_subnet_is_no_change_but_its_address_is() {
        let facts = serde_json::json!({"nodeIP": "10.0.0.2", "vtepMAC": "02:00:00:00:00:02"});
        let claim = claim_of(&subnet("node-2", facts.clone()), "node-1").expect("a peer");
        assert_eq!(claim.status.node_ip.as_deref(), Some("10.0.0.2"));
        let mut with_condition = facts.clone();
        with_condition["conditions"] = serde_json::json!([{"type": "PeersProgrammed", "status": "False",
            "reason": "PeerProblems", "message": "x", "lastTransitionTime": "2026-12-06T10:00:00Z"}]);
        assert_eq!(claim_of(&subnet("node-2", with_condition), "node-1"), Some(claim.clone()));
        let moved = serde_json::json!({"nodeIP": "10.0.0.9", "vtepMAC": "02:00:00:00:00:02"});
        assert_ne!(claim_of(&subnet("node-2", moved), "node-1"), Some(claim));
        assert_eq!(claim_of(&subnet("node-1", facts.clone()), "node-1"), None, "this node's own lease is no peer");
        let mut waiting = subnet("node-3", facts);
        waiting.spec.cidr.clear();
        waiting.spec.cidrs.clear();
        assert_eq!(claim_of(&waiting, "node-1"), None, "a node waiting for a range is no peer yet");
    }
}
