//! weft-agent: the node agent. Serves weft-cni on a Unix socket, owns the
//! node's pod addresses and programs the node's dataplane.

use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use clap::Parser;
use kube::Api;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use weft_api::subnet::Subnet;
use weft_proto::cni::v1::cni_server::CniServer;

use config::Config;
use ipam::{Ipam, Ipv6Block, Pool};
use weft_agent::attach::Attacher;
use weft_agent::{
    attach, cni_server, config, dataplane, firewall, flows, guard, hostport, http, ipam, lease, masquerade, metrics,
    node_settings, overlay, peer_sync, policy, tunnel,
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    weft_telemetry::logging::init("WEFT_LOG");
    let config = Config::parse();
    if let Err(e) = run(config).await {
        tracing::error!("{e:#}");
        return Err(e);
    }
    Ok(())
}

async fn run(config: Config) -> anyhow::Result<()> {
    let slot: http::AgentSlot = Arc::new(OnceLock::new());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let shutdown = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let http_stop = stop_rx.clone();
    let http =
        tokio::spawn(http::serve(config.metrics_addr.clone(), Arc::clone(&slot), move || shutdown(http_stop.clone())));
    let signal = wait_for_signal();
    tokio::pin!(signal);

    // Without a fixed pod CIDR the node's Subnet lease decides it; no CNI
    // socket exists until then, so weft-cni answers STATUS 50 / ADD 11.
    // With a fixed pod CIDR the API is optional (host port annotations and
    // Events need it); with a lease it is required.
    let client = match (config.pod_cidr, &config.kubeconfig) {
        (Some(_), None) => None,
        _ => Some(kube_client(&config).await?),
    };
    let subnets = match (config.pod_cidr, &client) {
        (None, Some(c)) => Some(Api::<Subnet>::all(c.clone())),
        _ => None,
    };
    // The peers' listings start first: they need neither the lease nor the
    // overlay device, and at 1,000 nodes take longer than both.
    let peer_watches = subnets
        .as_ref()
        .map(|api| peer_sync::PeerWatches::start(api, Api::all(api.clone().into_client()), &config.node_name));
    let lease = match (&subnets, config.pod_cidr) {
        (_, Some(cidr)) => {
            lease::Lease { cidr, cidr6: config.pod_ipv6_cidr, backend: weft_api::subnet::Backend::default() }
        }
        (Some(api), None) => tokio::select! {
            lease = lease::wait_for(api, &config.node_name) => lease?,
            r = &mut signal => { let _ = stop_tx.send(true); return r; }
        },
        (None, None) => unreachable_config()?,
    };
    let pool = Pool::new(lease.cidr).with_context(|| format!("unusable pod CIDR {}", lease.cidr))?;
    let host = dataplane::netns::Netns::current().context("cannot open netlink")?;

    // With a lease this node is part of a cluster: set up the overlay first,
    // since it decides the pod MTU and what we announce in our Subnet.
    let metrics = Arc::new(metrics::Metrics::default());
    let overlay = match (&subnets, peer_watches) {
        (Some(api), Some(watches)) => Some(setup_overlay(&config, &lease, host.clone(), api, watches, &metrics).await?),
        _ => None,
    };
    let pod_mtu = config.mtu.or(overlay.as_ref().map(|o| o.pod_mtu)).unwrap_or(1500);

    let ipam_dir = config.state_dir.join("ipam");
    let ipam = tokio::task::block_in_place(|| Ipam::open(pool, &ipam_dir)).context("cannot load IPAM state")?;
    let ipv6 = match lease.cidr6 {
        Some(cidr6) => Some(Ipv6Block::new(cidr6, pool).with_context(|| format!("unusable IPv6 block {cidr6}"))?),
        None => None,
    };
    let hostports = host_ports(&config, &pool, ipv6.as_ref(), &ipam);
    let kube = client
        .clone()
        .map(|c| attach::KubeAccess { pods: hostport::pods::PodCache::start(c.clone(), &config.node_name), client: c });
    let mut attacher = Attacher::new(config.clone(), ipam, hostports, kube, host, pod_mtu, Arc::clone(&metrics));
    attacher.ipv6 = ipv6;
    attacher.health = dataplane::netns::Netns::current().context("cannot open netlink for health checks")?;
    // Policy needs the API: with a lease, or a fixed pod CIDR plus --kubeconfig.
    let policy_pods = (client.is_some() && config.network_policy)
        .then(|| Arc::new(policy::attached::Attached::new(Arc::new(tokio::sync::Notify::new()))));
    attacher.policy_pods = policy_pods.clone();
    let attacher = Arc::new(attacher);

    // The bridge first: it holds the gateway address, which ADD needs and
    // which the routes to routed pods come from.
    attacher.ensure_bridge(true).await.context("cannot set up the node bridge")?;
    attacher.reconcile_on_start().await.context("start-up reconciliation failed")?;
    // Before the CNI socket opens: no pod may send unchecked.
    attacher.guard_pods(guard::Write::Full).await.context("cannot set up the pods' source guard")?;
    metrics.set_host_port_usage(attacher.hostports.usage());
    start_attachment_loops(&config, client.as_ref(), &attacher, &metrics);
    // Bridged pods need bridge netfilter (policy between local pods), routed
    // ones forwarding; the repair loop keeps it so.
    let mode = attacher.attachment();
    let settings = attach::driver(mode)
        .ensure_node_settings(attacher.ipv6_pods())
        .with_context(|| format!("node settings for {mode} pods"))?;
    for setting in settings {
        tracing::info!(%mode, setting, "turned on a node setting {mode} pods need");
    }
    if let (Some(_), Some(cluster_cidr)) = (&subnets, config.cluster_cidr) {
        let (period, settings) = (config.resync(), node_settings_of(&config, &lease, cluster_cidr)?);
        let routable = overlay.as_ref().and_then(|o| o.ipv6_routable);
        tokio::spawn(node_settings::run(Arc::clone(&metrics), settings, period, routable));
    }
    metrics.set_ipam_usage(attacher.ipam.usage());
    let _ = slot.set(Arc::clone(&attacher));

    // Resolves when the lease has been withdrawn and let go: the agent then
    // exits, and its restart waits for the node's new lease.
    let mut lease_gone: LeaseGone = Box::pin(std::future::pending());
    if let (Some(api), Some(overlay)) = (&subnets, overlay) {
        lease_gone = hold_lease(&config, api, &lease, overlay, &attacher, &metrics);
    }
    let flows = match (&client, policy_pods) {
        (Some(client), Some(attached)) => start_policy(&config, client, subnets.as_ref(), attached, &metrics),
        _ => None,
    };

    if let (Some(addr), Some(reader), Some(client), Some(service)) =
        (config.flows_listen, &config.flows_reader, &client, &flows)
    {
        let reviewer = flows::token_review::TokenReviewer::new(client.clone(), reader.clone());
        let remote = flows::remote::RemoteFlows::new(service.clone(), reviewer);
        tokio::spawn(async move {
            if let Err(e) = flows::remote::serve(addr, remote).await {
                tracing::error!(error = %format!("{e:#}"), "flows: the operator's listener stopped");
            }
        });
    }
    let listener = bind_socket(&config.socket)?;
    tracing::info!(node = %config.node_name, pod_cidr = %pool.cidr(), socket = %config.socket.display(), "weft-agent ready");
    let grpc = serve_cni(listener, Arc::clone(&attacher), flows, shutdown(stop_rx))?;

    let outcome = tokio::select! {
        r = &mut signal => r,
        end = &mut lease_gone => Err(match end {
            lease::LeaseEnd::LetGo(why) => anyhow::anyhow!(
                "{why}; no pod uses the old block any more and it was let go: exiting so that the restart takes this node's new lease"
            ),
            lease::LeaseEnd::Extended(why) => anyhow::anyhow!(
                "{why}: exiting so that the restart gives new pods IPv6 addresses too (running pods keep theirs)"
            ),
        }),
    };
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    tokio::task::spawn_blocking(move || grpc.join())
        .await
        .context("gRPC server thread")?
        .map_err(|_| anyhow::anyhow!("the gRPC server thread panicked"))??;
    http.await.context("HTTP server task")??;
    let _ = std::fs::remove_file(&config.socket);
    outcome
}

