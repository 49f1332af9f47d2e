//! Weft on real nodes with the VXLAN backend: kubelet and containerd exec
//! weft-cni, Weft installed by `helm install charts/weft` from images built
//! on this machine. One cluster for the whole binary; the steps run in order
//! because later ones change the cluster (agent hung, helm upgrade, a node
//! replaced, helm uninstall).

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use weft_api::host_port::{NAMESPACE_OPT_IN_LABEL, NAMESPACE_OPT_IN_VALUE};
use weft_e2e::cluster::configs::ProxyMode;
use weft_e2e::cluster::node;
use weft_e2e::cluster::testing::{Cluster, apply, eventually, kubectl, kubectl_ok, node_exec, ok, pod_exec};
use weft_e2e::cluster::workloads::{HTTP_PORT, TestPod, delete_pods, http_hostname, namespace, wait_running};
use weft_e2e::supervisor::StateFile;

const NS: &str = "weft-e2e";

/// One step of the scenario: what it shows, and the function that shows it.
type Step = (&'static str, fn(&Cluster));

#[test]
fn weft_on_real_nodes_with_vxlan() {
    let Some(cluster) = Cluster::shared(&["--backend", "vxlan"]) else { return };
    let steps: &[Step] = &[
        ("each node has its own hostname, which its hostNetwork pods share", hostnames),
        ("pods reach each other across and within nodes (TCP, UDP), a Service reaches both nodes", connectivity),
        ("spec hostPort and weft.dev/host-ports reachable from the other node", host_ports),
        ("standard and weft.dev NetworkPolicies enforced by the agent image, explained and recorded", policies),
        ("every node's flows through the Kubernetes API, each caller seeing only what RBAC lets it", flows_api),
        ("a hostile pod gets past no policy (link-local, spoofed sources, its first packets)", hostile),
        ("deleted pods leave no address, veth or host-port rule", nothing_leaks),
        ("a hung agent makes its node NotReady through CNI STATUS, and it recovers", status_follows_the_agent),
        ("helm upgrade restarts the agents with traffic flowing, no packet lost", upgrade_without_loss),
        ("a Node object deleted and registered again keeps its lease and its pods' traffic", node_registers_again),
        ("a node deleted and a new one added: Subnet released and leased, pods reach the others", replace_node),
        ("helm uninstall leaves no Weft objects", uninstall),
    ];
    namespace(NS, &[(NAMESPACE_OPT_IN_LABEL, NAMESPACE_OPT_IN_VALUE)]);
    for (what, step) in steps {
        let started = Instant::now();
        eprintln!("--- step: {what}");
        step(cluster);
        eprintln!("--- ok ({:.1} s): {what}", started.elapsed().as_secs_f64());
    }
}

fn pod<'a>(name: &'a str, node: &'a str, labels: &'a [(&'a str, &'a str)]) -> TestPod<'a> {
    TestPod { namespace: NS, name, node, labels, annotations: &[], host_port: None, capabilities: &[] }
}

fn hostnames(_: &Cluster) {
    for node in ["node-1", "node-2"] {
        let (ran, name) = node_exec(node, &["hostname"]);
        assert!(ran && name.trim() == node, "{node} calls itself {name:?}");
        // The agent runs with hostNetwork: it shares the node's UTS namespace.
        let name = in_agent(node, &["hostname"]);
        assert_eq!(name.trim(), node, "the agent pod on {node} calls itself {name:?}");
    }
}

fn connectivity(cluster: &Cluster) {
    // Before Weft was installed no node was Ready: containerd's STATUS had
    // no network; Ready came with Weft (Cluster::shared waited for it).
    let before = &cluster.state().ready_before_weft;
    assert_eq!(before.len(), 2, "{before:?}");
    for (node, status, message) in before {
        assert_eq!(status, "False", "{node} was Ready before Weft was installed: {message}");
        assert!(message.to_lowercase().contains("network"), "{node} NotReady for another reason: {message}");
    }
    let service_ip = weft_e2e::cluster::workloads::pods_and_a_service_connect(NS);
    // kube-proxy programs its own nftables table on every node, beside
    // Weft's; the Service above went through it.
    if ProxyMode::from_env() == Ok(ProxyMode::Nftables) {
        for node in ["node-1", "node-2"] {
            let (listed, proxy) = node_exec(node, &["nft", "list", "table", "ip", "kube-proxy"]);
            assert!(listed && proxy.contains(&service_ip), "{node}: kube-proxy's table lacks {service_ip}:\n{proxy}");
            let (listed, weft) = node_exec(node, &["nft", "list", "table", "inet", "weft"]);
            assert!(listed && weft.contains("chain masquerade-postrouting"), "{node}: Weft's table:\n{weft}");
        }
    }
}

