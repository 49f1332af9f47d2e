//! Scale: a real kube-apiserver and etcd with kwok simulating the nodes and
//! their kubelets (nodes Ready, pods Running with addresses), the real
//! weft-operator leasing every node's Subnet and publishing PodEndpoints,
//! and one real weft-agent enforcing policy for one of the simulated nodes.
//! The cluster grows through scale points (by default 100, 250, 500 and
//! 1,000 nodes, 50 pods per node in deployments of 5 to 50 replicas spread
//! over 100 namespaces, one NetworkPolicy per node); at each point a batch
//! of new Nodes is created at once and timed until leased, the pods until
//! Running and until published, with what one Pod watch and one PodEndpoint
//! watch received meanwhile; then the agent is started afresh once per pod
//! source (`WEFT_SCALE_POD_SOURCES`, default `pods,endpoints`) and timed to
//! ready and to its first full policy sync, then through policy and pod
//! label changes. The apiserver's own metrics say what each pod change cost
//! it in watch events and bytes. Then the agent is started once more as on
//! a real node (its lease, a VXLAN overlay; every other node's Subnet
//! carries the address its Node lists and a MAC, as its agent would
//! publish) and timed until every peer is programmed; the passes Node
//! heartbeats cause are counted (none), and a peer's new MAC is timed into
//! the kernel. After the last point, N watchers of every
//! Pod, then of every PodEndpoint (the agent's watch of other nodes' pods
//! in either mode, as N agents hold it; `WEFT_SCALE_FANOUT`, default
//! 10,50,100) measure what the apiserver pays per pod change for each
//! agent, the figure that grows with the node count. At the end the cluster
//! grows past the operator's pool (the smallest power of two of /24s that
//! holds the largest point): every node beyond it must be reported (a
//! condition on the Node and an Event), never left waiting silently, and
//! leased as soon as nodes leave.
//!
//! Everything runs in a network namespace this bench creates; nothing of
//! the root namespace is touched. Run with `e2e/bench.sh scale` (release
//! binaries; builds kwok) or `cargo bench -p weft-e2e --bench scale`.
//! `WEFT_SCALE_NODES` (comma-separated points), `WEFT_SCALE_PODS_PER_NODE`
//! and `WEFT_SCALE_POLICIES_PER_NODE` set the scale; `WEFT_SCALE_LOGS` (a
//! directory) keeps the logs of kwok, the operator and the agent.

use std::collections::HashSet;
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use nix::sched::{CloneFlags, setns};
use serde_json::json;
use weft_api::{PodEndpoint, Subnet};
use weft_e2e::bench_agent::{
    KillOnDrop, METRICS_ADDR, POLL, Synced, cpu_seconds, metric, metrics, next_sync, percentile, ready, rss_mib, syncs,
};
use weft_e2e::control_plane::operator::OperatorProcess;
use weft_e2e::control_plane::{
    Component, ControlPlane, Options, install_crds, tools_dir, tools_present, wait_until_crds_take_creates,
};
use weft_e2e::netns::Netns;
use weft_e2e::{bins, wait};

const NAMESPACES: usize = 100;
const CONCURRENCY: usize = 32;
/// Policy and label changes timed at each point.
const CHANGES: usize = 40;
/// The simulated node whose policy the real agent enforces.
const AGENT_NODE: &str = "kwok-0";
/// What kwok does to the nodes and pods it manages (beside its binary).
const KWOK_STAGES: &str = "kwok-stages.yaml";
/// kwok manages the Nodes carrying this annotation.
const KWOK_ANNOTATION: (&str, &str) = ("kwok.x-k8s.io/node", "fake");
/// Nodes created past the operator's pool at the end.
const BEYOND_POOL: usize = 20;
/// Leased nodes then deleted, whose Subnets go to waiting nodes.
const RELEASED: usize = 5;
/// Pod changes timed with each number of watchers.
const FANOUT_CHANGES: usize = 20;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let kwok = tools_dir().join("kwok");
    if !weft_e2e::prereq::require_root()
        || !weft_e2e::prereq::require(&format!("kube-apiserver and etcd in {}", tools_dir().display()), tools_present())
        || !weft_e2e::prereq::require(
            &format!("kwok and its stages in {} (e2e/scripts/build-tools.sh --kwok)", tools_dir().display()),
            kwok.exists() && tools_dir().join(KWOK_STAGES).exists(),
        )
    {
        return;
    }
    let points: Vec<usize> = std::env::var("WEFT_SCALE_NODES")
        .unwrap_or_else(|_| "100,250,500,1000".into())
        .split(',')
        .map(|p| p.trim().parse().expect("WEFT_SCALE_NODES: node counts, comma-separated"))
        .collect();
    assert!(points.windows(2).all(|w| w[0] < w[1]), "the scale points grow: {points:?}");
    let scale = Scale {
        pods_per_node: env_usize("WEFT_SCALE_PODS_PER_NODE", 50),
        policies_per_node: env_usize("WEFT_SCALE_POLICIES_PER_NODE", 1),
    };
    let ns = Netns::new("scale");
    ns.ip(&["link", "set", "lo", "up"]);
    // The overlay agent's node address (its VXLAN packets would leave by
    // it); a bridge, since this kernel has no dummy links.
    ns.ip(&["link", "add", "underlay0", "type", "bridge"]);
    ns.ip(&["addr", "add", &format!("{}/16", kwok_node_ip(0)), "dev", "underlay0"]);
    ns.ip(&["link", "set", "underlay0", "up"]);
    let path = ns.path();
    // The whole bench runs on a thread inside the namespace: the control
    // plane, kwok, the operator, the agent and the bench's own client.
    std::thread::spawn(move || {
        let file = File::open(&path).expect("open netns");
        setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        rt.block_on(bench(&points, scale, &path, &kwok));
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p));
}

#[derive(Clone, Copy)]
struct Scale {
    pods_per_node: usize,
    policies_per_node: usize,
}

/// Node `i`'s pod range for kwok's addresses (not Weft's lease: the pods
/// are simulated, their addresses only have to be distinct).
fn kwok_pod_cidr(i: usize) -> String {
    format!("10.{}.{}.0/24", 64 + i / 256, i % 256)
}

/// Node `i`'s address, as its kubelet lists it and its agent claims it.
fn kwok_node_ip(i: usize) -> String {
    format!("100.64.{}.{}", i / 250, i % 250 + 1)
}

