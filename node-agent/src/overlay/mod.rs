//! The multi-node overlay: VXLAN (flannel-style VTEP routes, neighbour and
//! FDB entries), host-gw (direct routes), and the TUN backends udp and
//! wireguard (the cluster's ranges routed into a TUN device, whose packets
//! the agent's datapath, [`crate::tunnel`], carries), level-triggered.
//!
//! [`Reconciler::reconcile`] observes the kernel, computes the desired state
//! from the peers ([`desired`]), diffs the two ([`diff`]) and applies only the
//! difference. On correct kernel state it applies nothing, so a restarted
//! agent adopts what its predecessor programmed without disturbing traffic.
//!
//! The reconciler operates in the network namespace of its netlink handle,
//! which must also be the calling thread's (the checksum ioctl uses it).

pub mod desired;
pub mod diff;
pub use crate::dataplane::entries;

#[cfg(test)]
mod kernel_tests;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::{IpNet, Ipv6Net};
use rtnetlink::Handle;

use crate::dataplane::routes::{self, Devices};
use crate::dataplane::{DataplaneError, link, tun, underlay, vxlan};
use crate::tunnel::engine::{Datapath, Stats};
use crate::tunnel::keys::NodeKey;
use crate::tunnel::{Encapsulation, udp, wireguard};
pub use desired::{Backend, Peer, PeerError, PeerPath, VxlanUnderlay};
pub use entries::Mac;

/// Name of the VXLAN device: `weft.<VNI>` by convention, like `flannel.1`.
pub const DEFAULT_DEVICE: &str = "weft.1";
pub const DEFAULT_VNI: u32 = 1;
/// Name of the TUN backends' device (flannel's is `flannel0`).
pub const DEFAULT_TUNNEL_DEVICE: &str = "weft-tun";

/// This node's overlay configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayConfig {
    pub node_name: String,
    /// IPv4, or IPv6 on an IPv6-only node.
    pub node_ip: IpAddr,
    /// This node's IPv6 address (`--node-ips`), when it has one.
    pub node_ipv6: Option<Ipv6Addr>,
    /// Which node addresses VXLAN packets travel between: with IPv6 the
    /// device's `local` is `node_ipv6`, else `node_ip`.
    pub vxlan_underlay: VxlanUnderlay,
    /// IPv4, or IPv6 on an IPv6-only node (the family of `node_ip`).
    pub pod_cidr: IpNet,
    /// This node's IPv6 block in a dual-stack cluster.
    pub pod_cidr6: Option<Ipv6Net>,
    pub cluster_cidr: IpNet,
    /// The cluster's IPv6 range (`--ipv6-cluster-cidr`): IPv6 routes into
    /// it are Weft's.
    pub cluster_cidr6: Option<Ipv6Net>,
    /// Underlay interface name; `None`: the interface carrying `node_ip`.
    pub underlay: Option<String>,
    pub backend: Backend,
    /// VXLAN only: host-gw for peers on the same L2 segment.
    pub direct_routing: bool,
    pub vni: u32,
    pub port: u16,
    pub device: String,
    /// Overrides the detected MTU of the VXLAN device (and of pods).
    pub mtu: Option<u32>,
    /// Overrides the VTEP MAC; by default it is derived from the node IP.
    pub vtep_mac: Option<Mac>,
    /// Turn off tx checksum offload on the VXLAN device; by default only on
    /// kernels that need it (before 5.7).
    pub tx_checksum_workaround: bool,
    /// udp and wireguard: the UDP port of every node's datapath.
    pub tunnel_port: u16,
    /// udp and wireguard: the TUN device.
    pub tunnel_device: String,
    /// wireguard: this node's key pair.
    pub wireguard_key: Option<NodeKey>,
}

impl OverlayConfig {
    /// Defaults: VNI 1, port 8472, device `weft.1`, no direct routing,
    /// underlay and MTU detected.
    /// The VXLAN underlay is the family of `node_ip`.
    pub fn new(node_name: &str, node_ip: IpAddr, pod_cidr: IpNet, cluster_cidr: IpNet, backend: Backend) -> Self {
        Self {
            node_name: node_name.to_owned(),
            node_ip,
            node_ipv6: None,
            vxlan_underlay: if node_ip.is_ipv6() { VxlanUnderlay::Ipv6 } else { VxlanUnderlay::Ipv4 },
            pod_cidr,
            pod_cidr6: None,
            cluster_cidr,
            cluster_cidr6: None,
            underlay: None,
            backend,
            direct_routing: false,
            vni: DEFAULT_VNI,
            port: vxlan::DEFAULT_PORT,
            device: DEFAULT_DEVICE.to_owned(),
            mtu: None,
            vtep_mac: None,
            tx_checksum_workaround: vxlan::kernel_needs_tx_checksum_workaround(),
            tunnel_port: default_tunnel_port(backend),
            tunnel_device: DEFAULT_TUNNEL_DEVICE.to_owned(),
            wireguard_key: None,
        }
    }

