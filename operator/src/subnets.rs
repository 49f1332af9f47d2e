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

use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions, VersionMatch};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::sync::Mutex;
use weft_api::Subnet;
use weft_api::subnet::{
    CONDITION_ALLOCATED, CONDITION_READY, LEASE_FINALIZER, REASON_LEASE_WITHDRAWN, SubnetSpec, holds_lease,
    let_go_patch,
};

use crate::config::Config;
use crate::ipam::{Pool, overlaps};
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

/// Shared by both reconcilers.
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
    /// Serialises list-then-create so this replica never double-allocates.
    pub alloc_lock: Mutex<()>,
    /// Nodes waiting for the allocation lock; served in batches.
    pub pending: std::sync::Mutex<Vec<AllocRequest>>,
    /// Nodes this replica reported as waiting for space.
    pub exhausted_nodes: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Newest resourceVersion of a Subnet this replica created.
    pub last_write_rv: std::sync::Mutex<Option<(String, u64)>>,
    /// Set while some node is waiting for space; a Subnet deletion then
    /// retriggers all nodes.
    pub waiting_for_space: std::sync::atomic::AtomicBool,
    /// Count of Subnet deletions seen, so an allocation that found no space
    /// can tell whether space was freed while it was looking.
    pub deletions: std::sync::atomic::AtomicU64,
    /// Since when each Subnet's node has been seen absent (this replica's
    /// view: a new leader starts counting again, which only delays).
    pub absent_since: std::sync::Mutex<std::collections::HashMap<String, Instant>>,
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
    // Read from the API, not the cache: a just-deleted Subnet may linger in
    // the cache and would leave the node without a lease until the resync.
    // A Subnet of this name, also one left by an earlier Node object of the
    // same name, is this node's lease: it keeps it.
    let current = ctx.subnets_api.get_opt(&name).await.map_err(kube_err("reading", &name))?;
    match current {
        // A lease from before the cluster was made dual-stack gets a block of the other family.
        Some(subnet) if subnet.metadata.deletion_timestamp.is_none() && lacks_secondary(ctx, &subnet) => {
            allocate(node, ctx).await
        }
        Some(subnet) => keep_lease(ctx, node, &subnet).await,
        None => allocate(node, ctx).await,
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
    ensure_lease_metadata(ctx, subnet).await?;
    ensure_allocated_condition(ctx, subnet).await?;
    clear_exhausted(ctx, node, subnet).await;
    Ok(Action::requeue(ctx.config.resync()))
}

/// One node waiting for a lease.
pub struct AllocRequest {
    node: String,
    reply: tokio::sync::oneshot::Sender<Outcome>,
}

enum Outcome {
    Created(Box<Subnet>),
    Exists(Box<Subnet>),
    Exhausted {
        pool: Pool,
        in_pool: u128,
        space_freed_meanwhile: bool,
    },
    /// Someone else created it between our list and create.
    Conflict,
    Failed(String),
}

/// Gets the node a lease: queues the request, and whoever holds the
/// allocation lock serves every queued request with one fresh list of all
/// Subnets. Batching keeps "list before allocating" without one list per
/// node when hundreds join at once.
async fn allocate(node: &Node, ctx: &Context) -> Result<Action, Error> {
    let name = node.name_any();
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    lock_pending(ctx).push(AllocRequest { node: name.clone(), reply: tx });
    let outcome = match rx.try_recv() {
        Ok(o) => o,
        Err(_) => {
            let guard = ctx.alloc_lock.lock().await;
            // A previous holder may have served us already; if not, we
            // serve the queue (which holds our request) ourselves.
            let batch = std::mem::take(&mut *lock_pending(ctx));
            if !batch.is_empty() {
                serve_batch(ctx, batch).await;
            }
            drop(guard);
            rx.try_recv().map_err(|_| Error::Alloc(name.clone(), "request was dropped".into()))?
        }
    };

    match outcome {
        Outcome::Created(subnet) => {
            tracing::info!(node = %name, cidr = %subnet.spec.cidr, "allocated subnet");
            ensure_allocated_condition(ctx, &subnet).await?;
            clear_exhausted(ctx, node, &subnet).await;
            Ok(Action::requeue(ctx.config.resync()))
        }
        Outcome::Exists(subnet) => keep_lease(ctx, node, &subnet).await,
        Outcome::Conflict => Ok(Action::requeue(Duration::ZERO)),
        Outcome::Failed(e) => Err(Error::Alloc(name, e)),
        Outcome::Exhausted { space_freed_meanwhile: true, .. } => Ok(Action::requeue(Duration::from_millis(100))),
        Outcome::Exhausted { pool, in_pool, space_freed_meanwhile: false } => {
            report_exhausted(ctx, node, &pool, in_pool).await;
            // Deletions wake us early; this is the fallback.
            Ok(Action::requeue(Duration::from_secs(10)))
        }
    }
}

fn lock_pending(ctx: &Context) -> std::sync::MutexGuard<'_, Vec<AllocRequest>> {
    // The queue holds plain data; a panic elsewhere cannot leave it torn.
    ctx.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves a batch of requests. Must run under `alloc_lock`.
