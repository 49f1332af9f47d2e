//! Locating the workspace's built binaries and the reference CNI plugins.

use std::path::PathBuf;

/// A binary built by `cargo build --workspace --bins`: `$WEFT_BIN_DIR/<name>`
/// or the workspace's `target/debug/<name>`.
pub fn weft(name: &str) -> PathBuf {
    let dir = std::env::var_os("WEFT_BIN_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
        target.join("debug")
    });
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` first (or set WEFT_BIN_DIR)",
        path.display()
    );
    path
}

/// weft-cni as it ships: the static build of `cni-plugin/build-static.sh`,
/// whose path `e2e/test.sh` exports as `WEFT_STATIC_CNI`.
pub fn static_cni() -> Option<PathBuf> {
    std::env::var_os("WEFT_STATIC_CNI").map(PathBuf::from).filter(|p| p.exists())
}

/// Directory of the reference CNI plugins (Debian containernetworking-plugins).
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

pub fn reference(name: &str) -> PathBuf {
    PathBuf::from(REFERENCE_PLUGINS).join(name)
}
