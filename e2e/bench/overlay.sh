#!/usr/bin/env bash
# Cross-node pod-to-pod datapath benchmark (run via e2e/bench.sh overlay, as root).
# Compares, in the same run and between the same node namespaces:
#   weft vxlan   vs a hand-built kernel VXLAN (routed, no bridge), weft's pods
#                routed (--pod-attachment routed), then bridged (the default)
#   weft vxlan, IPv6 pod traffic (dual-stack, bridged pods) vs the hand-built
#                VXLAN carrying IPv6 to routed and to bridged pods, both over
#                the IPv4 underlay, then both over the IPv6 underlay
#                (--vxlan-underlay ipv6), then an IPv6-only cluster (up
#                --ipv6-only) vs VXLAN over IPv6, its pods bridged, then routed
#   weft host-gw vs plain routing over the underlay, pods bridged, then routed
#   weft vxlan with 100 NetworkPolicies (default deny plus allows) selecting
#                both pods vs the same path under no policy
# in interleaved rounds (e2e/bench/compare.py: this machine is noisy, so each
# round measures both), and measures overlay convergence (new peer Subnet ->
# route+FDB+neighbour on another node). Prints tables; asserts nothing.
#
# Usage: e2e/bench/overlay.sh [vxlan] [ipv6] [host-gw] (the sections to run;
# all by default). vxlan includes the policy cost and convergence.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECTIONS=" ${*:-vxlan ipv6 host-gw} "
want() { [[ $SECTIONS == *" $1 "* ]]; }
SBX=target/debug/weft-sandbox
ROUNDS=${ROUNDS:-12}
SECS=${SECS:-4}
export RUST_BACKTRACE=0
N1=weft-sbx-node-1 N2=weft-sbx-node-2

