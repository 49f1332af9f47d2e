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

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kube::Client;

use super::attached::Attached;
use super::caches::{Caches, PodSource, with_attached};
use super::drop_log;
use super::incremental::Incremental;
use super::limits::{self, NodeRefusal};
use super::metrics::{KindLabels, PolicyMetrics, ResultLabels};
use super::model::{Cluster, PodInfo, PodPolicy};
use super::pods::LocalPods;
use super::render::{self, Desired};
use super::report;
use crate::firewall::nft::Nft;
use crate::firewall::ruleset::SetKind;
use crate::firewall::{Engine, FirewallError};

/// Lets the events of one burst (a watch delivers them one by one, from the
/// same read) land in one pass. As short as the timer allows: every change
/// waits for it, and events that come during a pass are taken by the next
/// one anyway.
const DEBOUNCE: Duration = Duration::from_millis(1);
/// How long the loop must have been idle after an incremental pass before
/// the heap is trimmed. A trim walks every malloc arena under its lock, and
/// a pass that starts meanwhile waits on those locks (about 10 ms of a
/// loaded pass at 50,000 pods): changes that come one after another are
/// passed first. A full pass (each resync) trims at its end anyway.
const TRIM_WHEN_QUIET: Duration = Duration::from_secs(1);
/// Retry delay after a failed pass.
const RETRY: Duration = Duration::from_secs(1);
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
    /// The local pods under policy, as compiled.
    local: Vec<Arc<PodPolicy>>,
    local_pods: usize,
    recompiled: usize,
    /// How long the compile and the render took.
    took: (Duration, Duration),
}

/// What the bounds refuse in a pass's cluster.
struct Bounds {
    /// `namespace/name` of the policies over the per-policy bound.
    refused: Vec<String>,
    over_node: Vec<NodeRefusal>,
}

impl Bounds {
    /// Applies the per-policy and per-node bounds to `cluster`, whose pods
    /// on this node are `local`.
    fn enforce(cluster: &mut Cluster, local: &[Arc<PodInfo>]) -> Self {
        let refused = limits::refused_policies(cluster);
        Bounds { refused, over_node: limits::enforce_node_bound(cluster, local) }
    }
}

/// What a pass's blocking part did.
struct Computed {
    /// The cluster within the bounds, as compiled.
    cluster: Arc<Cluster>,
    bounds: Bounds,
    want: Want,
    /// Set when `want` has rules (changed, or a full pass).
    applied: Option<Applied>,
}

/// Rules written to the kernel, and when.
struct Applied {
    result: Result<bool, FirewallError>,
    /// From the start of the pass to the rules computed.
    computed: Duration,
    kernel: Duration,
    /// When the kernel call returned (the metric of the last write).
    at: SystemTime,
}

/// The pure part of a pass, with what it compiled and rendered last: a
/// change compiles the pods and renders the chains it affects, no others.
struct Compute {
    /// This node's pods, for the bounds (the compile follows its own).
    local: LocalPods,
    compiler: Incremental,
    renderer: render::Renderer,
    log: Option<render::DropLog>,
    deny: render::DenyAction,
}

impl Compute {
    fn new(node: &str, log: Option<render::DropLog>, deny: render::DenyAction) -> Self {
        let renderer = render::Renderer::new(log).with_deny_action(deny);
        Compute { local: LocalPods::new(node), compiler: Incremental::new(node), renderer, log, deny }
    }

    /// Applies the bounds to `cluster`; `full`: reading every pod.
    fn bounds(&mut self, cluster: &mut Cluster, full: bool) -> Bounds {
        if full {
            self.local.reset();
        }
        let local = self.local.follow(&cluster.pods).0;
        Bounds::enforce(cluster, local)
    }

