//! ADD: address from IPAM, veth pair into the pod, bridge (or a route to
//! the pod), default route.

use std::path::Path;
use std::sync::Arc;

use weft_proto::ErrorCode;
use weft_proto::cni::v1::{CniError, CniRequest, CniResult, Dns, Interface, IpConfig, Route};

use super::key_of;
use crate::agent::{Agent, host_veth_name, ipam_error, veth_mac};
use crate::attachment::Attachment;
use crate::dataplane::link::{self, AttachSpec, HostSide};
use crate::hostport::{self, HostPortError, PodIdentity, Wanted, publish, request};
use crate::ipam::Record;
use crate::netns::{BlockingNetns, NetnsError};

impl Agent {
    pub async fn add(&self, req: &CniRequest) -> Result<CniResult, CniError> {
        let key = key_of(req)?;
        if req.netns.is_empty() {
            return Err(ErrorCode::InvalidEnv.error("CNI_NETNS is required for ADD"));
        }
        let mtu = if req.mtu > 0 { req.mtu } else { self.pod_mtu };
        // Open the pod namespace first: a bad CNI_NETNS fails before anything
        // is allocated. ADD's kernel work is called directly, not through
        // block_in_place or spawn_blocking: each call blocks for the kernel's
        // own time (about 1 ms for the veth), handing it to another thread
        // cost ADD 0.4 ms more, and the CNI server has a thread of its own
        // (main.rs), so only other CNI requests wait meanwhile.
        let mut pod = BlockingNetns::open(Path::new(&req.netns)).map_err(|e| match e {
            NetnsError::Missing(_) | NetnsError::Enter { .. } => {
                ErrorCode::InvalidEnv.error(format!("CNI_NETNS {} is not a usable network namespace: {e}", req.netns))
            }
            other => ErrorCode::Internal.error(other.to_string()),
        })?;
        // Routed pods need the bridge too: it holds the gateway address.
        let bridge_index = self.ensure_bridge(false).await?;
        let attachment = self.attachment();
        let (pod_id, wanted) = self.host_ports_wanted(req).await?;

        let host_veth = host_veth_name(&key);
        let record = Record {
            container_id: key.container_id.clone(),
            ifname: key.ifname.clone(),
            netns: req.netns.clone(),
            host_veth: host_veth.clone(),
            pod: pod_name(req),
            pod_uid: pod_id.uid.clone(),
            host_ports: Vec::new(),
            attachment,
        };
        let ip = self.ipam.reserve(record).map_err(ipam_error)?;
        // Host ports go into the same record, so the ADD writes one file.
        let ports = match self.hostports.reserve(&key, &pod_id, ip, &wanted) {
            Ok(ports) => ports,
            Err(e) => {
                if let Err(cleanup) = self.teardown(&key, &host_veth).await {
                    tracing::error!(%ip, error = %cleanup.msg, "could not undo a failed ADD");
                }
                return Err(self.host_port_failure(&pod_id, e));
            }
        };
        if let Some(p) = &ports {
            self.ipam.set_host_ports(ip, &pod_id.uid, p.ports.clone());
        }
        let pool = *self.ipam.pool();
        let address = attachment.pod_address(ip, pool.cidr());
        let (host_mac, pod_mac) = (veth_mac(&key, false), veth_mac(&key, true));
        let spec = AttachSpec {
            host_veth: host_veth.clone(),
            ifname: key.ifname.clone(),
            host: match attachment {
                Attachment::Bridge => HostSide::Bridge(bridge_index),
                Attachment::Routed => HostSide::Routed,
            },
            address,
            gateway: pool.gateway(),
            mtu,
            host_mac,
            pod_mac,
        };

        // The record's write overlaps with the kernel work. Both must finish
        // before we answer; a crash in between leaves either a record without
        // a complete attachment or a veth without a record, and start-up
        // reconciliation removes both.
        let ipam = Arc::clone(&self.ipam);
        let persist = tokio::task::spawn_blocking(move || ipam.persist(ip));
        let programmed = self.hostports.program(ports.as_ref());
        // Polled after `programmed`, which has then started iptables-restore,
        // so the rules are written while the veth is built.
        let attach = async { link::attach(&mut pod, &spec) };
        let (ports, attached, persisted) = tokio::join!(programmed, attach, persist);
        if let Err(e) = ports {
            if let Err(cleanup) = self.teardown(&key, &host_veth).await {
                tracing::error!(%ip, error = %cleanup.msg, "could not undo a failed ADD");
            }
            return Err(self.host_port_failure(&pod_id, e));
        }
        self.metrics.set_host_port_usage(self.hostports.usage());
        let failure = match (attached, persisted) {
            (Err(e), _) => {
                // Perhaps the bridge went away: look again on the next ADD.
                self.forget_bridge().await;
                Some(e.to_string())
            }
            (Ok(()), Ok(Err(e))) => Some(e.to_string()),
            (Ok(()), Err(join)) => Some(format!("IPAM write task failed: {join}")),
            (Ok(()), Ok(Ok(()))) => None,
        };
        if let Some(e) = failure {
            if let Err(cleanup) = self.teardown(&key, &host_veth).await {
                tracing::error!(%ip, error = %cleanup.msg, "could not undo a failed ADD");
            }
            return Err(ErrorCode::Internal.error(format!("cannot attach {} to the pod network: {e}", key.ifname)));
        }
        self.ipam.commit(ip);

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
            ips: vec![IpConfig { address: address.to_string(), gateway: pool.gateway().to_string(), interface: 1 }],
            routes: vec![Route { dst: "0.0.0.0/0".into(), gw: pool.gateway().to_string() }],
            dns: dns_of(&req.config_json),
        })
    }
}