/// The MAC of node `i`'s VXLAN device, as its agent would publish it; a new
/// `generation` stands for a recreated device.
fn kwok_vtep_mac(i: usize, generation: usize) -> String {
    format!("02:77:{:02x}:{:02x}:{:02x}:{:02x}", generation % 256, (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

/// Deployment `d`: its namespace and replicas (5 to 50).
fn deployment(d: usize) -> (String, usize) {
    (format!("s{}", d % NAMESPACES), 5 + (d * 7) % 46)
}

/// What one scale point measured.
#[derive(Default)]
struct Point {
    nodes: usize,
    pods: usize,
    /// Pods of the earlier points.
    pods_before: usize,
    policies: usize,
    new_nodes: usize,
    /// Creating the new Node objects (`CONCURRENCY` in flight).
    nodes_created: Duration,
    lease: Duration,
    /// The operator's requests while the new nodes were leased
    /// ([`operator_requests`]).
    operator_requests: std::collections::BTreeMap<String, f64>,
    pods_running: Duration,
    /// From the first pod created to a PodEndpoint of every pod.
    endpoints_published: Duration,
    /// What one watcher of Pods and one of PodEndpoints received while the
    /// point's pods were created and ran: (events, bytes) per pod.
    pod_watch_per_pod: (f64, f64),
    endpoint_watch_per_pod: (f64, f64),
    operator_rss: f64,
    /// The agent, once per pod source.
    agents: Vec<AgentRun>,
    /// The agent with its lease and overlay, programming every peer.
    overlay: PeerRun,
    apiserver_rss: f64,
    etcd_rss: f64,
}

/// What one agent run measured.
#[derive(Default)]
struct AgentRun {
    /// Its `--pod-source`.
    source: String,
    ready: Duration,
    synced: Duration,
    rss: f64,
    local_pods: f64,
    rules: f64,
    policy_changes: Vec<Synced>,
    label_changes: Vec<Synced>,
    /// Watch events and bytes (Pods and PodEndpoints, to every watcher) and
    /// apiserver CPU per label change.
    events_per_change: f64,
    bytes_per_change: f64,
    apiserver_cpu_per_change: f64,
}

/// What one real agent's overlay (vxlan, its own Subnet lease) measured.
#[derive(Default)]
struct PeerRun {
    peers: usize,
    /// Agent start → every peer programmed (routes, neighbour and FDB entries).
    programmed: Duration,
    /// Passes run until then, and their summed time.
    passes: f64,
    pass_seconds: f64,
    /// Passes run for [`HEARTBEATS`] Node status heartbeats followed by one
    /// peer change (one, for the change, when heartbeats wake none).
    passes_for_heartbeats: f64,
    /// A peer's VXLAN MAC published anew → its neighbour entry rewritten.
    peer_changes: Vec<Duration>,
    rss: f64,
}

/// The agent's overlay passes completed (counted when each has applied).
const PASSES_DONE: &str = "weft_agent_overlay_pass_duration_seconds_count ";

fn passes_done() -> f64 {
    metric(&metrics(), PASSES_DONE)
}

/// Node status heartbeats sent to the overlay agent's Node watch.
const HEARTBEATS: usize = 100;

async fn bench(points: &[usize], scale: Scale, ns_path: &str, kwok_bin: &Path) {
    let ns_name = ns_path.rsplit('/').next().unwrap_or_default().to_owned();
    let cp = ControlPlane::start_with(&Options { netns: Some(ns_name), ..Default::default() })
        .expect("control plane starts");
    let client = cp.client().await.expect("client");
    let crds = install_crds(&client).await.expect("CRDs");
    // Timed leases start once the apiserver no longer holds back creates
    // of a just-established CRD (as in a cluster, where Weft's CRDs are old).
    wait_until_crds_take_creates(&client, &crds).await.expect("CRDs settled");
    create_namespaces(&client).await;
    let dir = tempfile::Builder::new().prefix("weft-scale-").tempdir().expect("temp dir");
    let kwok_log = dir.path().join("kwok.log");
    // kwok stands in for 1,000 kubelets on 1,000 machines: on this one it
    // yields the CPU to the agent (niceness 10), as those kubelets would
    // not run on the agent's node. The apiserver and etcd keep theirs.
    let mut kwok = KillOnDrop(
        Command::new("nice")
            .args(["-n", "10"])
            .arg(kwok_bin)
            .arg("--config")
            .arg(tools_dir().join(KWOK_STAGES))
            .arg("--kubeconfig")
            .arg(cp.in_namespace_kubeconfig())
            .arg(format!("--manage-nodes-with-annotation-selector={}={}", KWOK_ANNOTATION.0, KWOK_ANNOTATION.1))
            .arg("--node-lease-duration-seconds=40")
            .stdout(Stdio::null())
            .stderr(File::create(&kwok_log).expect("kwok log"))
            .spawn()
            .expect("kwok"),
    );
    let pool = points.last().map_or(1, |n| n + 1).next_power_of_two();
    let cluster_cidr = format!("10.200.0.0/{}", 24 - pool.trailing_zeros());
    let args = vec![
        format!("--cluster-cidr={cluster_cidr}"),
        "--node-prefix-length=24".to_owned(),
        "--leader-election-namespace=default".to_owned(),
        // Deleted nodes' blocks go at once (60 s by default, for a node
        // that comes back): the exhaustion phase times the hand-over.
        "--release-grace-seconds=0".to_owned(),
        // For the agents run with --pod-source endpoints.
        "--publish-pod-endpoints=true".to_owned(),
    ];
    let operator = OperatorProcess::start(&cp, &args).expect("operator");
    let keep = KeepLogs(dir.path().to_owned(), operator.log.clone());
    let leased = spawn_lease_recorder(client.clone());
    let running = spawn_running_recorder(client.clone());
    let published = spawn_counter(Api::<PodEndpoint>::all(client.clone()), |e: &PodEndpoint| {
        Some(format!("{}/{}", e.metadata.namespace.as_deref()?, e.metadata.name.as_deref()?))
    });
    let sources: Vec<String> = std::env::var("WEFT_SCALE_POD_SOURCES")
        .unwrap_or_else(|_| "pods,endpoints".into())
        .split(',')
        .map(|s| s.trim().to_owned())
        .collect();

    let mut results = Vec::new();
    let (mut nodes, mut pods, mut deployments, mut policies) = (0, 0, 0, 0);
    for &target in points {
        let mut p = Point { nodes: target, new_nodes: target - nodes, pods_before: pods, ..Default::default() };
        // Nodes, all at once (CONCURRENCY creations in flight, as a burst of
        // joining kubelets would be), timed until every one is leased.
        let requests_before = operator_requests(&client).await;
        let start = Instant::now();
        create_nodes(&client, nodes..target).await;
        p.nodes_created = start.elapsed();
        wait_for(&leased, target, Duration::from_secs(600), "Subnets allocated", &mut kwok, &kwok_log).await;
        p.lease = start.elapsed();
        publish_agent_facts(&client, nodes.max(1)..target, 0).await;
        p.operator_requests = operator_requests(&client).await;
        for (verb, n) in &mut p.operator_requests {
            *n -= requests_before.get(verb).copied().unwrap_or_default();
        }
        nodes = target;

        // Pods in deployments' shapes, spread over every node; kwok runs them.
        let pod_watch = WatchCount::start(&client, "/api/v1/pods").await;
        let endpoint_watch = WatchCount::start(&client, "/apis/weft.dev/v1alpha1/podendpoints").await;
        let start = Instant::now();
        let want = target * scale.pods_per_node;
        let mut batch = Vec::new();
        while pods + batch.len() < want {
            let (namespace, replicas) = deployment(deployments);
            for r in 0..replicas.min(want - pods - batch.len()) {
                batch.push((deployments, namespace.clone(), r));
            }
            deployments += 1;
        }
        stream::iter(batch.into_iter().enumerate())
            .for_each_concurrent(CONCURRENCY, |(k, (d, namespace, r))| {
                let client = client.clone();
                let node = format!("kwok-{}", (pods + k) % target);
                async move { create_pod(&client, &namespace, d, r, &node).await }
            })
            .await;
        pods = want;
        wait_for(&running, pods, Duration::from_secs(1800), "pods Running with an address", &mut kwok, &kwok_log).await;
        p.pods_running = start.elapsed();
        wait_for(&published, pods, Duration::from_secs(600), "PodEndpoints", &mut kwok, &kwok_log).await;
        p.endpoints_published = start.elapsed();
        let new_pods = (pods - p.pods_before) as f64;
        let per_pod = |(events, bytes): (usize, usize)| (events as f64 / new_pods, bytes as f64 / new_pods);
        p.pod_watch_per_pod = per_pod(pod_watch.stop());
        p.endpoint_watch_per_pod = per_pod(endpoint_watch.stop());
        p.pods = pods;

        let want = target * scale.policies_per_node;
        stream::iter(policies..want)
            .for_each_concurrent(CONCURRENCY, |k| {
                let client = client.clone();
                async move {
                    let (namespace, _) = deployment(k);
                    let api: Api<NetworkPolicy> = Api::namespaced(client, &namespace);
                    api.create(&PostParams::default(), &policy(k, 80)).await.expect("create policy");
                }
            })
            .await;
        policies = want;
        p.policies = policies;
        p.operator_rss = rss_mib(operator.pid());

        for source in &sources {
            p.agents.push(measure_agent(&client, &cp, dir.path(), p.nodes, source).await);
        }
        p.overlay = measure_peers(&client, &cp, dir.path(), p.nodes, &cluster_cidr).await;
        p.apiserver_rss = cp.pid(Component::Apiserver).map_or(0.0, rss_mib);
        p.etcd_rss = cp.pid(Component::Etcd).map_or(0.0, rss_mib);
        eprintln!(
            "scale point {} nodes: leased in {:.2} s, pods running in {:.1} s, agent synced in {:?} s",
            p.nodes,
            p.lease.as_secs_f64(),
            p.pods_running.as_secs_f64(),
            p.agents.iter().map(|a| a.synced.as_secs_f64()).collect::<Vec<_>>()
        );
        results.push(p);
    }
    let fanout_counts: Vec<usize> = std::env::var("WEFT_SCALE_FANOUT")
        .unwrap_or_else(|_| "10,50,100".into())
        .split(',')
        .filter(|c| !c.trim().is_empty())
        .map(|c| c.trim().parse().expect("WEFT_SCALE_FANOUT: watcher counts, comma-separated"))
        .collect();
    let mut fanout = Vec::new();
    for watched in [Watched::Pods, Watched::Endpoints] {
        for &watchers in &fanout_counts {
            fanout.push(measure_fanout(&client, &cp, watchers, watched).await);
        }
    }
    let exhaustion = measure_exhaustion(&client, nodes, pool, &leased, &mut kwok, &kwok_log).await;
    drop(kwok);
    drop(keep);
    drop(operator);
    print_table(&results, scale);
    print_peers(&results);
    print_fanout(&fanout, nodes, results.last().map_or(0, |p| p.pods));
    exhaustion.print();
    cp.shutdown();
}

/// What an agent watches to learn of every pod.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Watched {
    /// Every Pod (`--pod-source pods`).
    Pods,
    /// Every PodEndpoint (`--pod-source endpoints`).
    Endpoints,
}

impl Watched {
    fn path(self) -> &'static str {
        match self {
            Watched::Pods => "/api/v1/pods",
            Watched::Endpoints => "/apis/weft.dev/v1alpha1/podendpoints",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Watched::Pods => "Pods",
            Watched::Endpoints => "PodEndpoints",
        }
    }
}

/// What the apiserver paid with `watchers` watchers of every pod.
struct Fanout {
    watched: Watched,
    watchers: usize,
    /// Apiserver CPU per pod change.
    cpu_per_change: f64,
    /// Bytes the apiserver sent to pod watchers per pod change, all together.
    bytes_per_change: f64,
    /// What each of this bench's watchers received per timed change, on
    /// average: the changed pod's events (as an agent's watch gets them),
    /// and everything (kwok's own pod updates meanwhile included).
    watcher_bytes_own: f64,
    watcher_bytes_all: f64,
    /// From the API write to every watcher having the event.
    delivered: Vec<Duration>,
    apiserver_rss: f64,
}

/// Holds `watchers` watches of every pod or every PodEndpoint (the request
/// the agent's watch makes once listed, from the current resourceVersion;
/// what arrives is read and counted, not kept), then relabels a pod
/// [`FANOUT_CHANGES`] times, each timed until every watcher has it (through
/// the operator, for endpoints). The CPU and bytes are the apiserver's for
/// both kinds: a relabelled pod's endpoint is one more write.
async fn measure_fanout(client: &Client, cp: &ControlPlane, watchers: usize, watched: Watched) -> Fanout {
    use futures::AsyncBufReadExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let apiserver = cp.pid(Component::Apiserver).expect("apiserver pid");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "s1");
    let rv = current_resource_version(client).await;
    // The highest change each watcher has seen (0: none yet).
    let seen: std::sync::Arc<Vec<AtomicUsize>> =
        std::sync::Arc::new((0..watchers).map(|_| AtomicUsize::new(0)).collect());
    // Bytes all watchers received: (the changed pod's events, everything).
    let received = std::sync::Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let arrived = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..watchers {
        let (client, seen, arrived, received) = (client.clone(), seen.clone(), arrived.clone(), received.clone());
        let uri = format!("{}?watch=true&allowWatchBookmarks=true&resourceVersion={rv}", watched.path());
        tasks.spawn(async move {
            let request = http::Request::get(uri).body(Vec::new()).expect("request");
            let body = client.request_stream(request).await.expect("watch");
            let mut lines = body.lines();
            while let Some(Ok(line)) = lines.next().await {
                // Each event is a line of JSON and its newline.
                received.1.fetch_add(line.len() + 1, Ordering::Relaxed);
                // The change's number, in the label the bench sets.
                let Some(at) = line.find("\"weft-fanout\":\"") else { continue };
                received.0.fetch_add(line.len() + 1, Ordering::Relaxed);
                let digits: String = line[at + 15..].chars().take_while(char::is_ascii_digit).collect();
                if let Ok(n) = digits.parse() {
                    seen[w].fetch_max(n, Ordering::Relaxed);
                    arrived.notify_waiters();
                }
            }
        });
    }
    let relabel = |n: usize| {
        let pods = pods.clone();
        async move {
            let patch = json!({"metadata": {"labels": {"weft-fanout": n.to_string()}}});
            pods.patch("dep-1-0", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("label pod");
        }
    };
    let all_seen = |n: usize| seen.iter().all(|s| s.load(Ordering::Relaxed) >= n);
    let wait_all = |n: usize| {
        let arrived = arrived.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let notified = arrived.notified();
                if all_seen(n) {
                    return;
                }
                assert!(Instant::now() < deadline, "{watchers} watchers: change {n} not delivered to all after 60 s");
                let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
            }
        }
    };
    // Change 1 shows every watch is established.
    relabel(1).await;
    wait_all(1).await;
    let (cpu_before, watch_before) = (cpu_seconds(apiserver), watch_events(client).await);
    let received_before = (received.0.load(Ordering::Relaxed), received.1.load(Ordering::Relaxed));
    let mut delivered = Vec::new();
    for n in 2..FANOUT_CHANGES + 2 {
        let t = Instant::now();
        relabel(n).await;
        wait_all(n).await;
        delivered.push(t.elapsed());
    }
    let (cpu_after, watch_after) = (cpu_seconds(apiserver), watch_events(client).await);
    let per_watcher_change = |before: usize, counter: &AtomicUsize| {
        (counter.load(Ordering::Relaxed) - before) as f64 / (watchers * FANOUT_CHANGES) as f64
    };
    let apiserver_rss = rss_mib(apiserver);
    tasks.abort_all();
    Fanout {
        watched,
        watchers,
        cpu_per_change: (cpu_after - cpu_before) / FANOUT_CHANGES as f64,
        bytes_per_change: (watch_after.1 - watch_before.1) / FANOUT_CHANGES as f64,
        watcher_bytes_own: per_watcher_change(received_before.0, &received.0),
        watcher_bytes_all: per_watcher_change(received_before.1, &received.1),
        delivered,
        apiserver_rss,
    }
}

