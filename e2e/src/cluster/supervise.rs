//! Bringing the real-node cluster up and down. `up` starts a supervisor
//! process that owns the control plane and removes everything when it gets
//! SIGTERM from `down`; node daemons run detached in their nodes' cgroups so
//! that tests can stop, kill and restart them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams};
use weft_api::subnet::Subnet;

use super::families::Families;
use super::{
    CLUSTER_CIDR, CP_IP, CP_NS, FORWARD_PORT, IMAGE_TAG, NodeInfo, SERVICE_CIDR, State, UNDERLAY_NS, node, state_dir,
};
use crate::control_plane::pki::ClientIdentity;
use crate::control_plane::{self, ControlPlane, Options, kube_util, process};
use crate::sandbox::ip;
use crate::supervisor::StateFile;

/// Nodes that can exist at once (client certificates are issued up front).
pub const MAX_NODES: usize = 9;

/// The cluster's supervisor and starting locks (one cluster per machine).
pub fn locks() -> crate::supervisor::MachineLocks {
    State::locks()
}

/// How `up` is asked to build the cluster.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub nodes: usize,
    pub backend: String,
    /// Extra `--set key=value` for `helm install`.
    pub helm_sets: Vec<String>,
    /// docker-archive tarballs to import into every node.
    pub images: Vec<PathBuf>,
}

/// Starts the supervisor in the background and waits until the cluster is
/// ready: every node Ready, Weft's pods running, every Subnet Ready.
pub fn up(opts: &UpOptions) -> anyhow::Result<State> {
    let mut args = vec!["--nodes".to_owned(), opts.nodes.to_string(), "--backend".to_owned(), opts.backend.clone()];
    args.extend(opts.helm_sets.iter().map(|s| format!("--set={s}")));
    for i in &opts.images {
        args.extend(["--image".to_owned(), i.display().to_string()]);
    }
    crate::supervisor::up::<State>(&args, || Ok(()))
}

/// Stops the supervisor (which tears everything down) and removes leftovers.
pub fn down() -> anyhow::Result<()> {
    crate::supervisor::down::<State>()
}

/// Removes every node (processes, mounts, cgroups), every cluster namespace
/// and the state directory. Finds nodes by their directories, so it also
/// cleans up after a supervisor that died.
pub fn cleanup_leftovers() {
    let nodes_dir = state_dir().join("nodes");
    if let Ok(entries) = std::fs::read_dir(&nodes_dir) {
        let nodes: Vec<NodeInfo> = entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("node-").and_then(|i| i.parse().ok()))
            .map(NodeInfo::new)
            .collect();
        destroy_nodes(&nodes);
    }
    crate::supervisor::remove_namespaces(super::NS_PREFIX);
    let ns_dir = state_dir().join("ns");
    if ns_dir.exists() {
        let _ = Command::new("umount").arg(&ns_dir).stderr(std::process::Stdio::null()).status();
    }
    let _ = Command::new("rm").args(["-rf", "--one-file-system"]).arg(state_dir()).status();
}

/// Removes nodes side by side (each waits for its daemons and deletes its
/// files, independently of the others).
fn destroy_nodes(nodes: &[NodeInfo]) {
    std::thread::scope(|s| {
        for n in nodes {
            s.spawn(move || node::destroy(n));
        }
    });
}

/// The supervisor: builds everything, writes the state, waits for SIGTERM.
pub async fn supervise(opts: UpOptions) -> anyhow::Result<()> {
    let Some(_lock) = locks().take_supervisor()? else {
        bail!("a cluster is already up or starting on this machine");
    };
    let started = Instant::now();
    let pod_ranges = Families::of(&opts.helm_sets).cluster_cidrs()?;
    let (cp, children) = match build(&opts).await {
        Ok(parts) => parts,
        Err(e) => {
            eprintln!("cluster start failed: {e:#}");
            destroy_nodes(&(1..=MAX_NODES).map(NodeInfo::new).collect::<Vec<_>>());
            crate::supervisor::remove_namespaces(super::NS_PREFIX);
            return Err(e);
        }
    };
    eprintln!("cluster ready after {:.1} s", started.elapsed().as_secs_f64());
    let routes = tokio::spawn(super::cp_routes::keep(cp.client().await?, pod_ranges));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    eprintln!("tearing the cluster down");
    routes.abort();
    if let Ok(state) = State::load() {
        destroy_nodes(&state.nodes);
    }
    for mut c in children {
        process::stop(&mut c, Duration::from_secs(5));
    }
    cp.shutdown();
    cleanup_leftovers();
    Ok(())
}

type Parts = (ControlPlane, Vec<std::process::Child>);

