#!/usr/bin/env bash
# The real-node Weft cluster: `e2e/cluster.sh up` installs what it needs,
# builds Kubernetes, containerd, Weft and its images, starts a control plane
# and two nodes (kubelet + containerd + kube-proxy each) and installs Weft with
# `helm install charts/weft`. Other commands: down, status, kubectl, helm,
# add-node, del-node, node-exec (`e2e/cluster.sh help`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == up ]]; then
  e2e/scripts/setup-machine.sh
  e2e/scripts/build-tools.sh
  cargo build --workspace --bins
  e2e/scripts/build-images.sh >/dev/null
fi
export WEFT_TOOLS_DIR="${WEFT_TOOLS_DIR:-$(e2e/scripts/build-tools.sh --print-dir)}"
exec target/debug/weft-cluster "$@"
