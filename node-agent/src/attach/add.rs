//! ADD: reserve (an address, host ports) → program (veth pair into the pod,
//! host ports, the pod's policy rules) → persist (the record) → open (the
//! source guard lets the veth send), answered only when all are done. One
//! [`Rollback`] guard undoes the reservation on any failure, and also when
//! the ADD is dropped half-way (the CNI server runs each verb to its end
//! in a task of its own, so that only happens when the agent shuts down).

use std::path::PathBuf;
use std::sync::Arc;

use weft_proto::cni::v1::{CniRequest, CniResult, Dns, Interface, IpConfig, Route};

use super::Attacher;
use super::names::{host_veth_name, veth_mac};
use super::{AttachError, driver, off_thread};
use crate::dataplane::entries::Mac;
use crate::dataplane::link::{self, AttachSpec};
use crate::dataplane::netns::{BlockingNetns, NetnsError};
use crate::guard::Write;
use crate::hostport::{self, HostPortError, PodIdentity, Wanted, publish, request};
use crate::ipam::{Key, Record};

/// How long an ADD waits for the policy loop to apply the new pod's rules
/// before it fails (the runtime tries again): a pod never runs unpoliced.
const POLICY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Attacher {
    pub async fn add(self: &Arc<Self>, key: &Key, req: &CniRequest) -> Result<CniResult, AttachError> {
        if req.netns.is_empty() {
            return Err(AttachError::InvalidRequest("CNI_NETNS is required for ADD".into()));
        }
        if let Some(why) = self.lease.reason() {
            return Err(AttachError::TryAgain(format!("this node takes no new pods: {why}")));
        }
        let mtu = if req.mtu > 0 { req.mtu } else { self.pod_mtu };
        // Open the pod namespace first, so a bad CNI_NETNS fails before
        // anything is allocated; off this thread, since a path on a stuck
        // mount would block it.
        let path = PathBuf::from(&req.netns);
        let mut pod = off_thread("open CNI_NETNS", move || BlockingNetns::open(&path)).await?.map_err(|e| match e {
            NetnsError::Missing(_) | NetnsError::Enter { .. } => {
                AttachError::InvalidRequest(format!("CNI_NETNS {} is not a usable network namespace: {e}", req.netns))
            }
            other => AttachError::Kernel { what: "open the pod's network namespace".into(), source: other.into() },
        })?;
        // Routed pods need the bridge too: it holds the gateway address.
        let bridge_index = self.ensure_bridge(false).await?;
        let driver = driver(self.attachment());
        let (pod_id, wanted, in_api) = self.host_ports_wanted(req).await?;

        let host_veth = host_veth_name(key);
        let (host_mac, pod_mac) = (veth_mac(key, false), veth_mac(key, true));
        let record = Record {
            container_id: key.container_id.clone(),
            ifname: key.ifname.clone(),
            netns: req.netns.clone(),
            host_veth: host_veth.clone(),
            pod: pod_name(req),
            pod_uid: pod_id.uid.clone(),
            host_ports: Vec::new(),
            attachment: driver.mode(),
            ipv6: self.ipv6.is_some(),
            pod_mac: Some(Mac(pod_mac)),
        };
        let ipv6_wanted = record.ipv6;
        let ip = self.ipam.reserve(record)?;
        let rollback = Rollback::new(self, key, &host_veth);
        let addresses = self.addresses_of(ip, ipv6_wanted, driver.mode());
        // Host ports go into the same record, so the ADD writes one file.
        let pod_ips: Vec<_> = addresses.iter().map(|a| a.address.addr()).collect();
        let ports = match self.hostports.reserve(key, &pod_id, &pod_ips, &wanted) {
            Ok(ports) => ports,
            Err(e) => {
                rollback.undo().await;
                return Err(self.host_port_failure(&pod_id, e));
            }
        };
        if let Some(p) = &ports {
            self.ipam.set_host_ports(ip, &pod_id.uid, p.ports.clone());
        }
        // The policy loop compiles the pod with these addresses while the
        // veth is made; the ADD answers once its rules are in the kernel.
        // Only a pod the API knows can be selected by a policy (or be a peer).
        let policy_pod = self.policy_pods.as_ref().zip(Some(pod_name(req)).filter(|p| in_api && !p.is_empty()));
        if let Some((attached, pod)) = &policy_pod {
            attached.admit(pod, &key.container_id, pod_ips.clone());
        }
        let spec = AttachSpec {
            host_veth: host_veth.clone(),
            ifname: key.ifname.clone(),
            addresses: addresses.clone(),
            mtu,
            host_mac,
            pod_mac,
        };

        // The record's write, the host port rules and the veth overlap (and
        // the policy pass, above). All must finish before we answer. A
        // crash in between leaves a record
        // with its veth (kept by start-up reconciliation, removed by the DEL
        // the runtime sends for the failed ADD), a record without a veth, or
        // a veth without a record (both removed at start-up).
        let ipam = Arc::clone(&self.ipam);
        let persist = tokio::task::spawn_blocking(move || ipam.persist(ip));
        let programmed = self.hostports.program(ports.as_ref());
        let attach = off_thread("attach the pod", move || driver.attach(&mut pod, &spec, bridge_index));
        let (ports, attached, persisted) = tokio::join!(programmed, attach, persist);
        if let Err(e) = ports {
            rollback.undo().await;
            return Err(self.host_port_failure(&pod_id, e));
        }
        self.metrics.set_host_port_usage(self.hostports.usage());
        let failure = match (attached, persisted) {
            (Err(e), _) => Some(e.to_string()),
            (Ok(Err(e)), _) => {
                // Perhaps the bridge went away: look again on the next ADD.
                self.forget_bridge().await;
                Some(e.to_string())
            }
            (Ok(Ok(())), Ok(Err(e))) => Some(e.to_string()),
            (Ok(Ok(())), Err(join)) => Some(format!("IPAM write task failed: {join}")),
            (Ok(Ok(())), Ok(Ok(()))) => None,
        };
        if let Some(e) = failure {
            rollback.undo().await;
            return Err(AttachError::Internal(format!("cannot attach {} to the pod network: {e}", key.ifname)));
        }
        if let Some((attached, pod)) = &policy_pod
            && let Err(e) = attached.wait_applied(pod, POLICY_WAIT).await
        {
            rollback.undo().await;
            return Err(AttachError::TryAgain(e.to_string()));
        }
        // Only now may the pod send: its veth dropped everything until the
        // guard knew it, so no packet of it ever went unpoliced. The guard
        // takes committed records only, so it is committed first.
        self.ipam.commit(ip);
        if let Err(e) = self.guard_pods(Write::Update).await {
            rollback.undo().await;
            return Err(AttachError::Internal(format!("cannot attach {} to the pod network: {e}", key.ifname)));
        }
        rollback.disarm();

        Ok(CniResult {
            interfaces: vec![
                Interface { name: host_veth, mac: link::format_mac(&host_mac), mtu, sandbox: String::new() },
                Interface {
                    name: key.ifname.clone(),
                    mac: link::format_mac(&pod_mac),
                    mtu,
                    sandbox: req.netns.clone(),
                },
            ],
            ips: addresses
                .iter()
                .map(|a| IpConfig { address: a.address.to_string(), gateway: a.gateway.to_string(), interface: 1 })
                .collect(),
            routes: addresses
                .iter()
                .flat_map(|a| driver.pod_routes(a.gateway))
                .map(|(dst, gw)| Route { dst: dst.to_string(), gw: gw.map(|g| g.to_string()).unwrap_or_default() })
                .collect(),
            dns: dns_of(&req.config_json),
        })
    }
}

