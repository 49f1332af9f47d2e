//! The operator's policy controllers against the real apiserver: weft.dev
//! NetworkPolicy `Accepted` with the validation problems the CRD schema
//! cannot see, `selectedPods` following pods and their labels; a Warning
//! Event on a standard NetworkPolicy the agents refuse as too large; the
//! PodEndpoints published for the agents.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use weft_api::{NetworkPolicy, PodEndpoint};
use weft_e2e::control_plane::operator::OperatorProcess;
use weft_e2e::control_plane::{ControlPlane, install_crds, new_namespace, unique_name, wait_for};

/// Pods need it, and no controller manager runs here to make it.
async fn add_default_service_account(client: &kube::Client, ns: &str) {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("sa");
    let _ = Api::<ServiceAccount>::namespaced(client.clone(), ns).create(&PostParams::default(), &sa).await;
}

/// An operator of its own: its cluster CIDR, its namespace's nodes and
/// lease (it shares the control plane with the other tests), and `extra`.
fn start_operator(cp: &ControlPlane, ns: &str, cidr: &str, extra: &[&str]) -> OperatorProcess {
    let mut args = vec![
        format!("--cluster-cidr={cidr}"),
        format!("--node-selector=weft.dev/e2e={ns}"),
        format!("--leader-election-namespace={ns}"),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    OperatorProcess::start(cp, &args).expect("operator starts")
}

fn accepted(p: &NetworkPolicy) -> Option<(String, String, String)> {
    let c = p.status.as_ref()?.conditions.iter().find(|c| c.type_ == "Accepted")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

#[tokio::test]
async fn operator_reports_acceptance_and_selected_pods() {
    let Some(cp) = ControlPlane::shared() else { return };
    let client = cp.client().await.expect("client");
    install_crds(&client).await.expect("CRDs");
    let ns = new_namespace(&client, "op-np").await.expect("namespace");
    add_default_service_account(&client, &ns).await;
    let _op = start_operator(cp, &ns, "10.213.0.0/16", &[]);

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for (name, app) in [("a", "web"), ("b", "web"), ("c", "db")] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("create pod");
    }
    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), &ns);
    let good = unique_name("web");
    let bad = unique_name("bad");
    for (name, spec) in [
        (&good, json!({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{"action": "Allow"}]})),
        (
            &bad,
            json!({"podSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]},
                   "egress": [{"action": "Deny", "peers": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.1.0.0/24"]}}]}]}),
        ),
    ] {
        let obj: NetworkPolicy =
            serde_json::from_value(json!({"apiVersion": "weft.dev/v1alpha1", "kind": "NetworkPolicy",
            "metadata": {"name": name}, "spec": spec}))
            .expect("policy");
        policies.create(&PostParams::default(), &obj).await.expect("the schema accepts it");
    }

    let status_is = |name: String, want: (&'static str, i32)| {
        let policies = policies.clone();
        async move {
            let p = policies.get(&name).await?;
            let selected = p.status.as_ref().map(|s| s.selected_pods);
            Ok(accepted(&p).is_some_and(|(s, _, _)| s == want.0) && selected == Some(want.1))
        }
    };
    wait_for(Duration::from_secs(30), "the valid policy accepted with 2 pods", || status_is(good.clone(), ("True", 2)))
        .await
        .expect("accepted");
    wait_for(Duration::from_secs(30), "the invalid policy rejected", || status_is(bad.clone(), ("False", 0)))
        .await
        .expect("rejected");
    let (_, reason, message) = accepted(&policies.get(&bad).await.expect("get")).expect("condition");
    assert_eq!(reason, "Invalid");
    assert!(message.contains("spec.podSelector.matchExpressions[0]: operator In needs values"), "{message}");
    assert!(
        message
            .contains("spec.egress[0].peers[0].ipBlock.except[0]: 10.1.0.0/24 is not strictly inside cidr 10.0.0.0/16"),
        "{message}"
    );

    // Pods gaining or losing the label, and deleted pods, change the count.
    pods.patch("c", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"app": "web"}}})))
        .await
        .expect("label");
    wait_for(Duration::from_secs(30), "3 selected pods", || status_is(good.clone(), ("True", 3))).await.expect("3");
    pods.delete("a", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await.expect("delete");
    wait_for(Duration::from_secs(30), "2 selected pods", || status_is(good.clone(), ("True", 2))).await.expect("2");

    // Fixing the invalid policy makes it accepted.
    let fix = json!({"spec": {"podSelector": {"matchLabels": {"app": "web"}, "matchExpressions": null},
        "egress": [{"action": "Deny", "peers": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/24"]}}]}]}});
    policies.patch(&bad, &PatchParams::default(), &Patch::Merge(fix)).await.expect("fix");
    wait_for(Duration::from_secs(30), "the fixed policy accepted", || status_is(bad.clone(), ("True", 2)))
        .await
        .expect("fixed");
    let p = policies.get(&bad).await.expect("get");
    assert_eq!(p.status.and_then(|s| s.observed_generation), p.metadata.generation);
}

#[tokio::test]
async fn operator_warns_about_a_standard_policy_the_agents_refuse() {
    let Some(cp) = ControlPlane::shared() else { return };
    let client = cp.client().await.expect("client");
    install_crds(&client).await.expect("CRDs");
    let ns = new_namespace(&client, "op-std").await.expect("namespace");
    let op = start_operator(cp, &ns, "10.214.0.0/16", &[]);
    // 700 excepts of an ipBlock: about 700 x 32 prefixes once cut out, over
    // the bound of 20,000; the apiserver takes it as valid.
    let excepts: Vec<String> = (0..700).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256)).collect();
    let policy: StandardPolicy = serde_json::from_value(json!({
        "metadata": {"name": "huge"},
        "spec": {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": excepts}}]}]},
    }))
    .expect("policy");
    let policies: Api<StandardPolicy> = Api::namespaced(client.clone(), &ns);
    policies.create(&PostParams::default(), &policy).await.expect("the apiserver accepts it");

    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let refused = || {
        let events = events.clone();
        async move {
            let list = events.list(&Default::default()).await?;
            Ok::<_, anyhow::Error>(list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some("PolicyRefused")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("huge")
            }))
        }
    };
    wait_for(Duration::from_secs(30), "a PolicyRefused Event on the policy", || async {
        Ok(refused().await?.is_some())
    })
    .await
    .expect("event");
    let e = refused().await.expect("list").expect("event");
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    let note = e.note.unwrap_or_default();
    assert!(note.contains("over Weft's bound of 20000") && note.contains("admits nothing"), "{note}");
    let gauge = || async {
        let (_, body) = op.http_get("/metrics").await?;
        Ok::<_, anyhow::Error>(body.lines().any(|l| l == "weft_operator_standard_network_policies_refused 1"))
    };
    wait_for(Duration::from_secs(10), "the refused-policy gauge at 1", gauge).await.expect("gauge");

    // Made small, it is enforced again: the gauge goes back to 0.
    let small =
        json!({"spec": {"ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]}]}});
    policies.patch("huge", &PatchParams::default(), &Patch::Merge(small)).await.expect("shrink");
    let zero = || async {
        let (_, body) = op.http_get("/metrics").await?;
        Ok::<_, anyhow::Error>(body.lines().any(|l| l == "weft_operator_standard_network_policies_refused 0"))
    };
    wait_for(Duration::from_secs(30), "the refused-policy gauge at 0", zero).await.expect("gauge 0");
}

/// A pod as the operator sees it: on node `n1` with an address once `ip` is given.
fn endpoint_pod(name: &str, app: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x", "ports": [{"name": "http", "containerPort": 8080}]}]},
    }))
    .expect("pod")
}

#[tokio::test]
async fn operator_publishes_a_pod_endpoint_per_addressed_pod_and_writes_only_what_policy_reads() {
    let Some(cp) = ControlPlane::shared() else { return };
    let client = cp.client().await.expect("client");
    install_crds(&client).await.expect("CRDs");
    let ns = new_namespace(&client, "op-wpe").await.expect("namespace");
    add_default_service_account(&client, &ns).await;
    let op = start_operator(cp, &ns, "10.215.0.0/16", &["--publish-pod-endpoints=true"]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let endpoints: Api<PodEndpoint> = Api::namespaced(client.clone(), &ns);
    let set_status = |name: &'static str, status: serde_json::Value| {
        let pods = pods.clone();
        async move {
            let patch = json!({"status": status});
            pods.patch_status(name, &PatchParams::default(), &Patch::Merge(patch)).await.expect("pod status");
        }
    };
    // One pod that never gets an address, then one that does.
    pods.create(&PostParams::default(), &endpoint_pod("pending", "web")).await.expect("pod");
    let web = pods.create(&PostParams::default(), &endpoint_pod("web", "web")).await.expect("pod");
    set_status("web", json!({"phase": "Running", "podIP": "10.215.1.5", "podIPs": [{"ip": "10.215.1.5"}]})).await;
    let endpoint_is = |name: &'static str, app: &'static str| {
        let endpoints = endpoints.clone();
        async move {
            Ok(endpoints
                .get_opt(name)
                .await?
                .is_some_and(|e| e.spec.labels.get("app").map(String::as_str) == Some(app)))
        }
    };
    wait_for(Duration::from_secs(30), "web's endpoint", || endpoint_is("web", "web")).await.expect("published");
    let e = endpoints.get("web").await.expect("endpoint");
    assert_eq!(e.spec.node_name, "n1");
    assert_eq!(e.spec.pod_ips, ["10.215.1.5".parse::<std::net::IpAddr>().expect("ip")]);
    assert_eq!((e.spec.ports[0].name.as_str(), e.spec.ports[0].port), ("http", 8080));
    let owner = &e.metadata.owner_references.as_ref().expect("owner")[0];
    assert_eq!((owner.kind.as_str(), Some(&owner.uid)), ("Pod", web.metadata.uid.as_ref()));
    assert!(endpoints.get_opt("pending").await.expect("get").is_none(), "a pod without an address is no endpoint");

    // Status updates that change nothing policy reads make no write.
    let applies = || op.metric("weft_operator_pod_endpoint_writes_total{op=\"apply\"} ");
    let before = applies().await.expect("the writes counter");
    for ready in ["False", "True", "False", "True"] {
        let conditions = json!({"conditions": [{"type": "Ready", "status": ready}]});
        set_status("web", conditions).await;
    }
    pods.patch("web", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"app": "db"}}})))
        .await
        .expect("relabel");
    wait_for(Duration::from_secs(30), "the new label published", || endpoint_is("web", "db")).await.expect("relabel");
    assert_eq!(applies().await, Some(before + 1.0), "one write: the label change, none for the status updates");

    // An endpoint changed by hand is put back; one without its pod goes.
    endpoints
        .patch("web", &PatchParams::default(), &Patch::Merge(json!({"spec": {"labels": {"app": "forged"}}})))
        .await
        .expect("forge");
    wait_for(Duration::from_secs(30), "the forged endpoint put back", || endpoint_is("web", "db"))
        .await
        .expect("put back");
    set_status("web", json!({"phase": "Succeeded"})).await;
    let gone = |name: &'static str| {
        let endpoints = endpoints.clone();
        async move { Ok(endpoints.get_opt(name).await?.is_none()) }
    };
    wait_for(Duration::from_secs(30), "a finished pod's endpoint deleted", || gone("web")).await.expect("deleted");
    set_status("pending", json!({"phase": "Running", "podIPs": [{"ip": "10.215.1.6"}]})).await;
    wait_for(Duration::from_secs(30), "pending's endpoint", || endpoint_is("pending", "web")).await.expect("published");
    pods.delete("pending", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
        .await
        .expect("delete");
    wait_for(Duration::from_secs(30), "a deleted pod's endpoint deleted", || gone("pending")).await.expect("deleted");
}
