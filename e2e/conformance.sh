#!/usr/bin/env bash
# Kubernetes' own network tests (upstream e2e.test) against Weft on the
# real-node cluster, then a table: suite, passed, failed, skipped (each skip
# with its reason), wall time. Exits non-zero on any failure.
#
# Usage: e2e/conformance.sh [netpol] [network-conformance] [sig-network]
#   (default: netpol and network-conformance, the part CI runs)
# Uses the running cluster (e2e/cluster.sh up) if there is one; otherwise
# brings one up and takes it down again afterwards. Reports and the table:
# target/conformance/. What is skipped and why: docs/conformance.md.
set -euo pipefail
cd "$(dirname "$0")/.."

e2e/scripts/setup-machine.sh
e2e/scripts/build-tools.sh --e2e-test
export WEFT_TOOLS_DIR="${WEFT_TOOLS_DIR:-$(e2e/scripts/build-tools.sh --print-dir)}"
# The whole workspace, as e2e/test.sh and cluster.sh build it: one package
# alone unifies features differently and rebuilds dependencies.
cargo build --workspace --bins
if ! target/debug/weft-cluster status >/dev/null 2>&1; then
  trap 'target/debug/weft-cluster down' EXIT
  e2e/cluster.sh up
fi
target/debug/weft-conformance "$@"
