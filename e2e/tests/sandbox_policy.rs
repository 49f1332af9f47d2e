//! NetworkPolicy truth tables in the sandbox cluster: namespaces and pods
//! with labels across three dual-stack nodes, policies applied with
//! kubectl, and the probe's allow/deny matrix over IPv4 and over IPv6
//! compared with the same expected one after each step (waiting for
//! convergence with a deadline, never a fixed sleep).
//!
//! SCTP cannot be probed here (the kernel has no SCTP); SCTP rules are
//! checked at rule level in the agent's unit and kernel tests.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{Up, apply, explained_matrix, kubectl, ok, probe_matrix, try_apply};
use weft_e2e::wait;

const CONVERGE: Duration = Duration::from_secs(45);
const IPV6_CLUSTER_CIDR: &str = "fd00:10:244::/56";
const PODS: [&str; 5] = ["dev/client", "dev/web", "prod/api", "prod/db", "prod/web"];

/// Namespaces prod (team=a) and dev (team=b) and the [`PODS`] across
/// three nodes, each serving `ports` (`-p` arguments of add-pod).
fn add_the_pods(ports: &[&str]) {
    for (ns, team) in [("prod", "a"), ("dev", "b")] {
        kubectl(&["create", "namespace", ns]);
        kubectl(&["label", "namespace", ns, &format!("team={team}")]);
    }
    for (ns, name, node, label) in [
        ("dev", "client", "node-1", "app=client"),
        ("dev", "web", "node-3", "app=web"),
        ("prod", "api", "node-3", "app=api"),
        ("prod", "db", "node-2", "app=db"),
        ("prod", "web", "node-1", "app=web"),
    ] {
        let mut args = vec!["add-pod", name, "-n", ns, "--node", node, "-l", label];
        args.extend_from_slice(ports);
        ok(&args);
    }
}

fn delete_all_policies() {
    for ns in ["prod", "dev"] {
        kubectl(&["delete", "networkpolicies.networking.k8s.io", "--all", "-n", ns]);
        kubectl(&["delete", "networkpolicies.weft.dev", "--all", "-n", ns]);
    }
}

/// Waits until the probe matrix over each family equals `expect(from, to)`
/// for every ordered pair.
#[track_caller]
fn expect_matrix(step: &str, protocol: &str, port: u16, expect: impl Fn(&str, &str) -> bool) {
    for family in ["ipv4", "ipv6"] {
        expect_family(step, family, protocol, port, &expect);
    }
}

#[track_caller]
fn expect_family(step: &str, family: &str, protocol: &str, port: u16, expect: &impl Fn(&str, &str) -> bool) {
    let mut want = BTreeMap::new();
    for f in PODS {
        for t in PODS.iter().filter(|t| **t != f) {
            want.insert((f.to_owned(), (*t).to_owned()), expect(f, t));
        }
    }
    let mut last = String::new();
    let converged = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait::until(step, CONVERGE, || {
            let got = probe_matrix(family, protocol, port);
            if got == want {
                return Some(());
            }
            last = got
                .iter()
                .filter(|(k, v)| want.get(*k) != Some(v))
                .map(|((f, t), v)| format!("  {f} -> {t}: got {}, want {}", allowed(*v), allowed(!*v)))
                .collect::<Vec<_>>()
                .join("\n");
            None
        })
    }));
    assert!(converged.is_ok(), "step {step:?} ({family}, {protocol}/{port}) did not converge; differences:\n{last}");
    // What the datapath did is what `weft explain` says, for every pair.
    let explained = explained_matrix(family, protocol, port, &PODS);
    let differ: Vec<String> = explained
        .iter()
        .filter(|(k, v)| want.get(*k) != Some(v))
        .map(|((f, t), v)| format!("  {f} -> {t}: explained {}, observed {}", allowed(*v), allowed(!*v)))
        .collect();
    assert!(
        differ.is_empty(),
        "step {step:?} ({family}, {protocol}/{port}): weft explain disagrees:\n{}",
        differ.join("\n")
    );
    eprintln!("ok: {step} ({family}, {protocol}/{port}), explained alike");
}

fn allowed(v: bool) -> &'static str {
    if v { "allow" } else { "deny" }
}

