//! Keeps this node's policy rules in step with the API: reflectors for
//! pods, namespaces and both kinds of NetworkPolicy feed in-memory stores
//! (pods trimmed to what policy reads). Any change (debounced) recomputes
//! this node's rules in memory, compiling only the pods it can affect
//! (`incremental`) and rendering only chains no pod had; only when that
//! changed a pod's rules is the difference written to the kernel (without
//! reading it), so pod churn elsewhere in the cluster that cannot change
//! this node's rules costs no render and no kernel call. The periodic
//! resync compiles and renders everything, reads the kernel and writes what
//! differs, so a missed event or a tampered rule is repaired by the next one.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod, PodStatus};
use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use weft_api::network_policy::{self as wnp, NetworkPolicy as WeftPolicy};
use weft_api::watch::{self, Projection};

use super::attached::{Attached, Taken};
use super::drop_log;
use super::incremental::Incremental;
use super::metrics::{KindLabels, PolicyMetrics, ResultLabels};
use super::model::{Cluster, NamedPort, PodInfo, Proto};
use super::render::{self, Desired};
use crate::firewall::nft::Nft;
use crate::firewall::ruleset::SetKind;
use crate::firewall::{Engine, FirewallError};

/// Lets the events of one burst (a watch delivers them one by one) land in
/// one pass. Short: a change waits for it, and events that come during a
/// pass are taken by the next one anyway.
const DEBOUNCE: Duration = Duration::from_millis(5);
/// Retry delay after a failed pass.
const RETRY: Duration = Duration::from_secs(1);
/// How long the caches may take to fill before that is reported as a
/// failure (new pods wait for them at ADD meanwhile).
const CACHE_GRACE: Duration = Duration::from_secs(30);
/// How often the policy counters are read into the metrics.
const COUNTERS_EVERY: Duration = Duration::from_secs(10);

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
    let ips = status.map(pod_addresses).unwrap_or_default();
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
        ips,
        node: spec.node_name.clone().unwrap_or_default(),
        ports,
    })
}

/// A pod's addresses from `podIPs` (else `podIP`): the first valid one of
/// each family, IPv4 first; anything unparsable is no address.
fn pod_addresses(status: &PodStatus) -> Vec<IpAddr> {
    let listed = status.pod_ips.iter().flatten().map(|p| p.ip.as_str()).chain(status.pod_ip.as_deref());
    let parsed: Vec<IpAddr> = listed.filter_map(|ip| ip.parse().ok()).collect();
    let v4 = parsed.iter().copied().find(IpAddr::is_ipv4);
    let v6 = parsed.iter().copied().find(IpAddr::is_ipv6);
    v4.into_iter().chain(v6).collect()
}

/// How long the policy loop waits for Weft's own policy cache before it
/// enforces standard NetworkPolicy without it (the CRD may be missing).
const WEFT_CACHE_GRACE: Duration = Duration::from_secs(30);

/// Gives this node's pods that ADD registered the addresses ADD gave them
/// (the API may not know them yet, or still show an earlier sandbox's);
/// returns the keys of those found in the API.
fn with_attached(pods: &mut [Arc<PodInfo>], node: &str, taken: &Taken) -> Vec<String> {
    let mut found = Vec::new();
    if taken.pods.is_empty() {
        return found;
    }
    for pod in pods.iter_mut().filter(|p| p.node == node) {
        let key = pod.key();
        let Some(entry) = taken.pods.get(&key) else { continue };
        if pod.ips != entry.ips {
            Arc::make_mut(pod).ips = entry.ips.clone();
        }
        found.push(key);
    }
    found
}

/// The cluster as the stores see it; invalid Weft policies are left out (logged once per pass).
fn snapshot(
    pods: &Projection<PodInfo>,
    namespaces: &Store<Namespace>,
    standard: &Store<StandardPolicy>,
    weft: &Store<WeftPolicy>,
) -> Cluster {
    let mut c =
        Cluster { pods: pods.values(), namespaces: BTreeMap::new(), standard: standard.state(), weft: Vec::new() };
    for ns in namespaces.state() {
        if let Some(name) = &ns.metadata.name {
            c.namespaces.insert(name.clone(), ns.metadata.labels.clone().unwrap_or_default());
        }
    }
    for p in weft.state() {
        let problems = wnp::validate(&p.spec);
        if problems.is_empty() {
            c.weft.push(p);
        } else {
            tracing::debug!(namespace = ?p.metadata.namespace, name = ?p.metadata.name, ?problems, "ignoring an invalid Weft NetworkPolicy");
        }
    }
    c
}

