//! The generated CRDs install on a real apiserver, and the schema rejects
//! invalid objects with messages a user understands.

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use weft_api::{HostPortAllocation, NetworkPolicy, Subnet};
use weft_e2e::control_plane::{ControlPlane, install_crds, new_namespace, unique_name};

async fn setup() -> Option<Client> {
    let cp = ControlPlane::shared()?;
    let client = cp.client().await.expect("client");
    install_crds(&client).await.expect("CRDs install");
    Some(client)
}

/// Creates `obj` (untyped, so the client does not reject it first) as a `K`
/// and returns the apiserver's rejection message.
async fn rejection<K>(api: &Api<K>, obj: Value) -> String
where
    K: kube::Resource<DynamicType = ()> + Clone,
{
    let ar = ApiResource::erase::<K>(&());
    let raw: Api<DynamicObject> = match obj["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(api.clone().into_client(), ns, &ar),
        None => Api::all_with(api.clone().into_client(), &ar),
    };
    let obj: DynamicObject = serde_json::from_value(obj).expect("object is well-formed JSON");
    match raw.create(&PostParams::default(), &obj).await {
        Ok(created) => panic!("apiserver accepted an invalid object: {created:?}"),
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "expected 422 Invalid, got {status:?}");
            status.message
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}

fn subnet(name: &str, cidr: &str) -> Value {
    json!({
        "apiVersion": "weft.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": name},
        "spec": {"nodeName": name, "cidr": cidr, "backend": "vxlan"}
    })
}

#[tokio::test]
async fn crds_install_and_are_served() {
    let Some(client) = setup().await else { return };
    let names = install_crds(&client).await.expect("second install is idempotent");
    // Weft's own, then the ClusterNetworkPolicy CRD the chart vendors.
    let expected = [
        "hostportallocations.weft.dev",
        "networkpolicies.weft.dev",
        "podendpoints.weft.dev",
        "subnets.weft.dev",
        "clusternetworkpolicies.policy.networking.k8s.io",
    ];
    assert_eq!(names, expected.map(String::from).to_vec());
    let subnets: Api<Subnet> = Api::all(client.clone());
    let name = unique_name("valid");
    let created = subnets
        .create(&PostParams::default(), &serde_json::from_value(subnet(&name, "10.250.7.0/24")).expect("subnet"))
        .await
        .expect("a valid Subnet is accepted");
    assert_eq!(created.spec.cidr, "10.250.7.0/24");
    // IPv6 leases are accepted by the schema too.
    let v6 = unique_name("valid6");
    subnets
        .create(&PostParams::default(), &serde_json::from_value(subnet(&v6, "fd00:10:244:1::/64")).expect("subnet"))
        .await
        .expect("an IPv6 Subnet is accepted");
    for n in [name, v6] {
        subnets.delete(&n, &DeleteParams::default()).await.expect("delete");
    }
}

#[tokio::test]
async fn subnet_with_bad_cidr_is_rejected() {
    let Some(client) = setup().await else { return };
    let subnets: Api<Subnet> = Api::all(client);
    let msg = rejection(&subnets, subnet(&unique_name("bad"), "10.300.0.0/24")).await;
    assert!(msg.contains("cidr must be a valid CIDR such as 10.244.1.0/24"), "message: {msg}");
    let msg = rejection(&subnets, subnet(&unique_name("bad"), "not-a-cidr-at-all")).await;
    assert!(msg.contains("cidr must be a valid CIDR"), "message: {msg}");
    let msg = rejection(&subnets, subnet(&unique_name("bad"), "10.244.1.5/24")).await;
    assert!(msg.contains("host bits must be zero"), "message: {msg}");
    let msg = rejection(
        &subnets,
        json!({"apiVersion": "weft.dev/v1alpha1", "kind": "Subnet", "metadata": {"name": unique_name("bad")},
               "spec": {"nodeName": "n", "cidr": "10.244.1.0/24", "backend": "geneve"}}),
    )
    .await;
    assert!(msg.contains("spec.backend") && msg.contains("\"vxlan\", \"host-gw\""), "message: {msg}");
}

