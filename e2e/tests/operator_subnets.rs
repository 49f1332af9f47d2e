//! The real `weft-operator` binary against the real apiserver: Subnet leases
//! for joining nodes, no overlaps under load and across a SIGKILL, release
//! on node deletion, exhaustion and recovery, leader election.
//!
//! Every test runs its own operator with its own cluster CIDR, node label
//! (`--node-selector`) and Lease namespace, so tests share one control plane
//! without seeing each other's nodes.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use futures::TryStreamExt;
use futures::future::try_join_all;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use weft_api::Subnet;
use weft_api::subnet::LEASE_FINALIZER;
use weft_e2e::control_plane::operator::OperatorProcess;
use weft_e2e::control_plane::{ControlPlane, install_crds, new_namespace, wait_for};

const LABEL: &str = "weft.dev/e2e";

/// One test's slice of the shared cluster.
struct Fixture {
    cp: &'static ControlPlane,
    client: Client,
    ns: String,
    cidr: String,
    prefix: u8,
}

impl Fixture {
    async fn new(prefix_name: &str, cidr: &str, prefix: u8) -> Option<Fixture> {
        let cp = ControlPlane::shared()?;
        let client = cp.client().await.expect("client");
        install_crds(&client).await.expect("CRDs install");
        let ns = new_namespace(&client, prefix_name).await.expect("namespace");
        Some(Fixture { cp, client, ns, cidr: cidr.into(), prefix })
    }

    fn operator(&self, identity: &str) -> OperatorProcess {
        self.operator_with(identity, &[])
    }

    fn operator_with(&self, identity: &str, extra: &[&str]) -> OperatorProcess {
        let mut args = vec![
            format!("--cluster-cidr={}", self.cidr),
            format!("--node-prefix-length={}", self.prefix),
            format!("--node-selector={LABEL}={}", self.ns),
            format!("--leader-election-namespace={}", self.ns),
            format!("--identity={identity}"),
            // Short lease so that a SIGKILLed leader is replaced quickly.
            "--lease-duration-seconds=3".into(),
            "--renew-deadline-seconds=2".into(),
            "--retry-period-seconds=1".into(),
        ];
        // Deleted nodes' leases are withdrawn at once unless a test says.
        if !extra.iter().any(|a| a.starts_with("--release-grace-seconds")) {
            args.push("--release-grace-seconds=0".into());
        }
        args.extend(extra.iter().map(|a| a.to_string()));
        OperatorProcess::start(self.cp, &args).expect("operator starts")
    }

    /// Who holds this test's leader Lease ("" while nobody does).
    async fn lease_holder(&self) -> anyhow::Result<String> {
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let lease = leases.get_opt("weft-operator").await?;
        Ok(lease.and_then(|l| l.spec?.holder_identity).unwrap_or_default())
    }

    /// Waits until one of replica-a and replica-b holds the Lease; its identity.
    async fn wait_for_leader(&self) -> String {
        wait_for(Duration::from_secs(30), "a leader", || async { Ok(!self.lease_holder().await?.is_empty()) })
            .await
            .expect("a replica leads");
        self.lease_holder().await.expect("lease")
    }

    /// Creates `nodes` and runs `act` once the `n`th of this test's Subnets
    /// has appeared, while the creations go on.
    async fn create_nodes_acting_at_subnet(&self, nodes: &[String], n: usize, act: impl FnOnce()) {
        let prefix = format!("{}-", self.ns);
        let mut subnet_events = std::pin::pin!(kube::runtime::watcher(
            Api::<Subnet>::all(self.client.clone()),
            kube::runtime::watcher::Config::default()
        ));
        let creating = try_join_all(nodes.iter().map(|name| async { Ok::<_, ()>(self.create_node(name).await) }));
        let act_at_nth = async {
            let mut seen = HashSet::new();
            while let Some(ev) = subnet_events.try_next().await.expect("subnet watch") {
                if let kube::runtime::watcher::Event::Apply(s) = ev
                    && s.name_any().starts_with(&prefix)
                {
                    seen.insert(s.name_any());
                    if seen.len() >= n {
                        act();
                        return;
                    }
                }
            }
        };
        let (created, ()) = tokio::join!(creating, act_at_nth);
        created.expect("nodes created");
    }