/// `namespace/name` of the standard policies over the bound (`limits`).
fn refused_policies(cluster: &Cluster) -> Vec<String> {
    let over = |p: &&Arc<StandardPolicy>| {
        p.spec.as_ref().is_some_and(|s| super::limits::standard_cost(s) > super::limits::MAX_COST)
    };
    let key = |p: &Arc<StandardPolicy>| {
        format!(
            "{}/{}",
            p.metadata.namespace.as_deref().unwrap_or_default(),
            p.metadata.name.as_deref().unwrap_or_default()
        )
    };
    cluster.standard.iter().filter(over).map(key).collect()
}

/// Logs and puts a Warning Event on each standard policy newly refused
/// for this node's bound (`was`: those refused the pass before).
fn report_node_refusals(
    client: &Client,
    node: &str,
    now: &[super::limits::NodeRefusal],
    was: &[super::limits::NodeRefusal],
) {
    let key = |r: &super::limits::NodeRefusal| (r.namespace.clone(), r.name.clone(), r.uid.clone());
    let was: std::collections::HashSet<_> = was.iter().map(key).collect();
    for r in now.iter().filter(|r| !was.contains(&key(r))) {
        let message = super::limits::node_refusal_message(r, node);
        tracing::error!(policy = %format!("{}/{}", r.namespace, r.name), "{message}");
        let regarding = crate::events::Regarding {
            api_version: "networking.k8s.io/v1",
            kind: "NetworkPolicy",
            namespace: r.namespace.clone(),
            name: r.name.clone(),
            uid: r.uid.clone(),
        };
        crate::events::record(client, node, regarding, crate::events::Kind::Warning, "PolicyRefused", message);
    }
}

/// Makes the kernel match `want`: after reading it when `full` (the
/// resync, which finds tampering), else by writing what differs from the
/// rules last applied. Blocking.
pub fn apply(
    engine: &Engine<Nft>,
    want: &Desired,
    full: bool,
    metrics: Option<&PolicyMetrics>,
) -> Result<bool, FirewallError> {
    if !full {
        return engine.update(&want.part);
    }
    let (wrote, counts) = engine.sync_counted(&want.part)?;
    if let Some(m) = metrics {
        m.observe_counters(&counts, &want.counters);
    }
    Ok(wrote)
}

impl Report {
    fn of(rules: &Desired, local_pods: usize, wrote: bool) -> Self {
        // Address sets, not the two dispatch maps.
        let sets = rules.part.sets.values().filter(|s| matches!(s.kind, SetKind::Nets(_))).count();
        Report { wrote, rules: rules.rule_count(), sets, local_pods }
    }
}

/// This node's rules (None: the same as the pass before), how many of its
/// pods they cover, and how many of those were compiled anew.
struct Want {
    rules: Option<Arc<Desired>>,
    local_pods: usize,
    recompiled: usize,
    /// How long the compile and the render took.
    took: (Duration, Duration),
}

/// The pure part of a pass, with what it compiled and rendered last: a
/// change compiles the pods and renders the chains it affects, no others.
struct Compute {
    compiler: Incremental,
    renderer: render::Renderer,
    log: Option<render::DropLog>,
    deny: render::DenyAction,
}

impl Compute {
    fn new(node: &str, log: Option<render::DropLog>, deny: render::DenyAction) -> Self {
        let renderer = render::Renderer::new(log).with_deny_action(deny);
        Compute { compiler: Incremental::new(node), renderer, log, deny }
    }

