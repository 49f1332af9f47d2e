//! ADD+DEL latency of weft (weft-cni → weft-agent) against the reference
//! `bridge` + `host-local` chain, in the same run on the same machine.
//!
//! Run with `e2e/bench.sh cni` (builds release binaries first). Each plugin is
//! exec'd as a runtime does, from a process already inside the node's
//! namespace, so the figures contain no `ip netns exec` overhead. Weft runs
//! twice, with bridged and with routed pods, and dual-stack against the same
//! reference with two `host-local` ranges. The chains take turns every
//! iteration, each going first in turn, so machine noise hits them alike.
//! A fourth agent has its `/readyz` hammered all along (about 200 requests a
//! second, as anything that can reach a node could): its ADDs must not wait
//! for the health checks. With `WEFT_BASELINE_BIN_DIR` (weft-agent and
//! weft-cni of another build), that build runs beside this one in the same
//! rotation, so a change is measured against what it changed. Each case
//! always follows the same one, whose veth removals finish during it: that
//! slot alone moved DEL by 10–15 % here. Run it twice with the two builds'
//! directories swapped (WEFT_BIN_DIR and WEFT_BASELINE_BIN_DIR) and compare
//! each build in the same slot.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::json;
use weft_e2e::agent::Agent;
use weft_e2e::bench_exec::{Case, Samples, inner_main, measure, print_table};
use weft_e2e::bins;
use weft_e2e::netns::Netns;

