//! The sandbox's operator: two replicas electing a leader on the Lease in
//! kube-system, as the chart runs it. Each is a detached process with a
//! pidfile, so that a test can kill the leader and watch the other take over.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use super::{CP_NS, state_dir};
use crate::bins;

/// Replica names; the first serves metrics on :9090 and leads after `up`,
/// the second on :9092 (:9091 is the metrics test's Prometheus).
pub const REPLICAS: [&str; 2] = ["a", "b"];
const LEASE: &str = "weft-operator";
const LEASE_NAMESPACE: &str = "kube-system";

fn pidfile(replica: &str) -> PathBuf {
    state_dir().join(format!("operator-{replica}.pid"))
}

fn identity(replica: &str) -> String {
    format!("weft-operator-sandbox-{replica}")
}

/// Starts one replica; returns its pid.
pub fn start(replica: &str, kubeconfig: &Path, backend: &str) -> anyhow::Result<u32> {
    let port = if replica == REPLICAS[0] { 9090 } else { 9092 };
    let mut op = crate::control_plane::process::in_netns(CP_NS, bins::weft("weft-operator"));
    op.env("KUBECONFIG", kubeconfig).args([
        format!("--identity={}", identity(replica)),
        format!("--cluster-cidr={}", super::cluster_cidr()),
        format!("--backend={backend}"),
        format!("--metrics-addr=0.0.0.0:{port}"),
        // del-node removes a node for good: no need to wait for it to return.
        "--release-grace-seconds=1".to_owned(),
        // A killed leader is replaced within seconds.
        "--lease-duration-seconds=4".to_owned(),
        "--renew-deadline-seconds=3".to_owned(),
        "--retry-period-seconds=1".to_owned(),
    ]);
    if super::ipv6_only() {
        op.arg("--node-prefix-length=64");
    }
    op.args(super::ExtraArgs::Operator.load());
    let log = state_dir().join(format!("operator-{replica}.log"));
    let pid = super::spawn_detached(op, &log)?.id();
    std::fs::write(pidfile(replica), pid.to_string())?;
    Ok(pid)
}

pub fn stop(replica: &str, kill9: bool) {
    super::stop_by_pidfile(&pidfile(replica), kill9);
}

/// The replica holding the leader Lease, if any.
pub async fn leader(client: &kube::Client) -> anyhow::Result<Option<String>> {
    let lease = Api::<Lease>::namespaced(client.clone(), LEASE_NAMESPACE).get_opt(LEASE).await?;
    let holder = lease.and_then(|l| l.spec?.holder_identity).unwrap_or_default();
    Ok(REPLICAS.iter().find(|r| identity(r) == holder).map(|r| r.to_string()))
}

/// Waits until `replica` leads.
pub async fn wait_leading(client: &kube::Client, replica: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if leader(client).await?.as_deref() == Some(replica) {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "operator replica {replica} did not lead within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts both replicas, the first one leading before the second starts (so
/// that the operator's metrics are on :9090 after `up`).
pub async fn start_all(client: &kube::Client, kubeconfig: &Path, backend: &str) -> anyhow::Result<()> {
    start(REPLICAS[0], kubeconfig, backend)?;
    wait_leading(client, REPLICAS[0], Duration::from_secs(60)).await?;
    start(REPLICAS[1], kubeconfig, backend)?;
    Ok(())
}

/// Kills (SIGKILL with `kill9`) and starts again the replica that leads;
/// returns its name, or None when nobody leads.
pub async fn restart_leader(state: &super::State, kill9: bool) -> anyhow::Result<Option<String>> {
    let client = crate::control_plane::kube_util::client_from(&state.kubeconfig).await?;
    let Some(replica) = leader(&client).await.context("reading the leader Lease")? else { return Ok(None) };
    stop(&replica, kill9);
    start(&replica, &state.in_cluster_kubeconfig, &state.backend)?;
    Ok(Some(replica))
}