    /// `full`: compile and render everything, as the resync does, so that
    /// the safety net does not depend on the incremental bookkeeping either.
    fn want(&mut self, cluster: &Cluster, full: bool) -> Want {
        if full {
            self.compiler.reset();
            self.renderer = render::Renderer::new(self.log).with_deny_action(self.deny);
        }
        let started = Instant::now();
        let compiled = self.compiler.compile(cluster);
        let compiled_at = started.elapsed();
        let rules = compiled.changed.then(|| self.renderer.render(&compiled.pods));
        let took = (compiled_at, started.elapsed() - compiled_at);
        Want { rules, local_pods: compiled.pods.len(), recompiled: compiled.recompiled, took }
    }
}

/// Runs for the agent's lifetime; `deny`: what denies do with packets;
/// `drop_log`: log dropped packets (off when `None`); `attached`: the pods
/// ADD registered (their rules are applied before ADD answers).
pub async fn run(
    client: Client,
    node: String,
    resync: Duration,
    deny: render::DenyAction,
    drop_log: Option<render::DropLog>,
    metrics: Arc<PolicyMetrics>,
    attached: Arc<Attached>,
) {
    let changed = Arc::clone(&attached.changed);
    // Only what policy reads of each pod is kept (a pod object is kilobytes).
    let pods = watch::project(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default(),
        "Pod",
        pod_info,
        Arc::clone(&changed),
    );
    let namespaces = reflect(Api::<Namespace>::all(client.clone()), "Namespace", Arc::clone(&changed), slim);
    let standard = reflect(Api::<StandardPolicy>::all(client.clone()), "NetworkPolicy", Arc::clone(&changed), slim);
    let (weft_client, events_client) = (client.clone(), client.clone());
    let weft = reflect(Api::<WeftPolicy>::all(client), "weft.dev NetworkPolicy", Arc::clone(&changed), slim);
    tracing::info!("policy: waiting for the pod, namespace and policy caches");
    let caches = async {
        pods.wait_until_ready().await.is_ok()
            && namespaces.wait_until_ready().await.is_ok()
            && standard.wait_until_ready().await.is_ok()
    };
    tokio::pin!(caches);
    let ready = match tokio::time::timeout(CACHE_GRACE, &mut caches).await {
        Ok(ready) => ready,
        Err(_) => {
            attached.set_failure(Some(format!(
                "the Pod, Namespace and NetworkPolicy caches are not filled after {CACHE_GRACE:?} (may the agent list them? see its log)"
            )));
            caches.await
        }
    };
    if !ready {
        tracing::error!("a policy cache was dropped before it was ready; policy is not enforced");
        attached.set_failure(Some("a policy cache was dropped before it was ready (see the agent's log)".to_owned()));
        return;
    }
    // Standard NetworkPolicy does not wait for Weft's CRD: without it (not
    // installed, or no permission) Weft policies are enforced once their
    // cache fills, and standard ones from now on.
    let weft_served = match Api::<WeftPolicy>::all(weft_client).list(&kube::api::ListParams::default().limit(1)).await {
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 403 => {
            tracing::error!(error = %e, "cannot list weft.dev NetworkPolicies (is the CRD installed, may the agent list it?); enforcing standard NetworkPolicy without them");
            false
        }
        _ => true,
    };
    if weft_served && tokio::time::timeout(WEFT_CACHE_GRACE, weft.wait_until_ready()).await.is_err() {
        tracing::error!(
            "the weft.dev NetworkPolicy cache is not ready after {WEFT_CACHE_GRACE:?} (is the CRD installed, may the agent list it?); enforcing standard NetworkPolicy without it"
        );
    }
    // Whether the rules of the last pass that had any reached the kernel.
    let mut last_applied = false;
    let mut last_refused: Vec<String> = Vec::new();
    let mut last_over_node: Vec<super::limits::NodeRefusal> = Vec::new();
    // When the kernel is read next whatever changes: the resync, or a
    // retry. A deadline, not a timer restarted by each change, so that
    // constant churn elsewhere cannot put the resync off.
    let mut kernel_due = tokio::time::Instant::now();
    // Whether rules were ever applied (then the iptables-era ones are gone).
    let mut cleaned_up = false;
    let engine = Arc::new(Engine::new(Nft::default()));
    let mut compute = Some(Compute::new(&node, drop_log, deny));
    let labels: drop_log::Labels = Arc::new(std::sync::Mutex::new(Default::default()));
    tokio::spawn(read_counters(Arc::clone(&engine), Arc::clone(&labels), Arc::clone(&metrics)));
    if let Some(log) = drop_log
        && let Err(e) = drop_log::start(log, Arc::clone(&labels), Arc::clone(&metrics))
    {
        tracing::error!(error = %e, "cannot start the policy drop log reader; policy is enforced without it");
    }
    loop {
        let started = Instant::now();
        let taken = attached.take();
        let mut cluster = snapshot(&pods, &namespaces, &standard, &weft);
        let included = with_attached(&mut cluster.pods, &node, &taken);
        let covered = |pod: &str| included.iter().any(|k| k == pod);
        let snapshot_took = started.elapsed();
        let m = metrics.as_ref();
        m.policies.get_or_create(&KindLabels { kind: "standard" }).set(cluster.standard.len() as i64);
        m.policies.get_or_create(&KindLabels { kind: "weft" }).set(cluster.weft.len() as i64);
        let refused = refused_policies(&cluster);
        let over_node = super::limits::enforce_node_bound(&mut cluster, &node);
        m.refused.set((refused.len() + over_node.len()) as i64);
        if refused != last_refused {
            if !refused.is_empty() {
                tracing::error!(
                    policies = ?refused, bound = super::limits::MAX_COST,
                    "refusing NetworkPolicies that compile past the per-policy bound: the pods they select stay isolated and they admit nothing"
                );
            }
            last_refused = refused;
        }
        report_node_refusals(&events_client, &node, &over_node, &last_over_node);
        last_over_node = over_node;
        let full = tokio::time::Instant::now() >= kernel_due;
        // Lost if the task panics: the next pass starts over.
        let mut c = compute.take().unwrap_or_else(|| Compute::new(&node, drop_log, deny));
        let Want { rules, local_pods, recompiled, took } = match tokio::task::spawn_blocking(move || {
            let want = c.want(&cluster, full);
            (c, want)
        })
        .await
        {
            Ok((c, want)) => {
                compute = Some(c);
                want
            }
            Err(e) => {
                tracing::error!(error = %e, "computing the policy rules failed; retrying");
                m.syncs.get_or_create(&ResultLabels { result: "error" }).inc();
                next_change_or(&changed, &attached, tokio::time::Instant::now() + RETRY).await;
                continue;
            }
        };
        // Only the kernel shows tampering, so the resync (or a retry) always
        // reads it; otherwise only rules that changed go to it. Pod churn
        // elsewhere in the cluster that cannot change this node's rules
        // ends here.
        let Some(rules) = rules else {
            // The rules of the pass before: applied, or (it failed) retried
            // when `kernel_due` comes, with a full compile.
            m.syncs.get_or_create(&ResultLabels { result: "unaffected" }).inc();
            if last_applied {
                attached.applied(&taken, covered);
            }
            next_change_or(&changed, &attached, kernel_due).await;
            continue;
        };
        let computed = started.elapsed();
        let (rules2, metrics2, engine2) = (Arc::clone(&rules), Arc::clone(&metrics), Arc::clone(&engine));
        let result = tokio::task::spawn_blocking(move || {
            let applied = apply(&engine2, &rules2, full, Some(&metrics2));
            // What the pass (or, at the start and after a resync period, a
            // relist) allocated briefly is free now: hand it back before
            // the pass is reported done. Blocking threads each keep an
            // arena, so without this the resident size creeps up pass by pass.
            crate::heap::release_free_memory();
            applied
        })
        .await;
        let elapsed = started.elapsed();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut pause = resync;
        match result {
            Ok(Ok(wrote)) => {
                last_applied = true;
                attached.set_failure(None);
                attached.applied(&taken, covered);
                let report = Report::of(&rules, local_pods, wrote);
                m.rules.set(report.rules as i64);
                m.sets.set(report.sets as i64);
                m.local_pods.set(report.local_pods as i64);
                m.sync_duration.observe(elapsed.as_secs_f64());
                let result = if report.wrote { "applied" } else { "unchanged" };
                m.syncs.get_or_create(&ResultLabels { result }).inc();
                if report.wrote {
                    tracing::info!(
                        rules = report.rules,
                        sets = report.sets,
                        local_pods = report.local_pods,
                        recompiled_pods = recompiled,
                        full,
                        elapsed_ms = format_args!("{:.1}", ms(elapsed)),
                        snapshot_ms = format_args!("{:.1}", ms(snapshot_took)),
                        compute_ms = format_args!("{:.1}", ms(computed - snapshot_took)),
                        compile_ms = format_args!("{:.1}", ms(took.0)),
                        render_ms = format_args!("{:.1}", ms(took.1)),
                        kernel_ms = format_args!("{:.1}", ms(elapsed - computed)),
                        "policy rules applied"
                    );
                }
                *labels.lock().unwrap_or_else(|p| p.into_inner()) = rules.counters.clone();
                if !cleaned_up {
                    // An upgrade in place: the iptables-era policy goes once this is in.
                    crate::firewall::legacy::remove_once("policy", crate::firewall::legacy::remove_policy).await;
                    cleaned_up = true;
                }
            }
            Ok(Err(e)) => {
                last_applied = false;
                attached.set_failure(Some(e.to_string()));
                m.syncs.get_or_create(&ResultLabels { result: "error" }).inc();
                tracing::error!(error = %e, "policy sync failed; retrying");
                pause = RETRY;
            }
            Err(e) => {
                last_applied = false;
                attached.set_failure(Some(format!("the policy task failed: {e}")));
                m.syncs.get_or_create(&ResultLabels { result: "error" }).inc();
                tracing::error!(error = %e, "policy sync task failed; retrying");
                pause = RETRY;
            }
        }
        kernel_due = tokio::time::Instant::now() + pause;
        next_change_or(&changed, &attached, kernel_due).await;
    }
}

