//! Sandbox nodes: a namespace on the underlay, a Node object, and a
//! weft-agent that runs detached (its pid in the node's directory) so that it
//! can be restarted, and nodes added or removed, while the sandbox runs.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use weft_api::subnet::Subnet;

use super::{NodeInfo, State, UNDERLAY_NS, UNDERLAY_PREFIX, UNDERLAY_PREFIX6, ip, state_dir};
use crate::bins;
use crate::control_plane::{self, kube_util, process};
use crate::supervisor::StateFile;

/// Creates `netns` (loopback up) with a veth to the underlay bridge carrying `addr`.
pub fn attach_to_underlay(netns: &str, tag: &str, addr: Ipv4Addr) -> anyhow::Result<()> {
    attach_to_bridge(UNDERLAY_NS, netns, tag, addr)
}

/// Creates `netns` (loopback up) with a veth to bridge `br0` of namespace
/// `underlay` carrying `addr` on the underlay's prefix, and its IPv6
/// counterpart ([`super::node_ipv6`]): the underlay is dual-stack. No
/// duplicate address detection: the IPv6 address is usable at once.
pub fn attach_to_bridge(underlay: &str, netns: &str, tag: &str, addr: Ipv4Addr) -> anyhow::Result<()> {
    ip(&["netns", "add", netns])?;
    ip(&["-n", netns, "link", "set", "lo", "up"])?;
    let port = format!("ul-{tag}");
    ip(&["-n", underlay, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", netns])?;
    ip(&["-n", underlay, "link", "set", &port, "master", "br0", "up"])?;
    ip(&["-n", netns, "addr", "add", &format!("{addr}/{UNDERLAY_PREFIX}"), "dev", "eth0"])?;
    let ipv6 = format!("{}/{UNDERLAY_PREFIX6}", super::node_ipv6(addr));
    ip(&["-n", netns, "addr", "add", &ipv6, "dev", "eth0", "nodad"])?;
    ip(&["-n", netns, "link", "set", "eth0", "up"])?;
    Ok(())
}

/// Adds node `node-<index>`: namespace, Node object, agent.
pub async fn add(client: &kube::Client, index: usize, kubeconfig: &Path) -> anyhow::Result<NodeInfo> {
    let name = format!("node-{index}");
    let netns = super::node_ns(&name);
    let node_ip = super::node_ip(index);
    attach_to_underlay(&netns, &format!("n{index}"), node_ip)?;
    register(&Api::<Node>::all(client.clone()), &name, node_ip).await?;
    let dir = state_dir().join(&name);
    std::fs::create_dir_all(&dir)?;
    let info = NodeInfo { name, netns, ip: node_ip, socket: dir.join("agent.sock") };
    start_agent(&info, kubeconfig)?;
    Ok(info)
}

async fn register(api: &Api<Node>, name: &str, addr: Ipv4Addr) -> anyhow::Result<()> {
    let addr6 = super::node_ipv6(addr);
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "weft.dev/sandbox": "true"}},
    }))?;
    api.create(&PostParams::default(), &node).await.with_context(|| format!("registering Node {name}"))?;
    let status = json!({"status": {
        "addresses": [
            {"type": "InternalIP", "address": addr.to_string()},
            {"type": "InternalIP", "address": addr6.to_string()},
            {"type": "Hostname", "address": name},
        ],
        "conditions": [{"type": "Ready", "status": "True", "reason": "SandboxNode", "message": "a weft sandbox node"}],
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await?;
    Ok(())
}

/// Starts the node's agent detached, appending to its log.
pub fn start_agent(node: &NodeInfo, kubeconfig: &Path) -> anyhow::Result<u32> {
    let dir = state_dir().join(&node.name);
    let mut cmd = process::in_netns(&node.netns, bins::weft("weft-agent"));
    let node_ips = format!("{},{}", node.ip, super::node_ipv6(node.ip));
    let node_ip = if super::ipv6_only() { super::node_ipv6(node.ip).to_string() } else { node.ip.to_string() };
    cmd.args(["--node-name", &node.name, "--node-ip", &node_ip, "--cluster-cidr", super::cluster_cidr()])
        .args(["--node-ips", &node_ips])
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--socket")
        .arg(&node.socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--metrics-addr", "0.0.0.0:9646"])
        .args(super::ExtraArgs::Agent.load());
    let pid = super::spawn_detached(cmd, &dir.join("agent.log"))?.id();
    std::fs::write(dir.join("agent.pid"), pid.to_string())?;
    Ok(pid)
}

/// Stops the node's agent (SIGTERM, then SIGKILL) if it runs.
pub fn stop_agent(node: &str) {
    super::stop_by_pidfile(&state_dir().join(node).join("agent.pid"), false);
}

/// Restarts a node's agent (`kill9`: without letting it shut down cleanly).
pub fn restart_agent(state: &State, node: &str, kill9: bool) -> anyhow::Result<u32> {
    let info = state.node(node)?;
    super::stop_by_pidfile(&state_dir().join(node).join("agent.pid"), kill9);
    start_agent(info, &state.in_cluster_kubeconfig)
}

/// Adds the next node to a running sandbox.
pub async fn add_to_running() -> anyhow::Result<NodeInfo> {
    let mut state = State::load()?;
    let index = (1..).find(|i| !state.nodes.iter().any(|n| n.name == format!("node-{i}"))).unwrap_or(1);
    let client = crate::control_plane::kube_util::client_from(&state.kubeconfig).await?;
    let info = add(&client, index, &state.in_cluster_kubeconfig).await?;
    state.nodes.push(info.clone());
    state.save()?;
    wait_ready(&client, &state.nodes).await?;
    Ok(info)
}

/// Removes a node: its pods (drained first, through CNI DEL), its agent,
/// its Node object (the operator then releases its Subnet) and its namespace.
pub async fn remove(name: &str) -> anyhow::Result<()> {
    let mut state = State::load()?;
    let info = state.node(name)?.clone();
    for pod in super::pods::PodRecord::all().into_iter().filter(|p| p.node == name) {
        super::pods::delete(&pod.name, &pod.namespace, false).await?;
    }
    stop_agent(name);
    let client = crate::control_plane::kube_util::client_from(&state.kubeconfig).await?;
    let nodes = Api::<Node>::all(client);
    match nodes.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e).context("deleting the Node object"),
    }
    let _ = ip(&["netns", "del", &info.netns]);
    state.nodes.retain(|n| n.name != name);
    state.save()
}

/// Waits until every node's Subnet is Ready with its peers programmed.
pub async fn wait_ready(client: &kube::Client, nodes: &[NodeInfo]) -> anyhow::Result<()> {
    let subnets = Api::<Subnet>::all(client.clone());
    control_plane::wait_for(Duration::from_secs(180), "every node's Subnet Ready with peers programmed", || async {
        let list = subnets.list(&Default::default()).await?;
        Ok(nodes.iter().all(|n| kube_util::subnet_ready(&list.items, &n.name)))
    })
    .await
}
