//! Sandbox pods: a network namespace set up by exec'ing weft-cni inside its
//! node's namespace exactly as a container runtime does, a Pod object in the
//! API, and a small responder serving the pod's ports.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{NS_PREFIX, State, ip, state_dir};
use crate::bins;
use crate::cni::Outcome;
use crate::supervisor::StateFile;

/// A port a pod serves: `80/tcp`, `53/udp`, `9000/sctp`, optionally named (`http=80/tcp`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortSpec {
    pub name: Option<String>,
    pub port: u16,
    pub protocol: String,
}

impl std::str::FromStr for PortSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, rest) = match s.split_once('=') {
            Some((n, r)) => (Some(n.to_owned()), r),
            None => (None, s),
        };
        let (port, proto) = rest.split_once('/').unwrap_or((rest, "tcp"));
        let port = port.parse().map_err(|_| format!("bad port in {s:?}"))?;
        let protocol = proto.to_ascii_lowercase();
        if !["tcp", "udp", "sctp"].contains(&protocol.as_str()) {
            return Err(format!("protocol in {s:?} must be tcp, udp or sctp"));
        }
        Ok(PortSpec { name, port, protocol })
    }
}

/// A pod spec `hostPort`: `8080:80/tcp` maps node port 8080 to container port 80.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPortSpec {
    pub host_port: u16,
    pub container_port: u16,
    pub protocol: String,
}

impl std::str::FromStr for HostPortSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (ports, proto) = s.split_once('/').unwrap_or((s, "tcp"));
        let (h, c) = ports.split_once(':').ok_or_else(|| format!("{s:?} is not HOSTPORT:CONTAINERPORT[/protocol]"))?;
        let port = |x: &str| x.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| format!("bad port {x:?} in {s:?}"));
        Ok(HostPortSpec { host_port: port(h)?, container_port: port(c)?, protocol: proto.to_ascii_lowercase() })
    }
}

/// Extras of a pod beyond its name, node, labels and ports.
#[derive(Debug, Clone, Default)]
pub struct PodOptions {
    pub annotations: BTreeMap<String, String>,
    /// Pod spec `hostPort`s, passed to weft-cni as `runtimeConfig.portMappings` as a runtime does.
    pub host_ports: Vec<HostPortSpec>,
    /// Run the pod as a VM runtime does: its workload in a guest wired to
    /// eth0 by TC redirects ([`super::vm`]).
    pub vm: bool,
}

/// What the sandbox remembers of a pod.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PodRecord {
    pub name: String,
    pub namespace: String,
    pub node: String,
    /// The namespace the runtime gives weft-cni (CNI_NETNS).
    pub netns: String,
    /// A VM pod's guest, where its workload runs; none for a plain pod.
    #[serde(default)]
    pub guest_netns: Option<String>,
    pub container_id: String,
    pub ip: String,
    /// The IPv6 address of a pod in a dual-stack sandbox.
    #[serde(default)]
    pub ip6: Option<String>,
    pub ports: Vec<PortSpec>,
    #[serde(default)]
    pub host_ports: Vec<HostPortSpec>,
    #[serde(default)]
    pub uid: String,
    pub responder_pid: Option<u32>,
}

fn pods_dir() -> PathBuf {
    state_dir().join("pods")
}

impl PodRecord {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Where the pod's workload runs and its traffic starts: the guest of a
    /// VM pod, else the pod's namespace.
    pub fn workload_netns(&self) -> &str {
        self.guest_netns.as_deref().unwrap_or(&self.netns)
    }

    /// Removes a VM pod's guest namespace (its link went with the pod's).
    fn remove_guest(&self) {
        if let Some(guest) = &self.guest_netns {
            let _ = ip(&["netns", "del", guest]);
        }
    }

    fn path(namespace: &str, name: &str) -> PathBuf {
        pods_dir().join(format!("{namespace}_{name}.json"))
    }

