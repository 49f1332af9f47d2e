//! weft-cluster: a Kubernetes cluster of real nodes (kubelet + containerd in
//! network and mount namespaces) with Weft installed by its Helm chart.
//! `e2e/cluster.sh` builds everything and calls this.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Context;
use clap::{Parser, Subcommand};
use weft_e2e::cluster::{self, State, node, supervise};
use weft_e2e::control_plane;
use weft_e2e::supervisor::StateFile;

#[derive(Parser)]
#[command(name = "weft-cluster", about = "A local Kubernetes cluster of real nodes running Weft")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the control plane and N nodes, then `helm install` Weft.
    Up {
        #[arg(long, default_value_t = 2)]
        nodes: usize,
        /// vxlan or host-gw.
        #[arg(long, default_value = "vxlan")]
        backend: String,
        /// An extra chart value, key=value (repeatable), e.g. --set agent.podAttachment=routed.
        #[arg(long = "set")]
        sets: Vec<String>,
    },
    /// Stop everything and remove every namespace, mount, cgroup and file the cluster made.
    Down,
    /// Show the nodes and how to reach the cluster.
    Status,
    /// kubectl with the cluster's kubeconfig.
    #[command(trailing_var_arg = true)]
    Kubectl {
        #[arg(allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// helm with the cluster's kubeconfig.
    #[command(trailing_var_arg = true)]
    Helm {
        #[arg(allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Add a node (namespaces, containerd, kubelet, kube-proxy); Weft's DaemonSet follows.
    AddNode,
    /// Remove a node: every process and mount of it, its namespaces, its Node object.
    DelNode { name: String },
    /// Run a command inside a node (its network and mount namespaces), e.g. `ip route`.
    #[command(trailing_var_arg = true)]
    NodeExec {
        node: String,
        #[arg(allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Stop a node daemon (containerd, kubelet, kube-proxy).
    StopDaemon {
        node: String,
        daemon: String,
        /// SIGKILL at once instead of SIGTERM first.
        #[arg(long)]
        kill: bool,
    },
    /// Start a stopped node daemon again with its first flags.
    StartDaemon { node: String, daemon: String },
    /// Internal: the process that owns the cluster (started by `up`).
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        nodes: usize,
        #[arg(long)]
        backend: String,
        #[arg(long = "set")]
        sets: Vec<String>,
        #[arg(long = "image")]
        images: Vec<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Up { nodes, backend, sets } => {
            anyhow::ensure!(
                (1..=supervise::MAX_NODES).contains(&nodes),
                "--nodes must be 1..={}",
                supervise::MAX_NODES
            );
            backend.parse::<weft_api::Backend>().map_err(|e| anyhow::anyhow!("--backend: {e}"))?;
            let images = cluster::images::tarballs(cluster::images::CLUSTER)?;
            let state = supervise::up(&supervise::UpOptions { nodes, backend, helm_sets: sets, images })?;
            print_usage(&state);
        }
        Cmd::Down => supervise::down()?,
        Cmd::Status => {
            let state = State::load()?;
            print_usage(&state);
        }
        Cmd::Kubectl { args } => exec_with_kubeconfig("kubectl", &args)?,
        Cmd::Helm { args } => exec_with_kubeconfig("helm", &args)?,
        Cmd::AddNode => {
            let info = runtime()?.block_on(supervise::add_to_running())?;
            println!("{} ({}) is Ready", info.name, info.ip);
        }
        Cmd::DelNode { name } => runtime()?.block_on(supervise::remove_node(&name))?,
        Cmd::NodeExec { node: name, command } => {
            let state = State::load()?;
            let info = state.node(&name)?;
            let status = node::command(info, std::path::Path::new(&command[0]))
                .args(&command[1..])
                .status()
                .context("cannot run the command in the node")?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Cmd::StopDaemon { node: name, daemon, kill } => {
            let state = State::load()?;
            let info = state.node(&name)?;
            check_daemon(&daemon)?;
            let grace = if kill { std::time::Duration::ZERO } else { std::time::Duration::from_secs(10) };
            node::stop_daemon(info, &daemon, grace);
        }
        Cmd::StartDaemon { node: name, daemon } => {
            let state = State::load()?;
            check_daemon(&daemon)?;
            node::restart_daemon(state.node(&name)?, &daemon)?;
        }
        Cmd::Supervise { nodes, backend, sets, images } => runtime()?
            .block_on(supervise::supervise(supervise::UpOptions { nodes, backend, helm_sets: sets, images }))?,
    }
    Ok(())
}

fn check_daemon(daemon: &str) -> anyhow::Result<()> {
    anyhow::ensure!(node::DAEMONS.contains(&daemon), "no daemon {daemon:?}: one of {}", node::DAEMONS.join(", "));
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("tokio runtime")
}

fn exec_with_kubeconfig(tool: &str, args: &[String]) -> anyhow::Result<()> {
    let state = State::load()?;
    let status = Command::new(control_plane::tools_dir().join(tool))
        .env("KUBECONFIG", &state.kubeconfig)
        .args(args)
        .status()
        .with_context(|| format!("cannot run {tool}"))?;
    std::process::exit(status.code().unwrap_or(1));
}

fn print_usage(state: &State) {
    println!("Weft cluster up: {} nodes, backend {}", state.nodes.len(), state.backend);
    let families = weft_e2e::cluster::families::Families::of(&state.helm_values);
    for n in &state.nodes {
        let ips: Vec<String> = families.node_ips(n).iter().map(ToString::to_string).collect();
        println!("  {}  {}  (network namespace {})", n.name, ips.join(", "), n.netns);
    }
    let tools = control_plane::tools_dir();
    println!();
    println!("  export KUBECONFIG={}", state.kubeconfig.display());
    println!("  export PATH={}:$PATH", tools.display());
    println!("  kubectl get nodes -o wide; kubectl get subnets -o wide");
    println!(
        "  kubectl run web --image={} --image-pull-policy=Never -- netexec --http-port=8080",
        cluster::workloads::AGNHOST_IMAGE
    );
    println!("  e2e/cluster.sh node-exec node-1 ip route     # inside a node");
    println!("  e2e/cluster.sh down");
}
