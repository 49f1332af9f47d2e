//! Pods of a VM runtime (Kata's default `tcfilter` mode, emulated by
//! `weft-sandbox add-pod --vm`): after weft-cni's ADD, the workload moves
//! into a guest whose interface gets the pod interface's MAC, MTU,
//! addresses and routes from the CNI result, and TC redirects carry every
//! frame between the pod's eth0 and the guest's tap. Pod-to-pod on one node
//! and across nodes, host ports, policy and MTU-sized packets must work
//! through it in both attachment modes, next to plain pods.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{Up, connect, ok, try_apply};
use weft_e2e::wait;

/// `ip -j -n NETNS args…` as JSON.
fn ip_json(netns: &str, args: &[&str]) -> Value {
    let out = Command::new("ip").args(["-j", "-n", netns]).args(args).output().expect("ip");
    assert!(out.status.success(), "ip -n {netns} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("ip JSON")
}

fn ipv4_addresses(link: &Value) -> Vec<String> {
    link["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["family"] == "inet")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or_default(), a["prefixlen"]))
        .collect()
}

fn probe(protocol: &str, port: &str) -> Value {
    serde_json::from_str(&ok(&["probe", "--protocol", protocol, "--port", port])).expect("probe JSON")
}

/// The pods `from` reaches, per source, as `from -> [to…]` lines.
fn reached(m: &Value) -> Vec<String> {
    let mut lines = Vec::new();
    for (from, row) in m["matrix"].as_object().expect("matrix") {
        let to: Vec<&str> =
            row.as_object().expect("row").iter().filter(|(_, v)| **v == true).map(|(k, _)| k.as_str()).collect();
        lines.push(format!("{from} -> {}", to.join(",")));
    }
    lines
}

/// Checks what the emulated runtime did to a VM pod and returns the guest's MTU.
#[track_caller]
fn assert_wired_like_kata(pod: &Value) -> u64 {
    let (pod_ns, guest_ns) = (pod["netns"].as_str().expect("netns"), pod["guest_netns"].as_str().expect("a VM pod"));
    let pod_if = &ip_json(pod_ns, &["addr", "show", "dev", "eth0"])[0];
    let guest_if = &ip_json(guest_ns, &["addr", "show", "dev", "eth0"])[0];
    assert_eq!(guest_if["address"], pod_if["address"], "the guest has the pod interface's MAC");
    assert_eq!(guest_if["mtu"], pod_if["mtu"], "the guest has the pod interface's MTU");
    assert!(ipv4_addresses(pod_if).is_empty(), "the pod interface keeps no address: {pod_if}");
    let ip = pod["ip"].as_str().expect("ip");
    assert!(ipv4_addresses(guest_if).iter().any(|a| a.starts_with(&format!("{ip}/"))), "{guest_if}");
    for (dev, to) in [("eth0", "tap0_kata"), ("tap0_kata", "eth0")] {
        let out =
            Command::new("tc").args(["-n", pod_ns, "filter", "show", "dev", dev, "ingress"]).output().expect("tc");
        let filters = String::from_utf8_lossy(&out.stdout);
        assert!(filters.contains(&format!("Egress Redirect to device {to}")), "{dev} ingress:\n{filters}");
    }
    guest_if["mtu"].as_u64().expect("mtu")
}

/// Pings `target` from pod `from` with an unfragmentable packet filling `mtu`.
#[track_caller]
fn assert_full_size_packets_pass(from: &str, target: &str, mtu: u64) {
    let size = (mtu - 28).to_string();
    let out = ok(&["exec", from, "--", "ping", "-M", "do", "-s", &size, "-c", "2", "-W", "2", target]);
    assert!(out.contains(" 0% packet loss"), "{from} -> {target} with {mtu}-byte packets:\n{out}");
}

fn vm_pods_work_through_tc_redirects(up_args: &[&str]) {
    let Some(_up) = Up::start(up_args, &[]) else { return };
    let add = |name: &str, node: &str, extra: &[&str]| -> Value {
        let label = format!("app={name}");
        let mut args = vec!["add-pod", name, "--node", node, "-l", &label, "-p", "80/tcp", "-p", "53/udp"];
        args.extend_from_slice(extra);
        let out = ok(&args);
        serde_json::from_str(out.lines().last().unwrap_or_default()).expect("pod record JSON")
    };
    let vm_a = add("vm-a", "node-1", &["--vm", "--host-port", "8080:80/tcp"]);
    let vm_b = add("vm-b", "node-2", &["--vm"]);
    add("c", "node-1", &[]);
    add("d", "node-2", &[]);
    let mtu = assert_wired_like_kata(&vm_a);
    assert_eq!(assert_wired_like_kata(&vm_b), mtu);

    // Every pod reaches every other, VM or not, on one node and across nodes.
    for (protocol, port) in [("tcp", "80"), ("udp", "53")] {
        let m = probe(protocol, port);
        assert!(
            m["matrix"]
                .as_object()
                .expect("matrix")
                .values()
                .all(|row| { row.as_object().expect("row").values().all(|v| *v == true) }),
            "{protocol}: {m}"
        );
    }
    let (ip_b, ip_c) = (vm_b["ip"].as_str().expect("ip"), ok(&["pods"]));
    let ip_c = ip_c.lines().find(|l| l.starts_with("default/c ")).and_then(|l| l.split_whitespace().nth(2)).expect("c");
    assert_full_size_packets_pass("vm-a", ip_b, mtu);
    assert_full_size_packets_pass("vm-a", ip_c, mtu);
    assert_full_size_packets_pass("d", vm_a["ip"].as_str().expect("ip"), mtu);

    // The VM's host port, from another node and from a pod of its own node.
    assert_eq!(connect("node-2", "tcp", "10.250.0.11:8080").as_deref(), Some("default/vm-a"));
    assert_eq!(connect("default/c", "tcp", "10.250.0.11:8080").as_deref(), Some("default/vm-a"));
    // And from the VM itself: out of eth0 and back in through it (hairpin).
    assert_eq!(connect("default/vm-a", "tcp", "10.250.0.11:8080").as_deref(), Some("default/vm-a"));

    // Policy on a VM pod: only vm-a may reach vm-b.
    let (applied, out) = try_apply(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: only-a, namespace: default}\n\
         spec:\n  podSelector: {matchLabels: {app: vm-b}}\n  policyTypes: [Ingress]\n  ingress:\n\
         \x20 - from: [{podSelector: {matchLabels: {app: vm-a}}}]\n",
    );
    assert!(applied, "{out}");
    let want = [
        "default/c -> default/d,default/vm-a",
        "default/d -> default/c,default/vm-a",
        "default/vm-a -> default/c,default/d,default/vm-b",
        "default/vm-b -> default/c,default/d,default/vm-a",
    ];
    let mut last = Vec::new();
    let settled = wait::try_until(Duration::from_secs(30), || {
        last = reached(&probe("tcp", "80"));
        (last == want).then_some(())
    });
    assert!(settled.is_some(), "policy through the VM pods: got {last:#?}, want {want:#?}");

    // Deleting a VM pod leaves neither its namespaces nor its attachment.
    ok(&["del-pod", "vm-a"]);
    let netns =
        String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().expect("ip").stdout).into_owned();
    assert!(!netns.contains("weft-sbx-vm-default-vm-a") && !netns.contains("weft-sbx-pod-default-vm-a"), "{netns}");
    assert!(connect("node-2", "tcp", "10.250.0.11:8080").is_none(), "the host port went with the pod");
}

#[test]
fn vm_pods_on_bridged_attachments_over_vxlan() {
    vm_pods_work_through_tc_redirects(&["--nodes", "2"]);
}

#[test]
fn vm_pods_on_routed_attachments_over_host_gw() {
    vm_pods_work_through_tc_redirects(&["--nodes", "2", "--backend", "host-gw", "--agent-arg=--pod-attachment=routed"]);
}
