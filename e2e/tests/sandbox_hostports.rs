//! Host ports in the sandbox cluster: pods opting in with the
//! `weft.dev/host-ports` annotation or a spec `hostPort` are reachable at
//! `nodeIP:hostPort` from other nodes, their own node, other pods and
//! themselves; allocations are unique, durable and leak nothing, whatever
//! happens to the Pod object, the API or the agent.
//!
//! One sandbox runs per machine, so these tests take turns ([`Up`]).

use std::collections::{BTreeMap, HashSet};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{Up, connect, ok, run};
use weft_e2e::wait;

const NODE1_IP: &str = "10.250.0.11";
const NODE2_IP: &str = "10.250.0.12";

/// The pod's `weft.dev/host-port-addresses` annotation once it is there.
fn addresses(pod: &str) -> BTreeMap<String, String> {
    wait::until(&format!("the host port annotation on {pod}"), Duration::from_secs(30), || {
        let (ok, out) = run(&[
            "kubectl",
            "get",
            "pod",
            pod,
            "-o",
            r"jsonpath={.metadata.annotations.weft\.dev/host-port-addresses}",
        ]);
        if !ok || out.trim().is_empty() {
            return None;
        }
        serde_json::from_str(out.trim()).ok()
    })
}

fn port_of(address: &str) -> u16 {
    address.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or_else(|| panic!("bad address {address}"))
}

#[track_caller]
fn assert_reaches(from: &str, protocol: &str, target: &str, pod: &str) {
    assert_eq!(connect(from, protocol, target).as_deref(), Some(pod), "{from} -> {target}/{protocol}");
}

/// Weft's per-mapping host port rules (mark and DNAT) in a node's nftables table.
fn host_port_rules(node: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", &format!("weft-sbx-{node}"), "nft", "list", "table", "inet", "weft"])
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| l.contains("dnat ip to") || l.contains("meta mark set"))
        .map(str::to_owned)
        .collect()
}

fn in_node(node: &str, cmd: &[&str]) -> bool {
    Command::new("ip").args(["netns", "exec", &format!("weft-sbx-{node}")]).args(cmd).status().expect("run").success()
}

/// A process listening on a TCP port in a node's namespace (stopped, and
/// its ready file removed, on drop).
struct HostListener(std::process::Child, std::path::PathBuf);

impl HostListener {
    fn start(node: &str, port: u16) -> Self {
        let ready = std::env::temp_dir().join(format!("weft-host-listener-{}", std::process::id()));
        let _ = std::fs::remove_file(&ready);
        let child = Command::new("ip")
            .args(["netns", "exec", &format!("weft-sbx-{node}")])
            .arg(weft_e2e::bins::weft("weft-sandbox"))
            .args(["respond", "--name", "host-process", &format!("--port={port}/tcp"), "--ready-file"])
            .arg(&ready)
            .spawn()
            .expect("host listener");
        // Owned from here: a failed wait still stops the process and removes the file.
        let listener = HostListener(child, ready);
        wait::until("the host listener", Duration::from_secs(10), || listener.1.exists().then_some(()));
        listener
    }
}

impl Drop for HostListener {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(&self.1);
    }
}

fn allocations() -> Vec<Value> {
    let out = ok(&["kubectl", "get", "hostportallocations", "-A", "-o", "json"]);
    serde_json::from_str::<Value>(&out).expect("JSON")["items"].as_array().cloned().unwrap_or_default()
}

fn allocation_of(pod: &str) -> Option<Value> {
    allocations().into_iter().find(|a| a["spec"]["podRef"]["name"] == pod)
}