    fn validate(&self) -> Result<(), OverlayError> {
        let bad = |m: String| Err(OverlayError::Config(m));
        if !self.cluster_cidr.contains(&self.pod_cidr) {
            return bad(format!("pod CIDR {} is outside the cluster CIDR {}", self.pod_cidr, self.cluster_cidr));
        }
        if self.pod_cidr.addr().is_ipv6() != self.node_ip.is_ipv6() {
            return bad(format!("pod CIDR {} and node IP {} are of different families", self.pod_cidr, self.node_ip));
        }
        if self.node_ip.is_ipv6() && self.pod_cidr6.is_some() {
            return bad("an IPv6 pod CIDR takes no second IPv6 block".into());
        }
        if self.node_ip.is_ipv6() && self.uses_vxlan() && self.vxlan_underlay == VxlanUnderlay::Ipv4 {
            return bad(format!(
                "node IP {} is IPv6: VXLAN runs over the IPv6 underlay (--vxlan-underlay ipv6)",
                self.node_ip
            ));
        }
        if self.vni == 0 || self.vni >= 1 << 24 {
            return bad(format!("VNI {} is not in 1..16777215", self.vni));
        }
        if self.device.is_empty() || self.device.len() >= libc::IFNAMSIZ {
            return bad(format!("device name {:?} must have 1 to 15 characters", self.device));
        }
        if let Some(mac) = self.vtep_mac
            && !mac.is_valid_unicast()
        {
            return bad(format!("VTEP MAC {mac} is not a unicast address"));
        }
        if let Some(mtu) = self.mtu
            && !(68..=65535).contains(&mtu)
        {
            return bad(format!("MTU {mtu} is not in 68..65535"));
        }
        if self.vxlan_underlay == VxlanUnderlay::Ipv6 && self.uses_vxlan() && self.node_ipv6().is_none() {
            return bad("VXLAN over IPv6 needs this node's IPv6 address (--node-ips)".into());
        }
        if self.backend == Backend::Wireguard && self.wireguard_key.is_none() {
            return bad("the wireguard backend needs this node's key".into());
        }
        if self.backend.uses_tunnel() && self.tunnel_port == 0 {
            return bad("the tunnel port must not be 0".into());
        }
        if self.tunnel_device.is_empty() || self.tunnel_device.len() >= libc::IFNAMSIZ {
            return bad(format!("TUN device name {:?} must have 1 to 15 characters", self.tunnel_device));
        }
        Ok(())
    }

    fn uses_vxlan(&self) -> bool {
        self.backend == Backend::Vxlan
    }

    /// The VTEP address: the pod CIDR's network address, /32 (/128).
    pub fn vtep_ip(&self) -> IpAddr {
        self.pod_cidr.network()
    }

    /// This node's IPv6 address: `node_ipv6`, or `node_ip` on an IPv6-only node.
    fn node_ipv6(&self) -> Option<Ipv6Addr> {
        match self.node_ip {
            IpAddr::V6(v6) => Some(v6),
            IpAddr::V4(_) => self.node_ipv6,
        }
    }

    fn vtep_mac(&self) -> Mac {
        self.vtep_mac.unwrap_or(Mac(vxlan::mac_for(self.node_ip)))
    }