fn ns_of(pod: &str) -> &str {
    pod.split('/').next().unwrap_or_default()
}

/// A pod's IPv4 address.
fn pod_ip(key: &str) -> String {
    pod_field(key, 2)
}

/// A pod's IPv6 address.
fn pod_ip6(key: &str) -> String {
    pod_field(key, 3)
}

/// Field `n` of the pod's line in `weft-sandbox pods`.
fn pod_field(key: &str, n: usize) -> String {
    ok(&["pods"])
        .lines()
        .find(|l| l.starts_with(&format!("{key} ")))
        .and_then(|l| l.split_whitespace().nth(n))
        .unwrap_or_else(|| panic!("no field {n} for {key}"))
        .to_owned()
}

fn in_node(node: &str, cmd: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &format!("weft-sbx-{node}"), cmd])
        .args(args)
        .output()
        .expect("ip netns exec");
    assert!(out.status.success(), "{cmd} {args:?} in {node}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn agent_metrics(node_ip: &str) -> String {
    let url = format!("http://{node_ip}:9646/metrics");
    let out = Command::new("ip")
        .args(["netns", "exec", "weft-sbx-cp", "curl", "-sf", "-m", "5", &url])
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sum of a metric family's samples whose line contains `filter`.
fn metric_sum(text: &str, name: &str, filter: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const DENY_ALL_PROD: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec:
  podSelector: {}
";

#[test]
fn standard_and_weft_policies_follow_the_truth_table() {
    // With the drop log on (it is off by default), and other nodes' pods
    // learnt from the PodEndpoints the operator publishes (the other tests
    // here and the real-node clusters' watch every Pod, the default).
    let secondary = format!("--operator-arg=--secondary-cluster-cidr={IPV6_CLUSTER_CIDR}");
    let agents = format!("--agent-arg=--ipv6-cluster-cidr={IPV6_CLUSTER_CIDR}");
    let endpoints = ["--operator-arg=--publish-pod-endpoints=true", "--agent-arg=--pod-source=endpoints"];
    let Some(_up) = Up::start(
        &["--nodes", "3", "--agent-arg=--policy-drop-log-group=100", &secondary, &agents, endpoints[0], endpoints[1]],
        &[("curl", std::path::Path::new("/usr/bin/curl").is_file())],
    ) else {
        return;
    };
    add_the_pods(&["-p", "80/tcp", "-p", "http=8080/tcp", "-p", "dns=53/udp"]);
    wait::until("a PodEndpoint of each pod", CONVERGE, || {
        let listed = kubectl(&[
            "get",
            "podendpoints",
            "-A",
            "-o",
            "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {end}",
        ]);
        PODS.iter().all(|p| listed.split_whitespace().any(|e| e == *p)).then_some(())
    });

    // No policy: everything is open.
    expect_matrix("default allow", "tcp", 80, |_, _| true);

    // An empty podSelector selects every pod of its namespace (ingress only: egress stays open).
    apply(DENY_ALL_PROD);
    expect_matrix("deny-all ingress in prod", "tcp", 80, |_, to| ns_of(to) != "prod");

    // podSelector peer: the policy's namespace only (dev/web has the label too, but is in dev).
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-from-web, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: web}}}]
",
    );
    expect_matrix("podSelector peer", "tcp", 80, |from, to| {
        ns_of(to) != "prod" || (to == "prod/db" && from == "prod/web")
    });

    // A pod created later is isolated by deny-all at once and becomes a peer at once.
    ok(&["add-pod", "web2", "-n", "prod", "--node", "node-3", "-l", "app=web", "-p", "80/tcp"]);
    wait::until("new prod/web2 to reach prod/db and be isolated itself", CONVERGE, || {
        let out = ok(&["probe", "--port", "80", "--pod", "prod/web2", "--pod", "prod/db", "--pod", "dev/client"]);
        let m: Value = serde_json::from_str(&out).expect("probe JSON");
        let web2_to_db = m["matrix"]["prod/web2"]["prod/db"] == Value::Bool(true);
        let client_to_web2 = m["matrix"]["dev/client"]["prod/web2"] == Value::Bool(true);
        (web2_to_db && !client_to_web2).then_some(())
    });
    ok(&["del-pod", "web2", "-n", "prod"]);

    // Both selectors in one peer: AND.
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-from-web, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: b}}, podSelector: {matchLabels: {app: web}}}]
",
    );
    expect_matrix("namespaceSelector AND podSelector", "tcp", 80, |from, to| {
        ns_of(to) != "prod" || (to == "prod/db" && from == "dev/web")
    });
    // Two peers: OR (updated in place).
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-from-web, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: b}}}, {podSelector: {matchLabels: {app: web}}}]
",
    );
    expect_matrix("namespaceSelector OR podSelector", "tcp", 80, |from, to| {
        ns_of(to) != "prod" || (to == "prod/db" && (ns_of(from) == "dev" || from == "prod/web"))
    });

    // ipBlock with except, on prod/api; the other policies stay (union with
    // deny-all). One block per family, so both matrices expect the same.
    let (client_ip, client_ip6) = (pod_ip("dev/client"), pod_ip6("dev/client"));
    apply(&format!(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: api-from-cluster, namespace: prod}}