fn print_fanout(fanout: &[Fanout], nodes: usize, pods: usize) {
    if fanout.is_empty() {
        return;
    }
    println!(
        "\nfan-out: N watchers of every Pod (--pod-source pods) or every PodEndpoint (--pod-source endpoints) at {nodes} nodes / {pods} pods; one pod relabelled {FANOUT_CHANGES} times"
    );
    println!(
        "| watched | watchers | apiserver CPU per pod change | per watcher | bytes sent per pod change | each watcher received per change: the pod's events / everything | delivered to all p50 / p95 | apiserver RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for f in fanout {
        println!(
            "| {} | {} | {:.1} ms | {:.3} ms | {:.0} B | {:.0} B / {:.0} B | {:.0} / {:.0} ms | {:.0} MiB |",
            f.watched.name(),
            f.watchers,
            f.cpu_per_change * 1e3,
            f.cpu_per_change * 1e3 / f.watchers as f64,
            f.bytes_per_change,
            f.watcher_bytes_own,
            f.watcher_bytes_all,
            percentile(&f.delivered, 50) * 1e3,
            percentile(&f.delivered, 95) * 1e3,
            f.apiserver_rss
        );
    }
    // A straight line through the points: the per-watcher cost at 1,000 nodes.
    for watched in [Watched::Pods, Watched::Endpoints] {
        let of: Vec<&Fanout> = fanout.iter().filter(|f| f.watched == watched).collect();
        let (Some(a), Some(b)) = (of.first(), of.last()) else { continue };
        if b.watchers <= a.watchers {
            continue;
        }
        let slope = (b.cpu_per_change - a.cpu_per_change) / (b.watchers - a.watchers) as f64;
        let at = |n: f64| a.cpu_per_change + slope * (n - a.watchers as f64);
        // Bytes: what each watcher received of the changed pod, counted
        // directly (the apiserver-wide count includes kwok's churn).
        let bytes = of.iter().map(|f| f.watcher_bytes_own).sum::<f64>() / of.len() as f64;
        println!(
            "({}: CPU extrapolated linearly from {} to {} watchers: {:.3} ms per watcher per pod change; each watcher receives {:.0} B per pod change; 1,000 agents: {:.0} ms of CPU and {:.1} MB per pod change)",
            watched.name(),
            a.watchers,
            b.watchers,
            slope * 1e3,
            bytes,
            at(1000.0) * 1e3,
            bytes * 1000.0 / 1e6
        );
    }
}

