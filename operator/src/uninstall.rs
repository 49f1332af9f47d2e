//! `weft-operator --uninstall`: what the chart's post-delete hook runs once
//! the operator and the agents are gone. Removes the objects Weft made
//! (Subnets, HostPortAllocations, PodEndpoints); NetworkPolicies are the
//! users' and stay.

use anyhow::Context;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, ResourceExt};
use weft_api::host_port::HostPortAllocation;
use weft_api::pod_endpoint::PodEndpoint;
use weft_api::subnet::{Subnet, holds_lease, let_go_patch};

/// How many objects of each kind [`remove_weft_objects`] deleted.
#[derive(Debug, Default)]
pub struct Removed {
    pub subnets: usize,
    pub allocations: usize,
    pub endpoints: usize,
}

/// Deletes every Subnet, HostPortAllocation and PodEndpoint.
pub async fn remove_weft_objects(client: Client) -> anyhow::Result<Removed> {
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
    let allocations = delete_namespaced::<HostPortAllocation>(&client, "HostPortAllocation").await?;
    let endpoints = delete_namespaced::<PodEndpoint>(&client, "PodEndpoint").await?;
    Ok(Removed { subnets: listed.items.len(), allocations, endpoints })
}

/// Deletes every object of a namespaced kind; returns how many.
async fn delete_namespaced<K>(client: &Client, kind: &str) -> anyhow::Result<usize>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let all: Api<K> = Api::all(client.clone());
    let listed = all.list(&ListParams::default()).await.with_context(|| format!("listing {kind}s"))?;
    for o in &listed.items {
        let ns = o.namespace().unwrap_or_default();
        let api: Api<K> = Api::namespaced(client.clone(), &ns);
        delete_ignoring_gone(&api, &o.name_any())
            .await
            .with_context(|| format!("deleting {kind} {ns}/{}", o.name_any()))?;
    }
    Ok(listed.items.len())
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