spec:
  podSelector: {{matchLabels: {{app: api}}}}
  ingress:
  - from:
    - {{ipBlock: {{cidr: 10.244.0.0/16, except: [{client_ip}/32]}}}}
    - {{ipBlock: {{cidr: '{IPV6_CLUSTER_CIDR}', except: ['{client_ip6}/128']}}}}
"
    ));
    expect_matrix("ipBlock except", "tcp", 80, |from, to| match to {
        "prod/db" => ns_of(from) == "dev" || from == "prod/web",
        "prod/api" => from != "dev/client",
        "prod/web" => false,
        _ => true,
    });

    // Named port and endPort: prod/web admits port "http" (8080); prod/db admits 8000-8090.
    delete_all_policies();
    apply(DENY_ALL_PROD);
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-http, namespace: prod}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - ports: [{port: http}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-range, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - ports: [{port: 8000, endPort: 8090}]
",
    );
    expect_matrix("named port and endPort admit 8080", "tcp", 8080, |_, to| to != "prod/api");
    expect_matrix("named port and endPort do not admit 80", "tcp", 80, |_, to| ns_of(to) != "prod");

    // UDP: prod/db admits UDP 53 from app=web pods of any namespace.
    delete_all_policies();
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-dns, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}]
    ports: [{protocol: UDP, port: 53}]
",
    );
    expect_matrix("UDP from web pods", "udp", 53, |from, to| to != "prod/db" || from.ends_with("/web"));
    expect_matrix("UDP rule does not admit TCP", "tcp", 80, |_, to| to != "prod/db");

    // Egress (policyTypes Egress only): dev/client may reach prod/db only; its ingress stays open.
    // And prod/db has egress deny-all: replies of connections to it still pass (conntrack).
    delete_all_policies();
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-out, namespace: dev}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - to: [{namespaceSelector: {matchLabels: {team: a}}, podSelector: {matchLabels: {app: db}}}]
    ports: [{port: 80}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-no-egress, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Egress]
",
    );
    expect_matrix("egress policies; replies pass", "tcp", 80, |from, to| match from {
        "dev/client" => to == "prod/db",
        "prod/db" => false,
        _ => true,
    });
    // Egress with a named port: each destination's own number for "http".
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-out, namespace: dev}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - ports: [{port: http}]
",
    );
    expect_matrix("egress named port 8080", "tcp", 8080, |from, _| from != "prod/db");
    expect_matrix("egress named port does not admit 80", "tcp", 80, |from, _| {
        from != "prod/db" && from != "dev/client"
    });

    // Label changes: of a pod, then of a namespace.
    delete_all_policies();
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-friends, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from: [{podSelector: {matchLabels: {role: friend}}}, {namespaceSelector: {matchLabels: {access: 'yes'}}}]
",
    );
    expect_matrix("no friends yet", "tcp", 80, |_, to| to != "prod/db");
    kubectl(&["label", "pod", "api", "-n", "prod", "role=friend"]);
    expect_matrix("pod label added", "tcp", 80, |from, to| to != "prod/db" || from == "prod/api");
    kubectl(&["label", "namespace", "dev", "access=yes"]);
    expect_matrix("namespace label added", "tcp", 80, |from, to| {
        to != "prod/db" || from == "prod/api" || ns_of(from) == "dev"
    });
    kubectl(&["label", "pod", "api", "-n", "prod", "role-"]);
    kubectl(&["label", "namespace", "dev", "access-"]);
    expect_matrix("labels removed", "tcp", 80, |_, to| to != "prod/db");

    // Policy deletion reopens.
    kubectl(&["delete", "networkpolicy.networking.k8s.io", "db-friends", "-n", "prod"]);
    expect_matrix("policy deleted", "tcp", 80, |_, _| true);

    // Weft Deny beats a standard Allow.
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-open, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress: [{}]
---
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: db-no-dev, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  priority: 100
  ingress:
  - action: Deny
    peers: [{namespaceSelector: {matchLabels: {team: b}}}]