    fn node_name(&self, i: usize) -> String {
        format!("{}-n{i}", self.ns)
    }

    async fn create_node(&self, name: &str) -> Node {
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {LABEL: self.ns}},
        }))
        .expect("node");
        Api::<Node>::all(self.client.clone()).create(&PostParams::default(), &node).await.expect("create node")
    }

    async fn delete_node(&self, name: &str) {
        Api::<Node>::all(self.client.clone()).delete(name, &DeleteParams::default()).await.expect("delete node");
    }

    /// This test's Subnets by node name.
    async fn subnets(&self) -> anyhow::Result<BTreeMap<String, Subnet>> {
        let all = Api::<Subnet>::all(self.client.clone()).list(&ListParams::default()).await?;
        Ok(all
            .items
            .into_iter()
            .filter(|s| s.spec.node_name.starts_with(&format!("{}-", self.ns)))
            .map(|s| (s.spec.node_name.clone(), s))
            .collect())
    }

    /// Waits until exactly `nodes` have an allocated Subnet and no other
    /// Subnet of this test exists.
    async fn wait_for_exact_subnets(&self, nodes: &[String], timeout: Duration) {
        let want: HashSet<&String> = nodes.iter().collect();
        wait_for(timeout, &format!("Subnets for exactly {} nodes", nodes.len()), || async {
            let subnets = self.subnets().await?;
            let have: HashSet<&String> = subnets.keys().collect();
            if have == want && subnets.values().all(allocated) {
                return Ok(true);
            }
            let summary: Vec<String> = subnets
                .values()
                .map(|s| format!("{}={}{}", s.name_any(), s.spec.cidr, if allocated(s) { "" } else { "(pending)" }))
                .collect();
            anyhow::bail!("have {} of {}: {}", have.len(), want.len(), summary.join(" "))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    }
}

fn allocated(s: &Subnet) -> bool {
    s.status.as_ref().is_some_and(|st| st.conditions.iter().any(|c| c.type_ == "Allocated" && c.status == "True"))
}

/// Asserts that the Subnets are pairwise disjoint, inside `pool`, one per
/// node, named after their node and reserved by the lease finalizer (no
/// owner reference: the garbage collector must not withdraw a lease).
fn assert_disjoint(subnets: &BTreeMap<String, Subnet>, pool: &str) {
    let pool: ipnet::IpNet = pool.parse().expect("pool");
    let nets: Vec<(String, ipnet::IpNet)> =
        subnets.values().map(|s| (s.name_any(), s.spec.cidr.parse().expect("subnet CIDR parses"))).collect();
    for (i, (a_name, a)) in nets.iter().enumerate() {
        assert!(pool.contains(a), "{a_name}: {a} outside pool {pool}");
        for (b_name, b) in &nets[i + 1..] {
            assert!(!a.contains(&b.network()) && !b.contains(&a.network()), "{a_name} ({a}) overlaps {b_name} ({b})");
        }
    }
    for (node, s) in subnets {
        assert_eq!(&s.name_any(), node, "Subnet is named after its node");
        assert_eq!(s.spec.node_name, *node);
        assert!(s.finalizers().iter().any(|f| f == LEASE_FINALIZER), "{node}: no lease finalizer");
        assert!(s.owner_references().is_empty(), "{node}: owned by {:?}", s.owner_references());
    }
}

#[tokio::test]
async fn joining_node_gets_a_subnet_and_metrics_are_served() {
    let Some(fx) = Fixture::new("op-join", "10.101.0.0/16", 24).await else { return };
    let mut op = fx.operator("solo");
    let node = fx.node_name(0);
    fx.create_node(&node).await;
    fx.wait_for_exact_subnets(std::slice::from_ref(&node), Duration::from_secs(30)).await;
    op.check_running().expect("operator running");

    let subnets = fx.subnets().await.expect("list");
    let s = &subnets[&node];
    assert_eq!(s.spec.cidr, "10.101.0.0/24", "first lease is the lowest block");
    assert_eq!(s.spec.backend, weft_api::Backend::Vxlan);
    assert_eq!(s.spec.vni, Some(1));
    assert_disjoint(&subnets, &fx.cidr);

    assert_eq!(op.http_get("/healthz").await.expect("healthz").0, 200);
    assert_eq!(op.http_get("/readyz").await.expect("readyz").0, 200);
    wait_for(Duration::from_secs(10), "lease gauges", || async {
        Ok(op.metric("weft_operator_subnet_leases{state=\"allocated\"} ").await == Some(1.0)
            && op.metric("weft_operator_subnet_leases{state=\"free\"} ").await == Some(255.0))
    })
    .await
    .expect("metrics report 1 allocated, 255 free");
    assert!(op.metric("weft_operator_reconcile_total{controller=\"node\"} ").await.unwrap_or(0.0) >= 1.0);
    assert!(
        op.http_get("/metrics").await.expect("metrics").1.contains("weft_operator_reconcile_duration_seconds_bucket")
    );

    // The lease survives an operator restart unchanged.
    op.kill();
    let mut op = fx.operator("solo-2");
    let cidr_before = s.spec.cidr.clone();
    let uid_before = s.uid();
    wait_for(Duration::from_secs(20), "restarted operator to lead", || async {
        Ok(op.metric("weft_operator_leader ").await == Some(1.0))
    })
    .await
    .expect("new leader");
    let after = fx.subnets().await.expect("list");
    assert_eq!((after[&node].spec.cidr.clone(), after[&node].uid()), (cidr_before, uid_before), "node keeps its lease");
    op.check_running().expect("operator running");
}

#[tokio::test]
async fn fifty_nodes_at_once_get_fifty_disjoint_subnets() {
    let Some(fx) = Fixture::new("op-fifty", "10.102.0.0/16", 24).await else { return };
    let mut op = fx.operator("fifty");
    let nodes: Vec<String> = (0..50).map(|i| fx.node_name(i)).collect();
    try_join_all(nodes.iter().map(|n| async { Ok::<_, ()>(fx.create_node(n).await) })).await.expect("create nodes");
    fx.wait_for_exact_subnets(&nodes, Duration::from_secs(60)).await;
    assert_disjoint(&fx.subnets().await.expect("list"), &fx.cidr);
    op.check_running().expect("operator running");
}

#[tokio::test]
async fn operator_killed_midway_leaves_no_overlaps_duplicates_or_orphans() {
    let Some(fx) = Fixture::new("op-kill", "10.103.0.0/16", 24).await else { return };
    // Two replicas: leader election must keep them from allocating together.
    // One reconcile at a time, so that the kill lands mid-allocation.
    let slow = ["--concurrency=1"];
    let mut a = fx.operator_with("replica-a", &slow);
    let mut b = fx.operator_with("replica-b", &slow);
    let leader = fx.wait_for_leader().await;
    let (leader, standby) = if leader == "replica-a" { (&mut a, &mut b) } else { (&mut b, &mut a) };
    wait_for(Duration::from_secs(10), "leader metrics", || async {
        Ok(leader.metric("weft_operator_leader ").await == Some(1.0))
    })
    .await
    .expect("the Lease holder leads");
    assert_eq!(standby.metric("weft_operator_leader ").await, Some(0.0), "only one replica leads");

    // SIGKILL the leader at the fifth of this test's Subnets.
    let nodes: Vec<String> = (0..50).map(|i| fx.node_name(i)).collect();
    fx.create_nodes_acting_at_subnet(&nodes, 5, || leader.kill()).await;
    let killed_at = fx.subnets().await.expect("list").len();
    eprintln!("killed the leader with {killed_at}/50 subnets allocated");
    assert!(killed_at < 50, "the kill must land mid-allocation ({killed_at}/50 done)");

    // The standby takes over; the killed one comes back as a standby.
    let _restarted = fx.operator("replica-c");
    fx.wait_for_exact_subnets(&nodes, Duration::from_secs(90)).await;
    standby.check_running().expect("standby running");
    let subnets = fx.subnets().await.expect("list");
    assert_eq!(subnets.len(), 50, "no duplicates");
    assert_disjoint(&subnets, &fx.cidr);
    // No orphans: every Subnet of this test belongs to an existing node.
    let all_nodes = Api::<Node>::all(fx.client.clone())
        .list(&ListParams::default().labels(&format!("{LABEL}={}", fx.ns)))
        .await
        .expect("nodes");
    let node_names: HashSet<String> = all_nodes.items.iter().map(|n| n.name_any()).collect();
    assert!(subnets.keys().all(|n| node_names.contains(n)));
}

#[tokio::test]
async fn a_leader_stopped_past_its_term_writes_nothing_when_it_continues() {
    let Some(fx) = Fixture::new("op-hung", "10.108.0.0/16", 24).await else { return };
    // One reconcile at a time, so that the stopped leader has work queued.
    let slow = ["--concurrency=1"];
    let mut a = fx.operator_with("replica-a", &slow);
    let mut b = fx.operator_with("replica-b", &slow);
    let first = fx.wait_for_leader().await;
    let (leader, standby, standby_id) =
        if first == "replica-a" { (&mut a, &mut b, "replica-b") } else { (&mut b, &mut a, "replica-a") };

    // Twenty nodes join; the leader hangs (SIGSTOP) at the third Subnet,
    // holding the Lease, with the rest of its work queued.
    let nodes: Vec<String> = (0..20).map(|i| fx.node_name(i)).collect();
    fx.create_nodes_acting_at_subnet(&nodes, 3, || leader.signal(libc::SIGSTOP)).await;

    // The standby takes over and finishes the work.
    wait_for(Duration::from_secs(30), "the standby to take the Lease", || async {
        Ok(fx.lease_holder().await? == standby_id)
    })
    .await
    .expect("takeover");
    fx.wait_for_exact_subnets(&nodes, Duration::from_secs(90)).await;
    let snapshot = || async {
        fx.subnets()
            .await
            .expect("list")
            .into_iter()
            .map(|(n, s)| (n, (s.spec.cidr.clone(), s.uid())))
            .collect::<BTreeMap<String, (String, Option<String>)>>()
    };
    let before = snapshot().await;

    // The old leader continues with its queue and stale caches: it finds
    // its term over (renewal cut off at the deadline, every write checking
    // the term first) and gives up without writing.
    let resumed_at = leader.log_text().len();
    leader.signal(libc::SIGCONT);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while leader.check_running().is_ok() {
        assert!(std::time::Instant::now() < deadline, "the old leader still runs 20 s after it continued");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = leader.log_text().get(resumed_at..).unwrap_or_default().to_owned();
    assert!(after.contains("lost leadership"), "{after}");
    // (Its log may still report a create it sent before it was stopped:
    // that one is in the snapshot. What it must not do is change anything.)
    standby.check_running().expect("the new leader runs");
    assert_eq!(snapshot().await, before, "Subnets changed after the old leader continued:\n{after}");
    assert_disjoint(&fx.subnets().await.expect("list"), &fx.cidr);
}

#[tokio::test]
async fn deleted_node_releases_its_subnet_for_reuse() {
    let Some(fx) = Fixture::new("op-release", "10.104.0.0/16", 24).await else { return };
    let mut op = fx.operator("release");
    let (n0, n1, n2) = (fx.node_name(0), fx.node_name(1), fx.node_name(2));
    fx.create_node(&n0).await;
    fx.wait_for_exact_subnets(std::slice::from_ref(&n0), Duration::from_secs(30)).await;
    fx.create_node(&n1).await;
    fx.wait_for_exact_subnets(&[n0.clone(), n1.clone()], Duration::from_secs(30)).await;
    let freed = fx.subnets().await.expect("list")[&n0].spec.cidr.clone();
    assert_eq!(freed, "10.104.0.0/24");

    fx.delete_node(&n0).await;
    fx.wait_for_exact_subnets(std::slice::from_ref(&n1), Duration::from_secs(30)).await;
    fx.create_node(&n2).await;
    fx.wait_for_exact_subnets(&[n1.clone(), n2.clone()], Duration::from_secs(30)).await;
    assert_eq!(fx.subnets().await.expect("list")[&n2].spec.cidr, freed, "the released CIDR is handed out again");
    op.check_running().expect("operator running");
}

#[tokio::test]
async fn exhausted_pool_reports_an_event_and_recovers() {
    // A /24 split into /26 blocks: room for four nodes.
    let Some(fx) = Fixture::new("op-full", "10.105.0.0/24", 26).await else { return };
    let mut op = fx.operator("full");
    let nodes: Vec<String> = (0..5).map(|i| fx.node_name(i)).collect();
    for n in &nodes[..4] {
        fx.create_node(n).await;
    }
    fx.wait_for_exact_subnets(&nodes[..4], Duration::from_secs(30)).await;
    let starved = &nodes[4];
    fx.create_node(starved).await;

    let events: Api<Event> = Api::namespaced(fx.client.clone(), "default");
    wait_for(Duration::from_secs(30), "SubnetPoolExhausted event", || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list.items.iter().any(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(starved.as_str())
                && e.reason.as_deref() == Some("SubnetPoolExhausted")
                && e.type_.as_deref() == Some("Warning")
                && e.note.as_deref().is_some_and(|n| n.contains("no free /26 left in cluster CIDR 10.105.0.0/24"))
        }))
    })
    .await
    .expect("exhaustion is reported on the node");
    assert!(op.metric("weft_operator_subnet_pool_exhausted_total ").await.unwrap_or(0.0) >= 1.0);
    let node_condition =
        |status: &'static str, reason: &'static str| {
            let nodes: Api<Node> = Api::all(fx.client.clone());
            let name = starved.clone();
            async move {
                let node = nodes.get(&name).await?;
                Ok(node.status.and_then(|s| s.conditions).unwrap_or_default().iter().any(|c| {
                    c.type_ == "WeftSubnetAllocated" && c.status == status && c.reason.as_deref() == Some(reason)
                }))
            }
        };
    wait_for(Duration::from_secs(10), "node condition WeftSubnetAllocated=False", || {
        node_condition("False", "SubnetPoolExhausted")
    })
    .await
    .expect("exhaustion is a condition on the node");
    // And on the node's Subnet, which has no range while it waits.
    wait_for(Duration::from_secs(10), "Subnet condition Allocated=False", || async {
        let subnets = fx.subnets().await?;
        let Some(s) = subnets.get(starved) else { anyhow::bail!("no Subnet for {starved}") };
        let conditions = s.status.as_ref().map(|st| st.conditions.as_slice()).unwrap_or_default();
        Ok(s.spec.is_pending()
            && s.spec.blocks().next().is_none()
            && conditions.iter().any(|c| {
                c.type_ == "Allocated"
                    && c.status == "False"
                    && c.reason == "SubnetPoolExhausted"
                    && c.message.contains("no free /26 left in cluster CIDR 10.105.0.0/24")
            }))
    })
    .await
    .expect("exhaustion is a condition on the node's Subnet, which holds no range");

    // Freeing a block lets the waiting node in, without waiting for a resync.
    let freed = fx.subnets().await.expect("list")[&nodes[1]].spec.cidr.clone();
    fx.delete_node(&nodes[1]).await;
    let expected: Vec<String> = [0, 2, 3, 4].iter().map(|&i| nodes[i].clone()).collect();
    fx.wait_for_exact_subnets(&expected, Duration::from_secs(20)).await;
    assert_eq!(fx.subnets().await.expect("list")[starved].spec.cidr, freed);
    wait_for(Duration::from_secs(10), "node condition WeftSubnetAllocated=True", || {
        node_condition("True", "SubnetAllocated")
    })
    .await
    .expect("the condition clears once the node has a lease");
    op.check_running().expect("operator running");
}

