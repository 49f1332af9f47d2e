//! Policy scale: one weft-agent with 5,000 pods, 1,000 NetworkPolicies and
//! 100 ClusterNetworkPolicies (both tiers) in the API (250 of the pods on its
//! node): full sync, policy changes of both kinds and pod label changes
//! (median and p95), rules programmed, agent RSS, and the same under the
//! oversized-policy attack (refused, not held back). Set
//! `WEFT_BIN_DIR` to measure another agent build (an older engine) the same way. (The engine beside the
//! iptables one it replaced, on the same compiled rules, is the agent's
//! `policy::kernel_tests::engines_side_by_side`.)
//!
//! Everything runs in network namespaces this bench creates (the control
//! plane and the agent share one, so the agent reaches the apiserver on
//! loopback); the root namespace's rules are never touched.
//! Run with `e2e/bench.sh policy` or `cargo bench -p weft-e2e --bench policy_sync`
//! (`WEFT_BENCH_PODS` / `WEFT_BENCH_POLICIES` / `WEFT_BENCH_CLUSTER_POLICIES`
//! scale it down; with no ClusterNetworkPolicies the agent does not enforce
//! them, as agents before them).

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use nix::sched::{CloneFlags, setns};
use serde_json::json;
use weft_api::cluster_network_policy::ClusterNetworkPolicy;
use weft_e2e::bench_agent::{
    KillOnDrop, METRICS_ADDR, POLL, Synced, metric, metrics, next_sync, percentile, rss_mib, syncs,
};
use weft_e2e::control_plane::{ControlPlane, Options, install_crds, tools_dir, tools_present};
use weft_e2e::netns::Netns;
use weft_e2e::{bins, wait};

const NODES: usize = 20;
const NAMESPACES: usize = 50;
const CONCURRENCY: usize = 32;
/// Policy changes and label changes timed (median and p95 reported).
const CHANGES: usize = 10;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    if !weft_e2e::prereq::require_root()
        || !weft_e2e::prereq::require(&format!("kube-apiserver and etcd in {}", tools_dir().display()), tools_present())
    {
        return;
    }
    let pods = env_usize("WEFT_BENCH_PODS", 5000);
    let policies = env_usize("WEFT_BENCH_POLICIES", 1000);
    // Checked before anything starts: the attack phase changes np20.
    assert!(
        policies > 20,
        "WEFT_BENCH_POLICIES={policies}: at least 21 (np20 is the other tenant's policy it changes)"
    );
    let cluster_policies = env_usize("WEFT_BENCH_CLUSTER_POLICIES", 100);
    let ns = Netns::new("pbench");
    ns.ip(&["link", "set", "lo", "up"]);
    let path = ns.path();
    // The whole bench runs on a thread inside the namespace: the control
    // plane, the agent and the bench's own API client all live there.
    std::thread::spawn(move || {
        let file = File::open(&path).expect("open netns");
        setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(bench(pods, policies, cluster_policies, &path));
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p));
}

fn pod_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 62_500, (i / 250) % 250, i % 250 + 1)
}

async fn create_objects(client: &Client, pods: usize, policies: usize, cluster_policies: usize) {
    let nss: Api<Namespace> = Api::all(client.clone());
    for n in 0..NAMESPACES {
        let ns: Namespace = serde_json::from_value(
            json!({"metadata": {"name": format!("b{n}"), "labels": {"team": format!("t{}", n % 5)}}}),
        )
        .expect("namespace");
        nss.create(&PostParams::default(), &ns).await.expect("create namespace");
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("sa");
        let _ = Api::<ServiceAccount>::namespaced(client.clone(), &format!("b{n}"))
            .create(&PostParams::default(), &sa)
            .await;
    }
    stream::iter(0..pods)
        .for_each_concurrent(CONCURRENCY, |i| async move {
            let ns = format!("b{}", i % NAMESPACES);
            let j = i / NAMESPACES;
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": format!("p{i}"), "labels": {"app": format!("a{}", j % 10), "tier": format!("t{}", j % 3)}},
                "spec": {"nodeName": format!("node-{}", i % NODES), "containers": [{"name": "c", "image": "x",
                    "ports": [{"name": "http", "containerPort": 8080}, {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
            }))
            .expect("pod");
            api.create(&PostParams::default(), &pod).await.expect("create pod");
            let status = json!({"status": {"phase": "Running", "podIP": pod_ip(i), "podIPs": [{"ip": pod_ip(i)}]}});
            api.patch_status(&format!("p{i}"), &PatchParams::default(), &Patch::Merge(&status)).await.expect("pod status");
        })
        .await;
    stream::iter(0..policies)
        .for_each_concurrent(CONCURRENCY, |k| async move {
            let ns = format!("b{}", k % NAMESPACES);
            let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), &ns);
            api.create(&PostParams::default(), &policy(k, 80)).await.expect("create policy");
        })
        .await;
    let api: Api<ClusterNetworkPolicy> = Api::all(client.clone());
    for k in 0..cluster_policies {
        api.create(&PostParams::default(), &cluster_policy(k, 9000)).await.expect("create ClusterNetworkPolicy");
    }
}

