//! Subnet leases: every managed Node gets exactly one Subnet (named after
//! the node) carved from the cluster CIDR.
//!
//! A lease follows the node's name, not the Node object: a node that
//! re-registers (its Node deleted and created again) keeps it. A Subnet is
//! withdrawn (deleted) when its Node has been absent for the release grace
//! period, or when it overlaps one that keeps its block (see [`Claim`]). Its
//! finalizer keeps the block reserved until nobody uses it: the node's agent
//! removes it once its pods are gone; for a node that is gone, or whose
//! agent never used the lease, this operator does once no pod in the API
//! holds an address from it.
//!
//! The Subnet objects are the only state. Allocation lists them from the API
//! under a lock (so this replica never hands out one block twice), and the
//! deterministic name makes a concurrent creator conflict instead of
//! duplicating. If overlapping Subnets exist anyway (e.g. written by hand,
//! restored from a backup, or by a replica that lost its lease mid-flight),
//! the one no live node uses, else the newer, is withdrawn and its node gets
//! a fresh lease once the block is let go.

//!
//! Parts: [`plan`] (pure: who gets which block, when a withdrawn block may
//! be let go), [`allocate`] (batched allocation under one lock),
//! [`status`] (conditions, finalizer and Events), [`release`] (withdrawal
//! and letting go). This file wires them into the two reconcilers.

mod allocate;
mod plan;
mod release;
mod sightings;
mod status;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::Store;
use weft_api::Subnet;

pub use allocate::Allocator;
pub use plan::{Decision, blocks, plan};
use sightings::Freshest;
pub use sightings::Sightings;
pub use status::NODE_CONDITION;

use crate::config::Config;
use crate::ipam::Pool;
use crate::leader::{NotLeader, Term};
use crate::metrics::Metrics;

pub const FIELD_MANAGER: &str = "weft-operator";
/// Label on every Subnet naming its node, for selectors and humans.
pub use weft_api::NODE_LABEL;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{action} subnet {name}: {source}")]
    Kube {
        action: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("allocating subnet for node {0}: {1}")]
    Alloc(String, String),
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
}

fn kube_err(action: &'static str, name: &str) -> impl FnOnce(kube::Error) -> Error + use<> {
    let name = name.to_string();
    move |source| Error::Kube { action, name, source }
}

/// Shared by both reconcilers: the API and its caches, the pools, and the
/// state of each part (which owns its locks).
pub struct Context {
    pub nodes_api: Api<Node>,
    pub subnets_api: Api<Subnet>,
    pub nodes: Store<Node>,
    pub subnets: Store<Subnet>,
    pub pool: Pool,
    /// The other address family's pool in a dual-stack cluster.
    pub secondary: Option<Pool>,
    pub config: Config,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    /// Checked before every write: a replica whose term as leader is over
    /// allocates and releases nothing.
    pub term: Term,
    pub allocator: Allocator,
    /// Nodes this replica reported as waiting for space.
    pub reported: status::Reported,
    /// Since when each Subnet's node has been seen absent.
    pub absences: release::Absences,
    /// What the node controller's Subnet watch saw that `subnets` may lack,
    /// and this replica's Subnet writes.
    pub sightings: Arc<Sightings<Subnet>>,
    /// What the Subnet controller's Node watch saw that `nodes` may lack.
    pub node_sightings: Arc<Sightings<Node>>,
}

/// Reconciles one Node: make sure it has exactly one valid Subnet.
pub async fn reconcile_node(node: Arc<Node>, ctx: Arc<Context>) -> Result<Action, Error> {
    // A replica whose term is over does not even plan: its caches may be stale.
    ctx.term.check()?;
    let started = Instant::now();
    let result = reconcile_node_inner(&node, &ctx).await;
    ctx.metrics.observe("node", started.elapsed(), result.is_err());
    result
}