#[test]
fn host_ports_reach_pods_from_everywhere_and_survive_agent_restarts() {
    let Some(_up) = Up::start(&["--nodes", "2", "--agent-arg=--resync-seconds=1"], &[]) else { return };
    // A host process on node-1 holds the first port of the range: it is skipped.
    let _host_process = HostListener::start("node-1", 20000);
    ok(&[
        "add-pod",
        "web",
        "--node",
        "node-1",
        "-p",
        "http=8080/tcp",
        "-p",
        "admin=9090/tcp",
        "-p",
        "dns=53/udp",
        "-a",
        "weft.dev/host-ports=http, admin, dns",
    ]);
    ok(&["add-pod", "neighbour", "--node", "node-1"]);
    ok(&["add-pod", "client", "--node", "node-2"]);

    let addrs = addresses("web");
    assert_eq!(addrs.keys().collect::<Vec<_>>(), ["53/UDP", "8080/TCP", "9090/TCP"], "{addrs:?}");
    let http = addrs["8080/TCP"].clone();
    let admin = addrs["9090/TCP"].clone();
    let dns = addrs["53/UDP"].clone();
    assert!(http.starts_with(&format!("{NODE1_IP}:")) && admin.starts_with(&format!("{NODE1_IP}:")));
    assert_ne!(port_of(&http), port_of(&admin), "two TCP ports, two host ports");
    for a in [&http, &admin, &dns] {
        assert!((20000..=29999).contains(&port_of(a)), "default range: {a}");
    }
    assert_ne!(port_of(&http), 20000, "a port a host process listens on was handed out");
    assert_eq!(connect("node-2", "tcp", &format!("{NODE1_IP}:20000")).as_deref(), Some("host-process"));

    // From another node, the pod's own node, a pod on each node, and the pod itself (hairpin).
    for from in ["node-2", "node-1", "default/client", "default/neighbour", "default/web"] {
        assert_reaches(from, "tcp", &http, "default/web");
        assert_reaches(from, "tcp", &admin, "default/web");
        assert_reaches(from, "udp", &dns, "default/web");
    }

    // The allocation is visible in the API with useful columns.
    let alloc = wait::until("web's HostPortAllocation with status", Duration::from_secs(30), || {
        allocation_of("web").filter(|a| a["status"]["addresses"].as_array().is_some_and(|x| x.len() == 3))
    });
    assert_eq!(alloc["spec"]["nodeName"], "node-1");
    assert_eq!(alloc["spec"]["nodeIP"], NODE1_IP);
    assert_eq!(alloc["metadata"]["labels"]["weft.dev/node"], "node-1");
    let table = ok(&["kubectl", "get", "hostportallocations", "-o", "wide"]);
    assert!(table.contains("ADDRESSES") && table.contains(&format!("{http}/TCP")), "{table}");
    let conditions = alloc["status"]["conditions"].as_array().cloned().unwrap_or_default();
    assert!(conditions.iter().any(|c| c["type"] == "PodAnnotated" && c["status"] == "True"), "{alloc}");

    // A spec hostPort, passed as runtimeConfig.portMappings, works without portmap.
    ok(&["add-pod", "fixed", "--node", "node-2", "-p", "80/tcp", "--host-port", "8088:80/tcp"]);
    assert_reaches("node-1", "tcp", &format!("{NODE2_IP}:8088"), "default/fixed");
    assert_reaches("default/web", "tcp", &format!("{NODE2_IP}:8088"), "default/fixed");
    let fixed = wait::until("fixed's HostPortAllocation", Duration::from_secs(30), || allocation_of("fixed"));
    assert_eq!(fixed["spec"]["ports"][0]["hostPort"], 8088);
    assert_eq!(fixed["spec"]["ports"][0]["automatic"], false);
    // The same spec hostPort on the same node is refused with a clear error.
    let (success, out) = run(&["add-pod", "clash", "--node", "node-2", "-p", "80/tcp", "--host-port", "8088:80/tcp"]);
    assert!(
        !success && out.contains("\"code\":105") && out.contains("8088/TCP is already used by pod default/fixed"),
        "{out}"
    );

    // Agent restarts (clean and kill -9) keep allocations, rules and traffic.
    let rules_before = host_port_rules("node-1");
    assert_eq!(rules_before.len(), 6, "{rules_before:?}");
    for kill in [false, true] {
        let mut args = vec!["restart-agent", "node-1"];
        if kill {
            args.push("--kill");
        }
        ok(&args);
        assert_reaches("node-2", "tcp", &http, "default/web");
        wait::until("the agent to serve again", Duration::from_secs(30), || {
            run(&["add-pod", &format!("after-{kill}"), "--node", "node-1", "-a", "weft.dev/host-ports=80"])
                .0
                .then_some(())
        });
        let mut rules = host_port_rules("node-1");
        rules.retain(|r| !r.contains("default/after-"));
        assert_eq!(rules, rules_before, "restart changed the rules");
        let newer = addresses(&format!("after-{kill}"));
        let port = port_of(&newer["80/TCP"]);
        assert!(port != port_of(&http) && port != port_of(&admin), "a port in use was handed out again: {port}");
    }
    assert_reaches("default/client", "udp", &dns, "default/web");

    // Others' rules in iptables and in a table of their own, and someone
    // emptying Weft's host port map: the map is repaired, their rules stay.
    assert!(in_node("node-1", &["iptables", "-t", "nat", "-N", "OTHER-COMPONENT"]));
    assert!(in_node("node-1", &["iptables", "-t", "nat", "-A", "PREROUTING", "-j", "OTHER-COMPONENT"]));
    assert!(in_node(
        "node-1",
        &[
            "nft",
            "add table ip other; add chain ip other pre { type nat hook prerouting priority -100; }; add rule ip other pre tcp dport 1 counter"
        ]
    ));
    assert!(in_node("node-1", &["nft", "flush", "map", "inet", "weft", "hostport-ports"]));
    wait::until("the periodic sync to repair the host port rules", Duration::from_secs(30), || {
        (connect("node-2", "tcp", &http).as_deref() == Some("default/web")).then_some(())
    });
    let save = Command::new("ip").args(["netns", "exec", "weft-sbx-node-1", "iptables-save", "-t", "nat"]).output();
    let save = String::from_utf8_lossy(&save.expect("iptables-save").stdout).into_owned();
    assert!(save.contains("-A PREROUTING -j OTHER-COMPONENT"), "another component's rule was touched:\n{save}");
    let other =
        Command::new("ip").args(["netns", "exec", "weft-sbx-node-1", "nft", "list", "table", "ip", "other"]).output();
    let other = String::from_utf8_lossy(&other.expect("nft").stdout).into_owned();
    assert!(other.contains("tcp dport 1 counter"), "another component's table was touched:\n{other}");
    // (Once, a single request here got no answer at all in CI: ask until
    // one comes, so that a failure says what the agent counted.)
    let metrics = wait::until("node-1's agent to answer /metrics", Duration::from_secs(30), || {
        let args = ["netns", "exec", "weft-sbx-node-1", "curl", "-sf", "-m", "5", "http://127.0.0.1:9646/metrics"];
        let out = Command::new("ip").args(args).output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.contains("weft_agent_").then_some(text)
    });
    assert!(metrics.contains("weft_agent_host_port_rule_repairs_total 1"), "{metrics}");
    assert!(metrics.contains("weft_agent_host_ports{state=\"allocated\"} 5"), "{metrics}");
}