#[tokio::test]
async fn subnet_immutable_fields_stay_immutable() {
    let Some(client) = setup().await else { return };
    let subnets: Api<Subnet> = Api::all(client);
    let name = unique_name("immutable");
    subnets
        .create(&PostParams::default(), &serde_json::from_value(subnet(&name, "10.250.8.0/24")).expect("subnet"))
        .await
        .expect("create");
    let pp = PatchParams::default();
    let err = subnets
        .patch(&name, &pp, &Patch::Merge(json!({"spec": {"cidr": "10.250.9.0/24"}})))
        .await
        .expect_err("changing cidr must be rejected");
    assert!(err.to_string().contains("cidr is immutable"), "error: {err}");
    let err = subnets
        .patch(&name, &pp, &Patch::Merge(json!({"spec": {"nodeName": "someone-else"}})))
        .await
        .expect_err("changing nodeName must be rejected");
    assert!(err.to_string().contains("nodeName is immutable"), "error: {err}");
    // The backend may change (e.g. a cluster-wide switch).
    let patched = subnets
        .patch(&name, &pp, &Patch::Merge(json!({"spec": {"backend": "host-gw"}})))
        .await
        .expect("backend is mutable");
    assert_eq!(patched.spec.backend, weft_api::Backend::HostGw);
    // Status goes through the status subresource and is validated too.
    let err = subnets
        .patch_status(&name, &pp, &Patch::Merge(json!({"status": {"vtepMAC": "not-a-mac"}})))
        .await
        .expect_err("bad MAC");
    assert!(err.to_string().contains("status.vtepMAC"), "error: {err}");
    let ok = subnets
        .patch_status(
            &name,
            &pp,
            &Patch::Merge(json!({"status": {"vtepMAC": "aa:bb:cc:dd:ee:ff", "nodeIP": "192.0.2.1"}})),
        )
        .await
        .expect("good status");
    assert_eq!(ok.status.and_then(|s| s.vtep_mac).as_deref(), Some("aa:bb:cc:dd:ee:ff"));
    subnets.delete(&name, &DeleteParams::default()).await.expect("delete");
}

/// A node waiting for space has a Subnet without a range: its range may be
/// set once, and never removed (as a set one is never changed).
#[tokio::test]
async fn a_subnet_without_a_range_gets_one_once_and_keeps_it() {
    let Some(client) = setup().await else { return };
    let subnets: Api<Subnet> = Api::all(client);
    let name = unique_name("waiting");
    let waiting = json!({"apiVersion": "weft.dev/v1alpha1", "kind": "Subnet", "metadata": {"name": name},
                         "spec": {"nodeName": name, "backend": "vxlan"}});
    let created = subnets
        .create(&PostParams::default(), &serde_json::from_value(waiting).expect("subnet"))
        .await
        .expect("create");
    assert!(created.spec.is_pending());
    let pp = PatchParams::default();
    let err = subnets
        .patch(&name, &pp, &Patch::Merge(json!({"spec": {"cidrs": ["10.250.10.0/24"]}})))
        .await
        .expect_err("cidrs without cidr");
    assert!(err.to_string().contains("cidrs[0] must equal cidr"), "error: {err}");
    let filled = subnets
        .patch(&name, &pp, &Patch::Merge(json!({"spec": {"cidr": "10.250.10.0/24"}})))
        .await
        .expect("a range is given once");
    assert_eq!(filled.spec.cidr, "10.250.10.0/24");
    let err = subnets
        .patch(&name, &pp, &Patch::Merge(json!({"spec": {"cidr": null}})))
        .await
        .expect_err("removing cidr must be rejected");
    assert!(err.to_string().contains("cidr cannot be removed"), "error: {err}");
    subnets.delete(&name, &DeleteParams::default()).await.expect("delete");
}

/// `cidrs` (dual-stack): one range per family, `cidr` first; a family may
/// be added to a single-stack lease, a listed range never changes.
#[tokio::test]
async fn subnet_cidrs_hold_one_range_per_family() {
    let Some(client) = setup().await else { return };
    let subnets: Api<Subnet> = Api::all(client);
    let with_cidrs = |cidr: &str, cidrs: Value| {
        let mut s = subnet(&unique_name("dual"), cidr);
        s["spec"]["cidrs"] = cidrs;
        s
    };
    let cases = [
        (
            with_cidrs("10.250.10.0/24", json!(["10.250.10.0/24", "10.250.11.0/24"])),
            "at most one range per address family",
        ),
        (with_cidrs("10.250.10.0/24", json!(["fd00:10::/64", "10.250.10.0/24"])), "cidrs[0] must equal cidr"),
        (with_cidrs("10.250.10.0/24", json!(["10.250.10.0/24", "fd00:10::1/64"])), "their host bits must be zero"),
        (with_cidrs("10.250.10.0/24", json!(["10.250.10.0/24", "fd00:zz::/64"])), "cidrs must be valid CIDRs"),
    ];
    for (obj, want) in cases {
        let msg = rejection(&subnets, obj).await;
        assert!(msg.contains(want), "want {want:?}, message: {msg}");
    }

    let name = unique_name("grow");
    let pp = PatchParams::default();
    subnets
        .create(&PostParams::default(), &serde_json::from_value(subnet(&name, "10.250.12.0/24")).expect("subnet"))
        .await
        .expect("create");
    let grown = subnets
        .patch(&name, &pp, &Patch::Merge(json!({"spec": {"cidrs": ["10.250.12.0/24", "fd00:12::/64"]}})))
        .await
        .expect("a family may be added");
    assert_eq!(grown.spec.blocks().collect::<Vec<_>>(), ["10.250.12.0/24", "fd00:12::/64"]);
    for (cidrs, want) in [
        (json!(["10.250.12.0/24", "fd00:13::/64"]), "cannot be changed or removed"),
        (json!(["10.250.12.0/24"]), "cannot be changed or removed"),
        (Value::Null, "cidrs cannot be removed"),
    ] {
        let err = subnets
            .patch(&name, &pp, &Patch::Merge(json!({"spec": {"cidrs": cidrs}})))
            .await
            .expect_err("a listed range must stay");
        assert!(err.to_string().contains(want), "want {want:?}, error: {err}");
    }
    subnets.delete(&name, &DeleteParams::default()).await.expect("delete");
}