/// The attachment path's own loops: host port rules kept, the node's side
/// of the pods repaired, the node's addresses published for host ports.
fn start_attachment_loops(
    config: &Config,
    client: Option<&kube::Client>,
    attacher: &Arc<Attacher>,
    metrics: &Arc<metrics::Metrics>,
) {
    tokio::spawn(sync_host_ports(Arc::clone(&attacher.hostports), Arc::clone(metrics), config.resync()));
    tokio::spawn(attach::repair::run(Arc::clone(attacher)));
    if let (Some(c), Some(node_ip)) = (client, config.node_ip) {
        let (resync, hp) = (config.resync(), Arc::clone(&attacher.hostports));
        // An IPv6-only node's IPv6 address is its node IP: listed once.
        let ipv6 = config.node_ipv6().filter(|v6| std::net::IpAddr::V6(*v6) != node_ip);
        let node = hostport::publish::NodeAddresses { name: config.node_name.clone(), node_ip, ipv6 };
        tokio::spawn(hostport::publish::run(c.clone(), node, hp, resync));
    }
}

/// What ends the agent when its lease does.
type LeaseGone = std::pin::Pin<Box<dyn Future<Output = lease::LeaseEnd> + Send>>;

/// Holds this node's lease; the future resolves when the lease ends.
fn hold_lease(
    config: &Config,
    api: &Api<Subnet>,
    lease: &lease::Lease,
    overlay: OverlayStart,
    attacher: &Arc<Attacher>,
    metrics: &metrics::Metrics,
) -> LeaseGone {
    let resync = config.resync();
    let reconciler = overlay.reconciler;
    let holder = lease::Holder {
        api: api.clone(),
        node: config.node_name.clone(),
        lease: lease.clone(),
        facts: overlay.facts,
        withdrawal: Arc::clone(&attacher.lease),
        gauge: metrics.lease_withdrawn.clone(),
        resync,
        rotate_key: (lease.backend == weft_api::Backend::Wireguard).then(|| key_rotation(config, &reconciler)),
    };
    let ipam = Arc::clone(&attacher.ipam);
    Box::pin(lease::hold(holder, move || ipam.all().len()))
}

