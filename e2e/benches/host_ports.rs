//! ADD+DEL latency with host ports, in the sandbox (a real agent with its
//! API, operator and publisher running): a pod without host ports, a pod
//! with two automatic host ports (annotation), and the reference
//! `bridge` + `host-local` + `portmap` chain with two port mappings, in the
//! same run, alternating every iteration.
//!
//! Run with `e2e/bench.sh hostports` (release binaries, root).

use std::path::Path;

use serde_json::json;
use weft_e2e::bench_exec::{Case, Samples, inner_main, measure, print_table};
use weft_e2e::bins;
use weft_e2e::netns::Netns;
use weft_e2e::sandbox::State;
use weft_e2e::sandbox::testing::{Up, ok};
use weft_e2e::supervisor::StateFile;

const ITERATIONS: usize = 100;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--inner") {
        inner_main(&args[i + 1..]);
        return;
    }
    // SAFETY: setting an env var before any thread is spawned.
    if std::env::var_os("WEFT_BIN_DIR").is_none() {
        unsafe { std::env::set_var("WEFT_BIN_DIR", Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release")) };
    }
    let Some(_up) = Up::start(&["--nodes", "1"], &[]) else {
        eprintln!("host_ports needs root and the control plane (e2e/scripts/build-tools.sh)");
        std::process::exit(1);
    };
    // The Pod objects the runtime's ADDs are for (what kubelet would have).
    let pod = |name: &str, annotation: Option<&str>| {
        let mut meta = json!({"name": name, "namespace": "default"});
        if let Some(a) = annotation {
            meta["annotations"] = json!({"weft.dev/host-ports": a});
        }
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": "node-1",
            "containers": [{"name": "app", "image": "x", "ports": [{"containerPort": 80}, {"containerPort": 81}]}]}});
        let file = std::env::temp_dir().join(format!("weft-bench-{name}.json"));
        std::fs::write(&file, pod.to_string()).expect("pod file");
        ok(&["kubectl", "apply", "-f", file.to_str().expect("path")]);
    };
    // The namespace's default ServiceAccount (no controller-manager runs to make it).
    ok(&["kubectl", "create", "serviceaccount", "default", "-n", "default"]);
    ok(&["kubectl", "label", "--overwrite", "namespace", "default", "weft.dev/host-ports=allowed"]);
    pod("bench-plain", None);
    pod("bench-ports", Some("80,81"));

    let state = State::load().expect("sandbox state");
    let node = state.node("node-1").expect("node-1");
    let node_ns = Netns::existing(&node.netns);
    let weft_pod = Netns::new("bench-hp-wpod");
    let weft_conf = json!({"cniVersion": "1.1.0", "name": "weft", "type": "weft-cni", "agentSocket": node.socket,
                           "capabilities": {"portMappings": true}});
    let args = |name: &str| format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}");
    let plain = Case {
        node: &node_ns,
        plugin: bins::weft("weft-cni"),
        pod: &weft_pod,
        conf: weft_conf.clone(),
        cni_args: args("bench-plain"),
    };
    let ports = Case {
        node: &node_ns,
        plugin: bins::weft("weft-cni"),
        pod: &weft_pod,
        conf: weft_conf,
        cni_args: args("bench-ports"),
    };

    let dir = tempfile::tempdir().expect("tempdir");
    let ref_node = Netns::new("bench-hp-ref");
    let ref_pod = Netns::new("bench-hp-rpod");
    let reference = Case {
        node: &ref_node,
        plugin: Path::new(bins::REFERENCE_PLUGINS).to_path_buf(),
        pod: &ref_pod,
        conf: json!({
            "cniVersion": "1.0.0", "name": "refnet",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "subnet": "10.223.0.0/24", "dataDir": dir.path().join("host-local")}},
                {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true},
            ],
            "runtimeConfig": {"portMappings": [
                {"hostPort": 28080, "containerPort": 80, "protocol": "tcp"},
                {"hostPort": 28081, "containerPort": 81, "protocol": "tcp"},
            ]},
        }),
        cni_args: args("bench-ref"),
    };

    let (mut s_plain, mut s_ports, mut s_ref) = (Samples::default(), Samples::default(), Samples::default());
    for _ in 0..ITERATIONS {
        s_plain.push(measure(&plain));
        s_ports.push(measure(&ports));
        s_ref.push(measure(&reference));
    }
    print_table(
        &format!("CNI ADD/DEL latency with host ports, {ITERATIONS} iterations each, alternating (ms)"),
        &[
            ("weft, no host ports", &s_plain),
            ("weft, 2 automatic host ports", &s_ports),
            ("bridge + host-local + portmap, 2 mappings", &s_ref),
        ],
    );
    let extra = weft_e2e::bench_exec::ms(s_ports.add.median()) - weft_e2e::bench_exec::ms(s_plain.add.median());
    println!("\ncost of two host ports in weft's ADD (median): {extra:.2} ms");
}