    /// `full`: compile and render everything, as the resync does, so that
    /// the safety net does not depend on the incremental bookkeeping either.
    fn want(&mut self, cluster: &Arc<Cluster>, full: bool) -> Want {
        if full {
            self.compiler.reset();
            self.renderer = render::Renderer::new(self.log).with_deny_action(self.deny);
        }
        let started = Instant::now();
        let compiled = self.compiler.compile(cluster);
        let compiled_at = started.elapsed();
        let rules = compiled.changed.then(|| self.renderer.render(&compiled.pods));
        let took = (compiled_at, started.elapsed() - compiled_at);
        let local_pods = compiled.pods.len();
        Want { rules, local: compiled.pods, local_pods, recompiled: compiled.recompiled, took }
    }
}

/// How this node enforces policy (the agent's flags).
pub struct Settings {
    pub node: String,
    /// How often the kernel is read and repaired whatever changes.
    pub resync: Duration,
    /// What denies do with packets.
    pub deny: render::DenyAction,
    /// Log dropped packets (off when `None`).
    pub drop_log: Option<render::DropLog>,
    /// Enforce ClusterNetworkPolicies too (their CRD must be installed).
    pub cluster_policies: bool,
    /// Where the cluster's pods are learnt from.
    pub pod_source: PodSource,
    /// Who reads the drop log's records besides the log lines.
    pub drop_log_readers: drop_log::Readers,
    /// Where each pass publishes what it computed (the flow recorder's view).
    pub publish: Option<tokio::sync::watch::Sender<Option<Arc<Latest>>>>,
}

/// What the latest pass computed: every pod the policy loop knows, and this
/// node's pods under policy as compiled.
pub struct Latest {
    pub cluster: Arc<Cluster>,
    pub local: Vec<Arc<PodPolicy>>,
}

/// Runs for the agent's lifetime; `attached`: the pods ADD registered
/// (their rules are applied before ADD answers).
pub async fn run(client: Client, settings: Settings, metrics: Arc<PolicyMetrics>, attached: Arc<Attached>) {
    let caches =
        Caches::start(&client, &attached.changed, settings.cluster_policies, settings.pod_source, &settings.node);
    if !caches.wait_filled(&client, &attached).await {
        return;
    }
    let mut policy = PolicyLoop::start(client, settings, metrics, Arc::clone(&attached));
    loop {
        let next = policy.pass(&caches).await;
        let trim = policy.trim_due.take();
        next_change_or(&attached.changed, &attached, next, trim, || {
            tokio::task::spawn_blocking(crate::heap::release_free_memory);
        })
        .await;
    }
}

/// The loop's state between passes.
struct PolicyLoop {
    node: String,
    resync: Duration,
    events: Client,
    metrics: Arc<PolicyMetrics>,
    attached: Arc<Attached>,
    engine: Arc<Engine<Nft>>,
    /// The compiler and renderer with what they did last; made anew when a
    /// pass's task fails (the next pass starts over).
    compute: Arc<std::sync::Mutex<Compute>>,
    new_compute: Box<dyn Fn() -> Compute + Send>,
    /// What each counter of the rules last applied counts (metrics, drop log).
    labels: drop_log::Labels,
    /// Whether the rules of the last pass that had any reached the kernel.
    last_applied: bool,
    last_refused: Vec<String>,
    last_over_node: Vec<NodeRefusal>,
    /// When the kernel is read next whatever changes: the resync, or a
    /// retry. A deadline, not a timer restarted by each change, so that
    /// constant churn elsewhere cannot put the resync off.
    kernel_due: tokio::time::Instant,
    /// Whether rules were ever applied (then the iptables-era ones are gone).
    cleaned_up: bool,
    /// Shared with each pass's blocking part, which publishes.
    publish: Option<Arc<tokio::sync::watch::Sender<Option<Arc<Latest>>>>>,
    /// When the heap is trimmed if no change comes first (after an
    /// incremental pass that applied rules).
    trim_due: Option<tokio::time::Instant>,
}