/// Undoes a reserved attachment (host ports, veth, address) unless the ADD
/// disarms it: awaited on a failure, so the error answers after the clean-up;
/// spawned when the ADD is dropped before either.
struct Rollback {
    attacher: Arc<Attacher>,
    key: Key,
    host_veth: String,
    armed: bool,
}

impl Rollback {
    fn new(attacher: &Arc<Attacher>, key: &Key, host_veth: &str) -> Self {
        Self { attacher: Arc::clone(attacher), key: key.clone(), host_veth: host_veth.to_owned(), armed: true }
    }

    fn disarm(mut self) {
        self.armed = false;
    }

    async fn undo(mut self) {
        self.armed = false;
        undo(&self.attacher, &self.key, &self.host_veth).await;
    }
}

impl Drop for Rollback {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (attacher, key, host_veth) = (Arc::clone(&self.attacher), self.key.clone(), self.host_veth.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move { undo(&attacher, &key, &host_veth).await });
            }
            // No runtime left (the agent is exiting): start-up reconciliation
            // and the runtime's DEL clean up after the restart.
            Err(_) => tracing::warn!(container = %key.container_id, "an interrupted ADD is left to the next start-up"),
        }
    }
}

async fn undo(attacher: &Attacher, key: &Key, host_veth: &str) {
    if let Err(e) = attacher.teardown(key, host_veth).await {
        tracing::error!(container = %key.container_id, ifname = %key.ifname, error = %e, "could not undo a failed ADD");
    }
}

