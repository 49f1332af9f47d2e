//! Time from Node creation to an allocated Subnet, for 1 node and for 500
//! nodes created at once, and the operator's memory at 500 nodes, then with
//! 5,000 pods as well.
//!
//! Run with `e2e/bench.sh` (release binaries) or
//! `cargo bench -p weft-e2e --bench subnet_leases`. Starts its own control
//! plane (etcd + kube-apiserver from `e2e/scripts/build-tools.sh`) and the
//! real `weft-operator` binary.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use weft_api::Subnet;
use weft_e2e::control_plane::operator::OperatorProcess;
use weft_e2e::control_plane::{ControlPlane, install_crds, tools_dir, tools_present, wait_until_crds_take_creates};

const SINGLE_RUNS: usize = 10;
const BULK_NODES: usize = 500;
const PODS: usize = 5000;

fn main() {
    if !weft_e2e::prereq::require(&format!("kube-apiserver and etcd in {}", tools_dir().display()), tools_present()) {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let cp = ControlPlane::start().expect("control plane starts");
    rt.block_on(bench(&cp));
}

fn allocated(s: &Subnet) -> bool {
    s.status.as_ref().is_some_and(|st| st.conditions.iter().any(|c| c.type_ == "Allocated" && c.status == "True"))
}

/// Watches Subnets and records when each node's lease was first seen allocated.
fn spawn_recorder(client: Client) -> tokio::sync::watch::Receiver<HashMap<String, Instant>> {
    let (tx, rx) = tokio::sync::watch::channel(HashMap::new());
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(Api::<Subnet>::all(client), watcher::Config::default()));
        while let Ok(Some(ev)) = events.try_next().await {
            if let watcher::Event::Apply(s) | watcher::Event::InitApply(s) = ev
                && allocated(&s)
            {
                tx.send_if_modified(|seen| {
                    let fresh = !seen.contains_key(&s.spec.node_name);
                    seen.entry(s.spec.node_name.clone()).or_insert_with(Instant::now);
                    fresh
                });
            }
        }
    });
    rx
}

async fn create_node(nodes: &Api<Node>, name: &str) -> Instant {
    let node: Node =
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})).expect("node");
    let t = Instant::now();
    nodes.create(&PostParams::default(), &node).await.expect("create node");
    t
}

async fn wait_all(
    rx: &mut tokio::sync::watch::Receiver<HashMap<String, Instant>>,
    names: &[String],
    timeout: Duration,
) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if names.iter().all(|n| rx.borrow().contains_key(n)) {
            return;
        }
        if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
            let have = names.iter().filter(|n| rx.borrow().contains_key(*n)).count();
            panic!("only {have}/{} subnets allocated after {timeout:?}", names.len());
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