/// Rotates this node's WireGuard key when its Subnet asks (once per
/// request): a new key file, the datapath switched to it, its public key
/// returned for the Subnet.
fn key_rotation(config: &Config, reconciler: &Arc<overlay::Reconciler>) -> lease::RotateKey {
    let (dir, reconciler) = (config.state_dir.clone(), Arc::clone(reconciler));
    Box::new(move |request: &str| {
        let key = tunnel::keys::rotate_on_request(&dir, request).map_err(|e| e.to_string())?;
        Ok(key.map(|key| {
            let public = tunnel::keys::encode(&key.public);
            reconciler.set_wireguard_key(key);
            public
        }))
    })
}

/// The policy loop, (with a lease) the reporter of its failures and (with
/// `--flows-capacity`) the flow recorder, whose service it returns.
fn start_policy(
    config: &Config,
    client: &kube::Client,
    subnets: Option<&Api<Subnet>>,
    attached: Arc<policy::attached::Attached>,
    metrics: &metrics::Metrics,
) -> Option<flows::service::FlowService> {
    if let Some(api) = subnets {
        let failure = attached.watch_failure();
        tokio::spawn(policy::report::run(api.clone(), config.node_name.clone(), failure));
    }
    let mut drop_log_readers = policy::drop_log::Readers { lines: config.policy_drop_log_lines, sink: None };
    let (mut publish, mut service) = (None, None);
    if config.flows_capacity > 0 {
        let ring = Arc::new(flows::ring::Ring::new(config.flows_capacity as usize));
        let (tx, rx) = tokio::sync::watch::channel(None);
        let rejects = config.policy_deny_action == policy::render::DenyAction::Reject;
        let recorder = Arc::new(flows::recorder::Recorder::new(
            &config.node_name,
            Arc::clone(&ring),
            Arc::clone(&metrics.flows),
            rejects,
            rx,
        ));
        if let Err(e) = recorder.start_connections() {
            tracing::error!(error = %e, "flows: cannot start the conntrack reader");
        }
        if config.drop_log().is_none() {
            tracing::warn!("flows: no --policy-drop-log-group, so packets policy denies are not recorded");
        }
        drop_log_readers.sink = Some(recorder);
        publish = Some(tx);
        service = Some(flows::service::FlowService::new(&config.node_name, ring, Arc::clone(&metrics.flows)));
    }
    let settings = policy::sync::Settings {
        node: config.node_name.clone(),
        resync: config.resync(),
        deny: config.policy_deny_action,
        drop_log: config.drop_log(),
        cluster_policies: config.cluster_network_policy,
        pod_source: config.pod_source,
        drop_log_readers,
        publish,
    };
    tokio::spawn(policy::sync::run(client.clone(), settings, Arc::clone(&metrics.policy), attached));
    service
}

