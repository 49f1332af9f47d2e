//! Keeps this node's policy rules in step with the API: reflectors for
//! pods, namespaces and both kinds of NetworkPolicy feed in-memory stores;
//! any change (debounced) and a periodic resync run one full pass:
//! compile, render, diff against the kernel, write only what differs. The
//! pass is level-triggered, so a missed event or a tampered rule is
//! repaired by the next one.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use weft_api::network_policy::{self as wnp, NetworkPolicy as WeftPolicy};

use super::ipset;
use super::metrics::{KindLabels, PolicyMetrics, ResultLabels};
use super::model::{Cluster, NamedPort, PodInfo, Proto, compile};
use super::render::{self, Desired};
use crate::dataplane::iptables;

/// Coalesces bursts of events (a namespace relabel touches many pods) into one pass.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// Retry delay after a failed pass.
const RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// `iptables-save`/`-restore` or `ipset`: the error names the program.
    #[error(transparent)]
    Program(#[from] crate::dataplane::exec::ExecError),
}

/// The outcome of one pass.
#[derive(Debug)]
pub struct Report {
    pub wrote: bool,
    pub rules: usize,
    pub sets: usize,
    pub local_pods: usize,
}

/// Keeps only what policy reads, so that the caches stay small with many pods.
fn slim<K: Resource>(obj: &mut K) {
    let meta = obj.meta_mut();
    meta.managed_fields = None;
    meta.annotations = None;
    meta.owner_references = None;
}

fn slim_pod(pod: &mut Pod) {
    slim(pod);
    if let Some(spec) = pod.spec.as_mut() {
        spec.volumes = None;
        spec.tolerations = None;
        spec.affinity = None;
        for c in spec.containers.iter_mut().chain(spec.init_containers.iter_mut().flatten()) {
            *c = k8s_openapi::api::core::v1::Container {
                name: std::mem::take(&mut c.name),
                ports: c.ports.take(),
                ..Default::default()
            };
        }
    }
    if let Some(status) = pod.status.as_mut() {
        status.conditions = None;
        status.container_statuses = None;
        status.init_container_statuses = None;
    }
}

fn reflect<K>(api: Api<K>, what: &'static str, changed: Arc<tokio::sync::Notify>, trim: fn(&mut K)) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    weft_api::watch::reflect(api, watcher::Config::default(), what, trim, Some(changed))
}

/// What policy needs of a Pod object; None for pods outside the pod network
/// (host network, finished, or not addressed yet without a node).
pub fn pod_info(pod: &Pod) -> Option<PodInfo> {
    let spec = pod.spec.as_ref()?;
    if spec.host_network == Some(true) {
        return None;
    }
    let status = pod.status.as_ref();
    if status.and_then(|s| s.phase.as_deref()).is_some_and(|p| p == "Succeeded" || p == "Failed") {
        return None;
    }
    let ip = status.and_then(|s| {
        s.pod_ips
            .iter()
            .flatten()
            .map(|p| p.ip.as_str())
            .chain(s.pod_ip.as_deref())
            .find_map(|ip| ip.parse::<std::net::Ipv4Addr>().ok())
    });
    let ports = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| {
            Some(NamedPort {
                name: p.name.clone()?,
                port: u16::try_from(p.container_port).ok()?,
                proto: Proto::parse(p.protocol.as_deref())?,
            })
        })
        .collect();
    Some(PodInfo {
        namespace: pod.metadata.namespace.clone()?,
        name: pod.metadata.name.clone()?,
        labels: pod.metadata.labels.clone().unwrap_or_default(),
        ip,
        node: spec.node_name.clone().unwrap_or_default(),
        ports,
    })
}

/// The cluster as the stores see it; invalid Weft policies are left out (logged once per pass).
fn snapshot(
    pods: &Store<Pod>,
    namespaces: &Store<Namespace>,
    standard: &Store<StandardPolicy>,
    weft: &Store<WeftPolicy>,
) -> Cluster {
    let mut c = Cluster {
        pods: pods.state().iter().filter_map(|p| pod_info(p)).collect(),
        namespaces: BTreeMap::new(),
        standard: standard.state().iter().map(|p| (**p).clone()).collect(),
        weft: Vec::new(),
    };
    c.pods.sort_by_key(PodInfo::key);
    for ns in namespaces.state() {
        if let Some(name) = &ns.metadata.name {
            c.namespaces.insert(name.clone(), ns.metadata.labels.clone().unwrap_or_default());
        }
    }
    for p in weft.state() {
        let problems = wnp::validate(&p.spec);
        if problems.is_empty() {
            c.weft.push((*p).clone());
        } else {
            tracing::debug!(namespace = ?p.metadata.namespace, name = ?p.metadata.name, ?problems, "ignoring an invalid Weft NetworkPolicy");
        }
    }
    c
}

/// Makes the kernel match `want`: sets first (rules may name them), then one
/// atomic iptables-restore, then stale sets go. Blocking.
pub fn apply(want: &Desired, metrics: Option<&PolicyMetrics>) -> Result<bool, SyncError> {
    let (before, after) = render::ipset_texts(&render::parse_sets(&ipset::save()?), want);
    let mut wrote = false;
    if let Some(t) = before {
        ipset::restore(&t)?;
        wrote = true;
    }
    let current = render::parse_save(&iptables::save_counted("filter")?);
    if let Some(m) = metrics {
        m.observe_drops(&current.drops);
    }
    if let Some(t) = render::restore_text(&current, want) {
        iptables::restore(&t)?;
        wrote = true;
    }
    if let Some(t) = after {
        // A set still referenced (a racing writer) is retried on the next pass.
        match ipset::restore(&t) {
            Ok(()) => wrote = true,
            Err(e) => tracing::warn!(error = %e, "cannot destroy stale policy ipsets; retrying next pass"),
        }
    }
    Ok(wrote)
}