const ITERATIONS: usize = 200;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--inner") {
        inner_main(&args[i + 1..]);
        return;
    }
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("cni_add_del needs root (network namespaces)");
        std::process::exit(1);
    }
    // SAFETY: setting env vars before any thread is spawned.
    if std::env::var_os("WEFT_BIN_DIR").is_none() {
        unsafe { std::env::set_var("WEFT_BIN_DIR", Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release")) };
    }
    // The agent as installed: the chart's log level (values.yaml logLevel).
    // At debug, the gRPC stack's own events cost every ADD 0.16 ms.
    unsafe { std::env::set_var("WEFT_LOG", "info") };
    let dir = tempfile::tempdir().expect("tempdir");

    let weft_node = Netns::new("bench-weft");
    let weft_pod = Netns::new("bench-wpod");
    let agent = Agent::start(&weft_node, "10.220.0.0/24", dir.path());
    let weft = Case {
        node: &weft_node,
        plugin: bins::weft("weft-cni"),
        pod: &weft_pod,
        conf: json!({"cniVersion": "1.0.0", "name": "weft", "type": "weft-cni", "agentSocket": agent.socket}),
        cni_args: String::new(),
    };

    // The same with routed pods (--pod-attachment routed): no bridge port, a
    // route and neighbour entries instead.
    let routed_node = Netns::new("bench-routed");
    let routed_pod = Netns::new("bench-rtpod");
    let routed_dir = tempfile::tempdir().expect("tempdir");
    let routed_agent =
        Agent::start_with(&routed_node, "10.222.0.0/24", routed_dir.path(), &["--pod-attachment", "routed"]);
    let routed = Case {
        node: &routed_node,
        plugin: bins::weft("weft-cni"),
        pod: &routed_pod,
        conf: json!({"cniVersion": "1.0.0", "name": "weft", "type": "weft-cni", "agentSocket": routed_agent.socket}),
        cni_args: String::new(),
    };

    // The same as `weft`, with its /readyz hammered from inside its node.
    let probed_node = Netns::new("bench-probed");
    let probed_pod = Netns::new("bench-ppod");
    let probed_dir = tempfile::tempdir().expect("tempdir");
    let probed_agent = Agent::start(&probed_node, "10.223.0.0/24", probed_dir.path());
    let probed = Case {
        node: &probed_node,
        plugin: bins::weft("weft-cni"),
        pod: &probed_pod,
        conf: json!({"cniVersion": "1.0.0", "name": "weft", "type": "weft-cni", "agentSocket": probed_agent.socket}),
        cni_args: String::new(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let probes = Arc::new(AtomicU64::new(0));
    let to = std::net::SocketAddr::from(([127, 0, 0, 1], 9646));
    let pace = Some(Duration::from_millis(5));
    let hammer = weft_e2e::flood::readyz(probed_node.path(), to, pace, Arc::clone(&stop), Arc::clone(&probes));

    // Dual-stack: an IPv4 and an IPv6 address per pod, from one ADD.
    let dual_node = Netns::new("bench-dual");
    let dual_pod = Netns::new("bench-dpod");
    let dual_dir = tempfile::tempdir().expect("tempdir");
    let dual_agent =
        Agent::start_with(&dual_node, "10.224.0.0/24", dual_dir.path(), &["--pod-ipv6-cidr", "fd00:224::/64"]);
    let dual = Case {
        node: &dual_node,
        plugin: bins::weft("weft-cni"),
        pod: &dual_pod,
        conf: json!({"cniVersion": "1.0.0", "name": "weft", "type": "weft-cni", "agentSocket": dual_agent.socket}),
        cni_args: String::new(),
    };

    let ref_node = Netns::new("bench-ref");
    let ref_pod = Netns::new("bench-rpod");
    let reference = Case {
        node: &ref_node,
        plugin: bins::reference("bridge"),
        pod: &ref_pod,
        conf: json!({
            "cniVersion": "1.0.0", "name": "refnet", "type": "bridge", "bridge": "cni0",
            "isGateway": true, "ipMasq": false,
            "ipam": {"type": "host-local", "subnet": "10.221.0.0/24", "dataDir": dir.path().join("host-local")},
        }),
        cni_args: String::new(),
    };
    let ref_dual_node = Netns::new("bench-refdual");
    let ref_dual_pod = Netns::new("bench-rdpod");
    // Weft adds IPv6 addresses without duplicate address detection (the
    // agent owns the block); the bridge plugin waits for DAD to settle, which
    // would measure a one-second kernel timer, not the plugin. Off here too.
    for ns in [&ref_dual_node, &ref_dual_pod] {
        for conf in ["all", "default"] {
            ns.exec("sysctl", &["-qw", &format!("net.ipv6.conf.{conf}.accept_dad=0")]);
        }
    }
    let reference_dual = Case {
        node: &ref_dual_node,
        plugin: bins::reference("bridge"),
        pod: &ref_dual_pod,
        conf: json!({
            "cniVersion": "1.0.0", "name": "refnet", "type": "bridge", "bridge": "cni0",
            "isGateway": true, "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": "10.225.0.0/24"}], [{"subnet": "fd00:225::/64"}]],
                "dataDir": dir.path().join("host-local-dual"),
            },
        }),
        cni_args: String::new(),
    };

    // Another build of weft, bridged as `weft` (WEFT_BASELINE_BIN_DIR).
    let baseline_dir = std::env::var_os("WEFT_BASELINE_BIN_DIR").map(std::path::PathBuf::from);
    let baseline_node = Netns::new("bench-base");
    let baseline_pod = Netns::new("bench-bpod");
    let baseline_state = tempfile::tempdir().expect("tempdir");
    let baseline_agent = baseline_dir
        .as_ref()
        .map(|d| Agent::start_binary(&baseline_node, "10.226.0.0/24", baseline_state.path(), &d.join("weft-agent")));
    let baseline = baseline_dir.as_ref().zip(baseline_agent.as_ref()).map(|(d, a)| Case {
        node: &baseline_node,
        plugin: d.join("weft-cni"),
        pod: &baseline_pod,
        conf: json!({"cniVersion": "1.0.0", "name": "weft", "type": "weft-cni", "agentSocket": a.socket}),
        cni_args: String::new(),
    });

    let mut cases = vec![
        ("weft", &weft),
        ("weft, routed pods", &routed),
        ("weft, /readyz hammered", &probed),
        ("bridge + host-local", &reference),
        ("weft, dual-stack", &dual),
        ("bridge + host-local, 2 ranges", &reference_dual),
    ];
    if let Some(b) = &baseline {
        cases.push(("weft, baseline build", b));
    }
    let mut samples: Vec<Samples> = cases.iter().map(|_| Samples::default()).collect();
    for i in 0..ITERATIONS {
        // Each chain goes first in turn: a DEL's deferred kernel work (RCU
        // callbacks of the veth it removed) lands on whichever comes next.
        for k in 0..cases.len() {
            let c = (i + k) % cases.len();
            samples[c].push(measure(cases[c].1));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let answered = hammer.join().expect("readyz hammer");
    drop((agent, routed_agent, probed_agent, dual_agent, baseline_agent));
    let rows: Vec<(&str, &Samples)> = cases.iter().zip(&samples).map(|((name, _), s)| (*name, s)).collect();
    // Tables from the same interleaved run, each with its own reference last.
    print_table(&format!("CNI ADD/DEL latency, {ITERATIONS} iterations each, rotating order (ms)"), &rows[..4]);
    print_table("Dual-stack (IPv4 + IPv6 per pod), same run (ms)", &rows[4..6]);
    if rows.len() > 6 {
        print_table("This build against the baseline build, same run (ms)", &[rows[0], rows[6]]);
    }
    println!("\n/readyz requests during the run: {} ({answered} answered)", probes.load(Ordering::Relaxed));
}