/// What growing past the pool showed.
struct Exhaustion {
    pool: usize,
    nodes: usize,
    leased: usize,
    /// Nodes with the operator's condition False, reason SubnetPoolExhausted.
    waiting: usize,
    /// Of those, how many have a SubnetPoolExhausted Event.
    with_event: usize,
    /// Subnets without a range whose condition Allocated is False, reason SubnetPoolExhausted.
    waiting_subnets: usize,
    /// From creating the nodes to every one leased or reported.
    reported: Duration,
    /// From deleting [`RELEASED`] leased nodes to as many waiting ones leased.
    recovered: Duration,
}

impl Exhaustion {
    fn print(&self) {
        println!(
            "\nexhaustion: a pool of {} /24s, {} nodes: {} leased, {} reported waiting (condition SubnetPoolExhausted on the Node, {} with an Event, {} with a Subnet saying so) {:.2} s after they were created; {RELEASED} leased nodes deleted → {RELEASED} waiting nodes leased in {:.2} s (release grace 0 s here)",
            self.pool,
            self.nodes,
            self.leased,
            self.waiting,
            self.with_event,
            self.waiting_subnets,
            self.reported.as_secs_f64(),
            self.recovered.as_secs_f64()
        );
    }
}

/// Grows the cluster from `nodes` to [`BEYOND_POOL`] nodes past `pool`
/// Subnets, and waits for each node to be leased or reported waiting; then
/// deletes [`RELEASED`] leased nodes and waits for as many waiting ones to
/// be leased.
async fn measure_exhaustion(
    client: &Client,
    nodes: usize,
    pool: usize,
    leased: &Counter,
    kwok: &mut KillOnDrop,
    log: &Path,
) -> Exhaustion {
    let waiting = spawn_counter(Api::<Node>::all(client.clone()), |n: &Node| {
        let conditions = n.status.as_ref()?.conditions.as_ref()?;
        let waits = conditions.iter().any(|c| {
            c.type_ == "WeftSubnetAllocated"
                && c.status == "False"
                && c.reason.as_deref() == Some("SubnetPoolExhausted")
        });
        waits.then(|| n.metadata.name.clone().unwrap_or_default())
    });
    let waiting_subnets = spawn_counter(Api::<Subnet>::all(client.clone()), |s: &Subnet| {
        let conditions = &s.status.as_ref()?.conditions;
        let waits = conditions
            .iter()
            .any(|c| c.type_ == "Allocated" && c.status == "False" && c.reason == "SubnetPoolExhausted");
        (waits && s.spec.is_pending()).then(|| s.spec.node_name.clone())
    });
    let target = pool + BEYOND_POOL;
    let start = Instant::now();
    create_nodes(client, nodes..target).await;
    let deadline = Instant::now() + Duration::from_secs(300);
    let (mut l, mut w) = (leased.clone(), waiting.clone());
    loop {
        let (leased_so_far, waiting_so_far) = (*l.borrow_and_update(), *w.borrow_and_update());
        if leased_so_far + waiting_so_far >= target {
            break;
        }
        if let Ok(Some(status)) = kwok.0.try_wait() {
            panic!("kwok exited ({status}):\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        assert!(
            Instant::now() < deadline,
            "of {target} nodes, {leased_so_far} leased and {waiting_so_far} reported waiting after 300 s: the rest wait silently",
        );
        // Woken by either count, or every second to look at kwok.
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            tokio::select! {
                _ = l.changed() => {}
                _ = w.changed() => {}
            }
        })
        .await;
    }
    let reported = start.elapsed();
    let (leased_now, waiting_now) = (*leased.borrow(), *waiting.borrow());
    assert_eq!(leased_now, pool, "every Subnet of the pool leased");
    assert_eq!(waiting_now, target - pool, "every node beyond the pool reported");
    // The Event follows the condition: wait for one per waiting node.
    let events = Api::<k8s_openapi::api::core::v1::Event>::all(client.clone());
    let exhausted = kube::api::ListParams::default().fields("reason=SubnetPoolExhausted");
    let deadline = Instant::now() + Duration::from_secs(30);
    let with_event = loop {
        let listed = events.list(&exhausted).await.map(|l| l.items).unwrap_or_default();
        let nodes: HashSet<String> = listed.into_iter().filter_map(|e| e.involved_object.name).collect();
        if nodes.len() >= waiting_now || Instant::now() >= deadline {
            break nodes;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(with_event.len(), waiting_now, "an Event for every waiting node within 30 s");
    // The Subnet's condition is written beside the Event.
    let mut on_subnets = waiting_subnets.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while *on_subnets.borrow_and_update() < waiting_now {
        if tokio::time::timeout_at(deadline, on_subnets.changed()).await.is_err() {
            break;
        }
    }
    let waiting_subnets = *on_subnets.borrow();
    assert_eq!(waiting_subnets, waiting_now, "a Subnet saying so for every waiting node within 30 s");

    // Nodes leave; the waiting ones get their Subnets.
    let start = Instant::now();
    let nodes_api: Api<Node> = Api::all(client.clone());
    for i in 1..=RELEASED {
        nodes_api.delete(&format!("kwok-{i}"), &Default::default()).await.expect("delete node");
    }
    wait_for(leased, pool + RELEASED, Duration::from_secs(120), "Subnets allocated after nodes left", kwok, log).await;
    Exhaustion {
        pool,
        nodes: target,
        leased: leased_now,
        waiting: waiting_now,
        with_event: with_event.len(),
        waiting_subnets,
        reported,
        recovered: start.elapsed(),
    }
}

/// With `WEFT_SCALE_LOGS` set, copies kwok's, the operator's and the
/// agent's logs there when dropped, a panic included (the bench's own
/// directory goes when it ends).
struct KeepLogs(std::path::PathBuf, std::path::PathBuf);

impl Drop for KeepLogs {
    fn drop(&mut self) {
        keep_logs(&self.0, &self.1);
    }
}

fn keep_logs(dir: &Path, operator_log: &Path) {
    let Some(to) = std::env::var_os("WEFT_SCALE_LOGS").map(std::path::PathBuf::from) else { return };
    let _ = std::fs::create_dir_all(&to);
    let logs = std::fs::read_dir(dir).into_iter().flatten().filter_map(Result::ok).map(|e| e.path());
    for log in logs.filter(|p| p.extension().is_some_and(|e| e == "log")).chain([operator_log.to_owned()]) {
        if let Some(name) = log.file_name() {
            let _ = std::fs::copy(&log, to.join(name));
        }
    }
    eprintln!("logs kept in {}", to.display());
}

async fn create_namespaces(client: &Client) {
    let nss: Api<Namespace> = Api::all(client.clone());
    for n in 0..NAMESPACES {
        let ns: Namespace = serde_json::from_value(
            json!({"metadata": {"name": format!("s{n}"), "labels": {"team": format!("t{}", n % 5)}}}),
        )
        .expect("namespace");
        nss.create(&PostParams::default(), &ns).await.expect("create namespace");
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("sa");
        let _ = Api::<ServiceAccount>::namespaced(client.clone(), &format!("s{n}"))
            .create(&PostParams::default(), &sa)
            .await;
    }
}

/// Nodes `range`, [`CONCURRENCY`] creations in flight.
async fn create_nodes(client: &Client, range: std::ops::Range<usize>) {
    stream::iter(range)
        .for_each_concurrent(CONCURRENCY, |i| {
            let client = client.clone();
            async move { create_node(&client, i).await }
        })
        .await;
}

async fn create_node(client: &Client, i: usize) {
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": format!("kwok-{i}"), "annotations": {KWOK_ANNOTATION.0: KWOK_ANNOTATION.1},
            "labels": {"type": "kwok", "kubernetes.io/hostname": format!("kwok-{i}")}},
        "spec": {"podCIDR": kwok_pod_cidr(i), "podCIDRs": [kwok_pod_cidr(i)]},
        // As its kubelet would list them (kwok adds only what is missing):
        // what the peers check the address its agent claims against.
        "status": {"addresses": [{"type": "InternalIP", "address": kwok_node_ip(i)},
                                 {"type": "Hostname", "address": format!("kwok-{i}")}]},
    }))
    .expect("node");
    Api::<Node>::all(client.clone()).create(&PostParams::default(), &node).await.expect("create node");
}

