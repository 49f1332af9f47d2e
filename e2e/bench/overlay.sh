#!/usr/bin/env bash
# Cross-node pod-to-pod datapath benchmark (run via e2e/bench.sh overlay, as root).
# Compares, in the same run and between the same node namespaces:
#   weft vxlan   vs a hand-built kernel VXLAN (routed, no bridge), weft's pods
#                routed (--pod-attachment routed), then bridged (the default)
#   weft host-gw vs plain routing over the underlay, pods bridged, then routed
# in interleaved rounds (e2e/bench/compare.py: this machine is noisy, so each
# round measures both), and measures overlay convergence (new peer Subnet ->
# route+FDB+neighbour on another node). Prints tables; asserts nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
SBX=target/debug/weft-sandbox
ROUNDS=${ROUNDS:-12}
SECS=${SECS:-4}
export RUST_BACKTRACE=0
N1=weft-sbx-node-1 N2=weft-sbx-node-2

cleanup() {
  pkill -f "iperf3 -s -p 5301" 2>/dev/null || true
  for ns in bench-p1 bench-p2; do ip netns del "$ns" 2>/dev/null || true; done
  $SBX down >/dev/null 2>&1 || true
}
trap cleanup EXIT

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# Weft's pod pair against a baseline pair, interleaved; sets T/R/F/P[weft] and T/R/F/P[base].
compare() {
  local k t r f runs
  while read -r k t r f runs; do T[$k]=$t; R[$k]=$r; F[$k]=$f; P[$k]=$runs; done < <(
    python3 e2e/bench/compare.py --rounds "$ROUNDS" --secs "$SECS" \
      "$1:weft-sbx-pod-default-a:weft-sbx-pod-default-b:$B_IP" "$2:bench-p1:bench-p2:192.168.202.2")
}

# A baseline "pod" in node namespace $1: netns $2 with $3/24, gateway $4 on the node side.
baseline_pod() {
  local node=$1 pod=$2 addr=$3 gw=$4 mtu=$5
  ip netns add "$pod"
  ip -n "$pod" link set lo up
  ip -n "$node" link add "b-$pod" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$pod"
  ip -n "$node" addr add "$gw/24" dev "b-$pod"
  ip -n "$node" link set "b-$pod" up
  ip -n "$pod" addr add "$addr/24" dev eth0
  ip -n "$pod" link set eth0 up
  ip -n "$pod" route add default via "$gw"
}

two_pods() {
  $SBX add-pod a --node node-1 >/dev/null
  $SBX add-pod b --node node-2 >/dev/null
  B_IP=$($SBX pods | awk '$1=="default/b" {print $3}')
}

$SBX down >/dev/null 2>&1 || true
declare -A T R F P

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
vxlan wvr kvr --agent-arg=--pod-attachment=routed
$SBX down >/dev/null
ip netns del bench-p1; ip netns del bench-p2
vxlan wv kv

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
host_gw wh pr
host_gw whr prr --agent-arg=--pod-attachment=routed

ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
row() { printf '| %-32s | %7s | %7s | %7s | %s |\n' "$@"; }
# A weft row, its baseline's row and their ratios: pair KEY BASE_KEY LABEL BASE_LABEL RATIO_LABEL.
pair() {
  row "$3" "${T[$1]}" "${R[$1]}" "${F[$1]}" "${P[$1]}"
  row "$4" "${T[$2]}" "${R[$2]}" "${F[$2]}" "${P[$2]}"
  row "$5" "$(ratio "${T[$1]}" "${T[$2]}")" "$(ratio "${R[$1]}" "${R[$2]}")" "$(ratio "${F[$1]}" "${F[$2]}")" ""
}
echo
echo "Pod-to-pod across nodes, ${ROUNDS} interleaved rounds: iperf3 ${SECS}s per round (median Gbit/s;"
echo "client CPU 0, server CPU 1), 200 pings 2 ms apart per round (median RTT of all) and"
echo "4000 back-to-back pings per round (ping -f; mean RTT: the path without idle wake-ups)"
echo
row "datapath" "Gbit/s" "RTT ms" "b2b ms" "Gbit/s by round"
row "--------------------------------" "------:" "------:" "------:" "---"
pair wv kv "weft vxlan, bridged pods" "hand-built kernel VXLAN" "ratio weft bridged / kernel VXLAN"
pair wvr kvr "weft vxlan, routed pods" "hand-built kernel VXLAN" "ratio weft routed / kernel VXLAN"
pair wh pr "weft host-gw, bridged pods" "plain routing over the underlay" "ratio weft bridged / plain"
pair whr prr "weft host-gw, routed pods" "plain routing over the underlay" "ratio weft routed / plain"
echo
echo "Convergence (Subnet status with VTEP data -> route+FDB+neighbour on another node), 15 peers: median ${conv_median} ms, max ${conv_max} ms"
