//! The images every node imports: what `e2e/scripts/build-images.sh` wrote.

use std::path::PathBuf;

use anyhow::Context;

/// The images a node needs: Weft's two, the pause image, cluster DNS and the
/// images of the upstream e2e tests.
pub const REQUIRED: &[&str] = &[
    "weft-agent.tar",
    "weft-operator.tar",
    "pause.tar",
    "coredns.tar",
    "agnhost.tar",
    "jessie-dnsutils.tar",
    "busybox.tar",
    "distroless-iptables.tar",
    "nginx.tar",
    "regression-issue-74839.tar",
];

/// Where build-images.sh writes its tarballs (`$WEFT_IMAGES_DIR`, default
/// the workspace's `target/images`).
pub fn dir() -> PathBuf {
    std::env::var_os("WEFT_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/images"))
}

/// The tarballs to import, failing with the command that makes them.
pub fn tarballs() -> anyhow::Result<Vec<PathBuf>> {
    let dir = dir();
    REQUIRED
        .iter()
        .map(|name| {
            let path = dir.join(name);
            path.is_file()
                .then_some(path)
                .with_context(|| format!("{name} is missing in {}: run e2e/scripts/build-images.sh", dir.display()))
        })
        .collect()
}