",
    );
    expect_matrix("Weft Deny beats standard Allow", "tcp", 80, |from, to| to != "prod/db" || ns_of(from) == "prod");
    // Weft Allow is final over a standard deny-all; a higher-priority Weft Deny still wins.
    delete_all_policies();
    apply(DENY_ALL_PROD);
    apply(
        "
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: db-from-dev, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  priority: 10
  ingress:
  - action: Allow
    peers: [{namespaceSelector: {matchLabels: {team: b}}}]
    ports: [{port: 80}]
---
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: no-web, namespace: prod}
spec:
  priority: 500
  ingress:
  - action: Deny
    peers: [{namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}]
",
    );
    expect_matrix("Weft Allow is final, higher Deny first", "tcp", 80, |from, to| {
        ns_of(to) != "prod" || (to == "prod/db" && from == "dev/client")
    });
    // Weft egress Deny on UDP without isolating anything else.
    delete_all_policies();
    apply(
        "
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: web-no-dns-out, namespace: dev}
spec:
  podSelector: {matchLabels: {app: web}}
  egress:
  - action: Deny
    ports: [{protocol: UDP, port: dns}]
",
    );
    expect_matrix("Weft egress Deny with a named UDP port", "udp", 53, |from, _| from != "dev/web");
    expect_matrix("Weft UDP Deny leaves TCP open", "tcp", 80, |_, _| true);

    // Invalid Weft policies: the apiserver's messages.
    let (accepted, msg) = try_apply(
        "
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: bad, namespace: prod}
spec:
  priority: 5000
  ingress:
  - action: Maybe
",
    );
    assert!(!accepted, "{msg}");
    for part in ["spec.priority", "1000", "Unsupported value: \"Maybe\""] {
        assert!(msg.contains(part), "{part:?} missing in: {msg}");
    }
    let (accepted, msg) = try_apply(
        "
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: bad, namespace: prod}
spec:
  ingress:
  - action: Deny
    ports: [{port: 80, endPort: 10}]
",
    );
    assert!(!accepted && msg.contains("endPort requires a numeric port and must not be below it"), "{msg}");

    // What CEL cannot check, the operator reports in the status; agents ignore such a policy.
    apply(
        "
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: bad-except, namespace: prod}
spec:
  ingress:
  - action: Deny
    peers: [{ipBlock: {cidr: 10.244.0.0/16, except: [10.245.0.0/24]}}]
---
apiVersion: weft.dev/v1alpha1
kind: NetworkPolicy
metadata: {name: web-pods, namespace: prod}
spec:
  podSelector: {matchLabels: {app: web}}
  egress: [{action: Allow}]
