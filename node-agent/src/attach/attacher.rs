//! [`Attacher`]: what attaching pods needs (configuration, IPAM, host
//! ports, the source guard, the policy loop's hand-over, the node's netlink
//! handles, the bridge and the mode of new pods, per-key ordering) and owns.
//! Its verbs are in the files beside this one: `add`, `check`, `del`, `gc`,
//! `status`, start-up reconciliation and the repair loop.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use ipnet::IpNet;
use rtnetlink::Handle;

use super::{AttachError, KeyLocks, deadline};
use crate::attachment::{self, Attachment};
use crate::config::Config;
use crate::dataplane::link::{self, PodAddress};
use crate::guard::Guard;
use crate::hostport::HostPorts;
use crate::hostport::pods::PodCache;
use crate::ipam::{Ipam, Ipv6Block, Record};
use crate::lease::Withdrawal;
use crate::metrics::Metrics;

pub struct Attacher {
    pub config: Config,
    pub ipam: Arc<Ipam>,
    pub hostports: Arc<HostPorts>,
    /// What each pod may send (its own addresses only).
    pub guard: Guard,
    /// Where ADD registers a pod for the policy loop and waits for its
    /// rules (None: policy is not enforced on this node).
    pub policy_pods: Option<Arc<crate::policy::attached::Attached>>,
    /// The API, when the agent has one: pods' host port annotations, Events.
    pub kube: Option<KubeAccess>,
    pub host: Handle,
    /// A netlink socket of its own for health checks (STATUS, /readyz): a
    /// flood of them never makes ADD's or start-up's dumps busy.
    pub health: Handle,
    pub metrics: Arc<Metrics>,
    /// MTU of pod interfaces when the network configuration sets none.
    pub pod_mtu: u32,
    /// The bridge's index once it is known to be set up.
    bridge: tokio::sync::Mutex<Option<u32>>,
    /// How new pods are attached: the configured mode once start-up
    /// reconciliation has seen the pods already here.
    mode: Mutex<Attachment>,
    /// One verb at a time per attachment.
    pub locks: KeyLocks,
    /// Set while this node's Subnet lease is withdrawn: no new pods.
    pub lease: Arc<Withdrawal>,
    /// The node's IPv6 block when the cluster is dual-stack: bridged pods
    /// get an IPv6 address from it besides their IPv4 one.
    pub ipv6: Option<Ipv6Block>,
}

/// The agent's view of the Kubernetes API.
pub struct KubeAccess {
    pub client: kube::Client,
    pub pods: PodCache,
}

impl Attacher {
    pub fn new(
        config: Config,
        ipam: Ipam,
        hostports: HostPorts,
        kube: Option<KubeAccess>,
        host: Handle,
        pod_mtu: u32,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            mode: Mutex::new(config.pod_attachment),
            config,
            ipam: Arc::new(ipam),
            hostports: Arc::new(hostports),
            guard: Guard::default(),
            policy_pods: None,
            kube,
            health: host.clone(),
            host,
            metrics,
            pod_mtu,
            bridge: tokio::sync::Mutex::new(None),
            locks: KeyLocks::default(),
            lease: Arc::default(),
            ipv6: None,
        }
    }

    /// How new pods are attached.
    pub fn attachment(&self) -> Attachment {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Settles the mode of new pods from the configured one and the pods
    /// already here (see [`attachment::effective`]).
    pub fn settle_attachment(&self) -> Attachment {
        let configured = self.config.pod_attachment;
        let mode = attachment::effective(configured, self.ipam.all().into_iter().map(|(_, r)| r.attachment));
        if mode != configured {
            tracing::warn!(
                %configured, running = %mode,
                "pods attached {mode} still run on this node: new pods are attached {mode} too, until the agent starts on a node without them"
            );
        }
        *self.mode.lock().unwrap_or_else(|p| p.into_inner()) = mode;
        mode
    }

    /// The bridge with the gateway address, created when missing. Returns its
    /// index. ADDs use the cached index; `refresh` (start-up, the repair
    /// loop) checks the kernel again, as does the ADD after a failed one.
    pub async fn ensure_bridge(&self, refresh: bool) -> Result<u32, AttachError> {
        let mut cached = self.bridge.lock().await;
        if let (Some(index), false) = (*cached, refresh) {
            return Ok(index);
        }
        let what = format!("set up bridge {}", self.config.bridge);
        let index = deadline(&what, link::ensure_bridge(&self.host, &self.config.bridge, &self.gateways())).await?;
        *cached = Some(index);
        Ok(index)
    }

    /// Whether new pods get an IPv6 address: from the IPv6 block of a
    /// dual-stack node, or from an IPv6 pool.
    pub fn ipv6_pods(&self) -> bool {
        self.ipv6.is_some() || self.ipam.pool().cidr().addr().is_ipv6()
    }

    /// The bridge's gateway addresses: the pool's, and the IPv6 block's on
    /// a dual-stack node.
    pub fn gateways(&self) -> Vec<IpNet> {
        let v6 = self.ipv6.map(|b| IpNet::V6(b.gateway_net()));
        std::iter::once(self.ipam.pool().gateway_net()).chain(v6).collect()
    }

    /// The addresses and gateways of the pod whose pool address is `ip`
    /// and whose record is `record`, the pool's first.
    pub fn pod_addresses(&self, ip: IpAddr, record: &Record) -> Vec<PodAddress> {
        self.addresses_of(ip, record.ipv6, record.attachment)
    }

    /// The addresses (as a pod of `mode` carries them) and gateways of the
    /// pod whose pool address is `ip`: that one, and on a dual-stack node
    /// when the pod has it (`has_ipv6`) the IPv6 address of its host number.
    pub fn addresses_of(&self, ip: IpAddr, has_ipv6: bool, mode: Attachment) -> Vec<PodAddress> {
        let driver = super::driver(mode);
        let pool = self.ipam.pool();
        let primary = PodAddress { address: driver.pod_address(ip, pool.cidr()), gateway: pool.gateway() };
        let second = self.ipv6.filter(|_| has_ipv6).and_then(|block| {
            Some(PodAddress {
                address: driver.pod_address(block.beside(ip)?.into(), block.cidr().into()),
                gateway: block.gateway().into(),
            })
        });
        std::iter::once(primary).chain(second).collect()
    }

    /// Forgets the bridge's index, so the next ADD checks the kernel again.
    pub async fn forget_bridge(&self) {
        *self.bridge.lock().await = None;
    }
}
