//! `weft explain` against the real apiserver: it reads the pods, namespaces
//! and policies there and names the policy and rule that decide a
//! connection, and refuses a malformed pod name before any request.

use std::process::Command;

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use weft_e2e::control_plane::operator::workspace_binary;
use weft_e2e::control_plane::{ControlPlane, install_crds, new_namespace};

/// Runs `weft explain` with the admin kubeconfig; its JSON, or its stderr.
fn explain(cp: &ControlPlane, args: &[&str]) -> Result<Value, String> {
    let bin = workspace_binary("weft").expect("weft is built");
    let out = Command::new(bin)
        .env("KUBECONFIG", &cp.kubeconfig)
        .arg("explain")
        .args(args)
        .args(["-o", "json"])
        .output()
        .expect("weft runs");
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).expect("JSON on stdout"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[tokio::test]
async fn explain_names_the_deciding_policy_from_the_api() {
    let Some(cp) = ControlPlane::shared() else { return };
    let client = cp.client().await.expect("client");
    install_crds(&client).await.expect("CRDs");
    let ns = new_namespace(&client, "explain").await.expect("namespace");
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("sa");
    let _ = Api::<ServiceAccount>::namespaced(client.clone(), &ns).create(&PostParams::default(), &sa).await;

    // Pods as a kubelet would report them: on a node, running, addressed.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for (name, app, ip) in [("web", "web", "10.244.1.5"), ("db", "db", "10.244.2.7"), ("tool", "tool", "10.244.1.9")] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]},
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("create pod");
        let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.expect("pod status");
    }
    let policies: Api<StandardPolicy> = Api::namespaced(client.clone(), &ns);
    let db_policy: StandardPolicy = serde_json::from_value(json!({
        "metadata": {"name": "db"},
        "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"app": "cache"}}}]},
            {"from": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": 5432}]}
        ]},
    }))
    .expect("policy");
    policies.create(&PostParams::default(), &db_policy).await.expect("create policy");

    let (web, db, tool) = (format!("{ns}/web"), format!("{ns}/db"), format!("{ns}/tool"));
    let allowed = explain(cp, &["--from", &web, "--to", &db, "--port", "5432"]).expect("explained");
    assert_eq!(allowed["allowed"], json!(true), "{allowed:#}");
    assert_eq!((allowed["from"].as_str(), allowed["to"].as_str()), (Some("10.244.1.5"), Some("10.244.2.7")));
    assert_eq!(
        allowed["ingress"]["decided"],
        json!({"by": "rule", "origin": format!("{ns}/db"), "rule": 1, "allow": true})
    );
    assert_eq!(allowed["egress"]["decided"], json!({"by": "notSelected"}));

    let denied = explain(cp, &["--from", &tool, "--to", &db, "--port", "5432/TCP"]).expect("explained");
    assert_eq!(denied["allowed"], json!(false), "{denied:#}");
    assert_eq!(denied["ingress"]["decided"], json!({"by": "defaultDeny"}));
    assert_eq!(denied["ingress"]["selectedBy"], json!([format!("{ns}/db")]));

    // By address: the pod holding it is found.
    let by_addr = explain(cp, &["--from", "10.244.1.5", "--to", &db, "--port", "5433"]).expect("explained");
    assert_eq!(by_addr["egress"]["pod"], json!(web));
    assert_eq!(by_addr["allowed"], json!(false), "port 5433 is not admitted: {by_addr:#}");

    let err = explain(cp, &["--from", "Bad_Name/x", "--to", &db, "--port", "80"]).expect_err("refused");
    assert!(err.contains("DNS-1123"), "{err}");
    let err = explain(cp, &["--from", &format!("{ns}/gone"), "--to", &db, "--port", "80"]).expect_err("refused");
    assert!(err.contains("not found on the pod network"), "{err}");
}
