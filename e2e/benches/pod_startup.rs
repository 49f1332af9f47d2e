//! Pod create-to-Running on the real-node cluster: 30 pods with Weft against
//! the same 30 with the reference `bridge` + `host-local` conflist placed in
//! front of Weft's on the same nodes, in the same run. Each pod's latency is
//! from the `kubectl apply` of all 30 to the first poll that sees it Running
//! (polled every 100 ms). Also prints how long `up` took and its helm install.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use weft_e2e::cluster::node::host_view;
use weft_e2e::cluster::testing::{Cluster, apply, kubectl, kubectl_ok};
use weft_e2e::cluster::workloads::{TestPod, namespace};

const PODS: usize = 30;
const NS: &str = "weft-bench";
/// Sorts before 00-weft.conflist: containerd uses the first conflist it finds.
const REFERENCE_CONFLIST: &str = "/etc/cni/net.d/00-a-reference.conflist";

fn reference_conflist(index: usize) -> String {
    format!(
        r#"{{"cniVersion": "1.0.0", "name": "reference", "plugins": [
  {{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true,
    "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "10.99.{index}.0/24"}}]]}}}}]}}"#
    )
}

/// Creates the pods (alternating nodes) and returns each one's latency.
fn round(tag: &str, nodes: &[String]) -> Vec<Duration> {
    let names: Vec<String> = (0..PODS).map(|i| format!("{tag}-{i}")).collect();
    let yaml: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            TestPod {
                namespace: NS,
                name,
                node: &nodes[i % nodes.len()],
                labels: &[],
                annotations: &[],
                host_port: None,
                capabilities: &[],
            }
            .yaml()
        })
        .collect();
    let started = Instant::now();
    apply(&yaml.join("---\n"));
    let mut running: BTreeMap<String, Duration> = BTreeMap::new();
    let deadline = started + Duration::from_secs(300);
    while running.len() < PODS {
        assert!(Instant::now() < deadline, "{tag}: only {} of {PODS} pods Running after 300 s", running.len());
        let (ok, out) = kubectl(&[
            "get",
            "pods",
            "-n",
            NS,
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.status.phase}{\"\\n\"}{end}",
        ]);
        let now = started.elapsed();
        if ok {
            for line in out.lines() {
                if let Some((name, "Running")) = line.split_once(' ')
                    && name.starts_with(&format!("{tag}-"))
                {
                    running.entry(name.to_owned()).or_insert(now);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    kubectl_ok(&["delete", "pods", "-n", NS, "--all", "--grace-period=0", "--force", "--wait=true"]);
    running.into_values().collect()
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64()
}

fn main() {
    let Some(cluster) = Cluster::shared(&["--backend", "vxlan"]) else { return };
    let state = cluster.state();
    let nodes: Vec<String> = state.nodes.iter().map(|n| n.name.clone()).collect();
    namespace(NS, &[]);
    // Warm-up: the first pod of each node pays one-time costs (image unpack).
    let _ = round("warm", &nodes);
    let weft = round("weft", &nodes);
    for n in &state.nodes {
        let path = host_view(n, REFERENCE_CONFLIST).expect("per-node path");
        std::fs::write(&path, reference_conflist(n.index)).expect("write reference conflist");
    }
    // containerd notices the new conflist; a pod's address says which ran.
    let probe = TestPod {
        namespace: NS,
        name: "which",
        node: &nodes[0],
        labels: &[],
        annotations: &[],
        host_port: None,
        capabilities: &[],
    };
    let mut seen_reference = false;
    for _ in 0..20 {
        let ip = probe.run();
        kubectl_ok(&["delete", "pod", "-n", NS, "which", "--grace-period=0", "--force", "--wait=true"]);
        if ip.starts_with("10.99.") {
            seen_reference = true;
            break;
        }
    }
    assert!(seen_reference, "containerd did not switch to the reference conflist");
    let reference = round("ref", &nodes);
    for n in &state.nodes {
        let _ = std::fs::remove_file(host_view(n, REFERENCE_CONFLIST).expect("per-node path"));
    }

    let mut weft = weft;
    let mut reference = reference;
    weft.sort();
    reference.sort();
    println!("\npod create-to-Running, {PODS} pods on {} nodes (s)", nodes.len());
    println!("| chain | median | p95 | last |");
    println!("|---|---|---|---|");
    for (name, d) in [("weft", &weft), ("bridge + host-local", &reference)] {
        println!("| {name} | {:.2} | {:.2} | {:.2} |", pct(d, 0.5), pct(d, 0.95), pct(d, 1.0));
    }
    println!(
        "| ratio weft / reference | {:.2} | {:.2} | {:.2} |",
        pct(&weft, 0.5) / pct(&reference, 0.5),
        pct(&weft, 0.95) / pct(&reference, 0.95),
        pct(&weft, 1.0) / pct(&reference, 1.0)
    );
    let log = std::fs::read_to_string(weft_e2e::cluster::state_dir().join("supervisor.log")).unwrap_or_default();
    for line in log.lines().filter(|l| l.starts_with("timing:")) {
        println!("{line}");
    }
}
