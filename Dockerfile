# syntax=docker/dockerfile:1
# Weft images, built from the workspace root:
#   docker build --target agent    -t ghcr.io/weft/weft-agent:0.1.0 .
#   docker build --target operator -t ghcr.io/weft/weft-operator:0.1.0 .
# The chart (charts/weft) uses these two images; the agent image also carries
# weft-cni, which the DaemonSet's init container copies to the host, and the
# `weft` CLI (`kubectl exec ds/weft-agent -- weft flows`).

ARG RUST_VERSION=1.89
ARG DEBIAN_RELEASE=bookworm

# ---- builder: release builds of the four binaries (weft-cni static) -----------
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=weft-target \
    cargo build --release --locked -p weft-agent -p weft-operator \
 && cni=$(cni-plugin/build-static.sh) \
 && mkdir -p /out \
 && cp target/release/weft-agent target/release/weft target/release/weft-operator "$cni" /out/

# ---- agent: root, host network, programs links, routes and nftables ----------
FROM debian:${DEBIAN_RELEASE}-slim AS agent
# The programs the agent executes (e2e/tests/images.rs checks the image has each):
# nftables: masquerading, host ports and policy (nft -j); iptables and ipset:
# only to remove what iptables-era agents left on a node (an upgrade in place);
# conntrack: flushing stale UDP entries of host ports. iproute2 is not needed: the agent speaks netlink
# itself. ca-certificates: TLS to the apiserver.
RUN apt-get update \
 && apt-get install -y --no-install-recommends nftables iptables ipset conntrack ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/weft-agent /out/weft-cni /out/weft /usr/local/bin/
# Runs as root: it owns /run/weft, /var/lib/weft and the host's CNI directories
# and needs CAP_NET_ADMIN/CAP_SYS_ADMIN (see charts/weft/templates/agent-daemonset.yaml).
USER 0:0
ENTRYPOINT ["/usr/local/bin/weft-agent"]

# ---- operator: an API client only, so unprivileged ---------------------------
FROM debian:${DEBIAN_RELEASE}-slim AS operator
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/weft-operator /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/weft-operator"]