/// Replica `r` of deployment `d`, as its ReplicaSet would make it.
async fn create_pod(client: &Client, namespace: &str, d: usize, r: usize, node: &str) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("dep-{d}-{r}"),
            "labels": {"app": format!("dep-{d}"), "tier": format!("t{}", d % 3), "pod-template-hash": format!("{d:x}")}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "registry.example.com/app:1",
            "ports": [{"name": "http", "containerPort": 8080}, {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
    }))
    .expect("pod");
    Api::<Pod>::namespaced(client.clone(), namespace).create(&PostParams::default(), &pod).await.expect("create pod");
}

/// Policy `k`, in deployment `k`'s namespace: selects that deployment's
/// pods; ingress from a tier of its namespace or an app of a team's
/// namespaces, on a port and a named port; every third also egress to an
/// ipBlock with an except, and DNS.
fn policy(k: usize, port: u16) -> NetworkPolicy {
    let mut spec = json!({
        "podSelector": {"matchLabels": {"app": format!("dep-{k}")}},
        "ingress": [{
            "from": [{"podSelector": {"matchLabels": {"tier": format!("t{}", k % 3)}}},
                     {"namespaceSelector": {"matchLabels": {"team": format!("t{}", k % 5)}},
                      "podSelector": {"matchLabels": {"app": format!("dep-{}", (k + 1) % 50)}}}],
            "ports": [{"port": port}, {"port": "http"}]
        }]
    });
    if k.is_multiple_of(3) {
        spec["egress"] = json!([{"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.64.0.0/16"]}}]},
                                {"ports": [{"protocol": "UDP", "port": "dns"}]}]);
        spec["policyTypes"] = json!(["Ingress", "Egress"]);
    }
    serde_json::from_value(json!({"metadata": {"name": format!("np{k}")}, "spec": spec})).expect("policy")
}

