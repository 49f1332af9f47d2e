//! Multi-node pod networking in the sandbox cluster: the real control plane,
//! the operator and one weft-agent per node namespace, driven through the
//! `weft-sandbox` tool as a person would use it.
//!
//! One sandbox runs per machine, so these tests take turns ([`Up`]).

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{Up, assert_all_allowed, connect, ip_in_node, ok, probe_all, subnet, try_apply};
use weft_e2e::wait;

fn pod_ip(name: &str) -> String {
    ok(&["pods"])
        .lines()
        .find(|l| l.starts_with(&format!("default/{name} ")))
        .and_then(|l| l.split_whitespace().nth(2))
        .unwrap_or_default()
        .to_owned()
}

fn condition(subnet: &Value, type_: &str) -> Option<(String, String)> {
    subnet["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_).map(|c| {
        (c["status"].as_str().unwrap_or_default().to_owned(), c["message"].as_str().unwrap_or_default().to_owned())
    })
}

/// Pings `target` from pod `from` every 10 ms while node-1's agent is
/// killed and node-2's stopped and restarted: not one echo may go missing.
#[track_caller]
fn assert_no_loss_across_agent_restarts(from: &str, target: &str) {
    let ping = Command::new("ip")
        .args(["netns", "exec", &format!("weft-sbx-pod-default-{from}"), "ping", "-q", "-i", "0.01", "-c", "400"])
        .args(["-W", "1", target])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ping");
    ok(&["restart-agent", "node-1", "--kill"]);
    ok(&["restart-agent", "node-2"]);
    let out = ping.wait_with_output().expect("ping output");
    let summary = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("traffic across agent restarts: {}", summary.lines().find(|l| l.contains("loss")).unwrap_or(""));
    assert!(summary.contains(" 0% packet loss"), "packets lost across agent restarts:\n{summary}");
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
    assert!(ip_in_node("node-1", &["-d", "link", "show", "weft.1"]).contains("vxlan id 1"));

    // A node added later is reachable without restarting the others.
    let added = ok(&["add-node"]);
    assert!(added.starts_with("node-3"), "{added}");
    ok(&["add-pod", "c", "--node", "node-3", "-p", "80/tcp", "-p", "53/udp"]);
    assert_all_allowed(&probe_all("tcp", "80"));

    // Continuous traffic across nodes survives an agent restart on both ends.
    assert_no_loss_across_agent_restarts("a", &pod_ip("b"));
    assert_all_allowed(&probe_all("tcp", "80"));

    // A deleted node's route, neighbour and FDB entries disappear everywhere.
    let s3 = subnet("node-3");
    let cidr3 = s3["spec"]["cidr"].as_str().expect("cidr").to_owned();
    let mac3 = s3["status"]["vtepMAC"].as_str().expect("vtepMAC").to_owned();
    assert!(ip_in_node("node-1", &["route"]).contains(&cidr3));
    ok(&["del-node", "node-3"]);
    for node in ["node-1", "node-2"] {
        wait::until(&format!("{node} to forget node-3"), Duration::from_secs(30), || {
            let gone = !ip_in_node(node, &["route"]).contains(&cidr3)
                && !ip_in_node(node, &["neigh", "show", "dev", "weft.1"]).contains(&mac3)
                && !ip_in_node(node, &["link", "show"]).is_empty()
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

    // Bad peer data is reported in a condition, not a crash. node-2's agent
    // is stopped meanwhile: a running one puts its real MAC back at once.
    let paused = weft_e2e::sandbox::testing::PausedAgent::new("node-2");
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
    // node-2's agent, running again, announces its real MAC by itself.
    drop(paused);
    wait::until("node-1's peers programmed again", Duration::from_secs(30), || {
        matches!(condition(&subnet("node-1"), "PeersProgrammed"), Some((s, _)) if s == "True").then_some(())
    });
    assert_all_allowed(&probe_all("tcp", "80"));

    // A Subnet overlapping node-1's lease, injected while node-1 has pods:
    // the newer one is withdrawn and let go; node-1 keeps its lease.
    let lease1 = subnet("node-1");
    let cidr1 = lease1["spec"]["cidr"].as_str().expect("cidr").to_owned();
    let ghost = format!(
        "apiVersion: weft.dev/v1alpha1\nkind: Subnet\nmetadata: {{name: ghost}}\nspec: {{nodeName: ghost, cidr: {cidr1}}}\n"
    );
    let (applied, out) = weft_e2e::sandbox::testing::try_apply(&ghost);
    assert!(applied, "{out}");
    wait::until("the injected overlapping Subnet to be let go", Duration::from_secs(30), || {
        (!ok(&["kubectl", "get", "subnets", "-o", "name"]).contains("ghost")).then_some(())
    });
    assert_eq!(subnet("node-1")["metadata"]["uid"], lease1["metadata"]["uid"], "node-1's lease was replaced");
    assert_all_allowed(&probe_all("tcp", "80"));
}

#[test]
fn host_gw_cluster_routes_via_node_ips() {
    let Some(_up) = Up::start(&["--nodes", "2", "--backend", "host-gw"], &[]) else { return };
    ok(&["add-pod", "a", "--node", "node-1"]);
    ok(&["add-pod", "b", "--node", "node-2"]);
    assert_all_allowed(&probe_all("tcp", "80"));
    let cidr2 = subnet("node-2")["spec"]["cidr"].as_str().expect("cidr").to_owned();
    let routes = ip_in_node("node-1", &["route"]);
    assert!(routes.contains(&format!("{cidr2} via 10.250.0.12")), "{routes}");
    assert!(!ip_in_node("node-1", &["link", "show"]).contains("weft.1"), "host-gw needs no VXLAN device");
}

#[test]
fn routed_pods_reach_each_other_their_host_ports_and_meet_policy() {
    let args = ["--nodes", "2", "--backend", "host-gw", "--agent-arg=--pod-attachment=routed"];
    let Some(_up) = Up::start(&args, &[]) else { return };
    let host_port = ["-a", "weft.dev/host-ports=http"];
    ok(&[&["add-pod", "a", "--node", "node-1", "-l", "app=a", "-p", "80/tcp", "-p", "http=8080/tcp"][..], &host_port]
        .concat());
    ok(&["add-pod", "b", "--node", "node-1", "-l", "app=b"]);
    ok(&["add-pod", "c", "--node", "node-2", "-l", "app=c"]);
    // Same node and across nodes, every way.
    assert_all_allowed(&probe_all("tcp", "80"));

    // No bridge hop: node-1 routes to each of its pods on a host veth of its own.
    let a = pod_ip("a");
    let route = ip_in_node("node-1", &["route", "show", &format!("{a}/32")]);
    assert!(route.contains("dev weftv") && route.contains("scope link"), "{route}");
    assert!(
        !ip_in_node("node-1", &["link", "show", "master", "weft0"]).contains("weftv"),
        "a host veth is a bridge port"
    );

    // The host port answers from the other node, the pod's node, a pod on
    // each node and the pod itself (hairpin, routed back out of its own veth).
    let address = wait::until("a's host port annotation", Duration::from_secs(30), || {
        let out = ok(&[
            "kubectl",
            "get",
            "pod",
            "a",
            "-o",
            r"jsonpath={.metadata.annotations.weft\.dev/host-port-addresses}",
        ]);
        let v: Value = serde_json::from_str(out.trim()).ok()?;
        v["8080/TCP"].as_str().map(str::to_owned)
    });
    assert!(address.starts_with("10.250.0.11:"), "{address}");
    for from in ["node-2", "node-1", "default/b", "default/c", "default/a"] {
        assert_eq!(connect(from, "tcp", &address).as_deref(), Some("default/a"), "{from} -> {address}");
    }

    // Traffic across nodes survives agent restarts: the routes are adopted.
    assert_no_loss_across_agent_restarts("c", &a);

    // Policy holds between routed pods of one node as across nodes: a admits c only.
    let (applied, out) = try_apply(
        "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: a-from-c, namespace: default}
spec:
  podSelector: {matchLabels: {app: a}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: c}}}]
",
    );
    assert!(applied, "kubectl apply failed:\n{out}");
    wait::until("b to be denied a while c and everything else stays allowed", Duration::from_secs(45), || {
        let m = probe_all("tcp", "80");
        let allowed = |from: &str, to: &str| m["matrix"][from][to] == Value::Bool(true);
        let expected = !allowed("default/b", "default/a")
            && allowed("default/c", "default/a")
            && allowed("default/a", "default/b")
            && allowed("default/b", "default/c");
        expected.then_some(())
    });
}

