//! The node's Subnet lease from the API: wait for it, then publish this
//! node's datapath facts (node IP, VTEP IP and MAC, Ready) in its status.

use futures::TryStreamExt;
use ipnet::Ipv4Net;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::json;
use weft_api::subnet::{Backend, CONDITION_READY, Subnet};

/// Field manager of everything the agent writes.
pub const FIELD_MANAGER: &str = "weft-agent";

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("watching Subnet {node}: {source}")]
    Watch { node: String, source: watcher::Error },
    #[error("the Subnet watch for node {0} ended")]
    Ended(String),
    #[error("publishing the status of Subnet {node}: {source}")]
    Publish { node: String, source: kube::Error },
}

/// What the agent takes from its Subnet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub cidr: Ipv4Net,
    pub backend: Backend,
}

/// Parses a Subnet's spec; `Err` says why it is unusable.
pub fn lease_of(subnet: &Subnet) -> Result<Lease, String> {
    let cidr: Ipv4Net =
        subnet.spec.cidr.parse().map_err(|e| format!("cidr {:?} is not an IPv4 CIDR: {e}", subnet.spec.cidr))?;
    if cidr != cidr.trunc() {
        return Err(format!("cidr {cidr} has host bits set"));
    }
    Ok(Lease { cidr, backend: subnet.spec.backend })
}

/// Waits until the Subnet named after `node` exists with a usable spec.
pub async fn wait_for(api: &Api<Subnet>, node: &str) -> Result<Lease, LeaseError> {
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let stream = watcher::watcher(api.clone(), config);
    futures::pin_mut!(stream);
    tracing::info!(node, "waiting for this node's Subnet lease");
    while let Some(event) =
        stream.try_next().await.map_err(|source| LeaseError::Watch { node: node.to_owned(), source })?
    {
        let subnet = match event {
            watcher::Event::Apply(s) | watcher::Event::InitApply(s) => s,
            _ => continue,
        };
        match lease_of(&subnet) {
            Ok(lease) => return Ok(lease),
            Err(why) => tracing::warn!(node, %why, "ignoring an unusable Subnet lease"),
        }
    }
    Err(LeaseError::Ended(node.to_owned()))
}

/// What the agent publishes about its node.
pub struct NodeFacts {
    pub node_ip: String,
    pub vtep_ip: Option<String>,
    pub vtep_mac: Option<String>,
}

/// Writes the agent's part of the Subnet status (facts and Ready=True) with server-side apply, so
/// the operator's fields (its own conditions) are left alone.
pub async fn publish(api: &Api<Subnet>, node: &str, facts: &NodeFacts) -> Result<(), LeaseError> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut st = json!({
        "nodeIP": facts.node_ip,
        "conditions": [{
            "type": CONDITION_READY,
            // Published once the datapath uses the lease; problems with peers
            // go to the PeersProgrammed condition (peer_sync.rs).
            "status": "True",
            "reason": "DatapathProgrammed",
            "message": "the node's agent uses this lease",
            "lastTransitionTime": now,
        }],
    });
    if let Some(ip) = &facts.vtep_ip {
        st["vtepIP"] = json!(ip);
    }
    if let Some(mac) = &facts.vtep_mac {
        st["vtepMAC"] = json!(mac);
    }
    let patch = json!({ "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet", "status": st });
    api.patch_status(node, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await
        .map_err(|source| LeaseError::Publish { node: node.to_owned(), source })?;
    Ok(())
}