async fn bench(cp: &ControlPlane) {
    let client = cp.client().await.expect("client");
    let crds = install_crds(&client).await.expect("CRDs");
    // Timed leases start once the apiserver no longer holds back creates
    // of a just-established CRD (as in a cluster, where Weft's CRDs are old).
    wait_until_crds_take_creates(&client, &crds).await.expect("CRDs settled");
    let args: Vec<String> =
        ["--cluster-cidr=10.200.0.0/14", "--node-prefix-length=24", "--leader-election-namespace=default"]
            .map(String::from)
            .to_vec();
    let op = OperatorProcess::start(cp, &args).expect("operator");
    let nodes: Api<Node> = Api::all(client.clone());
    let mut seen = spawn_recorder(client.clone());
    let rss_idle = {
        // Let it settle (leader lease + caches) before measuring.
        let warm = "bench-warmup".to_string();
        create_node(&nodes, &warm).await;
        wait_all(&mut seen, std::slice::from_ref(&warm), Duration::from_secs(60)).await;
        op.rss_kib().unwrap_or(0)
    };

    // 1 node at a time.
    let mut single = Vec::new();
    for i in 0..SINGLE_RUNS {
        let name = format!("bench-single-{i}");
        let t0 = create_node(&nodes, &name).await;
        wait_all(&mut seen, std::slice::from_ref(&name), Duration::from_secs(30)).await;
        single.push(seen.borrow()[&name] - t0);
    }
    single.sort();

    // 500 nodes at once (32 creations in flight, as a burst of joining kubelets would be).
    let names: Vec<String> = (0..BULK_NODES).map(|i| format!("bench-bulk-{i}")).collect();
    let start = Instant::now();
    let created: HashMap<String, Instant> = stream::iter(names.iter().cloned())
        .map(|n| {
            let nodes = nodes.clone();
            async move {
                let t = create_node(&nodes, &n).await;
                (n, t)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let created_all = start.elapsed();
    wait_all(&mut seen, &names, Duration::from_secs(600)).await;
    let bulk_total = {
        let snapshot = seen.borrow();
        names.iter().map(|n| snapshot[n]).max().map(|t| t - start).unwrap_or_default()
    };
    let mut bulk: Vec<Duration> = {
        let snapshot = seen.borrow();
        names.iter().map(|n| snapshot[n] - created[n]).collect()
    };
    bulk.sort();
    let rss_500 = op.rss_kib().unwrap_or(0);
    let pods_took = with_pods(&client, &names).await;
    let rss_pods = op.rss_kib().unwrap_or(0);

    println!();
    println!("Subnet leases: node created -> Subnet Allocated (real kube-apiserver + etcd on loopback)");
    println!("| scenario                    | p50        | p90        | max        | total      |");
    println!("|-----------------------------|------------|------------|------------|------------|");
    println!(
        "| 1 node ({SINGLE_RUNS} runs)              | {:>10} | {:>10} | {:>10} | {:>10} |",
        ms(percentile(&single, 0.5)),
        ms(percentile(&single, 0.9)),
        ms(percentile(&single, 1.0)),
        "-"
    );
    println!(
        "| {BULK_NODES} nodes at once           | {:>10} | {:>10} | {:>10} | {:>10} |",
        ms(percentile(&bulk, 0.5)),
        ms(percentile(&bulk, 0.9)),
        ms(percentile(&bulk, 1.0)),
        ms(bulk_total)
    );
    println!("(creating the {BULK_NODES} Node objects took {})", ms(created_all));
    println!();
    println!("| operator RSS                | KiB        |");
    println!("|-----------------------------|------------|");
    println!("| after 1 node                | {rss_idle:>10} |");
    println!("| at {} nodes               | {rss_500:>10} |", BULK_NODES + SINGLE_RUNS + 1);
    println!("| and {PODS} pods              | {rss_pods:>10} |");
    println!("(creating the {PODS} pods and the operator counting them in a policy took {})", ms(pods_took));

    drop(op);
}

/// Creates PODS pods spread over `nodes` (Pending: no kubelet runs here),
/// each shaped like a Deployment's pod: two containers with env, resources
/// and probes, labels, and kubectl's last-applied annotation. Returns once a
/// weft.dev NetworkPolicy selecting them all counts every one (so the
/// operator's pod caches hold them); returns how long that took.
async fn with_pods(client: &Client, nodes: &[String]) -> Duration {
    use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
    use weft_api::NetworkPolicy;
    let start = Instant::now();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    let account: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("account");
    let _ = accounts.create(&PostParams::default(), &account).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let container = |name: &str| {
        json!({"name": name, "image": "registry.example.com/shop/web:1.2.3",
            "env": (0..10).map(|i| json!({"name": format!("SETTING_{i}"), "value": "a-typical-value"})).collect::<Vec<_>>(),
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}}})
    };
    stream::iter(0..PODS)
        .map(|i| {
            let pods = pods.clone();
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": format!("bench-pod-{i}"),
                    "labels": {"app": format!("app-{}", i % 50), "tier": "web", "pod-template-hash": "5d8c7b9f6c"},
                    "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x".repeat(1024)}},
                "spec": {"nodeName": nodes[i % nodes.len()], "containers": [container("web"), container("sidecar")]},
            }))
            .expect("pod");
            async move { pods.create(&PostParams::default(), &pod).await.expect("create pod") }
        })
        .buffer_unordered(32)
        .for_each(|_| async {})
        .await;
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), "default");
    let policy: NetworkPolicy = serde_json::from_value(json!({
        "apiVersion": "weft.dev/v1alpha1", "kind": "NetworkPolicy", "metadata": {"name": "bench-all"},
        "spec": {"podSelector": {}, "priority": 100, "ingress": [], "egress": []},
    }))
    .expect("policy");
    policies.create(&PostParams::default(), &policy).await.expect("create policy");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let counted = policies.get("bench-all").await.ok().and_then(|p| p.status).map_or(0, |s| s.selected_pods);
        if counted as usize == PODS {
            return start.elapsed();
        }
        assert!(Instant::now() < deadline, "the operator counted {counted} of {PODS} pods");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
