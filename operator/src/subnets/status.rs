//! What leasing writes besides the Subnet's spec: the `Allocated`
//! condition and the lease finalizer on Subnets, and for a node that waits
//! for space, a Subnet without a range saying so, the operator's condition
//! on the Node and an Event.

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard, PoisonError};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::json;
use weft_api::Subnet;
use weft_api::subnet::{CONDITION_ALLOCATED, LEASE_FINALIZER, REASON_POOL_EXHAUSTED, holds_lease};

use super::{Context, Error, FIELD_MANAGER, kube_err, managed};
use crate::ipam::Pool;

/// The nodes this replica reported as waiting for space.
#[derive(Default)]
pub struct Reported(Mutex<HashSet<String>>);

impl Reported {
    fn nodes(&self) -> MutexGuard<'_, HashSet<String>> {
        // Plain data; a panic elsewhere cannot leave it torn.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(super) async fn report_exhausted(ctx: &Context, node: &Node, pool: &Pool, in_pool: u128) {
    let name = node.name_any();
    ctx.metrics.pool_exhausted.inc();
    let note = format!(
        "no free /{} left in cluster CIDR {} ({} of {} subnets in use); the node gets one as soon as a Subnet is released",
        pool.node_prefix(),
        pool.cluster(),
        in_pool,
        pool.capacity()
    );
    tracing::warn!(node = %name, "{note}");
    ctx.reported.nodes().insert(name.clone());
    if !node_condition_is(node, "False") {
        set_node_condition(ctx, &name, "False", REASON_POOL_EXHAUSTED, &note).await;
    }
    report_on_subnet(ctx, &name, &note).await;
    let event = Event {
        type_: EventType::Warning,
        reason: REASON_POOL_EXHAUSTED.into(),
        note: Some(note),
        action: "AllocateSubnet".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &node.object_ref(&())).await {
        tracing::warn!(error = %e, node = %name, "publishing exhaustion event failed");
    }
}

/// The node's Subnet says that it waits: made without a range when there
/// is none, with `Allocated=False`. A leased Subnet (a dual-stack lease
/// waiting for its other family's block) is left as it is: its node runs
/// pods. Best effort, as the Node condition: the Event and metric report
/// exhaustion whatever happens here, and the next attempt tries again.
async fn report_on_subnet(ctx: &Context, node: &str, note: &str) {
    let subnet = match ctx.subnets.get(&ObjectRef::new(node)) {
        Some(s) if !s.spec.is_pending() || allocated_is(&s, "False") => return,
        Some(s) => Subnet::clone(&s),
        None => {
            let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
            if ctx.term.check().is_err() {
                return;
            }
            match ctx.subnets_api.create(&pp, &super::plan::waiting_subnet(node, &ctx.config)).await {
                Ok(s) => {
                    ctx.allocator.note_write(&s);
                    ctx.sightings.wrote(&s, &ctx.subnets);
                    s
                }
                // One this replica's view lacks: the next attempt sees it.
                Err(kube::Error::Api(s)) if s.code == 409 => return,
                Err(e) => {
                    tracing::warn!(error = %e, %node, "making the Subnet of a node waiting for space failed");
                    return;
                }
            }
        }
    };
    if let Err(e) = set_allocated(ctx, &subnet, "False", REASON_POOL_EXHAUSTED, note).await {
        tracing::warn!(error = %e, %node, "setting Allocated=False on the node's Subnet failed");
    }
}

fn allocated_is(subnet: &Subnet, status: &str) -> bool {
    subnet
        .status
        .as_ref()
        .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == CONDITION_ALLOCATED && c.status == status))
}

/// Node condition the operator owns: whether the node has a pod CIDR lease.
pub const NODE_CONDITION: &str = "WeftSubnetAllocated";

fn node_condition_is(node: &Node, status: &str) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == NODE_CONDITION && c.status == status))
}

