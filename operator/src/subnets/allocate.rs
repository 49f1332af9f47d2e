//! Allocation: a node without a lease queues a request, and whoever holds
//! the allocation lock serves every queued request from one list of all
//! Subnets (batches keep "list before allocating" without one list per node
//! when hundreds join at once). This replica so never hands out one block
//! twice; the deterministic name makes a concurrent creator conflict.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{ListParams, Patch, PatchParams, PostParams, VersionMatch};
use kube::runtime::controller::Action;
use serde_json::json;
use weft_api::Subnet;

use super::plan::{self, Decision};
use super::{Context, Error, FIELD_MANAGER, status};
use crate::ipam::Pool;

/// What allocation keeps between reconciles.
#[derive(Default)]
pub struct Allocator {
    /// Serialises list-then-create so this replica never double-allocates.
    lock: tokio::sync::Mutex<()>,
    /// Nodes waiting for the lock; served in batches.
    pending: Mutex<Vec<Request>>,
    /// Newest resourceVersion of a Subnet this replica wrote.
    last_write_rv: Mutex<Option<(String, u64)>>,
    /// What allocation may plan from without listing: the resourceVersion
    /// of the last list, and this replica's writes since ([`cached_view`]).
    cache: Mutex<CacheHint>,
    /// Set while some node is waiting for space; a Subnet deletion then
    /// retriggers all nodes.
    waiting_for_space: AtomicBool,
    /// Count of Subnet deletions seen, so an allocation that found no space
    /// can tell whether space was freed while it was looking.
    deletions: AtomicU64,
}

impl Allocator {
    /// Notes a Subnet's deletion; true when nodes wait for space (wake them).
    pub fn subnet_deleted(&self) -> bool {
        self.deletions.fetch_add(1, Ordering::SeqCst);
        self.waiting_for_space.swap(false, Ordering::SeqCst)
    }

