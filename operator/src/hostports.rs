//! HostPortAllocations: the agents write them (they own the ports); the
//! operator deletes those whose pod is gone (a cluster may run no garbage
//! collector), keeps each pod's `weft.dev/host-port-addresses` annotation
//! in step with its allocations, and reports per-node pool usage on the
//! objects' status and as metrics.
//!
//! Level-triggered: every change of an allocation or a pod, and a periodic
//! resync, runs one pass over everything in the caches.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use weft_api::host_port::{
    ADDRESSES_ANNOTATION, HostPort, HostPortAllocation, HostPortAllocationStatus, NodePoolStatus,
};

use crate::leader::{NotLeader, Term};
use crate::metrics::Metrics;

pub const CONDITION_ANNOTATED: &str = "PodAnnotated";

/// What the host port controller works with: the caches it reads and the
/// client it writes through.
pub struct Ctx {
    pub client: Client,
    pub allocations: Store<HostPortAllocation>,
    pub pods: Store<Pod>,
    pub metrics: Arc<Metrics>,
    pub term: Term,
}

/// Runs until the process ends. `pods` is the operator's shared Pod cache
/// and `changed` is notified on its changes; allocation changes notify it
/// too.
///
/// The same shape as the Subnet and policy controllers (a context, a
/// reconcile, an error policy), but one reconcile covers every
/// allocation: the node pools and the sweep of stale pod annotations span
/// all of them, so there is no per-object key to queue.
pub async fn run(
    client: Client,
    pods: Store<Pod>,
    changed: Arc<tokio::sync::Notify>,
    metrics: Arc<Metrics>,
    resync: Duration,
    term: Term,
) {
    let allocations = weft_api::watch::reflect(
        Api::<HostPortAllocation>::all(client.clone()),
        watcher::Config::default(),
        "HostPortAllocation",
        weft_api::watch::keep_all,
        Some(changed.clone()),
    );
    if allocations.wait_until_ready().await.is_err() || pods.wait_until_ready().await.is_err() {
        tracing::error!("host port caches were dropped before they were ready");
        return;
    }
    let ctx = Ctx { client, allocations, pods, metrics, term };
    loop {
        let started = std::time::Instant::now();
        let result = reconcile(&ctx).await;
        ctx.metrics.observe("hostports", started.elapsed(), result.is_err());
        let wait = match result {
            Ok(()) => resync,
            Err(e) => error_policy(&e),
        };
        tokio::select! {
            _ = changed.notified() => {
                // Let a burst of changes (a node's pods starting) settle into one pass.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Retry policy for a failed reconcile.
fn error_policy(error: &Error) -> Duration {
    tracing::warn!(%error, "host port reconcile failed; retrying");
    Duration::from_secs(1)
}

/// Where a port is reachable, as `ip:port` (an IPv6 address in brackets):
/// its host IP if it has one, else the node's IP and, for a dual-stack
/// pod, the node's IPv6 address.
fn reachable_at(a: &HostPortAllocation, p: &HostPort) -> Vec<String> {
    let ips: Vec<&str> = match &p.host_ip {
        Some(ip) => vec![ip.as_str()],
        None => std::iter::once(a.spec.node_ip.as_str()).chain(a.spec.node_ipv6.as_deref()).collect(),
    };
    ips.into_iter()
        .map(|ip| if ip.contains(':') { format!("[{ip}]:{}", p.host_port) } else { format!("{ip}:{}", p.host_port) })
        .collect()
}

/// The annotation value for a pod's allocations: `containerPort/PROTOCOL` →
/// `nodeIP:hostPort` (the first address; the status lists them all), as
/// JSON with sorted keys.
pub fn addresses_annotation(allocs: &[&HostPortAllocation]) -> String {
    let map: BTreeMap<String, String> = allocs
        .iter()
        .flat_map(|a| {
            a.spec.ports.iter().filter_map(|p| {
                let first = reachable_at(a, p).into_iter().next()?;
                Some((format!("{}/{}", p.container_port, p.protocol.as_str()), first))
            })
        })
        .collect();
    serde_json::to_string(&map).unwrap_or_default()
}

/// Whether `a` belongs to `pod` as it is: the same pod (its UID, when the
/// allocation names one) on the allocation's node. An agent may write
/// allocations of its own node only, so one naming a pod of another node
/// is not that pod's, whoever wrote it, and is never trusted.
fn pod_alive(pod: Option<&Pod>, a: &HostPortAllocation) -> bool {
    pod.is_some_and(|p| {
        let same_pod = a.spec.pod_ref.uid.as_deref().is_none_or(|uid| p.metadata.uid.as_deref() == Some(uid));
        let same_node = p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(a.spec.node_name.as_str());
        same_pod && same_node
    })
}

/// Per node: (ports of the range in use, size of the range).
pub fn node_pools(allocs: &[Arc<HostPortAllocation>]) -> HashMap<String, (i32, i32)> {
    let mut pools: HashMap<String, (i32, i32)> = HashMap::new();
    for a in allocs {
        let entry = pools.entry(a.spec.node_name.clone()).or_default();
        if let Some(r) = a.spec.port_range {
            entry.1 = r.last - r.first + 1;
            entry.0 += a.spec.ports.iter().filter(|p| (r.first..=r.last).contains(&p.host_port)).count() as i32;
        }
    }
    pools
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{action} {kind} {namespace}/{name}: {source}")]
    Kube { action: &'static str, kind: &'static str, namespace: String, name: String, source: kube::Error },
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
}

/// Builds the error for a failed call on `kind` `namespace/name`.
fn failed(action: &'static str, kind: &'static str, namespace: &str, name: &str) -> impl FnOnce(kube::Error) -> Error {
    let (namespace, name) = (namespace.to_owned(), name.to_owned());
    move |source| Error::Kube { action, kind, namespace, name, source }
}

/// One pass over every allocation: delete those whose pod is gone, keep
/// each pod's addresses annotation and each allocation's status in step.
/// Each write first checks that this replica is still the leader.
pub async fn reconcile(ctx: &Ctx) -> Result<(), Error> {
    let Ctx { client, allocations, pods, metrics, term } = ctx;
    let all = allocations.state();
    let mut live: Vec<Arc<HostPortAllocation>> = Vec::new();
    for a in all {
        let ns = a.namespace().unwrap_or_default();
        let cached = pods.get(&ObjectRef::new(&a.spec.pod_ref.name).within(&ns));
        if pod_alive(cached.as_deref(), &a) {
            live.push(a);
            continue;
        }
        // The cache may lag behind a pod created a moment ago: ask the API.
        let fresh = Api::<Pod>::namespaced(client.clone(), &ns).get_opt(&a.spec.pod_ref.name).await.map_err(failed(
            "looking up",
            "Pod",
            &ns,
            &a.spec.pod_ref.name,
        ))?;
        if pod_alive(fresh.as_ref(), &a) {
            live.push(a);
            continue;
        }
        term.check()?;
        tracing::info!(allocation = %format!("{ns}/{}", a.name_any()), pod = %a.spec.pod_ref.name, "pod is gone; deleting its HostPortAllocation");
        match Api::<HostPortAllocation>::namespaced(client.clone(), &ns)
            .delete(&a.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => {
                metrics.host_port_collected.inc();
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(failed("deleting", "HostPortAllocation", &ns, &a.name_any())(e)),
        }
    }

    let pools = node_pools(&live);
    metrics.set_host_port_pools(&pools);

    // Pod annotations: one value per pod from all its allocations.
    let mut by_pod: BTreeMap<(String, String), Vec<&HostPortAllocation>> = BTreeMap::new();
    for a in &live {
        by_pod.entry((a.namespace().unwrap_or_default(), a.spec.pod_ref.name.clone())).or_default().push(a);
    }
    let mut annotated: HashMap<(String, String), Result<(), String>> = HashMap::new();
    for ((ns, name), allocs) in &by_pod {
        let want = addresses_annotation(allocs);
        let pod = pods.get(&ObjectRef::new(name).within(ns));
        let have = pod.as_ref().and_then(|p| p.annotations().get(ADDRESSES_ANNOTATION).cloned());
        let outcome = if have.as_deref() == Some(want.as_str()) {
            Ok(())
        } else {
            term.check()?;
            let patch = json!({"metadata": {"annotations": {ADDRESSES_ANNOTATION: want}}});
            // A merge patch of metadata only: the pod is neither restarted nor rescheduled.
            Api::<Pod>::namespaced(client.clone(), ns)
                .patch_metadata(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        annotated.insert((ns.clone(), name.clone()), outcome);
    }
    // Pods that keep the annotation without any allocation (their ports were released).
    for pod in pods.state() {
        let key = (pod.namespace().unwrap_or_default(), pod.name_any());
        if pod.annotations().contains_key(ADDRESSES_ANNOTATION) && !by_pod.contains_key(&key) {
            term.check()?;
            let patch = json!({"metadata": {"annotations": {ADDRESSES_ANNOTATION: null}}});
            match Api::<Pod>::namespaced(client.clone(), &key.0)
                .patch_metadata(&key.1, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(failed("removing the addresses annotation of", "Pod", &key.0, &key.1)(e)),
            }
        }
    }

    // Status: addresses, the node's pool, whether the pod shows them.
    for a in &live {
        let ns = a.namespace().unwrap_or_default();
        let (used, size) = pools.get(&a.spec.node_name).copied().unwrap_or_default();
        let outcome = annotated.get(&(ns.clone(), a.spec.pod_ref.name.clone())).cloned().unwrap_or(Ok(()));
        let want = status_for(a, used, size, &outcome);
        if same_status(a.status.as_ref(), &want) {
            continue;
        }
        term.check()?;
        let patch = json!({"status": want});
        match Api::<HostPortAllocation>::namespaced(client.clone(), &ns)
            .patch_status(&a.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(failed("updating the status of", "HostPortAllocation", &ns, &a.name_any())(e)),
        }
    }
    Ok(())
}

fn status_for(
    a: &HostPortAllocation,
    used: i32,
    size: i32,
    annotated: &Result<(), String>,
) -> HostPortAllocationStatus {
    let addresses = a
        .spec
        .ports
        .iter()
        .flat_map(|p| reachable_at(a, p).into_iter().map(|at| format!("{at}/{}", p.protocol.as_str())))
        .collect();
    let (status, reason, message) = match annotated {
        Ok(()) => ("True", "Annotated", format!("pod annotation {ADDRESSES_ANNOTATION} lists these ports")),
        Err(e) => ("False", "AnnotationFailed", format!("cannot annotate the pod: {e}")),
    };
    let condition = serde_json::from_value(json!({
        "type": CONDITION_ANNOTATED,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string(),
    }));
    HostPortAllocationStatus {
        conditions: condition.into_iter().collect(),
        addresses,
        node_pool: (size > 0).then(|| NodePoolStatus { used, size, summary: format!("{used}/{size}") }),
    }
}

/// Equal but for condition timestamps.
fn same_status(have: Option<&HostPortAllocationStatus>, want: &HostPortAllocationStatus) -> bool {
    let Some(have) = have else { return false };
    let key = |s: &HostPortAllocationStatus| {
        s.conditions
            .iter()
            .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone(), c.message.clone()))
            .collect::<Vec<_>>()
    };
    have.addresses == want.addresses && have.node_pool == want.node_pool && key(have) == key(want)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(node: &str, ports: serde_json::Value) -> HostPortAllocation {
        let mut a: HostPortAllocation = serde_json::from_value(json!({
            "apiVersion": "weft.dev/v1alpha1", "kind": "HostPortAllocation",
            "metadata": {"name": "web-1", "namespace": "default"},
            "spec": {"podRef": {"name": "web", "uid": "u1"}, "nodeName": node, "nodeIP": "10.250.0.11",
                     "ports": ports, "portRange": {"first": 20000, "last": 20009}},
        }))
        .unwrap();
        a.status = None;
        a
    }

    #[test]
    fn annotation_maps_container_ports_to_reachable_addresses() {
        let a = alloc(
            "n1",
            json!([{"protocol": "TCP", "containerPort": 80, "hostPort": 20000},
                                     {"protocol": "UDP", "containerPort": 53, "hostPort": 20001, "hostIP": "10.0.0.9"}]),
        );
        assert_eq!(addresses_annotation(&[&a]), r#"{"53/UDP":"10.0.0.9:20001","80/TCP":"10.250.0.11:20000"}"#);
        let s = status_for(&a, 2, 10, &Ok(()));
        assert_eq!(s.addresses, vec!["10.250.0.11:20000/TCP", "10.0.0.9:20001/UDP"]);
        assert_eq!(s.node_pool.as_ref().map(|p| p.summary.as_str()), Some("2/10"));
        assert!(same_status(Some(&s), &status_for(&a, 2, 10, &Ok(()))));
        assert!(!same_status(Some(&s), &status_for(&a, 3, 10, &Ok(()))));
    }

    #[test]
    fn a_dual_stack_pod_is_listed_at_both_node_addresses() {
        let mut a = alloc(
            "n1",
            json!([{"protocol": "TCP", "containerPort": 80, "hostPort": 20000},
                   {"protocol": "UDP", "containerPort": 53, "hostPort": 20001, "hostIP": "fd00:250::99"}]),
        );
        a.spec.node_ipv6 = Some("fd00:250::11".into());
        let s = status_for(&a, 2, 10, &Ok(()));
        assert_eq!(s.addresses, vec!["10.250.0.11:20000/TCP", "[fd00:250::11]:20000/TCP", "[fd00:250::99]:20001/UDP"]);
        assert_eq!(addresses_annotation(&[&a]), r#"{"53/UDP":"[fd00:250::99]:20001","80/TCP":"10.250.0.11:20000"}"#);
    }

    #[test]
    fn pools_count_only_ports_of_the_range_per_node() {
        let a = Arc::new(alloc(
            "n1",
            json!([{"containerPort": 80, "hostPort": 20000}, {"containerPort": 81, "hostPort": 8080}]),
        ));
        let b = Arc::new(alloc("n2", json!([{"containerPort": 80, "hostPort": 20000}])));
        let pools = node_pools(&[a, b]);
        assert_eq!(pools["n1"], (1, 10));
        assert_eq!(pools["n2"], (1, 10));
    }

    #[test]
    fn a_recreated_pod_does_not_keep_the_old_allocation_alive() {
        let a = alloc("n1", json!([{"containerPort": 80, "hostPort": 20000}]));
        let pod = |uid: &str| -> Pod {
            serde_json::from_value(
                json!({"metadata": {"name": "web", "uid": uid}, "spec": {"nodeName": "n1", "containers": []}}),
            )
            .unwrap()
        };
        assert!(pod_alive(Some(&pod("u1")), &a));
        assert!(!pod_alive(Some(&pod("u2")), &a));
        assert!(!pod_alive(None, &a));
    }

    #[test]
    fn an_allocation_of_another_node_is_not_the_pod_s() {
        // Written by node n2's agent (its own node) for a pod running on n1.
        let forged = alloc("n2", json!([{"containerPort": 80, "hostPort": 20000}]));
        let on = |node: Option<&str>| -> Pod {
            serde_json::from_value(
                json!({"metadata": {"name": "web", "uid": "u1"}, "spec": {"nodeName": node, "containers": []}}),
            )
            .unwrap()
        };
        assert!(!pod_alive(Some(&on(Some("n1"))), &forged));
        assert!(!pod_alive(Some(&on(None)), &forged), "an unscheduled pod has no host ports");
        assert!(pod_alive(Some(&on(Some("n2"))), &forged));
    }

    mod mock_api {
        use super::*;
        use crate::mock_api::{Handle, expect, no_more_requests, not_found, ok, store};
        use http::Method;
        use serde_json::Value;

        const ALLOCATION: &str = "/apis/weft.dev/v1alpha1/namespaces/default/hostportallocations/web-1";
        const POD: &str = "/api/v1/namespaces/default/pods/web";

        fn context(allocations: Vec<HostPortAllocation>, pods: Vec<Pod>) -> (Arc<Ctx>, Handle) {
            let (client, handle) = crate::mock_api::client();
            let ctx = Ctx {
                client,
                allocations: store(allocations),
                pods: store(pods),
                metrics: Arc::new(Metrics::new()),
                term: Term::always(),
            };
            (Arc::new(ctx), handle)
        }

        fn pod(annotation: Option<&str>) -> Pod {
            let annotations = annotation.map(|a| json!({ADDRESSES_ANNOTATION: a})).unwrap_or(json!({}));
            serde_json::from_value(json!({"metadata": {"name": "web", "namespace": "default", "uid": "u1",
                "annotations": annotations}, "spec": {"nodeName": "n1", "containers": []}}))
            .unwrap()
        }

        fn one_port() -> HostPortAllocation {
            alloc("n1", json!([{"protocol": "TCP", "containerPort": 80, "hostPort": 20000}]))
        }

        async fn run(ctx: &Arc<Ctx>) -> tokio::task::JoinHandle<Result<(), Error>> {
            let ctx = ctx.clone();
            tokio::spawn(async move { reconcile(&ctx).await })
        }

        #[tokio::test]
        async fn an_allocation_whose_pod_is_gone_is_deleted_once_the_api_confirms_it() {
            let (ctx, mut api) = context(vec![one_port()], vec![]);
            let pass = run(&ctx).await;
            // The cache may lag behind a new pod: the API is asked first.
            expect(&mut api, Method::GET, POD, not_found("pod web")).await;
            expect(&mut api, Method::DELETE, ALLOCATION, ok(&one_port())).await;
            pass.await.unwrap().unwrap();
            assert!(no_more_requests(&mut api).await);
            assert_eq!(ctx.metrics.host_port_collected.get(), 1);
        }

        #[tokio::test]
        async fn a_pod_the_cache_has_not_seen_yet_keeps_its_allocation() {
            let (ctx, mut api) = context(vec![one_port()], vec![]);
            let pass = run(&ctx).await;
            expect(&mut api, Method::GET, POD, ok(&pod(None))).await;
            // Live: annotated and its status written.
            expect(&mut api, Method::PATCH, POD, ok(&pod(None))).await;
            let status = expect(&mut api, Method::PATCH, &format!("{ALLOCATION}/status"), ok(&one_port())).await;
            assert_eq!(status["status"]["addresses"], json!(["10.250.0.11:20000/TCP"]), "{status}");
            pass.await.unwrap().unwrap();
        }

        #[tokio::test]
        async fn a_live_pod_is_annotated_and_the_status_shows_its_addresses_and_pool() {
            let (ctx, mut api) = context(vec![one_port()], vec![pod(None)]);
            let pass = run(&ctx).await;
            let patch = expect(&mut api, Method::PATCH, POD, ok(&pod(None))).await;
            assert_eq!(
                patch["metadata"]["annotations"][ADDRESSES_ANNOTATION], r#"{"80/TCP":"10.250.0.11:20000"}"#,
                "{patch}"
            );
            let status = expect(&mut api, Method::PATCH, &format!("{ALLOCATION}/status"), ok(&one_port())).await;
            assert_eq!(status["status"]["nodePool"]["summary"], "1/10", "{status}");
            assert_eq!(status["status"]["conditions"][0]["status"], "True", "{status}");
            pass.await.unwrap().unwrap();
            assert!(no_more_requests(&mut api).await);
        }

        #[tokio::test]
        async fn a_released_pod_loses_its_annotation_and_what_is_in_step_is_not_written() {
            let (ctx, mut api) = context(vec![], vec![pod(Some(r#"{"80/TCP":"10.250.0.11:20000"}"#))]);
            let pass = run(&ctx).await;
            let patch = expect(&mut api, Method::PATCH, POD, ok(&pod(None))).await;
            assert_eq!(patch["metadata"]["annotations"][ADDRESSES_ANNOTATION], Value::Null, "{patch}");
            pass.await.unwrap().unwrap();

            let mut done = one_port();
            done.status = Some(status_for(&done, 1, 10, &Ok(())));
            let (ctx, mut api) = context(vec![done], vec![pod(Some(r#"{"80/TCP":"10.250.0.11:20000"}"#))]);
            run(&ctx).await.await.unwrap().unwrap();
            assert!(no_more_requests(&mut api).await, "a pass over what is in step wrote something");
        }
    }
}