/// Serves weft-cni (and the flow records, when recorded) on `listener` until `stop` resolves, on a thread and
/// runtime of its own, so that CNI requests and the reconcilers never queue
/// behind each other; the verbs' blocking kernel work goes to the blocking
/// pool (attach::off_thread).
fn serve_cni(
    listener: std::os::unix::net::UnixListener,
    attacher: Arc<Attacher>,
    flows: Option<flows::service::FlowService>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<std::thread::JoinHandle<anyhow::Result<()>>> {
    // Probes are sent from the pods this node's attachment records name.
    let ipam = Arc::clone(&attacher.ipam);
    let pods: flows::service::PodNetns = Arc::new(move |pod: &str| {
        ipam.all().into_iter().find(|(_, r)| r.pod == pod).map(|(_, r)| std::path::PathBuf::from(r.netns))
    });
    let service = CniServer::new(cni_server::CniService::new(attacher));
    let flows = flows.map(|f| weft_proto::flows::v1::flows_server::FlowsServer::new(f.with_probes(pods)));
    std::thread::Builder::new()
        .name("weft-cni-server".into())
        .spawn(move || -> anyhow::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the CNI server's runtime")?;
            rt.block_on(async move {
                let listener = UnixListener::from_std(listener).context("cannot use the CNI socket")?;
                tonic::transport::Server::builder()
                    .add_service(service)
                    .add_optional_service(flows)
                    .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
                    .await
                    .context("gRPC server")
            })
        })
        .context("cannot start the CNI server thread")
}

/// What node_settings keeps for this lease: each family's pod block and
/// cluster range (an IPv6-only node's cluster CIDR is its IPv6 range), and
/// the overlay port its pods may not send to.
/// Refuses a cluster CIDR of another family than the lease's, and an IPv6
/// block outside the cluster's IPv6 range.
fn node_settings_of(
    config: &Config,
    lease: &lease::Lease,
    cluster_cidr: ipnet::IpNet,
) -> anyhow::Result<node_settings::NodeSettings> {
    use ipnet::IpNet;
    let (ipv4, pods6, cluster6) = match (lease.cidr, cluster_cidr) {
        (IpNet::V4(pods), IpNet::V4(cluster)) => {
            (Some(masquerade::Ranges { pods, cluster }), lease.cidr6, config.ipv6_cluster_cidr)
        }
        (IpNet::V6(pods), IpNet::V6(cluster)) => (None, Some(pods), Some(cluster)),
        (pods, cluster) => {
            anyhow::bail!("this node's pod CIDR {pods} and --cluster-cidr {cluster} are of different families")
        }
    };
    let ipv6 =
        pods6.map(|pods| node_settings::Ipv6Settings { pods, cluster: cluster6, masquerade: config.ipv6_masquerade });
    if let Some(v6) = ipv6
        && let Some(cluster) = v6.cluster
        && !cluster.contains(&v6.pods)
    {
        anyhow::bail!("this node's IPv6 block {} is outside the cluster's IPv6 range {cluster}", v6.pods);
    }
    let encapsulation_port = overlay::unauthenticated_port(lease.backend, config.tunnel_port);
    Ok(node_settings::NodeSettings { ipv4, ipv6, encapsulation_port })
}