fn host_ports(cluster: &Cluster) {
    let state = cluster.state();
    let node1 = state.node("node-1").expect("node-1").ip;
    let fixed = TestPod { host_port: Some(18088), ..pod("fixed", "node-1", &[]) };
    fixed.run();
    let answer = eventually("spec hostPort 18088 from node-2", Duration::from_secs(30), || {
        curl_from_node("node-2", &format!("{node1}:18088"))
    });
    assert_eq!(answer, "fixed");

    let auto = TestPod { annotations: &[("weft.dev/host-ports", "http")], ..pod("auto", "node-1", &[]) };
    auto.run();
    let addresses = eventually("weft.dev/host-port-addresses on the pod", Duration::from_secs(60), || {
        let (ok, out) = kubectl(&[
            "get",
            "pod",
            "-n",
            NS,
            "auto",
            "-o",
            r"jsonpath={.metadata.annotations.weft\.dev/host-port-addresses}",
        ]);
        (ok && !out.trim().is_empty()).then(|| out.trim().to_owned())
    });
    let map: std::collections::BTreeMap<String, String> =
        serde_json::from_str(&addresses).unwrap_or_else(|e| panic!("bad annotation {addresses:?}: {e}"));
    let address = map.get(&format!("{HTTP_PORT}/TCP")).unwrap_or_else(|| panic!("no {HTTP_PORT}/TCP in {map:?}"));
    assert!(address.starts_with(&format!("{node1}:")), "{address} is not on node-1's address");
    let answer = eventually("the automatic host port from node-2", Duration::from_secs(30), || {
        curl_from_node("node-2", address)
    });
    assert_eq!(answer, "auto");
}

/// Runs `command` in the agent container of `node`'s Weft agent pod.
fn in_agent(node: &str, command: &[&str]) -> String {
    let agent = weft_pods("agent", Some(node), "{.items[0].metadata.name}");
    let mut args = vec!["exec", "-n", "kube-system", &agent, "-c", "agent", "--"];
    args.extend_from_slice(command);
    kubectl_ok(&args)
}

/// `weft flows <args> -o json` in `node`'s agent pod (flows are on by
/// default in the chart): the node's records, parsed.
fn flows(node: &str, args: &[&str]) -> Vec<Value> {
    let mut command = vec!["weft", "flows"];
    command.extend_from_slice(args);
    command.extend_from_slice(&["-o", "json"]);
    let out = in_agent(node, &command);
    out.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
}

/// The newest record at `node` of `event` from pod `from` to pod `to` (names in [`NS`]).
fn flow(node: &str, event: &str, verdict: &str, from: &str, to: &str) -> Option<Value> {
    let end = |r: &Value, side: &str| {
        r[side]["namespace"].as_str() == Some(NS)
            && r[side]["pod"].as_str() == Some(if side == "source" { from } else { to })
    };
    let pod = format!("{NS}/{from}");
    let records = flows(node, &["--pod", &pod, "--verdict", verdict]);
    records.into_iter().rev().find(|r| r["event"] == event && end(r, "source") && end(r, "destination"))
}