/// Runs `sh -c script` inside node-1's namespace (its own sysctls and nat table).
fn in_node_sh(script: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-node-1", "sh", "-c", script])
        .output()
        .expect("ip netns exec");
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn node_settings_undone_behind_the_agents_back_are_put_back() {
    let Some(_up) = Up::start(&["--nodes", "1", "--agent-arg=--resync-seconds=1"], &[]) else { return };
    ok(&["add-pod", "a", "--node", "node-1"]);
    let masquerade =
        || in_node_sh("nft list chain inet weft masquerade-postrouting | grep -c 'masquerade fully-random' || true");
    assert_ne!(masquerade(), "0", "no masquerade rules to begin with");

    // A `sysctl --system` and a firewall reload, as far as this node goes.
    in_node_sh(
        "echo 0 > /proc/sys/net/ipv4/ip_forward; echo 0 > /proc/sys/net/bridge/bridge-nf-call-iptables; \
         nft flush chain inet weft masquerade-postrouting",
    );
    assert_eq!(masquerade(), "0");
    wait::until("the agent to put the node settings back", Duration::from_secs(20), || {
        let back = in_node_sh("cat /proc/sys/net/ipv4/ip_forward") == "1"
            && in_node_sh("cat /proc/sys/net/bridge/bridge-nf-call-iptables") == "1"
            && masquerade() != "0";
        back.then_some(())
    });
    let metrics = in_node_sh("curl -s http://127.0.0.1:9646/metrics");
    for setting in ["ip_forward", "masquerade", "bridge_netfilter"] {
        let line = format!("weft_agent_node_setting_repairs_total{{setting=\"{setting}\"}} 1");
        assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
    }
}
