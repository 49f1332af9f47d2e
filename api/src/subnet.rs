//! `Subnet`: one node's lease of pod addresses, carved from the cluster CIDR
//! by the operator. The spec is written once by the operator; the status is
//! published by the node's agent (and the operator's `Allocated` condition).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How pod traffic between nodes is carried.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema, Default)]
pub enum Backend {
    /// VXLAN overlay (works across L3 boundaries).
    #[default]
    #[serde(rename = "vxlan")]
    Vxlan,
    /// Plain routes via the peer node IP (nodes must share an L2 segment).
    #[serde(rename = "host-gw")]
    HostGw,
    /// flannel's UDP backend: pod packets read from a TUN device and sent,
    /// one per UDP datagram, to the peer node's agent (port 8285).
    #[serde(rename = "udp")]
    Udp,
    /// WireGuard between nodes, in the agent over a TUN device (port
    /// 51820): pod traffic leaves the node only encrypted.
    #[serde(rename = "wireguard")]
    Wireguard,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vxlan => "vxlan",
            Backend::HostGw => "host-gw",
            Backend::Udp => "udp",
            Backend::Wireguard => "wireguard",
        }
    }

    /// Whether pod packets between nodes go through the agent's TUN device.
    pub fn uses_tunnel(self) -> bool {
        matches!(self, Backend::Udp | Backend::Wireguard)
    }
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Backend::Vxlan, Backend::HostGw, Backend::Udp, Backend::Wireguard]
            .into_iter()
            .find(|b| b.as_str() == s)
            .ok_or_else(|| format!("unknown backend {s:?}: one of vxlan, host-gw, udp, wireguard"))
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which of a node's addresses its VXLAN packets travel between.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema, Default)]
pub enum VxlanUnderlay {
    /// The node IP (`status.nodeIP`).
    #[default]
    #[serde(rename = "ipv4")]
    Ipv4,
    /// The node's IPv6 address (`status.nodeIPv6`).
    #[serde(rename = "ipv6")]
    Ipv6,
}

impl std::fmt::Display for VxlanUnderlay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VxlanUnderlay::Ipv4 => "IPv4",
            VxlanUnderlay::Ipv6 => "IPv6",
        })
    }
}

/// A node's pod-address lease. Cluster-scoped; its name is the node name.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "weft.dev",
    version = "v1alpha1",
    kind = "Subnet",
    plural = "subnets",
    shortname = "wsn",
    status = "SubnetStatus",
    category = "weft",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeName"),
    printcolumn(name = "CIDR", type_ = "string", json_path = ".spec.cidr"),
    printcolumn(
        name = "Allocated",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Allocated\")].reason"
    ),
    printcolumn(name = "Backend", type_ = "string", json_path = ".spec.backend"),
    printcolumn(name = "NodeIP", type_ = "string", json_path = ".status.nodeIP"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(
        name = "Policy",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"PolicyApplied\")].status",
        priority = 1
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    doc = "Per-node pod CIDR lease handed out by the Weft operator"
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.cidrs) || size(self.cidrs) == 0 || (has(self.cidr) && self.cidrs[0] == self.cidr)").message("cidrs[0] must equal cidr"),
    validation = Rule::new("!has(oldSelf.cidrs) || size(oldSelf.cidrs) == 0 || has(self.cidrs)").message("cidrs cannot be removed"),
    validation = Rule::new("!has(oldSelf.cidr) || has(self.cidr)").message("cidr cannot be removed")
)]
pub struct SubnetSpec {
    /// Name of the Node that holds this lease. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("nodeName is immutable"))]
    #[schemars(length(min = 1, max = 253))]
    pub node_name: String,
    /// Pod address range of the node in CIDR notation, e.g. `10.244.3.0/24`
    /// (IPv6 ranges are accepted by the schema). Unset while the node waits
    /// for a free range (its `Allocated` condition says why); set once, then
    /// immutable.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[x_kube(
        validation = Rule::new("isCIDR(self)").message("cidr must be a valid CIDR such as 10.244.1.0/24"),
        validation = Rule::new("!isCIDR(self) || cidr(self) == cidr(self).masked()").message("cidr must be a network address: its host bits must be zero (e.g. 10.244.1.0/24, not 10.244.1.5/24)"),
        validation = Rule::new("self == oldSelf").message("cidr is immutable")
    )]
    #[schemars(length(min = 9, max = 43))]
    pub cidr: String,
    /// Every pod address range of the node, one per address family, `cidr`
    /// first: set in dual-stack clusters (as a Node's `podCIDRs`), empty in
    /// single-stack ones. A family may be added (a cluster made dual-stack);
    /// a listed range never changes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(
        validation = Rule::new("self.all(c, isCIDR(c))").message("cidrs must be valid CIDRs such as fd00:10:244:1::/64"),
        validation = Rule::new("self.all(c, !isCIDR(c) || cidr(c) == cidr(c).masked())").message("cidrs must be network addresses: their host bits must be zero"),
        validation = Rule::new("size(self) < 2 || !isCIDR(self[0]) || !isCIDR(self[1]) || cidr(self[0]).ip().family() != cidr(self[1]).ip().family()").message("cidrs holds at most one range per address family"),
        validation = Rule::new("oldSelf.all(c, c in self)").message("a range in cidrs cannot be changed or removed")
    )]
    #[schemars(length(max = 2), inner(length(min = 3, max = 43)))]
    pub cidrs: Vec<String>,
    /// Encapsulation used between nodes.
    #[serde(default)]
    pub backend: Backend,
    /// VXLAN network identifier (vxlan backend only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777215))]
    pub vni: Option<u32>,
    /// MTU override for pod interfaces; unset means the agent derives it
    /// from the node's uplink minus the encapsulation overhead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 576, max = 9216))]
    pub mtu: Option<u32>,
}