    /// The source address of this node's VXLAN packets.
    fn tunnel_local(&self) -> IpAddr {
        match self.node_ipv6() {
            Some(v6) if self.vxlan_underlay == VxlanUnderlay::Ipv6 => v6.into(),
            _ => self.node_ip,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("invalid overlay configuration: {0}")]
    Config(String),
    #[error("underlay: {0}")]
    Underlay(DataplaneError),
    #[error("VXLAN device: {0}")]
    Device(DataplaneError),
    #[error("cannot read the kernel's routes, neighbours or FDB: {0}")]
    Observe(DataplaneError),
    #[error("TUN device: {0}")]
    Tunnel(DataplaneError),
    #[error("cannot start the {backend} datapath on {address}: {source}")]
    Datapath { backend: Backend, address: std::net::SocketAddr, source: std::io::Error },
}

/// The UDP port of a backend whose packets a node takes on the word of
/// their source address (VXLAN, udp; `tunnel_port` overrides udp's
/// default): pods must not be able to send to it. `None` for host-gw (no
/// encapsulation) and wireguard (authenticated by the peer's key).
pub fn unauthenticated_port(backend: Backend, tunnel_port: Option<u16>) -> Option<u16> {
    match backend {
        Backend::Vxlan => Some(vxlan::DEFAULT_PORT),
        Backend::Udp => Some(tunnel_port.unwrap_or(udp::DEFAULT_PORT)),
        Backend::HostGw | Backend::Wireguard => None,
    }
}

/// The UDP port of a TUN backend by default: flannel's 8285 for udp,
/// WireGuard's 51820.
pub fn default_tunnel_port(backend: Backend) -> u16 {
    match backend {
        Backend::Wireguard => wireguard::DEFAULT_PORT,
        _ => udp::DEFAULT_PORT,
    }
}

/// What this node announces in its own Subnet, and the MTU pods must use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalVtep {
    pub backend: Backend,
    pub node_ip: IpAddr,
    /// VXLAN only.
    pub vtep_ip: Option<IpAddr>,
    /// VXLAN only.
    pub vtep_mac: Option<Mac>,
    pub underlay: String,
    pub underlay_mtu: u32,
    /// The MTU for pod interfaces (and of the VXLAN or TUN device).
    pub pod_mtu: u32,
    /// wireguard only: the public key peers encrypt to.
    pub wireguard_public_key: Option<[u8; 32]>,
    /// What had to be fixed on the VXLAN device; empty when adopted as is.
    pub device_changes: Vec<String>,
}

/// Why one peer is not (fully) programmed. Goes to the peer's Subnet
/// conditions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerIssue {
    #[error("{0}")]
    Invalid(#[from] PeerError),
    #[error("an entry not created by Weft is in the way: {0}")]
    Conflict(String),
    #[error("kernel: {0}")]
    Kernel(String),
}

/// The outcome of one reconciliation.
#[derive(Debug, Clone)]
pub struct Report {
    pub local: LocalVtep,
    /// Peers that are programmed, and how they are reached.
    pub programmed: BTreeMap<String, PeerPath>,
    /// Peers with a problem, by node name. A peer with only a kernel error
    /// may be partially programmed; the next reconcile retries it.
    pub peer_errors: BTreeMap<String, PeerIssue>,
    /// Operations attempted / succeeded.
    pub ops_planned: usize,
    pub ops_applied: usize,
    /// Failures to delete stale entries (which belong to no current peer).
    pub stale_errors: Vec<String>,
    pub elapsed: Duration,
}

/// Programs the overlay from (this node, peers). Share it behind an `Arc`:
/// concurrent calls (watch events, periodic resync) run one at a time.
pub struct Reconciler {
    handle: Handle,
    cfg: OverlayConfig,
    // Two interleaved observe→apply passes would each act on a stale view.
    pass: tokio::sync::Mutex<()>,
    /// udp and wireguard: the running datapath.
    datapath: std::sync::Mutex<Option<Datapath>>,
    tunnel_stats: Stats,
    /// wireguard: this node's key pair (replaced by a rotation).
    wireguard_key: std::sync::Mutex<Option<NodeKey>>,
}

impl Reconciler {
    pub fn new(handle: Handle, cfg: OverlayConfig) -> Result<Self, OverlayError> {
        cfg.validate()?;
        let wireguard_key = std::sync::Mutex::new(cfg.wireguard_key.clone());
        Ok(Self {
            handle,
            cfg,
            pass: tokio::sync::Mutex::new(()),
            datapath: std::sync::Mutex::new(None),
            tunnel_stats: Stats::default(),
            wireguard_key,
        })
    }

    fn wireguard_key(&self) -> Option<NodeKey> {
        self.wireguard_key.lock().ok().and_then(|k| k.clone())
    }

    /// wireguard: uses `key` from now on (a rotation): the running datapath
    /// starts new sessions with it, and [`LocalVtep`] reports its public key.
    pub fn set_wireguard_key(&self, key: NodeKey) {
        if let Ok(running) = self.datapath.lock()
            && let Some(datapath) = running.as_ref()
        {
            datapath.set_private_key(&key.private);
        }
        if let Ok(mut current) = self.wireguard_key.lock() {
            *current = Some(key);
        }
    }