    // These hold plain data; a panic elsewhere cannot leave them torn.
    fn queue(&self) -> MutexGuard<'_, Vec<Request>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn last_write(&self) -> MutexGuard<'_, Option<(String, u64)>> {
        self.last_write_rv.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cache(&self) -> MutexGuard<'_, CacheHint> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets every hint: the next batch lists fully consistently.
    fn reset(&self) {
        *self.last_write() = None;
        *self.cache() = CacheHint::default();
    }

    /// Remembers the newest resourceVersion this replica wrote, and the write.
    pub(super) fn note_write(&self, subnet: &Subnet) {
        let Some(rv) = subnet.resource_version() else { return };
        {
            let mut cache = self.cache();
            cache.writes.retain(|w| w.name_any() != subnet.name_any());
            cache.writes.push(subnet.clone());
        }
        // etcd-backed resourceVersions are integers; anything else disables
        // the shortcut (consistent lists are always correct, just slower).
        let Ok(n) = rv.parse::<u64>() else {
            *self.last_write() = None;
            return;
        };
        let mut last = self.last_write();
        if last.as_ref().is_none_or(|(_, m)| n > *m) {
            *last = Some((rv, n));
        }
    }
}

/// One node waiting for a lease.
struct Request {
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
pub(super) async fn allocate(node: &Node, ctx: &Context) -> Result<Action, Error> {
    let name = node.name_any();
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    ctx.allocator.queue().push(Request { node: name.clone(), reply: tx });
    let outcome = match rx.try_recv() {
        Ok(o) => o,
        Err(_) => {
            let guard = ctx.allocator.lock.lock().await;
            // A previous holder may have served us already; if not, we
            // serve the queue (which holds our request) ourselves.
            let batch = std::mem::take(&mut *ctx.allocator.queue());
            if !batch.is_empty() {
                serve(ctx, batch).await;
            }
            drop(guard);
            rx.try_recv().map_err(|_| Error::Alloc(name.clone(), "request was dropped".into()))?
        }
    };

    match outcome {
        Outcome::Created(subnet) => {
            tracing::info!(node = %name, cidr = %subnet.spec.cidr, "allocated subnet");
            status::ensure_allocated_condition(ctx, &subnet).await?;
            status::clear_exhausted(ctx, node, &subnet).await;
            Ok(Action::requeue(ctx.config.resync()))
        }
        Outcome::Exists(subnet) => super::keep_lease(ctx, node, &super::newest_known(ctx, *subnet)).await,
        Outcome::Conflict => Ok(Action::requeue(Duration::ZERO)),
        Outcome::Failed(e) => Err(Error::Alloc(name, e)),
        Outcome::Exhausted { space_freed_meanwhile: true, .. } => Ok(Action::requeue(Duration::from_millis(100))),
        Outcome::Exhausted { pool, in_pool, space_freed_meanwhile: false } => {
            status::report_exhausted(ctx, node, &pool, in_pool).await;
            // Deletions wake us early; this is the fallback.
            Ok(Action::requeue(Duration::from_secs(10)))
        }
    }
}

/// Serves a batch of requests. Must run under the allocator's lock. Nodes
/// the plan says to look at again for (a possibly stale list found no
/// space) are planned once more from a fully consistent list.
async fn serve(ctx: &Context, mut batch: Vec<Request>) {
    while !batch.is_empty() {
        batch = serve_once(ctx, batch).await;
        if !batch.is_empty() {
            // Forget the hints so the rerun lists fully consistently.
            ctx.allocator.reset();
        }
    }
}

/// One pass over `batch`; returns the requests to plan again.
async fn serve_once(ctx: &Context, batch: Vec<Request>) -> Vec<Request> {
    let deletions_before = ctx.allocator.deletions.load(Ordering::SeqCst);
    let reading = std::time::Instant::now();
    let existing = match list_subnets(ctx).await {
        Ok(list) => list,
        Err(e) => {
            let msg = format!("listing subnets: {e}");
            for req in batch {
                let _ = req.reply.send(Outcome::Failed(msg.clone()));
            }
            return Vec::new();
        }
    };
    let (existing, fully_consistent) = existing;
    tracing::debug!(
        requests = batch.len(),
        subnets = existing.len(),
        read_ms = reading.elapsed().as_millis() as u64,
        fully_consistent,
        "serving a batch of lease requests"
    );
    let nodes: Vec<&str> = batch.iter().map(|r| r.node.as_str()).collect();
    let (decisions, mut in_pool) = plan::plan(&existing, &nodes, &ctx.pool, ctx.secondary.as_ref(), fully_consistent);
    let mut to_create = Vec::new();
    let mut to_fill = Vec::new();
    let mut to_extend = Vec::new();
    let mut retry = Vec::new();
    for (req, decision) in batch.into_iter().zip(decisions) {
        match decision {
            Decision::Has(i) => {
                let _ = req.reply.send(Outcome::Exists(Box::new(existing[i].clone())));
            }
            Decision::Lease(cidrs) => {
                let subnet = plan::new_subnet(&req.node, &cidrs, &ctx.config);
                to_create.push((req, subnet));
            }
            Decision::Fill(i, cidrs) => to_fill.push((req, &existing[i], cidrs)),
            Decision::Extend(i, cidr) => to_extend.push((req, &existing[i], cidr)),
            Decision::LookAgain => retry.push(req),
            Decision::Exhausted { pool, in_use } => {
                ctx.allocator.waiting_for_space.store(true, Ordering::SeqCst);
                let freed = ctx.allocator.deletions.load(Ordering::SeqCst) != deletions_before;
                let _ = req.reply.send(Outcome::Exhausted { pool, in_pool: in_use, space_freed_meanwhile: freed });
            }
        }
    }
    if let Err(e) = ctx.term.check() {
        let waiting = to_create.into_iter().map(|(r, _)| r).chain(to_fill.into_iter().map(|(r, ..)| r));
        for req in waiting.chain(to_extend.into_iter().map(|(r, ..)| r)) {
            let _ = req.reply.send(Outcome::Failed(e.to_string()));
        }
        return Vec::new();
    }
    let filled = futures::future::join_all(to_fill.iter().map(|(_, s, cidrs)| fill(ctx, s, cidrs))).await;
    for ((req, ..), outcome) in to_fill.into_iter().zip(filled) {
        if !matches!(outcome, Outcome::Created(_)) {
            in_pool = in_pool.saturating_sub(1);
        }
        let _ = req.reply.send(outcome);
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
                ctx.allocator.note_write(&s);
                ctx.sightings.wrote(&s, &ctx.subnets);
                Outcome::Created(Box::new(s))
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // A Subnet of that name the view did not show: the node is
                // planned again from a fully consistent list, which has it.
                ctx.allocator.reset();
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
    retry
}

/// Gives a Subnet that waited for a range its blocks (see
/// [`plan::fill_patch`]); to the caller, a lease made.
async fn fill(ctx: &Context, subnet: &Subnet, cidrs: &[IpNet]) -> Outcome {
    let name = subnet.name_any();
    let pp = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    match ctx.subnets_api.patch(&name, &pp, &Patch::Merge(&plan::fill_patch(subnet, cidrs))).await {
        Ok(s) => {
            ctx.allocator.note_write(&s);
            ctx.sightings.wrote(&s, &ctx.subnets);
            Outcome::Created(Box::new(s))
        }
        // Changed or gone meanwhile: planned again from a consistent list.
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
            ctx.allocator.reset();
            Outcome::Conflict
        }
        Err(e) => Outcome::Failed(format!("leasing a range to waiting subnet {name}: {e}")),
    }
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
            ctx.allocator.note_write(&s);
            ctx.sightings.wrote(&s, &ctx.subnets);
            tracing::info!(subnet = %s.name_any(), %cidr, "added a block of the other address family to the lease");
            Outcome::Exists(Box::new(s))
        }
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Outcome::Conflict,
        Err(e) => Outcome::Failed(format!("adding {cidr} to subnet {}: {e}", subnet.name_any())),
    }
}