/// Reads the policy counters into the metrics every [`COUNTERS_EVERY`]
/// (`labels`: what each counter of the rules last applied counts).
async fn read_counters(engine: Arc<Engine<Nft>>, labels: drop_log::Labels, metrics: Arc<PolicyMetrics>) {
    loop {
        tokio::time::sleep(COUNTERS_EVERY).await;
        let engine = Arc::clone(&engine);
        match tokio::task::spawn_blocking(move || engine.counters(render::OWNER)).await {
            Ok(Ok(counts)) => {
                let labels = labels.lock().unwrap_or_else(|p| p.into_inner()).clone();
                metrics.observe_counters(&counts, &labels);
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot read the policy counters"),
            Err(e) => tracing::warn!(error = %e, "the policy counter task failed"),
        }
    }
}

/// Waits for a change (then lets a burst settle, unless an ADD waits) or
/// until `deadline`.
async fn next_change_or(changed: &tokio::sync::Notify, attached: &Attached, deadline: tokio::time::Instant) {
    tokio::select! {
        () = changed.notified() => if !attached.pending() { tokio::time::sleep(DEBOUNCE).await },
        () = tokio::time::sleep_until(deadline) => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn only_a_change_of_this_node_s_rules_or_a_resync_reaches_the_kernel() {
        use crate::policy::model::tests::{NODE, cluster, std_policy};
        let mut c = cluster();
        c.standard = vec![std_policy("prod", "db", json!({"podSelector": {"matchLabels": {"app": "db"}}}))];
        let mut compute = Compute::new(NODE, None, render::DenyAction::default());
        let first = compute.want(&c, true).rules.expect("the first pass has rules");
        assert!(compute.want(&c, false).rules.is_none(), "nothing changed");
        let again = compute.want(&c, true).rules.expect("the resync looks for tampering");
        assert_eq!(again, first);
        // A change elsewhere: prod/cache is on the other node and no peer.
        let i = c.pods.iter().position(|p| p.key() == "prod/cache").unwrap();
        Arc::make_mut(&mut c.pods[i]).labels.insert("app".into(), "other".into());
        assert!(compute.want(&c, false).rules.is_none(), "a change elsewhere");
        c.standard.clear();
        let none = compute.want(&c, false).rules.expect("this node's rules changed");
        assert_eq!(*none, render::render(&[], None));
    }

    #[test]
    fn attached_pods_of_this_node_take_the_addresses_add_gave_them() {
        use crate::policy::model::tests::{NODE, cluster};
        let attached = Attached::default();
        let c = cluster();
        let local = c.pods.iter().find(|p| p.node == NODE).unwrap().key();
        let remote = c.pods.iter().find(|p| p.node != NODE).unwrap().key();
        let new_ip: IpAddr = "10.244.9.9".parse().unwrap();
        for pod in [&local, &remote, &"prod/not-in-the-api".to_owned()] {
            attached.admit(pod, "c", vec![new_ip]);
        }
        let mut pods = c.pods.clone();
        let found = with_attached(&mut pods, NODE, &attached.take());
        assert_eq!(found, std::slice::from_ref(&local), "only this node's pods, and only those the API knows");
        let ips = |key: &str| pods.iter().find(|p| p.key() == key).unwrap().ips.clone();
        assert_eq!(ips(&local), [new_ip]);
        assert_ne!(ips(&remote), [new_ip], "another node's pod is never changed");
        // The snapshot's own copy changed, not the cache's entry.
        assert_ne!(c.pods.iter().find(|p| p.key() == local).unwrap().ips, [new_ip]);
    }

    #[test]
    fn pods_become_policy_pods_with_named_ports() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "prod", "labels": {"app": "web"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [
                {"name": "http", "containerPort": 8080},
                {"containerPort": 9000},
                {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
            "status": {"podIP": "fd00::5", "podIPs": [{"ip": "fd00::5"}, {"ip": "bogus"}, {"ip": "fd00::6"}, {"ip": "10.0.0.5"}]}
        }))
        .unwrap();
        let info = pod_info(&pod).unwrap();
        let addrs: Vec<IpAddr> = ["10.0.0.5", "fd00::5"].map(|a| a.parse().unwrap()).into();
        assert_eq!(info.ips, addrs, "one address per family, IPv4 first");
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
        assert!(pod_info(&pending).unwrap().ips.is_empty());
    }

    /// Benchmark of the pure part of a pass at the scale of
    /// `e2e/benches/policy_sync.rs` (5,000 pods, 1,000 policies, 250 local
    /// pods): `cargo test -p weft-agent --release --bin weft-agent pass_phases -- --ignored --nocapture`.
    #[test]
    #[ignore = "benchmark; run explicitly"]
    fn pass_phases_at_bench_scale() {
        use crate::firewall::ruleset::diff;
        use crate::policy::incremental::Incremental;
        use crate::policy::model::compile;
        const NAMESPACES: usize = 50;
        let pod = |i: usize, app: usize| -> Pod {
            let j = i / NAMESPACES;
            let ip = format!("10.{}.{}.{}", 100 + i / 62_500, (i / 250) % 250, i % 250 + 1);
            serde_json::from_value(json!({
                "metadata": {"name": format!("p{i}"), "namespace": format!("b{}", i % NAMESPACES),
                    "uid": format!("u{i}"), "resourceVersion": "1",
                    "labels": {"app": format!("a{}", app), "tier": format!("t{}", j % 3)}},
                "spec": {"nodeName": format!("node-{}", i % 20), "containers": [{"name": "c",
                    "ports": [{"name": "http", "containerPort": 8080}, {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
                "status": {"phase": "Running", "podIP": ip}
            }))
            .unwrap()
        };
        let policy = |k: usize| -> StandardPolicy {
            let mut spec = json!({
                "podSelector": {"matchLabels": {"app": format!("a{}", (k / NAMESPACES) % 10)}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"tier": format!("t{}", k % 3)}}},
                    {"namespaceSelector": {"matchLabels": {"team": format!("t{}", k % 5)}},
                     "podSelector": {"matchLabels": {"app": format!("a{}", (k + 1) % 10)}}}],
                    "ports": [{"port": 80}, {"port": "http"}]}]
            });
            if k.is_multiple_of(3) {
                spec["egress"] = json!([{"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.100.0.0/16"]}}]},
                                        {"ports": [{"protocol": "UDP", "port": "dns"}]}]);
                spec["policyTypes"] = json!(["Ingress", "Egress"]);
            }
            serde_json::from_value(json!({"metadata": {"name": format!("np{k}"), "namespace": format!("b{}", k % NAMESPACES)}, "spec": spec})).unwrap()
        };
        // The median of 31 runs: single runs of a few milliseconds are noise.
        let median = |f: &mut dyn FnMut(usize)| {
            let mut ms: Vec<f64> = (0..31)
                .map(|k| {
                    let t = Instant::now();
                    f(k);
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(f64::total_cmp);
            ms[ms.len() / 2]
        };
        let pods: Vec<Pod> = (0..5000).map(|i| pod(i, (i / NAMESPACES) % 10)).collect();
        let mut snapshot = Vec::new();
        let t_snapshot = median(&mut |_| snapshot = pods.iter().filter_map(pod_info).map(Arc::new).collect());
        // In the order the watch keeps them.
        snapshot.sort_by(|a: &Arc<PodInfo>, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut cluster = Cluster {
            pods: snapshot,
            namespaces: (0..NAMESPACES)
                .map(|n| (format!("b{n}"), [("team".to_owned(), format!("t{}", n % 5))].into()))
                .collect(),
            standard: (0..1000).map(|k| Arc::new(policy(k))).collect(),
            weft: Vec::new(),
        };
        let mut compiled = Vec::new();
        let t_compile = median(&mut |_| compiled = compile(&cluster, "node-0"));
        let mut desired = render::render(&[], None);
        let t_render = median(&mut |_| desired = render::render(&compiled, None));

        // Label changes, each undone by the next run: of a pod on this
        // node, then of one elsewhere; the incremental compile and the
        // render that keeps the chains of the pass before.
        let (mut inc, mut renderer) = (Incremental::new("node-0"), render::Renderer::new(None));
        let mut last = inc.compile(&cluster);
        renderer.render(&last.pods);
        let mut changes = Vec::new();
        for (node, key, value) in [("node-0", "app", "a9"), ("node-7", "tier", "t1")] {
            let i = cluster.pods.iter().position(|p| p.node == node).unwrap();
            let was = cluster.pods[i].labels[key].clone();
            let (mut recompiled, mut renders) = (0, Vec::new());
            let t_pass = median(&mut |k| {
                let label = if k % 2 == 0 { value } else { was.as_str() };
                Arc::make_mut(&mut cluster.pods[i]).labels.insert(key.into(), label.into());
                last = inc.compile(&cluster);
                recompiled = recompiled.max(last.recompiled);
                if last.changed {
                    let t = Instant::now();
                    renderer.render(&last.pods);
                    renders.push(t.elapsed().as_secs_f64() * 1e3);
                }
            });
            renders.sort_by(f64::total_cmp);
            changes.push((node, recompiled, t_pass, renders.get(renders.len() / 2).copied()));
        }
        let after = desired.clone();
        let t_diff = median(&mut |_| {
            let mut have = crate::firewall::ruleset::Observed::default();
            have.apply(&diff(&Default::default(), &desired.part));
            diff(&have, &after.part);
        });
        println!(
            "\nPolicy pass at bench scale ({} local pods under policy, {} rules), median ms of 31 runs\n",
            compiled.len(),
            desired.rule_count()
        );
        println!("| phase | ms |\n|---|---:|");
        println!("| pods read from the objects (once; the watch keeps them) | {t_snapshot:.2} |");
        println!("| compile everything (first pass, resync) | {t_compile:.2} |\n| render everything | {t_render:.2} |");
        for (node, recompiled, t_pass, t_render) in changes {
            let render = if t_render.is_some() { "+ render" } else { "(rules unchanged: no render)" };
            println!(
                "| a label change on {node}: incremental compile {render}, {recompiled} pods recompiled | {t_pass:.2} |"
            );
            if let Some(t_render) = t_render {
                println!("| … of which the render | {t_render:.2} |");
            }
        }
        println!("| diff from the last applied (incl. building it) | {t_diff:.2} |");
    }
}