async fn reconcile_node_inner(node: &Node, ctx: &Context) -> Result<Action, Error> {
    let name = node.name_any();
    if node.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    // A Subnet of this name, also one left by an earlier Node object of the
    // same name, is this node's lease: it keeps it. The cache's copy is
    // used, or this replica's newer write of it; it is read from the API
    // only when the event that triggered this reconcile (another watch) is
    // newer than both: a just-deleted Subnet may linger in the cache and
    // would leave the node without a lease until the resync. One the cache
    // does not show needs no read: allocating plans from a view at least as
    // new as this replica's writes, and a Subnet it misses still holds the
    // name (the create answers 409 and the node is planned again).
    let cached = ctx.subnets.get(&ObjectRef::new(&name));
    let current = match ctx.sightings.freshest(&name, cached.as_deref()) {
        Freshest::Cache => cached.map(|c| Subnet::clone(&c)),
        Freshest::Written(subnet) => Some(*subnet),
        Freshest::Read => ctx.subnets_api.get_opt(&name).await.map_err(kube_err("reading", &name))?,
    };
    match current {
        // Waiting for a range, or from before the cluster was made
        // dual-stack (it gets a block of the other family).
        Some(subnet)
            if subnet.metadata.deletion_timestamp.is_none()
                && (subnet.spec.is_pending() || lacks_secondary(ctx, &subnet)) =>
        {
            allocate::allocate(node, ctx).await
        }
        Some(subnet) => keep_lease(ctx, node, &subnet).await,
        None => allocate::allocate(node, ctx).await,
    }
}

/// The node has a Subnet: a withdrawn one is waited out (the node gets a new
/// lease once the old block is let go), a live one gets the finalizer and
/// the Allocated condition.
async fn keep_lease(ctx: &Context, node: &Node, subnet: &Subnet) -> Result<Action, Error> {
    if subnet.metadata.deletion_timestamp.is_some() {
        tracing::debug!(node = %node.name_any(), "the node's withdrawn lease is not let go yet");
        return Ok(Action::requeue(Duration::from_secs(10)));
    }
    status::ensure_lease_metadata(ctx, subnet).await?;
    status::ensure_allocated_condition(ctx, subnet).await?;
    status::clear_exhausted(ctx, node, subnet).await;
    Ok(Action::requeue(ctx.config.resync()))
}

/// `subnet`, or this replica's newer write of it.
fn newest_known(ctx: &Context, subnet: Subnet) -> Subnet {
    match ctx.sightings.freshest(&subnet.name_any(), Some(&subnet)) {
        Freshest::Written(written) => *written,
        Freshest::Cache | Freshest::Read => subnet,
    }
}

/// Reconciles one Subnet: release it when its Node is gone (or replaced),
/// and delete the newer of two overlapping Subnets.
pub async fn reconcile_subnet(subnet: Arc<Subnet>, ctx: Arc<Context>) -> Result<Action, Error> {
    ctx.term.check()?;
    let started = Instant::now();
    let result = release::reconcile(&subnet, &ctx).await;
    ctx.metrics.observe("subnet", started.elapsed(), result.is_err());
    result
}

/// Whether a live lease lacks the block of the secondary pool's family.
fn lacks_secondary(ctx: &Context, subnet: &Subnet) -> bool {
    ctx.secondary.is_some_and(|p| managed(ctx, subnet) && !blocks(subnet).any(|b| p.contains(&b)))
}

/// Only touch Subnets inside our pool, so that operators with other pools
/// (or hand-made leases outside it) are left alone.
fn managed(ctx: &Context, subnet: &Subnet) -> bool {
    subnet.spec.cidr.parse::<IpNet>().is_ok_and(|n| ctx.pool.contains(&n))
}

fn update_lease_gauges(ctx: &Context) {
    let allocated = ctx
        .subnets
        .state()
        .iter()
        .filter(|s| s.spec.cidr.parse::<IpNet>().is_ok_and(|n| ctx.pool.contains(&n)))
        .count() as u128;
    ctx.metrics.set_leases(allocated, ctx.pool.capacity());
}

/// Retry policy for failed reconciles.
pub fn error_policy<K>(_obj: Arc<K>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(%error, "reconcile failed, retrying");
    Action::requeue(Duration::from_secs(2))
}