fn client_identities() -> Vec<ClientIdentity> {
    let mut ids: Vec<ClientIdentity> = (1..=MAX_NODES)
        .map(|i| ClientIdentity {
            stem: format!("kubelet-{}", super::node_name(i)),
            user: format!("system:node:{}", super::node_name(i)),
            group: Some("system:nodes".into()),
        })
        .collect();
    ids.push(ClientIdentity { stem: "kube-proxy".into(), user: "system:kube-proxy".into(), group: None });
    ids.push(ClientIdentity {
        stem: "apiserver-kubelet-client".into(),
        user: "kube-apiserver-kubelet-client".into(),
        group: Some("system:masters".into()),
    });
    ids
}

async fn build(opts: &UpOptions) -> anyhow::Result<Parts> {
    let started = Instant::now();
    let families = Families::of(&opts.helm_sets);
    // IPv6-only: the `kubernetes` Service is IPv6, so the apiserver listens
    // on and advertises its IPv6 address, which its certificate names.
    let cp6 = crate::sandbox::node_ipv6(CP_IP).to_string();
    let (service_args, extra_sans) = match &families {
        Families::Ipv4 => (vec![], vec![]),
        Families::DualStack(_) => (vec![format!("--service-cluster-ip-range={SERVICE_CIDR},{SERVICE_CIDR6}")], vec![]),
        Families::Ipv6Only(_) => (
            vec![
                format!("--service-cluster-ip-range={SERVICE_CIDR6}"),
                format!("--advertise-address={cp6}"),
                "--bind-address=::".to_owned(),
            ],
            vec![cp6.clone(), SERVICE_IP6.to_owned()],
        ),
    };
    let dir = state_dir();
    std::fs::create_dir_all(&dir)?;
    ip(&["netns", "add", UNDERLAY_NS])?;
    ip(&["-n", UNDERLAY_NS, "link", "add", "br0", "type", "bridge"])?;
    ip(&["-n", UNDERLAY_NS, "link", "set", "br0", "up"])?;
    crate::sandbox::nodes::attach_to_bridge(UNDERLAY_NS, CP_NS, "cp", CP_IP)?;
    crate::sandbox::forward::serve(
        SocketAddr::from(([127, 0, 0, 1], FORWARD_PORT)),
        CP_NS,
        SocketAddr::from((CP_IP, 6443)),
    )?;

    let cp_dir = dir.join("control-plane");
    let cp = tokio::task::spawn_blocking(move || {
        ControlPlane::start_with(&Options {
            netns: Some(CP_NS.to_owned()),
            address: Some(CP_IP),
            client_server: Some(format!("https://127.0.0.1:{FORWARD_PORT}")),
            dir: Some(cp_dir),
            clients: client_identities(),
            kubelet_client: Some("apiserver-kubelet-client".into()),
            // Kubelets act as their node only; exec and logs reach them by IP.
            node_authorization: true,
            extra_apiserver_args: std::iter::once("--kubelet-preferred-address-types=InternalIP,Hostname".to_owned())
                .chain(service_args)
                .collect(),
            extra_sans,
        })
    })
    .await??;
    cp.write_apiserver_pid(&dir.join("apiserver.pid"))?;
    let mut children = Vec::new();
    let in_cluster = cp.in_namespace_kubeconfig();
    let kc = in_cluster.display().to_string();
    let tools = control_plane::tools_dir();
    let mut kcm = process::in_netns(CP_NS, tools.join("kube-controller-manager"));
    kcm.args([
        format!("--kubeconfig={kc}"),
        format!("--authentication-kubeconfig={kc}"),
        format!("--authorization-kubeconfig={kc}"),
        format!("--service-account-private-key-file={}", cp.pki.service_account_key.display()),
        format!("--root-ca-file={}", cp.pki.ca_cert.display()),
        "--use-service-account-credentials=true".into(),
        "--leader-elect=false".into(),
        "--bind-address=127.0.0.1".into(),
        // Weft leases pod CIDRs itself (Subnets).
        "--allocate-node-cidrs=false".into(),
        // Notice a silent node sooner than the default 50 s.
        "--node-monitor-grace-period=20s".into(),
        "--v=1".into(),
    ]);
    children.push(process::spawn_tied(kcm, &dir.join("kube-controller-manager.log"))?);
    let mut scheduler = process::in_netns(CP_NS, tools.join("kube-scheduler"));
    scheduler.args([
        format!("--kubeconfig={kc}"),
        format!("--authentication-kubeconfig={kc}"),
        format!("--authorization-kubeconfig={kc}"),
        "--leader-elect=false".into(),
        "--bind-address=127.0.0.1".into(),
        "--v=1".into(),
    ]);
    children.push(process::spawn_tied(scheduler, &dir.join("kube-scheduler.log"))?);

    let creds = node::Credentials {
        server: cp.in_namespace_server().to_owned(),
        ca: cp.pki.ca_cert.clone(),
        certs_dir: cp.pki.ca_cert.parent().context("the CA certificate has no directory")?.to_path_buf(),
    };
    let nodes = {
        let (creds, images, families, count) = (creds.clone(), opts.images.clone(), families.clone(), opts.nodes);
        tokio::task::spawn_blocking(move || add_nodes(1..=count, &creds, &images, &families)).await??
    };
    let client = cp.client().await?;
    wait_registered(&client, &nodes).await?;
    control_plane::wait_for(Duration::from_secs(60), "every kubelet to report a Ready condition", || async {
        Ok(ready_conditions(&client).await?.len() == nodes.len())
    })
    .await?;
    let before_weft = ready_conditions(&client).await?;
    eprintln!("before helm install: {before_weft:?}");

    let values = helm_values(&opts.backend, &opts.helm_sets);
    let mut args: Vec<String> = ["install", "weft"].map(String::from).into();
    args.push(chart_dir().display().to_string());
    args.extend(["-n", "kube-system", "--wait", "--timeout", "5m"].map(String::from));
    for v in &values {
        args.push("--set".into());
        args.push(v.clone());
    }
    let kubeconfig = cp.kubeconfig.clone();
    let helm_started = Instant::now();
    eprintln!("timing: nodes registered {:.1} s after start", started.elapsed().as_secs_f64());
    tokio::task::spawn_blocking(move || helm(&kubeconfig, &args)).await??;
    eprintln!("timing: helm install --wait (Weft's pods ready) took {:.1} s", helm_started.elapsed().as_secs_f64());
    wait_ready(&client, &nodes, Duration::from_secs(300)).await?;
    eprintln!(
        "timing: every node Ready {:.1} s after helm install began, {:.1} s after start",
        helm_started.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let kubeconfig = cp.kubeconfig.clone();
    let dns_ip = families.dns_ip();
    tokio::task::spawn_blocking(move || super::dns::deploy(&kubeconfig, dns_ip)).await??;
    eprintln!("timing: cluster DNS ready {:.1} s after start", started.elapsed().as_secs_f64());

    let state = State {
        supervisor_pid: std::process::id(),
        kubeconfig: cp.kubeconfig.clone(),
        backend: opts.backend.clone(),
        nodes,
        helm_values: values,
        credentials: creds,
        images: opts.images.clone(),
        ready_before_weft: before_weft,
    };
    state.save()?;
    Ok((cp, children))
}

/// Makes nodes: their namespaces and containerd one after the other (when
/// whole nodes started side by side, a loaded CI run once found a node's
/// containerd refusing its first connection), the images into all of them
/// side by side (most of a node's start), then their kubelets.
fn add_nodes(
    indexes: std::ops::RangeInclusive<usize>,
    creds: &node::Credentials,
    images: &[PathBuf],
    families: &Families,
) -> anyhow::Result<Vec<NodeInfo>> {
    let nodes = indexes.map(node_with_runtime).collect::<anyhow::Result<Vec<_>>>()?;
    node::import_images_everywhere(&nodes, images)?;
    for info in &nodes {
        node::start_kubelet_and_proxy(info, creds, families)?;
    }
    Ok(nodes)
}

/// Makes node `index` and starts its daemons for a cluster of `families`.
pub fn add_node(
    index: usize,
    creds: &node::Credentials,
    images: &[PathBuf],
    families: &Families,
) -> anyhow::Result<NodeInfo> {
    add_nodes(index..=index, creds, images, families)?.pop().context("no node was made")
}

/// Node `index`'s namespaces, mounts and cgroups, and its containerd.
fn node_with_runtime(index: usize) -> anyhow::Result<NodeInfo> {
    anyhow::ensure!((1..=MAX_NODES).contains(&index), "node index {index} is outside 1..={MAX_NODES}");
    let info = NodeInfo::new(index);
    node::create(&info).with_context(|| format!("creating {}", info.name))?;
    node::start_containerd(&info)?;
    Ok(info)
}

/// Each node's Ready condition: status and message.
pub async fn ready_conditions(client: &kube::Client) -> anyhow::Result<Vec<(String, String, String)>> {
    let list = Api::<Node>::all(client.clone()).list(&Default::default()).await?;
    Ok(list
        .items
        .iter()
        .filter_map(|n| {
            let c = n.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready")?;
            Some((n.metadata.name.clone()?, c.status.clone(), c.message.clone().unwrap_or_default()))
        })
        .collect())
}

/// Waits until kubelet has registered each node's Node object.
pub async fn wait_registered(client: &kube::Client, nodes: &[NodeInfo]) -> anyhow::Result<()> {
    let api = Api::<Node>::all(client.clone());
    control_plane::wait_for(Duration::from_secs(120), "every kubelet to register its Node", || async {
        let list = api.list(&Default::default()).await?;
        Ok(nodes.iter().all(|n| list.items.iter().any(|o| o.metadata.name.as_deref() == Some(n.name.as_str()))))
    })
    .await
}

/// charts/weft of this repository (`$WEFT_CHART_DIR` overrides).
pub fn chart_dir() -> PathBuf {
    std::env::var_os("WEFT_CHART_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/weft"))
}