/// ClusterNetworkPolicy `k`: the first half Admin, the rest Baseline, by
/// priority `k`; subject a team's namespaces (every fifth policy: an app's
/// pods in them); ingress Deny from another team's app on a port, Pass (Admin)
/// or Accept (Baseline) from a tier; egress Deny to two networks on UDP 53.
fn cluster_policy(k: usize, port: u16) -> ClusterNetworkPolicy {
    let admin = k < 50;
    let team = json!({"matchLabels": {"team": format!("t{}", k % 5)}});
    let subject = if k.is_multiple_of(5) {
        json!({"pods": {"namespaceSelector": team, "podSelector": {"matchLabels": {"app": format!("a{}", k % 10)}}}})
    } else {
        json!({"namespaces": team})
    };
    serde_json::from_value(json!({
        "apiVersion": "policy.networking.k8s.io/v1beta1", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": format!("cnp{k}")},
        "spec": {"tier": if admin { "Admin" } else { "Baseline" }, "priority": k, "subject": subject,
            "ingress": [
                {"action": "Deny", "from": [{"pods": {"namespaceSelector": {"matchLabels": {"team": format!("t{}", (k + 1) % 5)}},
                                                      "podSelector": {"matchLabels": {"app": format!("a{}", (k + 3) % 10)}}}}],
                 "protocols": [{"tcp": {"destinationPort": {"number": port}}}]},
                {"action": if admin { "Pass" } else { "Accept" },
                 "from": [{"pods": {"podSelector": {"matchLabels": {"tier": format!("t{}", k % 3)}}}}]}],
            "egress": [{"action": "Deny", "to": [{"networks": [format!("192.168.{k}.0/24"), format!("fd00:{k:x}::/64")]}],
                        "protocols": [{"udp": {"destinationPort": {"number": 53}}}]}]}
    }))
    .expect("ClusterNetworkPolicy")
}

/// Policy `k`: selects app=a<k%10> of its namespace; ingress from a tier of
/// its namespace OR an app of team namespaces (AND) on a port and a named
/// port; every third also egress to an ipBlock with except and DNS.
fn policy(k: usize, port: u16) -> NetworkPolicy {
    let mut spec = json!({
        "podSelector": {"matchLabels": {"app": format!("a{}", (k / NAMESPACES) % 10)}},
        "ingress": [{
            "from": [{"podSelector": {"matchLabels": {"tier": format!("t{}", k % 3)}}},
                     {"namespaceSelector": {"matchLabels": {"team": format!("t{}", k % 5)}},
                      "podSelector": {"matchLabels": {"app": format!("a{}", (k + 1) % 10)}}}],
            "ports": [{"port": port}, {"port": "http"}]
        }]
    });
    if k.is_multiple_of(3) {
        spec["egress"] = json!([{"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.100.0.0/16", "10.101.1.0/24"]}}]},
                                {"ports": [{"protocol": "UDP", "port": "dns"}]}]);
        spec["policyTypes"] = json!(["Ingress", "Egress"]);
    }
    serde_json::from_value(json!({"metadata": {"name": format!("np{k}")}, "spec": spec})).expect("policy")
}

/// Policies of the attack just under the per-policy bound.
const HEAVY: usize = 20;

/// The attack's policy far past the per-policy bound: every pod of its
/// namespace, from all of IPv6 but 20,000 /64s (compiled, millions of
/// prefixes).
fn oversized() -> NetworkPolicy {
    let excepts: Vec<String> = (0..20_000).map(|i| format!("fd00:0:0:{i:x}::/64")).collect();
    serde_json::from_value(json!({"metadata": {"name": "attack-oversized"}, "spec": {"podSelector": {},
        "ingress": [{"from": [{"ipBlock": {"cidr": "fd00::/16", "except": excepts}}]}]}}))
    .expect("policy")
}

/// An attack policy just under the per-policy bound (599 IPv4 excepts:
/// about 19,200 entries), selecting every pod of its namespace.
fn heavy(k: usize) -> NetworkPolicy {
    let excepts: Vec<String> = (0..599).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256)).collect();
    serde_json::from_value(json!({"metadata": {"name": format!("attack-heavy-{k}")}, "spec": {"podSelector": {},
        "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": excepts}}], "ports": [{"port": 9000 + k}]}]}}))
    .expect("policy")
}

