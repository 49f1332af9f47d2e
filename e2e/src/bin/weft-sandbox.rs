//! weft-sandbox: a local Weft cluster of network namespaces with a real
//! control plane. `e2e/sandbox.sh` builds everything and calls this.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use weft_e2e::control_plane::Component;
use weft_e2e::sandbox::pods::{self, HostPortSpec, PodRecord, PortSpec};
use weft_e2e::sandbox::{State, cluster, probe};
use weft_e2e::supervisor::StateFile;

#[derive(Parser)]
#[command(name = "weft-sandbox", about = "A local Weft cluster made of network namespaces")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the control plane, the operator and N nodes with their agents.
    Up {
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// vxlan or host-gw.
        #[arg(long, default_value = "vxlan")]
        backend: String,
        /// IPv6-only: the nodes' IPs (their IPv6 addresses), the cluster
        /// CIDR (fd00:10:244::/56) and so the pods are IPv6.
        #[arg(long)]
        ipv6_only: bool,
        /// An extra flag for every agent, e.g. --agent-arg=--host-port-range=20000-20009 (repeatable).
        #[arg(long = "agent-arg", allow_hyphen_values = true)]
        agent_args: Vec<String>,
        /// An extra flag for the operator, e.g.
        /// --operator-arg=--secondary-cluster-cidr=fd00:10:244::/56 for a dual-stack sandbox (repeatable).
        #[arg(long = "operator-arg", allow_hyphen_values = true)]
        operator_args: Vec<String>,
    },
    /// Stop everything and remove every namespace the sandbox created.
    Down,
    /// Show nodes.
    Status,
    /// Add a node (namespace, Node object, agent) to the running sandbox.
    AddNode,
    /// Remove a node: agent, Node object, namespace.
    DelNode { name: String },
    /// Restart the operator replica that holds the leader Lease (the other
    /// one takes over); prints its name.
    RestartLeader {
        /// SIGKILL instead of a clean shutdown.
        #[arg(long)]
        kill: bool,
    },
    /// Restart a node's agent.
    RestartAgent {
        node: String,
        /// SIGKILL instead of a clean shutdown.
        #[arg(long)]
        kill: bool,
    },
    /// Create a pod: a namespace set up through weft-cni, a Pod object, a responder.
    AddPod {
        name: String,
        #[arg(long, short = 'n', default_value = "default")]
        namespace: String,
        #[arg(long)]
        node: Option<String>,
        /// Labels as key=value (repeatable).
        #[arg(long = "label", short = 'l')]
        labels: Vec<String>,
        /// Ports to serve, e.g. 80/tcp, 53/udp, http=8080/tcp (repeatable).
        #[arg(long = "port", short = 'p', default_value = "80/tcp")]
        ports: Vec<PortSpec>,
        /// Annotations as key=value (repeatable), e.g. weft.dev/host-ports=http,53/udp.
        #[arg(long = "annotation", short = 'a')]
        annotations: Vec<String>,
        /// A pod spec hostPort, HOSTPORT:CONTAINERPORT[/protocol] (repeatable).
        #[arg(long = "host-port")]
        host_ports: Vec<HostPortSpec>,
        /// Run the workload in a VM guest wired to the pod's eth0 by TC
        /// redirects, as Kata's tcfilter mode does.
        #[arg(long)]
        vm: bool,
    },
    /// Delete a pod (CNI DEL, namespace, Pod object).
    DelPod {
        name: String,
        #[arg(long, short = 'n', default_value = "default")]
        namespace: String,
        /// Leave the Pod object alone (CNI DEL and namespace only), e.g. while the API is paused.
        #[arg(long)]
        keep_object: bool,
    },
    /// Connect to IP:PORT from inside a pod (namespace/name) or a node (node-N)
    /// and print what the responder answered; fails when nothing answers.
    Connect {
        /// A pod as namespace/name, or a node name.
        #[arg(long)]
        from: String,
        #[arg(long, default_value = "tcp")]
        protocol: String,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// IP:PORT ([IPv6]:PORT)
        target: std::net::SocketAddr,
    },
    /// Freeze the kube-apiserver (SIGSTOP): the API stops answering, as in an outage.
    ApiPause,
    /// Kill etcd (SIGKILL) and start it again on the same data; returns once
    /// the apiserver is ready again.
    EtcdRestart,
    /// Kill the kube-apiserver (SIGKILL) and start it again; returns once it
    /// is ready.
    ApiserverRestart,
    /// Let a paused kube-apiserver go on (SIGCONT).
    ApiResume,
    /// List pods with their node and IP.
    Pods,
    /// Run a command inside a pod's network namespace (a VM pod's guest).
    Exec {
        pod: String,
        #[arg(long, short = 'n', default_value = "default")]
        namespace: String,
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
    /// Try every ordered pair of pods on a port and print the allow/deny matrix as JSON.
    Probe {
        #[arg(long, default_value_t = 80)]
        port: u16,
        #[arg(long, default_value = "tcp")]
        protocol: String,
        /// Pods as namespace/name (default: all).
        #[arg(long = "pod")]
        pods: Vec<String>,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// Which address of each pod to connect to.
        #[arg(long, value_enum, default_value = "ipv4")]
        family: probe::Family,
    },
    /// kubectl against the sandbox's apiserver.
    Kubectl {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// (internal) The supervisor that owns the running sandbox.
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        nodes: usize,
        #[arg(long)]
        backend: String,
    },
    /// (internal) Serve ports inside a pod.
    #[command(hide = true)]
    Respond {
        #[arg(long)]
        name: String,
        #[arg(long = "port")]
        ports: Vec<PortSpec>,
        /// Created once every port is served.
        #[arg(long)]
        ready_file: Option<std::path::PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Cmd::Up { nodes, backend, ipv6_only, agent_args, operator_args } => {
            backend.parse::<weft_api::Backend>().map_err(|e| anyhow::anyhow!("--backend: {e}"))?;
            let state = cluster::up(nodes, &backend, ipv6_only, &agent_args, &operator_args)?;
            print_status(&state);
            println!("\nkubeconfig: {}", state.kubeconfig.display());
            println!("try: e2e/sandbox.sh kubectl get subnets; e2e/sandbox.sh add-pod web -l app=web");
        }
        Cmd::Down => cluster::down()?,
        Cmd::Status => print_status(&State::load()?),
        Cmd::AddNode => {
            let n = rt.block_on(weft_e2e::sandbox::nodes::add_to_running())?;
            println!("{} {} {}", n.name, n.ip, n.netns);
        }
        Cmd::DelNode { name } => rt.block_on(weft_e2e::sandbox::nodes::remove(&name))?,
        Cmd::RestartLeader { kill } => {
            let replica = rt.block_on(weft_e2e::sandbox::operators::restart_leader(&State::load()?, kill))?;
            println!("{}", replica.as_deref().unwrap_or("none"));
        }
        Cmd::RestartAgent { node, kill } => {
            let pid = weft_e2e::sandbox::nodes::restart_agent(&State::load()?, &node, kill)?;
            println!("{pid}");
        }
        Cmd::AddPod { name, namespace, node, labels, ports, annotations, host_ports, vm } => {
            let labels = key_values(&labels, "labels")?;
            let options = pods::PodOptions { annotations: key_values(&annotations, "annotations")?, host_ports, vm };
            let rec = rt.block_on(pods::add(&name, &namespace, node.as_deref(), &labels, &ports, &options))?;
            println!("{}", serde_json::to_string(&rec)?);
        }
        Cmd::DelPod { name, namespace, keep_object } => rt.block_on(pods::delete(&name, &namespace, keep_object))?,
        Cmd::Connect { from, protocol, timeout_ms, target } => {
            let state = State::load()?;
            let netns = match state.nodes.iter().find(|n| n.name == from) {
                Some(n) => n.netns.clone(),
                None => {
                    let (ns, name) =
                        from.split_once('/').context("--from is a node name or a pod as namespace/name")?;
                    PodRecord::load(ns, name)?.workload_netns().to_owned()
                }
            };
            let timeout = Duration::from_millis(timeout_ms);
            match probe::reach_from(&netns, &target.ip().to_string(), target.port(), &protocol, timeout)? {
                Some(answer) => println!("{answer}"),
                None => anyhow::bail!("no answer from {target}/{protocol} within {timeout_ms} ms"),
            }
        }
        Cmd::ApiPause => signal_apiserver(libc::SIGSTOP)?,
        Cmd::EtcdRestart => restart(&State::load()?, Component::Etcd)?,
        Cmd::ApiserverRestart => restart(&State::load()?, Component::Apiserver)?,
        Cmd::ApiResume => signal_apiserver(libc::SIGCONT)?,
        Cmd::Pods => {
            println!("{:<32} {:<10} {:<16} IPV6", "POD", "NODE", "IP");
            for p in PodRecord::all() {
                println!("{:<32} {:<10} {:<16} {}", p.key(), p.node, p.ip, p.ip6.as_deref().unwrap_or("-"));
            }
        }
        Cmd::Exec { pod, namespace, command } => {
            let rec = PodRecord::load(&namespace, &pod)?;
            let status = std::process::Command::new("ip")
                .args(["netns", "exec", rec.workload_netns()])
                .args(&command)
                .status()
                .context("cannot run the command")?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Cmd::Probe { port, protocol, pods, timeout_ms, family } => {
            let all = PodRecord::all();
            let selected: Vec<PodRecord> =
                if pods.is_empty() { all } else { all.into_iter().filter(|p| pods.contains(&p.key())).collect() };
            let m = probe::probe(&selected, port, &protocol, family, Duration::from_millis(timeout_ms))?;
            println!("{}", serde_json::to_string_pretty(&m)?);
        }
        Cmd::Kubectl { args } => {
            let state = State::load()?;
            let kubectl = weft_e2e::control_plane::tools_dir().join("kubectl");
            let status = std::process::Command::new(kubectl)
                .arg("--kubeconfig")
                .arg(&state.kubeconfig)
                .args(&args)
                .status()
                .context("cannot run kubectl (build it with e2e/scripts/build-tools.sh)")?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Cmd::Supervise { nodes, backend } => rt.block_on(cluster::supervise(nodes, &backend))?,
        Cmd::Respond { name, ports, ready_file } => probe::respond(&name, &ports, ready_file.as_deref())?,
    }
    Ok(())
}

fn key_values(items: &[String], what: &str) -> anyhow::Result<BTreeMap<String, String>> {
    items
        .iter()
        .map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("{what} are key=value"))
        })
        .collect()
}

