//! Fails when `crds/` no longer matches the Rust types.

use std::path::Path;

#[test]
fn generated_crds_match_the_types() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    let mut stale = Vec::new();
    for crd in weft_api::crds() {
        let name = weft_api::crd_file_name(&crd);
        let want = weft_api::crd_yaml(&crd).expect("CRD serialises");
        let have = std::fs::read_to_string(dir.join(&name)).unwrap_or_default();
        if have != want {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "crds/ is out of date ({}); regenerate with: cargo run -p weft-api --bin crdgen -- crds/",
        stale.join(", ")
    );
}

#[test]
fn crds_have_expected_shape() {
    let crds = weft_api::crds();
    let subnet = &crds[0];
    assert_eq!(subnet.spec.scope, "Cluster");
    assert_eq!(subnet.spec.names.short_names.as_deref(), Some(&["wsn".to_string()][..]));
    let json = serde_json::to_string(subnet).expect("serialises");
    for needle in ["isCIDR(self)", "self == oldSelf", "x-kubernetes-list-map-keys", "\"status\":{}"] {
        assert!(json.contains(needle), "Subnet CRD lacks {needle}");
    }
    assert_eq!(crds[1].spec.scope, "Namespaced");
    assert_eq!(crds[2].spec.scope, "Namespaced");
}
