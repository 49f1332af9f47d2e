# Versions of everything the e2e scripts build or vendor from Go modules,
# pinned in one place (sourced by build-tools.sh and vendor-cnp-crds.sh; the
# tests read it as KEY=VALUE lines).

# One Kubernetes minor throughout: k8s-openapi feature v1_35, these components.
K8S_VERSION=v1.35.4
STAGING_VERSION=v0.35.4
# The etcd minor that Kubernetes 1.35 requires in its go.mod.
ETCD_VERSION=v3.6.5
HELM_VERSION=v3.19.0
# containerd 2.x speaks CNI 1.1 (STATUS, GC); Debian's 1.6 rejects 1.1 results.
CONTAINERD_VERSION=v2.2.9
# Cluster DNS for the real-node cluster: the CoreDNS kubeadm 1.35 deploys.
COREDNS_VERSION=v1.13.1
# The ginkgo that k8s.io/kubernetes $K8S_VERSION requires in its go.mod.
GINKGO_VERSION=v2.27.2
# The SIG Network policy API: the ClusterNetworkPolicy CRDs the chart
# vendors (charts/weft/files/clusternetworkpolicies/) and its conformance suite.
NETWORK_POLICY_API_VERSION=v0.3.0
# wireguard-go (a stock WireGuard peer for the wireguard backend's interop
# test and benchmark): the module's newest pseudo-version.
WIREGUARD_GO_VERSION=v0.0.0-20260522210424-ecfc5a8d5446
# flanneld, the peer of e2e/bench.sh overlay flannel.
FLANNEL_VERSION=v0.28.10
# kwok, the simulated nodes and kubelets of e2e/bench.sh scale.
KWOK_VERSION=v0.8.0