#[tokio::test]
async fn newer_of_two_overlapping_subnets_is_reallocated() {
    let Some(fx) = Fixture::new("op-overlap", "10.106.0.0/16", 24).await else { return };
    let (n0, n1) = (fx.node_name(0), fx.node_name(1));
    let subnets: Api<Subnet> = Api::all(fx.client.clone());
    // Two leases for the same block, as a split brain could leave them.
    for n in [&n0, &n1] {
        let node = fx.create_node(n).await;
        let s: Subnet = serde_json::from_value(json!({
            "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": n, "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": n, "uid": node.uid(), "controller": true}]},
            "spec": {"nodeName": n, "cidr": "10.106.0.0/24"},
        }))
        .expect("subnet");
        subnets.create(&PostParams::default(), &s).await.expect("pre-create subnet");
        // creationTimestamp has one-second resolution; make the order certain.
        if n == &n0 {
            tokio::time::sleep(Duration::from_millis(1100)).await;
        }
    }
    let older_uid = fx.subnets().await.expect("list")[&n0].uid();
    let mut op = fx.operator("overlap");
    wait_for(Duration::from_secs(30), "overlap resolved", || async {
        let s = fx.subnets().await?;
        Ok(s.len() == 2 && s.values().all(allocated) && s[&n1].spec.cidr != "10.106.0.0/24")
    })
    .await
    .expect("newer subnet reallocated");
    let after = fx.subnets().await.expect("list");
    assert_eq!(after[&n0].uid(), older_uid, "the older lease is kept");
    assert_eq!(after[&n1].spec.cidr, "10.106.1.0/24");
    assert_disjoint(&after, &fx.cidr);
    op.check_running().expect("operator running");
}