impl Agent {
    /// The pod's identity and the host ports it asks for: fixed ones from
    /// the runtime's `portMappings`, automatic ones from its annotation (read
    /// from the API when the agent has one).
    async fn host_ports_wanted(&self, req: &CniRequest) -> Result<(PodIdentity, Vec<Wanted>), CniError> {
        let arg = |k: &str| req.args.get(k).cloned().unwrap_or_default();
        let mut pod_id =
            PodIdentity { namespace: arg("K8S_POD_NAMESPACE"), name: arg("K8S_POD_NAME"), uid: arg("K8S_POD_UID") };
        let mut wanted = request::from_runtime_config(&req.config_json)
            .map_err(|e| self.host_port_failure(&pod_id, HostPortError::from(e)))?;
        let Some(kube) = &self.kube else { return Ok((pod_id, wanted)) };
        if pod_id.name.is_empty() || pod_id.namespace.is_empty() {
            return Ok((pod_id, wanted));
        }
        let uid = Some(pod_id.uid.as_str()).filter(|u| !u.is_empty());
        let pod = kube
            .pods
            .get(&pod_id.namespace, &pod_id.name, uid)
            .await
            .map_err(|e| ErrorCode::TryAgainLater.error(e.to_string()))?;
        // No Pod object: a runtime used outside Kubernetes; nothing to read.
        if let Some(pod) = pod {
            if pod_id.uid.is_empty() {
                pod_id.uid = pod.metadata.uid.clone().unwrap_or_default();
            }
            let auto = request::from_pod(&pod).map_err(|e| self.host_port_failure(&pod_id, HostPortError::from(e)))?;
            wanted.extend(auto);
        }
        Ok((pod_id, wanted))
    }

    /// The CNI error for a host port failure, also recorded as an Event on the pod.
    fn host_port_failure(&self, pod_id: &PodIdentity, e: HostPortError) -> CniError {
        let err = e.to_cni();
        let reason = match &e {
            HostPortError::Request(_) => "InvalidHostPorts",
            HostPortError::Store(hostport::StoreError::Exhausted { .. }) => "HostPortsExhausted",
            HostPortError::Store(hostport::StoreError::Conflict { .. }) => "HostPortConflict",
            _ => "HostPortsFailed",
        };
        if let Some(kube) = &self.kube {
            publish::warn_pod(&kube.client, &self.config.node_name, pod_id, reason, err.msg.clone());
        }
        err
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
