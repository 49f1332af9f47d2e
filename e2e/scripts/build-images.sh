#!/usr/bin/env bash
# Builds Weft's container images without docker or a registry, as docker-archive
# tarballs (the `docker save` format) that `ctr -n k8s.io images import FILE`
# accepts, so a cluster on this machine can run them with imagePullPolicy Never.
#
#   ghcr.io/weft/weft-agent:<tag>      the Dockerfile's `agent` stage
#   ghcr.io/weft/weft-operator:<tag>   the Dockerfile's `operator` stage
#   registry.k8s.io/pause:<pause tag>  the sandbox image, from the Kubernetes source
#   registry.k8s.io/coredns/coredns:<version>  cluster DNS (binary from build-tools.sh)
#   registry.k8s.io/e2e-test-images/agnhost:<version>   for the Kubernetes e2e tests
#   registry.k8s.io/e2e-test-images/jessie-dnsutils:<version>   for their DNS tests
#   registry.k8s.io/e2e-test-images/{busybox,nginx,regression-issue-74839}:<version>
#   registry.k8s.io/build-image/distroless-iptables:<version>   the other images
#                      the sig-network tests run
#
# The Dockerfile stays the source of truth for the Weft images: this script
# reads each stage's runtime packages (its `apt-get install ...
# --no-install-recommends <pkgs>`), its `COPY --from=builder` binaries and
# destination, its USER and its ENTRYPOINT, and fails on an instruction it
# cannot mirror. The Debian base (debian:<release>-slim plus the packages) is
# made with mmdebstrap and cached; the binaries are a second layer.
#
# Usage: e2e/scripts/build-images.sh [agent|operator|pause|coredns|jessie-dnsutils|busybox|
#        distroless-iptables|nginx|regression-issue-74839|agnhost ...]
#        (default: all)
# Prints `<name:tag> <path>` per image on stdout; progress goes to stderr.
#
# Environment:
#   WEFT_IMAGE_TAG     tag of the Weft images (default dev)
#   WEFT_BIN_DIR       where weft-agent and weft-operator are (default target/debug;
#                      build them first: cargo build -p weft-agent -p weft-operator)
#   WEFT_STATIC_CNI    the static weft-cni (default: the path cni-plugin/build-static.sh
#                      prints, which builds it if needed)
#   WEFT_IMAGES_DIR    output directory (default target/images)
#   WEFT_IMAGES_CACHE  cache of base layers, pause, busybox and agnhost
#                      (default ~/.cache/weft/images)
#   WEFT_IDLE_WAIT     seconds to wait for a load average <= 1.5 before the
#                      agnhost Go build (default 1200; then it builds anyway, -p 1)
set -euo pipefail
umask 022

caller=$PWD
cd "$(dirname "$0")/../.."
root=$PWD