#[tokio::test]
async fn a_node_that_registers_again_keeps_its_lease() {
    let Some(fx) = Fixture::new("op-recreate", "10.107.0.0/16", 24).await else { return };
    let mut op = fx.operator_with("recreate", &["--release-grace-seconds=60"]);
    let (n0, n1) = (fx.node_name(0), fx.node_name(1));
    fx.create_node(&n0).await;
    fx.wait_for_exact_subnets(std::slice::from_ref(&n0), Duration::from_secs(30)).await;
    let before = fx.subnets().await.expect("list")[&n0].clone();
    // The Node object deleted and created again (a node re-registering)
    // while its pods run: the lease must not move under them.
    fx.delete_node(&n0).await;
    wait_for(Duration::from_secs(20), "the operator to see the node absent", || async {
        Ok(op.log_text().contains("node is absent; its lease is kept"))
    })
    .await
    .expect("absence noticed");
    fx.create_node(&n0).await;
    // A later node's lease shows the operator has processed the recreation.
    fx.create_node(&n1).await;
    fx.wait_for_exact_subnets(&[n0.clone(), n1.clone()], Duration::from_secs(30)).await;
    let after = fx.subnets().await.expect("list");
    assert_eq!(after[&n0].uid(), before.uid(), "the same Subnet object");
    assert_eq!(after[&n0].spec.cidr, before.spec.cidr);
    assert!(after[&n0].metadata.deletion_timestamp.is_none(), "the lease was withdrawn");
    assert_disjoint(&after, &fx.cidr);
    op.check_running().expect("operator running");
}