    /// Counts the TUN datapath's packets in these counters.
    pub fn with_tunnel_stats(mut self, stats: Stats) -> Self {
        self.tunnel_stats = stats;
        self
    }

    /// Finds the underlay and, for VXLAN, creates or adopts the device; what
    /// it returns is what this node announces in its Subnet. Cheap and
    /// idempotent; [`Self::reconcile`] does it every time so that a deleted
    /// device comes back.
    pub async fn ensure_local(&self) -> Result<LocalVtep, OverlayError> {
        let _pass = self.pass.lock().await;
        self.prepare().await.map(|(local, _, _)| local)
    }

    async fn prepare(&self) -> Result<(LocalVtep, Devices, underlay::Underlay), OverlayError> {
        let h = &self.handle;
        let cfg = &self.cfg;
        let ul = underlay::find(h, cfg.underlay.as_deref(), cfg.node_ip).await.map_err(OverlayError::Underlay)?;
        let mut local = LocalVtep {
            backend: cfg.backend,
            node_ip: cfg.node_ip,
            vtep_ip: None,
            vtep_mac: None,
            underlay: ul.name.clone(),
            underlay_mtu: ul.mtu,
            pod_mtu: cfg.mtu.unwrap_or(ul.mtu),
            wireguard_public_key: None,
            device_changes: Vec::new(),
        };
        let vxlan_index = if cfg.uses_vxlan() {
            let local_ip = cfg.tunnel_local();
            if local_ip != cfg.node_ip {
                underlay::require_address(h, &ul, local_ip).await.map_err(OverlayError::Underlay)?;
            }
            let mtu = cfg.mtu.unwrap_or_else(|| vxlan::mtu_for(ul.mtu, local_ip));
            let spec = vxlan::VxlanSpec {
                name: cfg.device.clone(),
                vni: cfg.vni,
                port: cfg.port,
                local: local_ip,
                underlay_index: ul.index,
                mtu,
                mac: cfg.vtep_mac().0,
                kept_mac: cfg.vtep_mac.is_none().then(|| vxlan::legacy_mac_for(cfg.node_ip)),
                address: IpNet::from(cfg.vtep_ip()),
                tx_checksum_workaround: cfg.tx_checksum_workaround,
            };
            let dev = vxlan::ensure(h, &spec).await.map_err(OverlayError::Device)?;
            if !dev.changes.is_empty() {
                tracing::info!(device = %cfg.device, changes = ?dev.changes, "VXLAN device programmed");
            }
            local.vtep_ip = Some(cfg.vtep_ip());
            local.vtep_mac = Some(Mac(dev.mac));
            local.pod_mtu = mtu;
            local.device_changes = dev.changes;
            Some(dev.index)
        } else {
            // A device left from VXLAN mode still carries entries of ours,
            // which the diff removes; the device itself is kept.
            link::by_name(h, &cfg.device).await.map_err(OverlayError::Device)?.map(|l| l.header.index)
        };
        let tunnel_index = if cfg.backend.uses_tunnel() {
            let (index, mtu, changes) = self.ensure_tunnel(&ul).await?;
            if !changes.is_empty() {
                tracing::info!(device = %cfg.tunnel_device, ?changes, "TUN datapath programmed");
            }
            local.pod_mtu = mtu;
            local.wireguard_public_key = self.wireguard_key().map(|k| k.public);
            local.device_changes = changes;
            Some(index)
        } else {
            link::by_name(h, &cfg.tunnel_device).await.map_err(OverlayError::Device)?.map(|l| l.header.index)
        };
        Ok((local, Devices { vxlan: vxlan_index, underlay: ul.index, tunnel: tunnel_index }, ul))
    }

    fn encapsulation(&self) -> Arc<dyn Encapsulation> {
        // The current key: a datapath started again after a rotation
        // keeps the rotated key.
        match self.wireguard_key() {
            Some(key) if self.cfg.backend == Backend::Wireguard => Arc::new(wireguard::WireGuard::new(key.private)),
            _ => Arc::new(udp::Udp),
        }
    }