/// Medians of the phases of the agent's incremental passes (its "policy
/// rules applied" log lines with `full=false`): snapshot, compute, kernel.
fn change_phases(log: &str) -> Option<[f64; 3]> {
    let field = |line: &str, name: &str| -> Option<f64> {
        line.split_whitespace().find_map(|w| w.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
    };
    let mut cols: [Vec<f64>; 3] = Default::default();
    for line in log.lines().filter(|l| l.contains("policy rules applied") && l.contains("full=false")) {
        for (col, name) in cols.iter_mut().zip(["snapshot_ms", "compute_ms", "kernel_ms"]) {
            col.push(field(line, name)?);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let [mut a, mut b, mut c] = cols;
    Some([median(&mut a)?, median(&mut b)?, median(&mut c)?])
}

struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

async fn bench(pods: usize, policies: usize, cluster_policies: usize, ns_path: &str) {
    let ns_name = ns_path.rsplit('/').next().unwrap_or_default().to_owned();
    let cp = ControlPlane::start_with(&Options { netns: Some(ns_name.clone()), ..Default::default() })
        .expect("control plane starts");
    let client = cp.client().await.expect("client");
    install_crds(&client).await.expect("CRDs");
    let t = Instant::now();
    create_objects(&client, pods, policies, cluster_policies).await;
    eprintln!(
        "created {pods} pods, {policies} policies and {cluster_policies} ClusterNetworkPolicies in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let dir = tempfile::Builder::new().prefix("weft-pbench-").tempdir().expect("temp dir");
    let log = File::create(dir.path().join("agent.log")).expect("log");
    let agent_log = dir.path().join("agent.log");
    // On failure the agent's log says why.
    let _report = Defer(move || {
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", std::fs::read_to_string(&agent_log).unwrap_or_default());
        }
    });
    let started = Instant::now();
    let agent = KillOnDrop(
        Command::new(bins::weft("weft-agent"))
            .args(["--node-name", "node-0", "--pod-cidr", "10.100.0.0/24", "--metrics-addr", METRICS_ADDR])
            .arg("--kubeconfig")
            .arg(cp.in_namespace_kubeconfig())
            .arg("--socket")
            .arg(dir.path().join("agent.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg(format!("--cluster-network-policy={}", cluster_policies > 0))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("weft-agent"),
    );
    let Synced { written: full_wall, passes: full_sync, .. } = next_sync((0.0, 0.0), started);
    let m = metrics();
    let rules = metric(&m, "weft_agent_policy_rules ");
    // (`policy_ipsets` in agents before the nftables engine.)
    let sets = metric(&m, "weft_agent_policy_sets ").max(metric(&m, "weft_agent_policy_ipsets "));
    let local = metric(&m, "weft_agent_policy_local_pods ");
    let rss = rss_mib(agent.0.id());

    // Policy changes: another port for a policy selecting local pods, each
    // timed from the API write to the agent's pass that applied it.
    let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), "b0");
    let (mut policy_changes, mut policy_passes) = (Vec::new(), Vec::new());
    for i in 0..CHANGES {
        let before = syncs();
        let t = Instant::now();
        let patch = json!({"spec": policy(0, 81 + i as u16).spec});
        api.patch("np0", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch policy");
        let synced = next_sync(before, t);
        policy_changes.push(synced.written);
        policy_passes.push(Duration::from_secs_f64(synced.passes));
    }

    // ClusterNetworkPolicy changes: another port in the Deny of cnp0 (Admin,
    // its subject pods of team t0, so of b0 and other local namespaces).
    let cnps: Api<ClusterNetworkPolicy> = Api::all(client.clone());
    let mut cluster_changes = Vec::new();
    for i in 0..if cluster_policies > 0 { CHANGES } else { 0 } {
        let before = syncs();
        let t = Instant::now();
        let patch = json!({"spec": cluster_policy(0, 9001 + i as u16).spec});
        cnps.patch("cnp0", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch ClusterNetworkPolicy");
        cluster_changes.push(next_sync(before, t).written);
    }

    // Pod label changes: a local pod moves between two apps (other chains;
    // with fewer policies, a9 may be selected by none: still a change).
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), "b0");
    let (mut label_changes, mut label_passes) = (Vec::new(), Vec::new());
    for i in 0..CHANGES {
        let before = syncs();
        let t = Instant::now();
        let app = if i % 2 == 0 { "a9" } else { "a0" };
        let relabel = json!({"metadata": {"labels": {"app": app, "tier": "t2"}}});
        pods_api.patch("p0", &PatchParams::default(), &Patch::Merge(&relabel)).await.expect("label pod");
        let synced = next_sync(before, t);
        label_changes.push(synced.written);
        label_passes.push(Duration::from_secs_f64(synced.passes));
    }
    let rss_after = rss_mib(agent.0.id());
    let rules_after = metric(&metrics(), "weft_agent_policy_rules ");
    let phases_log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();

    // The oversized-policy attack: a tenant of b0 (some of whose pods are
    // local) writes one policy far past the per-policy bound and
    // `HEAVY` just under it, past the per-node bound together; timed until
    // the agent has them all, then policy changes of another tenant, timed
    // as above, each pass compiling the attack too; then the agent's RSS.
    let attack = Instant::now();
    api.create(&PostParams::default(), &oversized()).await.expect("create the oversized policy");
    for k in 0..HEAVY {
        api.create(&PostParams::default(), &heavy(k)).await.expect("create a heavy policy");
    }
    // Every pass after the agent has seen all of them (its policy count)
    // compiles them: the next change's pass refuses or applies them.
    let all = (policies + 1 + HEAVY) as f64;
    wait::until_every("the agent to see the attack's policies", Duration::from_secs(300), POLL, || {
        (metric(&metrics(), "weft_agent_policy_network_policies{kind=\"standard\"}") >= all).then_some(())
    });
    let attack_seen = attack.elapsed();
    // np20 selects local pods of b20 (as np0 does of b0).
    let other: Api<NetworkPolicy> = Api::namespaced(client.clone(), "b20");
    let mut other_changes = Vec::new();
    for i in 0..CHANGES {
        let before = syncs();
        let t = Instant::now();
        let patch = json!({"spec": policy(20, 81 + i as u16).spec});
        other.patch("np20", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch policy");
        other_changes.push(next_sync(before, t).written);
    }
    let rss_attack = rss_mib(agent.0.id());
    let under_attack = metrics();
    let (rules_attack, refused) =
        (metric(&under_attack, "weft_agent_policy_rules "), metric(&under_attack, "weft_agent_policy_refused "));
    let phases = change_phases(&phases_log);

    drop(agent);

    println!(
        "\npolicy_sync: {pods} pods in the API ({local} local pods under policy), {policies} NetworkPolicies, {cluster_policies} ClusterNetworkPolicies"
    );
    println!("| measure | value |");
    println!("|---|---|");
    println!("| full sync: agent start → rules applied (incl. listing the API) | {:.2} s |", full_wall.as_secs_f64());
    println!("| full sync: compile + diff + apply (agent's own time) | {:.3} s |", full_sync);
    // The wall time is seen by polling the agent's metrics (every 5 ms);
    // the pass is the agent's own compile + diff + apply.
    for (what, walls, passes) in
        [("policy change", &policy_changes, &policy_passes), ("pod label change", &label_changes, &label_passes)]
    {
        println!(
            "| one {what}: API write → applied, median / p95 of {CHANGES} (agent pass median / p95) | {:.3} s / {:.3} s ({:.3} s / {:.3} s) |",
            percentile(walls, 50),
            percentile(walls, 95),
            percentile(passes, 50),
            percentile(passes, 95)
        );
    }
    if !cluster_changes.is_empty() {
        println!(
            "| one ClusterNetworkPolicy change: API write → applied, median / p95 of {CHANGES} | {:.3} s / {:.3} s |",
            percentile(&cluster_changes, 50),
            percentile(&cluster_changes, 95)
        );
    }
    println!(
        "| firewall rules programmed after full sync / after changes; address sets | {rules} / {rules_after}; {sets} |"
    );
    println!("| agent RSS after full sync / after changes | {rss:.1} MiB / {rss_after:.1} MiB |");
    println!(
        "| oversized-policy attack (1 policy of 20,000 IPv6 excepts + {HEAVY} of about 19,200 entries, all selecting local pods): written → all seen by the agent; refused | {:.2} s; {refused} |",
        attack_seen.as_secs_f64()
    );
    println!(
        "| agent RSS / firewall rules under the attack (after the changes below) | {rss_attack:.1} MiB / {rules_attack} |"
    );
    println!(
        "| another tenant's policy change under the attack: API write → applied, median / p95 of {CHANGES} | {:.3} s / {:.3} s |",
        percentile(&other_changes, 50),
        percentile(&other_changes, 95)
    );
    if let Some([snapshot, compute, kernel]) = phases {
        println!(
            "| the passes of the changes, median: snapshot of the caches / compile + render / kernel write | {snapshot:.1} / {compute:.1} / {kernel:.1} ms |"
        );
    }
    cp.shutdown();
}
