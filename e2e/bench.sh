#!/usr/bin/env bash
# Runs Weft's benchmarks (as root) against their peers in the same run and
# prints tables. Usage: e2e/bench.sh [cni|overlay|hostports|policy|all]
set -euo pipefail
cd "$(dirname "$0")/.."
e2e/scripts/setup-machine.sh
cargo build --release --workspace --bins
export WEFT_BIN_DIR="$PWD/target/release"
case "${1:-all}" in
  cni) cargo bench -p weft-e2e --bench cni_add_del ;;
  overlay) cargo build --workspace --bins && e2e/bench/overlay.sh ;;
  hostports)
    cargo bench -p weft-e2e --bench host_ports
    cargo test -p weft-agent --release thousand_host_port -- --ignored --nocapture ;;
  policy) cargo bench -p weft-e2e --bench policy_sync ;;
  all) cargo bench -p weft-e2e && cargo build --workspace --bins && e2e/bench/overlay.sh ;;
  *) echo "usage: e2e/bench.sh [cni|overlay|hostports|policy|all]" >&2; exit 2 ;;
esac