fn signal_apiserver(signal: i32) -> anyhow::Result<()> {
    let pid = weft_e2e::sandbox::apiserver_pid()?;
    // SAFETY: plain kill(2) of the sandbox's own apiserver.
    if unsafe { libc::kill(pid, signal) } != 0 {
        anyhow::bail!("cannot signal the apiserver (pid {pid}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Asks the supervisor (which owns the control plane) to restart `which`
/// and waits for its answer.
fn restart(state: &State, which: Component) -> anyhow::Result<()> {
    let result = cluster::restart_result(which);
    let _ = std::fs::remove_file(&result);
    let signal = match which {
        Component::Etcd => libc::SIGUSR1,
        Component::Apiserver => libc::SIGUSR2,
    };
    // SAFETY: plain kill(2) of the sandbox's supervisor.
    if unsafe { libc::kill(state.supervisor_pid as i32, signal) } != 0 {
        anyhow::bail!("cannot signal the supervisor: {}", std::io::Error::last_os_error());
    }
    let what = format!("the supervisor to restart {}", which.name());
    let note = weft_e2e::wait::until(&what, std::time::Duration::from_secs(90), || {
        std::fs::read_to_string(&result).ok().filter(|s| !s.is_empty())
    });
    anyhow::ensure!(note == format!("{} restarted", which.name()), "{note}");
    Ok(())
}

fn print_status(state: &State) {
    println!("Weft sandbox ({} backend), supervisor pid {}", state.backend, state.supervisor_pid);
    println!("{:<10} {:<14} {:<22}", "NODE", "IP", "NETNS");
    for n in &state.nodes {
        println!("{:<10} {:<14} {:<22}", n.name, n.ip, n.netns);
    }
}
