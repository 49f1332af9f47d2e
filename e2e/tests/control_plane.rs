//! The control plane harness itself: it serves a TLS API with RBAC and an
//! admin token, and leaves nothing behind when dropped, also on a panic.

use std::path::Path;

use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use weft_e2e::control_plane::{ControlPlane, tools_dir, tools_present};

fn alive(pid: u32) -> bool {
    // A reaped child has no /proc entry; a zombie would show state Z.
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .is_ok_and(|s| !s.lines().any(|l| l.starts_with("State:") && l.contains('Z')))
}

#[test]
fn private_control_plane_serves_and_cleans_up_after_a_panic() {
    let what = format!("kube-apiserver and etcd in {}", tools_dir().display());
    if !weft_e2e::prereq::require(&what, tools_present()) {
        return;
    }
    let mut seen = (Vec::new(), None);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let cp = ControlPlane::start().expect("control plane starts");
        seen = (cp.pids(), cp.data_dir());
        assert!(cp.server.starts_with("https://127.0.0.1:"), "TLS on loopback: {}", cp.server);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let client = cp.client().await.expect("client");
            // The admin token maps to system:masters under RBAC.
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        verb: Some("delete".into()),
                        resource: Some("nodes".into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
                .create(&PostParams::default(), &review)
                .await
                .expect("access review");
            assert!(answer.status.is_some_and(|s| s.allowed), "admin may delete nodes");
            // The aggregation layer is configured: extension apiservers (the
            // operator's flows.weft.dev) learn the front proxy's CA and name here.
            let auth = Api::<ConfigMap>::namespaced(client, "kube-system")
                .get("extension-apiserver-authentication")
                .await
                .expect("extension-apiserver-authentication");
            let data = auth.data.unwrap_or_default();
            let ca = std::fs::read_to_string(&cp.pki.front_proxy_ca_cert).expect("front-proxy CA");
            assert_eq!(data.get("requestheader-client-ca-file").map(|s| s.trim()), Some(ca.trim()));
            assert_eq!(data.get("requestheader-allowed-names").map(String::as_str), Some(r#"["front-proxy-client"]"#));
            assert_eq!(data.get("requestheader-username-headers").map(String::as_str), Some(r#"["X-Remote-User"]"#));
        });
        panic!("deliberate panic with a running control plane");
    }));
    let panic = outcome.expect_err("the closure panics");
    // ... at the deliberate panic, not at a failed check before it.
    let message = panic.downcast_ref::<&str>().copied().or(panic.downcast_ref::<String>().map(String::as_str));
    assert_eq!(message, Some("deliberate panic with a running control plane"));
    let (pids, dir) = seen;
    assert_eq!(pids.len(), 2, "etcd and kube-apiserver were running");
    for pid in pids {
        assert!(!alive(pid), "process {pid} survived the panic");
    }
    let dir = dir.expect("data dir");
    assert!(!Path::new(&dir).exists(), "{} was not removed", dir.display());
}