/// What [`setup_overlay`] leaves for the rest of start-up.
struct OverlayStart {
    reconciler: Arc<overlay::Reconciler>,
    pod_mtu: u32,
    /// What was announced in the Subnet.
    facts: lease::NodeFacts,
    /// Whether the node had routable IPv6 (`auto` IPv6 masquerading).
    ipv6_routable: Option<bool>,
}

/// Creates or adopts the VXLAN device (or checks the underlay for host-gw),
/// starts programming the peers, enables forwarding and masquerading, and
/// announces this node in its Subnet.
async fn setup_overlay(
    config: &Config,
    lease: &lease::Lease,
    host: rtnetlink::Handle,
    api: &Api<Subnet>,
    peer_watches: peer_sync::PeerWatches,
    metrics: &metrics::Metrics,
) -> anyhow::Result<OverlayStart> {
    let node_ip =
        config.node_ip.context("--node-ip (WEFT_NODE_IP) is required when the pod CIDR comes from a Subnet lease")?;
    let cluster_cidr = config
        .cluster_cidr
        .context("--cluster-cidr (WEFT_CLUSTER_CIDR) is required when the pod CIDR comes from a Subnet lease")?;
    let backend = lease.backend;
    let mut cfg = overlay::OverlayConfig::new(&config.node_name, node_ip, lease.cidr, cluster_cidr, backend);
    cfg.vni = config.vni;
    cfg.pod_cidr6 = lease.cidr6;
    cfg.cluster_cidr6 = config.ipv6_cluster_cidr;
    // host-gw peers route this node's IPv6 block to its IPv6 address, and
    // VXLAN over IPv6 peers send their packets to it.
    // An IPv6-only node has only IPv6 to tunnel over, and its node IP is
    // its IPv6 address.
    let node_ip6 = match node_ip {
        std::net::IpAddr::V6(v6) => Some(v6),
        std::net::IpAddr::V4(_) => None,
    };
    let underlay = if node_ip6.is_some() { overlay::VxlanUnderlay::Ipv6 } else { config.vxlan_underlay };
    let over_ipv6 = underlay == overlay::VxlanUnderlay::Ipv6 && backend == weft_api::Backend::Vxlan;
    let node_ipv6 =
        config.node_ipv6().or(node_ip6).filter(|_| lease.cidr6.is_some() || over_ipv6 || node_ip6.is_some());
    if over_ipv6 && node_ipv6.is_none() {
        anyhow::bail!("--vxlan-underlay ipv6 needs this node's IPv6 address in --node-ips (WEFT_NODE_IPS)");
    }
    cfg.node_ipv6 = node_ipv6;
    cfg.vxlan_underlay = underlay;
    if lease.cidr6.is_some() && node_ipv6.is_none() && backend == weft_api::Backend::HostGw {
        tracing::warn!(
            "this node's IPv6 block is unreachable from other nodes: host-gw needs its IPv6 address (--node-ips)"
        );
    }
    cfg.direct_routing = config.direct_routing;
    cfg.underlay = config.underlay_iface.clone();
    cfg.mtu = config.mtu;
    if let Some(port) = config.tunnel_port {
        cfg.tunnel_port = port;
    }
    if backend == weft_api::Backend::Wireguard {
        let (dir, rotate) = (config.state_dir.clone(), config.wireguard_rotate_key);
        let key = tokio::task::spawn_blocking(move || tunnel::keys::load_or_create(&dir, rotate))
            .await
            .context("WireGuard key task")??;
        tracing::info!(public_key = %tunnel::keys::encode(&key.public), rotated = rotate, "WireGuard key");
        cfg.wireguard_key = Some(key);
    }
    let reconciler = overlay::Reconciler::new(host, cfg).context("overlay configuration")?;
    let reconciler = Arc::new(
        reconciler
            .with_tunnel_stats(tunnel::engine::Stats::of(&metrics.tunnel_packets, &metrics.tunnel_device_operations)),
    );
    let local = reconciler.ensure_local().await.context("cannot set up this node's overlay")?;
    // The peers need the device only: they are programmed while the rest
    // of the node is set up (at 1,000 nodes, the announcement below alone
    // waits on a loaded apiserver).
    tokio::spawn(peer_sync::run(peer_sync::PeerSync {
        subnets: api.clone(),
        watches: peer_watches,
        reconciler: Arc::clone(&reconciler),
        node: config.node_name.clone(),
        resync: config.resync(),
        metrics: metrics.overlay.clone(),
    }));

    // Pods on other nodes are reached through this node's forwarding path,
    // and their traffic leaving the cluster is masqueraded (kept so by
    // node_settings::run).
    let settings = node_settings_of(config, lease, cluster_cidr)?;
    if let Some(v6) = settings.ipv6
        && v6.cluster.is_none()
        && v6.masquerade != node_settings::Ipv6Masquerade::Off
    {
        tracing::warn!("IPv6 traffic leaving the cluster is not masqueraded: --ipv6-cluster-cidr is not set");
    }
    let pass = tokio::task::spawn_blocking(move || node_settings::ensure(&settings, None))
        .await
        .context("node settings task")?
        .context("cannot set up forwarding and masquerading")?;

    let facts = lease::NodeFacts {
        node_ip: node_ip.to_string(),
        node_ipv6: node_ipv6.map(|ip| ip.to_string()),
        vtep_ip: local.vtep_ip.map(|ip| ip.to_string()),
        vtep_mac: local.vtep_mac.map(|m| m.to_string()),
        vxlan_underlay: local.vtep_mac.map(|_| underlay),
        wireguard_public_key: local.wireguard_public_key.map(|k| tunnel::keys::encode(&k)),
    };
    lease::publish(api, &config.node_name, &facts).await?;
    Ok(OverlayStart { reconciler, pod_mtu: local.pod_mtu, facts, ipv6_routable: pass.ipv6_routable })
}

