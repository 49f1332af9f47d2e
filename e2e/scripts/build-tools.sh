#!/usr/bin/env bash
# Builds the pinned Kubernetes components, etcd, containerd and helm from Go
# modules and caches them by version. A second run with the same versions only
# checks the cache.
#
# Usage: e2e/scripts/build-tools.sh [--e2e-test | --flannel | --kwok | --print-dir]
#   --e2e-test  also Kubernetes' e2e.test and the ClusterNetworkPolicy
#               conformance suite (for e2e/conformance.sh)
#   --flannel   also flanneld, the peer of e2e/bench.sh overlay flannel
#   --kwok      also kwok, the simulated nodes of e2e/bench.sh scale
# Cache: ${WEFT_TOOLS_CACHE:-$HOME/.cache/weft/tools}/<name>-<version>/<binary>,
# linked from ${WEFT_TOOLS_CACHE}/bin.
set -euo pipefail

# The pinned versions (one file, read by the other scripts and tests too).
source "$(dirname "$0")/versions.sh"

cache=${WEFT_TOOLS_CACHE:-$HOME/.cache/weft/tools}
with_e2e_test=0 with_flannel=0 with_kwok=0
case ${1:-} in
  --print-dir) echo "$cache/bin" && exit 0 ;;
  --e2e-test) with_e2e_test=1 ;;
  --flannel) with_flannel=1 ;;
  --kwok) with_kwok=1 ;;
  "") ;;
  *) echo "usage: $0 [--e2e-test | --flannel | --kwok | --print-dir]" >&2 && exit 2 ;;
esac

log() { echo "build-tools: $*" >&2; }

