//! Wiring: client, metrics server, leader election, the two controllers.

use std::sync::Arc;

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use weft_api::Subnet;

use crate::config::Config;
use crate::leader::{LeaderElector, Term};
use crate::metrics::{self, Metrics};
use crate::subnets::{self, Context, Sightings};

/// Runs the operator until SIGTERM/SIGINT (Ok) or a fatal error.
pub async fn run(config: Config) -> anyhow::Result<()> {
    config.validate()?;
    let pool = config.pool()?;
    let client = Client::try_default().await.context("connecting to the Kubernetes API")?;
    let metrics = Arc::new(Metrics::new());
    metrics.set_leases(0, pool.capacity());

    let mut server = tokio::spawn(metrics::serve(config.metrics_addr, metrics.clone()));
    // Every replica serves the flows API: it holds no state to lead.
    if let Some(settings) = flows_api_settings(&config, &client) {
        tokio::spawn(crate::flows_api::run(settings, client.clone(), metrics.flows_api_serving.clone()));
    }
    let identity = config.identity.clone().unwrap_or_else(default_identity);

    let mut elector = config.leader_elect.then(|| {
        LeaderElector::new(
            Api::<Lease>::namespaced(client.clone(), &config.leader_election_namespace),
            config.leader_election_name.clone(),
            identity.clone(),
            config.lease_duration(),
            config.renew_deadline(),
            config.retry_period(),
        )
    });

    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);

    if let Some(elector) = elector.as_mut() {
        // A standby replica is healthy and ready; it just does not allocate.
        metrics.set_ready(true);
        tokio::select! {
            res = elector.acquire() => res.context("acquiring leadership")?,
            _ = &mut shutdown => return Ok(()),
            res = &mut server => return Err(server_exit(res)),
        }
    }
    metrics.leader.set(1);

    let ctx_config = config.clone();
    let term = elector.as_ref().map_or_else(Term::always, LeaderElector::term);
    let controllers = run_controllers(client, ctx_config, pool, metrics.clone(), identity, term);
    tokio::pin!(controllers);

    let outcome = match elector.as_mut() {
        Some(elector) => {
            tokio::select! {
                lost = elector.hold() => Err(anyhow::Error::new(lost)),
                res = &mut controllers => res,
                res = &mut server => Err(server_exit(res)),
                _ = &mut shutdown => Ok(()),
            }
        }
        None => {
            tokio::select! {
                res = &mut controllers => res,
                res = &mut server => Err(server_exit(res)),
                _ = &mut shutdown => Ok(()),
            }
        }
    };
    if outcome.is_ok()
        && let Some(elector) = elector.as_mut()
    {
        elector.release().await;
    }
    outcome
}

fn flows_api_settings(config: &Config, client: &Client) -> Option<crate::flows_api::Settings> {
    Some(crate::flows_api::Settings {
        addr: config.flows_api_addr?,
        cert: config.flows_api_cert.clone()?,
        key: config.flows_api_key.clone()?,
        agents: crate::flows_api::agents::Agents {
            pods: Api::namespaced(client.clone(), &config.flows_agent_namespace),
            selector: config.flows_agent_selector.clone(),
            port: config.flows_agent_port,
            token_file: config.flows_token_file.clone(),
        },
    })
}

fn server_exit(res: Result<std::io::Result<()>, tokio::task::JoinError>) -> anyhow::Error {
    match res {
        Ok(Ok(())) => anyhow::anyhow!("metrics server stopped"),
        Ok(Err(e)) => anyhow::Error::new(e).context("metrics server failed"),
        Err(e) => anyhow::Error::new(e).context("metrics server task failed"),
    }
}

