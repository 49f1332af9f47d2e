#!/usr/bin/env bash
# Runs every Weft test on this machine (as root): unit tests, integration
# tests against a real kube-apiserver and etcd, and the namespace-based e2e
# tests. Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."

e2e/scripts/setup-machine.sh
e2e/scripts/build-tools.sh
export WEFT_TOOLS_DIR="$(e2e/scripts/build-tools.sh --print-dir)"

cargo build --workspace --bins
# weft-cni as it ships (static); e2e/tests/cni_single_node.rs runs it too.
export WEFT_STATIC_CNI="$(cni-plugin/build-static.sh)"
cargo test --workspace --no-fail-fast "$@"