",
    );
    let status = |name: &str, path: &str| {
        kubectl(&["get", "networkpolicies.weft.dev", name, "-n", "prod", "-o", &format!("jsonpath={path}")])
    };
    let accepted = "{.status.conditions[?(@.type==\"Accepted\")].status}";
    let message = "{.status.conditions[?(@.type==\"Accepted\")].message}";
    wait::until("bad-except to be rejected", CONVERGE, || (status("bad-except", accepted) == "False").then_some(()));
    let why = status("bad-except", message);
    assert!(
        why.contains(
            "spec.ingress[0].peers[0].ipBlock.except[0]: 10.245.0.0/24 is not strictly inside cidr 10.244.0.0/16"
        ),
        "{why}"
    );
    wait::until("web-pods to be accepted", CONVERGE, || (status("web-pods", accepted) == "True").then_some(()));
    wait::until("web-pods to count its pod", CONVERGE, || {
        (status("web-pods", "{.status.selectedPods}") == "1").then_some(())
    });
    expect_matrix("the rejected Deny is not enforced", "tcp", 80, |_, _| true);

    // Others' rules survive our syncs; tampering with ours is repaired by the resync.
    delete_all_policies();
    apply(DENY_ALL_PROD);
    expect_matrix("deny-all again", "tcp", 80, |_, to| ns_of(to) != "prod");
    // The node itself still reaches its isolated pods (kubelet probes).
    let db_ip = pod_ip("prod/db");
    let answer =
        in_node("node-2", "timeout", &["3", "bash", "-c", &format!("exec 3<>/dev/tcp/{db_ip}/80 && head -c 64 <&3")]);
    assert_eq!(answer.trim(), "prod/db", "node-2 cannot reach its own pod under deny-all");
    // Other components accepting everything first, in iptables (nft
    // backend) and iptables-legacy: they admit nothing Weft drops (a drop
    // in any table is final), and Weft leaves their rules alone.
    in_node("node-2", "iptables", &["-I", "FORWARD", "1", "-m", "comment", "--comment", "not weft", "-j", "ACCEPT"]);
    in_node(
        "node-2",
        "iptables-legacy",
        &["-I", "FORWARD", "1", "-m", "comment", "--comment", "legacy", "-j", "ACCEPT"],
    );
    expect_matrix("deny-all under others' accept-all", "tcp", 80, |_, to| ns_of(to) != "prod");
    in_node("node-2", "nft", &["flush", "chain", "inet", "weft", "policy-forward"]);
    expect_matrix("flushed chain repaired", "tcp", 80, |_, to| ns_of(to) != "prod");
    let forward = in_node("node-2", "iptables", &["-S", "FORWARD"]);
    assert!(forward.contains("not weft"), "a foreign rule was removed:\n{forward}");
    let legacy = in_node("node-2", "iptables-legacy", &["-S", "FORWARD"]);
    assert!(legacy.contains("legacy"), "a foreign legacy rule was removed:\n{legacy}");
    let base = in_node("node-2", "nft", &["list", "chain", "inet", "weft", "policy-forward"]);
    // Once, not once per repair (the IPv6 lookup is `@policy-ingress6`).
    assert_eq!(base.matches("vmap @policy-ingress ").count(), 1, "{base}");

    // Drops are counted per policy on the destination's node (read at each sync).
    wait::until("node-2 to count default-deny drops", CONVERGE, || {
        let text = agent_metrics("10.250.0.12");
        let dropped = metric_sum(&text, "weft_agent_policy_dropped_packets_total", "policy=\"default-deny\"");
        (dropped > 0.0 && metric_sum(&text, "weft_agent_policy_rules", "") > 3.0).then_some(())
    });
    // And logged there: policy, direction, addresses, port.
    let db = pod_ip("prod/db");
    let log_path = weft_e2e::sandbox::state_dir().join("node-2").join("agent.log");
    let line = wait::until("node-2's agent to log a dropped packet to prod/db", CONVERGE, || {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        log.lines()
            .find(|l| {
                l.contains("packet dropped by policy")
                    && l.contains("policy=default-deny")
                    && l.contains("direction=ingress")
                    && l.contains(&format!("dst={db} "))
            })
            .map(str::to_owned)
    });
    assert!(line.contains("proto=tcp") && line.contains("dport=80"), "{line}");
    let logged = metric_sum(&agent_metrics("10.250.0.12"), "weft_agent_policy_drop_log_records_total", "logged");
    assert!(logged > 0.0, "no logged records counted");

    // A node that cannot write its policy says so where an operator looks
    // (its Subnet's condition, an Event on its Node, its readiness), and
    // says so again once it can.
    let policy_condition = |field: &str| {
        kubectl(&[
            "get",
            "subnets.weft.dev",
            "node-2",
            "-o",
            &format!("jsonpath={{.status.conditions[?(@.type==\"PolicyApplied\")].{field}}}"),
        ])
    };
    wait::until("node-2's PolicyApplied condition", CONVERGE, || (policy_condition("status") == "True").then_some(()));
    let held = TableHeldByAnother::new("node-2");
    wait::until("node-2 to report policy not applied", CONVERGE, || {
        (policy_condition("status") == "False").then_some(())
    });
    // Why, as the failing pass saw it (nft 1.0.6 cannot even list a table
    // with the owner flag: its JSON stops at the flags).
    let why = policy_condition("message");
    let reason = why.split_once("new pods wait at ADD): ").map(|(_, r)| r.trim()).unwrap_or_default();
    assert!(why.contains("not applied") && reason.contains("nft"), "{why}");
    let node_events = |reason: &str| {
        let selector = format!("involvedObject.kind=Node,involvedObject.name=node-2,reason={reason}");
        kubectl(&["get", "events", "-n", "default", "--field-selector", &selector, "-o", "jsonpath={.items[*].type}"])
    };
    wait::until("a Warning Event on node-2", CONVERGE, || (node_events("PolicyNotApplied") == "Warning").then_some(()));
    let ready = in_node("node-2", "curl", &["-s", "-m", "5", "http://127.0.0.1:9646/readyz"]);
    assert!(ready.contains("network policy changes are not applied"), "{ready}");
    drop(held);
    wait::until("node-2 to report policy applied again", CONVERGE, || {
        (policy_condition("status") == "True").then_some(())
    });
    wait::until("a Normal Event on node-2", CONVERGE, || (node_events("PolicyApplied") == "Normal").then_some(()));
    expect_matrix("deny-all rewritten once the table could be written", "tcp", 80, |_, to| ns_of(to) != "prod");
}