log() { echo "build-images: $*" >&2; }
die() { echo "build-images: error: $*" >&2; exit 1; }
# A path given in the environment is relative to the caller's directory.
abspath() { if [[ $1 == /* ]]; then echo "$1"; else echo "$caller/$1"; fi; }

tag=${WEFT_IMAGE_TAG:-dev}
target_dir=${CARGO_TARGET_DIR:+$(abspath "$CARGO_TARGET_DIR")}
target_dir=${target_dir:-$root/target}
bin_dir=${WEFT_BIN_DIR:+$(abspath "$WEFT_BIN_DIR")}
bin_dir=${bin_dir:-$target_dir/debug}
out_dir=${WEFT_IMAGES_DIR:+$(abspath "$WEFT_IMAGES_DIR")}
out_dir=${out_dir:-$target_dir/images}
cache=${WEFT_IMAGES_CACHE:-$HOME/.cache/weft/images}
dockerfile=$root/Dockerfile
arch=$(dpkg --print-architecture)
# debian:<release>-slim's PATH (Docker's default PATH).
default_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p "$out_dir/.layers" "$cache"
# Layers of the Weft binaries are remade each run (cheap, deterministic);
# only the archives and the cache stay.
trap 'rm -rf "$out_dir/.layers"' EXIT

# A version the cluster tools are built from (pinned in versions.sh).
tools_var() {
  local v
  v=$(sed -n "s/^$1=\([^ #]*\).*/\1/p" "$root/e2e/scripts/versions.sh" | head -n1)
  [[ -n $v ]] || die "no $1= in e2e/scripts/versions.sh"
  echo "$v"
}

# ---------------------------------------------------------------------------
# Reading the Dockerfile

# stage_text STAGE: the stage's instructions, continuation lines joined and
# comments dropped, one instruction per line.
stage_text() {
  awk -v stage="$1" '
    /^[[:space:]]*#/ { next }
    {
      line = $0
      if (line ~ /\\[[:space:]]*$/) { sub(/\\[[:space:]]*$/, "", line); buf = buf line " "; next }
      line = buf line; buf = ""
      if (line ~ /^[[:space:]]*$/) next
      n = split(line, f, /[[:space:]]+/)
      if (toupper(f[1]) == "FROM") { ins = (n >= 4 && tolower(f[n - 1]) == "as" && f[n] == stage) }
      if (ins) print line
    }' "$dockerfile"
}

# dockerfile_arg NAME: the default of a global ARG.
dockerfile_arg() {
  local v
  v=$(sed -n "s/^ARG $1=\(.*\)$/\1/p" "$dockerfile" | head -n1)
  [[ -n $v ]] || die "Dockerfile has no 'ARG $1=<default>'"
  echo "$v"
}

# Sets stage_pkgs, stage_bins (names), stage_bin_dest, stage_user and
# stage_entrypoint (JSON) from the Dockerfile's stage STAGE.
read_stage() {
  local stage=$1 text line instr words w a after args
  text=$(stage_text "$stage")
  [[ -n $text ]] || die "Dockerfile has no stage '... AS $stage'"
  stage_pkgs=() stage_bins=() stage_bin_dest="" stage_user="" stage_entrypoint=""
  while IFS= read -r line; do
    read -r instr _ <<<"$line"
    case ${instr^^} in
      FROM | ARG) ;;
      RUN)
        [[ $line == *"apt-get install"*"--no-install-recommends"* ]] ||
          die "stage $stage: cannot mirror '$line' (only the apt-get install RUN is understood)"
        after=0
        read -ra words <<<"${line#*--no-install-recommends}"
        for w in "${words[@]}"; do
          [[ $w == "&&" || $w == ";" || $w == "|" ]] && break
          [[ $w == -* ]] && continue
          stage_pkgs+=("$w")
          after=1
        done
        ((after)) || die "stage $stage: no packages after --no-install-recommends in '$line'"
        ;;
      COPY)
        args=()
        read -ra words <<<"${line#*[Cc][Oo][Pp][Yy]}"
        [[ $line == *--from=builder* ]] || die "stage $stage: cannot mirror '$line' (only COPY --from=builder)"
        for a in "${words[@]}"; do [[ $a == --* ]] || args+=("$a"); done
        ((${#args[@]} >= 2)) || die "stage $stage: malformed '$line'"
        stage_bin_dest=${args[-1]}
        [[ $stage_bin_dest == /*/ ]] || die "stage $stage: COPY destination must be a directory ending in /: '$line'"
        for a in "${args[@]:0:${#args[@]}-1}"; do stage_bins+=("${a##*/}"); done
        ;;
      USER) read -r _ stage_user <<<"$line" ;;
      ENTRYPOINT)
        stage_entrypoint=${line#*[Ee][Nn][Tt][Rr][Yy][Pp][Oo][Ii][Nn][Tt]}
        stage_entrypoint=${stage_entrypoint#"${stage_entrypoint%%[![:space:]]*}"}
        [[ $stage_entrypoint == \[*\] ]] || die "stage $stage: ENTRYPOINT must be the exec (JSON) form"
        ;;
      *) die "stage $stage: build-images.sh does not mirror '$instr' (teach it, or keep the stage simple)" ;;
    esac
  done <<<"$text"
  ((${#stage_pkgs[@]})) || die "stage $stage: no 'apt-get install ... --no-install-recommends <pkgs>' line found"
  ((${#stage_bins[@]})) || die "stage $stage: no 'COPY --from=builder ...' line found"
  [[ -n $stage_user ]] || die "stage $stage: no USER"
  [[ -n $stage_entrypoint ]] || die "stage $stage: no ENTRYPOINT"
}

# ---------------------------------------------------------------------------
# Layers and archives

# sha256_of FILE: the file's sha256, remembered next to it in FILE.sha256
# (trusted while it is newer than FILE).
sha256_of() {
  local f=$1
  if [[ -f $f.sha256 && $f.sha256 -nt $f ]]; then
    cat "$f.sha256"
  else
    sha256sum "$f" | cut -d' ' -f1 | tee "$f.sha256"
  fi
}

# dir_layer DIR OUT.tar: DIR's contents as a layer: owned by root, mtime 0,
# sorted, so the same files give the same digest.
dir_layer() {
  tar -C "$1" --owner=0 --group=0 --numeric-owner --mtime=@0 --sort=name --format=gnu \
    -cf "$2.tmp" .
  mv "$2.tmp" "$2"
}

# json_strings A B ...: a JSON array of the (plain) strings.
json_strings() {
  local s out=""
  for s in "$@"; do out+="${out:+,}\"$s\""; done
  echo "[$out]"
}

# docker_archive OUT NAME:TAG CONFIG_JSON LAYER.tar...
# Writes the `docker save` archive of an image with these layers (first the
# lowest) and CONFIG_JSON as its runtime config (Entrypoint, User, Env, ...).
# Skips the write when OUT already holds exactly this image.
docker_archive() {
  local out=$1 ref=$2 runtime=$3
  shift 3
  local work layer digest diff_ids=() layer_paths=()
  for layer in "$@"; do
    digest=$(sha256_of "$layer")
    diff_ids+=("sha256:$digest")
    layer_paths+=("$digest/layer.tar")
  done
  local config
  config=$(printf '{"architecture":"%s","os":"linux","created":"1970-01-01T00:00:00Z","config":%s,"rootfs":{"type":"layers","diff_ids":%s}}' \
    "$arch" "$runtime" "$(json_strings "${diff_ids[@]}")")
  local config_digest
  config_digest=$(printf '%s' "$config" | sha256sum | cut -d' ' -f1)
  local manifest
  manifest=$(printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":%s}]' \
    "$config_digest" "$ref" "$(json_strings "${layer_paths[@]}")")
  local key
  key=$(printf '%s\n%s\n' "$config" "$manifest" | sha256sum | cut -d' ' -f1)
  if [[ -f $out && -f $out.key && $(cat "$out.key") == "$key" ]]; then
    log "$ref: up to date ($out)"
    return
  fi
  work=$(mktemp -d)
  printf '%s' "$config" >"$work/$config_digest.json"
  printf '%s' "$manifest" >"$work/manifest.json"
  local i
  for i in "${!layer_paths[@]}"; do
    mkdir -p "$work/${layer_paths[i]%/layer.tar}"
    ln -s "$(realpath "${@:i+1:1}")" "$work/${layer_paths[i]}"
  done
  # -h: the layer symlinks are stored as the files they point to.
  tar -C "$work" -h --owner=0 --group=0 --numeric-owner --mtime=@0 --sort=name --format=gnu \
    -cf "$out.tmp" manifest.json "$config_digest.json" "${layer_paths[@]%/layer.tar}"
  rm -rf "$work"
  mv "$out.tmp" "$out"
  echo "$key" >"$out.key"
  log "$ref: wrote $out"
}

# runtime_config ENTRYPOINT_JSON USER [CMD_JSON]: the image's `config` object.
runtime_config() {
  printf '{"Entrypoint":%s,"User":"%s","Env":["PATH=%s"],"WorkingDir":"/"%s}' \
    "$1" "$2" "$default_path" "${3:+,\"Cmd\":$3}"
}

# ---------------------------------------------------------------------------
# Debian base layers

need_mmdebstrap() {
  command -v mmdebstrap >/dev/null && return
  log "installing mmdebstrap (Debian package)"
  apt-get install -y --no-install-recommends mmdebstrap >&2 ||
    { apt-get update >&2 && apt-get install -y --no-install-recommends mmdebstrap >&2; }
}

# base_layer STAGE RELEASE PKGS...: path of the cached layer: debian minbase
# with PKGS, trimmed like debian:<release>-slim (no docs but copyright, no man
# pages, info or locales, no apt lists), without /dev nodes.
# Cached as base-STAGE-<sha256 of the release and the sorted packages>.tar
# (and of base_recipe: change it when changing how the layer is made).
base_recipe=1
base_layer() {
  local stage=$1 release=$2
  shift 2
  local sorted key file
  sorted=$(printf '%s\n' "$@" | sort -u)
  key=$(printf '%s\n%s\n%s\n' "$base_recipe" "$release" "$sorted" | sha256sum | cut -c1-16)
  file=$cache/base-$stage-$key.tar
  if [[ ! -s $file ]]; then
    need_mmdebstrap
    log "mmdebstrap $release with: $(paste -sd' ' <<<"$sorted") (once; cached as $file)"
    local start=$SECONDS
    # The merged-usr hook sets up merged /usr as debootstrap (and so
    # debian:<release>-slim) does, with usr-is-merged: no usrmerge and perl.
    # shellcheck disable=SC2016 # the hooks' $1 is the chroot, expanded by mmdebstrap
    mmdebstrap --variant=minbase --include="$(paste -sd, <<<"$sorted")" \
      --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/groff/*' \
      --dpkgopt='path-exclude=/usr/share/lintian/*' \
      --dpkgopt='path-exclude=/usr/share/linda/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      --dpkgopt='path-include=/usr/share/locale/locale.alias' \
      --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --customize-hook='rm -f "$1/etc/hostname" && : >"$1/etc/resolv.conf"' \
      --customize-hook='rm -rf "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old "$1"/var/cache/ldconfig/aux-cache' \
      "$release" "$file.raw.tar" \
      "deb http://deb.debian.org/debian $release main" \
      "deb http://deb.debian.org/debian $release-updates main" \
      "deb http://deb.debian.org/debian-security $release-security main" \
      </dev/null >&2
    # Device nodes are the runtime's business, as in Docker's images.
    mmtarfilter '--path-exclude=/dev/*' <"$file.raw.tar" >"$file.tmp"
    rm -f "$file.raw.tar"
    mv "$file.tmp" "$file"
    log "base layer for $stage made in $((SECONDS - start)) s ($(du -h "$file" | cut -f1))"
  fi
  echo "$file"
}

# ---------------------------------------------------------------------------
# Binaries

static_cni() {
  if [[ -n ${WEFT_STATIC_CNI:-} ]]; then
    local p
    p=$(abspath "$WEFT_STATIC_CNI")
    [[ -x $p ]] || die "WEFT_STATIC_CNI=$WEFT_STATIC_CNI is not an executable"
    echo "$p"
  else
    log "static weft-cni: cni-plugin/build-static.sh"
    cni-plugin/build-static.sh
  fi
}

# binary_path NAME: where the Weft binary NAME comes from.
binary_path() {
  local p
  case $1 in
    weft-cni) p=$(static_cni) ;;
    *) p=$bin_dir/$1 ;;
  esac
  [[ -x $p ]] || die "$1 is not built ($p): cargo build -p weft-agent -p weft-operator (or set WEFT_BIN_DIR)"
  echo "$p"
}

# ---------------------------------------------------------------------------
# Images

# weft_image STAGE IMAGE_NAME
weft_image() {
  local stage=$1 name=$2
  read_stage "$stage"
  local release base
  release=$(dockerfile_arg DEBIAN_RELEASE)
  base=$(base_layer "$stage" "$release" "${stage_pkgs[@]}")
  local stage_dir=$out_dir/.layers/$name
  rm -rf "$stage_dir" && mkdir -p "$stage_dir$stage_bin_dest"
  local b path
  for b in "${stage_bins[@]}"; do
    path=$(binary_path "$b")
    install -m 0755 "$path" "$stage_dir$stage_bin_dest$b"
    # Debug builds carry ~60 MB of DWARF each, which every node would
    # import; symbols stay, so backtraces still name functions.
    strip --strip-debug "$stage_dir$stage_bin_dest$b"
  done
  dir_layer "$stage_dir" "$out_dir/.layers/$name-bin.tar"
  rm -rf "$stage_dir"
  docker_archive "$out_dir/$name.tar" "ghcr.io/weft/$name:$tag" \
    "$(runtime_config "$stage_entrypoint" "$stage_user")" \
    "$base" "$out_dir/.layers/$name-bin.tar"
  echo "ghcr.io/weft/$name:$tag $out_dir/$name.tar"
}

# The Kubernetes source of the pinned version (pause.c, agnhost, manifest.go).
k8s_dir() {
  local dir
  dir=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$(tools_var K8S_VERSION)" |
    sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  [[ -d $dir ]] || die "go mod download of k8s.io/kubernetes gave no source directory"
  echo "$dir"
}

pause_image() {
  local src ptag
  src=$(k8s_dir)/build/pause
  ptag=$(sed -n 's/^TAG ?= *\(.*\)$/\1/p' "$src/Makefile")
  [[ -n $ptag ]] || die "no 'TAG ?=' in $src/Makefile"
  local bin=$cache/pause-$ptag/pause
  if [[ ! -x $bin ]]; then
    mkdir -p "${bin%/*}"
    # The Makefile's CFLAGS (its VERSION adds `git describe`, absent in a module).
    gcc -Os -Wall -Werror -static -DVERSION="v$ptag" -o "$bin.tmp" "$src/linux/pause.c"
    strip "$bin.tmp"
    mv "$bin.tmp" "$bin"
  fi
  local dir=$out_dir/.layers/pause
  rm -rf "$dir" && mkdir -p "$dir"
  install -m 0755 "$bin" "$dir/pause"
  dir_layer "$dir" "$out_dir/.layers/pause.tar"
  rm -rf "$dir"
  docker_archive "$out_dir/pause.tar" "registry.k8s.io/pause:$ptag" \
    "$(runtime_config '["/pause"]' 65535:65535)" "$out_dir/.layers/pause.tar"
  echo "registry.k8s.io/pause:$ptag $out_dir/pause.tar"
}

# busybox: Debian's static busybox, from the .deb (not installed on the host).
busybox_bin() {
  local version
  version=$(apt-cache policy busybox-static | sed -n 's/^ *Candidate: //p')
  [[ -n $version && $version != "(none)" ]] || { apt-get update >&2; version=$(apt-cache policy busybox-static | sed -n 's/^ *Candidate: //p'); }
  local dir=$cache/busybox-${version//[:~]/_}
  if [[ ! -x $dir/busybox ]]; then
    local work
    work=$(mktemp -d)
    chmod 755 "$work" # apt downloads as _apt
    (cd "$work" && apt-get download "busybox-static=$version" >&2 && dpkg-deb -x ./*.deb x)
    mkdir -p "$dir"
    install -m 0755 "$work/x/bin/busybox" "$dir/busybox"
    rm -rf "$work"
  fi
  echo "$dir/busybox"
}

# Waits (bounded) until the machine is not busy: another Go build may run.
wait_for_idle() {
  local limit=${WEFT_IDLE_WAIT:-1200} waited=0 load
  while :; do
    read -r load _ </proc/loadavg
    awk -v l="$load" 'BEGIN { exit !(l <= 1.5) }' && return 0
    if ((waited >= limit)); then
      log "load still $load after ${waited}s: building anyway, one package at a time"
      return 1
    fi
    ((waited % 60 == 0)) && log "load average $load > 1.5: waiting (at most ${limit}s) before the agnhost build"
    sleep 15
    waited=$((waited + 15))
  done
}

# Builds the e2e test image program k8s.io/kubernetes/test/images/NAME (a
# package of the kubernetes module, not a module of its own) in a throwaway
# module that requires k8s.io/kubernetes and replaces its ./staging modules
# with the published ones, as e2e/scripts/build-tools.sh does.
# Usage: test_image_bin NAME VERSION
test_image_bin() {
  local name=$1 version=$2
  local out=$cache/$name-$version/$name
  if [[ ! -x $out ]]; then
    local k8s staging gomod work parallel=()
    k8s=$(tools_var K8S_VERSION)
    staging=$(tools_var STAGING_VERSION)
    wait_for_idle || parallel=(-p 1)
    gomod=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$k8s" |
      sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    work=$(mktemp -d)
    {
      echo "module weft.dev/images/$name"
      echo "go $(sed -n 's/^go //p' "$gomod")"
      echo "require k8s.io/kubernetes $k8s"
      sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$gomod" |
        while read -r m; do echo "replace $m => $m $staging"; done
    } >"$work/go.mod"
    log "building $name $version from k8s.io/kubernetes $k8s (once; cached as $out)"
    local start=$SECONDS
    mkdir -p "${out%/*}"
    (cd "$work" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build "${parallel[@]}" -trimpath \
      -ldflags="-s -w -X main.Version=$version" -o "$out.tmp" "k8s.io/kubernetes/test/images/$name")
    rm -rf "$work"
    mv "$out.tmp" "$out"
    log "$name built in $((SECONDS - start)) s"
  fi
  echo "$out"
}

# Layer 1 of the e2e test images: the programs agnhost's Dockerfile adds to
# its alpine base (`apk add bind-tools curl netcat-openbsd iproute2 iperf
# bash`), from Debian: the e2e tests run `curl`, `nc -u`, `dig`, `ss` and
# `iperf` inside agnhost pods, `dig` and `getent` in jessie-dnsutils pods.
# Plus GNU wget: the Service tests run `wget -q -O - -T 1` and Debian's
# busybox 1.35 `wget` dies with SIGSEGV whenever `-T` is given.
test_tools_layer() {
  base_layer agnhost "$(dockerfile_arg DEBIAN_RELEASE)" bash bind9-dnsutils curl netcat-openbsd iproute2 iperf wget
}

# e2e_image_version KEY NAME: the tag test/utils/image/manifest.go gives
# the e2e test image NAME (`configs[KEY] = Config{..., "NAME", "TAG"}`).
e2e_image_version() {
  local version
  version=$(sed -n "s/.*configs\[$1\] *= *Config{[^,]*, *\"$2\", *\"\([^\"]*\)\"}.*/\1/p" \
    "$(k8s_dir)/test/utils/image/manifest.go")
  [[ -n $version && $version != *$'\n'* ]] || die "no single configs[$1] entry for $2 in test/utils/image/manifest.go"
  echo "$version"
}

# jessie-dnsutils: the DNS tests' second prober, which runs `dig` and `getent`
# in shell loops. Upstream it is Debian jessie with dnsutils; here the same
# tools from the test layer (Debian bookworm).
jessie_dnsutils_image() {
  local version base ref
  version=$(e2e_image_version JessieDnsutils jessie-dnsutils)
  base=$(test_tools_layer)
  ref=registry.k8s.io/e2e-test-images/jessie-dnsutils:$version
  docker_archive "$out_dir/jessie-dnsutils.tar" "$ref" "$(runtime_config null "" '["/bin/bash"]')" "$base"
  echo "$ref $out_dir/jessie-dnsutils.tar"
}

# CoreDNS (cluster DNS of the real-node cluster), from the binary
# build-tools.sh builds, under the name kubeadm gives it.
# The CoreDNS binary build-tools.sh builds.
coredns_bin() {
  local bin
  bin=${WEFT_TOOLS_CACHE:-$HOME/.cache/weft/tools}/coredns-$(tools_var COREDNS_VERSION)/coredns
  [[ -x $bin ]] || die "$bin is missing: run e2e/scripts/build-tools.sh"
  echo "$bin"
}

coredns_image() {
  local version bin
  version=$(tools_var COREDNS_VERSION)
  bin=$(coredns_bin)
  local dir=$out_dir/.layers/coredns
  rm -rf "$dir" && mkdir -p "$dir/etc"
  install -m 0755 "$bin" "$dir/coredns"
  echo 'root:x:0:0:root:/:/coredns' >"$dir/etc/passwd"
  dir_layer "$dir" "$out_dir/.layers/coredns.tar"
  rm -rf "$dir"
  local ref=registry.k8s.io/coredns/coredns:$version
  docker_archive "$out_dir/coredns.tar" "$ref" "$(runtime_config '["/coredns"]' "")" "$out_dir/.layers/coredns.tar"
  echo "$ref $out_dir/coredns.tar"
}

agnhost_image() {
  local k8s version src
  k8s=$(k8s_dir)
  src=$k8s/test/images/agnhost
  version=$(e2e_image_version Agnhost agnhost)
  [[ $(cat "$src/VERSION") == "$version" ]] ||
    log "warning: the e2e tests expect agnhost $version, the source is $(cat "$src/VERSION")"
  log "agnhost version the e2e tests of $(tools_var K8S_VERSION) expect: $version"
  local busybox bin
  busybox=$(busybox_bin)
  bin=$(test_image_bin agnhost "$version")

  local base
  base=$(test_tools_layer)

  # Layer 2: busybox applets for the alpine commands Debian minbase lacks
  # (wget, nslookup, ping, ...), never shadowing a Debian program; the image's
  # users and groups; its own files.
  local dir=$out_dir/.layers/agnhost-base
  rm -rf "$dir" && mkdir -p "$dir"/{usr/bin,etc,uploads}
  install -m 0755 "$busybox" "$dir/usr/bin/busybox"
  local have applet
  have=$(tar -tf "$base" | sed -n 's#^\./##; s#^usr/##; s#^s\{0,1\}bin/\([^/]\{1,\}\)$#\1#p' | sort -u)
  for applet in $("$busybox" --list); do
    [[ $applet == busybox ]] || grep -qxF "$applet" <<<"$have" || ln -s busybox "$dir/usr/bin/$applet"
  done
  tar -xOf "$base" ./etc/passwd >"$dir/etc/passwd"
  tar -xOf "$base" ./etc/group >"$dir/etc/group"
  echo 'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh' >>"$dir/etc/passwd"
  printf '%s\n' 'user-defined-in-image:x:1000:' 'group-defined-in-image:x:50000:user-defined-in-image' \
    >>"$dir/etc/group"
  install -m 0644 "$src/porter/localhost.crt" "$src/porter/localhost.key" "$dir/"
  dir_layer "$dir" "$out_dir/.layers/agnhost-base.tar"
  rm -rf "$dir"
  # Layer 3: the binary (and the agnhost-2 link of the upstream image), and
  # /coredns as upstream's image has it (the DNS tests run it as a pod's
  # own DNS server).
  local coredns
  coredns=$(coredns_bin)
  dir=$out_dir/.layers/agnhost-bin
  rm -rf "$dir" && mkdir -p "$dir"
  install -m 0755 "$bin" "$dir/agnhost"
  ln -s agnhost "$dir/agnhost-2"
  install -m 0755 "$coredns" "$dir/coredns"
  dir_layer "$dir" "$out_dir/.layers/agnhost-bin.tar"
  rm -rf "$dir"
  local ref=registry.k8s.io/e2e-test-images/agnhost:$version
  docker_archive "$out_dir/agnhost.tar" "$ref" \
    "$(runtime_config '["/agnhost"]' "" '["pause"]')" \
    "$base" "$out_dir/.layers/agnhost-base.tar" "$out_dir/.layers/agnhost-bin.tar"
  echo "$ref $out_dir/agnhost.tar"
}

# busybox: upstream's image is busybox alone, its applets in /bin. The
# conntrack tests run `sh -c "... nc boom-server 9000 ..."` and init
# containers `sleep` in it.
busybox_image() {
  local version busybox dir
  version=$(e2e_image_version BusyBox busybox)
  busybox=$(busybox_bin)
  dir=$out_dir/.layers/busybox
  rm -rf "$dir" && mkdir -p "$dir/bin" "$dir/etc" "$dir/tmp"
  chmod 1777 "$dir/tmp"
  install -m 0755 "$busybox" "$dir/bin/busybox"
  local applet
  for applet in $("$busybox" --list); do
    [[ $applet == busybox ]] || ln -s busybox "$dir/bin/$applet"
  done
  printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' 'nobody:x:65534:65534:nobody:/home:/bin/false' >"$dir/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' >"$dir/etc/group"
  dir_layer "$dir" "$out_dir/.layers/busybox.tar"
  rm -rf "$dir"
  local ref=registry.k8s.io/e2e-test-images/busybox:$version
  docker_archive "$out_dir/busybox.tar" "$ref" "$(runtime_config null "" '["sh"]')" "$out_dir/.layers/busybox.tar"
  echo "$ref $out_dir/busybox.tar"
}

# regression-issue-74839: the conntrack test's server that sends an
# out-of-window TCP packet, built from the same Kubernetes source, on the
# test tools layer (upstream: Debian bookworm base).
regression_image() {
  local version bin base dir
  version=$(e2e_image_version RegressionIssue74839 regression-issue-74839)
  bin=$(test_image_bin regression-issue-74839 "$version")
  base=$(test_tools_layer)
  dir=$out_dir/.layers/regression
  rm -rf "$dir" && mkdir -p "$dir"
  install -m 0755 "$bin" "$dir/regression-issue-74839"
  dir_layer "$dir" "$out_dir/.layers/regression.tar"
  rm -rf "$dir"
  local ref=registry.k8s.io/e2e-test-images/regression-issue-74839:$version
  docker_archive "$out_dir/regression-issue-74839.tar" "$ref" \
    "$(runtime_config '["/regression-issue-74839"]' "")" "$base" "$out_dir/.layers/regression.tar"
  echo "$ref $out_dir/regression-issue-74839.tar"
}

# distroless-iptables: the KubeProxy test reads conntrack entries from a
# hostNetwork pod of this image (`which conntrack`, `conntrack -L | grep`).
# Upstream it is distroless with iptables and conntrack; here Debian's.
distroless_iptables_image() {
  local version base
  version=$(e2e_image_version DistrolessIptables distroless-iptables)
  base=$(base_layer distroless-iptables "$(dockerfile_arg DEBIAN_RELEASE)" conntrack iptables)
  local ref=registry.k8s.io/build-image/distroless-iptables:$version
  docker_archive "$out_dir/distroless-iptables.tar" "$ref" "$(runtime_config null "" '["/bin/sh"]')" "$base"
  echo "$ref $out_dir/distroless-iptables.tar"
}

# nginx: the Endpoints and EndpointSlice tests run it as a plain server.
# Upstream's is nginx 1.14 on Debian; here Debian bookworm's nginx.
nginx_image() {
  local version base
  version=$(e2e_image_version Nginx nginx)
  base=$(base_layer nginx "$(dockerfile_arg DEBIAN_RELEASE)" nginx-light)
  local ref=registry.k8s.io/e2e-test-images/nginx:$version
  docker_archive "$out_dir/nginx.tar" "$ref" \
    "$(runtime_config null "" '["nginx","-g","daemon off;"]')" "$base"
  echo "$ref $out_dir/nginx.tar"
}

# ---------------------------------------------------------------------------

all=(agent operator pause coredns jessie-dnsutils busybox distroless-iptables nginx regression-issue-74839 agnhost)
want=("$@")
((${#want[@]})) || want=("${all[@]}")
for w in "${want[@]}"; do
  [[ " ${all[*]} " == *" $w "* ]] || die "unknown image '$w' (${all[*]})"
done
# The Go-built test images last: their builds are the slow, heavy ones.
for w in "${all[@]}"; do
  [[ " ${want[*]} " == *" $w "* ]] || continue
  case $w in
    agent) weft_image agent weft-agent ;;
    operator) weft_image operator weft-operator ;;
    pause) pause_image ;;
    coredns) coredns_image ;;
    jessie-dnsutils) jessie_dnsutils_image ;;
    busybox) busybox_image ;;
    distroless-iptables) distroless_iptables_image ;;
    nginx) nginx_image ;;
    regression-issue-74839) regression_image ;;
    agnhost) agnhost_image ;;
  esac
done