/// The host ports in the IPAM records; warns when the range collides with
/// the node's ephemeral ports (outgoing connections could take a port first).
fn host_ports(config: &Config, pool: &Pool, ipv6: Option<&Ipv6Block>, ipam: &Ipam) -> hostport::HostPorts {
    let range = config.host_port_range;
    if let Some(eph) = hostport::range::ephemeral_range().filter(|e| e.overlaps(&range)) {
        tracing::warn!(%range, ephemeral = %eph, "the host port range overlaps the node's ephemeral port range");
    }
    let existing = ipam
        .all()
        .iter()
        .filter_map(|(ip, r)| hostport::Allocation::from_record(*ip, ipv6.and_then(|b| b.beside(*ip)), r))
        .collect();
    let pods = hostport::PodBlocks { pool: pool.cidr(), ipv6: ipv6.map(Ipv6Block::cidr) };
    hostport::HostPorts::new(range, pods, existing)
}

/// Rewrites the host port rules whenever someone else changed them (a
/// component restoring the nat table, a hand edit), every resync period.
async fn sync_host_ports(
    hostports: Arc<hostport::HostPorts>,
    metrics: Arc<metrics::Metrics>,
    period: std::time::Duration,
) {
    let mut first = true;
    loop {
        match hostports.sync().await {
            Ok(true) if !first => {
                tracing::warn!("host port rules had been changed by someone else; rewritten");
                metrics.host_port_repairs.inc();
            }
            // An upgrade in place: the iptables-era chains go once the
            // nftables host port (and, at start-up, masquerade) rules are in.
            Ok(_) if first => {
                firewall::legacy::remove_once("host ports and masquerade", firewall::legacy::remove_nat).await
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "cannot sync host port rules"),
        }
        first = false;
        tokio::time::sleep(period).await;
    }
}

fn unreachable_config() -> anyhow::Result<lease::Lease> {
    anyhow::bail!("neither --pod-cidr nor a Kubernetes API to lease a Subnet from")
}

async fn kube_client(config: &Config) -> anyhow::Result<kube::Client> {
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("invalid kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no kubeconfig and not running in a cluster")?,
    };
    kube::Client::try_from(kube_config).context("cannot build the Kubernetes client")
}

/// Binds the CNI socket, replacing a stale one, readable by root only.
fn bind_socket(path: &std::path::Path) -> anyhow::Result<std::os::unix::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot remove stale socket {}", path.display())),
    }
    let listener =
        std::os::unix::net::UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    listener.set_nonblocking(true).context("cannot make the CNI socket non-blocking")?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", path.display()))?;
    Ok(listener)
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