#[tokio::test]
async fn host_port_allocation_ranges_are_enforced() {
    let Some(client) = setup().await else { return };
    let ns = new_namespace(&client, "crd-hpa").await.expect("namespace");
    let api: Api<HostPortAllocation> = Api::namespaced(client, &ns);
    let obj = |host_port: i64| {
        json!({"apiVersion": "weft.dev/v1alpha1", "kind": "HostPortAllocation",
               "metadata": {"name": unique_name("hpa"), "namespace": ns},
               "spec": {"podRef": {"name": "web"}, "nodeName": "n1", "nodeIP": "192.0.2.1",
                        "ports": [{"protocol": "TCP", "containerPort": 80, "hostPort": host_port}]}})
    };
    let msg = rejection(&api, obj(70000)).await;
    assert!(msg.contains("spec.ports[0].hostPort") && msg.contains("65535"), "message: {msg}");
    let msg = rejection(&api, obj(0)).await;
    assert!(msg.contains("spec.ports[0].hostPort") && msg.contains("greater than or equal to 1"), "message: {msg}");
    let created = api
        .create(&PostParams::default(), &serde_json::from_value(obj(8080)).expect("hpa"))
        .await
        .expect("valid HostPortAllocation");
    assert_eq!(created.spec.ports[0].host_port, 8080);
    assert_eq!(created.namespace().as_deref(), Some(ns.as_str()));
}

#[tokio::test]
async fn network_policy_is_validated() {
    let Some(client) = setup().await else { return };
    let ns = new_namespace(&client, "crd-np").await.expect("namespace");
    let api: Api<NetworkPolicy> = Api::namespaced(client, &ns);
    let policy = |priority: i64, peer: Value, port: Value| {
        json!({"apiVersion": "weft.dev/v1alpha1", "kind": "NetworkPolicy",
               "metadata": {"name": unique_name("np"), "namespace": ns},
               "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "priority": priority,
                        "ingress": [{"action": "Deny", "peers": [peer], "ports": [port]}]}})
    };
    let good_peer = json!({"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}});
    let good_port = json!({"protocol": "TCP", "port": 5432});

    let msg = rejection(&api, policy(1001, good_peer.clone(), good_port.clone())).await;
    assert!(msg.contains("spec.priority") && msg.contains("1000"), "message: {msg}");
    let msg = rejection(&api, policy(10, json!({"ipBlock": {"cidr": "10.0.0.0/33"}}), good_port.clone())).await;
    assert!(msg.contains("ipBlock.cidr must be a valid CIDR"), "message: {msg}");
    let msg = rejection(&api, policy(10, json!({}), good_port.clone())).await;
    assert!(msg.contains("a peer needs podSelector, namespaceSelector or ipBlock"), "message: {msg}");
    let msg = rejection(&api, policy(10, good_peer.clone(), json!({"port": 100, "endPort": 50}))).await;
    assert!(msg.contains("endPort requires a numeric port and must not be below it"), "message: {msg}");
    let msg = rejection(&api, policy(10, good_peer.clone(), json!({"port": "http", "endPort": 50}))).await;
    assert!(msg.contains("endPort requires a numeric port"), "message: {msg}");
    let msg = rejection(&api, policy(10, good_peer.clone(), json!({"port": 0}))).await;
    assert!(msg.contains("port must be between 1 and 65535"), "message: {msg}");
    let msg = rejection(&api, policy(10, good_peer.clone(), json!({"protocol": "ICMP", "port": 1}))).await;
    assert!(msg.contains("protocol") && msg.contains("\"TCP\", \"UDP\", \"SCTP\""), "message: {msg}");
    let msg = rejection(
        &api,
        json!({"apiVersion": "weft.dev/v1alpha1", "kind": "NetworkPolicy",
               "metadata": {"name": unique_name("np"), "namespace": ns},
               "spec": {"ingress": [{"action": "Reject"}]}}),
    )
    .await;
    assert!(msg.contains("action") && msg.contains("\"Allow\", \"Deny\""), "message: {msg}");
    let msg =
        rejection(&api, policy(10, json!({"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}), good_port.clone()))
            .await;
    assert!(msg.contains("ipBlock cannot be combined with podSelector or namespaceSelector"), "message: {msg}");
    // Named ports and ranges are accepted.
    for port in [
        json!({"port": "http"}),
        json!({"protocol": "UDP", "port": 8000, "endPort": 8080}),
        json!({"protocol": "SCTP"}),
    ] {
        let obj = policy(10, good_peer.clone(), port.clone());
        api.create(&PostParams::default(), &serde_json::from_value(obj).expect("np"))
            .await
            .unwrap_or_else(|e| panic!("{port} must be accepted: {e}"));
    }
    let created = api
        .create(&PostParams::default(), &serde_json::from_value(policy(10, good_peer, good_port)).expect("np"))
        .await
        .expect("valid NetworkPolicy");
    assert_eq!(created.spec.priority, 10);
}