/// Counts what a watch has seen pass `seen` (a Subnet allocated, a pod
/// Running with an address), for [`wait_for`].
type Counter = tokio::sync::watch::Receiver<usize>;

fn spawn_lease_recorder(client: Client) -> Counter {
    spawn_counter(Api::<Subnet>::all(client), |s: &Subnet| {
        let allocated = s
            .status
            .as_ref()
            .is_some_and(|st| st.conditions.iter().any(|c| c.type_ == "Allocated" && c.status == "True"));
        allocated.then(|| s.spec.node_name.clone())
    })
}

fn spawn_running_recorder(client: Client) -> Counter {
    spawn_counter(Api::<Pod>::all(client), |p: &Pod| {
        let status = p.status.as_ref()?;
        (status.phase.as_deref() == Some("Running") && status.pod_ip.is_some()).then(|| {
            format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or_default(),
                p.metadata.name.as_deref().unwrap_or_default()
            )
        })
    })
}

fn spawn_counter<K>(api: Api<K>, key: impl Fn(&K) -> Option<String> + Send + 'static) -> Counter
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let (tx, rx) = tokio::sync::watch::channel(0);
    tokio::spawn(async move {
        let mut seen = HashSet::new();
        // A watch error (an expired resourceVersion under load) is retried
        // after a backoff, never the end of the count.
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        while let Some(ev) = events.next().await {
            if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev
                && let Some(k) = key(&o)
                && seen.insert(k)
            {
                tx.send_replace(seen.len());
            }
        }
    });
    rx
}

/// Waits until `counter` reaches `want`, failing at once if kwok exits.
async fn wait_for(counter: &Counter, want: usize, timeout: Duration, what: &str, kwok: &mut KillOnDrop, log: &Path) {
    let mut rx = counter.clone();
    let deadline = tokio::time::Instant::now() + timeout;
    while *rx.borrow_and_update() < want {
        if let Ok(Some(status)) = kwok.0.try_wait() {
            panic!("kwok exited ({status}):\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        assert!(tokio::time::Instant::now() < deadline, "only {} of {want} {what} after {timeout:?}", *rx.borrow());
        // Woken by the count, or every second to look at kwok.
        let _ = tokio::time::timeout(Duration::from_secs(1), rx.changed()).await;
    }
}

/// Starts the agent afresh for [`AGENT_NODE`] with `--pod-source
/// source`: start → ready and → first full policy sync, its memory, then
/// policy and pod label changes timed from the API write to the applied
/// pass, with the apiserver's watch events, bytes and CPU per pod change.
async fn measure_agent(client: &Client, cp: &ControlPlane, dir: &Path, nodes: usize, source: &str) -> AgentRun {
    // Each run starts from an empty ruleset, as on a new node: an earlier
    // run's rules would make its first pass a no-op. This thread is in the
    // bench's namespace, and so is what it starts.
    let flushed = Command::new("nft").args(["flush", "ruleset"]).status().expect("nft");
    assert!(flushed.success(), "nft flush ruleset in the bench's namespace: {flushed}");
    let started = Instant::now();
    let agent =
        start_agent(cp, dir, &format!("{nodes}-{source}"), &["--pod-cidr", &kwok_pod_cidr(0), "--pod-source", source]);
    let ready = tokio::task::spawn_blocking(move || {
        wait::until_every("the agent to be ready", Duration::from_secs(600), POLL, || ready().then(Instant::now))
    });
    let synced = tokio::task::spawn_blocking(move || next_sync((0.0, 0.0), started)).await.expect("sync").written;
    let m = metrics();
    let mut run = AgentRun {
        source: source.to_owned(),
        ready: ready.await.expect("readiness") - started,
        synced,
        rss: rss_mib(agent.0.id()),
        local_pods: metric(&m, "weft_agent_policy_local_pods "),
        rules: metric(&m, "weft_agent_policy_rules "),
        ..AgentRun::default()
    };

    // np0 selects deployment 0, whose first replica is on the agent's node.
    let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), "s0");
    for i in 0..CHANGES {
        let before = syncs();
        let t = Instant::now();
        let patch = json!({"spec": policy(0, 81 + i as u16).spec});
        api.patch("np0", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch policy");
        run.policy_changes.push(tokio::task::spawn_blocking(move || next_sync(before, t)).await.expect("sync"));
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "s0");
    let apiserver = cp.pid(Component::Apiserver).expect("the apiserver runs");
    let (watch_before, cpu_before) = (watch_events(client).await, cpu_seconds(apiserver));
    for i in 0..CHANGES {
        let before = syncs();
        let t = Instant::now();
        let app = if i % 2 == 0 { "moved" } else { "dep-0" };
        let relabel = json!({"metadata": {"labels": {"app": app}}});
        pods.patch("dep-0-0", &PatchParams::default(), &Patch::Merge(&relabel)).await.expect("label pod");
        run.label_changes.push(tokio::task::spawn_blocking(move || next_sync(before, t)).await.expect("sync"));
    }
    let (watch_after, cpu_after) = (watch_events(client).await, cpu_seconds(apiserver));
    run.events_per_change = (watch_after.0 - watch_before.0) / CHANGES as f64;
    run.bytes_per_change = (watch_after.1 - watch_before.1) / CHANGES as f64;
    run.apiserver_cpu_per_change = (cpu_after - cpu_before) / CHANGES as f64;
    drop(agent);
    // The next run starts from the same labels.
    let relabel = json!({"metadata": {"labels": {"app": "dep-0"}}});
    pods.patch("dep-0-0", &PatchParams::default(), &Patch::Merge(&relabel)).await.expect("label pod");
    run
}

/// What the agents of nodes `range` would publish in their Subnets: the
/// node address their Node lists and their VXLAN device's MAC.
async fn publish_agent_facts(client: &Client, range: std::ops::Range<usize>, generation: usize) {
    stream::iter(range)
        .for_each_concurrent(CONCURRENCY, |i| {
            let api: Api<Subnet> = Api::all(client.clone());
            async move {
                let facts = json!({"status": {"nodeIP": kwok_node_ip(i), "vtepMAC": kwok_vtep_mac(i, generation)}});
                let name = format!("kwok-{i}");
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&facts)).await.expect("Subnet status");
            }
        })
        .await;
}