/// `weft explain` from the test host with the cluster's kubeconfig: the
/// policies as the apiserver has them, no packet sent.
fn explain(cluster: &Cluster, from: &str, to: &str) -> Value {
    let out = std::process::Command::new(weft_e2e::bins::weft("weft"))
        .env("KUBECONFIG", &cluster.state().kubeconfig)
        .args(["explain", "--from", &format!("{NS}/{from}"), "--to", &format!("{NS}/{to}")])
        .args(["--port", &format!("{HTTP_PORT}/TCP"), "-o", "json"])
        .output()
        .expect("weft runs");
    assert!(out.status.success(), "weft explain: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// `GET /hostname` from inside a node (its network namespace).
fn curl_from_node(node: &str, target: &str) -> Option<String> {
    let url = format!("http://{target}/hostname");
    let (ok, out) = node_exec(node, &["curl", "-s", "--max-time", "3", &url]);
    ok.then(|| out.trim().to_owned()).filter(|s| !s.is_empty())
}

fn policies(cluster: &Cluster) {
    let server = pod("server", "node-1", &[("app", "server")]).run();
    pod("client", "node-2", &[("role", "client")]).run();
    pod("other", "node-2", &[("role", "other")]).run();
    let target = format!("{server}:{HTTP_PORT}");
    let reaches = |from: &str| http_hostname(NS, from, &target).is_some();
    assert!(reaches("client") && reaches("other"), "server must be open before any policy");

    apply(&format!(
        r#"apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: server-from-clients, namespace: {NS}}}
spec:
  podSelector: {{matchLabels: {{app: server}}}}
  ingress:
  - from: [{{podSelector: {{matchLabels: {{role: client}}}}}}]
    ports: [{{port: http}}]
"#
    ));
    eventually("the standard policy to drop other → server", Duration::from_secs(30), || {
        (!reaches("other")).then_some(())
    });
    assert!(reaches("client"), "client is admitted by the standard policy");

    // `weft explain` says what the datapath just did, from the API's objects.
    let policy = format!("{NS}/server-from-clients");
    let other = explain(cluster, "other", "server");
    assert_eq!(other["allowed"], json!(false), "{other:#}");
    assert_eq!(other["ingress"]["decided"], json!({"by": "defaultDeny"}), "{other:#}");
    assert_eq!(other["ingress"]["selectedBy"], json!([policy]), "{other:#}");
    let client = explain(cluster, "client", "server");
    assert_eq!(client["allowed"], json!(true), "{client:#}");
    assert_eq!(client["ingress"]["decided"], json!({"by": "rule", "origin": policy, "rule": 0, "allow": true}));
    // And server's agent recorded both, naming the policy, within 2 s.
    assert!(!reaches("other"));
    let denied = eventually("other's refused connection recorded at node-1", Duration::from_secs(2), || {
        flow("node-1", "denied", "rejected", "other", "server")
    });
    assert_eq!(
        (denied["policy"].as_str(), denied["direction"].as_str()),
        (Some(&*policy), Some("ingress")),
        "{denied}"
    );
    assert!(reaches("client"));
    let opened = eventually("client's connection recorded at node-1", Duration::from_secs(2), || {
        flow("node-1", "opened", "forwarded", "client", "server")
    });
    assert_eq!((opened["policy"].as_str(), opened["rule"].as_i64()), (Some(&*policy), Some(0)), "{opened}");
    // `weft explain --probe` in the agent pod of other's node (node-2), with
    // the agent's own in-cluster identity: refused, as explained.
    let (from, to, port) = (format!("{NS}/other"), format!("{NS}/server"), format!("{HTTP_PORT}/TCP"));
    let probe = ["weft", "explain", "--from", &from, "--to", &to, "--port", &port, "--probe", "-o", "json"];
    let probed: Value = serde_json::from_str(&in_agent("node-2", &probe)).expect("JSON");
    assert_eq!(probed["probe"]["outcome"], "refused", "{probed:#}");
    assert_eq!((probed["allowed"].as_bool(), probed["probe"]["agrees"].as_bool()), (Some(false), Some(true)));

    apply(&format!(
        r#"apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {{name: deny-clients, namespace: {NS}}}
spec:
  podSelector: {{matchLabels: {{app: server}}}}
  priority: 100
  ingress:
  - action: Deny
    peers: [{{podSelector: {{matchLabels: {{role: client}}}}}}]
"#
    ));
    eventually("the weft.dev Deny to override the standard allow", Duration::from_secs(30), || {
        (!reaches("client")).then_some(())
    });
    let deny = format!("weft.dev/{NS}/deny-clients");
    let client = explain(cluster, "client", "server");
    assert_eq!(client["ingress"]["decided"], json!({"by": "rule", "origin": deny, "rule": 0, "allow": false}));
    let denied = eventually("client's refused connection recorded at node-1", Duration::from_secs(2), || {
        flow("node-1", "denied", "rejected", "client", "server")
    });
    assert_eq!(denied["policy"].as_str(), Some(&*deny), "{denied}");
    kubectl_ok(&["delete", "networkpolicies.weft.dev", "-n", NS, "deny-clients"]);
    kubectl_ok(&["delete", "networkpolicies.networking.k8s.io", "-n", NS, "server-from-clients"]);
    eventually("both policies gone: other reaches server again", Duration::from_secs(30), || {
        (reaches("other") && reaches("client")).then_some(())
    });
}

/// Weft's host veths, IPAM records and host-port rules on a node.
/// `jsonpath` over Weft's kube-system pods of `component` (on `node`, if given).
fn weft_pods(component: &str, node: Option<&str>, jsonpath: &str) -> String {
    let selector = format!("app.kubernetes.io/component={component}");
    let mut args = vec!["get", "pods", "-n", "kube-system", "-l", &selector];
    let field = node.map(|n| format!("spec.nodeName={n}"));
    if let Some(f) = &field {
        args.extend_from_slice(&["--field-selector", f]);
    }
    let output = format!("jsonpath={jsonpath}");
    args.extend_from_slice(&["-o", &output]);
    kubectl_ok(&args).trim().to_owned()
}

/// `weft flows -o json <args>` from the test host with `kubeconfig`: the
/// records and what it said on stderr (nodes that did not answer), or the error.
fn flows_and_warnings(kubeconfig: &std::path::Path, args: &[&str]) -> Result<(Vec<Value>, String), String> {
    let out = std::process::Command::new(weft_e2e::bins::weft("weft"))
        .env("KUBECONFIG", kubeconfig)
        .env_remove("WEFT_AGENT_SOCKET")
        .args(["flows", "-o", "json"])
        .args(args)
        .output()
        .expect("weft runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(stderr);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok((text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect(), stderr))
}

/// [`flows_and_warnings`]'s records; its warnings go to the test's log.
fn flows_through_api(kubeconfig: &std::path::Path, args: &[&str]) -> Result<Vec<Value>, String> {
    let (records, warnings) = flows_and_warnings(kubeconfig, args)?;
    if !warnings.is_empty() {
        eprintln!("    weft flows {args:?}: {}", warnings.trim());
    }
    Ok(records)
}

/// The gRPC status an agent's flows listener gives a List sent from
/// `node` with `token` (None: no token), read from the response's headers.
fn agent_listener_status(node: &str, agent_ip: &str, token: Option<&str>) -> String {
    let url = format!("http://{agent_ip}:9654/weft.flows.v1.Flows/List");
    let auth = token.map(|t| format!("-H 'authorization: Bearer {t}'")).unwrap_or_default();
    // An empty ListRequest, framed: no compression, length 0.
    let script = format!(
        "printf '\\000\\000\\000\\000\\000' | curl -s -i --max-time 5 --http2-prior-knowledge \
         -H 'content-type: application/grpc' -H 'te: trailers' {auth} --data-binary @- {url}"
    );
    let (_, out) = node_exec(node, &["sh", "-c", &script]);
    // A refusal comes in the headers; an answer's status in the trailers,
    // which curl may not print: a 200 without a status there is an answer.
    match out.lines().find_map(|l| l.strip_prefix("grpc-status:")) {
        Some(status) => status.trim().to_owned(),
        None if out.starts_with("HTTP/2 200") => "0".to_owned(),
        None => format!("no gRPC status in: {out}"),
    }
}

/// A running `weft flows --follow -o json` through the API: its records
/// as they come; killed when dropped.
struct Follower {
    child: std::process::Child,
    records: std::sync::mpsc::Receiver<Value>,
}

impl Follower {
    fn start(kubeconfig: &std::path::Path, args: &[&str]) -> Follower {
        use std::io::BufRead;
        let mut child = std::process::Command::new(weft_e2e::bins::weft("weft"))
            .env("KUBECONFIG", kubeconfig)
            .env_remove("WEFT_AGENT_SOCKET")
            .args(["flows", "--follow", "-o", "json"])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("weft runs");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, records) = std::sync::mpsc::channel::<Value>();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(v) = serde_json::from_str(&line) else { continue };
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        Follower { child, records }
    }

    /// The next record that `wanted` admits, if one comes before `deadline`.
    fn next_until(&self, deadline: Instant, wanted: impl Fn(&Value) -> bool) -> Option<Value> {
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.records.recv_timeout(left) {
                Ok(r) if wanted(&r) => return Some(r),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `weft flows --follow` through the API with `kubeconfig` (alice's): a
/// connection made after it started arrives as it happens, from the node
/// that recorded it.
fn follow_through_api(kubeconfig: &std::path::Path, server: &str) {
    let pod = format!("{NS}/client");
    let follower = Follower::start(kubeconfig, &["-n", NS, "--pod", &pod, "--verdict", "forwarded"]);
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut found = None;
    while found.is_none() && Instant::now() < deadline {
        // One new connection a round, until one arrives (the follow may
        // still be opening its streams to the agents).
        assert!(http_hostname(NS, "client", &format!("{server}:{HTTP_PORT}")).is_some(), "client reaches server");
        found = follower.next_until(Instant::now() + Duration::from_secs(2), |r| {
            r["timeUnixMs"].as_u64() >= Some(since) && r["destination"]["pod"] == "server"
        });
    }
    let r = found.expect("a new connection of client's arrives through `weft flows --follow` within 20 s");
    assert_eq!(r["source"]["pod"], "client", "{r}");
}

fn flows_api(cluster: &Cluster) {
    const OTHER: &str = "weft-e2e-visitors";
    let admin = cluster.state().kubeconfig.clone();
    namespace(OTHER, &[]);
    TestPod { namespace: OTHER, ..pod("visitor", "node-2", &[]) }.run();
    let server = weft_e2e::cluster::workloads::placement(NS, "server").expect("server placed").0;
    assert!(
        http_hostname(OTHER, "visitor", &format!("{server}:{HTTP_PORT}")).is_some(),
        "no policy: visitor reaches server"
    );

    // The cluster admin, through the API: both nodes' records of visitor → server.
    let visitor = format!("{OTHER}/visitor");
    let mut last = String::new();
    let seen = weft_e2e::wait::try_until(Duration::from_secs(30), || {
        let records = match flows_through_api(&admin, &["--pod", &visitor]) {
            Ok(r) => r,
            Err(e) => {
                last = e;
                return None;
            }
        };
        let to_server: Vec<&Value> =
            records.iter().filter(|r| r["destination"]["pod"] == "server" && r["source"]["pod"] == "visitor").collect();
        let nodes: std::collections::BTreeSet<&str> = to_server.iter().filter_map(|r| r["node"].as_str()).collect();
        last = format!("{} records, {} of visitor → server, from {nodes:?}", records.len(), to_server.len());
        (nodes.len() == 2).then_some(to_server.len())
    });
    let Some(seen) = seen else {
        let (_, logs) =
            kubectl(&["logs", "-n", "kube-system", "-l", "app.kubernetes.io/component=operator", "--tail=30"]);
        panic!(
            "visitor → server not seen through the flows API from both nodes within 30 s: {last}\noperator:\n{logs}"
        );
    };
    assert!(seen >= 2);

    // alice may view weft-e2e only (the chart's reader role joins `view`).
    kubectl_ok(&["create", "rolebinding", "alice-views", "-n", NS, "--clusterrole=view", "--user=alice"]);
    eventually("view to include flows.weft.dev (role aggregation)", Duration::from_secs(30), || {
        let (_, out) = kubectl(&["auth", "can-i", "list", "flows.flows.weft.dev", "-n", NS, "--as", "alice"]);
        (out.trim() == "yes").then_some(())
    });
    let kubeconfig = std::fs::read_to_string(&admin).expect("kubeconfig");
    let alice_config = tempfile::NamedTempFile::new().expect("temp file");
    let alice_text = kubeconfig.replacen("    token:", "    as: alice\n    token:", 1);
    assert_ne!(alice_text, kubeconfig, "the kubeconfig has a token user");
    std::fs::write(alice_config.path(), alice_text).expect("write alice's kubeconfig");
    let alice = alice_config.path();
    let hers = flows_through_api(alice, &["-n", NS]).expect("alice lists weft-e2e's flows");
    assert!(!hers.is_empty(), "weft-e2e has flows");
    for r in &hers {
        let ends = [&r["source"], &r["destination"]];
        assert!(ends.iter().any(|e| e["namespace"] == NS), "a record without weft-e2e at either end: {r}");
        for e in ends {
            assert!(e["namespace"] == NS || (e["namespace"] == "" && e["pod"] == ""), "another namespace shown: {r}");
        }
    }
    assert!(
        hers.iter()
            .any(|r| r["destination"]["pod"] == "server" && r["source"]["address"] != "" && r["source"]["pod"] == ""),
        "visitor's connection is hers, without visitor's name"
    );
    follow_through_api(alice, &server);
    for forbidden in [vec!["-n", OTHER], vec![]] {
        let err = flows_through_api(alice, &forbidden).expect_err("alice may not read these flows");
        assert!(err.contains("forbidden"), "{forbidden:?}: {err}");
    }

    // Nobody reaches the flows past the apiserver: the operator's port
    // refuses a client without the front-proxy certificate, whatever
    // headers it sends ...
    let operator_ip = weft_pods("operator", None, "{.items[0].status.hostIP}");
    let url = format!("https://{operator_ip}:9648/apis/flows.weft.dev/v1alpha1/flows");
    let spoof =
        ["curl", "-sk", "--max-time", "5", "-H", "X-Remote-User: admin", "-H", "X-Remote-Group: system:masters", &url];
    let (ok, out) = node_exec("node-2", &spoof);
    assert!(
        !ok && !out.contains("FlowList"),
        "the flows API answered a client without the front-proxy certificate: {out}"
    );
    // ... and an agent answers only the operator's token for flows.weft.dev.
    let agent_ip = weft_pods("agent", Some("node-1"), "{.items[0].status.hostIP}");
    assert_eq!(agent_listener_status("node-2", &agent_ip, None), "16", "no token: unauthenticated");
    let agent_sa = weft_pods("agent", None, "{.items[0].spec.serviceAccountName}");
    let operator_sa = weft_pods("operator", None, "{.items[0].spec.serviceAccountName}");
    let token = |sa: &str, audience: &str| {
        kubectl_ok(&["create", "token", "-n", "kube-system", sa.trim(), "--audience", audience]).trim().to_owned()
    };
    let stolen = token(&agent_sa, "flows.weft.dev");
    assert_eq!(agent_listener_status("node-2", &agent_ip, Some(&stolen)), "7", "an agent's token: permission denied");
    let wrong_audience = token(&operator_sa, "https://kubernetes.default.svc.cluster.local");
    assert_eq!(agent_listener_status("node-2", &agent_ip, Some(&wrong_audience)), "16", "the operator's API token");
    let right = token(&operator_sa, "flows.weft.dev");
    assert_eq!(agent_listener_status("node-2", &agent_ip, Some(&right)), "0", "the operator's flows token");

    kubectl_ok(&["delete", "namespace", OTHER, "--timeout=120s"]);
    kubectl_ok(&["delete", "rolebinding", "-n", NS, "alice-views"]);
}

fn hostile(_: &Cluster) {
    weft_e2e::cluster::hostile::attacks_fail("weft-hostile");
}

fn node_footprint(cluster: &Cluster, node_name: &str) -> (usize, usize, String) {
    let state = cluster.state();
    let info = state.node(node_name).expect("node").clone();
    let (_, links) = node_exec(node_name, &["ip", "-o", "link", "show", "type", "veth"]);
    let veths = links.lines().filter(|l| l.contains(": weftv")).count();
    let records = node::host_view(&info, "/var/lib/weft/ipam")
        .ok()
        .and_then(|d| std::fs::read_dir(d).ok())
        .map(|d| d.filter_map(Result::ok).filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count())
        .unwrap_or(0);
    let (_, rules) = node_exec(node_name, &["nft", "list", "table", "inet", "weft"]);
    (veths, records, rules)
}

/// Pods outside the test namespace with an attachment on `node` (cluster
/// DNS): theirs are the only veths and records that may stay.
fn other_attached_pods(node: &str) -> usize {
    let json = kubectl_ok(&["get", "pods", "-A", "--field-selector", &format!("spec.nodeName={node}"), "-o", "json"]);
    let list: serde_json::Value = serde_json::from_str(&json).expect("pod list JSON");
    list["items"]
        .as_array()
        .map(|pods| {
            pods.iter().filter(|p| p["metadata"]["namespace"] != NS && p["spec"]["hostNetwork"] != true).count()
        })
        .unwrap_or(0)
}

fn nothing_leaks(cluster: &Cluster) {
    delete_pods(NS, &["a", "b", "c", "fixed", "auto", "server", "client", "other"]);
    for node in ["node-1", "node-2"] {
        let others = other_attached_pods(node);
        let (veths, records, rules) =
            eventually(&format!("{node} to drop its pods' attachments"), Duration::from_secs(30), || {
                let f = node_footprint(cluster, node);
                (f.0 == others && f.1 == others).then_some(f)
            });
        assert_eq!((veths, records), (others, others), "{others} pods of other namespaces on {node}");
        assert!(!rules.contains("18088") && !rules.contains("dnat ip to"), "host-port rules left on {node}:\n{rules}");
    }
}

/// The pid of weft-agent running on a node (in the node's cgroup).
fn agent_pid(cluster: &Cluster, node_name: &str) -> Option<i32> {
    let state = cluster.state();
    node::find_processes(state.node(node_name).ok()?, "weft-agent").first().copied()
}

fn node_ready(name: &str) -> Option<bool> {
    let (ok, out) = kubectl(&["get", "node", name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"]);
    ok.then(|| out.trim() == "True")
}

fn status_follows_the_agent(cluster: &Cluster) {
    let pid = eventually("weft-agent running on node-2", Duration::from_secs(30), || agent_pid(cluster, "node-2"));
    // A hung agent: it keeps its socket but answers nothing.
    // SAFETY: plain kill(2) of the agent process found in node-2.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // The flows API answers without it, in bounded time, and says which
    // node did not answer.
    let started = Instant::now();
    let (_, warnings) = flows_and_warnings(&cluster.state().kubeconfig, &["-n", NS]).expect("flows without node-2");
    assert!(warnings.contains("node node-2 did not answer"), "{warnings}");
    assert!(started.elapsed() < Duration::from_secs(15), "a hung agent held the flows API {:?}", started.elapsed());
    // A follow too: node-1's held records come through, node-2 left out.
    let follower = Follower::start(&cluster.state().kubeconfig, &["-n", NS]);
    let held = follower.next_until(Instant::now() + Duration::from_secs(15), |r| r["node"] == "node-1");
    assert!(held.is_some(), "a hung agent held up a follow through the flows API");
    drop(follower);
    eventually("node-2 NotReady once STATUS fails", Duration::from_secs(60), || {
        (node_ready("node-2") == Some(false)).then_some(())
    });
    let message =
        kubectl_ok(&["get", "node", "node-2", "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].message}"]);
    assert!(message.to_lowercase().contains("network"), "NotReady for another reason: {message}");
    // A pod for node-2 waits while the node is not ready.
    apply(&pod("late", "node-2", &[]).yaml());
    let (_, phase) = kubectl(&["get", "pod", "-n", NS, "late", "-o", "jsonpath={.status.phase}"]);
    assert_eq!(phase.trim(), "Pending", "a pod must not start on a node whose network is not ready");
    // kubelet's liveness probe restarts the hung agent; the node recovers.
    eventually("node-2 Ready again after the agent restarted", Duration::from_secs(180), || {
        (node_ready("node-2") == Some(true)).then_some(())
    });
    // SAFETY: as above; the stopped process may be gone already.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    wait_running(NS, "late");
    delete_pods(NS, &["late"]);
}

fn agent_pods() -> Vec<String> {
    let out = weft_pods("agent", None, "{.items[*].metadata.uid}");
    out.split_whitespace().map(str::to_owned).collect()
}

/// The output so far of the pings `upgrade_without_loss` runs in ping-src.
fn pings() -> String {
    pod_exec(NS, "ping-src", &["cat", PINGS]).1
}

/// The sequence number of every answer in ping's output, in order
/// (iputils prints `icmp_seq=1`, busybox `seq=0`).
fn answered(pings: &str) -> Vec<u64> {
    pings
        .lines()
        .filter(|l| l.contains(" bytes from "))
        .filter_map(|l| l.split("seq=").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect()
}

const PINGS: &str = "/tmp/pings";

fn upgrade_without_loss(cluster: &Cluster) {
    pod("ping-src", "node-1", &[]).run();
    let dst = pod("ping-dst", "node-2", &[]).run();
    let before = agent_pods();
    // Ten pings a second in the background of ping-src, for as long as the
    // rollout takes, then five seconds more.
    let (started, pid) = pod_exec(NS, "ping-src", &["sh", "-c", &format!("ping -i 0.1 {dst} >{PINGS} 2>&1 & echo $!")]);
    assert!(started, "cannot start ping in ping-src: {pid}");
    let pid = pid.trim().to_owned();
    eventually("the first ping answered", Duration::from_secs(10), || (!answered(&pings()).is_empty()).then_some(()));
    let state = cluster.state();
    let chart = weft_e2e::cluster::supervise::chart_dir().display().to_string();
    let mut args: Vec<String> = ["helm", "upgrade", "weft", &chart].map(String::from).into();
    args.extend(["-n", "kube-system", "--wait", "--timeout", "3m"].map(String::from));
    for v in &state.helm_values {
        args.push("--set".into());
        args.push(v.clone());
    }
    // A changed setting rolls the DaemonSet.
    args.extend(["--set", "agent.resyncSeconds=29"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&args);
    kubectl_ok(&["rollout", "status", "-n", "kube-system", "daemonset/weft-agent", "--timeout=180s"]);
    let after = agent_pods();
    assert!(before.iter().all(|uid| !after.contains(uid)), "every agent pod must have been replaced");
    let at_rollout = answered(&pings()).len();
    eventually("50 more pings answered after the rollout", Duration::from_secs(30), || {
        (answered(&pings()).len() >= at_rollout + 50).then_some(())
    });
    let (stopped, out) = pod_exec(NS, "ping-src", &["kill", "-INT", &pid]);
    assert!(stopped, "cannot stop ping {pid}: {out}");
    let out = eventually("ping's summary", Duration::from_secs(10), || {
        let out = pings();
        out.contains("packets transmitted").then_some(out)
    });
    // A lost packet is a gap in the answered sequence numbers (the request
    // in flight when ping was stopped may lack its answer, and counts for
    // nothing).
    let seqs = answered(&out);
    let first = seqs.first().copied().unwrap_or_default();
    let in_order = seqs.iter().enumerate().all(|(i, &seq)| seq == first + i as u64);
    assert!(first <= 1 && in_order, "packets lost during helm upgrade:\n{out}");
    eprintln!("    {} pings, every one answered, across the rollout", seqs.len());
    delete_pods(NS, &["ping-src", "ping-dst"]);
}

fn subnet_of(node: &str) -> Option<String> {
    let (ok, out) = kubectl(&["get", "subnets", "-o", "json"]);
    if !ok {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    v["items"].as_array()?.iter().find(|s| s["spec"]["nodeName"] == node).map(|s| s["spec"]["cidr"].to_string())
}

fn subnet_uid(node: &str) -> String {
    kubectl_ok(&["get", "subnet", node, "-o", "jsonpath={.metadata.uid}"])
}

fn node_registers_again(_: &Cluster) {
    let a = pod("again-a", "node-1", &[]).run();
    let b = pod("again-b", "node-2", &[]).run();
    let lease = subnet_uid("node-1");
    // The Node object deleted while its pods run, and created again by its
    // kubelet (which registers the node when it starts).
    ok(&["stop-daemon", "node-1", "kubelet"]);
    kubectl_ok(&["delete", "node", "node-1", "--wait=true"]);
    ok(&["start-daemon", "node-1", "kubelet"]);
    eventually("node-1 registered again and Ready", Duration::from_secs(120), || {
        (node_ready("node-1") == Some(true)).then_some(())
    });
    assert_eq!(subnet_uid("node-1"), lease, "the node's lease was replaced");
    // Traffic both ways, with nothing restarted by hand.
    for (from, to, want) in [("again-b", &a, "again-a"), ("again-a", &b, "again-b")] {
        let answer = eventually(&format!("{from} reaching {want}"), Duration::from_secs(30), || {
            http_hostname(NS, from, &format!("{to}:{HTTP_PORT}"))
        });
        assert_eq!(answer, want);
    }
    let deletion = kubectl_ok(&["get", "subnet", "node-1", "-o", "jsonpath={.metadata.deletionTimestamp}"]);
    assert!(deletion.trim().is_empty(), "node-1's lease is being withdrawn: {deletion}");
    delete_pods(NS, &["again-a", "again-b"]);
}

fn replace_node(_: &Cluster) {
    assert!(subnet_of("node-2").is_some(), "node-2 has a Subnet");
    ok(&["del-node", "node-2"]);
    // The lease of a node gone for the operator's grace period (30 s in the
    // e2e cluster: a node registering again keeps it) is withdrawn, and its block
    // let go once its silent agent has not answered for 15 s. Only then is a
    // node added (it takes the lowest free name, node-2 again, which would
    // otherwise keep the lease).
    eventually("node-2's Subnet released", Duration::from_secs(180), || subnet_of("node-2").is_none().then_some(()));
    let out = ok(&["add-node"]);
    let new = out.split_whitespace().next().expect("add-node names the node").to_owned();
    assert!(subnet_of(&new).is_some(), "{new} got a Subnet");
    let a = pod("after-a", "node-1", &[]).run();
    pod("after-b", &new, &[]).run();
    let answer = eventually(&format!("a pod on {new} reaching node-1"), Duration::from_secs(30), || {
        http_hostname(NS, "after-b", &format!("{a}:{HTTP_PORT}"))
    });
    assert_eq!(answer, "after-a");
    delete_pods(NS, &["after-a", "after-b"]);
}

fn uninstall(cluster: &Cluster) {
    ok(&["helm", "uninstall", "weft", "-n", "kube-system", "--wait", "--timeout", "2m"]);
    let (_, left) = kubectl(&[
        "get",
        "all,serviceaccounts,configmaps,roles,rolebindings",
        "-A",
        "-l",
        "app.kubernetes.io/instance=weft",
        "-o",
        "name",
    ]);
    assert!(left.trim().is_empty(), "helm uninstall left objects:\n{left}");
    let (_, subnets) = kubectl(&["get", "subnets,hostportallocations", "-A", "-o", "name"]);
    assert!(subnets.trim().is_empty(), "helm uninstall left Weft objects:\n{subnets}");
    // What stays on a node (README, "Install with Helm"): the files the init
    // container installed and the kernel state the agent made.
    let state = cluster.state();
    let node1 = state.node("node-1").expect("node-1");
    for path in ["/opt/cni/bin/weft-cni", "/etc/cni/net.d/00-weft.conflist"] {
        let left = node::host_view(node1, path).expect("per-node path").exists();
        eprintln!("after helm uninstall, {path} on node-1: {}", if left { "left" } else { "gone" });
    }
    let (_, links) = node_exec("node-1", &["ip", "-o", "link", "show"]);
    eprintln!(
        "after helm uninstall, Weft's links on node-1: {:?}",
        links.lines().filter_map(|l| l.split(": ").nth(1)).filter(|n| n.starts_with("weft")).collect::<Vec<_>>()
    );
}
