//! Letting leases go: a Subnet whose node has been absent for the release
//! grace period, or that overlaps one that keeps its block ([`Claim`]), is
//! withdrawn (deleted); its finalizer keeps the block reserved until nobody
//! can be using it ([`may_let_go`]).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use weft_api::Subnet;
use weft_api::subnet::{REASON_LEASE_WITHDRAWN, holds_lease, let_go_patch};

use super::plan::{Agent, Claim, blocks, may_let_go, ready_condition};
use super::sightings::Freshest;
use super::{Context, Error, kube_err, managed, status};
use crate::ipam::overlaps;

/// Since when each Subnet's node has been seen absent (this replica's view:
/// a new leader starts counting again, which only delays).
#[derive(Default)]
pub struct Absences(Mutex<HashMap<String, Instant>>);

impl Absences {
    /// When `subnet`'s node was first seen absent (now, if not before).
    fn since(&self, subnet: &str) -> Instant {
        // Plain data; a panic elsewhere cannot leave it torn.
        *self.0.lock().unwrap_or_else(PoisonError::into_inner).entry(subnet.to_owned()).or_insert_with(Instant::now)
    }

    fn forget(&self, subnet: &str) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).remove(subnet);
    }
}

/// Releases a Subnet whose Node is gone (or replaced), and withdraws the
/// newer of two overlapping Subnets.
pub(super) async fn reconcile(subnet: &Subnet, ctx: &Context) -> Result<Action, Error> {
    super::update_lease_gauges(ctx);
    let name = subnet.name_any();
    let node_name = &subnet.spec.node_name;
    let node_present = node_present(ctx, node_name).await?;
    if subnet.metadata.deletion_timestamp.is_some() {
        return let_go_when_unused(ctx, subnet, node_present).await;
    }
    if !node_present {
        // A Subnet still waiting for a range reserves nothing: no grace.
        if subnet.spec.is_pending() {
            delete_subnet(ctx, subnet).await?;
            return Ok(Action::await_change());
        }
        if !managed(ctx, subnet) {
            return Ok(Action::await_change());
        }
        let grace = ctx.config.release_grace();
        let since = ctx.absences.since(&name);
        let absent_for = since.elapsed();
        if absent_for < grace {
            tracing::info!(subnet = %name, node = %node_name, ?absent_for, "node is absent; its lease is kept while it may register again");
            return Ok(Action::requeue(grace - absent_for + Duration::from_millis(100)));
        }
        tracing::info!(subnet = %name, node = %node_name, cidr = %subnet.spec.cidr, "node has been absent for {grace:?}, withdrawing its lease");
        delete_subnet(ctx, subnet).await?;
        ctx.absences.forget(&name);
        return Ok(Action::await_change());
    }
    ctx.absences.forget(&name);
    status::ensure_lease_metadata(ctx, subnet).await?;

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

/// Whether Node `name` exists. The cache's copy is trusted unless the
/// Subnet controller's own Node watch (which may have triggered this
/// reconcile: a Node's deletion) saw a newer version than it holds; a Node
/// the cache does not show is asked of the API, as releasing on a cache
/// that has not seen a new Node yet would take its lease.
async fn node_present(ctx: &Context, name: &str) -> Result<bool, Error> {
    let cached = ctx.nodes.get(&ObjectRef::new(name));
    if let Some(node) = &cached
        && matches!(ctx.node_sightings.freshest(name, Some(node)), Freshest::Cache)
    {
        return Ok(true);
    }
    let node = ctx.nodes_api.get_opt(name).await.map_err(kube_err("looking up node", name))?;
    Ok(node.is_some())
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
    status::patch_metadata(ctx, subnet, &let_go_patch(subnet)).await?;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use clap::Parser;
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use kube::runtime::events::Recorder;
    use serde_json::json;
    use weft_api::subnet::CONDITION_READY;

    use super::super::plan::new_subnet;
    use super::super::reconcile_subnet;
    use super::*;
    use crate::config::Config;
    use crate::leader::Term;
    use crate::metrics::Metrics;

    fn leased(node: &str, cidr: &str, withdrawn: bool) -> Subnet {
        let cfg = Config::try_parse_from(["x"]).expect("config");
        let mut s = new_subnet(node, &[cidr.parse().expect("cidr")], &cfg);
        if withdrawn {
            s.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        }
        s
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
            let nodes = nodes.iter().map(|n| {
                serde_json::from_value::<Node>(json!({"metadata": {"name": n, "resourceVersion": "1"}})).expect("node")
            });
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
                allocator: Default::default(),
                reported: Default::default(),
                absences: Default::default(),
                sightings: Default::default(),
                node_sightings: Default::default(),
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
        async fn a_cached_node_is_read_only_when_its_watch_saw_a_newer_version() {
            let (ctx, mut api) = context_with("0", &[], &["n1"]);
            reconcile_subnet(Arc::new(subnet(false, true)), ctx.clone()).await.expect("reconcile");
            assert!(no_more_requests(&mut api).await, "the cached node was trusted");

            // The Subnet controller's Node watch saw the node's deletion
            // before the node cache did: the API is asked, and it is gone.
            let deleted: Node =
                serde_json::from_value(json!({"metadata": {"name": "n1", "resourceVersion": "2"}})).expect("node");
            ctx.node_sightings.saw(&deleted, &ctx.nodes);
            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(subnet(false, true)), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", not_found("node n1")).await;
            let answer = json_response(StatusCode::OK, serde_json::to_value(subnet(true, true)).expect("json"));
            expect(&mut api, Method::DELETE, "/apis/weft.dev/v1alpha1/subnets/n1", answer).await;
            assert_eq!(reconcile.await.expect("task").expect("reconcile"), Action::await_change());
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
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await, "the live node's lease was touched");

            // The twin names a live node but no agent uses it: it loses.
            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(twin.clone()), ctx));
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
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await, "the older lease was touched");

            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(new.clone()), ctx));
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

        /// Leasing (the node reconciler, beside the release tests for their
        /// scripted context): a node the Subnet cache shows nothing for is
        /// planned and leased without a read of its Subnet first (a quorum
        /// read per node of a burst); one it shows is read only when the
        /// trigger watch saw a newer version of it.
        #[tokio::test]
        async fn a_node_without_a_cached_subnet_is_leased_without_reading_one_first() {
            let (ctx, mut api) = context_with("60", &[], &["n2"]);
            let node: Node = serde_json::from_value(json!({"metadata": {"name": "n2"}})).expect("node");
            let reconcile = tokio::spawn(crate::subnets::reconcile_node(Arc::new(node), ctx.clone()));
            let empty = json!({"kind": "SubnetList", "apiVersion": "weft.dev/v1alpha1", "metadata": {"resourceVersion": "5"}, "items": []});
            expect(&mut api, Method::GET, "/apis/weft.dev/v1alpha1/subnets", json_response(StatusCode::OK, empty))
                .await;
            let mut created = leased("n2", "10.9.0.0/24", false);
            created.metadata.resource_version = Some("6".into());
            let answer = json_response(StatusCode::CREATED, serde_json::to_value(&created).expect("json"));
            let body = expect(&mut api, Method::POST, "/apis/weft.dev/v1alpha1/subnets", answer).await;
            assert_eq!(body["spec"]["nodeName"], "n2", "{body}");
            let answer = json_response(StatusCode::OK, serde_json::to_value(&created).expect("json"));
            expect(&mut api, Method::PATCH, "/apis/weft.dev/v1alpha1/subnets/n2/status", answer).await;
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await);

            // The cache shows the Subnet and the trigger watch saw nothing
            // newer: the cache is trusted (no read), its condition written.
            let (ctx, mut api) = context_with("60", std::slice::from_ref(&created), &["n2"]);
            let node: Arc<Node> = Arc::new(serde_json::from_value(json!({"metadata": {"name": "n2"}})).expect("node"));
            let reconcile = tokio::spawn(crate::subnets::reconcile_node(node.clone(), ctx.clone()));
            let answer = json_response(StatusCode::OK, serde_json::to_value(&created).expect("json"));
            expect(&mut api, Method::PATCH, "/apis/weft.dev/v1alpha1/subnets/n2/status", answer).await;
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await);

            // The trigger watch saw a newer version (its deletion, say) than
            // the cache holds: it is read from the API, and found gone.
            let mut deleted = created.clone();
            deleted.metadata.resource_version = Some("9".into());
            ctx.sightings.saw(&deleted, &ctx.subnets);
            let reconcile = tokio::spawn(crate::subnets::reconcile_node(node, ctx));
            expect(&mut api, Method::GET, "/apis/weft.dev/v1alpha1/subnets/n2", not_found("subnet n2")).await;
            reconcile.abort();
        }

        /// A node the pool has no range for gets a Subnet without one that
        /// says so (besides the Node condition and the Event); once a range
        /// is free, that Subnet is given it, guarded by its resourceVersion.
        #[tokio::test]
        async fn a_node_the_pool_has_no_range_for_gets_a_waiting_subnet_that_is_filled_later() {
            let list = |items: Vec<Subnet>| {
                json!({"kind": "SubnetList", "apiVersion": "weft.dev/v1alpha1", "metadata": {"resourceVersion": "5"},
                       "items": items})
            };
            let node: Arc<Node> = Arc::new(serde_json::from_value(json!({"metadata": {"name": "n2"}})).expect("node"));
            let (ctx, mut api) = context_with("60", &[], &["n2"]);
            let reconcile = tokio::spawn(crate::subnets::reconcile_node(node.clone(), ctx.clone()));
            // The whole pool is another node's.
            let full = list(vec![leased("n1", "10.9.0.0/16", false)]);
            expect(&mut api, Method::GET, "/apis/weft.dev/v1alpha1/subnets", json_response(StatusCode::OK, full)).await;
            let cond =
                expect(&mut api, Method::PATCH, "/api/v1/nodes/n2/status", json_response(StatusCode::OK, json!({})))
                    .await;
            assert_eq!(cond["status"]["conditions"][0]["reason"], "SubnetPoolExhausted", "{cond}");
            let cfg = Config::try_parse_from(["x"]).expect("config");
            let mut waiting = crate::subnets::plan::waiting_subnet("n2", &cfg);
            waiting.metadata.resource_version = Some("6".into());
            let answer = json_response(StatusCode::CREATED, serde_json::to_value(&waiting).expect("json"));
            let made = expect(&mut api, Method::POST, "/apis/weft.dev/v1alpha1/subnets", answer).await;
            assert_eq!(made["spec"]["nodeName"], "n2", "{made}");
            assert!(made["spec"].get("cidr").is_none() && made["metadata"].get("finalizers").is_none(), "{made}");
            let answer = json_response(StatusCode::OK, serde_json::to_value(&waiting).expect("json"));
            let status = expect(&mut api, Method::PATCH, "/apis/weft.dev/v1alpha1/subnets/n2/status", answer).await;
            let condition = &status["status"]["conditions"][0];
            assert_eq!((&condition["type"], &condition["status"]), (&json!("Allocated"), &json!("False")), "{status}");
            assert_eq!(condition["reason"], "SubnetPoolExhausted");
            assert!(condition["message"].as_str().is_some_and(|m| m.contains("no free /24")), "{status}");
            let event = expect(
                &mut api,
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/default/events",
                json_response(StatusCode::CREATED, json!({})),
            )
            .await;
            assert_eq!(event["reason"], "SubnetPoolExhausted", "{event}");
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await);

            // n1 is gone: the waiting Subnet is filled, not made anew.
            let (ctx, mut api) = context_with("60", std::slice::from_ref(&waiting), &["n2"]);
            let reconcile = tokio::spawn(crate::subnets::reconcile_node(node, ctx));
            let freed = list(vec![waiting.clone()]);
            expect(&mut api, Method::GET, "/apis/weft.dev/v1alpha1/subnets", json_response(StatusCode::OK, freed))
                .await;
            let mut filled = leased("n2", "10.9.0.0/24", false);
            filled.metadata.resource_version = Some("8".into());
            let answer = json_response(StatusCode::OK, serde_json::to_value(&filled).expect("json"));
            let patch = expect(&mut api, Method::PATCH, "/apis/weft.dev/v1alpha1/subnets/n2", answer).await;
            assert_eq!(patch["spec"]["cidr"], "10.9.0.0/24", "{patch}");
            assert_eq!(patch["metadata"]["resourceVersion"], "6", "guarded: {patch}");
            assert_eq!(patch["metadata"]["finalizers"], json!([weft_api::subnet::LEASE_FINALIZER]), "{patch}");
            let answer = json_response(StatusCode::OK, serde_json::to_value(&filled).expect("json"));
            let status = expect(&mut api, Method::PATCH, "/apis/weft.dev/v1alpha1/subnets/n2/status", answer).await;
            assert_eq!(status["status"]["conditions"][0]["status"], "True", "{status}");
            reconcile.await.expect("task").expect("reconcile");
            assert!(no_more_requests(&mut api).await);
        }

        #[tokio::test]
        async fn a_waiting_subnet_whose_node_is_gone_is_deleted_at_once() {
            let cfg = Config::try_parse_from(["x"]).expect("config");
            let mut waiting = crate::subnets::plan::waiting_subnet("n1", &cfg);
            waiting.metadata.uid = Some("uid-w".into());
            // A grace of an hour: it applies to leases, not to a waiting node.
            let (ctx, mut api) = context("3600");
            let reconcile = tokio::spawn(reconcile_subnet(Arc::new(waiting.clone()), ctx));
            expect(&mut api, Method::GET, "/api/v1/nodes/n1", not_found("node n1")).await;
            let answer = json_response(StatusCode::OK, serde_json::to_value(&waiting).expect("json"));
            let body = expect(&mut api, Method::DELETE, "/apis/weft.dev/v1alpha1/subnets/n1", answer).await;
            assert_eq!(body["preconditions"]["uid"], "uid-w", "{body}");
            assert_eq!(reconcile.await.expect("task").expect("reconcile"), Action::await_change());
        }
    }
}