    pub fn load(namespace: &str, name: &str) -> anyhow::Result<PodRecord> {
        let text = std::fs::read_to_string(Self::path(namespace, name))
            .with_context(|| format!("no sandbox pod {namespace}/{name}"))?;
        Ok(serde_json::from_str(&text)?)
    }

    pub fn all() -> Vec<PodRecord> {
        let Ok(rd) = std::fs::read_dir(pods_dir()) else { return Vec::new() };
        let mut v: Vec<PodRecord> = rd
            .filter_map(Result::ok)
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .filter_map(|t| serde_json::from_str(&t).ok())
            .collect();
        v.sort_by_key(PodRecord::key);
        v
    }

    pub fn stop_responder(&self) {
        if let Some(pid) = self.responder_pid {
            // SAFETY: plain kill(2) of the responder we started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// The network configuration as a runtime passes it for this pod: the
/// `portMappings` capability filled from the pod's hostPorts.
fn cni_conf(state: &State, rec: &PodRecord) -> anyhow::Result<serde_json::Value> {
    let n = state.node(&rec.node)?;
    let mut conf = json!({"cniVersion": "1.1.0", "name": "weft", "type": "weft-cni", "agentSocket": n.socket,
                          "capabilities": {"portMappings": true}});
    if !rec.host_ports.is_empty() {
        let mappings: Vec<_> = rec
            .host_ports
            .iter()
            .map(|h| json!({"hostPort": h.host_port, "containerPort": h.container_port, "protocol": h.protocol}))
            .collect();
        conf["runtimeConfig"] = json!({"portMappings": mappings});
    }
    Ok(conf)
}

/// Execs weft-cni inside the node's namespace, as the runtime on that node would.
fn cni(state: &State, verb: &str, rec: &PodRecord) -> anyhow::Result<Outcome> {
    let n = state.node(&rec.node)?;
    let ns = crate::netns::Netns::existing(&n.netns);
    let mut args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={}", rec.namespace, rec.name);
    if !rec.uid.is_empty() {
        args.push_str(&format!(";K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}", rec.container_id, rec.uid));
    }
    let netns_path = format!("/run/netns/{}", rec.netns);
    let env = [
        ("CNI_COMMAND", verb),
        ("CNI_CONTAINERID", rec.container_id.as_str()),
        ("CNI_NETNS", netns_path.as_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", args.as_str()),
    ];
    Ok(crate::cni::exec_raw(&ns, &bins::weft("weft-cni"), &env, cni_conf(state, rec)?.to_string().as_bytes()))
}

/// Creates a pod on `node` (default: the least loaded node) the way a
/// cluster does: the Pod object first (scheduled to the node), then the
/// runtime's CNI ADD, then the pod's status and its responder.
pub async fn add(
    name: &str,
    namespace: &str,
    node: Option<&str>,
    labels: &BTreeMap<String, String>,
    ports: &[PortSpec],
    options: &PodOptions,
) -> anyhow::Result<PodRecord> {
    let state = State::load()?;
    if PodRecord::load(namespace, name).is_ok() {
        bail!("pod {namespace}/{name} exists already");
    }
    for h in &options.host_ports {
        if !ports.iter().any(|p| p.port == h.container_port && p.protocol == h.protocol) {
            bail!(
                "host port {}:{}/{} maps a port the pod does not serve (add --port)",
                h.host_port,
                h.container_port,
                h.protocol
            );
        }
    }
    let node = match node {
        Some(n) => state.node(n)?.name.clone(),
        None => least_loaded(&state),
    };
    let netns = format!("{NS_PREFIX}pod-{namespace}-{name}");
    let mut rec = PodRecord {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        node: node.clone(),
        netns: netns.clone(),
        guest_netns: None,
        // Unique per creation, as a runtime's sandbox IDs are.
        container_id: format!("sbx-{namespace}-{name}-{:08x}", rand::random::<u32>()),
        ip: String::new(),
        ip6: None,
        ports: ports.to_vec(),
        host_ports: options.host_ports.clone(),
        uid: String::new(),
        responder_pid: None,
    };
    let client = crate::control_plane::kube_util::client_from(&state.kubeconfig).await?;
    let pods = Api::<Pod>::namespaced(client.clone(), namespace);
    rec.uid = create_pod_object(&client, &rec, labels, options).await?;
    let undo_object = || async {
        let _ = pods.delete(name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await;
    };
    if let Err(e) = ip(&["netns", "add", &netns]).and_then(|_| ip(&["-n", &netns, "link", "set", "lo", "up"])) {
        undo_object().await;
        return Err(e);
    }
    let out = match cni(&state, "ADD", &rec) {
        Ok(out) => out,
        Err(e) => {
            let _ = ip(&["netns", "del", &netns]);
            undo_object().await;
            return Err(e);
        }
    };
    if !out.success {
        let _ = ip(&["netns", "del", &netns]);
        undo_object().await;
        bail!("weft-cni ADD failed: {}", out.stdout);
    }
    let result = out.json();
    rec.ip = crate::cni::pod_ip(&result);
    // An IPv6-only pod's one address is its `ip`, not a second one.
    rec.ip6 = crate::cni::pod_ip6(&result).filter(|v6| *v6 != rec.ip);
    let finished = async {
        if options.vm {
            wire_vm(&mut rec, &result)?;
        }
        register(&state, &mut rec).await
    };
    match finished.await {
        Ok(()) => Ok(rec),
        Err(e) => {
            // Leave nothing half-made behind: the attachment, the namespaces and the object go too.
            rec.stop_responder();
            rec.remove_guest();
            let _ = cni(&state, "DEL", &rec);
            let _ = ip(&["netns", "del", &rec.netns]);
            undo_object().await;
            Err(e)
        }
    }
}

/// Moves the pod's workload into a VM guest wired to eth0 as Kata does,
/// configured from the ADD `result` alone.
fn wire_vm(rec: &mut PodRecord, result: &serde_json::Value) -> anyhow::Result<()> {
    let guest = super::vm::GuestInterface::from_result(result, "eth0")?;
    let guest_netns = format!("{NS_PREFIX}vm-{}-{}", rec.namespace, rec.name);
    super::vm::wire(&rec.netns, "eth0", &guest_netns, &guest)?;
    rec.guest_netns = Some(guest_netns);
    Ok(())
}

/// The Pod object, scheduled to the record's node; returns its UID.
async fn create_pod_object(
    client: &kube::Client,
    rec: &PodRecord,
    labels: &BTreeMap<String, String>,
    options: &PodOptions,
) -> anyhow::Result<String> {
    ensure_namespace(client, &rec.namespace).await?;
    let pods = Api::<Pod>::namespaced(client.clone(), &rec.namespace);
    let container_ports: Vec<_> = rec
        .ports
        .iter()
        .map(|p| {
            let mut v = json!({"containerPort": p.port, "protocol": p.protocol.to_ascii_uppercase()});
            if let Some(n) = &p.name {
                v["name"] = json!(n);
            }
            if let Some(h) = rec.host_ports.iter().find(|h| h.container_port == p.port && h.protocol == p.protocol) {
                v["hostPort"] = json!(h.host_port);
            }
            v
        })
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": rec.name, "namespace": rec.namespace, "labels": labels, "annotations": options.annotations},
        "spec": {"nodeName": rec.node, "containers": [{"name": "app", "image": "weft.dev/sandbox-responder", "ports": container_ports}]},
    }))?;
    let created = pods
        .create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("creating Pod {}/{}", rec.namespace, rec.name))?;
    Ok(created.metadata.uid.unwrap_or_default())
}

/// The pod's status, its responder and its record, once it is attached.
async fn register(state: &State, rec: &mut PodRecord) -> anyhow::Result<()> {
    let client = crate::control_plane::kube_util::client_from(&state.kubeconfig).await?;
    let pods = Api::<Pod>::namespaced(client, &rec.namespace);
    let node_ip = state.node(&rec.node)?.ip;
    let host_ip = if super::ipv6_only() { super::node_ipv6(node_ip).to_string() } else { node_ip.to_string() };
    let pod_ips: Vec<_> = std::iter::once(&rec.ip).chain(&rec.ip6).map(|ip| json!({"ip": ip})).collect();
    let status = json!({"status": {"phase": "Running", "podIP": rec.ip, "podIPs": pod_ips, "hostIP": host_ip}});
    pods.patch_status(&rec.name, &PatchParams::default(), &Patch::Merge(&status)).await?;

    rec.responder_pid = Some(start_responder(rec)?);
    std::fs::create_dir_all(pods_dir())?;
    std::fs::write(PodRecord::path(&rec.namespace, &rec.name), serde_json::to_vec_pretty(&rec)?)?;
    Ok(())
}

fn least_loaded(state: &State) -> String {
    let pods = PodRecord::all();
    state
        .nodes
        .iter()
        .min_by_key(|n| pods.iter().filter(|p| p.node == n.name).count())
        .map(|n| n.name.clone())
        .unwrap_or_default()
}

/// The namespace and its `default` ServiceAccount (the sandbox runs no
/// controller-manager to create it, and Pod admission requires it). A
/// namespace made here allows automatic host ports, as the sandbox's admin;
/// one that exists already is left as it is.
async fn ensure_namespace(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let api = Api::<Namespace>::all(client.clone());
    if api.get_opt(name).await?.is_none() {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": {
            weft_api::host_port::NAMESPACE_OPT_IN_LABEL: weft_api::host_port::NAMESPACE_OPT_IN_VALUE,
        }}}))?;
        api.create(&PostParams::default(), &ns).await.with_context(|| format!("creating namespace {name}"))?;
    }
    let sas = Api::<ServiceAccount>::namespaced(client.clone(), name);
    if sas.get_opt("default").await?.is_none() {
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}}))?;
        match sas.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e).context("creating the default ServiceAccount"),
        }
    }
    Ok(())
}