    /// Starts the datapath (again, when its device was deleted or it
    /// stopped) and brings the TUN device to its MTU and addresses.
    async fn ensure_tunnel(&self, ul: &underlay::Underlay) -> Result<(u32, u32, Vec<String>), OverlayError> {
        let cfg = &self.cfg;
        let mut changes = Vec::new();
        let present = link::by_name(&self.handle, &cfg.tunnel_device).await.map_err(OverlayError::Tunnel)?.is_some();
        let overhead = if cfg.backend == Backend::Wireguard { wireguard::OVERHEAD } else { udp::OVERHEAD };
        let mtu = cfg.mtu.unwrap_or_else(|| tun::mtu_for(ul.mtu, cfg.node_ip, overhead));
        let poisoned = || OverlayError::Config("datapath lock poisoned".into());
        let (needed, stopped) = {
            let running = self.datapath.lock().map_err(|_| poisoned())?;
            let stopped = running.as_ref().and_then(Datapath::failure);
            (running.is_none() || stopped.is_some() || !present, stopped)
        };
        if needed {
            // The old one lets go of the device and the port first; its
            // threads are joined outside the lock (passes are serialised
            // by `pass`, so nobody starts another meanwhile).
            let old = self.datapath.lock().map_err(|_| poisoned())?.take();
            drop(old);
            let fd = tun::open(&cfg.tunnel_device).map_err(OverlayError::Tunnel)?;
            let address = std::net::SocketAddr::new(cfg.node_ip, cfg.tunnel_port);
            let started = std::net::UdpSocket::bind(address)
                .and_then(|socket| Datapath::start(fd, socket, self.encapsulation(), self.tunnel_stats.clone()));
            let datapath =
                started.map_err(|source| OverlayError::Datapath { backend: cfg.backend, address, source })?;
            *self.datapath.lock().map_err(|_| poisoned())? = Some(datapath);
            changes.push(match stopped {
                Some(why) => format!("datapath restarted ({why})"),
                None if present => "datapath started".to_owned(),
                None => "device created, datapath started".to_owned(),
            });
        }
        let mut addresses = vec![IpNet::from(cfg.vtep_ip())];
        addresses.extend(cfg.pod_cidr6.map(|b| IpNet::from(IpAddr::V6(b.network()))));
        let (index, configured) =
            tun::configure(&self.handle, &cfg.tunnel_device, mtu, &addresses).await.map_err(OverlayError::Tunnel)?;
        changes.extend(configured);
        Ok((index, mtu, changes))
    }

