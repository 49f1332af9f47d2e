//! `weft-operator --uninstall`: what the chart's post-delete hook runs once
//! the operator and the agents are gone. Removes the objects Weft made
//! (Subnets, HostPortAllocations); NetworkPolicies are the users' and stay.

use anyhow::Context;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, ResourceExt};
use weft_api::host_port::HostPortAllocation;
use weft_api::subnet::{Subnet, holds_lease, let_go_patch};

/// Deletes every Subnet and HostPortAllocation; returns how many of each.
pub async fn remove_weft_objects(client: Client) -> anyhow::Result<(usize, usize)> {
    let subnets: Api<Subnet> = Api::all(client.clone());
    let listed = subnets.list(&ListParams::default()).await.context("listing Subnets")?;
    for s in &listed.items {
        // No agent is left to let the lease go: the network itself goes.
        if holds_lease(s) {
            match subnets.patch(&s.name_any(), &PatchParams::default(), &Patch::Merge(&let_go_patch(s))).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => continue,
                Err(e) => {
                    return Err(e).with_context(|| format!("removing the lease finalizer of Subnet {}", s.name_any()));
                }
            }
        }
        delete_ignoring_gone(&subnets, &s.name_any())
            .await
            .with_context(|| format!("deleting Subnet {}", s.name_any()))?;
    }
    let all: Api<HostPortAllocation> = Api::all(client.clone());
    let allocations = all.list(&ListParams::default()).await.context("listing HostPortAllocations")?;
    for a in &allocations.items {
        let ns = a.namespace().unwrap_or_default();
        let api: Api<HostPortAllocation> = Api::namespaced(client.clone(), &ns);
        delete_ignoring_gone(&api, &a.name_any())
            .await
            .with_context(|| format!("deleting HostPortAllocation {ns}/{}", a.name_any()))?;
    }
    Ok((listed.items.len(), allocations.items.len()))
}

async fn delete_ignoring_gone<K>(api: &Api<K>, name: &str) -> Result<(), kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}