/// Starts the agent afresh for [`AGENT_NODE`] as on a real node: its pod
/// range from its Subnet lease, a VXLAN overlay over an address of the
/// bench's namespace, policy off (measured above). Times start → every peer
/// programmed; then counts the passes Node heartbeats cause, and times a
/// peer's new VXLAN MAC to its neighbour entry.
async fn measure_peers(client: &Client, cp: &ControlPlane, dir: &Path, nodes: usize, cluster_cidr: &str) -> PeerRun {
    let peers = nodes - 1;
    let started = Instant::now();
    let args = ["--node-ip", &kwok_node_ip(0), "--cluster-cidr", cluster_cidr, "--network-policy=false"];
    let agent = start_agent(cp, dir, &format!("{nodes}-overlay"), &args);
    let programmed = tokio::task::spawn_blocking(move || {
        wait::until_every("the agent to program every peer", Duration::from_secs(300), POLL, || {
            let m = metrics();
            (metric(&m, "weft_agent_overlay_peers_programmed ") as usize == peers).then(|| (started.elapsed(), m))
        })
    });
    let (elapsed, m) = programmed.await.expect("peers");
    let mut run = PeerRun {
        peers,
        programmed: elapsed,
        passes: metric(&m, PASSES_DONE),
        pass_seconds: metric(&m, "weft_agent_overlay_pass_duration_seconds_sum "),
        rss: rss_mib(agent.0.id()),
        ..PeerRun::default()
    };

    // kwok-1's VXLAN device made anew, CHANGES times; before the first,
    // every other node's status heartbeat (within HEARTBEATS).
    let subnet = Api::<Subnet>::all(client.clone()).get("kwok-1").await.expect("kwok-1's Subnet");
    let vtep = subnet.spec.cidr.split('/').next().unwrap_or_default().to_owned();
    let before = passes_done();
    heartbeats(client, 1..(1 + HEARTBEATS).min(nodes)).await;
    for generation in 1..=CHANGES {
        let passes = passes_done();
        let t = Instant::now();
        publish_agent_facts(client, 1..2, generation).await;
        let (vtep, mac) = (vtep.clone(), kwok_vtep_mac(1, generation));
        let applied = tokio::task::spawn_blocking(move || {
            wait::until_every("the peer's new MAC in the kernel", Duration::from_secs(60), POLL, || {
                let done = passes_done() > passes;
                (done && neighbour(&vtep).contains(&mac)).then(|| t.elapsed())
            })
        });
        run.peer_changes.push(applied.await.expect("peer change"));
        if generation == 1 {
            run.passes_for_heartbeats = passes_done() - before;
        }
    }
    drop(agent);
    // The next point's policy runs start without this run's devices.
    for link in ["weft.1", "weft0"] {
        let _ = Command::new("ip").args(["link", "del", link]).status();
    }
    run
}

/// Status heartbeats of the Nodes `range`, as their kubelets send them.
async fn heartbeats(client: &Client, range: std::ops::Range<usize>) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    stream::iter(range)
        .for_each_concurrent(CONCURRENCY, |i| {
            let api: Api<Node> = Api::all(client.clone());
            let beat =
                json!({"status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": now}]}});
            async move {
                api.patch_status(&format!("kwok-{i}"), &PatchParams::default(), &Patch::Strategic(&beat))
                    .await
                    .expect("Node heartbeat");
            }
        })
        .await;
}

