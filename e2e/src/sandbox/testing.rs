//! Driving the sandbox from tests the way a person does: through the
//! `weft-sandbox` binary. One sandbox runs per machine, so a test holds
//! [`Up`] for as long as it uses it.

use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::{bins, control_plane, prereq, wait};

/// Tests of one binary take turns; other binaries wait for the machine's lock.
static ONE_SANDBOX: Mutex<()> = Mutex::new(());

/// Runs `weft-sandbox args…`; returns success and stdout+stderr.
pub fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(bins::weft("weft-sandbox"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap_or_else(|e| panic!("cannot run weft-sandbox: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// What the responder at `target` (IP:PORT) answers to `from` (a node name
/// or namespace/pod); `None` when nothing answers.
pub fn connect(from: &str, protocol: &str, target: &str) -> Option<String> {
    let (success, out) = run(&["connect", "--from", from, "--protocol", protocol, target]);
    success.then(|| out.trim().to_owned())
}

/// `kubectl apply -f` of a YAML document; returns success and output.
pub fn try_apply(yaml: &str) -> (bool, String) {
    let mut f = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp file");
    std::io::Write::write_all(&mut f, yaml.as_bytes()).expect("write YAML");
    let path = f.path().to_str().expect("utf-8 path").to_owned();
    run(&["kubectl", "apply", "-f", &path])
}

/// `weft-sandbox kubectl args…`, failing the test if it fails.
#[track_caller]
pub fn kubectl(args: &[&str]) -> String {
    ok(&[&["kubectl"], args].concat())
}

/// `kubectl apply` of a YAML document, failing the test if it fails.
#[track_caller]
pub fn apply(yaml: &str) {
    let (success, out) = try_apply(yaml);
    assert!(success, "kubectl apply failed:\n{out}\n{yaml}");
}

/// One probe matrix of every sandbox pod (`weft-sandbox probe`), over the
/// pods' addresses of `family` (`ipv4` or `ipv6`): (from, to) → reached.
pub fn probe_matrix(family: &str, protocol: &str, port: u16) -> std::collections::BTreeMap<(String, String), bool> {
    let port = port.to_string();
    let out = ok(&["probe", "--family", family, "--protocol", protocol, "--port", &port, "--timeout-ms", "700"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("probe JSON");
    let mut m = std::collections::BTreeMap::new();
    for (from, row) in v["matrix"].as_object().expect("matrix") {
        for (to, allowed) in row.as_object().expect("row") {
            m.insert((from.clone(), to.clone()), allowed.as_bool().expect("bool"));
        }
    }
    m
}

/// A sandbox pod's address of `family` (`ipv4` or `ipv6`), from `pods`'s listing.
pub fn pod_address(listing: &str, key: &str, family: &str) -> String {
    let field = if family == "ipv6" { 3 } else { 2 };
    let line = listing.lines().find(|l| l.starts_with(&format!("{key} "))).unwrap_or_else(|| panic!("no pod {key}"));
    line.split_whitespace().nth(field).unwrap_or_else(|| panic!("no {family} address for {key}")).to_owned()
}

/// A sandbox pod's IPv4 address.
pub fn pod_ip(key: &str) -> String {
    pod_address(&ok(&["pods"]), key, "ipv4")
}

/// What `weft explain` (the policy model, from the API) says of every
/// ordered pair of `pods` over `family` to `protocol`/`port`: admitted or
/// not. Run in parallel, one CLI run per pair.
pub fn explained_matrix(
    family: &str,
    protocol: &str,
    port: u16,
    pods: &[&str],
) -> std::collections::BTreeMap<(String, String), bool> {
    let state = <super::State as crate::supervisor::StateFile>::load().expect("sandbox state");
    let listing = ok(&["pods"]);
    let field = if family == "ipv6" { 3 } else { 2 };
    let addr = |key: &str| -> String {
        let line =
            listing.lines().find(|l| l.starts_with(&format!("{key} "))).unwrap_or_else(|| panic!("no pod {key}"));
        line.split_whitespace().nth(field).unwrap_or_else(|| panic!("no {family} address for {key}")).to_owned()
    };
    let target = format!("{port}/{}", protocol.to_ascii_uppercase());
    let pairs: Vec<(&str, &str, String)> = pods
        .iter()
        .flat_map(|f| pods.iter().filter(move |t| *t != f).map(move |t| (*f, *t)))
        .map(|(f, t)| (f, t, addr(t)))
        .collect();
    std::thread::scope(|scope| {
        let runs: Vec<_> = pairs
            .iter()
            .map(|(from, to, to_addr)| {
                let (kubeconfig, target) = (&state.kubeconfig, &target);
                scope.spawn(move || {
                    let out = Command::new(bins::weft("weft"))
                        .arg("--kubeconfig")
                        .arg(kubeconfig)
                        .args(["explain", "--from", from, "--to", to_addr, "--port", target, "-o", "json"])
                        .output()
                        .expect("weft runs");
                    assert!(
                        out.status.success(),
                        "weft explain {from} -> {to}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("explanation JSON");
                    assert_eq!(v["ingress"]["pod"], serde_json::json!(to), "{to_addr} is {to}'s");
                    ((from.to_string(), to.to_string()), v["allowed"].as_bool().expect("allowed"))
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// Waits (at most `within`) until the probe matrix between `pods` over
/// `family` equals `expect(from, to)`; fails the test with the last matrix.
#[track_caller]
pub fn expect_matrix(
    pods: &[&str],
    (step, family, protocol, port): (&str, &str, &str, u16),
    within: Duration,
    expect: &dyn Fn(&str, &str) -> bool,
) {
    let mut want = std::collections::BTreeMap::new();
    for f in pods {
        for t in pods.iter().filter(|t| *t != f) {
            want.insert(((*f).to_owned(), (*t).to_owned()), expect(f, t));
        }
    }
    let mut last = std::collections::BTreeMap::new();
    let converged = wait::try_until(within, || {
        last = probe_matrix(family, protocol, port);
        (last == want).then_some(())
    });
    assert!(converged.is_some(), "step {step:?} over {family} ({protocol}/{port}): got {last:?}, want {want:?}");
    eprintln!("ok: {step} over {family} ({protocol}/{port})");
}

/// The addresses (`ip:port/PROTO`) the HostPortAllocation of `pod` lists in
/// its status, once it lists `count` per port.
pub fn host_port_addresses(pod: &str, count: usize, within: Duration) -> Vec<String> {
    wait::until(&format!("the host port addresses of {pod}"), within, || {
        let all: serde_json::Value =
            serde_json::from_str(&kubectl(&["get", "hostportallocations", "-A", "-o", "json"])).ok()?;
        let mine = all["items"].as_array()?.iter().find(|a| a["spec"]["podRef"]["name"] == pod)?;
        let ports = mine["spec"]["ports"].as_array()?.len();
        let listed: Vec<String> =
            mine["status"]["addresses"].as_array()?.iter().filter_map(|a| a.as_str().map(str::to_owned)).collect();
        (listed.len() == ports * count).then_some(listed)
    })
}

/// Fails the test if a node's agent logged a failed overlay operation: an
/// entry the reconciler fought the kernel over (deleted and re-added every
/// pass) shows up there.
#[track_caller]
pub fn assert_overlay_converged(nodes: &[&str]) {
    for node in nodes {
        let path = super::state_dir().join(node).join("agent.log");
        let log = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let failed: Vec<&str> = log.lines().filter(|l| l.contains("overlay operation failed")).take(3).collect();
        assert!(failed.is_empty(), "{node}: {failed:#?}");
    }
}

/// Waits until `from` (a pod key or node name) reaches `target` over
/// `protocol` and the answer names `want`; fails the test otherwise.
#[track_caller]
pub fn assert_reaches(from: &str, protocol: &str, target: &str, want: &str, within: Duration) {
    let answer = wait::try_until(within, || connect(from, protocol, target).filter(|a| a == want));
    assert!(answer.is_some(), "{from} cannot reach {want} at {target} ({protocol})");
}

/// The standard NetworkPolicy `db-from-dev` in namespace prod: pods
/// app=db admit ingress only from `peer` (one entry of `from`, in YAML flow
/// style).
pub fn db_ingress_policy(peer: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: db-from-dev, namespace: prod}}\n\
         spec:\n  podSelector: {{matchLabels: {{app: db}}}}\n  ingress:\n  - from: [{peer}]\n"
    )
}

/// Weft's own NetworkPolicy `no-client` in namespace prod: pods app=web
/// deny ingress from `cidr`, then allow every namespace.
pub fn weft_deny_to_web(cidr: &str) -> String {
    format!(
        "apiVersion: weft.dev/v1alpha1\nkind: NetworkPolicy\nmetadata: {{name: no-client, namespace: prod}}\n\
         spec:\n  priority: 100\n  podSelector: {{matchLabels: {{app: web}}}}\n  ingress:\n\
         \x20 - action: Deny\n    peers: [{{ipBlock: {{cidr: '{cidr}'}}}}]\n\
         \x20 - action: Allow\n    peers: [{{namespaceSelector: {{}}}}]\n"
    )
}

/// The namespace of a pod key (`namespace/name`).
pub fn ns_of(pod: &str) -> &str {
    pod.split('/').next().unwrap_or_default()
}

/// Runs `weft-sandbox args…`, failing the test with its output if it fails.
#[track_caller]
pub fn ok(args: &[&str]) -> String {
    let (success, out) = run(args);
    assert!(success, "weft-sandbox {args:?} failed:\n{out}");
    out
}

/// This test's turn at the sandbox (tests of one binary take turns) once
/// root, the control plane binaries and `extra` prerequisites are present;
/// `None` when one is missing outside CI.
pub fn turn(extra: &[(&str, bool)]) -> Option<MutexGuard<'static, ()>> {
    let turn = ONE_SANDBOX.lock().unwrap_or_else(|p| p.into_inner());
    let present = prereq::require_root()
        && prereq::require("kube-apiserver and etcd (e2e/scripts/build-tools.sh)", control_plane::tools_present())
        && extra.iter().all(|(what, present)| prereq::require(what, *present));
    present.then_some(turn)
}

/// A sandbox this test brought up; brought down on drop, also on panic.
pub struct Up {
    _turn: MutexGuard<'static, ()>,
}

impl Up {
    /// Brings the sandbox up with `args` (e.g. `["--nodes", "2"]`) once root,
    /// the control plane binaries and `extra` prerequisites are present;
    /// `None` when one is missing outside CI.
    pub fn start(args: &[&str], extra: &[(&str, bool)]) -> Option<Up> {
        let turn = turn(extra)?;
        // A person (or another test binary) may own the sandbox right now,
        // and another binary may win the race to `up` once it is free: wait
        // for the machine again then. Leftovers of a sandbox whose
        // supervisor died hold no lock: `up` removes them.
        let mut full = vec!["up"];
        full.extend_from_slice(args);
        let deadline = std::time::Instant::now() + Duration::from_secs(1200);
        loop {
            wait::until("no other sandbox to be up or starting", Duration::from_secs(600), || {
                (!super::cluster::locks().taken()).then_some(())
            });
            let (success, out) = run(&full);
            if success {
                break;
            }
            let lost_race = out.contains("already up or starting");
            assert!(lost_race && std::time::Instant::now() < deadline, "weft-sandbox {full:?} failed:\n{out}");
        }
        Some(Up { _turn: turn })
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = run(&["down"]);
    }
}

/// A node's agent stopped with SIGSTOP (it keeps its socket and answers
/// nothing, and writes nothing to the API) until this is dropped, also on a
/// panic. For showing what others do with data the agent would repair.
pub struct PausedAgent(i32);

impl PausedAgent {
    pub fn new(node: &str) -> PausedAgent {
        let pid = super::read_pid(&super::state_dir().join(node).join("agent.pid"))
            .unwrap_or_else(|| panic!("no pid of {node}'s agent"));
        // SAFETY: plain kill(2) of the sandbox's agent.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "cannot stop {node}'s agent");
        PausedAgent(pid)
    }
}

impl Drop for PausedAgent {
    fn drop(&mut self) {
        // SAFETY: as above; the process may be gone already.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

/// The probe matrix of every pod to every pod (`weft-sandbox probe`).
#[track_caller]
pub fn probe_all(protocol: &str, port: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["probe", "--protocol", protocol, "--port", port])).expect("probe JSON")
}

/// Every pod of the probe matrix `m` (at least two) reached every other.
#[track_caller]
pub fn assert_all_allowed(m: &serde_json::Value) {
    let pods = m["pods"].as_array().expect("pods").len();
    assert!(pods >= 2, "{m}");
    for (from, row) in m["matrix"].as_object().expect("matrix") {
        for (to, allowed) in row.as_object().expect("row") {
            assert_eq!(allowed, &serde_json::Value::Bool(true), "{from} cannot reach {to}: {m}");
        }
    }
}

/// Node `node`'s Subnet, as JSON.
#[track_caller]
pub fn subnet(node: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["kubectl", "get", "subnet", node, "-o", "json"])).expect("subnet JSON")
}

/// `ip -n <node's namespace> args…`: its stdout.
pub fn ip_in_node(node: &str, args: &[&str]) -> String {
    let out = Command::new("ip").args(["-n", &format!("weft-sbx-{node}")]).args(args).output().expect("ip");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `node`'s connection tracking holds a `protocol` flow from `src`
/// to `dst`: whether a packet with that source got there.
pub fn tracked(node: &str, protocol: &str, src: &str, dst: &str) -> bool {
    let out = Command::new("ip")
        .args(["netns", "exec", &format!("weft-sbx-{node}"), "conntrack", "-L", "-p", protocol, "-s", src, "-d", dst])
        .output()
        .expect("conntrack");
    String::from_utf8_lossy(&out.stdout).lines().any(|l| l.contains(&format!("src={src}")))
}

/// Sends, from the network namespace of sandbox pod `pod`
/// (`namespace/name`), an IPv4 UDP packet `src` → `dst` of its own making
/// hidden in the overlay's encapsulation to `node_ip:port` (VXLAN VNI 1 to
/// `vtep_mac` when given, else udp's bare packet); whether the packet then
/// shows up in `tracked_on`'s connection tracking within 2 s, i.e. whether
/// a node took it for its peer's traffic.
pub fn smuggled_arrives(
    pod: &str,
    to: std::net::SocketAddr,
    vtep_mac: Option<[u8; 6]>,
    src: &str,
    dst: &str,
    tracked_on: &str,
) -> bool {
    use crate::smuggle;
    let (ns, name) = pod.split_once('/').expect("namespace/name");
    let (s, d) = (src.parse().expect("an IPv4 source"), dst.parse().expect("an IPv4 destination"));
    let inner = smuggle::ipv4_udp(s, d, 40_000, 5_353, b"smuggled");
    let payload = match vtep_mac {
        Some(mac) => smuggle::vxlan(1, mac, &inner),
        None => inner,
    };
    let sent =
        smuggle::send_from(format!("/run/netns/weft-sbx-pod-{ns}-{name}"), to, payload, 3).expect("send from the pod");
    assert_eq!(sent, 3, "the pod's socket took every datagram");
    wait::try_until(Duration::from_secs(2), || tracked(tracked_on, "udp", src, dst).then_some(())).is_some()
}