/// One full pass over `cluster` for `node`. Blocking.
pub fn sync_once(cluster: &Cluster, node: &str, metrics: Option<&PolicyMetrics>) -> Result<Report, SyncError> {
    let compiled = compile(cluster, node);
    let want = render::render(&compiled);
    let wrote = apply(&want, metrics)?;
    Ok(Report { wrote, rules: want.rule_count(), sets: want.sets.len(), local_pods: compiled.len() })
}

/// Runs for the agent's lifetime.
pub async fn run(client: Client, node: String, resync: Duration, metrics: Arc<PolicyMetrics>) {
    let changed = Arc::new(tokio::sync::Notify::new());
    let pods = reflect(Api::<Pod>::all(client.clone()), "Pod", Arc::clone(&changed), slim_pod);
    let namespaces = reflect(Api::<Namespace>::all(client.clone()), "Namespace", Arc::clone(&changed), slim);
    let standard = reflect(Api::<StandardPolicy>::all(client.clone()), "NetworkPolicy", Arc::clone(&changed), slim);
    let weft = reflect(Api::<WeftPolicy>::all(client), "weft.dev NetworkPolicy", Arc::clone(&changed), slim);
    tracing::info!("policy: waiting for the pod, namespace and policy caches");
    for ready in [
        pods.wait_until_ready().await,
        namespaces.wait_until_ready().await,
        standard.wait_until_ready().await,
        weft.wait_until_ready().await,
    ] {
        if ready.is_err() {
            tracing::error!("a policy cache was dropped before it was ready; policy is not enforced");
            return;
        }
    }
    loop {
        let started = Instant::now();
        let cluster = snapshot(&pods, &namespaces, &standard, &weft);
        let m = metrics.as_ref();
        m.policies.get_or_create(&KindLabels { kind: "standard" }).set(cluster.standard.len() as i64);
        m.policies.get_or_create(&KindLabels { kind: "weft" }).set(cluster.weft.len() as i64);
        let node2 = node.clone();
        let metrics2 = Arc::clone(&metrics);
        let result = tokio::task::spawn_blocking(move || sync_once(&cluster, &node2, Some(&metrics2))).await;
        let elapsed = started.elapsed();
        let mut pause = resync;
        match result {
            Ok(Ok(report)) => {
                m.rules.set(report.rules as i64);
                m.ipsets.set(report.sets as i64);
                m.local_pods.set(report.local_pods as i64);
                m.sync_duration.observe(elapsed.as_secs_f64());
                let result = if report.wrote { "applied" } else { "unchanged" };
                m.syncs.get_or_create(&ResultLabels { result }).inc();
                if report.wrote {
                    tracing::info!(
                        rules = report.rules,
                        sets = report.sets,
                        local_pods = report.local_pods,
                        elapsed_ms = elapsed.as_millis() as u64,
                        "policy rules applied"
                    );
                }
            }
            Ok(Err(e)) => {
                m.syncs.get_or_create(&ResultLabels { result: "error" }).inc();
                tracing::error!(error = %e, "policy sync failed; retrying");
                pause = RETRY;
            }
            Err(e) => {
                m.syncs.get_or_create(&ResultLabels { result: "error" }).inc();
                tracing::error!(error = %e, "policy sync task failed; retrying");
                pause = RETRY;
            }
        }
        tokio::select! {
            () = changed.notified() => tokio::time::sleep(DEBOUNCE).await,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn pods_become_policy_pods_with_named_ports() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "prod", "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [
                {"name": "http", "containerPort": 8080},
                {"containerPort": 9000},
                {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
            "status": {"podIP": "10.0.0.5", "podIPs": [{"ip": "fd00::5"}, {"ip": "10.0.0.5"}]}
        }))
        .unwrap();
        let info = pod_info(&pod).unwrap();
        let mut slimmed = pod.clone();
        slim_pod(&mut slimmed);
        assert_eq!(pod_info(&slimmed), Some(info.clone()), "slimming keeps what policy reads");
        assert_eq!(info.ip, Some("10.0.0.5".parse().unwrap()));
        assert_eq!(info.key(), "prod/web");
        assert_eq!(info.node, "n1");
        assert_eq!(
            info.ports,
            [
                NamedPort { name: "http".into(), port: 8080, proto: Proto::Tcp },
                NamedPort { name: "dns".into(), port: 53, proto: Proto::Udp }
            ]
        );
        let mut host = pod.clone();
        host.spec.as_mut().unwrap().host_network = Some(true);
        assert_eq!(pod_info(&host), None, "host-network pods are not policy pods");
        let mut done = pod.clone();
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        assert_eq!(pod_info(&done), None, "a finished pod's address may belong to another pod");
        let mut pending = pod;
        pending.status = None;
        assert_eq!(pod_info(&pending).unwrap().ip, None);
    }
}