impl PolicyLoop {
    /// Also starts the counters' reader and, when asked, the drop log.
    fn start(events: Client, settings: Settings, metrics: Arc<PolicyMetrics>, attached: Arc<Attached>) -> Self {
        let Settings { node, resync, deny, drop_log, cluster_policies: _, pod_source: _, drop_log_readers, publish } =
            settings;
        let engine = Arc::new(Engine::new(Nft::default()));
        let labels: drop_log::Labels = Arc::new(std::sync::Mutex::new(Default::default()));
        tokio::spawn(read_counters(Arc::clone(&engine), Arc::clone(&labels), Arc::clone(&metrics)));
        if let Some(log) = drop_log
            && let Err(e) = drop_log::start(log, Arc::clone(&labels), Arc::clone(&metrics), drop_log_readers)
        {
            tracing::error!(error = %e, "cannot start the policy drop log reader; policy is enforced without it");
        }
        let compute_node = node.clone();
        let new_compute = Box::new(move || Compute::new(&compute_node, drop_log, deny));
        PolicyLoop {
            compute: Arc::new(std::sync::Mutex::new(new_compute())),
            new_compute,
            node,
            resync,
            events,
            metrics,
            attached,
            engine,
            labels,
            last_applied: false,
            last_refused: Vec::new(),
            last_over_node: Vec::new(),
            kernel_due: tokio::time::Instant::now(),
            cleaned_up: false,
            publish: publish.map(Arc::new),
            trim_due: None,
        }
    }

    /// One pass: the cluster from the caches (with the pods ADD registered)
    /// within the bounds, this node's rules computed and, when they changed
    /// or the kernel is due, applied. Returns when the kernel is due next.
    async fn pass(&mut self, caches: &Caches) -> tokio::time::Instant {
        let started = Instant::now();
        let taken = self.attached.take();
        let mut cluster = caches.snapshot();
        let included = with_attached(&mut cluster.pods, &self.node, &taken);
        let covered = |pod: &str| included.iter().any(|k| k == pod);
        let snapshot_took = started.elapsed();
        let full = tokio::time::Instant::now() >= self.kernel_due;
        let done = match self.compute_and_apply(cluster, full, started).await {
            Ok(done) => done,
            Err(e) => return self.failed(e),
        };
        let Computed { cluster, bounds, want, applied } = done;
        self.report_bounds(&cluster, bounds);
        // Only the kernel shows tampering, so the resync (or a retry) always
        // reads it; otherwise only rules that changed go to it. Pod churn
        // elsewhere in the cluster that cannot change this node's rules
        // ends here.
        let (Some(rules), Some(Applied { result, computed, kernel, at })) = (want.rules.clone(), applied) else {
            // The rules of the pass before: applied, or (it failed) retried
            // when `kernel_due` comes, with a full compile.
            self.metrics.syncs.get_or_create(&ResultLabels { result: "unaffected" }).inc();
            if self.last_applied {
                self.attached.applied(&taken, covered);
            }
            return self.kernel_due;
        };
        let wrote = match result {
            Ok(wrote) => wrote,
            Err(e) => return self.failed(e.to_string()),
        };
        let timings = Timings { total: started.elapsed(), snapshot: snapshot_took, computed, kernel, at };
        // ADDs waiting for these rules answer first.
        self.attached.set_failure(None);
        self.attached.applied(&taken, covered);
        self.applied(&rules, &want, full, wrote, timings).await;
        if !full {
            // Once the loop is quiet, off any pass's latency. Blocking
            // threads each keep an arena, so without this the resident size
            // would creep up.
            self.trim_due = Some(tokio::time::Instant::now() + TRIM_WHEN_QUIET);
        }
        self.last_applied = true;
        self.kernel_due = tokio::time::Instant::now() + self.resync;
        self.kernel_due
    }

    /// A pass that failed: counted, logged and told to the ADDs waiting;
    /// the next one, a full pass, comes after [`RETRY`].
    fn failed(&mut self, error: String) -> tokio::time::Instant {
        self.metrics.syncs.get_or_create(&ResultLabels { result: "error" }).inc();
        tracing::error!(error = %error, "policy sync failed; retrying");
        self.attached.set_failure(Some(error));
        self.last_applied = false;
        self.kernel_due = tokio::time::Instant::now() + RETRY;
        self.kernel_due
    }