async fn serve_batch(ctx: &Context, batch: Vec<AllocRequest>) {
    use std::sync::atomic::Ordering;
    let deletions_before = ctx.deletions.load(Ordering::SeqCst);
    let existing = match list_subnets(ctx).await {
        Ok(list) => list,
        Err(e) => {
            let msg = format!("listing subnets: {e}");
            for req in batch {
                let _ = req.reply.send(Outcome::Failed(msg.clone()));
            }
            return;
        }
    };
    let (existing, fully_consistent) = existing;
    let nodes: Vec<&str> = batch.iter().map(|r| r.node.as_str()).collect();
    let (decisions, mut in_pool) = plan(&existing, &nodes, &ctx.pool, ctx.secondary.as_ref(), fully_consistent);
    let mut to_create = Vec::new();
    let mut to_extend = Vec::new();
    let mut retry = Vec::new();
    for (req, decision) in batch.into_iter().zip(decisions) {
        match decision {
            Decision::Has(i) => {
                let _ = req.reply.send(Outcome::Exists(Box::new(existing[i].clone())));
            }
            Decision::Lease(cidrs) => {
                let subnet = new_subnet(&req.node, &cidrs, &ctx.config);
                to_create.push((req, subnet));
            }
            Decision::Extend(i, cidr) => to_extend.push((req, &existing[i], cidr)),
            Decision::LookAgain => retry.push(req),
            Decision::Exhausted { pool, in_use } => {
                ctx.waiting_for_space.store(true, Ordering::SeqCst);
                let freed = ctx.deletions.load(Ordering::SeqCst) != deletions_before;
                let _ = req.reply.send(Outcome::Exhausted { pool, in_pool: in_use, space_freed_meanwhile: freed });
            }
        }
    }
    if let Err(e) = ctx.term.check() {
        for req in to_create.into_iter().map(|(r, _)| r).chain(to_extend.into_iter().map(|(r, ..)| r)) {
            let _ = req.reply.send(Outcome::Failed(e.to_string()));
        }
        return;
    }
    let extended = futures::future::join_all(to_extend.iter().map(|(_, s, cidr)| extend(ctx, s, *cidr))).await;
    for ((req, ..), outcome) in to_extend.into_iter().zip(extended) {
        let _ = req.reply.send(outcome);
    }
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    let results = futures::future::join_all(to_create.iter().map(|(_, s)| ctx.subnets_api.create(&pp, s))).await;
    for ((req, _), result) in to_create.into_iter().zip(results) {
        let outcome = match result {
            Ok(s) => {
                note_write(ctx, &s);
                Outcome::Created(Box::new(s))
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                in_pool = in_pool.saturating_sub(1);
                Outcome::Conflict
            }
            Err(e) => {
                in_pool = in_pool.saturating_sub(1);
                Outcome::Failed(format!("creating subnet: {e}"))
            }
        };
        let _ = req.reply.send(outcome);
    }
    ctx.metrics.set_leases(in_pool, ctx.pool.capacity());
    if !retry.is_empty() {
        // Forget the cheap-list hint so the rerun lists fully consistently.
        *lock_rv(ctx) = None;
        Box::pin(serve_batch(ctx, retry)).await;
    }
}

/// What an allocation pass does for one waiting node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The node has a Subnet already: `existing[i]` (also a withdrawn one,
    /// which the node waits out).
    Has(usize),
    /// Lease these blocks: the primary pool's, then the secondary's.
    Lease(Vec<IpNet>),
    /// `existing[i]` has no block of the secondary pool's family yet: add this one.
    Extend(usize, IpNet),
    /// No block is free in what was listed, but the list may have missed
    /// deletions: list again fully consistently before reporting exhaustion.
    LookAgain,
    /// `pool` has no free block (`in_use` of them are leased).
    Exhausted { pool: Pool, in_use: u128 },
}

/// The allocation plan, pure: for each waiting node in order, from every
/// Subnet listed (withdrawn ones included: their blocks stay reserved until
/// let go), the pool and, in a dual-stack cluster, the other family's pool.
/// A new node gets a block of each; a lease from before the cluster was
/// made dual-stack gets the block it lacks. Also returns how many blocks of
/// the primary pool are then in use.
pub fn plan(
    existing: &[Subnet],
    nodes: &[&str],
    pool: &Pool,
    secondary: Option<&Pool>,
    fully_consistent: bool,
) -> (Vec<Decision>, u128) {
    let mut used: Vec<IpNet> = existing.iter().flat_map(blocks).collect();
    let mut in_pool = used.iter().filter(|n| pool.contains(n)).count() as u128;
    let lease_from = |p: &Pool, used: &mut Vec<IpNet>| match p.next_free(used.as_slice()) {
        Some(cidr) => {
            used.push(cidr);
            Ok(cidr)
        }
        None if !fully_consistent => Err(Decision::LookAgain),
        None => Err(Decision::Exhausted { pool: *p, in_use: used.iter().filter(|n| p.contains(n)).count() as u128 }),
    };
    let decisions = nodes
        .iter()
        .map(|node| {
            if let Some(i) = existing.iter().position(|s| s.name_any() == *node) {
                let missing = secondary.filter(|p| {
                    existing[i].metadata.deletion_timestamp.is_none() && !blocks(&existing[i]).any(|b| p.contains(&b))
                });
                return match missing {
                    Some(p) => lease_from(p, &mut used).map(|cidr| Decision::Extend(i, cidr)).unwrap_or_else(|d| d),
                    None => Decision::Has(i),
                };
            }
            let first = match lease_from(pool, &mut used) {
                Ok(cidr) => cidr,
                Err(d) => return d,
            };
            let mut cidrs = vec![first];
            if let Some(p) = secondary {
                match lease_from(p, &mut used) {
                    Ok(cidr) => cidrs.push(cidr),
                    Err(d) => {
                        // Not leased after all: the node waits for both.
                        used.retain(|u| *u != first);
                        return d;
                    }
                }
            }
            in_pool += 1;
            Decision::Lease(cidrs)
        })
        .collect();
    (decisions, in_pool)
}

