#!/usr/bin/env bash
# Cross-node pod-to-pod datapath benchmark (run via e2e/bench.sh overlay, as root).
# Compares, in the same run and between the same node namespaces, weft's pods
# with two pairs of pods built by hand on the same kind of path, one pair
# routed (no bridge), one on a bridge at each end (bbr0, with bridge netfilter
# on as weft0 has it), so that each of weft's attachment modes meets its own
# topology built by hand:
#   weft vxlan   vs a hand-built kernel VXLAN, weft's pods routed
#                (--pod-attachment routed), then bridged (the default)
#   weft vxlan, IPv6 pod traffic (dual-stack, bridged pods) vs the hand-built
#                VXLAN carrying IPv6, over the IPv4 underlay, then over the
#                IPv6 underlay (--vxlan-underlay ipv6), then an IPv6-only
#                cluster (up --ipv6-only) vs VXLAN over IPv6, its pods
#                bridged, then routed
#   weft host-gw vs plain routing over the underlay, pods bridged, then routed
#   weft udp (the agent's userspace datapath over a TUN device) vs a
#                hand-built kernel VXLAN: the cost of leaving the kernel
#   weft udp and vxlan vs flannel's own udp and vxlan backends: flanneld
#                (built from the Go module proxy) on the same node namespaces
#                at the same time (--kube-subnet-mgr, its own Nodes with
#                spec.podCIDR in 10.246.0.0/16, its own port and VNI), pods
#                on a bridge as flannel's CNI chain makes them
#   weft wireguard vs wireguard-go (the stock userspace WireGuard, built
#                from the Go module proxy) between the same node namespaces
#                with the same MTU, configured with wg
#   weft vxlan with 100 NetworkPolicies (default deny plus allows) selecting
#                both pods vs the same path under no policy
#   weft vxlan through the pods' source guard vs the same path with the
#                guard skipped for another pod pair
# in interleaved rounds (e2e/bench/compare.py: this machine is noisy, so each
# round measures both), and measures overlay convergence (new peer Subnet ->
# route+FDB+neighbour on another node). Prints tables; asserts nothing.
#
# Usage: e2e/bench/overlay.sh [vxlan] [ipv6] [host-gw] [tunnel] [flannel] (the sections to run;
# all by default). vxlan includes the policy cost and convergence.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECTIONS=" ${*:-vxlan ipv6 host-gw tunnel flannel} "
want() { [[ $SECTIONS == *" $1 "* ]]; }
SBX=target/debug/weft-sandbox
ROUNDS=${ROUNDS:-12}
SECS=${SECS:-4}
# iperf3's parallel streams per measurement (STREAMS=4 for the multi-stream table).
STREAMS=${STREAMS:-1}
export RUST_BACKTRACE=0
N1=weft-sbx-node-1 N2=weft-sbx-node-2