    /// The bounds applied to `cluster`, this node's rules computed and, when
    /// they changed (or `full`), applied: on one blocking thread, so that a
    /// change waits for one hand-off between threads, not two (each costs
    /// milliseconds on a loaded node). `started`: when the pass started.
    /// When the task fails, the next pass compiles anew.
    async fn compute_and_apply(
        &mut self,
        mut cluster: Cluster,
        full: bool,
        started: Instant,
    ) -> Result<Computed, String> {
        let compute = Arc::clone(&self.compute);
        let (metrics, engine) = (Arc::clone(&self.metrics), Arc::clone(&self.engine));
        let publish = self.publish.clone();
        let task = tokio::task::spawn_blocking(move || {
            // Not held across the kernel call below.
            let (bounds, cluster, want) = {
                let mut compute = compute.lock().unwrap_or_else(|p| p.into_inner());
                let bounds = compute.bounds(&mut cluster, full);
                let cluster = Arc::new(cluster);
                let want = compute.want(&cluster, full);
                (bounds, cluster, want)
            };
            let computed = started.elapsed();
            // Before the rules: the flow recorder names what they drop from
            // this view (rebuilding its index for a drop once a newer view exists).
            if let Some(tx) = &publish {
                let latest = Latest { cluster: Arc::clone(&cluster), local: want.local.clone() };
                tx.send_replace(Some(Arc::new(latest)));
            }
            let applied = want.rules.as_ref().map(|rules| {
                let applying_at = Instant::now();
                let result = apply(&engine, rules, full, Some(&metrics));
                let kernel = applying_at.elapsed();
                let at = SystemTime::now();
                // What a full pass (at the start and each resync, after a
                // relist) allocated briefly is free now: hand it back before
                // the pass is reported done, so the resident size then is
                // what the caches hold.
                if full {
                    crate::heap::release_free_memory();
                }
                Applied { result, computed, kernel, at }
            });
            Computed { cluster, bounds, want, applied }
        });
        task.await.map_err(|e| {
            self.compute = Arc::new(std::sync::Mutex::new((self.new_compute)()));
            format!("the policy task failed: {e}")
        })
    }

    /// Reports what the bounds refuse: the metrics always, the log and the
    /// Events when that changed.
    fn report_bounds(&mut self, cluster: &Cluster, bounds: Bounds) {
        let m = self.metrics.as_ref();
        m.policies.get_or_create(&KindLabels { kind: "standard" }).set(cluster.standard.len() as i64);
        m.policies.get_or_create(&KindLabels { kind: "weft" }).set(cluster.weft.len() as i64);
        let Bounds { refused, over_node } = bounds;
        m.refused.set((refused.len() + over_node.len()) as i64);
        if refused != self.last_refused {
            if !refused.is_empty() {
                tracing::error!(
                    policies = ?refused, bound = limits::MAX_COST,
                    "refusing NetworkPolicies that compile past the per-policy bound: the pods they select stay isolated and they admit nothing"
                );
            }
            self.last_refused = refused;
        }
        report::node_refusals(&self.events, &self.node, &over_node, &self.last_over_node);
        self.last_over_node = over_node;
    }

    /// What a pass that reached the kernel leaves: the metrics, a log line
    /// when it wrote, the counters' labels, and (once) the removal of the
    /// iptables-era policy.
    async fn applied(&mut self, rules: &Desired, want: &Want, full: bool, wrote: bool, t: Timings) {
        let m = self.metrics.as_ref();
        let report = Report::of(rules, want.local_pods, wrote);
        m.rules.set(report.rules as i64);
        m.sets.set(report.sets as i64);
        m.local_pods.set(report.local_pods as i64);
        m.sync_duration.observe(t.total.as_secs_f64());
        let result = if report.wrote { "applied" } else { "unchanged" };
        m.syncs.get_or_create(&ResultLabels { result }).inc();
        if report.wrote {
            m.last_write.set(t.at.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64());
            let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
            tracing::info!(
                rules = report.rules,
                sets = report.sets,
                local_pods = report.local_pods,
                recompiled_pods = want.recompiled,
                full,
                elapsed_ms = ms(t.total),
                snapshot_ms = ms(t.snapshot),
                compute_ms = ms(t.computed - t.snapshot),
                compile_ms = ms(want.took.0),
                render_ms = ms(want.took.1),
                kernel_ms = ms(t.kernel),
                "policy rules applied"
            );
        }
        *self.labels.lock().unwrap_or_else(|p| p.into_inner()) = rules.counters.clone();
        if !self.cleaned_up {
            // An upgrade in place: the iptables-era policy goes once this is in.
            crate::firewall::legacy::remove_once("policy", crate::firewall::legacy::remove_policy).await;
            self.cleaned_up = true;
        }
    }
}