/// Published by the node's agent once its datapath uses the lease.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct SubnetStatus {
    /// The node's IP used as the tunnel endpoint / next hop.
    #[serde(rename = "nodeIP", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 45))]
    pub node_ip: Option<String>,
    /// The node's IPv6 address on a dual-stack node: host-gw's next hop
    /// for the node's IPv6 block.
    #[serde(rename = "nodeIPv6", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 45))]
    pub node_ipv6: Option<String>,
    /// VXLAN tunnel endpoint IP (vxlan backend only).
    #[serde(rename = "vtepIP", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 45))]
    pub vtep_ip: Option<String>,
    /// MAC address of the node's VXLAN device (vxlan backend only).
    #[serde(rename = "vtepMAC", default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$"))]
    pub vtep_mac: Option<String>,
    /// Which address the node's VXLAN packets come from and must be sent
    /// to: `ipv4` (nodeIP; also when unset) or `ipv6` (nodeIPv6). Every
    /// node of a cluster must use the same (vxlan backend only).
    #[serde(rename = "vxlanUnderlay", default, skip_serializing_if = "Option::is_none")]
    pub vxlan_underlay: Option<VxlanUnderlay>,
    /// The node's WireGuard public key, base64 (wireguard backend only).
    /// Peers encrypt to it; a node without one gets no pod traffic.
    #[serde(rename = "wireguardPublicKey", default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$"))]
    pub wireguard_public_key: Option<String>,
    /// `Allocated` (operator) and `Ready` (agent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::common::conditions_schema")]
    pub conditions: Vec<Condition>,
}

impl SubnetSpec {
    /// Every range of the lease: `cidr`, then the other family's in
    /// dual-stack clusters; none while the node waits for a range.
    pub fn blocks(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.cidr.as_str())
            .filter(|c| !c.is_empty())
            .chain(self.cidrs.iter().map(String::as_str).filter(|c| *c != self.cidr))
    }

    /// Whether the node still waits for a range (the pool had none free).
    pub fn is_pending(&self) -> bool {
        self.cidr.is_empty()
    }
}

/// Annotation asking a wireguard node to make a new key pair: any value its
/// agent has not carried out yet (e.g. a timestamp) rotates the key once;
/// peers take the new public key from `status.wireguardPublicKey`.
pub const WIREGUARD_KEY_ROTATION: &str = "weft.dev/wireguard-key-rotation";

/// Condition type the operator sets: True once the lease exists, False
/// (with [`REASON_POOL_EXHAUSTED`]) while the node waits for a free range.
pub const CONDITION_ALLOCATED: &str = "Allocated";
/// Reason of `Allocated=False` (and of the operator's Node condition and
/// Event): the cluster CIDR has no free range for the node.
pub const REASON_POOL_EXHAUSTED: &str = "SubnetPoolExhausted";
/// Condition type the agent sets once its datapath uses the lease.
pub const CONDITION_READY: &str = "Ready";
/// Reason of `Ready=False` once the agent has seen its lease withdrawn (it
/// lets the block go when its pods are gone).
pub const REASON_LEASE_WITHDRAWN: &str = "LeaseWithdrawn";

/// Finalizer on every Subnet the operator creates: the block stays reserved
/// (no other node can lease it) until the node's agent has no pod left in it,
/// or, for a node that is gone, until no pod in the API is left in it.
pub const LEASE_FINALIZER: &str = "weft.dev/lease-in-use";

/// Whether the Subnet still reserves its block ([`LEASE_FINALIZER`]).
pub fn holds_lease(subnet: &Subnet) -> bool {
    subnet.metadata.finalizers.iter().flatten().any(|f| f == LEASE_FINALIZER)
}

/// The merge patch that lets the Subnet's block go: its finalizers without
/// [`LEASE_FINALIZER`], guarded by the resourceVersion the decision was made
/// on (a changed Subnet answers 409, and nobody else's finalizer is lost).
pub fn let_go_patch(subnet: &Subnet) -> serde_json::Value {
    let remaining: Vec<&String> =
        subnet.metadata.finalizers.iter().flatten().filter(|f| *f != LEASE_FINALIZER).collect();
    serde_json::json!({"metadata": {"resourceVersion": subnet.metadata.resource_version, "finalizers": remaining}})
}
