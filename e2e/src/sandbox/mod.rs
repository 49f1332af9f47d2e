//! The sandbox cluster: a real control plane and N nodes, each node a network
//! namespace on a shared underlay running its own weft-agent, pods as network
//! namespaces set up by exec'ing weft-cni as a runtime does.
//!
//! Layout (all namespaces are ours, prefixed `weft-sbx-`):
//! ```text
//!   weft-sbx-net     bridge br0: the underlay 10.250.0.0/24
//!   weft-sbx-cp      10.250.0.1: etcd, kube-apiserver :6443, weft-operator
//!   weft-sbx-node-N  10.250.0.(10+N): weft-agent, bridge weft0, weft.1
//!   weft-sbx-pod-*   one per pod, eth0 from weft-cni
//!   weft-sbx-vm-*    a VM pod's guest, wired to its pod's eth0 by TC (vm.rs)
//! ```
//! The host reaches the apiserver through a loopback forwarder run by the
//! supervisor (`127.0.0.1:16443`), like a load balancer in front of it.

pub mod cluster;
pub mod forward;
pub mod nodes;
pub mod operators;
pub mod pods;
pub mod probe;
pub mod testing;
pub mod vm;

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::Context;
use serde::{Deserialize, Serialize};

pub const NS_PREFIX: &str = "weft-sbx-";
pub const UNDERLAY_NS: &str = "weft-sbx-net";
pub const CP_NS: &str = "weft-sbx-cp";
pub const CP_IP: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 1);
pub const UNDERLAY_PREFIX: u8 = 24;
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The cluster CIDR of an IPv6-only sandbox (`up --ipv6-only`).
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/56";
/// The marker `up --ipv6-only` leaves in the state directory.
const IPV6_ONLY: &str = "ipv6-only";
pub const FORWARD_PORT: u16 = 16443;

/// Where the sandbox keeps its state (`$WEFT_SANDBOX_DIR`, default /run/weft-sandbox).
pub fn state_dir() -> PathBuf {
    std::env::var_os("WEFT_SANDBOX_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/run/weft-sandbox"))
}

/// Whether the sandbox is IPv6-only: the nodes' IPs (their IPv6
/// addresses), the cluster CIDR and so the pods are IPv6.
pub fn ipv6_only() -> bool {
    state_dir().join(IPV6_ONLY).exists()
}

/// Records whether the sandbox being started is IPv6-only.
pub fn set_ipv6_only(on: bool) -> anyhow::Result<()> {
    let marker = state_dir().join(IPV6_ONLY);
    let done = if on { std::fs::write(&marker, b"") } else { std::fs::remove_file(&marker).or_else(ignore_missing) };
    done.with_context(|| format!("cannot write {}", marker.display()))
}

fn ignore_missing(e: std::io::Error) -> std::io::Result<()> {
    if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) }
}

/// This sandbox's cluster CIDR.
pub fn cluster_cidr() -> &'static str {
    if ipv6_only() { CLUSTER_CIDR6 } else { CLUSTER_CIDR }
}

pub fn node_ns(name: &str) -> String {
    format!("{NS_PREFIX}{name}")
}

pub fn node_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, 0, 10 + index as u8)
}

/// The IPv6 address beside an IPv4 one on the underlay (unique local, no
/// default route): the IPv4 address's last byte in `fd00:250::/64`, so
/// 10.250.0.11 is fd00:250::b (the sandbox's and the real-node cluster's
/// underlays are separate namespaces).
pub fn node_ipv6(ipv4: Ipv4Addr) -> std::net::Ipv6Addr {
    std::net::Ipv6Addr::new(0xfd00, 0x250, 0, 0, 0, 0, 0, u16::from(ipv4.octets()[3]))
}

/// The underlay's IPv6 prefix length.
pub const UNDERLAY_PREFIX6: u8 = 64;

/// What `up` leaves for the other commands.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    pub supervisor_pid: u32,
    /// Kubeconfig for this (the root) namespace, through the forwarder.
    pub kubeconfig: PathBuf,
    /// Kubeconfig for processes inside the sandbox's namespaces.
    pub in_cluster_kubeconfig: PathBuf,
    pub backend: String,
    pub nodes: Vec<NodeInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeInfo {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    pub socket: PathBuf,
}

impl crate::supervisor::StateFile for State {
    type Node = NodeInfo;
    const WHAT: &'static str = "sandbox";
    const UP: &'static str = "e2e/sandbox.sh up";
    const DOWN: &'static str = "e2e/sandbox.sh down";
    const READY_WAIT: std::time::Duration = std::time::Duration::from_secs(300);
    const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

    fn state_dir() -> PathBuf {
        state_dir()
    }

    fn cleanup_leftovers() {
        cluster::cleanup_leftovers();
    }

    fn nodes(&self) -> &[NodeInfo] {
        &self.nodes
    }
}

impl crate::supervisor::StateNode for NodeInfo {
    fn name(&self) -> &str {
        &self.name
    }
}

/// Runs `ip args…`, failing with its stderr.
pub fn ip(args: &[&str]) -> anyhow::Result<String> {
    iproute2("ip", args)
}

/// Runs an iproute2 program (`ip`, `tc`) with `args`, failing with its stderr.
pub fn iproute2(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program} (iproute2)"))?;
    anyhow::ensure!(
        out.status.success(),
        "{program} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub use crate::control_plane::process::spawn_detached;

/// Names of the sandbox's network namespaces that exist now.
pub fn existing_namespaces() -> Vec<String> {
    crate::supervisor::namespaces_with_prefix(NS_PREFIX)
}

/// Extra flags of the sandbox's programs (`weft-sandbox up --agent-arg ...
/// --operator-arg ...`), kept in the state directory so restarted and added
/// nodes and operators get them too.
#[derive(Debug, Clone, Copy)]
pub enum ExtraArgs {
    Agent,
    Operator,
}

impl ExtraArgs {
    fn file(self) -> PathBuf {
        state_dir().join(match self {
            ExtraArgs::Agent => "agent-args.json",
            ExtraArgs::Operator => "operator-args.json",
        })
    }

    pub fn save(self, args: &[String]) -> anyhow::Result<()> {
        let file = self.file();
        std::fs::write(&file, serde_json::to_vec(args)?).with_context(|| format!("cannot write {}", file.display()))
    }

    pub fn load(self) -> Vec<String> {
        std::fs::read(self.file()).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
    }
}

/// Pid of the sandbox's kube-apiserver (for pausing the API in tests).
pub fn apiserver_pid() -> anyhow::Result<i32> {
    let path = state_dir().join("apiserver.pid");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    text.trim().parse().with_context(|| format!("bad pid in {}", path.display()))
}

/// The pid in a pidfile written when a detached process was started.
pub fn read_pid(pidfile: &std::path::Path) -> Option<i32> {
    std::fs::read_to_string(pidfile).ok().and_then(|p| p.trim().parse::<i32>().ok())
}

/// Stops the process of a pidfile (SIGTERM, up to 10 s, then SIGKILL; with
/// `kill9` SIGKILL at once) and removes the pidfile.
pub fn stop_by_pidfile(pidfile: &std::path::Path, kill9: bool) {
    let Some(pid) = read_pid(pidfile) else { return };
    if !kill9 {
        // SAFETY: plain kill(2) of a process this sandbox started.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while crate::supervisor::running(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = std::fs::remove_file(pidfile);
}
