//! What a person sees with kubectl on a running Weft cluster: the columns of
//! `kubectl get` on Weft's resources, and `kubectl describe` / Events that
//! explain failures — against the sandbox cluster, through the same kubectl
//! a user runs (`e2e/sandbox.sh kubectl`).
//!
//! One sandbox runs per machine, so these tests take turns ([`Up`]).

use std::time::Duration;

use weft_e2e::sandbox::testing::{Up, ok, run};
use weft_e2e::wait;

/// The header and the rows of a `kubectl get` table, split into columns.
fn table(args: &[&str]) -> (Vec<String>, Vec<Vec<String>>) {
    let out = ok(args);
    let mut lines = out.lines().map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>());
    let header = lines.next().unwrap_or_default();
    (header, lines.collect())
}

fn column<'a>(header: &[String], row: &'a [String], name: &str) -> &'a str {
    let i = header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no column {name} in {header:?}"));
    row.get(i).map(String::as_str).unwrap_or_default()
}

#[test]
fn kubectl_shows_weft_resources_and_explains_failures() {
    // One host port per node: the second asks for more than there is.
    let Some(_up) = Up::start(&["--nodes", "2", "--agent-arg=--host-port-range=20000-20000"], &[]) else { return };

    // Subnets: one row per node with its CIDR, why it has one (or not),
    // backend, node IP and readiness.
    let (header, rows) = table(&["kubectl", "get", "subnets"]);
    assert_eq!(header, ["NAME", "NODE", "CIDR", "ALLOCATED", "BACKEND", "NODEIP", "READY", "AGE"]);
    assert_eq!(rows.len(), 2, "{rows:?}");
    for row in &rows {
        let node = column(&header, row, "NODE");
        assert!(column(&header, row, "CIDR").starts_with("10.244."), "{row:?}");
        assert_eq!(column(&header, row, "ALLOCATED"), "LeaseGranted", "{row:?}");
        assert_eq!(column(&header, row, "BACKEND"), "vxlan");
        assert_eq!(column(&header, row, "NODEIP"), if node == "node-1" { "10.250.0.11" } else { "10.250.0.12" });
        assert_eq!(column(&header, row, "READY"), "True");
    }
    let described = ok(&["kubectl", "describe", "subnet", "node-1"]);
    for want in ["Conditions:", "Ready", "DatapathProgrammed", "PeersProgrammed", "Vtep Mac:"] {
        assert!(described.contains(want), "{want:?} missing from describe:\n{described}");
    }

    // A peer publishing bad data: describe on the reporting node says what
    // is wrong. node-2's agent is stopped meanwhile: running, it would put
    // its real MAC back at once.
    let paused = weft_e2e::sandbox::testing::PausedAgent::new("node-2");
    let bad = r#"{"status":{"vtepMAC":"01:00:5e:00:00:01"}}"#;
    ok(&["kubectl", "patch", "subnet", "node-2", "--subresource=status", "--type=merge", "-p", bad]);
    wait::until("node-1's Subnet to explain the bad peer", Duration::from_secs(60), || {
        let d = ok(&["kubectl", "describe", "subnet", "node-1"]);
        d.contains("node-2: VTEP MAC address 01:00:5e:00:00:01 is a multicast/broadcast address").then_some(())
    });
    drop(paused);
    wait::until("node-2's real MAC back", Duration::from_secs(60), || {
        let d = ok(&["kubectl", "describe", "subnet", "node-1"]);
        (!d.contains("01:00:5e:00:00:01")).then_some(())
    });

    // HostPortAllocations: pod, node, addresses; -o wide adds the node's pool.
    ok(&["add-pod", "web", "--node", "node-1", "-p", "http=8080/tcp", "-a", "weft.dev/host-ports=http"]);
    let row = wait::until("web's allocation with its address", Duration::from_secs(30), || {
        let (header, rows) = table(&["kubectl", "get", "hostportallocations", "-o", "wide"]);
        let row = rows.into_iter().find(|r| column(&header, r, "POD") == "web")?;
        (column(&header, &row, "ADDRESSES").contains("10.250.0.11:20000/TCP")).then_some((header, row))
    });
    let (header, row) = row;
    assert_eq!(header, ["NAME", "POD", "NODE", "ADDRESSES", "POOL", "AGE"]);
    assert_eq!(column(&header, &row, "NODE"), "node-1");
    assert_eq!(column(&header, &row, "POOL"), "1/1");
    let described = ok(&["kubectl", "describe", "hostportallocation", &row[0]]);
    assert!(described.contains("PodAnnotated") && described.contains("lists these ports"), "{described}");

    // Weft NetworkPolicies: priority, selected pods, accepted or why not.
    let policies = std::env::temp_dir().join(format!("weft-kubectl-policies-{}.yaml", std::process::id()));
    std::fs::write(
        &policies,
        "apiVersion: weft.dev/v1alpha1\nkind: NetworkPolicy\nmetadata: {name: guard, namespace: default}\n\
         spec:\n  priority: 100\n  podSelector: {}\n  ingress:\n  - action: Allow\n\
         ---\napiVersion: weft.dev/v1alpha1\nkind: NetworkPolicy\nmetadata: {name: broken, namespace: default}\n\
         spec:\n  ingress:\n  - action: Deny\n    peers:\n    - ipBlock: {cidr: 10.0.0.0/8, except: [192.168.0.0/16]}\n",
    )
    .expect("policy file");
    ok(&["kubectl", "apply", "-f", policies.to_str().expect("path")]);
    let _ = std::fs::remove_file(&policies);
    let (header, rows) = wait::until("both policies to have a status", Duration::from_secs(60), || {
        let (header, rows) = table(&["kubectl", "get", "networkpolicies.weft.dev"]);
        (rows.len() == 2 && rows.iter().all(|r| column(&header, r, "ACCEPTED") != "<none>")).then_some((header, rows))
    });
    assert_eq!(header, ["NAME", "PRIORITY", "PODS", "ACCEPTED", "AGE"]);
    let guard = rows.iter().find(|r| r[0] == "guard").expect("guard");
    assert_eq!((column(&header, guard, "PRIORITY"), column(&header, guard, "PODS")), ("100", "1"));
    assert_eq!(column(&header, guard, "ACCEPTED"), "True");
    let broken = rows.iter().find(|r| r[0] == "broken").expect("broken");
    assert_eq!(column(&header, broken, "ACCEPTED"), "False");
    let described = ok(&["kubectl", "describe", "networkpolicies.weft.dev", "broken"]);
    assert!(described.contains("192.168.0.0/16 is not strictly inside cidr 10.0.0.0/8"), "{described}");

    // An exhausted range: the ADD fails and the pod's Events say why.
    let (success, out) =
        run(&["add-pod", "more", "--node", "node-1", "-p", "http=8080/tcp", "-a", "weft.dev/host-ports=http"]);
    assert!(!success && out.contains("no free TCP host port left in 20000-20000"), "{out}");
    let events = wait::until("the Warning Event", Duration::from_secs(30), || {
        let out = ok(&["kubectl", "get", "events", "--field-selector", "involvedObject.name=more"]);
        out.contains("HostPortsExhausted").then_some(out)
    });
    assert!(events.contains("Warning") && events.contains("no free TCP host port left in 20000-20000"), "{events}");
}
