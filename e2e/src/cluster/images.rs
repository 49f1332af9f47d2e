//! The images nodes import: what `e2e/scripts/build-images.sh` wrote.

use std::path::PathBuf;

use anyhow::Context;

/// What every node imports as it starts: Weft's two images, the pause
/// image, cluster DNS and agnhost (what Weft's own tests run).
pub const CLUSTER: &[&str] = &["weft-agent.tar", "weft-operator.tar", "pause.tar", "coredns.tar", "agnhost.tar"];

/// The other images Kubernetes' own e2e tests run, imported by
/// `weft-conformance` before it runs them (about 450 MB a node that the
/// other tests do not need).
pub const UPSTREAM_TESTS: &[&str] =
    &["jessie-dnsutils.tar", "busybox.tar", "distroless-iptables.tar", "nginx.tar", "regression-issue-74839.tar"];

/// Where build-images.sh writes its tarballs (`$WEFT_IMAGES_DIR`, default
/// the workspace's `target/images`).
pub fn dir() -> PathBuf {
    std::env::var_os("WEFT_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/images"))
}

/// The tarballs of `names` (one of the lists above), failing with the
/// command that makes them.
pub fn tarballs(names: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let dir = dir();
    names
        .iter()
        .map(|name| {
            let path = dir.join(name);
            path.is_file()
                .then_some(path)
                .with_context(|| format!("{name} is missing in {}: run e2e/scripts/build-images.sh", dir.display()))
        })
        .collect()
}