/// Flips [`NODE_CONDITION`] to True for a node that was reported exhausted
/// (by this replica, or by a predecessor as the condition shows). Other
/// nodes never get the condition, which saves a write per node.
pub(super) async fn clear_exhausted(ctx: &Context, node: &Node, subnet: &Subnet) {
    let name = node.name_any();
    let reported = ctx.reported.nodes().remove(&name);
    if reported || node_condition_is(node, "False") {
        let msg = format!("leased {}", subnet.spec.blocks().collect::<Vec<_>>().join(","));
        set_node_condition(ctx, &name, "True", "SubnetAllocated", &msg).await;
    }
}

/// Sets [`NODE_CONDITION`] on the Node (server-side apply: kubelet's own
/// conditions are untouched). Best effort: without `nodes/status` RBAC the
/// Event and metric still report exhaustion.
async fn set_node_condition(ctx: &Context, node: &str, status: &str, reason: &str, message: &str) {
    let now = Timestamp::now().to_string();
    let patch = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "status": {"conditions": [{
            "type": NODE_CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }]},
    });
    if ctx.term.check().is_err() {
        return;
    }
    if let Err(e) =
        ctx.nodes_api.patch_status(node, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch)).await
    {
        tracing::warn!(error = %e, %node, "setting node condition {NODE_CONDITION} failed");
    }
}

/// Subnets made by earlier operators: adds the lease finalizer and drops the
/// owner reference to the Node (see [`plan::new_subnet`](super::plan::new_subnet)). One patch, guarded by
/// the resourceVersion.
pub(super) async fn ensure_lease_metadata(ctx: &Context, subnet: &Subnet) -> Result<(), Error> {
    let has_finalizer = holds_lease(subnet);
    let node_owned = subnet.owner_references().iter().any(|o| o.kind == "Node" && o.api_version == "v1");
    if (has_finalizer && !node_owned) || !managed(ctx, subnet) {
        return Ok(());
    }
    let mut finalizers = subnet.finalizers().to_vec();
    if !has_finalizer {
        finalizers.push(LEASE_FINALIZER.to_string());
    }
    let owners: Vec<_> =
        subnet.owner_references().iter().filter(|o| !(o.kind == "Node" && o.api_version == "v1")).collect();
    let patch = json!({"metadata": {
        "resourceVersion": subnet.resource_version(),
        "finalizers": finalizers,
        "ownerReferences": owners,
    }});
    patch_metadata(ctx, subnet, &patch).await
}

/// Merge-patches a Subnet's metadata; a conflict or a gone Subnet is left to
/// the next reconcile, which sees the newer object.
pub(super) async fn patch_metadata(ctx: &Context, subnet: &Subnet, patch: &serde_json::Value) -> Result<(), Error> {
    let name = subnet.name_any();
    ctx.term.check()?;
    match ctx.subnets_api.patch(&name, &PatchParams::default(), &Patch::Merge(patch)).await {
        Ok(written) => {
            ctx.sightings.wrote(&written, &ctx.subnets);
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(kube_err("updating metadata of", &name)(e)),
    }
}

/// Sets `Allocated=True` (server-side apply: the agent owns `Ready`).
pub(super) async fn ensure_allocated_condition(ctx: &Context, subnet: &Subnet) -> Result<(), Error> {
    if allocated_is(subnet, "True") {
        return Ok(());
    }
    let message = format!("{} leased to node {}", subnet.spec.cidr, subnet.spec.node_name);
    set_allocated(ctx, subnet, "True", "LeaseGranted", &message).await
}

/// Writes the Subnet's `Allocated` condition.
async fn set_allocated(ctx: &Context, subnet: &Subnet, status: &str, reason: &str, message: &str) -> Result<(), Error> {
    let name = subnet.name_any();
    let condition = Condition {
        type_: CONDITION_ALLOCATED.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: Time(Timestamp::now()),
        observed_generation: subnet.metadata.generation,
    };
    let patch = json!({
        "apiVersion": "weft.dev/v1alpha1",
        "kind": "Subnet",
        "status": {"conditions": [condition]},
    });
    ctx.term.check()?;
    match ctx.subnets_api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch)).await {
        Ok(written) => {
            ctx.sightings.wrote(&written, &ctx.subnets);
            Ok(())
        }
        // Deleted meanwhile: the next reconcile reallocates.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(kube_err("updating status of", &name)(e)),
    }
}