/// All Subnets, at least as new as this replica's last write (what
/// allocation needs: as leader we are the only allocator). From the
/// operator's own watch of Subnets when [`cached_view`] can tell it is new
/// enough: at a thousand Subnets a list costs tens of milliseconds, and
/// nodes joining one by one would each pay it. Otherwise listed, from the
/// apiserver's watch cache without the consistency round-trip a plain list
/// waits for (up to 100 ms). Before any write, or after a reset, the list
/// is fully consistent. Returns whether it was.
async fn list_subnets(ctx: &Context) -> Result<(Vec<Subnet>, bool), kube::Error> {
    let since = ctx.allocator.last_write().clone();
    if since.is_some() {
        let mut hint = ctx.allocator.cache();
        if let Some(view) = cached_view(&ctx.subnets.state(), &mut hint) {
            return Ok((view, false));
        }
    }
    let lp = match &since {
        Some((rv, _)) => ListParams::default().at(rv).matching(VersionMatch::NotOlderThan),
        None => ListParams::default(),
    };
    let list = ctx.subnets_api.list(&lp).await?;
    let listed_at = list.metadata.resource_version.as_deref().and_then(|rv| rv.parse().ok());
    let mut hint = ctx.allocator.cache();
    hint.listed_at = listed_at;
    hint.writes.clear();
    Ok((list.items, since.is_none()))
}

/// What [`cached_view`] needs besides the watch's Subnets.
#[derive(Default)]
struct CacheHint {
    /// The resourceVersion of the last list allocation planned from.
    listed_at: Option<u64>,
    /// This replica's writes since (created or extended Subnets).
    writes: Vec<Subnet>,
}

/// The Subnets as of at least the last list and every write of this
/// replica since, from the watch's `cached` Subnets: `None` when the watch
/// has not yet caught up with the last list (it holds no Subnet of that
/// resourceVersion or later: a watch delivers a resource's events in
/// resourceVersion order, so one that has seen a newer Subnet has seen
/// everything before it) or a resourceVersion is not a number. Writes of
/// this replica the watch has not seen yet are laid over it (and forgotten
/// once it has). Pure.
fn cached_view(cached: &[Arc<Subnet>], hint: &mut CacheHint) -> Option<Vec<Subnet>> {
    let rv = |s: &Subnet| s.resource_version().and_then(|v| v.parse::<u64>().ok());
    let listed_at = hint.listed_at?;
    let seen = cached.iter().map(|s| rv(s)).collect::<Option<Vec<u64>>>()?.into_iter().max()?;
    if seen < listed_at {
        return None;
    }
    hint.writes.retain(|w| rv(w).is_some_and(|v| v > seen));
    let mut view: Vec<Subnet> = cached
        .iter()
        .filter(|s| !hint.writes.iter().any(|w| w.name_any() == s.name_any()))
        .map(|s| Subnet::clone(s))
        .collect();
    view.extend(hint.writes.iter().cloned());
    Some(view)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock_api::subnet_at as subnet;

    fn cidrs(view: &[Subnet]) -> Vec<(String, String)> {
        let mut v: Vec<_> = view.iter().map(|s| (s.name_any(), s.spec.cidr.clone())).collect();
        v.sort();
        v
    }

    #[test]
    fn a_watch_behind_the_last_list_is_not_used() {
        let cached = [Arc::new(subnet("a", "10.0.0.0/24", "90"))];
        let mut hint = CacheHint { listed_at: Some(100), writes: vec![] };
        assert!(cached_view(&cached, &mut hint).is_none(), "it may miss what the list saw");
        let mut no_list = CacheHint::default();
        assert!(cached_view(&cached, &mut no_list).is_none(), "nothing to measure it against");
        assert!(cached_view(&[], &mut CacheHint { listed_at: Some(1), writes: vec![] }).is_none());
        let odd = [Arc::new(subnet("a", "10.0.0.0/24", "not-a-number"))];
        assert!(cached_view(&odd, &mut CacheHint { listed_at: Some(1), writes: vec![] }).is_none());
    }

    #[test]
    fn writes_the_watch_has_not_seen_are_laid_over_it_and_forgotten_once_seen() {
        let mut hint = CacheHint {
            listed_at: Some(100),
            writes: vec![subnet("b", "10.0.1.0/24", "105"), subnet("c", "10.0.2.0/24", "110")],
        };
        // The watch has seen b (and a newer Subnet), not c yet.
        let cached = [Arc::new(subnet("a", "10.0.0.0/24", "101")), Arc::new(subnet("b", "10.0.1.0/24", "105"))];
        let view = cached_view(&cached, &mut hint).expect("caught up with the list");
        assert_eq!(
            cidrs(&view),
            [
                ("a".into(), "10.0.0.0/24".into()),
                ("b".into(), "10.0.1.0/24".into()),
                ("c".into(), "10.0.2.0/24".into())
            ]
        );
        assert_eq!(hint.writes.len(), 1, "b is in the watch now: {:?}", cidrs(&hint.writes));
        // A write newer than the watch's copy of the same Subnet wins.
        let mut hint = CacheHint { listed_at: Some(100), writes: vec![subnet("a", "10.0.9.0/24", "120")] };
        let view = cached_view(&cached, &mut hint).expect("caught up");
        assert_eq!(cidrs(&view), [("a".into(), "10.0.9.0/24".into()), ("b".into(), "10.0.1.0/24".into())]);
    }
}