cleanup() {
  pkill -f "iperf3 -s -p 5301" 2>/dev/null || true
  for ns in bench-p1 bench-p2 bench-q1 bench-q2; do ip netns del "$ns" 2>/dev/null || true; done
  $SBX down >/dev/null 2>&1 || true
}
trap cleanup EXIT

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# Pod pairs (KEY:FROM_NETNS:TO_NETNS:ADDR each), interleaved; sets T/R/F/P[KEY],
# and for the first pair against each later one the paired ratios
# (compare.py --ratio) in PT/PR/PF[FIRST/LATER].
compare_pairs() {
  local k t r f runs first=${1%%:*} ratios=() x
  for x in "${@:2}"; do ratios+=(--ratio "$first/${x%%:*}"); done
  while read -r k t r f runs; do
    if [[ $k == */* ]]; then PT[$k]=$t PR[$k]=$r PF[$k]=$f; else T[$k]=$t R[$k]=$r F[$k]=$f P[$k]=$runs; fi
  done < <(python3 e2e/bench/compare.py --rounds "$ROUNDS" --secs "$SECS" "${ratios[@]}" "$@")
}

# Weft's pod pair against the baseline pair.
compare() {
  compare_pairs "$1:weft-sbx-pod-default-a:weft-sbx-pod-default-b:$B_IP" "$2:bench-p1:bench-p2:192.168.202.2"
}

# 100 NetworkPolicies in namespace bench-pol, all selecting role=bench: a
# default deny of both directions, 98 allows of a TCP port from and to an
# address block nobody uses (real rules in the pods' chains, matching
# nothing), and one allowing the bench pods everything between each other.
policies() {
  echo "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: bench-pol}
spec: {podSelector: {}, policyTypes: [Ingress, Egress]}"
  for i in $(seq 1 98); do
    echo "---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: unrelated-$i, namespace: bench-pol}
spec:
  podSelector: {matchLabels: {role: bench}}
  ingress: [{from: [{ipBlock: {cidr: 172.16.$i.0/24}}], ports: [{protocol: TCP, port: $((7000 + i))}]}]
  egress: [{to: [{ipBlock: {cidr: 172.16.$i.0/24}}], ports: [{protocol: TCP, port: $((7000 + i))}]}]"
  done
  echo "---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: zz-allow-bench, namespace: bench-pol}
spec:
  podSelector: {matchLabels: {role: bench}}
  ingress: [{from: [{podSelector: {matchLabels: {role: bench}}}]}]
  egress: [{to: [{podSelector: {matchLabels: {role: bench}}}]}]"
}

# In the running vxlan sandbox (bridged pods a and b): pods c (node-1) and d
# (node-2) under the 100 policies against a -> b under none, interleaved.
policy_cost() {
  $SBX kubectl create namespace bench-pol >/dev/null
  policies | $SBX kubectl apply -f - >/dev/null
  $SBX add-pod c -n bench-pol --node node-1 -l role=bench >/dev/null
  $SBX add-pod d -n bench-pol --node node-2 -l role=bench >/dev/null
  local c_ip d_ip
  c_ip=$($SBX pods | awk '$1=="bench-pol/c" {print $3}')
  d_ip=$($SBX pods | awk '$1=="bench-pol/d" {print $3}')
  # The policies are in the kernel once both pods' chains are mapped
  # (c's egress on node-1, d's ingress on node-2) and the deny holds.
  local ready=
  for _ in $(seq 1500); do
    if ip netns exec $N1 nft list map inet weft policy-egress 2>/dev/null | grep -q "$c_ip " \
      && ip netns exec $N2 nft list map inet weft policy-ingress 2>/dev/null | grep -q "$d_ip "; then ready=1; break; fi
    sleep 0.02
  done
  [ -n "$ready" ] || { echo "policies not applied within 30 s" >&2; exit 1; }
  if $SBX connect --from default/a "$d_ip:80" >/dev/null 2>&1; then
    echo "default/a reached bench-pol/d: the default deny is not in force" >&2; exit 1
  fi
  $SBX connect --from bench-pol/c "$d_ip:80" >/dev/null
  POLICY_RULES=$(ip netns exec $N2 nft list table inet weft | grep -c 'counter name "policy-count')
  compare_pairs "wpol:weft-sbx-pod-bench-pol-c:weft-sbx-pod-bench-pol-d:$d_ip" \
    "wnop:weft-sbx-pod-default-a:weft-sbx-pod-default-b:$B_IP"
}

# A baseline "pod" in node namespace $1: netns $2 with address $3, gateway
# $4 on the node side (IPv4 /24 or IPv6 /64, without DAD), MTU $5. The
# gateway is on the pod's own host veth (routed), or with $6 on a bridge of
# that name the host veth joins (bridged, as weft0 and the reference bridge
# plugin's cni0).
baseline_pod() {
  local node=$1 pod=$2 addr=$3 gw=$4 mtu=$5 bridge=${6:-} len=24 nodad=()
  if [[ $addr == *:* ]]; then len=64 nodad=(nodad); fi
  ip netns add "$pod"
  ip -n "$pod" link set lo up
  ip -n "$node" link add "b-$pod" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$pod"
  local gw_dev="b-$pod"
  if [[ $bridge ]]; then
    ip -n "$node" link show "$bridge" >/dev/null 2>&1 || ip -n "$node" link add "$bridge" mtu "$mtu" type bridge
    ip -n "$node" link set "b-$pod" master "$bridge"
    ip -n "$node" link set "$bridge" up
    gw_dev=$bridge
  fi
  ip -n "$node" addr add "$gw/$len" dev "$gw_dev" "${nodad[@]}"
  ip -n "$node" link set "b-$pod" up
  ip -n "$pod" addr add "$addr/$len" dev eth0 "${nodad[@]}"
  ip -n "$pod" link set eth0 up
  ip -n "$pod" route add default via "$gw"
}

two_pods() {
  $SBX add-pod a --node node-1 >/dev/null
  $SBX add-pod b --node node-2 >/dev/null
  B_IP=$($SBX pods | awk '$1=="default/b" {print $3}')
}

$SBX down >/dev/null 2>&1 || true
declare -A T R F P PT PR PF

# --- vxlan sandboxes: weft vxlan vs a hand-built VXLAN --------------------------
# Pods routed first (that sandbox comes down at once), then bridged (the
# default; convergence is measured in that one afterwards).
vxlan() {
  local weft=$1 base=$2; shift 2
  $SBX up --nodes 2 "$@" >/dev/null
  two_pods
  # Hand-built: a second VXLAN (VNI 99, port 4790) between the same node namespaces.
  ip -n $N1 link add bvx type vxlan id 99 dstport 4790 local 10.250.0.11 remote 10.250.0.12 dev eth0
  ip -n $N2 link add bvx type vxlan id 99 dstport 4790 local 10.250.0.12 remote 10.250.0.11 dev eth0
  ip -n $N1 addr add 172.31.99.1/30 dev bvx; ip -n $N1 link set bvx up
  ip -n $N2 addr add 172.31.99.2/30 dev bvx; ip -n $N2 link set bvx up
  baseline_pod $N1 bench-p1 192.168.201.2 192.168.201.1 1450
  baseline_pod $N2 bench-p2 192.168.202.2 192.168.202.1 1450
  ip -n $N1 route add 192.168.202.0/24 via 172.31.99.2
  ip -n $N2 route add 192.168.201.0/24 via 172.31.99.1
  compare "$weft" "$base"
}
if want vxlan; then
vxlan wvr kvr --agent-arg=--pod-attachment=routed
$SBX down >/dev/null
ip netns del bench-p1; ip netns del bench-p2
vxlan wv kv
policy_cost

# Convergence: a new node's Subnet with its VTEP data -> programmed on node-1.
KC() { $SBX kubectl "$@"; }
conv=()
for i in $(seq 1 15); do
  node="bench-peer-$i"
  KC create -f - >/dev/null <<YAML
apiVersion: v1
kind: Node
metadata: {name: $node}
YAML
  for _ in $(seq 500); do KC get subnet "$node" -o name >/dev/null 2>&1 && break; sleep 0.02; done
  cidr=$(KC get subnet "$node" -o jsonpath='{.spec.cidr}')
  mac=$(printf '02:57:0a:fa:01:%02x' "$i")
  # The clock starts once the API has accepted the data (kubectl's own start-up is not ours).
  KC patch subnet "$node" --subresource=status --type=merge \
    -p "{\"status\":{\"nodeIP\":\"10.250.0.$((100 + i))\",\"vtepMAC\":\"$mac\"}}" >/dev/null
  start=$(date +%s%N)
  for _ in $(seq 2000); do
    if ip -n $N1 route | grep -q "^$cidr " && ip netns exec $N1 bridge fdb show dev weft.1 | grep -q "$mac" \
      && ip -n $N1 neigh show dev weft.1 | grep -q "$mac"; then break; fi
    sleep 0.002
  done
  conv+=($(( ($(date +%s%N) - start) / 1000000 )))
  KC delete node "$node" >/dev/null
done
conv_median=$(printf '%s\n' "${conv[@]}" | median)
conv_max=$(printf '%s\n' "${conv[@]}" | sort -g | tail -1)
$SBX down >/dev/null
ip netns del bench-p1; ip netns del bench-p2
fi

# --- IPv6 vxlan sandboxes: IPv6 between pods vs hand-built VXLAN carrying IPv6 --
# vxlan_ipv6 KEY UNDERLAY [up args]. UNDERLAY: ipv4 (a dual-stack sandbox,
# VXLAN between the node IPs, MTU 1450), ipv6 (dual-stack, VXLAN between the
# nodes' IPv6 addresses fd00:250::b/::c, MTU 1430) or ipv6-only (an IPv6-only
# sandbox: IPv6 node IPs and pods, VXLAN over IPv6). Two hand-built pod pairs
# share the hand-built VXLAN: k$KEY routed (no bridge), b$KEY on a bridge at
# each end (bbr0, with bridge netfilter on as weft0 has it), so that each of
# weft's attachment modes meets the same topology built by hand.
vxlan_ipv6() {
  local weft=$1 underlay=$2 local1=10.250.0.11 local2=10.250.0.12 mtu=1450 column=4; shift 2
  local up=(--operator-arg=--secondary-cluster-cidr=fd00:10:244::/56
    --agent-arg=--ipv6-cluster-cidr=fd00:10:244::/56 --agent-arg=--vxlan-underlay=$underlay)
  if [[ $underlay != ipv4 ]]; then local1=fd00:250::b local2=fd00:250::c mtu=1430; fi
  # An IPv6-only pod's one address is in the IP column.
  if [[ $underlay == ipv6-only ]]; then up=(--ipv6-only) column=3; fi
  $SBX up --nodes 2 "${up[@]}" "$@" >/dev/null
  $SBX add-pod a --node node-1 >/dev/null
  $SBX add-pod b --node node-2 >/dev/null
  local b_ip6
  b_ip6=$($SBX pods | awk -v c=$column '$1=="default/b" {print $c}')
  [[ $b_ip6 == *:* ]] || { echo "pod b got no IPv6 address: $($SBX pods)" >&2; exit 1; }
  ip -n $N1 link add bvx type vxlan id 99 dstport 4790 local $local1 remote $local2 dev eth0
  ip -n $N2 link add bvx type vxlan id 99 dstport 4790 local $local2 remote $local1 dev eth0
  ip -n $N1 addr add fd00:99::1/64 dev bvx nodad; ip -n $N1 link set bvx up
  ip -n $N2 addr add fd00:99::2/64 dev bvx nodad; ip -n $N2 link set bvx up
  baseline_pod $N1 bench-p1 fd00:201::2 fd00:201::1 $mtu
  baseline_pod $N2 bench-p2 fd00:202::2 fd00:202::1 $mtu
  baseline_pod $N1 bench-q1 fd00:203::2 fd00:203::1 $mtu bbr0
  baseline_pod $N2 bench-q2 fd00:204::2 fd00:204::1 $mtu bbr0
  ip -n $N1 route add fd00:202::/64 via fd00:99::2
  ip -n $N1 route add fd00:204::/64 via fd00:99::2
  ip -n $N2 route add fd00:201::/64 via fd00:99::1
  ip -n $N2 route add fd00:203::/64 via fd00:99::1
  compare_pairs "$weft:weft-sbx-pod-default-a:weft-sbx-pod-default-b:$b_ip6" \
    "k$weft:bench-p1:bench-p2:fd00:202::2" "b$weft:bench-q1:bench-q2:fd00:204::2"
  $SBX down >/dev/null
  for ns in bench-p1 bench-p2 bench-q1 bench-q2; do ip netns del $ns; done
}
if want ipv6; then
vxlan_ipv6 wv6 ipv4
vxlan_ipv6 wv6u ipv6
vxlan_ipv6 wv6o ipv6-only
vxlan_ipv6 wv6or ipv6-only --agent-arg=--pod-attachment=routed
fi

# --- host-gw sandboxes: weft host-gw vs plain routing over the underlay ---------
# Once with pods on the bridge (the default), once routed (--pod-attachment
# routed); each against its own plain-routing baseline in the same sandbox.
host_gw() {
  local weft=$1 base=$2; shift 2
  $SBX up --nodes 2 --backend host-gw "$@" >/dev/null
  two_pods
  baseline_pod $N1 bench-p1 192.168.201.2 192.168.201.1 1500
  baseline_pod $N2 bench-p2 192.168.202.2 192.168.202.1 1500
  ip -n $N1 route add 192.168.202.0/24 via 10.250.0.12
  ip -n $N2 route add 192.168.201.0/24 via 10.250.0.11
  compare "$weft" "$base"
  $SBX down >/dev/null
  ip netns del bench-p1; ip netns del bench-p2
}
if want host-gw; then
host_gw wh pr
host_gw whr prr --agent-arg=--pod-attachment=routed
fi

row() { printf '| %-36s | %7s | %7s | %7s | %s |\n' "$@"; }
fig() { row "$2" "${T[$1]}" "${R[$1]}" "${F[$1]}" "${P[$1]}"; }
# The paired ratios of KEY against BASE (compare.py --ratio), two decimals.
ratios() {
  local k="$1/$2"
  row "$3" "$(printf %.2f "${PT[$k]}")" "$(printf %.2f "${PR[$k]}")" "$(printf %.2f "${PF[$k]}")" ""
}
# A weft row, its baseline's row and their ratios: pair KEY BASE_KEY LABEL BASE_LABEL RATIO_LABEL.
pair() { [[ ${T[$1]:-} ]] || return 0; fig "$1" "$3"; fig "$2" "$4"; ratios "$1" "$2" "$5"; }
# An IPv6 sandbox's three pairs: weft, the routed and the bridged baseline;
# the first ratio is against the baseline of weft's own attachment mode.
triple() {
  local key=$1 label=$2 mode=$3
  [[ ${T[$key]:-} ]] || return 0
  fig "$key" "$label"
  fig "k$key" "hand-built VXLAN, routed pods"
  fig "b$key" "hand-built VXLAN, bridged pods"
  if [[ $mode == routed ]]; then
    ratios "$key" "k$key" "ratio weft / hand-built, routed"
    ratios "$key" "b$key" "(weft / hand-built, bridged)"
  else
    ratios "$key" "b$key" "ratio weft / hand-built, bridged"
    ratios "$key" "k$key" "(weft / hand-built, routed)"
  fi
}
echo
echo "Pod-to-pod across nodes, ${ROUNDS} interleaved rounds: iperf3 ${SECS}s per round (median Gbit/s;"
echo "client CPU 0, server CPU 1), 200 pings 2 ms apart per round in blocks of 20, the pairs"
echo "taking turns (median RTT of all), and 4000 back-to-back pings per round (ping -f; mean"
echo "RTT: the path without idle wake-ups). Pings from CPU 0."
echo "Ratios are medians of the per-round ratios (both pairs measured in the same round)."
echo
row "datapath" "Gbit/s" "RTT ms" "b2b ms" "Gbit/s by round"
row "------------------------------------" "------:" "------:" "------:" "---"
pair wv kv "weft vxlan, bridged pods" "hand-built kernel VXLAN" "ratio weft bridged / kernel VXLAN"
pair wvr kvr "weft vxlan, routed pods" "hand-built kernel VXLAN" "ratio weft routed / kernel VXLAN"
pair wh pr "weft host-gw, bridged pods" "plain routing over the underlay" "ratio weft bridged / plain"
pair whr prr "weft host-gw, routed pods" "plain routing over the underlay" "ratio weft routed / plain"
triple wv6 "weft vxlan, IPv6 pods, bridged" bridged
triple wv6u "weft vxlan over IPv6, bridged" bridged
triple wv6o "weft IPv6-only cluster, bridged" bridged
triple wv6or "weft IPv6-only cluster, routed" routed
if want vxlan; then
pair wpol wnop "weft vxlan, 100 policies" "weft vxlan, no policy" "ratio 100 policies / none"
echo
echo "100 policies: default deny + 98 unrelated allows + 1 allowing the pair, all selecting both"
echo "pods (${POLICY_RULES} counted policy rules on the server's node); the pair without policy is"
echo "another pod pair on the same two nodes."
echo "Convergence (Subnet status with VTEP data -> route+FDB+neighbour on another node), 15 peers: median ${conv_median} ms, max ${conv_max} ms"
fi