#[test]
fn host_ports_are_unique_freed_and_never_leaked() {
    // 55 ports: 50 pods fill most of node-2's range.
    let Some(_up) = Up::start(&["--nodes", "2", "--agent-arg=--host-port-range=20000-20054"], &[]) else { return };

    // 50 pods on one node, 10 ADDs at a time: 50 distinct ports.
    let names: Vec<String> = (0..50).map(|i| format!("rep-{i}")).collect();
    for chunk in names.chunks(10) {
        std::thread::scope(|s| {
            for name in chunk {
                s.spawn(move || ok(&["add-pod", name, "--node", "node-2", "-a", "weft.dev/host-ports=80"]));
            }
        });
    }
    let ports: HashSet<u16> = names.iter().map(|n| port_of(&addresses(n)["80/TCP"])).collect();
    assert_eq!(ports.len(), 50, "ports handed out twice: {ports:?}");
    assert!(ports.iter().all(|p| (20000..=20054).contains(p)));
    assert_eq!(host_port_rules("node-2").len(), 100);
    wait::until("50 HostPortAllocations with the node's pool usage", Duration::from_secs(60), || {
        let all = allocations();
        (all.len() == 50 && all.iter().all(|a| a["status"]["nodePool"]["summary"] == "50/55")).then_some(())
    });

    // Exhaustion: a clear CNI error, an Event on the pod, nothing left behind.
    let greedy_ports = ["-p", "1/tcp", "-p", "2/tcp", "-p", "3/tcp", "-p", "4/tcp", "-p", "5/tcp", "-p", "6/tcp"];
    let mut args = vec!["add-pod", "greedy", "--node", "node-2", "-a", "weft.dev/host-ports=1,2,3,4,5,6"];
    args.extend_from_slice(&greedy_ports);
    let (success, out) = run(&args);
    assert!(
        !success && out.contains("\"code\":104") && out.contains("no free TCP host port left in 20000-20054"),
        "{out}"
    );
    let event = wait::until("an Event on the pod", Duration::from_secs(30), || {
        let events = ok(&["kubectl", "get", "events", "--field-selector", "involvedObject.name=greedy", "-o", "json"]);
        let events: Value = serde_json::from_str(&events).ok()?;
        events["items"].as_array().and_then(|e| e.first()).cloned()
    });
    assert_eq!(event["reason"], "HostPortsExhausted", "{event}");
    assert!(event["message"].as_str().unwrap_or_default().contains("20000-20054"), "{event}");
    assert_eq!(host_port_rules("node-2").len(), 100, "a failed ADD left rules behind");
    assert!(allocation_of("greedy").is_none());

    // The annotation only works in namespaces a cluster admin opened: pod
    // authors elsewhere cannot take node ports with it.
    ok(&["kubectl", "create", "namespace", "closed"]);
    let (success, out) =
        run(&["add-pod", "sneaky", "-n", "closed", "--node", "node-2", "-a", "weft.dev/host-ports=80"]);
    assert!(
        !success
            && out.contains("\"code\":7")
            && out.contains("namespace closed does not allow automatic host ports")
            && out.contains("kubectl label namespace closed weft.dev/host-ports=allowed"),
        "{out}"
    );
    let event = wait::until("an Event on the refused pod", Duration::from_secs(30), || {
        let events = ok(&["kubectl", "get", "events", "-n", "closed", "-o", "json"]);
        let events: Value = serde_json::from_str(&events).ok()?;
        events["items"].as_array().and_then(|e| e.iter().find(|e| e["involvedObject"]["name"] == "sneaky")).cloned()
    });
    assert_eq!(event["reason"], "HostPortsNotAllowed", "{event}");
    assert_eq!(host_port_rules("node-2").len(), 100, "a refused ADD left rules behind");
    ok(&["kubectl", "label", "namespace", "closed", "weft.dev/host-ports=allowed"]);
    ok(&["add-pod", "opened", "-n", "closed", "--node", "node-2", "-a", "weft.dev/host-ports=80"]);
    assert_eq!(host_port_rules("node-2").len(), 102, "the opted-in namespace's pod got its port");
    ok(&["del-pod", "opened", "-n", "closed"]);

    // Deleting pods removes their rules and frees their ports for reuse.
    for name in &names[..10] {
        ok(&["del-pod", name]);
    }
    assert_eq!(host_port_rules("node-2").len(), 80);
    wait::until("deleted pods' HostPortAllocations to go", Duration::from_secs(30), || {
        (allocations().len() == 40).then_some(())
    });
    args[1] = "greedy2";
    ok(&args);
    let reused: HashSet<u16> = addresses("greedy2").values().map(|a| port_of(a)).collect();
    assert_eq!(reused.len(), 6);
    assert!(reused.iter().any(|p| ports.contains(p)), "freed ports are reused: {reused:?}");

    // DEL after the Pod object is gone: succeeds and leaves nothing.
    ok(&["kubectl", "delete", "pod", "rep-10", "--grace-period=0", "--force", "--wait=true"]);
    ok(&["del-pod", "rep-10"]);
    assert!(!host_port_rules("node-2").iter().any(|r| r.contains("default/rep-10 ")));

    // DEL with the API down: needs only the agent's record.
    ok(&["api-pause"]);
    let del = run(&["del-pod", "rep-11", "--keep-object"]);
    ok(&["api-resume"]);
    assert!(del.0, "DEL with the API paused failed: {}", del.1);
    assert!(!host_port_rules("node-2").iter().any(|r| r.contains("default/rep-11 ")));
    // The agent's records (its IPAM records carry the host ports).
    let records = std::fs::read_dir("/run/weft-sandbox/node-2/state/ipam")
        .expect("records")
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .filter(|r| r.contains("\"hostPorts\""))
        .count();
    assert_eq!(records, 38 + 1, "38 replicas left and greedy2");
    // Once the API is back, the stale objects go too (agent and operator).
    wait::until("rep-10 and rep-11's allocations to go", Duration::from_secs(60), || {
        (allocation_of("rep-10").is_none() && allocation_of("rep-11").is_none()).then_some(())
    });
    ok(&["kubectl", "delete", "pod", "rep-11", "--grace-period=0", "--force", "--wait=true"]);
}