async fn run_controllers(
    client: Client,
    config: Config,
    pool: crate::ipam::Pool,
    metrics: Arc<Metrics>,
    identity: String,
    term: Term,
) -> anyhow::Result<()> {
    let nodes_api: Api<Node> = Api::all(client.clone());
    let subnets_api: Api<Subnet> = Api::all(client.clone());
    let node_watch = match &config.node_selector {
        Some(sel) => watcher::Config::default().labels(sel),
        None => watcher::Config::default(),
    };
    let ctrl_config = controller::Config::default().concurrency(config.concurrency);

    // Subnet deletions wake nodes that are waiting for space.
    let (retry_tx, retry_rx) = tokio::sync::mpsc::channel::<()>(1);
    // Each controller's watch of the other kind triggers reconciles; what it
    // saw is noted, so a reconcile reads from the API only when the other
    // controller's cache lags behind it (see `subnets::Sightings`).
    let (sightings, node_sightings) = (Arc::new(Sightings::default()), Arc::new(Sightings::default()));
    let node_ctrl = Controller::new(nodes_api.clone(), node_watch.clone());
    let subnet_ctrl = {
        let (node_sightings, nodes) = (node_sightings.clone(), node_ctrl.store());
        Controller::new(subnets_api.clone(), watcher::Config::default())
            .watches(nodes_api.clone(), node_watch, move |node: Node| {
                node_sightings.saw(&node, &nodes);
                Some(ObjectRef::<Subnet>::new(&node.name_any()))
            })
            .with_config(ctrl_config.clone())
    };
    let node_ctrl = {
        let (sightings, subnets) = (sightings.clone(), subnet_ctrl.store());
        node_ctrl
            .watches(subnets_api.clone(), watcher::Config::default(), move |s: Subnet| {
                sightings.saw(&s, &subnets);
                Some(ObjectRef::<Node>::new(&s.spec.node_name))
            })
            .reconcile_all_on(tokio_stream::wrappers::ReceiverStream::new(retry_rx))
            .with_config(ctrl_config)
    };

    let recorder =
        Recorder::new(client.clone(), Reporter { controller: "weft-operator".into(), instance: Some(identity) });
    let standard_policies =
        crate::standard_policies::run(client.clone(), recorder.clone(), metrics.clone(), term.clone());
    let ctx = Arc::new(Context {
        nodes_api,
        subnets_api: subnets_api.clone(),
        nodes: node_ctrl.store(),
        subnets: subnet_ctrl.store(),
        pool,
        // Validated by `config.validate()` at start-up.
        secondary: config.secondary_pool()?,
        config,
        metrics: metrics.clone(),
        recorder,
        term: term.clone(),
        allocator: Default::default(),
        reported: Default::default(),
        absences: Default::default(),
        sightings,
        node_sightings,
    });

    let wake = {
        let ctx = ctx.clone();
        watcher::watcher(Api::<PartialObjectMeta<Subnet>>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .for_each(move |ev| {
                let ctx = ctx.clone();
                let tx = retry_tx.clone();
                async move {
                    if let Ok(watcher::Event::Delete(_)) = ev
                        && ctx.allocator.subnet_deleted()
                    {
                        // Full channel means a wake-up is already pending.
                        let _ = tx.try_send(());
                    }
                }
            })
    };

    let ready = {
        let ctx = ctx.clone();
        async move {
            let nodes = ctx.nodes.wait_until_ready().await;
            let subnets = ctx.subnets.wait_until_ready().await;
            if nodes.is_ok() && subnets.is_ok() {
                tracing::info!("caches synced, reconciling");
            }
        }
    };

    let nodes = node_ctrl.run(subnets::reconcile_node, subnets::error_policy, ctx.clone()).for_each(|res| async move {
        if let Err(e) = res {
            tracing::debug!(error = %e, "node controller event");
        }
    });
    let subnets =
        subnet_ctrl.run(subnets::reconcile_subnet, subnets::error_policy, ctx.clone()).for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "subnet controller event");
            }
        });
    let resync = ctx.config.resync();
    let pods = crate::pods::cache(client.clone());
    let hostports =
        crate::hostports::run(client.clone(), pods.store.clone(), pods.changed, metrics.clone(), resync, term.clone());
    // Futures do nothing until awaited: a switched-off controller never starts.
    let cluster_policies = when(
        ctx.config.cluster_network_policy,
        crate::cluster_policies::run(client.clone(), metrics.clone(), term.clone(), resync),
    );
    let pod_endpoints = when(
        ctx.config.publish_pod_endpoints,
        crate::pod_endpoints::run(client.clone(), metrics.clone(), resync, term.clone()),
    );
    let policies = crate::policies::run(client.clone(), pods.store, pods.touched, metrics.clone(), term, resync);
    tokio::join!(nodes, subnets, wake, ready, hostports, policies, standard_policies, cluster_policies, pod_endpoints);
    anyhow::bail!("controllers stopped")
}

/// Runs `controller` when `enabled`, else nothing.
async fn when(enabled: bool, controller: impl std::future::Future<Output = ()>) {
    if enabled {
        controller.await;
    }
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    format!(
        "{}-{}-{:06x}",
        if host.is_empty() { "weft-operator" } else { &host },
        std::process::id(),
        rand::random::<u32>() & 0xff_ffff
    )
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM, shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT, shutting down"),
    }
}