/// Every block a Subnet reserves, parsed (one per family).
pub fn blocks(subnet: &Subnet) -> impl Iterator<Item = IpNet> + '_ {
    subnet.spec.blocks().filter_map(|b| b.parse().ok())
}

/// Whether a live lease lacks the block of the secondary pool's family.
fn lacks_secondary(ctx: &Context, subnet: &Subnet) -> bool {
    ctx.secondary.is_some_and(|p| managed(ctx, subnet) && !blocks(subnet).any(|b| p.contains(&b)))
}

/// Adds `cidr` to a lease from before the cluster was made dual-stack,
/// guarded by the resourceVersion the plan saw (a changed Subnet answers
/// 409 and the node is planned again).
async fn extend(ctx: &Context, subnet: &Subnet, cidr: IpNet) -> Outcome {
    let cidrs: Vec<String> = subnet.spec.blocks().map(str::to_owned).chain([cidr.to_string()]).collect();
    let patch = json!({"metadata": {"resourceVersion": subnet.resource_version()}, "spec": {"cidrs": cidrs}});
    let pp = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    match ctx.subnets_api.patch(&subnet.name_any(), &pp, &Patch::Merge(&patch)).await {
        Ok(s) => {
            note_write(ctx, &s);
            tracing::info!(subnet = %s.name_any(), %cidr, "added a block of the other address family to the lease");
            Outcome::Exists(Box::new(s))
        }
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Outcome::Conflict,
        Err(e) => Outcome::Failed(format!("adding {cidr} to subnet {}: {e}", subnet.name_any())),
    }
}

/// Lists all Subnets, at least as new as this replica's last write (what
/// allocation needs: as leader we are the only allocator). That is served
/// from the apiserver's watch cache without the consistency round-trip a
/// plain list waits for (up to 100 ms). Before any write, or after a reset,
/// the list is fully consistent. Returns whether it was.
async fn list_subnets(ctx: &Context) -> Result<(Vec<Subnet>, bool), kube::Error> {
    let since = lock_rv(ctx).clone();
    let lp = match &since {
        Some((rv, _)) => ListParams::default().at(rv).matching(VersionMatch::NotOlderThan),
        None => ListParams::default(),
    };
    let list = ctx.subnets_api.list(&lp).await?;
    Ok((list.items, since.is_none()))
}

/// Remembers the newest resourceVersion this replica wrote.
fn note_write(ctx: &Context, subnet: &Subnet) {
    let Some(rv) = subnet.resource_version() else { return };
    // etcd-backed resourceVersions are integers; anything else disables
    // the shortcut (consistent lists are always correct, just slower).
    let Ok(n) = rv.parse::<u64>() else {
        *lock_rv(ctx) = None;
        return;
    };
    let mut last = lock_rv(ctx);
    if last.as_ref().is_none_or(|(_, m)| n > *m) {
        *last = Some((rv, n));
    }
}

