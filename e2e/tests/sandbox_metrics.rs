//! Metrics of the real daemons in the sandbox cluster: the operator's and
//! every agent's exposition passes `promtool check metrics` and documents
//! every family in docs/metrics.md, and a real Prometheus (the Debian
//! package) in the control plane's namespace scrapes them all and sees the
//! CNI counters move as pods are created.
//!
//! The sandbox has fixed names: the tests of this file take turns, and cargo
//! runs test binaries one after another, so this file never overlaps
//! `sandbox_overlay.rs`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use weft_e2e::sandbox::testing::{Up, ok};
use weft_e2e::sandbox::{CP_IP, CP_NS, State};
use weft_e2e::supervisor::StateFile;
use weft_e2e::{bins, wait};

const OPERATOR_METRICS: &str = "10.250.0.1:9090";
const AGENT_PORT: u16 = 9646;
const PROMETHEUS_PORT: u16 = 9091;

/// curl inside the control plane's namespace; `None` unless HTTP 2xx.
fn curl_in_cp(args: &[&str]) -> Option<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", CP_NS, "curl", "-sf", "-m", "5"])
        .args(args)
        .output()
        .expect("ip netns exec curl");
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `promtool check metrics` on an exposition; returns its complaints.
fn promtool_check(exposition: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    child.stdin.take().expect("stdin").write_all(exposition.as_bytes()).expect("feeding promtool");
    let out = child.wait_with_output().expect("promtool output");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() && text.trim().is_empty() { Ok(()) } else { Err(text) }
}

/// Execs weft-cni as a runtime would, inside the node's namespace: `CHECK`
/// of an attachment the agent does not know. Returns the CNI error code.
fn cni_check_unknown(node: &weft_e2e::sandbox::NodeInfo) -> u64 {
    use std::io::Write;
    let conf = serde_json::json!({
        "cniVersion": "1.1.0", "name": "weft", "type": "weft-cni",
        "agentSocket": node.socket, "prevResult": {"cniVersion": "1.1.0"}
    });
    let mut child = Command::new("ip")
        .args(["netns", "exec", &node.netns])
        .arg(bins::weft("weft-cni"))
        .env("CNI_COMMAND", "CHECK")
        .env("CNI_CONTAINERID", "no-such-container")
        .env("CNI_NETNS", "/run/netns/weft-sbx-pod-default-a")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", bins::weft("weft-cni").parent().expect("bin dir"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("weft-cni");
    child.stdin.take().expect("stdin").write_all(conf.to_string().as_bytes()).expect("stdin");
    let out = child.wait_with_output().expect("weft-cni output");
    assert!(!out.status.success(), "CHECK of an unknown attachment succeeded");
    let err: Value = serde_json::from_slice(&out.stdout).expect("CNI error JSON");
    err["code"].as_u64().unwrap_or_else(|| panic!("no code in {err}"))
}

/// Family names of a classic-text exposition (`# TYPE <name> <type>`).
fn families(exposition: &str) -> Vec<String> {
    exposition.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_whitespace().next()).map(str::to_owned).collect()
}

/// A Prometheus server in the control plane's namespace; killed on drop.
struct Prometheus {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(agents: &[String]) -> Prometheus {
        let dir = tempfile::tempdir().expect("prometheus dir");
        let targets = |t: &[String]| t.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(", ");
        // The chart's alerts, evaluated against what the daemons expose.
        let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/weft/rules/alerts.yaml");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files: ['{}']\n\
             scrape_configs:\n\
             - job_name: weft-operator\n  static_configs:\n  - targets: [{}]\n\
             - job_name: weft-agent\n  static_configs:\n  - targets: [{}]\n",
            rules.display(),
            targets(&[OPERATOR_METRICS.to_owned()]),
            targets(agents)
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("writing prometheus.yml");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new("ip")
            .args(["netns", "exec", CP_NS, "/usr/bin/prometheus"])
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={CP_IP}:{PROMETHEUS_PORT}"))
            .arg("--log.level=warn")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("starting prometheus");
        let p = Prometheus { child, _dir: dir };
        wait::until("prometheus to be ready", Duration::from_secs(60), || {
            curl_in_cp(&[&format!("http://{CP_IP}:{PROMETHEUS_PORT}/-/ready")])
        });
        p
    }