/// Waits until every node is Ready and every node's Subnet Ready with its
/// peers programmed.
pub async fn wait_ready(client: &kube::Client, nodes: &[NodeInfo], timeout: Duration) -> anyhow::Result<()> {
    let node_api = Api::<Node>::all(client.clone());
    let subnets = Api::<Subnet>::all(client.clone());
    control_plane::wait_for(timeout, "every node Ready and its Subnet Ready with peers programmed", || async {
        let listed = node_api.list(&Default::default()).await?;
        let ready = |name: &str| {
            listed.items.iter().any(|n| {
                n.metadata.name.as_deref() == Some(name)
                    && n.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
        };
        let list = subnets.list(&Default::default()).await?;
        Ok(nodes.iter().all(|n| ready(&n.name) && kube_util::subnet_ready(&list.items, &n.name)))
    })
    .await
}

/// Adds the next free node to the running cluster and waits until it is
/// Ready with its Subnet.
pub async fn add_to_running() -> anyhow::Result<NodeInfo> {
    let mut state = State::load()?;
    let index = (1..=MAX_NODES)
        .find(|i| !state.nodes.iter().any(|n| n.index == *i))
        .with_context(|| format!("the cluster already has {MAX_NODES} nodes"))?;
    let (creds, images) = (state.credentials.clone(), state.images.clone());
    let families = Families::of(&state.helm_values);
    let info = tokio::task::spawn_blocking(move || add_node(index, &creds, &images, &families)).await??;
    state.nodes.push(info.clone());
    state.save()?;
    let client = control_plane::kube_util::client_from(&state.kubeconfig).await?;
    wait_registered(&client, std::slice::from_ref(&info)).await?;
    wait_ready(&client, &state.nodes, Duration::from_secs(300)).await?;
    Ok(info)
}

/// Removes a node from the running cluster: its daemons and pods, its
/// namespaces and its Node object (the operator then releases its Subnet).
pub async fn remove_node(name: &str) -> anyhow::Result<()> {
    let mut state = State::load()?;
    let info = state.node(name)?.clone();
    node::destroy(&info);
    let client = control_plane::kube_util::client_from(&state.kubeconfig).await?;
    match Api::<Node>::all(client).delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e).context("deleting the Node object"),
    }
    state.nodes.retain(|n| n.name != name);
    state.save()
}