fn lock_rv(ctx: &Context) -> std::sync::MutexGuard<'_, Option<(String, u64)>> {
    ctx.last_write_rv.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn report_exhausted(ctx: &Context, node: &Node, pool: &Pool, in_pool: u128) {
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
    lock_exhausted(ctx).insert(name.clone());
    if !node_condition_is(node, "False") {
        set_node_condition(ctx, &name, "False", "SubnetPoolExhausted", &note).await;
    }
    let event = Event {
        type_: EventType::Warning,
        reason: "SubnetPoolExhausted".into(),
        note: Some(note),
        action: "AllocateSubnet".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &node.object_ref(&())).await {
        tracing::warn!(error = %e, node = %name, "publishing exhaustion event failed");
    }
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
async fn clear_exhausted(ctx: &Context, node: &Node, subnet: &Subnet) {
    let name = node.name_any();
    let reported = lock_exhausted(ctx).remove(&name);
    if reported || node_condition_is(node, "False") {
        let msg = format!("leased {}", subnet.spec.blocks().collect::<Vec<_>>().join(","));
        set_node_condition(ctx, &name, "True", "SubnetAllocated", &msg).await;
    }
}

fn lock_exhausted(ctx: &Context) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
    ctx.exhausted_nodes.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

/// A lease of `cidrs` (the primary pool's block first; two in a dual-stack cluster).
fn new_subnet(node: &str, cidrs: &[IpNet], config: &Config) -> Subnet {
    let backend: weft_api::Backend = config.backend.into();
    let mut subnet = Subnet::new(
        node,
        SubnetSpec {
            node_name: node.to_string(),
            cidr: cidrs.first().map(IpNet::to_string).unwrap_or_default(),
            cidrs: if cidrs.len() > 1 { cidrs.iter().map(IpNet::to_string).collect() } else { Vec::new() },
            backend,
            vni: (backend == weft_api::Backend::Vxlan).then_some(config.vni),
            mtu: config.mtu,
        },
    );
    subnet.metadata.labels = Some([(NODE_LABEL.to_string(), node.to_string())].into());
    // No owner reference to the Node: the garbage collector would withdraw
    // the lease the moment a Node object is deleted, also when the node
    // registers again at once with its pods still running.
    subnet.metadata.finalizers = Some(vec![LEASE_FINALIZER.to_string()]);
    subnet
}

/// Subnets made by earlier operators: adds the lease finalizer and drops the
/// owner reference to the Node (see [`new_subnet`]). One patch, guarded by
/// the resourceVersion.
async fn ensure_lease_metadata(ctx: &Context, subnet: &Subnet) -> Result<(), Error> {
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
async fn patch_metadata(ctx: &Context, subnet: &Subnet, patch: &serde_json::Value) -> Result<(), Error> {
    let name = subnet.name_any();
    ctx.term.check()?;
    match ctx.subnets_api.patch(&name, &PatchParams::default(), &Patch::Merge(patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(kube_err("updating metadata of", &name)(e)),
    }
}

/// Sets `Allocated=True` (server-side apply: the agent owns `Ready`).
async fn ensure_allocated_condition(ctx: &Context, subnet: &Subnet) -> Result<(), Error> {
    let has = subnet
        .status
        .as_ref()
        .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == CONDITION_ALLOCATED && c.status == "True"));
    if has {
        return Ok(());
    }
    let name = subnet.name_any();
    let condition = Condition {
        type_: CONDITION_ALLOCATED.into(),
        status: "True".into(),
        reason: "LeaseGranted".into(),
        message: format!("{} leased to node {}", subnet.spec.cidr, subnet.spec.node_name),
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
        Ok(_) => Ok(()),
        // Deleted meanwhile: the next reconcile reallocates.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(kube_err("updating status of", &name)(e)),
    }
}

/// Deletes exactly this Subnet (UID precondition), tolerating it being gone.
async fn delete_subnet(ctx: &Context, subnet: &Subnet) -> Result<(), Error> {
    let name = subnet.name_any();
    let dp = DeleteParams {
        preconditions: subnet.uid().map(|uid| Preconditions { uid: Some(uid), resource_version: None }),
        ..Default::default()
    };
    ctx.term.check()?;
    match ctx.subnets_api.delete(&name, &dp).await {
        Ok(_) => {
            tracing::info!(subnet = %name, cidr = %subnet.spec.cidr, "released subnet");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(kube_err("deleting", &name)(e)),
    }
}

/// Reconciles one Subnet: release it when its Node is gone (or replaced),
/// and delete the newer of two overlapping Subnets.
pub async fn reconcile_subnet(subnet: Arc<Subnet>, ctx: Arc<Context>) -> Result<Action, Error> {
    ctx.term.check()?;
    let started = Instant::now();
    let result = reconcile_subnet_inner(&subnet, &ctx).await;
    ctx.metrics.observe("subnet", started.elapsed(), result.is_err());
    result
}

async fn reconcile_subnet_inner(subnet: &Subnet, ctx: &Context) -> Result<Action, Error> {
    update_lease_gauges(ctx);
    let name = subnet.name_any();
    let node_name = &subnet.spec.node_name;
    // Ask the API, not the node cache: this reconcile is often triggered by
    // the Node's deletion, which the cache (fed by another watch) may not
    // have seen yet.
    let node = ctx.nodes_api.get_opt(node_name).await.map_err(kube_err("looking up node of", node_name))?;
    if subnet.metadata.deletion_timestamp.is_some() {
        return let_go_when_unused(ctx, subnet, node.is_some()).await;
    }
    if node.is_none() {
        if !managed(ctx, subnet) {
            return Ok(Action::await_change());
        }
        let grace = ctx.config.release_grace();
        let since = *lock_absent(ctx).entry(name.clone()).or_insert_with(Instant::now);
        let absent_for = since.elapsed();
        if absent_for < grace {
            tracing::info!(subnet = %name, node = %node_name, ?absent_for, "node is absent; its lease is kept while it may register again");
            return Ok(Action::requeue(grace - absent_for + Duration::from_millis(100)));
        }
        tracing::info!(subnet = %name, node = %node_name, cidr = %subnet.spec.cidr, "node has been absent for {grace:?}, withdrawing its lease");
        delete_subnet(ctx, subnet).await?;
        lock_absent(ctx).remove(&name);
        return Ok(Action::await_change());
    }
    lock_absent(ctx).remove(&name);
    ensure_lease_metadata(ctx, subnet).await?;

    let mine: Vec<IpNet> = blocks(subnet).collect();
    let me = Claim::of(subnet, true);
    let winner = ctx.subnets.state().into_iter().find(|other| {
        other.name_any() != subnet.name_any()
            && blocks(other).any(|theirs| mine.iter().any(|m| overlaps(m, &theirs)))
            && Claim::of(other, ctx.nodes.get(&ObjectRef::new(&other.spec.node_name)).is_some()).beats(&me)
    });
    if let Some(winner) = winner {
        tracing::warn!(
            subnet = %subnet.name_any(), cidr = %subnet.spec.cidr, kept = %winner.name_any(), kept_cidr = %winner.spec.cidr,
            "subnet overlaps one that keeps its block, withdrawing it so its node is reallocated once the block is let go"
        );
        delete_subnet(ctx, subnet).await?;
    }
    Ok(Action::requeue(ctx.config.resync()))
}

/// One side of an overlap between two Subnets.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Claim {
    /// A present node's agent has published the lease (its `Ready`
    /// condition) and not let it go: pods may have addresses in the block.
    in_use: bool,
    created: Option<Timestamp>,
    name: String,
}

impl Claim {
    fn of(subnet: &Subnet, node_present: bool) -> Self {
        let ready = ready_condition(subnet);
        Self {
            in_use: node_present
                && subnet.metadata.deletion_timestamp.is_none()
                && ready.is_some_and(|c| c.reason != REASON_LEASE_WITHDRAWN),
            created: subnet.metadata.creation_timestamp.as_ref().map(|t| t.0),
            name: subnet.name_any(),
        }
    }

    /// Whether this side keeps the block over `other`. A lease a live node
    /// uses beats one nobody uses, so that a hand-written or restored
    /// object, however old, never takes a working node's block; between
    /// equals the older wins, then the name. A total order, so both
    /// reconciles agree on the loser.
    fn beats(&self, other: &Claim) -> bool {
        let key = |c: &Claim| (!c.in_use, c.created, c.name.clone());
        key(self) < key(other)
    }
}

fn lock_absent(ctx: &Context) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Instant>> {
    ctx.absent_since.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A withdrawn Subnet: removes the lease finalizer once nobody can still be
/// using the block (see [`may_let_go`]).
async fn let_go_when_unused(ctx: &Context, subnet: &Subnet, node_present: bool) -> Result<Action, Error> {
    if !holds_lease(subnet) || !managed(ctx, subnet) {
        return Ok(Action::await_change());
    }
    let name = subnet.name_any();
    let pods = pods_in_block(ctx, subnet).await?;
    let agent = match ready_condition(subnet) {
        None => Agent::NeverUsed,
        Some(c) if c.reason == REASON_LEASE_WITHDRAWN => Agent::Draining,
        Some(_) => Agent::Silent,
    };
    let withdrawn_for = subnet.metadata.deletion_timestamp.as_ref().map_or(Duration::ZERO, |t| {
        Duration::from_secs(u64::try_from(Timestamp::now().as_second() - t.0.as_second()).unwrap_or(0))
    });
    let grace = ctx.config.release_grace();
    if let Err(waiting) = may_let_go(node_present, agent, pods, withdrawn_for, grace) {
        tracing::info!(subnet = %name, cidr = %subnet.spec.cidr, "withdrawn lease kept: {waiting}");
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    patch_metadata(ctx, subnet, &let_go_patch(subnet)).await?;
    tracing::info!(subnet = %name, cidr = %subnet.spec.cidr, "let go of a withdrawn lease: no pod uses its block");
    Ok(Action::await_change())
}

/// Pods the API has on the Subnet's node with an address in its block.
async fn pods_in_block(ctx: &Context, subnet: &Subnet) -> Result<usize, Error> {
    let blocks: Vec<IpNet> = blocks(subnet).collect();
    if blocks.is_empty() {
        return Ok(0);
    }
    let pods: Api<Pod> = Api::all(ctx.subnets_api.clone().into_client());
    let lp = ListParams::default().fields(&format!("spec.nodeName={}", subnet.spec.node_name));
    let list = pods.list(&lp).await.map_err(kube_err("listing the pods on the node of", &subnet.name_any()))?;
    Ok(list
        .items
        .iter()
        .filter(|p| {
            let ips = p.status.as_ref().and_then(|s| s.pod_ips.as_ref());
            ips.into_iter()
                .flatten()
                .any(|ip| ip.ip.parse::<std::net::IpAddr>().is_ok_and(|ip| blocks.iter().any(|b| b.contains(&ip))))
        })
        .count())
}

/// The `Ready` condition the node's agent publishes on its Subnet.
fn ready_condition(subnet: &Subnet) -> Option<&Condition> {
    subnet.status.as_ref()?.conditions.iter().find(|c| c.type_ == CONDITION_READY)
}

/// What the Subnet's `Ready` condition says about the node's agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Agent {
    /// No agent ever published it: no pod got an address from the block.
    NeverUsed,
    /// The agent saw the withdrawal and lets go once its pods are gone.
    Draining,
    /// The agent used the lease and has not (yet) answered the withdrawal.
    Silent,
}

/// How long a gone node's agent has to answer a withdrawal before the
/// operator takes it for dead; a live agent answers within a second or two.
const ANSWER_WAIT: Duration = Duration::from_secs(15);

/// Whether the block of a withdrawn lease may be let go; `Err` says what is
/// still waited for. A node's agent lets go itself once its pods are gone;
/// the operator steps in only for a node without a working agent: one that
/// is gone (after giving a draining agent `grace`, a silent one
/// [`ANSWER_WAIT`]) or whose agent never used the lease. Either way no pod
/// in the API may hold an address in it.
fn may_let_go(
    node_present: bool,
    agent: Agent,
    pods_in_block: usize,
    withdrawn_for: Duration,
    grace: Duration,
) -> Result<(), String> {
    if pods_in_block > 0 {
        return Err(format!("{pods_in_block} pods on its node still have addresses in it"));
    }
    match agent {
        Agent::NeverUsed => Ok(()),
        _ if node_present => Err("the node's agent lets it go once its pods are gone".into()),
        Agent::Draining if withdrawn_for < grace => {
            Err(format!("the node is gone and its agent is letting go; it has {grace:?} to finish"))
        }
        Agent::Silent if withdrawn_for < ANSWER_WAIT => {
            Err(format!("the node is gone; its agent has {ANSWER_WAIT:?} to answer"))
        }
        Agent::Draining | Agent::Silent => Ok(()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn new_subnet_is_reserved_by_the_finalizer_and_carries_backend_data() {
        let cfg = Config::try_parse_from(["x", "--vni", "42", "--mtu", "1400"]).expect("config");
        let s = new_subnet("n1", &["10.244.3.0/24".parse().expect("cidr")], &cfg);
        assert_eq!(s.name_any(), "n1");
        assert_eq!(s.spec.cidr, "10.244.3.0/24");
        assert_eq!(s.spec.vni, Some(42));
        assert_eq!(s.spec.mtu, Some(1400));
        assert_eq!(s.finalizers(), [LEASE_FINALIZER.to_string()]);
        assert!(s.owner_references().is_empty(), "no owner: the garbage collector must not withdraw leases");
        let cfg = Config::try_parse_from(["x", "--backend", "host-gw"]).expect("config");
        let s = new_subnet("n1", &["10.244.3.0/24".parse().expect("cidr")], &cfg);
        assert_eq!(s.spec.vni, None, "host-gw has no VNI");
    }

    fn leased(node: &str, cidr: &str, withdrawn: bool) -> Subnet {
        let cfg = Config::try_parse_from(["x"]).expect("config");
        let mut s = new_subnet(node, &[cidr.parse().expect("cidr")], &cfg);
        if withdrawn {
            s.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        }
        s
    }

    #[test]
    fn the_plan_keeps_leases_fills_holes_and_never_reuses_a_withdrawn_block() {
        let pool = Pool::new("10.9.0.0/16".parse().expect("cidr"), 24).expect("pool");
        let existing = [
            leased("a", "10.9.0.0/24", false),
            // Withdrawn but not let go: its block is still reserved.
            leased("gone", "10.9.1.0/24", true),
            leased("c", "10.9.3.0/24", false),
        ];
        let (decisions, in_pool) = plan(&existing, &["new1", "a", "new2", "gone", "new3"], &pool, None, true);
        assert_eq!(
            decisions,
            [
                Decision::Lease(vec!["10.9.2.0/24".parse().expect("cidr")]),
                Decision::Has(0),
                Decision::Lease(vec!["10.9.4.0/24".parse().expect("cidr")]),
                Decision::Has(1),
                Decision::Lease(vec!["10.9.5.0/24".parse().expect("cidr")]),
            ]
        );
        assert_eq!(in_pool, 6);
    }

    #[test]
    fn dual_stack_leases_a_block_of_each_family_and_extends_older_leases() {
        let pool = Pool::new("10.9.0.0/23".parse().expect("cidr"), 24).expect("pool");
        let v6 = Pool::new("fd00:9::/63".parse().expect("cidr"), 64).expect("pool");
        let net = |s: &str| -> IpNet { s.parse().expect("cidr") };
        let cfg = Config::try_parse_from(["x"]).expect("config");
        // `a` leased both; `old` is from before the cluster was dual-stack.
        let existing =
            [new_subnet("a", &[net("10.9.0.0/24"), net("fd00:9::/64")], &cfg), leased("old", "10.9.1.0/24", false)];
        assert_eq!(existing[0].spec.cidrs, ["10.9.0.0/24", "fd00:9::/64"]);
        assert!(existing[1].spec.cidrs.is_empty(), "single-stack leases list no cidrs");
        let (decisions, _) = plan(&existing, &["a", "old", "new"], &pool, Some(&v6), true);
        assert_eq!(
            decisions,
            [
                Decision::Has(0),
                Decision::Extend(1, net("fd00:9:0:1::/64")),
                // The IPv4 pool is full: the node waits, and takes no IPv6 block meanwhile.
                Decision::Exhausted { pool, in_use: 2 },
            ]
        );
        let existing = [new_subnet("a", &[net("10.9.0.0/24"), net("fd00:9::/64")], &cfg)];
        let (decisions, in_pool) = plan(&existing, &["b", "c"], &pool, Some(&v6), true);
        assert_eq!(
            decisions,
            [
                Decision::Lease(vec![net("10.9.1.0/24"), net("fd00:9:0:1::/64")]),
                Decision::Exhausted { pool, in_use: 2 },
            ]
        );
        assert_eq!(in_pool, 2);
        // An exhausted secondary pool holds the primary block back too.
        let (decisions, _) = plan(&[leased("x", "fd00:9::/63", false)], &["b"], &pool, Some(&v6), true);
        assert_eq!(decisions, [Decision::Exhausted { pool: v6, in_use: 1 }]);
        let (decisions, _) = plan(&[leased("x", "fd00:9::/63", false)], &["b", "c"], &pool, Some(&v6), false);
        assert_eq!(decisions, [Decision::LookAgain, Decision::LookAgain]);
    }

    #[test]
    fn a_full_pool_is_looked_at_again_before_it_is_reported_exhausted() {
        let pool = Pool::new("10.9.0.0/23".parse().expect("cidr"), 24).expect("pool");
        let existing = [leased("a", "10.9.0.0/24", false)];
        let (cheap, _) = plan(&existing, &["b", "c"], &pool, None, false);
        assert_eq!(cheap, [Decision::Lease(vec!["10.9.1.0/24".parse().expect("cidr")]), Decision::LookAgain]);
        let (consistent, in_pool) = plan(&existing, &["b", "c"], &pool, None, true);
        assert_eq!(consistent[1], Decision::Exhausted { pool, in_use: 2 });
        assert_eq!(in_pool, 2);
    }

    #[test]
    fn a_withdrawn_block_is_let_go_only_when_nobody_can_use_it() {
        use Agent::*;
        let grace = Duration::from_secs(60);
        let (short, middle, long) = (Duration::from_secs(5), Duration::from_secs(20), Duration::from_secs(61));
        // Pods in the API with addresses in the block: never.
        for agent in [NeverUsed, Draining, Silent] {
            for present in [true, false] {
                assert!(may_let_go(present, agent, 1, long, grace).is_err(), "{agent:?} {present}");
            }
        }
        // A live node whose agent used it: only the agent lets go.
        assert!(may_let_go(true, Draining, 0, long, grace).is_err());
        assert!(may_let_go(true, Silent, 0, long, grace).is_err());
        // A gone node: a draining agent gets the grace period, a silent one
        // a short while to answer.
        assert!(may_let_go(false, Draining, 0, middle, grace).is_err());
        assert!(may_let_go(false, Draining, 0, long, grace).is_ok());
        assert!(may_let_go(false, Silent, 0, short, grace).is_err());
        assert!(may_let_go(false, Silent, 0, middle, grace).is_ok());
        // No agent ever used it: nothing to wait for.
        assert!(may_let_go(true, NeverUsed, 0, short, grace).is_ok());
        assert!(may_let_go(false, NeverUsed, 0, short, grace).is_ok());
    }

    /// Reconcilers against a mocked API server: each test scripts the
    /// requests the reconciler must make, in order, and the answers.
    mod mock_api {
        use super::*;
        use crate::mock_api::{Handle, expect, json_response, no_more_requests, not_found, store};
        use http::{Method, StatusCode};
        use kube::runtime::events::Reporter;

        fn context(grace: &str) -> (Arc<Context>, Handle) {
            context_with(grace, &[], &[])
        }

        /// A context whose caches hold `subnets` and Nodes named `nodes`.
        fn context_with(grace: &str, subnets: &[Subnet], nodes: &[&str]) -> (Arc<Context>, Handle) {
            let nodes =
                nodes.iter().map(|n| serde_json::from_value::<Node>(json!({"metadata": {"name": n}})).expect("node"));
            let (client, handle) = crate::mock_api::client();
            let config =
                Config::try_parse_from(["x", "--cluster-cidr", "10.9.0.0/16", "--release-grace-seconds", grace])
                    .expect("config");
            let ctx = Context {
                nodes_api: Api::all(client.clone()),
                subnets_api: Api::all(client.clone()),
                nodes: store(nodes),
                subnets: store(subnets.iter().cloned()),
                pool: config.pool().expect("pool"),
                secondary: None,
                config,
                metrics: Arc::new(Metrics::new()),
                recorder: Recorder::new(client, Reporter { controller: "test".into(), instance: None }),
                term: Term::always(),
                alloc_lock: Mutex::new(()),
                pending: std::sync::Mutex::new(Vec::new()),
                exhausted_nodes: std::sync::Mutex::new(Default::default()),
                last_write_rv: std::sync::Mutex::new(None),
                waiting_for_space: std::sync::atomic::AtomicBool::new(false),
                deletions: std::sync::atomic::AtomicU64::new(0),
                absent_since: std::sync::Mutex::new(Default::default()),
            };
            (Arc::new(ctx), handle)
        }

        fn subnet(withdrawn: bool, agent_used: bool) -> Subnet {
            let mut s = leased("n1", "10.9.4.0/24", withdrawn);
            s.metadata.uid = Some("uid-1".into());
            s.metadata.resource_version = Some("7".into());
            if agent_used {
                s.status = Some(weft_api::SubnetStatus {
                    conditions: vec![Condition {
                        type_: CONDITION_READY.into(),
                        status: "True".into(),
                        reason: "DatapathProgrammed".into(),
                        message: String::new(),
                        last_transition_time: Time(Timestamp::now()),
                        observed_generation: None,
                    }],
                    ..Default::default()
                });
            }
            s
        }

        #[tokio::test]
        async fn a_lease_whose_node_is_gone_past_the_grace_is_withdrawn_with_a_uid_precondition() {
            let (ctx, mut api) = context("0");
            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(subnet(false, true)), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", not_found("node n1")).await;
            let body = expect(
                &mut api,
                Method::DELETE,
                "/apis/weft.dev/v1alpha1/subnets/n1",
                json_response(StatusCode::OK, serde_json::to_value(subnet(true, true)).expect("json")),
            )
            .await;
            assert_eq!(body["preconditions"]["uid"], "uid-1", "{body}");
            let action = reconcile.await.expect("task").expect("reconcile");
            assert_eq!(action, Action::await_change());
        }

        #[tokio::test]
        async fn a_lease_whose_node_is_briefly_absent_is_kept() {
            let (ctx, mut api) = context("60");
            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(subnet(false, true)), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", not_found("node n1")).await;
            let action = reconcile.await.expect("task").expect("reconcile");
            // Nothing written; looked at again once the grace is over.
            assert!(no_more_requests(&mut api).await, "no write");
            assert!(action != Action::await_change(), "{action:?}");
        }

        #[tokio::test]
        async fn a_withdrawn_block_is_kept_while_a_pod_uses_it_and_let_go_after() {
            let (ctx, mut api) = context("0");
            let pod_in_block = json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [
                {"metadata": {"name": "web", "namespace": "shop"}, "spec": {"containers": []},
                 "status": {"podIPs": [{"ip": "10.9.4.7"}]}},
            ]});
            let empty = json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": []});

            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(subnet(true, false)), ctx.clone()));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", not_found("node n1")).await;
            let list = expect(&mut api, Method::GET, "/api/v1/pods", json_response(StatusCode::OK, pod_in_block)).await;
            assert!(list["query"].as_str().is_some_and(|q| q.contains("spec.nodeName%3Dn1")), "{list}");
            let action = reconcile.await.expect("task").expect("reconcile");
            assert!(action != Action::await_change(), "kept, and looked at again: {action:?}");
            assert!(no_more_requests(&mut api).await, "no write");

            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(subnet(true, false)), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", not_found("node n1")).await;
            expect(&mut api, Method::GET, "/api/v1/pods", json_response(StatusCode::OK, empty)).await;
            let patch = expect(
                &mut api,
                Method::PATCH,
                "/apis/weft.dev/v1alpha1/subnets/n1",
                json_response(StatusCode::OK, serde_json::to_value(subnet(true, false)).expect("json")),
            )
            .await;
            assert_eq!(patch["metadata"]["finalizers"], json!([]), "{patch}");
            assert_eq!(patch["metadata"]["resourceVersion"], "7", "guarded by the resourceVersion: {patch}");
            assert_eq!(reconcile.await.expect("task").expect("reconcile"), Action::await_change());
        }

        fn node_json(name: &str) -> http::Response<kube::client::Body> {
            json_response(StatusCode::OK, json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}))
        }

        /// `name` for node `node`, leasing `cidr`, created `age_s` seconds ago.
        fn claim(name: &str, node: &str, cidr: &str, age_s: i64, agent_used: bool) -> Subnet {
            let mut s = subnet(false, agent_used);
            s.metadata.name = Some(name.into());
            s.metadata.uid = Some(format!("uid-{name}"));
            s.spec.node_name = node.into();
            s.spec.cidr = cidr.into();
            let created = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(age_s);
            s.metadata.creation_timestamp = Some(Time(created));
            s
        }

        #[tokio::test]
        async fn an_older_overlapping_subnet_nobody_uses_never_takes_a_live_node_s_block() {
            // A restored or hand-written object, older than n1's lease, for
            // a node that does not exist, and one naming n1 itself.
            let live = claim("n1", "n1", "10.9.4.0/24", 60, true);
            let ghost = claim("ghost", "n9", "10.9.4.0/23", 3600, false);
            let twin = claim("twin", "n1", "10.9.4.128/25", 3600, false);
            let (ctx, mut api) = context_with("60", &[live.clone(), ghost, twin.clone()], &["n1"]);

            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(live), ctx.clone()));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", node_json("n1")).await;
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await, "the live node's lease was touched");

            // The twin names a live node but no agent uses it: it loses.
            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(twin.clone()), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", node_json("n1")).await;
            let body = expect(
                &mut api,
                Method::DELETE,
                "/apis/weft.dev/v1alpha1/subnets/twin",
                json_response(StatusCode::OK, serde_json::to_value(twin).expect("json")),
            )
            .await;
            assert_eq!(body["preconditions"]["uid"], "uid-twin", "{body}");
            reconcile.await.expect("task").expect("reconcile");
        }

        #[tokio::test]
        async fn between_two_leases_in_use_the_newer_is_withdrawn() {
            let old = claim("n1", "n1", "10.9.4.0/24", 3600, true);
            let new = claim("n2", "n2", "10.9.4.0/24", 60, true);
            let (ctx, mut api) = context_with("60", &[old.clone(), new.clone()], &["n1", "n2"]);

            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(old), ctx.clone()));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", node_json("n1")).await;
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await, "the older lease was touched");

            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(new.clone()), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n2", node_json("n2")).await;
            expect(
                &mut api,
                Method::DELETE,
                "/apis/weft.dev/v1alpha1/subnets/n2",
                json_response(StatusCode::OK, serde_json::to_value(new).expect("json")),
            )
            .await;
            reconcile.await.expect("task").expect("reconcile");
        }

        #[tokio::test]
        async fn a_live_node_s_withdrawn_block_is_left_to_its_agent() {
            let (ctx, mut api) = context("0");
            let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "uid": "node-uid"}});
            let empty = json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": []});
            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(subnet(true, true)), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", json_response(StatusCode::OK, node)).await;
            expect(&mut api, Method::GET, "/api/v1/pods", json_response(StatusCode::OK, empty)).await;
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await, "no write");
        }
    }
}