    /// One level-triggered pass: observe, diff against the peers, apply.
    /// Fails only on node-level problems; per-peer ones are in the report.
    pub async fn reconcile(&self, peers: &[Peer]) -> Result<Report, OverlayError> {
        let _pass = self.pass.lock().await;
        let start = Instant::now();
        let (local, devs, ul) = self.prepare().await?;
        let want = desired::compute(
            &desired::Local {
                node_name: self.cfg.node_name.clone(),
                underlay: ul.net,
                pod_cidr: self.cfg.pod_cidr,
                pod_cidr6: self.cfg.pod_cidr6,
                cluster_cidr: self.cfg.cluster_cidr,
                backend: self.cfg.backend,
                direct_routing: self.cfg.direct_routing,
                vxlan_underlay: self.cfg.vxlan_underlay,
                cluster_cidr6: self.cfg.cluster_cidr6,
                tunnel_port: self.cfg.tunnel_port,
            },
            peers,
        );
        let have = routes::observe(&self.handle, &devs).await.map_err(OverlayError::Observe)?;
        let cluster = diff::ClusterRanges::new(self.cfg.cluster_cidr, self.cfg.cluster_cidr6);
        let plan = diff::diff(&want, &have, &cluster);

        let mut peer_errors: BTreeMap<String, PeerIssue> =
            want.errors.iter().map(|(n, e)| (n.clone(), PeerIssue::Invalid(e.clone()))).collect();
        let mut programmed = want.paths.clone();
        for c in &plan.conflicts {
            if let Some(owner) = want.owners.get(&c.key) {
                programmed.remove(owner);
                peer_errors.insert(owner.clone(), PeerIssue::Conflict(c.existing.clone()));
            }
        }

        let mut applied = 0;
        let mut stale_errors = Vec::new();
        for o in &plan.ops {
            match routes::apply(&self.handle, &devs, o).await {
                Ok(()) => applied += 1,
                Err(e) => {
                    tracing::warn!(op = %o, error = %e, "overlay operation failed");
                    match want.owners.get(&o.entry().key()).filter(|_| !matches!(o, diff::Op::Delete(_))) {
                        Some(owner) => {
                            programmed.remove(owner);
                            peer_errors.insert(owner.clone(), PeerIssue::Kernel(e.to_string()));
                        }
                        None => stale_errors.push(e.to_string()),
                    }
                }
            }
        }
        if let Ok(running) = self.datapath.lock()
            && let Some(datapath) = running.as_ref()
        {
            datapath.set_peers(want.tunnel_peers.clone());
        }
        let report = Report {
            local,
            programmed,
            peer_errors,
            ops_planned: plan.ops.len(),
            ops_applied: applied,
            stale_errors,
            elapsed: start.elapsed(),
        };
        if report.ops_planned > 0 || !report.peer_errors.is_empty() {
            tracing::info!(
                planned = report.ops_planned,
                applied = report.ops_applied,
                peers = report.programmed.len(),
                peer_errors = report.peer_errors.len(),
                elapsed_ms = report.elapsed.as_millis() as u64,
                "overlay reconciled"
            );
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> OverlayConfig {
        OverlayConfig::new(
            "n1",
            "192.168.1.1".parse().unwrap(),
            "10.244.1.0/24".parse().unwrap(),
            "10.244.0.0/16".parse().unwrap(),
            Backend::Vxlan,
        )
    }

    #[test]
    fn defaults_follow_flannel() {
        let c = cfg();
        assert_eq!((c.vni, c.port, c.device.as_str()), (1, 8472, "weft.1"));
        assert_eq!(c.vtep_ip(), "10.244.1.0".parse::<IpAddr>().unwrap());
        assert!(c.vtep_mac().is_valid_unicast());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn only_backends_that_trust_a_source_address_have_a_port_pods_may_not_send_to() {
        assert_eq!(unauthenticated_port(Backend::Vxlan, Some(9999)), Some(8472), "the flag is the TUN backends'");
        assert_eq!(unauthenticated_port(Backend::Udp, None), Some(8285));
        assert_eq!(unauthenticated_port(Backend::Udp, Some(9999)), Some(9999));
        assert_eq!(unauthenticated_port(Backend::Wireguard, None), None);
        assert_eq!(unauthenticated_port(Backend::HostGw, None), None);
    }

    #[test]
    fn bad_configs_are_rejected() {
        let mut c = cfg();
        c.pod_cidr = "10.245.1.0/24".parse().unwrap();
        assert!(c.validate().is_err());
        for vni in [0, 1 << 24] {
            let mut c = cfg();
            c.vni = vni;
            assert!(c.validate().is_err());
        }
        let mut c = cfg();
        c.device = "a-very-long-device-name".into();
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.vtep_mac = Some(Mac([0xff; 6]));
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.mtu = Some(20);
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.vxlan_underlay = VxlanUnderlay::Ipv6;
        assert!(c.validate().is_err(), "VXLAN over IPv6 without the node's IPv6 address");
        c.node_ipv6 = Some("fd00::1".parse().unwrap());
        assert!(c.validate().is_ok());
        assert_eq!(c.tunnel_local(), "fd00::1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn an_ipv6_only_node_tunnels_from_its_node_ip_over_ipv6() {
        let c = OverlayConfig::new(
            "n1",
            "fd00:250::1".parse().unwrap(),
            "fd00:10:244:1::/64".parse().unwrap(),
            "fd00:10:244::/56".parse().unwrap(),
            Backend::Vxlan,
        );
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        assert_eq!(c.vxlan_underlay, VxlanUnderlay::Ipv6);
        assert_eq!(c.tunnel_local(), "fd00:250::1".parse::<IpAddr>().unwrap());
        assert_eq!(c.vtep_ip(), "fd00:10:244:1::".parse::<IpAddr>().unwrap());
        let mut over_v4 = c.clone();
        over_v4.vxlan_underlay = VxlanUnderlay::Ipv4;
        let e = over_v4.validate().unwrap_err().to_string();
        assert!(e.contains("VXLAN runs over the IPv6 underlay"), "{e}");
        let mut mixed = c.clone();
        mixed.pod_cidr = "10.244.1.0/24".parse().unwrap();
        mixed.cluster_cidr = "10.244.0.0/16".parse().unwrap();
        assert!(mixed.validate().unwrap_err().to_string().contains("different families"));
        let mut second = c;
        second.pod_cidr6 = Some("fd00:11::/64".parse().unwrap());
        assert!(second.validate().unwrap_err().to_string().contains("no second IPv6 block"));
    }
}
