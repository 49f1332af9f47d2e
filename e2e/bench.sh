#!/usr/bin/env bash
# Runs Weft's benchmarks (as root) against their peers in the same run and
# prints tables. Usage: e2e/bench.sh [cni|all]
set -euo pipefail
cd "$(dirname "$0")/.."
e2e/scripts/setup-machine.sh
cargo build --release --workspace --bins
export WEFT_BIN_DIR="$PWD/target/release"
case "${1:-all}" in
  cni) cargo bench -p weft-e2e --bench cni_add_del ;;
  all) cargo bench -p weft-e2e ;;
  *) echo "usage: e2e/bench.sh [cni|all]" >&2; exit 2 ;;
esac