/// Starts `weft-sandbox respond` inside the pod, detached from this command,
/// and waits until it serves every port (a probe right after must not race it).
fn start_responder(rec: &PodRecord) -> anyhow::Result<u32> {
    let log = state_dir().join(format!("responder-{}-{}.log", rec.namespace, rec.name));
    let ready = state_dir().join(format!("responder-{}-{}.ready", rec.namespace, rec.name));
    let _ = std::fs::remove_file(&ready);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", rec.workload_netns()])
        .arg(std::env::current_exe()?)
        .args(["respond", "--name", &rec.key()])
        .arg("--ready-file")
        .arg(&ready)
        .args(rec.ports.iter().map(|p| format!("--port={}/{}", p.port, p.protocol)));
    let mut child = super::spawn_detached(cmd, &log)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !ready.exists() {
        if let Some(status) = child.try_wait()? {
            bail!("the pod's responder exited ({status}): {}", std::fs::read_to_string(&log).unwrap_or_default());
        }
        if std::time::Instant::now() > deadline {
            bail!("the pod's responder did not serve its ports within 10 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Ok(child.id())
}

/// Deletes a pod: CNI DEL, namespace, Pod object (unless `keep_object`:
/// the API may be unreachable on purpose), record.
pub async fn delete(name: &str, namespace: &str, keep_object: bool) -> anyhow::Result<()> {
    let state = State::load()?;
    let rec = PodRecord::load(namespace, name)?;
    rec.stop_responder();
    let out = cni(&state, "DEL", &rec)?;
    if !out.success {
        bail!("weft-cni DEL failed: {}", out.stdout);
    }
    let _ = ip(&["netns", "del", &rec.netns]);
    rec.remove_guest();
    if keep_object {
        std::fs::remove_file(PodRecord::path(namespace, name))?;
        return Ok(());
    }
    let client = crate::control_plane::kube_util::client_from(&state.kubeconfig).await?;
    let pods = Api::<Pod>::namespaced(client, namespace);
    match pods.delete(name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e).context("deleting the Pod object"),
    }
    std::fs::remove_file(PodRecord::path(namespace, name))?;
    Ok(())
}
