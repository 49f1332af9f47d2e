//! Keeps the overlay in step with the cluster's Subnets. A watch feeds an
//! in-memory store; every change, and a periodic resync, runs one reconcile
//! pass over all peers (level-triggered: the pass diffs against the kernel,
//! so a missed event or a hand-deleted entry is repaired by the next one).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::json;
use weft_api::subnet::Subnet;

use crate::overlay::{Peer, Reconciler};

/// Field manager for the peer condition (separate from the one that writes
/// node facts, so neither apply removes the other's fields).
const FIELD_MANAGER: &str = "weft-agent-peers";
pub const CONDITION_PEERS: &str = "PeersProgrammed";

/// Runs until the watch ends for good (it retries with backoff on errors).
pub async fn run(api: Api<Subnet>, reconciler: Arc<Reconciler>, node: String, resync: Duration) {
    let changed = Arc::new(tokio::sync::Notify::new());
    let reader = weft_api::watch::reflect(
        api.clone(),
        watcher::Config::default(),
        "Subnet",
        weft_api::watch::keep_all,
        Some(Arc::clone(&changed)),
    );
    if reader.wait_until_ready().await.is_err() {
        tracing::error!("the Subnet store was dropped before it was ready");
        return;
    }
    let mut last_condition: Option<(bool, String)> = None;
    loop {
        let subnets = reader.state();
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
                Ok(p) => peers
                    .push(Peer { vxlan_underlay: status.and_then(|st| st.vxlan_underlay).unwrap_or_default(), ..p }),
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

fn describe(invalid: &BTreeMap<String, String>) -> String {
    if invalid.is_empty() {
        return "every peer's routes, neighbour and FDB entries are programmed".to_owned();
    }
    invalid.iter().map(|(peer, why)| format!("{peer}: {why}")).collect::<Vec<_>>().join("; ")
}

async fn publish(api: &Api<Subnet>, node: &str, (ok, message): &(bool, String)) -> Result<(), kube::Error> {
    let patch = json!({
        "apiVersion": "weft.dev/v1alpha1",
        "kind": "Subnet",
        "status": {"conditions": [{
            "type": CONDITION_PEERS,
            "status": if *ok { "True" } else { "False" },
            "reason": if *ok { "AllPeersProgrammed" } else { "PeerProblems" },
            "message": message,
            "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string(),
        }]},
    });
    api.patch_status(node, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await.map(|_| ())
}
