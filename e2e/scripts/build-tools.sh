#!/usr/bin/env bash
# Builds the pinned Kubernetes control plane (kube-apiserver, kubectl), etcd and
# helm from Go modules and caches them by version. A second run with the same
# versions only checks the cache.
#
# Usage: e2e/scripts/build-tools.sh [--print-dir]
# Cache: ${WEFT_TOOLS_CACHE:-$HOME/.cache/weft/tools}/<version>/<binary>
set -euo pipefail

# One Kubernetes minor throughout: k8s-openapi feature v1_35, this apiserver.
K8S_VERSION=v1.35.4
STAGING_VERSION=v0.35.4
# The etcd minor that Kubernetes 1.35 requires in its go.mod.
ETCD_VERSION=v3.6.5
HELM_VERSION=v3.19.0

cache=${WEFT_TOOLS_CACHE:-$HOME/.cache/weft/tools}
if [[ ${1:-} == --print-dir ]]; then
  echo "$cache/bin"
  exit 0
fi

log() { echo "build-tools: $*" >&2; }

# build NAME VERSION MODULE MAIN_PACKAGE [REPLACE_LINES...]
# Builds MAIN_PACKAGE inside a throwaway wrapper module that requires MODULE.
build() {
  local name=$1 version=$2 module=$3 pkg=$4
  shift 4
  local out="$cache/$name-$version"
  if [[ -x $out ]]; then
    ln -sf "$out" "$cache/bin/$name"
    return 0
  fi
  log "building $name $version (cached afterwards in $cache)"
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  {
    echo "module weft.dev/tools/$name"
    echo "go 1.25"
    echo "require $module $version"
    for r in "$@"; do echo "replace $r"; done
  } >"$work/go.mod"
  echo "package tools; import _ \"$pkg\"" >"$work/tools.go"
  (cd "$work" && GOFLAGS=-mod=mod go mod tidy >/dev/null 2>&1 || true)
  (cd "$work" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$out.tmp" "$pkg")
  mv "$out.tmp" "$out"
  ln -sf "$out" "$cache/bin/$name"
}

mkdir -p "$cache/bin"

# k8s.io/kubernetes points its staging modules at ./staging with version
# v0.0.0; replace each with its published module of the same minor.
k8s_replaces() {
  local modfile
  modfile=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$modfile" |
    while read -r m; do echo "$m => $m $STAGING_VERSION"; done
}
mapfile -t replaces < <(k8s_replaces)

build kube-apiserver "$K8S_VERSION" k8s.io/kubernetes k8s.io/kubernetes/cmd/kube-apiserver "${replaces[@]}"
build kubectl "$K8S_VERSION" k8s.io/kubernetes k8s.io/kubernetes/cmd/kubectl "${replaces[@]}"
build etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3
build helm "$HELM_VERSION" helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm

log "tools ready in $cache/bin"
