#!/usr/bin/env bash
# Runs Weft's benchmarks (as root) against their peers in the same run and
# prints tables. Usage: e2e/bench.sh [cni|overlay [SECTION...]|hostports|policy|scale|cluster|all]
set -euo pipefail
cd "$(dirname "$0")/.."
e2e/scripts/setup-machine.sh
cargo build --release --workspace --bins
# The release binaries, with weft-cni as it ships (static, see
# cni-plugin/build-static.sh), copied into place as the DaemonSet copies
# weft-cni onto a node (measured here: a copy execs about 0.2 ms faster than
# the file the linker wrote).
cni=$(cni-plugin/build-static.sh)
export WEFT_BIN_DIR="$PWD/target/bench-bin"
rm -rf "$WEFT_BIN_DIR" && mkdir -p "$WEFT_BIN_DIR"
find "$PWD/target/release" -maxdepth 1 -type f -perm -u+x -exec cp {} "$WEFT_BIN_DIR/" \;
cp "$cni" "$WEFT_BIN_DIR/weft-cni"
# The build leaves hundreds of MB of dirty pages; their writeback would land
# in the measurements (ADD writes a file).
sync
case "${1:-all}" in
  cni) cargo bench -p weft-e2e --bench cni_add_del ;;
  overlay) cargo build --workspace --bins && e2e/bench/overlay.sh "${@:2}" ;;
  hostports)
    cargo bench -p weft-e2e --bench host_ports
    cargo test -p weft-agent --release thousand_host_port -- --ignored --nocapture ;;
  policy) cargo bench -p weft-e2e --bench policy_sync ;;
  scale)
    # kwok simulates the nodes (WEFT_SCALE_NODES, default 100,250,500,1000).
    e2e/scripts/build-tools.sh --kwok
    cargo bench -p weft-e2e --bench scale ;;
  cluster)
    # Images with the release binaries; the bench brings its own cluster up.
    export WEFT_IMAGES_DIR="$PWD/target/bench-images"
    e2e/scripts/build-tools.sh
    e2e/scripts/build-images.sh >/dev/null
    cargo bench -p weft-e2e --bench pod_startup ;;
  all) e2e/scripts/build-tools.sh --kwok && cargo bench -p weft-e2e && cargo build --workspace --bins && e2e/bench/overlay.sh ;;
  *) echo "usage: e2e/bench.sh [cni|overlay|hostports|policy|scale|cluster|all]" >&2; exit 2 ;;
esac
