#!/usr/bin/env bash
# Copies the ClusterNetworkPolicy CRDs, byte for byte, from the pinned
# sigs.k8s.io/network-policy-api module (Go module proxy) into the chart:
# charts/weft/files/clusternetworkpolicies/{standard,experimental}.yaml.
# Run after changing NETWORK_POLICY_API_VERSION in versions.sh; the
# helm_chart tests check that the chart's copies are the module's.
#
# Usage: e2e/scripts/vendor-cnp-crds.sh [--check]   (--check: compare only)
set -euo pipefail
cd "$(dirname "$0")/../.."
source e2e/scripts/versions.sh
module=sigs.k8s.io/network-policy-api
dir=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "$module@$NETWORK_POLICY_API_VERSION" |
  sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
[[ -d $dir ]] || { echo "vendor-cnp-crds: cannot download $module@$NETWORK_POLICY_API_VERSION" >&2; exit 1; }
out=charts/weft/files/clusternetworkpolicies
mkdir -p "$out"
status=0
for channel in standard experimental; do
  src="$dir/config/crd/$channel/policy.networking.k8s.io_clusternetworkpolicies.yaml"
  if [[ ${1:-} == --check ]]; then
    cmp -s "$src" "$out/$channel.yaml" || { echo "$out/$channel.yaml differs from $src" >&2; status=1; }
  else
    install -m 0644 "$src" "$out/$channel.yaml"
  fi
done
exit $status