impl Attacher {
    /// The pod's identity and the host ports it asks for: fixed ones from
    /// the runtime's `portMappings`, automatic ones from its annotation (read
    /// from the API when the agent has one); and whether the API has the Pod.
    async fn host_ports_wanted(&self, req: &CniRequest) -> Result<(PodIdentity, Vec<Wanted>, bool), AttachError> {
        let arg = |k: &str| req.args.get(k).cloned().unwrap_or_default();
        let mut pod_id =
            PodIdentity { namespace: arg("K8S_POD_NAMESPACE"), name: arg("K8S_POD_NAME"), uid: arg("K8S_POD_UID") };
        let mut wanted = request::from_runtime_config(&req.config_json)
            .map_err(|e| self.host_port_failure(&pod_id, HostPortError::from(e)))?;
        let Some(kube) = &self.kube else { return Ok((pod_id, wanted, false)) };
        if pod_id.name.is_empty() || pod_id.namespace.is_empty() {
            return Ok((pod_id, wanted, false));
        }
        let uid = Some(pod_id.uid.as_str()).filter(|u| !u.is_empty());
        let pod = kube
            .pods
            .get(&pod_id.namespace, &pod_id.name, uid)
            .await
            .map_err(|e| AttachError::TryAgain(e.to_string()))?;
        // No Pod object: a runtime used outside Kubernetes; nothing to read.
        let in_api = pod.is_some();
        if let Some(pod) = pod {
            if pod_id.uid.is_empty() {
                pod_id.uid = pod.metadata.uid.clone().unwrap_or_default();
            }
            let auto = request::from_pod(&pod).map_err(|e| self.host_port_failure(&pod_id, HostPortError::from(e)))?;
            if !auto.is_empty() {
                let labels = kube
                    .pods
                    .namespace_labels(&pod_id.namespace)
                    .await
                    .map_err(|e| AttachError::TryAgain(e.to_string()))?;
                if !request::namespace_allows(labels.as_ref()) {
                    let refused = request::RequestError::NotAllowed { namespace: pod_id.namespace.clone() };
                    return Err(self.host_port_failure(&pod_id, HostPortError::from(refused)));
                }
            }
            wanted.extend(auto);
        }
        Ok((pod_id, wanted, in_api))
    }

    /// The CNI error for a host port failure, also recorded as an Event on the pod.
    fn host_port_failure(&self, pod_id: &PodIdentity, e: HostPortError) -> AttachError {
        let reason = match &e {
            HostPortError::Request(request::RequestError::NotAllowed { .. }) => "HostPortsNotAllowed",
            HostPortError::Request(_) => "InvalidHostPorts",
            HostPortError::Store(hostport::StoreError::Exhausted { .. }) => "HostPortsExhausted",
            HostPortError::Store(hostport::StoreError::Conflict { .. }) => "HostPortConflict",
            _ => "HostPortsFailed",
        };
        if let Some(kube) = &self.kube {
            publish::warn_pod(&kube.client, &self.config.node_name, pod_id, reason, e.to_string());
        }
        AttachError::HostPorts(e)
    }
}

fn pod_name(req: &CniRequest) -> String {
    match (req.args.get("K8S_POD_NAMESPACE"), req.args.get("K8S_POD_NAME")) {
        (Some(ns), Some(name)) => format!("{ns}/{name}"),
        _ => String::new(),
    }
}

/// The `dns` key of the network configuration, passed through to the result.
fn dns_of(config_json: &[u8]) -> Option<Dns> {
    let v: serde_json::Value = serde_json::from_slice(config_json).ok()?;
    let dns = v.get("dns")?;
    let strings = |k: &str| -> Vec<String> {
        dns.get(k)
            .and_then(|a| a.as_array())
            .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    Some(Dns {
        nameservers: strings("nameservers"),
        domain: dns.get("domain").and_then(|d| d.as_str()).unwrap_or_default().to_owned(),
        search: strings("search"),
        options: strings("options"),
    })
}
