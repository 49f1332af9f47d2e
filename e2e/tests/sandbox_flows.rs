//! Flow records on the sandbox cluster's real agents: a connection policy
//! refuses shows up at the destination's agent as denied, naming the
//! isolating policy, within 2 s; one it admits as opened, naming the
//! admitting rule; `weft flows` filters by pod and verdict. Read from each
//! agent's socket with the `weft` CLI. `weft explain --probe` has the
//! source's agent send one connection from inside the pod, as explained.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use weft_e2e::sandbox::testing::{Up, apply, connect, kubectl, ok, pod_ip};
use weft_e2e::supervisor::StateFile;
use weft_e2e::{bins, sandbox, wait};

const CONVERGE: Duration = Duration::from_secs(45);

fn socket(node: &str) -> PathBuf {
    sandbox::state_dir().join(node).join("agent.sock")
}

/// `weft flows --socket <node's> <args> -o json`: the records, parsed.
fn flows(node: &str, args: &[&str]) -> Vec<Value> {
    let out = Command::new(bins::weft("weft"))
        .arg("flows")
        .arg("--socket")
        .arg(socket(node))
        .args(args)
        .args(["-o", "json"])
        .output()
        .expect("weft runs");
    assert!(out.status.success(), "weft flows: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

/// `weft explain --from <from> --to <to> --port 80 --probe` against the
/// agent of `node`: the explanation with the probe, or the CLI's error.
fn explain_probe(node: &str, from: &str, to: &str) -> Result<Value, String> {
    let state = sandbox::State::load().expect("the sandbox is up");
    let out = Command::new(bins::weft("weft"))
        .arg("--kubeconfig")
        .arg(&state.kubeconfig)
        .args(["explain", "--from", from, "--to", to, "--port", "80/TCP", "--probe", "-o", "json", "--socket"])
        .arg(socket(node))
        .output()
        .expect("weft runs");
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).expect("JSON"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn pod_at(end: &Value) -> String {
    format!("{}/{}", end["namespace"].as_str().unwrap_or_default(), end["pod"].as_str().unwrap_or_default())
}

#[test]
fn denied_and_admitted_connections_are_recorded_with_their_policy() {
    let Some(_up) = Up::start(
        &[
            "--nodes",
            "2",
            "--agent-arg=--policy-drop-log-group=100",
            "--agent-arg=--policy-drop-log-lines=false",
            "--agent-arg=--flows-capacity=4096",
        ],
        &[],
    ) else {
        return;
    };
    for ns in ["prod", "dev"] {
        kubectl(&["create", "namespace", ns]);
    }
    ok(&["add-pod", "db", "-n", "prod", "--node", "node-2", "-l", "app=db", "-p", "80/tcp"]);
    ok(&["add-pod", "web", "-n", "prod", "--node", "node-1", "-l", "app=web", "-p", "80/tcp"]);
    ok(&["add-pod", "client", "-n", "dev", "--node", "node-1", "-l", "app=client", "-p", "80/tcp"]);
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
    let db = format!("{}:80", pod_ip("prod/db"));
    wait::until("the policy to hold: web reaches db, client does not", CONVERGE, || {
        let web = connect("prod/web", "tcp", &db);
        let client = connect("dev/client", "tcp", &db);
        (web.as_deref() == Some("prod/db") && client.is_none()).then_some(())
    });

    // A refused attempt: recorded at db's node, naming the isolating policy, within 2 s.
    let tried = Instant::now();
    assert!(connect("dev/client", "tcp", &db).is_none());
    let denied = wait::until("the refused connection's record", Duration::from_secs(2), || {
        let records = flows("node-2", &["--pod", "dev/client", "--verdict", "rejected"]);
        records.into_iter().rev().find(|r| r["event"] == "denied" && pod_at(&r["destination"]) == "prod/db")
    });
    eprintln!("denied record after {:?}: {denied}", tried.elapsed());
    assert_eq!(pod_at(&denied["source"]), "dev/client");
    assert_eq!((denied["policy"].as_str(), denied["direction"].as_str()), (Some("prod/db-from-web"), Some("ingress")));
    assert_eq!(denied["node"], "node-2");

    // An admitted connection: opened at db's node, naming the admitting rule.
    assert_eq!(connect("prod/web", "tcp", &db).as_deref(), Some("prod/db"));
    let opened = wait::until("the admitted connection's record", Duration::from_secs(2), || {
        let records = flows("node-2", &["--pod", "prod/web", "--verdict", "forwarded"]);
        records.into_iter().rev().find(|r| r["event"] == "opened" && pod_at(&r["destination"]) == "prod/db")
    });
    assert_eq!(pod_at(&opened["source"]), "prod/web");
    assert_eq!(
        (opened["policy"].as_str(), opened["direction"].as_str(), opened["rule"].as_i64()),
        (Some("prod/db-from-web"), Some("ingress"), Some(0))
    );
    // The source's node records it too; no policy selects web's egress.
    let at_source = wait::until("the source node's record", Duration::from_secs(2), || {
        flows("node-1", &["--pod", "prod/web"]).into_iter().find(|r| pod_at(&r["destination"]) == "prod/db")
    });
    assert_eq!(at_source["policy"], "");

    // Filters: nothing of dev/client among prod/web's records; a namespace without pods has none.
    assert!(flows("node-2", &["--pod", "prod/web"]).iter().all(|r| pod_at(&r["source"]) != "dev/client"));
    assert!(flows("node-2", &["-n", "kube-system"]).is_empty());

    // `weft explain --probe` at the source's node: web's probe connects,
    // as explained, and the node's record of it has the probe's port.
    let web = explain_probe("node-1", "prod/web", "prod/db").expect("probed");
    assert_eq!(
        (web["allowed"].as_bool(), web["probe"]["outcome"].as_str()),
        (Some(true), Some("connected")),
        "{web:#}"
    );
    assert_eq!(web["probe"]["agrees"], true);
    let port = web["probe"]["source"]["port"].clone();
    let records = web["probe"]["flows"].as_array().expect("flows");
    assert!(!records.is_empty() && records.iter().all(|r| r["source"]["port"] == port), "{web:#}");
    // client's is refused (db's ingress rejects it), as explained.
    let client = explain_probe("node-1", "dev/client", "prod/db").expect("probed");
    assert_eq!((client["allowed"].as_bool(), client["probe"]["outcome"].as_str()), (Some(false), Some("refused")));
    assert_eq!(client["probe"]["agrees"], true, "{client:#}");
    // A pod of another node: node-1's agent says where to run it.
    let err = explain_probe("node-1", "prod/db", "prod/web").expect_err("db is on node-2");
    assert!(err.contains("not attached on node node-1"), "{err}");
}