/// Runs helm with the cluster's kubeconfig.
pub fn helm(kubeconfig: &Path, args: &[String]) -> anyhow::Result<String> {
    let out = Command::new(control_plane::tools_dir().join("helm"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .context("cannot run helm")?;
    if !out.status.success() {
        bail!(
            "helm {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The IPv6 Service range of a dual-stack or IPv6-only cluster.
pub const SERVICE_CIDR6: &str = "fd00:96::/112";
/// Its first address: the `kubernetes` Service of an IPv6-only cluster.
pub const SERVICE_IP6: &str = "fd00:96::1";

/// The chart's values for this cluster: the images built here, never pulled.
pub fn helm_values(backend: &str, extra: &[String]) -> Vec<String> {
    let mut v: Vec<String> = [
        "images.agent.repository=ghcr.io/weft/weft-agent".into(),
        format!("images.agent.tag={IMAGE_TAG}"),
        "images.operator.repository=ghcr.io/weft/weft-operator".into(),
        format!("images.operator.tag={IMAGE_TAG}"),
        "images.pullPolicy=Never".into(),
        format!("network.clusterCIDR={CLUSTER_CIDR}"),
        format!("network.backend={backend}"),
        // Half the default: a node that registers again does so within
        // seconds here, and tests replacing a node wait for the release.
        "operator.releaseGraceSeconds=30".into(),
    ]
    .into();
    v.extend(extra.iter().cloned());
    v
}