    /// An instant query; the result vector.
    fn query(&self, promql: &str) -> Vec<Value> {
        let body = curl_in_cp(&[
            &format!("http://{CP_IP}:{PROMETHEUS_PORT}/api/v1/query"),
            "--data-urlencode",
            &format!("query={promql}"),
        ])
        .unwrap_or_else(|| panic!("query {promql} failed"));
        let v: Value = serde_json::from_str(&body).expect("query JSON");
        assert_eq!(v["status"], "success", "{body}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The single value of a scalar-like query, 0 when it has no result.
    fn value(&self, promql: &str) -> f64 {
        self.query(promql).first().and_then(|r| r["value"][1].as_str()?.parse().ok()).unwrap_or(0.0)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // `ip netns exec` execs the program: this is prometheus itself.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn metrics_pass_promtool_are_documented_and_prometheus_sees_them_change() {
    let file = |p: &str| Path::new(p).is_file();
    let extra = [
        ("promtool (Debian package prometheus)", file("/usr/bin/promtool")),
        ("prometheus (Debian package prometheus)", file("/usr/bin/prometheus")),
        ("curl", file("/usr/bin/curl")),
    ];
    let Some(_up) = Up::start(&["--nodes", "2"], &extra) else { return };
    let state = State::load().expect("sandbox state");
    let agents: Vec<String> = state.nodes.iter().map(|n| format!("{}:{AGENT_PORT}", n.ip)).collect();
    // A pod per node so that every agent's CNI families have samples.
    ok(&["add-pod", "a", "--node", "node-1"]);
    ok(&["add-pod", "z", "--node", "node-2"]);
    // And one failed request, so that the error family has a sample too.
    let code = cni_check_unknown(state.node("node-1").expect("node-1"));
    assert_eq!(code, 3, "CHECK of an unknown attachment");

    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"))
        .expect("docs/metrics.md");
    let mut endpoints = vec![("weft-operator", OPERATOR_METRICS.to_owned(), "weft_operator_")];
    endpoints.extend(agents.iter().map(|a| ("weft-agent", a.clone(), "weft_agent_")));
    for (daemon, addr, prefix) in &endpoints {
        let url = format!("http://{addr}/metrics");
        // Agents expose their families once they hold their lease.
        let text = wait::until(&format!("{daemon} metrics at {addr}"), Duration::from_secs(60), || {
            curl_in_cp(&[&url]).filter(|t| t.contains(&format!("# TYPE {prefix}")))
        });
        if let Err(complaints) = promtool_check(&text) {
            panic!("promtool check metrics on {daemon} ({addr}) complains:\n{complaints}\n--- exposition ---\n{text}");
        }
        let names = families(&text);
        assert!(names.len() >= 4, "{daemon}: {names:?}");
        for name in &names {
            assert!(name.starts_with(prefix), "{daemon}: {name} lacks the {prefix} prefix");
            assert!(docs.contains(&format!("`{name}`")), "{daemon}: {name} is not documented in docs/metrics.md");
        }
        // Prometheus itself gets OpenMetrics.
        let om = curl_in_cp(&["-H", "Accept: application/openmetrics-text; version=1.0.0", &url]).expect("openmetrics");
        assert!(om.trim_end().ends_with("# EOF"), "{daemon}: OpenMetrics exposition without # EOF");
    }

    let prom = Prometheus::start(&agents);
    wait::until("every target to be up", Duration::from_secs(60), || {
        let up = prom.query("up");
        (up.len() == endpoints.len() && up.iter().all(|r| r["value"][1] == "1")).then_some(())
    });
    for series in [
        "weft_operator_subnet_leases",
        "weft_operator_reconcile_total",
        "weft_operator_reconcile_duration_seconds_bucket",
        "weft_operator_leader",
        "weft_agent_cni_requests_total",
        "weft_agent_cni_request_duration_seconds_bucket",
        "weft_agent_ipam_addresses",
    ] {
        wait::until(&format!("prometheus to have {series}"), Duration::from_secs(30), || {
            (!prom.query(series).is_empty()).then_some(())
        });
    }
    assert_eq!(prom.value("sum(weft_operator_leader)"), 1.0, "exactly one leader");
    assert_eq!(prom.value(r#"weft_operator_subnet_leases{state="allocated"}"#), 2.0, "one lease per node");

    // Pods created now show up in the counters and gauges Prometheus scrapes.
    let adds = r#"sum(weft_agent_cni_requests_total{verb="ADD",result="success"})"#;
    let allocated = r#"sum(weft_agent_ipam_addresses{state="allocated"})"#;
    let before = wait::until("the first ADD to be scraped", Duration::from_secs(30), || {
        let v = prom.value(adds);
        (v >= 1.0).then_some(v)
    });
    let allocated_before = prom.value(allocated);
    ok(&["add-pod", "b", "--node", "node-2"]);
    ok(&["add-pod", "c", "--node", "node-1"]);
    wait::until("prometheus to see two more ADDs", Duration::from_secs(30), || {
        (prom.value(adds) >= before + 2.0).then_some(())
    });
    wait::until("prometheus to see two more allocated addresses", Duration::from_secs(30), || {
        (prom.value(allocated) >= allocated_before + 2.0).then_some(())
    });
    // Every query of the chart's Grafana dashboard is valid PromQL and finds
    // data in a live cluster (Grafana's variables substituted).
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/weft/dashboards/weft.json"))
            .expect("dashboard"),
    )
    .expect("dashboard JSON");
    let mut with_data = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr =
                target["expr"].as_str().expect("expr").replace("$__rate_interval", "1m").replace("$instance", ".*");
            if !prom.query(&expr).is_empty() {
                with_data += 1;
            }
        }
    }
    assert!(with_data >= 8, "only {with_data} dashboard queries return data");
    wait::until("prometheus to have the CHECK error", Duration::from_secs(30), || {
        (!prom.query(r#"weft_agent_cni_errors_total{verb="CHECK",code="3"}"#).is_empty()).then_some(())
    });
    let per_node = prom.query(r#"weft_agent_cni_requests_total{verb="ADD",result="success"}"#);
    assert_eq!(per_node.len(), 2, "both agents served an ADD: {per_node:?}");
    ok(&["del-pod", "c"]);
    wait::until("prometheus to see the DEL", Duration::from_secs(30), || {
        (prom.value(r#"sum(weft_agent_cni_requests_total{verb="DEL"})"#) >= 1.0).then_some(())
    });

    // The chart's alerts: every rule evaluates without error on these
    // series, and none is pending or firing on this healthy sandbox.
    let rules = wait::until("every alert rule to be evaluated", Duration::from_secs(30), || {
        let body = curl_in_cp(&[&format!("http://{CP_IP}:{PROMETHEUS_PORT}/api/v1/rules")])?;
        let v: Value = serde_json::from_str(&body).ok()?;
        let rules: Vec<Value> = v["data"]["groups"]
            .as_array()?
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        (!rules.is_empty() && rules.iter().all(|r| r["lastEvaluation"] != "0001-01-01T00:00:00Z")).then_some(rules)
    });
    for r in &rules {
        assert_eq!(r["health"], "ok", "alert {} does not evaluate: {}", r["name"], r["lastError"]);
    }
    assert!(prom.query("ALERTS").is_empty(), "alerts on a healthy sandbox: {:?}", prom.query("ALERTS"));
}
