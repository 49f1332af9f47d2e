#!/usr/bin/env bash
# Installs the machine packages Weft's build, tests and sandbox need (Debian).
# Idempotent: packages already present are not reinstalled.
set -euo pipefail

packages=(
  iproute2 nftables iptables ipset conntrack ethtool iputils-ping curl   # dataplane and probes
  protobuf-compiler                                            # tonic-prost-build
  containernetworking-plugins                                  # reference plugins (peer)
  iperf3 prometheus                                            # benchmarks and scraping
  wireguard-tools                                              # wg: configures the stock WireGuard peer
  runc mmdebstrap                                              # real nodes and their images
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup-machine: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup-machine: cargo (Rust) is required" >&2; exit 1; }
command -v go >/dev/null || { echo "setup-machine: go is required to build the control plane" >&2; exit 1; }