/// Weft's `inet weft` table on a node, replaced by an empty one that only
/// a process of the test may write (nftables' owner flag, held by an
/// interactive `nft` until this is dropped, also on a panic): every write
/// of the agent fails with EPERM, as a broken kernel or a hostile
/// component would make it fail.
struct TableHeldByAnother(std::process::Child);

impl TableHeldByAnother {
    fn new(node: &str) -> Self {
        use std::io::Write;
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &format!("weft-sbx-{node}"), "nft", "-i"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("nft -i");
        let stdin = nft.stdin.as_mut().expect("nft's stdin");
        // One line, one transaction: the agent cannot put its table back between.
        stdin.write_all(b"delete table inet weft; add table inet weft { flags owner; }\n").expect("write to nft");
        stdin.flush().expect("flush to nft");
        wait::until("the held table", Duration::from_secs(10), || {
            in_node(node, "nft", &["list", "table", "inet", "weft"]).contains("flags owner").then_some(())
        });
        TableHeldByAnother(nft)
    }
}

impl Drop for TableHeldByAnother {
    fn drop(&mut self) {
        // The owner's socket closes with it: the kernel removes the table.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ClusterNetworkPolicy` YAML.
fn cluster_policy(name: &str, tier: &str, priority: u32, body: &str) -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1beta1\nkind: ClusterNetworkPolicy\n\
         metadata: {{name: {name}}}\nspec:\n  tier: {tier}\n  priority: {priority}\n{body}"
    )
}

