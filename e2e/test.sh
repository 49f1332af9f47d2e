#!/usr/bin/env bash
# Runs every Weft test on this machine (as root): unit tests, integration
# tests against a real kube-apiserver and etcd, the namespace-based e2e tests
# and the real-node cluster tests (kubelet + containerd, Weft from its chart),
# then Kubernetes' own network tests (e2e/conformance.sh). Installs what it
# needs first. Arguments go to `cargo test`; with any, the upstream suites are
# left out (run them with e2e/conformance.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

e2e/scripts/setup-machine.sh
e2e/scripts/build-tools.sh --e2e-test
export WEFT_TOOLS_DIR="$(e2e/scripts/build-tools.sh --print-dir)"

cargo build --workspace --bins
# weft-cni as it ships (static); e2e/tests/cni_single_node.rs runs it too.
export WEFT_STATIC_CNI="$(cni-plugin/build-static.sh)"
# The images the real-node cluster imports (e2e/tests/cluster_*.rs).
e2e/scripts/build-images.sh >/dev/null
# The Go-built tools and images are cached now; Go's own build cache (about
# 6 GB) is not needed again. CI machines may be short of disk: free it there.
if [[ ${CI:-} == true ]] && command -v go >/dev/null; then go clean -cache; fi
# e2e/tests/images.rs checks these same tarballs instead of building its own.
export WEFT_AGENT_IMAGE="$PWD/target/images/weft-agent.tar" WEFT_OPERATOR_IMAGE="$PWD/target/images/weft-operator.tar"
status=0
cargo test --workspace --no-fail-fast "$@" || status=$?
if (($# == 0)); then
  # Upstream suites: netpol, network-conformance, cnp (docs/conformance.md).
  e2e/conformance.sh || status=$?
fi
exit "$status"