# wrapper_module DIR NAME MODULE VERSION PACKAGES... [-- REPLACE_LINES...]
# Writes a throwaway module in DIR that requires MODULE and imports PACKAGES,
# so `go build` / `go test -c` can build them with this module's replaces.
wrapper_module() {
  local dir=$1 name=$2 module=$3 version=$4
  shift 4
  local pkgs=() r p
  while (($#)) && [[ $1 != -- ]]; do pkgs+=("$1"); shift; done
  (($#)) && shift
  {
    echo "module weft.dev/tools/$name"
    echo "go 1.25"
    echo "require $module $version"
    for r in "$@"; do echo "replace $r"; done
  } >"$dir/go.mod"
  {
    echo "package tools"
    for p in "${pkgs[@]}"; do echo "import _ \"$p\""; done
  } >"$dir/tools.go"
  (cd "$dir" && GOFLAGS=-mod=mod go mod tidy >/dev/null 2>&1 || true)
}

# build NAME VERSION MODULE LDFLAGS PACKAGES... [-- REPLACE_LINES...]
# Builds every main package inside one wrapper module that requires MODULE,
# into $cache/NAME-VERSION/, and links each binary from $cache/bin (as
# $link_as if set). Without cgo unless cgo=1.
build() {
  local name=$1 version=$2 module=$3 ldflags=$4
  shift 4
  local pkgs=()
  while (($#)) && [[ $1 != -- ]]; do pkgs+=("$1"); shift; done
  local out="$cache/$name-$version"
  if [[ ! -f $out/.complete ]]; then
    log "building $name $version: ${pkgs[*]##*/} (cached afterwards in $out)"
    local work
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    wrapper_module "$work" "$name" "$module" "$version" "${pkgs[@]}" "$@"
    rm -rf "$out.tmp" && mkdir -p "$out.tmp"
    (cd "$work" && GOFLAGS=-mod=mod CGO_ENABLED=${cgo:-0} go build -trimpath -tags no_btrfs \
      -ldflags="-s -w $ldflags" -o "$out.tmp/" "${pkgs[@]}")
    touch "$out.tmp/.complete"
    rm -rf "$out" && mv "$out.tmp" "$out"
  fi
  local p bin
  for p in "${pkgs[@]}"; do
    bin=${p##*/}
    # Some go versions name a binary whose path ends in a major version (/v3)
    # after the element before it.
    [[ -e $out/$bin ]] || { bin=${p%/*}; bin=${bin##*/}; }
    ln -sfn "$out/$bin" "$cache/bin/${link_as:-$bin}"
  done
}

# build_test NAME VERSION MODULE LDFLAGS PACKAGE [-- REPLACE_LINES...]
# `go test -c` of PACKAGE (a test binary such as Kubernetes' e2e.test) into
# $cache/NAME-VERSION/NAME, linked as $cache/bin/NAME.
build_test() {
  local name=$1 version=$2 module=$3 ldflags=$4 pkg=$5
  shift 5
  local out="$cache/$name-$version"
  if [[ ! -f $out/.complete ]]; then
    log "building $name $version: go test -c $pkg (cached afterwards in $out)"
    local work start=$SECONDS
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    wrapper_module "$work" "$name" "$module" "$version" "$pkg" "$@"
    rm -rf "$out.tmp" && mkdir -p "$out.tmp"
    (cd "$work" && GOFLAGS=-mod=mod CGO_ENABLED=0 go test -c -trimpath \
      -ldflags="-s -w $ldflags" -o "$out.tmp/$name" "$pkg")
    touch "$out.tmp/.complete"
    rm -rf "$out" && mv "$out.tmp" "$out"
    log "$name built in $((SECONDS - start)) s"
  fi
  ln -sfn "$out/$name" "$cache/bin/$name"
}

# build_cnp_conformance: `go test -c` of the policy API module's conformance
# suite, with Weft's patch (cnp-conformance.patch, which says why) applied to
# a copy of the module. The cache key holds the patch's hash: a changed patch
# is a new build.
build_cnp_conformance() {
  local name=cnp-conformance.test module=sigs.k8s.io/network-policy-api
  local patch key
  patch="$(cd "$(dirname "$0")" && pwd)/cnp-conformance.patch"
  key=$(sha256sum "$patch" | cut -c1-12)
  local out="$cache/$name-$NETWORK_POLICY_API_VERSION-$key"
  if [[ ! -f $out/.complete ]]; then
    log "building $name $NETWORK_POLICY_API_VERSION: go test -c ./conformance (cached afterwards in $out)"
    local work dir start=$SECONDS
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    dir=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "$module@$NETWORK_POLICY_API_VERSION" |
      sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    [[ -d $dir ]] || { log "go mod download $module@$NETWORK_POLICY_API_VERSION gave no directory"; return 1; }
    cp -r "$dir/." "$work/" && chmod -R u+w "$work"
    patch --quiet -d "$work" -p1 <"$patch"
    rm -rf "$out.tmp" && mkdir -p "$out.tmp"
    (cd "$work" && GOFLAGS=-mod=mod CGO_ENABLED=0 go test -c -trimpath -ldflags="-s -w" \
      -o "$out.tmp/$name" ./conformance)
    touch "$out.tmp/.complete"
    rm -rf "$out" && mv "$out.tmp" "$out"
    log "$name built in $((SECONDS - start)) s"
  fi
  ln -sfn "$out/$name" "$cache/bin/$name"
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

# Without these the binaries say v0.0.0-master and `kubectl version` fails.
minor=${K8S_VERSION#v1.}
minor=${minor%%.*}
k8s_ldflags=""
for v in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor"
  k8s_ldflags+=" -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
done

build kubernetes "$K8S_VERSION" k8s.io/kubernetes "$k8s_ldflags" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl \
  k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubelet \
  -- "${replaces[@]}"
link_as=etcd build etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 "" go.etcd.io/etcd/server/v3
build helm "$HELM_VERSION" helm.sh/helm/v3 "" helm.sh/helm/v3/cmd/helm
build containerd "$CONTAINERD_VERSION" github.com/containerd/containerd/v2 \
  "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
  github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/ctr \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
build coredns "$COREDNS_VERSION" github.com/coredns/coredns "" github.com/coredns/coredns
# A stock WireGuard peer (userspace, over TUN) for the wireguard backend.
link_as=wireguard-go build wireguard-go "$WIREGUARD_GO_VERSION" golang.zx2c4.com/wireguard "" golang.zx2c4.com/wireguard

# Kubernetes' own end-to-end tests (e2e/conformance.sh), same version as the
# cluster so that the tests expect these components and this agnhost tag.
if ((with_e2e_test)); then
  build_test e2e.test "$K8S_VERSION" k8s.io/kubernetes "$k8s_ldflags" \
    k8s.io/kubernetes/test/e2e -- "${replaces[@]}"
  # The ginkgo CLI of the version e2e.test is built with: it runs a suite's
  # tests in parallel processes, as Kubernetes' own CI does.
  build ginkgo "$GINKGO_VERSION" github.com/onsi/ginkgo/v2 "" github.com/onsi/ginkgo/v2/ginkgo
  # SIG Network's ClusterNetworkPolicy conformance suite (e2e/conformance.sh cnp).
  build_cnp_conformance
fi

# flannel itself, the closest peer (e2e/bench.sh overlay flannel): its udp
# and vxlan backends on the same namespace nodes as Weft's (its udp backend's
# packet loop is C: cgo).
if ((with_flannel)); then
  cgo=1 link_as=flanneld build flannel "$FLANNEL_VERSION" github.com/flannel-io/flannel \
    "-X github.com/flannel-io/flannel/pkg/version.Version=$FLANNEL_VERSION" github.com/flannel-io/flannel \
    -- "github.com/tencentcloud/tencentcloud-sdk-go/tencentcloud/vpc => $(cd "$(dirname "$0")" && pwd)/flannel-stubs/tencent-vpc"
fi


# kwok: a thousand nodes' kubelets in one process (e2e/bench.sh scale).
if ((with_kwok)); then
  build kwok "$KWOK_VERSION" sigs.k8s.io/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
    sigs.k8s.io/kwok/cmd/kwok
  # kwok does nothing without stages: the module's "fast" ones (nodes Ready
  # at once; pods Running with an address from their node's podCIDR,
  # completed and deleted), one file beside the binary.
  stages="$cache/kwok-$KWOK_VERSION/stages.yaml"
  if [[ ! -f $stages ]]; then
    dir=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
      sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    for f in node/fast/node-initialize pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
      cat "$dir/kustomize/stage/$f.yaml" && echo "---"
    done >"$stages.tmp"
    mv "$stages.tmp" "$stages"
  fi
  ln -sfn "$stages" "$cache/bin/kwok-stages.yaml"
fi

log "tools ready in $cache/bin"