#[tokio::test]
async fn a_withdrawn_block_stays_reserved_while_a_pod_holds_an_address_in_it() {
    let Some(fx) = Fixture::new("op-reserve", "10.109.0.0/16", 24).await else { return };
    let mut op = fx.operator("reserve");
    let (n0, n1, n2) = (fx.node_name(0), fx.node_name(1), fx.node_name(2));
    fx.create_node(&n0).await;
    fx.wait_for_exact_subnets(std::slice::from_ref(&n0), Duration::from_secs(30)).await;
    let block = fx.subnets().await.expect("list")[&n0].spec.cidr.clone();
    assert_eq!(block, "10.109.0.0/24");
    // A pod of that node with an address in the block, as the API shows it
    // (no kubelet here: the status is written by hand).
    let pods: Api<Pod> = Api::namespaced(fx.client.clone(), &fx.ns);
    // No controller-manager here makes the namespace's default account.
    let accounts: Api<ServiceAccount> = Api::namespaced(fx.client.clone(), &fx.ns);
    let account = serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("account");
    accounts.create(&PostParams::default(), &account).await.expect("create service account");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "holder"},
        "spec": {"nodeName": n0, "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10.1"}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod).await.expect("create pod");
    let status = json!({"status": {"podIP": "10.109.0.7", "podIPs": [{"ip": "10.109.0.7"}]}});
    pods.patch_status("holder", &PatchParams::default(), &Patch::Merge(&status)).await.expect("pod status");

    fx.delete_node(&n0).await;
    wait_for(Duration::from_secs(20), "the lease to be withdrawn", || async {
        Ok(fx.subnets().await?.get(&n0).is_some_and(|s| s.metadata.deletion_timestamp.is_some()))
    })
    .await
    .expect("the gone node's lease is withdrawn");
    // The block is not handed out while the pod holds an address in it.
    fx.create_node(&n1).await;
    wait_for(Duration::from_secs(30), "a lease for the next node", || async {
        Ok(fx.subnets().await?.get(&n1).is_some_and(allocated))
    })
    .await
    .expect("next node leased");
    let subnets = fx.subnets().await.expect("list");
    assert_eq!(subnets[&n1].spec.cidr, "10.109.1.0/24", "the reserved block was handed out again");
    assert!(subnets.contains_key(&n0), "the withdrawn lease was let go while a pod used its block");
    assert!(op.log_text().contains("1 pods on its node still have addresses in it"), "{}", op.log_text());

    // The pod gone, the block is let go and reused.
    pods.delete("holder", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
        .await
        .expect("delete pod");
    fx.wait_for_exact_subnets(std::slice::from_ref(&n1), Duration::from_secs(30)).await;
    fx.create_node(&n2).await;
    fx.wait_for_exact_subnets(&[n1.clone(), n2.clone()], Duration::from_secs(30)).await;
    assert_eq!(fx.subnets().await.expect("list")[&n2].spec.cidr, block, "the let-go block is leased again");
    op.check_running().expect("operator running");
}

