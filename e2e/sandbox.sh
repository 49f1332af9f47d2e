#!/usr/bin/env bash
# The Weft sandbox cluster. `e2e/sandbox.sh up` installs what it needs, builds
# Weft and the control plane, and starts a control plane, the operator and
# three nodes (network namespaces) each running weft-agent.
# Other commands: down, status, add-pod, del-pod, pods, exec, probe, kubectl
# (`e2e/sandbox.sh help`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == up ]]; then
  e2e/scripts/setup-machine.sh
  e2e/scripts/build-tools.sh
  cargo build --workspace --bins
fi
export WEFT_TOOLS_DIR="${WEFT_TOOLS_DIR:-$(e2e/scripts/build-tools.sh --print-dir)}"
exec target/debug/weft-sandbox "$@"