AGENTS_PAUSED=
cleanup() {
  if [[ $AGENTS_PAUSED ]]; then signal_agents CONT || true; fi
  pkill -f "iperf3 -s -p 5301" 2>/dev/null || true
  pkill -f "wireguard-go wgb[12]" 2>/dev/null || true
  pkill -f "flanneld --kube-subnet-mgr" 2>/dev/null || true
  for ns in bench-p1 bench-p2 bench-q1 bench-q2 bench-f1 bench-f2; do ip netns del "$ns" 2>/dev/null || true; done
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
  done < <(python3 e2e/bench/compare.py --rounds "$ROUNDS" --secs "$SECS" --streams "$STREAMS" "${ratios[@]}" "$@")
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

# The node-side veth, in node namespace $1, of pod namespace $2's eth0.
host_veth() {
  local idx
  idx=$(ip -n "$2" -o link show eth0 | sed -n 's/.*eth0@if\([0-9]*\).*/\1/p')
  ip -n "$1" -o link | awk -F': ' -v i="$idx" '$1==i {sub(/@.*/, "", $2); print $2}'
}

# SIGSTOP or SIGCONT ($1: STOP, CONT) both sandbox agents.
signal_agents() {
  local n
  for n in node-1 node-2; do kill -"$1" "$(cat "${WEFT_SANDBOX_DIR:-/run/weft-sandbox}/$n/agent.pid")"; done
}

# In the running vxlan sandbox: a -> b through the source guard against
# pods e (node-1) -> f (node-2) that skip it (an accept for their veths
# ahead of the guard's rules, on both nodes, with the agents paused so
# that their resync does not take it away), interleaved.
guard_cost() {
  $SBX add-pod e --node node-1 >/dev/null
  $SBX add-pod f --node node-2 >/dev/null
  local f_ip ve vf
  f_ip=$($SBX pods | awk '$1=="default/f" {print $3}')
  ve=$(host_veth $N1 weft-sbx-pod-default-e) vf=$(host_veth $N2 weft-sbx-pod-default-f)
  [[ $ve && $vf ]] || { echo "no host veth for pod e or f" >&2; exit 1; }
  signal_agents STOP
  AGENTS_PAUSED=1
  ip netns exec $N1 nft insert rule bridge weft guard-bridged iifname "$ve" accept
  ip netns exec $N2 nft insert rule bridge weft guard-bridged iifname "$vf" accept
  compare_pairs "wgrd:weft-sbx-pod-default-a:weft-sbx-pod-default-b:$B_IP" \
    "wnog:weft-sbx-pod-default-e:weft-sbx-pod-default-f:$f_ip"
  signal_agents CONT
  AGENTS_PAUSED=
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

# The hand-built VXLAN bvx (VNI 99, port 4790), a second one between the
# same node namespaces: underlay addresses $1 (node-1) and $2, tunnel
# addresses $3 and $4 (CIDR).
baseline_vxlan() {
  local nodad=()
  if [[ $3 == *:* ]]; then nodad=(nodad); fi
  ip -n $N1 link add bvx type vxlan id 99 dstport 4790 local "$1" remote "$2" dev eth0
  ip -n $N2 link add bvx type vxlan id 99 dstport 4790 local "$2" remote "$1" dev eth0
  ip -n $N1 addr add "$3" dev bvx "${nodad[@]}"; ip -n $N1 link set bvx up
  ip -n $N2 addr add "$4" dev bvx "${nodad[@]}"; ip -n $N2 link set bvx up
}

# The two hand-built pairs across the nodes: bench-p1 -> bench-p2 routed,
# bench-q1 -> bench-q2 bridged (bbr0), both of family $1 (ipv4 or ipv6), MTU
# $2, each node routing the other's pod subnets via $3 (from node-1) and $4
# (from node-2): the hand-built VXLAN's far end, or the other node.
baseline_pairs() {
  local family=$1 mtu=$2 via1=$3 via2=$4 len=24 i
  if [[ $family == ipv6 ]]; then len=64; fi
  # Address HOST in baseline subnet N (1..4) of the family.
  at() { if [[ $family == ipv6 ]]; then echo "fd00:20$1::$2"; else echo "192.168.20$1.$2"; fi; }
  baseline_pod $N1 bench-p1 "$(at 1 2)" "$(at 1 1)" "$mtu"
  baseline_pod $N2 bench-p2 "$(at 2 2)" "$(at 2 1)" "$mtu"
  baseline_pod $N1 bench-q1 "$(at 3 2)" "$(at 3 1)" "$mtu" bbr0
  baseline_pod $N2 bench-q2 "$(at 4 2)" "$(at 4 1)" "$mtu" bbr0
  for i in 2 4; do ip -n $N1 route add "$(at $i 0)/$len" via "$via1"; done
  for i in 1 3; do ip -n $N2 route add "$(at $i 0)/$len" via "$via2"; done
  # The pairs for compare_pairs, without their keys: routed, then bridged.
  BASE_ROUTED="bench-p1:bench-p2:$(at 2 2)" BASE_BRIDGED="bench-q1:bench-q2:$(at 4 2)"
}

# Weft's pod pair (KEY $1) against both hand-built pairs (keys k$1 and b$1).
compare() {
  compare_pairs "$1:weft-sbx-pod-default-a:weft-sbx-pod-default-b:$2" "k$1:$BASE_ROUTED" "b$1:$BASE_BRIDGED"
}

del_baseline_pods() {
  local ns
  for ns in bench-p1 bench-p2 bench-q1 bench-q2; do ip netns del $ns; done
}

two_pods() {
  $SBX add-pod a --node node-1 >/dev/null
  $SBX add-pod b --node node-2 >/dev/null
  B_IP=$($SBX pods | awk '$1=="default/b" {print $3}')
}

$SBX down >/dev/null 2>&1 || true
declare -A T R F P PT PR PF CPU

# --- vxlan sandboxes: weft vxlan vs a hand-built VXLAN --------------------------
# Pods routed first (that sandbox comes down at once), then bridged (the
# default; convergence is measured in that one afterwards).
vxlan() {
  local weft=$1; shift
  $SBX up --nodes 2 "$@" >/dev/null
  two_pods
  baseline_vxlan 10.250.0.11 10.250.0.12 172.31.99.1/30 172.31.99.2/30
  baseline_pairs ipv4 1450 172.31.99.2 172.31.99.1
  compare "$weft" "$B_IP"
}
if want vxlan; then
vxlan wvr --agent-arg=--pod-attachment=routed
$SBX down >/dev/null
del_baseline_pods
vxlan wv
policy_cost
guard_cost

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
del_baseline_pods
fi

# --- IPv6 vxlan sandboxes: IPv6 between pods vs hand-built VXLAN carrying IPv6 --
# vxlan_ipv6 KEY UNDERLAY [up args]. UNDERLAY: ipv4 (a dual-stack sandbox,
# VXLAN between the node IPs, MTU 1450), ipv6 (dual-stack, VXLAN between the
# nodes' IPv6 addresses fd00:250::b/::c, MTU 1430) or ipv6-only (an IPv6-only
# sandbox: IPv6 node IPs and pods, VXLAN over IPv6). Both hand-built pod
# pairs share the hand-built VXLAN.
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
  baseline_vxlan $local1 $local2 fd00:99::1/64 fd00:99::2/64
  baseline_pairs ipv6 $mtu fd00:99::2 fd00:99::1
  compare "$weft" "$b_ip6"
  $SBX down >/dev/null
  del_baseline_pods
}
if want ipv6; then
vxlan_ipv6 wv6 ipv4
vxlan_ipv6 wv6u ipv6
vxlan_ipv6 wv6o ipv6-only
vxlan_ipv6 wv6or ipv6-only --agent-arg=--pod-attachment=routed
fi

# --- host-gw sandboxes: weft host-gw vs plain routing over the underlay ---------
# Once with pods on the bridge (the default), once routed (--pod-attachment
# routed); the hand-built pairs route over the underlay in the same sandbox.
host_gw() {
  local weft=$1; shift
  $SBX up --nodes 2 --backend host-gw "$@" >/dev/null
  two_pods
  baseline_pairs ipv4 1500 10.250.0.12 10.250.0.11
  compare "$weft" "$B_IP"
  $SBX down >/dev/null
  del_baseline_pods
}
if want host-gw; then
host_gw wh
host_gw whr --agent-arg=--pod-attachment=routed
fi

# --- TUN backends: weft udp vs a hand-built kernel VXLAN, weft wireguard vs
# wireguard-go -------------------------------------------------------------------
# wireguard-go's devices wgb1 (node-1) and wgb2 (node-2) (port 51821, MTU
# 1420 as weft's; two names, because wireguard-go's control sockets live in
# the one /var/run/wireguard), each end allowed the other's tunnel address
# and baseline pod subnets (baseline_pairs' 192.168.20N.0/24: odd N on
# node-1, even on node-2).
baseline_wireguard_go() {
  local wggo k1 k2 p1 p2
  wggo=${WEFT_TOOLS_DIR:-$(e2e/scripts/build-tools.sh --print-dir)}/wireguard-go
  [[ -x $wggo ]] || { echo "overlay: $wggo is missing (e2e/scripts/build-tools.sh)" >&2; exit 1; }
  k1=$(wg genkey) k2=$(wg genkey)
  p1=$(wg pubkey <<<"$k1") p2=$(wg pubkey <<<"$k2")
  ip netns exec $N1 "$wggo" wgb1 >/dev/null
  ip netns exec $N2 "$wggo" wgb2 >/dev/null
  ip netns exec $N1 wg set wgb1 private-key <(echo "$k1") listen-port 51821 peer "$p2" \
    endpoint 10.250.0.12:51821 allowed-ips 172.31.98.2/32,192.168.202.0/24,192.168.204.0/24
  ip netns exec $N2 wg set wgb2 private-key <(echo "$k2") listen-port 51821 peer "$p1" \
    endpoint 10.250.0.11:51821 allowed-ips 172.31.98.1/32,192.168.201.0/24,192.168.203.0/24
  ip -n $N1 addr add 172.31.98.1/30 dev wgb1; ip -n $N1 link set wgb1 mtu 1420 up
  ip -n $N2 addr add 172.31.98.2/30 dev wgb2; ip -n $N2 link set wgb2 mtu 1420 up
}

# CPU time (clock ticks) both sandbox agents have used so far.
agent_ticks() {
  local n st t=0
  for n in node-1 node-2; do
    read -r -a st <"/proc/$(cat "${WEFT_SANDBOX_DIR:-/run/weft-sandbox}/$n/agent.pid")/stat"
    t=$((t + st[13] + st[14]))
  done
  echo "$t"
}

# Both agents' CPU-seconds per Gbit the weft pair KEY carried in its rounds:
# CPUs busy per Gbit/s (the baseline pairs' rounds and the pings cost the
# agents next to nothing, and count here).
cpu_per_gbps() {
  awk -v t="${CPU[$1]}" -v hz="$(getconf CLK_TCK)" -v secs="$SECS" \
    '{ for (i = 1; i <= NF; i++) s += $i } END { printf "%.2f", t / hz / (s * secs) }' <<<"${P[$1]}"
}

tunnel() {
  local weft=$1 backend=$2 ticks
  $SBX up --nodes 2 --backend "$backend" >/dev/null
  two_pods
  if [[ $backend == wireguard ]]; then
    baseline_wireguard_go
    baseline_pairs ipv4 1420 172.31.98.2 172.31.98.1
  else
    baseline_vxlan 10.250.0.11 10.250.0.12 172.31.99.1/30 172.31.99.2/30
    baseline_pairs ipv4 1450 172.31.99.2 172.31.99.1
  fi
  ticks=$(agent_ticks)
  compare "$weft" "$B_IP"
  CPU[$weft]=$(($(agent_ticks) - ticks))
  $SBX down >/dev/null
  del_baseline_pods
}
if want tunnel; then
tunnel wu udp
tunnel ww wireguard
fi

# --- flannel itself: flanneld's udp / vxlan vs weft's, same nodes, same run ------
# Nodes flannel-1/2 (podCIDR 10.246.N.0/24) for flanneld's subnet manager;
# flanneld N runs in node-N's namespace as flannel-N, with backend $1 on its
# own port (8286 udp, 8473 vxlan with VNI 2: weft's are in use); a pod on
# bridge cni0 (10.246.N.2, gateway .1) behind each, MTU from flannel's
# subnet file.
flannel_up() {
  local type=$1 n conf kc flanneld mtu
  flanneld=${WEFT_TOOLS_DIR:-$(e2e/scripts/build-tools.sh --print-dir)}/flanneld
  [[ -x $flanneld ]] || { echo "overlay: $flanneld is missing (e2e/scripts/build-tools.sh --flannel)" >&2; exit 1; }
  kc=$(jq -r .in_cluster_kubeconfig /run/weft-sandbox/state.json)
  conf=$(mktemp -d /tmp/weft-bench-flannel.XXXX)
  FLANNEL_DIR=$conf
  if [[ $type == udp ]]; then
    echo '{"Network": "10.246.0.0/16", "Backend": {"Type": "udp", "Port": 8286}}' >"$conf/net-conf.json"
  else
    echo '{"Network": "10.246.0.0/16", "Backend": {"Type": "vxlan", "VNI": 2, "Port": 8473}}' >"$conf/net-conf.json"
  fi
  for n in 1 2; do
    $SBX kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Node
metadata: {name: flannel-$n}
spec: {podCIDR: 10.246.$n.0/24, podCIDRs: [10.246.$n.0/24]}
YAML
    $SBX kubectl patch node "flannel-$n" --subresource=status --type=merge \
      -p "{\"status\":{\"addresses\":[{\"type\":\"InternalIP\",\"address\":\"10.250.0.1$n\"}]}}" >/dev/null
    NODE_NAME=flannel-$n ip netns exec "weft-sbx-node-$n" "$flanneld" --kube-subnet-mgr --kubeconfig-file="$kc" \
      --iface=eth0 --net-config-path="$conf/net-conf.json" --subnet-file="$conf/subnet-$n.env" \
      >"$conf/flanneld-$n.log" 2>&1 &
  done
  for n in 1 2; do
    for _ in $(seq 300); do [[ -s $conf/subnet-$n.env ]] && break; sleep 0.1; done
    [[ -s $conf/subnet-$n.env ]] || { echo "overlay: flanneld $n did not start:" >&2; cat "$conf/flanneld-$n.log" >&2; exit 1; }
    mtu=$(sed -n 's/^FLANNEL_MTU=//p' "$conf/subnet-$n.env")
    baseline_pod "weft-sbx-node-$n" "bench-f$n" "10.246.$n.2" "10.246.$n.1" "$mtu" cni0
  done
  # Both flanneld have seen each other once the path answers.
  for _ in $(seq 300); do ip netns exec bench-f1 ping -c1 -W1 10.246.2.2 >/dev/null 2>&1 && break; sleep 0.1; done
}

flannel_down() {
  pkill -f "flanneld --kube-subnet-mgr" 2>/dev/null || true
  ip netns del bench-f1; ip netns del bench-f2
  $SBX kubectl delete node flannel-1 flannel-2 >/dev/null
  rm -rf "$FLANNEL_DIR"
}

# weft's pods (backend $2) against flannel's (backend $3), keys $1 and f$1.
flannel_vs() {
  local key=$1 weft=$2 type=$3
  $SBX up --nodes 2 --backend "$weft" >/dev/null
  two_pods
  flannel_up "$type"
  compare_pairs "$key:weft-sbx-pod-default-a:weft-sbx-pod-default-b:$B_IP" "f$key:bench-f1:bench-f2:10.246.2.2"
  flannel_down
  $SBX down >/dev/null
}
if want flannel; then
# flanneld is built on first use (cached afterwards), like the cluster's tools.
e2e/scripts/build-tools.sh --flannel >&2
flannel_vs fu udp udp
flannel_vs fv vxlan vxlan
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
# A sandbox's three pairs: weft, the routed and the bridged baseline (built
# on PATH); the first ratio is against the baseline of weft's own attachment
# mode: triple KEY LABEL MODE PATH.
triple() {
  local key=$1 label=$2 mode=$3 path=$4
  [[ ${T[$key]:-} ]] || return 0
  fig "$key" "$label"
  fig "k$key" "$path, routed pods"
  fig "b$key" "$path, bridged pods"
  if [[ $mode == routed ]]; then
    ratios "$key" "k$key" "ratio weft / hand-built, routed"
    ratios "$key" "b$key" "(weft / hand-built, bridged)"
  else
    ratios "$key" "b$key" "ratio weft / hand-built, bridged"
    ratios "$key" "k$key" "(weft / hand-built, routed)"
  fi
}
echo
echo "Pod-to-pod across nodes, ${ROUNDS} interleaved rounds: iperf3 ${SECS}s, ${STREAMS} stream(s), per round (median Gbit/s;"
echo "client CPU 0, server CPU 1), 200 pings 2 ms apart per round in blocks of 20, the pairs"
echo "taking turns (median RTT of all), and 4000 back-to-back pings per round (ping -f; mean"
echo "RTT: the path without idle wake-ups). Pings from CPU 0."
echo "Ratios are medians of the per-round ratios (both pairs measured in the same round)."
echo
row "datapath" "Gbit/s" "RTT ms" "b2b ms" "Gbit/s by round"
row "------------------------------------" "------:" "------:" "------:" "---"
triple wv "weft vxlan, bridged" bridged "hand-built VXLAN"
triple wvr "weft vxlan, routed" routed "hand-built VXLAN"
triple wh "weft host-gw, bridged" bridged "plain routing"
triple whr "weft host-gw, routed" routed "plain routing"
triple wu "weft udp, bridged" bridged "hand-built VXLAN"
triple ww "weft wireguard, bridged" bridged "wireguard-go"
pair fu ffu "weft udp, bridged" "flanneld udp, bridged pods" "ratio weft / flannel"
pair fv ffv "weft vxlan, bridged" "flanneld vxlan, bridged pods" "ratio weft / flannel"
triple wv6 "weft vxlan, IPv6 pods, bridged" bridged "hand-built VXLAN"
triple wv6u "weft vxlan over IPv6, bridged" bridged "hand-built VXLAN"
triple wv6o "weft IPv6-only cluster, bridged" bridged "hand-built VXLAN"
triple wv6or "weft IPv6-only cluster, routed" routed "hand-built VXLAN"
if want tunnel; then
echo
echo "Agent CPU per Gbit/s (both agents, ${STREAMS} stream(s)): udp $(cpu_per_gbps wu), wireguard $(cpu_per_gbps ww)"
fi
if want vxlan; then
pair wpol wnop "weft vxlan, 100 policies" "weft vxlan, no policy" "ratio 100 policies / none"
pair wgrd wnog "weft vxlan, source guard" "weft vxlan, guard skipped" "ratio guard / skipped"
echo
echo "100 policies: default deny + 98 unrelated allows + 1 allowing the pair, all selecting both"
echo "pods (${POLICY_RULES} counted policy rules on the server's node); the pair without policy is"
echo "another pod pair on the same two nodes. Source guard: pods a -> b against pods e -> f on the"
echo "same nodes whose veths an accept ahead of the guard's rules exempts (agents paused meanwhile)."
echo "Convergence (Subnet status with VTEP data -> route+FDB+neighbour on another node), 15 peers: median ${conv_median} ms, max ${conv_max} ms"
fi