/// Dual-stack: every node's Subnet lists a block of each family; a lease
/// from before the cluster was made dual-stack keeps its IPv4 block and gets
/// an IPv6 one added; the IPv6 blocks are disjoint like the IPv4 ones.
#[tokio::test]
async fn dual_stack_leases_a_block_of_each_family_and_extends_older_leases() {
    let Some(fx) = Fixture::new("op-dual", "10.110.0.0/16", 24).await else { return };
    let (n0, n1, n2) = (fx.node_name(0), fx.node_name(1), fx.node_name(2));
    let mut single = fx.operator("single");
    fx.create_node(&n0).await;
    fx.wait_for_exact_subnets(std::slice::from_ref(&n0), Duration::from_secs(30)).await;
    let before = fx.subnets().await.expect("list")[&n0].clone();
    assert!(before.spec.cidrs.is_empty(), "a single-stack lease lists no cidrs: {:?}", before.spec);
    single.kill();

    let mut dual = fx.operator_with("dual", &["--secondary-cluster-cidr=fd00:110::/56"]);
    fx.create_node(&n1).await;
    fx.create_node(&n2).await;
    let nodes = [n0.clone(), n1, n2];
    fx.wait_for_exact_subnets(&nodes, Duration::from_secs(30)).await;
    wait_for(Duration::from_secs(30), "every lease to hold both families", || async {
        let subnets = fx.subnets().await?;
        let summary: Vec<String> = subnets.values().map(|s| format!("{}={:?}", s.name_any(), s.spec.cidrs)).collect();
        anyhow::ensure!(subnets.values().all(|s| s.spec.cidrs.len() == 2), "{}", summary.join(" "));
        Ok(true)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let subnets = fx.subnets().await.expect("list");
    let after = &subnets[&n0];
    assert_eq!((after.uid(), &after.spec.cidr), (before.uid(), &before.spec.cidr), "the older lease is kept");
    assert_eq!(after.spec.cidrs[0], after.spec.cidr);
    let v6: Vec<ipnet::IpNet> = subnets.values().map(|s| s.spec.cidrs[1].parse().expect("IPv6 block")).collect();
    let pool: ipnet::IpNet = "fd00:110::/56".parse().expect("pool");
    for (i, a) in v6.iter().enumerate() {
        assert!(pool.contains(a) && a.prefix_len() == 64, "{a} is not a /64 of {pool}");
        assert!(v6[i + 1..].iter().all(|b| a != b), "{a} leased twice: {v6:?}");
    }
    assert_disjoint(&subnets, &fx.cidr);
    dual.check_running().expect("operator running");
}