#[test]
fn cluster_network_policies_come_before_and_after_the_namespaces_policies() {
    // Dual-stack: every step is probed over both families.
    let secondary = format!("--operator-arg=--secondary-cluster-cidr={IPV6_CLUSTER_CIDR}");
    let agents = format!("--agent-arg=--ipv6-cluster-cidr={IPV6_CLUSTER_CIDR}");
    let Some(_up) = Up::start(
        &[
            "--nodes",
            "3",
            "--agent-arg=--cluster-network-policy=true",
            "--operator-arg=--cluster-network-policy=true",
            &secondary,
            &agents,
        ],
        &[],
    ) else {
        return;
    };
    add_the_pods(&["-p", "80/tcp"]);
    let dev_to_prod = |from: &str, to: &str| ns_of(from) == "dev" && ns_of(to) == "prod";
    expect_matrix("default allow", "tcp", 80, |_, _| true);

    // Admin: nothing from dev reaches prod, whatever prod's own policies say.
    let subject_prod = "  subject: {namespaces: {matchLabels: {team: a}}}\n";
    apply(&cluster_policy(
        "no-dev",
        "Admin",
        10,
        &format!(
            "{subject_prod}  ingress:\n  - action: Deny\n    from: [{{namespaces: {{matchLabels: {{team: b}}}}}}]\n"
        ),
    ));
    expect_matrix("Admin deny", "tcp", 80, |f, t| !dev_to_prod(f, t));

    // Admin Pass (a lower number: first) hands dev/client to prod's own
    // policies: prod/web's NetworkPolicy admits it; prod/api and prod/db
    // have none, so it gets there (no Baseline rule yet).
    apply(&cluster_policy(
        "pass-client",
        "Admin",
        5,
        &format!(
            "{subject_prod}  ingress:\n  - action: Pass\n    from: [{{pods: {{namespaceSelector: {{matchLabels: {{team: b}}}}, podSelector: {{matchLabels: {{app: client}}}}}}}}]\n"
        ),
    ));
    apply(
        "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-from-client, namespace: prod}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: b}}, podSelector: {matchLabels: {app: client}}}]
",
    );
    let web_isolated = |f: &str, t: &str| t != "prod/web" || f == "dev/client";
    expect_matrix("Admin pass to the namespace's policies", "tcp", 80, |f, t| {
        web_isolated(f, t) && (!dev_to_prod(f, t) || f == "dev/client")
    });

    // Baseline: dev is denied where no NetworkPolicy speaks (prod/api,
    // prod/db); prod/web's own policy still decides for prod/web.
    apply(&cluster_policy(
        "baseline-no-dev",
        "Baseline",
        1,
        &format!(
            "{subject_prod}  ingress:\n  - action: Deny\n    from: [{{namespaces: {{matchLabels: {{team: b}}}}}}]\n"
        ),
    ));
    let baseline =
        |f: &str, t: &str| web_isolated(f, t) && (!dev_to_prod(f, t) || (f == "dev/client" && t == "prod/web"));
    expect_matrix("Baseline deny", "tcp", 80, baseline);

    // A network of one family: dev/client loses IPv6 to every pod (first
    // in the Admin tier), and keeps IPv4 as it was.
    apply(&cluster_policy(
        "client-no-ipv6",
        "Admin",
        1,
        &format!(
            "  subject: {{pods: {{namespaceSelector: {{matchLabels: {{team: b}}}}, podSelector: {{matchLabels: {{app: client}}}}}}}}\n  egress:\n  - {{action: Deny, to: [{{networks: ['{IPV6_CLUSTER_CIDR}']}}]}}\n"
        ),
    ));
    expect_family("an IPv6 network denied", "ipv6", "tcp", 80, &|f, t| f != "dev/client" && baseline(f, t));
    expect_family("an IPv6 network denied, IPv4 untouched", "ipv4", "tcp", 80, &baseline);

    // The operator's Accepted condition: True as written; False with the
    // reason for a peer Weft cannot match (it selects no pod here).
    apply(&cluster_policy(
        "by-domain",
        "Admin",
        20,
        "  subject: {namespaces: {matchLabels: {team: nobody}}}\n  egress:\n  - {action: Deny, to: [{domainNames: [example.com]}]}\n",
    ));
    let condition = |name: &str, field: &str| {
        let path = format!("jsonpath={{.status.conditions[?(@.type==\"Accepted\")].{field}}}");
        kubectl(&["get", "clusternetworkpolicies", name, "-o", &path])
    };
    wait::until("no-dev to be accepted", CONVERGE, || (condition("no-dev", "status") == "True").then_some(()));
    wait::until("by-domain to be refused", CONVERGE, || (condition("by-domain", "status") == "False").then_some(()));
    assert_eq!(condition("by-domain", "reason"), "DomainNamesUnsupported");
    let why = condition("by-domain", "message");
    assert!(why.contains("egress rule 0") && why.contains("denies all egress of its subjects"), "{why}");

    kubectl(&["delete", "clusternetworkpolicies", "--all"]);
    delete_all_policies();
    expect_matrix("all deleted", "tcp", 80, |_, _| true);
}