/// Where a pass's time went: in all, to the snapshot, until its rules were
/// computed, and in the kernel's calls.
#[derive(Clone, Copy)]
struct Timings {
    total: Duration,
    snapshot: Duration,
    computed: Duration,
    kernel: Duration,
    /// When the kernel call returned.
    at: SystemTime,
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
/// until `deadline`; calls `trim` at `trim_at` if neither came by then.
async fn next_change_or(
    changed: &tokio::sync::Notify,
    attached: &Attached,
    deadline: tokio::time::Instant,
    trim_at: Option<tokio::time::Instant>,
    trim: impl FnOnce(),
) {
    let quiet = async {
        if let Some(at) = trim_at {
            tokio::time::sleep_until(at).await;
            trim();
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        () = changed.notified() => if !attached.pending() { tokio::time::sleep(DEBOUNCE).await },
        () = tokio::time::sleep_until(deadline) => {}
        () = quiet => {}
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::networking::v1::NetworkPolicy as StandardPolicy;
    use serde_json::json;

    use super::*;
    use crate::policy::caches::pod_info;
    use crate::policy::pods::Pods;

    #[tokio::test]
    async fn the_heap_is_trimmed_once_the_loop_is_quiet_and_not_before_a_change() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let changed = Arc::new(tokio::sync::Notify::new());
        let attached = Attached::new(Arc::clone(&changed));
        let trimmed = AtomicBool::new(false);
        // Quiet: the trim comes at its time, and the wait goes on to the deadline.
        let now = tokio::time::Instant::now();
        let (trim_at, deadline) = (now + Duration::from_millis(20), now + Duration::from_millis(200));
        next_change_or(&changed, &attached, deadline, Some(trim_at), || trimmed.store(true, Ordering::SeqCst)).await;
        assert!(trimmed.load(Ordering::SeqCst), "no trim in a quiet loop");
        assert!(tokio::time::Instant::now() >= deadline, "the wait ends at the deadline, not at the trim");
        // A change before the trim's time: the pass comes first, no trim.
        trimmed.store(false, Ordering::SeqCst);
        changed.notify_one();
        let now = tokio::time::Instant::now();
        let (trim_at, deadline) = (now + Duration::from_secs(30), now + Duration::from_secs(60));
        next_change_or(&changed, &attached, deadline, Some(trim_at), || trimmed.store(true, Ordering::SeqCst)).await;
        assert!(!trimmed.load(Ordering::SeqCst), "trimmed before the change's pass");
    }

    #[test]
    fn only_a_change_of_this_node_s_rules_or_a_resync_reaches_the_kernel() {
        use crate::policy::model::tests::{NODE, cluster, std_policy};
        let mut c = cluster();
        c.standard = vec![std_policy("prod", "db", json!({"podSelector": {"matchLabels": {"app": "db"}}}))];
        let mut compute = Compute::new(NODE, None, render::DenyAction::default());
        let first = compute.want(&Arc::new(c.clone()), true).rules.expect("the first pass has rules");
        assert!(compute.want(&Arc::new(c.clone()), false).rules.is_none(), "nothing changed");
        let again = compute.want(&Arc::new(c.clone()), true).rules.expect("the resync looks for tampering");
        assert_eq!(again, first);
        // A change elsewhere: prod/cache is on the other node and no peer.
        Arc::make_mut(c.pods.get_mut("prod", "cache").unwrap()).labels.insert("app".into(), "other".into());
        assert!(compute.want(&Arc::new(c.clone()), false).rules.is_none(), "a change elsewhere");
        c.standard.clear();
        let none = compute.want(&Arc::new(c.clone()), false).rules.expect("this node's rules changed");
        assert_eq!(*none, render::render(&[], None));
    }

    /// Benchmark of the pure part of a pass at the scale of
    /// `e2e/benches/policy_sync.rs` (5,000 pods on 20 nodes, 1,000
    /// policies, 250 local pods): `cargo test -p weft-agent --release --bin
    /// weft-agent pass_phases -- --ignored --nocapture`. `WEFT_PASS_PODS`
    /// and `WEFT_PASS_NODES` set another shape: 50000 and 1000 are
    /// `e2e/bench.sh scale`'s largest point (50 local pods).
    /// `WEFT_PASS_COLD=1` evicts the CPU caches before each timed change.
    #[test]
    #[ignore = "benchmark; run explicitly"]
    fn pass_phases_at_bench_scale() {
        use crate::firewall::ruleset::diff;
        use crate::policy::incremental::Incremental;
        use crate::policy::model::{Compiler, PeerCache, compile};
        const NAMESPACES: usize = 50;
        let from_env =
            |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        let (pod_count, nodes) = (from_env("WEFT_PASS_PODS", 5000), from_env("WEFT_PASS_NODES", 20));
        let pod = |i: usize, app: usize| -> Pod {
            let j = i / NAMESPACES;
            let ip = format!("10.{}.{}.{}", 100 + i / 62_500, (i / 250) % 250, i % 250 + 1);
            serde_json::from_value(json!({
                "metadata": {"name": format!("p{i}"), "namespace": format!("b{}", i % NAMESPACES),
                    "uid": format!("u{i}"), "resourceVersion": "1",
                    "labels": {"app": format!("a{}", app), "tier": format!("t{}", j % 3)}},
                "spec": {"nodeName": format!("node-{}", i % nodes), "containers": [{"name": "c",
                    "ports": [{"name": "http", "containerPort": 8080}, {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
                "status": {"phase": "Running", "podIP": ip}
            }))
            .unwrap()
        };
        fn policy_with_port(k: usize, port: u16) -> StandardPolicy {
            let mut spec = json!({
                "podSelector": {"matchLabels": {"app": format!("a{}", (k / NAMESPACES) % 10)}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"tier": format!("t{}", k % 3)}}},
                    {"namespaceSelector": {"matchLabels": {"team": format!("t{}", k % 5)}},
                     "podSelector": {"matchLabels": {"app": format!("a{}", (k + 1) % 10)}}}],
                    "ports": [{"port": port}, {"port": "http"}]}]
            });
            if k.is_multiple_of(3) {
                spec["egress"] = json!([{"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.100.0.0/16"]}}]},
                                        {"ports": [{"protocol": "UDP", "port": "dns"}]}]);
                spec["policyTypes"] = json!(["Ingress", "Egress"]);
            }
            serde_json::from_value(json!({"metadata": {"name": format!("np{k}"), "namespace": format!("b{}", k % NAMESPACES)}, "spec": spec})).unwrap()
        }
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
        let pods: Vec<Pod> = (0..pod_count).map(|i| pod(i, (i / NAMESPACES) % 10)).collect();
        let mut snapshot = Pods::default();
        let t_snapshot = median(&mut |_| snapshot = pods.iter().filter_map(pod_info).map(Arc::new).collect());
        let mut cluster = Cluster {
            pods: snapshot,
            namespaces: (0..NAMESPACES)
                .map(|n| (format!("b{n}"), [("team".to_owned(), format!("t{}", n % 5))].into()))
                .collect(),
            standard: (0..1000).map(|k| Arc::new(policy_with_port(k, 80))).collect(),
            weft: Vec::new(),
            cluster_policies: Vec::new(),
            nodes: Vec::new(),
        };
        let mut compiled = Vec::new();
        let t_compile = median(&mut |_| compiled = compile(&cluster, "node-0"));
        let mut desired = render::render(&[], None);
        let t_render = median(&mut |_| desired = render::render(&compiled, None));

        // Label changes, each undone by the next run: of a pod on this
        // node, then of one elsewhere; the incremental compile and the
        // render that keeps the chains of the pass before.
        let (mut inc, mut renderer) = (Incremental::new("node-0"), render::Renderer::new(None));
        let mut last = inc.compile(&Arc::new(cluster.clone()));
        renderer.render(&last.pods);
        // Each change is undone by the next run: a label change of a pod on
        // this node, then of one elsewhere, then a policy's port.
        type Change = Box<dyn Fn(usize, &mut Cluster)>;
        let relabel = |node: &str, key: &'static str, value: &'static str| -> (String, Change) {
            let pod = cluster.pods.iter().find(|p| p.node == node).unwrap();
            let (ns, name, was) = (pod.namespace.clone(), pod.name.clone(), pod.labels[key].clone());
            let change: Change = Box::new(move |k, cluster| {
                let label = if k % 2 == 0 { value } else { was.as_str() };
                Arc::make_mut(cluster.pods.get_mut(&ns, &name).unwrap()).labels.insert(key.into(), label.into());
            });
            (format!("a label change on {node}"), change)
        };
        let repolicy: Change = Box::new(move |k, cluster| {
            let port = 80 + (k % 2) as u16;
            cluster.standard[0] = Arc::new(policy_with_port(0, port));
        });
        // With WEFT_PASS_COLD=1 the CPU caches are filled with other data
        // before each timed pass, as the apiserver and the rest of a node
        // leave them between two changes.
        let cold = std::env::var("WEFT_PASS_COLD").is_ok_and(|v| v == "1");
        let mut evictor = vec![0u8; 64 << 20];
        fn evict_caches(buf: &mut [u8]) {
            for i in (0..buf.len()).step_by(64) {
                buf[i] = buf[i].wrapping_add(1);
            }
            std::hint::black_box(&buf);
        }
        let mut changes = Vec::new();
        let (_, bounds_change) = relabel("node-0", "app", "a9");
        let (_, kernel_change) = relabel("node-0", "app", "a9");
        let kinds =
            [relabel("node-0", "app", "a9"), relabel("node-7", "tier", "t1"), ("a policy's port".to_owned(), repolicy)];
        for (what, change) in kinds {
            let (mut recompiled, mut renders, mut passes) = (0, Vec::new(), Vec::new());
            median(&mut |k| {
                change(k, &mut cluster);
                // The pass's snapshot (a copy, as the watch's is) is not timed.
                let snapshot = Arc::new(cluster.clone());
                if cold {
                    evict_caches(&mut evictor);
                }
                let t = Instant::now();
                last = inc.compile(&snapshot);
                recompiled = recompiled.max(last.recompiled);
                if last.changed {
                    let t = Instant::now();
                    renderer.render(&last.pods);
                    renders.push(t.elapsed().as_secs_f64() * 1e3);
                }
                passes.push(t.elapsed().as_secs_f64() * 1e3);
            });
            passes.sort_by(f64::total_cmp);
            let t_pass = passes[passes.len() / 2];
            renders.sort_by(f64::total_cmp);
            changes.push((what, recompiled, t_pass, renders.get(renders.len() / 2).copied()));
        }
        // The bounds after a label change on this node, on a copy as a
        // pass's snapshot is (the copy not timed).
        let mut bounds = Vec::new();
        let mut compute = Compute::new("node-0", None, render::DenyAction::default());
        compute.bounds(&mut cluster.clone(), true);
        median(&mut |k| {
            bounds_change(k, &mut cluster);
            let mut copy = cluster.clone();
            if cold {
                evict_caches(&mut evictor);
            }
            let t = Instant::now();
            std::hint::black_box(compute.bounds(&mut copy, false));
            bounds.push(t.elapsed().as_secs_f64() * 1e3);
        });
        bounds.sort_by(f64::total_cmp);
        let t_bounds = bounds[bounds.len() / 2];
        let t_copy = median(&mut |_| drop(std::hint::black_box(cluster.clone())));
        // Two parts of every incremental pass that read every policy.
        let t_index = median(&mut |_| {
            std::hint::black_box(Compiler::with_cache(&cluster, PeerCache::default()));
        });
        let t_reach = {
            let compiler = Compiler::with_cache(&cluster, PeerCache::default());
            let pod = cluster.pods.iter().find(|p| p.node == "node-7").unwrap().clone();
            let mut moved = (*pod).clone();
            moved.labels.insert("tier".into(), "t1".into());
            let labels = cluster.namespaces.get(&pod.namespace).unwrap();
            median(&mut |_| {
                std::hint::black_box(compiler.reach_of_rules_changed_by(Some((&pod, labels)), Some((&moved, labels))));
            })
        };
        let after = desired.clone();
        let t_diff = median(&mut |_| {
            let mut have = crate::firewall::ruleset::Observed::default();
            have.apply(&diff(&Default::default(), &desired.part));
            diff(&have, &after.part);
        });
        // The kernel's part of a label change on node-0 (as root, in a
        // network namespace of its own): the rules of both states, the
        // first written in full, then each change by an update.
        let states: Vec<Arc<render::Desired>> = (0..2)
            .map(|k| {
                kernel_change(k, &mut cluster);
                renderer.render(&inc.compile(&Arc::new(cluster.clone())).pods)
            })
            .collect();
        let kernel = crate::test_support::require_root().then(|| {
            crate::test_support::TestNetns::new().run(move || {
                let engine = Engine::new(Nft::default());
                apply(&engine, &states[0], true, None).expect("the first write");
                let (mut writes, mut diffs) = (Vec::new(), Vec::new());
                for k in 1..32 {
                    let (from, to) = (&states[(k + 1) % 2], &states[k % 2]);
                    let t = Instant::now();
                    let mut have = crate::firewall::ruleset::Observed::default();
                    have.apply(&diff(&Default::default(), &from.part));
                    let built = t.elapsed();
                    std::hint::black_box(diff(&have, &to.part));
                    diffs.push((t.elapsed() - built).as_secs_f64() * 1e3);
                    let t = Instant::now();
                    assert!(apply(&engine, to, false, None).expect("an update"), "the change is written");
                    writes.push(t.elapsed().as_secs_f64() * 1e3);
                }
                writes.sort_by(f64::total_cmp);
                diffs.sort_by(f64::total_cmp);
                (writes[writes.len() / 2], diffs[diffs.len() / 2])
            })
        });
        println!(
            "\nPolicy pass at bench scale ({} local pods under policy, {} rules), median ms of 31 runs\n",
            compiled.len(),
            desired.rule_count()
        );
        println!("| phase | ms |\n|---|---:|");
        println!("| pods read from the objects (once; the watch keeps them) | {t_snapshot:.2} |");
        println!("| compile everything (first pass, resync) | {t_compile:.2} |\n| render everything | {t_render:.2} |");
        for (what, recompiled, t_pass, t_render) in changes {
            let render = if t_render.is_some() { "+ render" } else { "(rules unchanged: no render)" };
            println!("| {what}: incremental compile {render}, {recompiled} pods recompiled | {t_pass:.2} |");
            if let Some(t_render) = t_render {
                println!("| … of which the render | {t_render:.2} |");
            }
        }
        println!("| diff from the last applied (incl. building it) | {t_diff:.2} |");
        println!("| the per-policy and per-node bounds | {t_bounds:.2} |");
        println!("| a copy of the cluster, as a pass's snapshot, and its drop | {t_copy:.2} |");
        println!(
            "| the policies indexed by namespace (a pass whose policies changed; others reuse it) | {t_index:.2} |"
        );
        println!("| the policies whose rules a changed pod affects (each changed pod) | {t_reach:.2} |");
        if let Some((write, diff)) = kernel {
            println!(
                "| the kernel: a label change on node-0 written (diff and one netlink transaction) | {write:.2} |"
            );
            println!("| … of which the diff | {diff:.2} |");
        }
    }
}
