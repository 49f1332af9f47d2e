//! Multi-node pod networking in the sandbox cluster: the real control plane,
//! the operator and one weft-agent per node namespace, driven through the
//! `weft-sandbox` tool as a person would use it.
//!
//! One sandbox runs per machine, so these tests take turns ([`Up`]).

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{Up, ok};
use weft_e2e::wait;

fn probe_all(protocol: &str, port: &str) -> Value {
    serde_json::from_str(&ok(&["probe", "--protocol", protocol, "--port", port])).expect("probe JSON")
}

#[track_caller]
fn assert_all_allowed(m: &Value) {
    let pods = m["pods"].as_array().expect("pods").len();
    assert!(pods >= 2, "{m}");
    for (from, row) in m["matrix"].as_object().expect("matrix") {
        for (to, allowed) in row.as_object().expect("row") {
            assert_eq!(allowed, &Value::Bool(true), "{from} cannot reach {to}: {m}");
        }
    }
}

fn pod_ip(name: &str) -> String {
    ok(&["pods"])
        .lines()
        .find(|l| l.starts_with(&format!("default/{name} ")))
        .and_then(|l| l.split_whitespace().nth(2))
        .unwrap_or_default()
        .to_owned()
}

fn subnet(node: &str) -> Value {
    serde_json::from_str(&ok(&["kubectl", "get", "subnet", node, "-o", "json"])).expect("subnet JSON")
}

fn condition(subnet: &Value, type_: &str) -> Option<(String, String)> {
    subnet["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_).map(|c| {
        (c["status"].as_str().unwrap_or_default().to_owned(), c["message"].as_str().unwrap_or_default().to_owned())
    })
}

fn in_node(node: &str, args: &[&str]) -> String {
    let out = Command::new("ip").args(["-n", &format!("weft-sbx-{node}")]).args(args).output().expect("ip");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn vxlan_cluster_connects_pods_across_nodes_and_follows_membership() {
    let Some(_up) = Up::start(&["--nodes", "2"], &[]) else { return };
    ok(&["add-pod", "a", "--node", "node-1", "-l", "app=a", "-p", "80/tcp", "-p", "53/udp"]);
    ok(&["add-pod", "b", "--node", "node-2", "-l", "app=b", "-p", "80/tcp", "-p", "53/udp"]);
    assert_all_allowed(&probe_all("tcp", "80"));
    assert_all_allowed(&probe_all("udp", "53"));

    // The nodes announce their VTEPs; the agent's device is weft.1 with tx checksumming off.
    let s1 = subnet("node-1");
    assert_eq!(s1["status"]["nodeIP"], "10.250.0.11");
    assert!(s1["status"]["vtepMAC"].as_str().is_some_and(|m| m.len() == 17), "{s1}");
    assert!(in_node("node-1", &["-d", "link", "show", "weft.1"]).contains("vxlan id 1"));

    // A node added later is reachable without restarting the others.
    let added = ok(&["add-node"]);
    assert!(added.starts_with("node-3"), "{added}");
    ok(&["add-pod", "c", "--node", "node-3", "-p", "80/tcp", "-p", "53/udp"]);
    assert_all_allowed(&probe_all("tcp", "80"));

    // Continuous traffic across nodes survives an agent restart on both ends.
    let target = pod_ip("b");
    let ping = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-pod-default-a", "ping", "-q", "-i", "0.01", "-c", "400", "-W", "1", &target])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ping");
    ok(&["restart-agent", "node-1", "--kill"]);
    ok(&["restart-agent", "node-2"]);
    let out = ping.wait_with_output().expect("ping output");
    let summary = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("traffic across agent restarts: {}", summary.lines().find(|l| l.contains("loss")).unwrap_or(""));
    assert!(summary.contains(" 0% packet loss"), "packets lost across agent restarts:\n{summary}");
    assert_all_allowed(&probe_all("tcp", "80"));

    // A deleted node's route, neighbour and FDB entries disappear everywhere.
    let s3 = subnet("node-3");
    let cidr3 = s3["spec"]["cidr"].as_str().expect("cidr").to_owned();
    let mac3 = s3["status"]["vtepMAC"].as_str().expect("vtepMAC").to_owned();
    assert!(in_node("node-1", &["route"]).contains(&cidr3));
    ok(&["del-node", "node-3"]);
    for node in ["node-1", "node-2"] {
        wait::until(&format!("{node} to forget node-3"), Duration::from_secs(30), || {
            let gone = !in_node(node, &["route"]).contains(&cidr3)
                && !in_node(node, &["neigh", "show", "dev", "weft.1"]).contains(&mac3)
                && !in_node(node, &["link", "show"]).is_empty()
                && !String::from_utf8_lossy(
                    &Command::new("ip")
                        .args(["netns", "exec", &format!("weft-sbx-{node}"), "bridge", "fdb", "show", "dev", "weft.1"])
                        .output()
                        .expect("bridge")
                        .stdout,
                )
                .contains(&mac3);
            gone.then_some(())
        });
    }

    // Bad peer data is reported in a condition, not a crash.
    let patch = r#"{"status":{"vtepMAC":"01:00:5e:00:00:01"}}"#;
    ok(&["kubectl", "patch", "subnet", "node-2", "--subresource=status", "--type=merge", "-p", patch]);
    let msg = wait::until("node-1 to report node-2's bad MAC", Duration::from_secs(30), || {
        match condition(&subnet("node-1"), "PeersProgrammed") {
            Some((s, m)) if s == "False" && m.contains("node-2") => Some(m),
            _ => None,
        }
    });
    eprintln!("PeersProgrammed on node-1: {msg}");
    assert!(ok(&["status"]).contains("node-1"));
    // The agent of node-2 announces its real MAC again when it restarts.
    ok(&["restart-agent", "node-2"]);
    wait::until("node-1's peers programmed again", Duration::from_secs(30), || {
        matches!(condition(&subnet("node-1"), "PeersProgrammed"), Some((s, _)) if s == "True").then_some(())
    });
    assert_all_allowed(&probe_all("tcp", "80"));
}

#[test]
fn host_gw_cluster_routes_via_node_ips() {
    let Some(_up) = Up::start(&["--nodes", "2", "--backend", "host-gw"], &[]) else { return };
    ok(&["add-pod", "a", "--node", "node-1"]);
    ok(&["add-pod", "b", "--node", "node-2"]);
    assert_all_allowed(&probe_all("tcp", "80"));
    let cidr2 = subnet("node-2")["spec"]["cidr"].as_str().expect("cidr").to_owned();
    let routes = in_node("node-1", &["route"]);
    assert!(routes.contains(&format!("{cidr2} via 10.250.0.12")), "{routes}");
    assert!(!in_node("node-1", &["link", "show"]).contains("weft.1"), "host-gw needs no VXLAN device");
}