/// This namespace's neighbour entry for `address` on the VXLAN device.
fn neighbour(address: &str) -> String {
    let out = Command::new("ip").args(["neigh", "show", "to", address, "dev", "weft.1"]).output().expect("ip neigh");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The agent of [`AGENT_NODE`] with `args`, its state and log named after
/// `run` in `dir`, metrics on [`METRICS_ADDR`].
fn start_agent(cp: &ControlPlane, dir: &Path, run: &str, args: &[&str]) -> KillOnDrop {
    let log = File::create(dir.join(format!("agent-{run}.log"))).expect("agent log");
    KillOnDrop(
        Command::new(bins::weft("weft-agent"))
            .args(["--node-name", AGENT_NODE, "--metrics-addr", METRICS_ADDR])
            .args(args)
            .arg("--kubeconfig")
            .arg(cp.in_namespace_kubeconfig())
            .arg("--socket")
            .arg(dir.join("agent.sock"))
            .arg("--state-dir")
            .arg(dir.join(format!("state-{run}")))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("weft-agent"),
    )
}

/// The newest resourceVersion of the cluster (a watch from it sees only
/// what comes next).
async fn current_resource_version(client: &Client) -> String {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let list = namespaces.list_metadata(&kube::api::ListParams::default().limit(1)).await.expect("list");
    list.metadata.resource_version.unwrap_or_default()
}

/// One raw watch of `path` from now on, counting the events and bytes it
/// receives (what one agent's watch would be sent), until [`stop`](Self::stop).
struct WatchCount {
    /// Events and bytes received.
    counts: std::sync::Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

type Counts = (std::sync::atomic::AtomicUsize, std::sync::atomic::AtomicUsize);

impl WatchCount {
    async fn start(client: &Client, path: &str) -> WatchCount {
        use futures::AsyncBufReadExt;
        use std::sync::atomic::Ordering;
        let mut rv = current_resource_version(client).await;
        let counts: std::sync::Arc<Counts> = std::sync::Arc::default();
        let seen = std::sync::Arc::clone(&counts);
        let (client, path) = (client.clone(), path.to_owned());
        let task = tokio::spawn(async move {
            // The apiserver may end a watch (a slow reader under load): it
            // is resumed from the last version seen, missing nothing.
            loop {
                let uri = format!("{path}?watch=true&allowWatchBookmarks=true&resourceVersion={rv}");
                let request = http::Request::get(uri).body(Vec::new()).expect("request");
                let Ok(body) = client.request_stream(request).await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let mut lines = body.lines();
                while let Some(Ok(line)) = lines.next().await {
                    let (events, bytes) = &*seen;
                    if let Some(at) = line.find("\"resourceVersion\":\"") {
                        rv = line[at + 19..].chars().take_while(char::is_ascii_digit).collect();
                    }
                    if line.contains("\"type\":\"ERROR\"") {
                        panic!("{path}: the watch failed: {line}");
                    }
                    if !line.contains("\"type\":\"BOOKMARK\"") {
                        events.fetch_add(1, Ordering::Relaxed);
                    }
                    bytes.fetch_add(line.len() + 1, Ordering::Relaxed);
                }
            }
        });
        WatchCount { counts, task }
    }

    /// (events, bytes) so far; the watch ends.
    fn stop(self) -> (usize, usize) {
        use std::sync::atomic::Ordering;
        self.task.abort();
        (self.counts.0.load(Ordering::Relaxed), self.counts.1.load(Ordering::Relaxed))
    }
}

/// The apiserver's own metrics, as text.
async fn apiserver_metrics(client: &Client) -> String {
    let request = http::Request::get("/metrics").body(Vec::new()).expect("request");
    client.request_text(request).await.expect("the apiserver's metrics")
}

/// The apiserver's requests so far that the operator makes here, by kind
/// and verb: on Subnets (nothing else here writes or lists them; watches
/// excluded: they are long-running and counted when they start), and reads
/// of single Nodes (kwok and the bench watch, patch and create them).
async fn operator_requests(client: &Client) -> std::collections::BTreeMap<String, f64> {
    let text = apiserver_metrics(client).await;
    let mut by_verb = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let label = |name: &str| line.split(&format!("{name}=\"")).nth(1).and_then(|v| v.split('"').next());
        let (verb, resource) = (label("verb").unwrap_or_default(), label("resource").unwrap_or_default());
        let kind = match (resource, verb) {
            ("subnets", v) if v != "WATCH" => "Subnet",
            ("nodes", "GET") if label("subresource").unwrap_or_default().is_empty() => "Node",
            _ => continue,
        };
        if let Some(Ok(n)) = line.rsplit(' ').next().map(str::parse::<f64>) {
            *by_verb.entry(format!("{kind} {verb}")).or_default() += n;
        }
    }
    by_verb
}

/// (watch events, their bytes) the apiserver has sent for Pods and
/// PodEndpoints so far, to all watchers together.
async fn watch_events(client: &Client) -> (f64, f64) {
    let text = apiserver_metrics(client).await;
    let pods = |l: &&str| {
        ["resource=\"pods\"", "kind=\"Pod\"", "resource=\"podendpoints\"", "kind=\"PodEndpoint\""]
            .iter()
            .any(|k| l.contains(k))
    };
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .filter(pods)
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (sum("apiserver_watch_events_total"), sum("apiserver_watch_events_sizes_sum"))
}

/// Changes timed to the agent's write.
fn written(changes: &[Synced]) -> Vec<Duration> {
    changes.iter().map(|c| c.written).collect()
}

/// Changes timed to the poll that saw them.
fn seen(changes: &[Synced]) -> Vec<Duration> {
    changes.iter().map(|c| c.seen).collect()
}

fn print_table(results: &[Point], scale: Scale) {
    println!(
        "\nscale: kwok nodes and pods ({} pods and {} NetworkPolicies per node) on a real kube-apiserver and etcd (kwok at niceness 10); the real operator (publishing PodEndpoints); one real agent per pod source",
        scale.pods_per_node, scale.policies_per_node
    );
    println!(
        "| nodes | pods | policies | new nodes → leased | operator RSS | agent's pod source | agent start → ready / full sync | agent RSS | local pods / rules | policy change p50 / p95 | label change p50 / p95 | the same, seen by the {} ms poll | per label change: watch events / bytes / apiserver CPU | apiserver / etcd RSS |",
        POLL.as_millis()
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for p in results {
        for a in &p.agents {
            println!(
                "| {} | {} | {} | {} in {:.2} s | {:.0} MiB | {} | {:.2} s / {:.2} s | {:.0} MiB | {} / {} | {:.0} / {:.0} ms | {:.0} / {:.0} ms | {:.0} / {:.0}; {:.0} / {:.0} ms | {:.1} / {:.0} B / {:.1} ms | {:.0} / {:.0} MiB |",
                p.nodes,
                p.pods,
                p.policies,
                p.new_nodes,
                p.lease.as_secs_f64(),
                p.operator_rss,
                a.source,
                a.ready.as_secs_f64(),
                a.synced.as_secs_f64(),
                a.rss,
                a.local_pods,
                a.rules,
                percentile(&written(&a.policy_changes), 50) * 1e3,
                percentile(&written(&a.policy_changes), 95) * 1e3,
                percentile(&written(&a.label_changes), 50) * 1e3,
                percentile(&written(&a.label_changes), 95) * 1e3,
                percentile(&seen(&a.policy_changes), 50) * 1e3,
                percentile(&seen(&a.policy_changes), 95) * 1e3,
                percentile(&seen(&a.label_changes), 50) * 1e3,
                percentile(&seen(&a.label_changes), 95) * 1e3,
                a.events_per_change,
                a.bytes_per_change,
                a.apiserver_cpu_per_change * 1e3,
                p.apiserver_rss,
                p.etcd_rss,
            );
        }
    }
    println!(
        "\nwhat one watch received while each point's pods were created and ran (per new pod): every Pod (--pod-source pods) against every PodEndpoint (--pod-source endpoints)"
    );
    println!(
        "| nodes | new pods | Pod watch: events / bytes | PodEndpoint watch: events / bytes | bytes ratio | pods Running / endpoints published |"
    );
    println!("|---|---|---|---|---|---|");
    for p in results {
        let (pe, pb) = p.pod_watch_per_pod;
        let (ee, eb) = p.endpoint_watch_per_pod;
        println!(
            "| {} | {} | {:.2} / {:.0} B | {:.2} / {:.0} B | {:.3} | {:.1} s / {:.1} s |",
            p.nodes,
            p.pods - p.pods_before,
            pe,
            pb,
            ee,
            eb,
            eb / pb.max(1.0),
            p.pods_running.as_secs_f64(),
            p.endpoints_published.as_secs_f64()
        );
    }
    let per_point = |f: &dyn Fn(&Point) -> Duration| -> String {
        results.iter().map(|p| format!("{:.1} s", f(p).as_secs_f64())).collect::<Vec<_>>().join(", ")
    };
    println!("(creating the new Node objects took, per point: {})", per_point(&|p| p.nodes_created));
    for p in results {
        let per_node: Vec<String> = p
            .operator_requests
            .iter()
            .map(|(verb, n)| format!("{verb} {:.2}", n / p.new_nodes.max(1) as f64))
            .collect();
        println!("(operator requests per new node at {} nodes: {})", p.nodes, per_node.join(", "));
    }
    println!("(pods created and Running with kwok's addresses, per point: {})", per_point(&|p| p.pods_running));
}

fn print_peers(results: &[Point]) {
    println!(
        "\noverlay: the real agent of one node with its Subnet lease (vxlan), every other node's Subnet published as its agent would, each claim checked against its Node"
    );
    println!(
        "| nodes | peers | agent start → every peer programmed | passes until then / their time | passes for up to {HEARTBEATS} Node heartbeats + 1 peer change | a peer's new VXLAN MAC → programmed p50 / p95 | agent RSS |"
    );
    println!("|---|---|---|---|---|---|---|");
    for p in results {
        let o = &p.overlay;
        println!(
            "| {} | {} | {:.2} s | {:.0} / {:.0} ms | {:.0} | {:.0} / {:.0} ms | {:.0} MiB |",
            p.nodes,
            o.peers,
            o.programmed.as_secs_f64(),
            o.passes,
            o.pass_seconds * 1e3,
            o.passes_for_heartbeats,
            percentile(&o.peer_changes, 50) * 1e3,
            percentile(&o.peer_changes, 95) * 1e3,
            o.rss,
        );
    }
}
