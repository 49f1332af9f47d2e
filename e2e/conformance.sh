#!/usr/bin/env bash
# Kubernetes' own network tests (upstream e2e.test) and SIG Network's
# ClusterNetworkPolicy conformance suite against Weft on the real-node
# cluster, then a table: suite, passed, failed, skipped (each skip with its
# reason), wall time. Exits non-zero on any failure.
#
# Usage: e2e/conformance.sh [netpol] [network-conformance] [sig-network] [cnp]
#   (default: netpol, network-conformance and cnp, the part CI runs)
# Uses the running cluster (e2e/cluster.sh up) if there is one; otherwise
# brings one up, with ClusterNetworkPolicy enforced and its experimental CRDs
# (what cnp needs), and takes it down again afterwards. Reports, logs and the
# table: target/conformance/. What is skipped and why: docs/conformance.md.
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
  e2e/cluster.sh up --set clusterNetworkPolicy.enforce=true --set clusterNetworkPolicy.installCRDs=true \
    --set clusterNetworkPolicy.crdChannel=experimental
fi
target/debug/weft-conformance "$@"
