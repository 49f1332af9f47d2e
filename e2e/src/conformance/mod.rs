//! Kubernetes' own end-to-end tests (`e2e.test`, built by
//! `e2e/scripts/build-tools.sh --e2e-test`) against the real-node cluster:
//! which upstream tests make up each suite, which are left out and why, and
//! the table of results. `weft-conformance` runs them; this module is the
//! pure part.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;
use regex::Regex;
use serde::Deserialize;

pub mod cnp;

/// When a documented skip applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Always,
    /// The cluster serves no DNS (no `kube-dns` Service in kube-system).
    NoClusterDns,
}

/// Upstream tests a suite selects but does not run, with the reason printed
/// in the table (docs/conformance.md has the evidence).
#[derive(Debug)]
pub struct Skip {
    pub pattern: &'static str,
    pub reason: &'static str,
    pub when: When,
}

#[derive(Debug)]
pub struct Suite {
    pub name: &'static str,
    pub about: &'static str,
    /// Alternatives matched against a test's full name (Go/RE2 syntax, as
    /// `--ginkgo.focus`).
    pub focus: &'static [&'static str],
    pub skips: &'static [Skip],
    /// Run when no suite is named (CI); the others are named to run.
    pub by_default: bool,
}

const NO_SCTP: Skip = Skip {
    pattern: r"\[Feature:SCTPConnectivity\]",
    reason: "the kernel has no SCTP module (sctp sockets: EPROTONOSUPPORT)",
    when: When::Always,
};

pub const SUITES: &[Suite] = &[
    Suite {
        name: "netpol",
        about: "every [Feature:NetworkPolicy] test (test/e2e/network/netpol)",
        focus: &[r"\[Feature:NetworkPolicy\]"],
        skips: &[NO_SCTP],
        by_default: true,
    },
    Suite {
        name: "network-conformance",
        about: "sig-network [Conformance] tests that exercise the pod network",
        focus: &[
            // Pod-to-pod and node-to-pod, HTTP and UDP, same and other node.
            r"\[sig-network\] Networking Granular Checks: Pods ",
            // Same hostPort, different hostIP or protocol.
            r"\[sig-network\] HostPort .*\[Conformance\]",
            // ClusterIP and NodePort Services reaching pods (kube-proxy).
            r"\[sig-network\] Services .*\[Conformance\]",
            r"\[sig-network\] DNS .*\[Conformance\]",
        ],
        skips: &[
            NO_SCTP,
            Skip {
                // Not "configurable pod DNS nameservers": kubelet's resolv.conf only.
                pattern: r"\[sig-network\] DNS should (provide|resolve) ",
                reason: "no cluster DNS deployed (no kube-dns Service); Weft does not ship one",
                when: When::NoClusterDns,
            },
            Skip {
                pattern: r"\[sig-network\] Services should be able to change the type from \w+ to ExternalName",
                reason: "the exec pod resolves the ExternalName through cluster DNS, and no cluster DNS is deployed",
                when: When::NoClusterDns,
            },
        ],
        by_default: true,
    },
    Suite {
        name: "sig-network",
        about: "every [sig-network] test, as Cilium's kind job runs them, less what this cluster cannot offer",
        focus: &[r"\[sig-network\]"],
        skips: &[
            NO_SCTP,
            Skip {
                pattern: r"\[Feature:NetworkPolicy\]",
                reason: "run by the netpol suite (the same tests)",
                when: When::Always,
            },
            Skip {
                pattern: r"LoadBalancer",
                reason: "no load-balancer provider: nothing gives a Service of type LoadBalancer an address here",
                when: When::Always,
            },
            Skip {
                pattern: r"\[Feature:IPv6DualStack\]|\[Feature:Networking-IPv6\]",
                reason: "the cluster is IPv4-only (dual-stack and IPv6-only clusters are separate runs, docs/conformance.md)",
                when: When::Always,
            },
            Skip {
                pattern: r"\[Feature:Networking-IPv4\]|\[Feature:Networking-DNS\]",
                reason: "reaches the Internet (8.8.8.8, google.com): the test machine has no route out",
                when: When::Always,
            },
            Skip {
                pattern: r"DNS configMap nameserver Forward PTR lookup",
                reason: "first resolves the PTR record of 8.8.8.8 through the cluster DNS's upstream (the Internet): the test machine has no route out",
                when: When::Always,
            },
            Skip {
                pattern: r"\[Provider:GCE\]",
                reason: "written for GCE clusters (their DNS names and metadata server)",
                when: When::Always,
            },
            Skip {
                pattern: r"\[Feature:OffByDefault\]",
                reason: "an alpha feature gate that is off in the cluster, as in a default Kubernetes",
                when: When::Always,
            },
            Skip {
                pattern: r"\[Disruptive\]",
                reason: "restarts or rewrites nodes over SSH (apiserver, kube-proxy, iptables) or moves kube-proxy between static pods and a DaemonSet; the nodes here have no SSH and kube-proxy is a node daemon",
                when: When::Always,
            },
            Skip {
                pattern: r"\[Feature:Networking-Performance\]",
                reason: "parses iperf 2.2's enhanced CSV (17 fields after a header line); Debian bookworm's iperf is 2.1.8 (9 fields). Weft's throughput is measured against peers by e2e/bench.sh",
                when: When::Always,
            },
            Skip {
                pattern: r"\[Feature:PerformanceDNS\]",
                reason: "a scale test of cluster DNS (the maximum number of Services), not of the pod network",
                when: When::Always,
            },
        ],
        by_default: false,
    },
];

pub fn suite(name: &str) -> Option<&'static Suite> {
    SUITES.iter().find(|s| s.name == name)
}

/// What the cluster offers that decides conditional skips.
#[derive(Debug, Clone, Copy)]
pub struct Environment {
    pub cluster_dns: bool,
}

impl Skip {
    fn applies(&self, env: Environment) -> bool {
        match self.when {
            When::Always => true,
            When::NoClusterDns => !env.cluster_dns,
        }
    }
}

/// One suite's tests, split into those to run and those skipped with a reason.
#[derive(Debug, Default)]
pub struct Plan {
    pub run: Vec<String>,
    pub skipped: Vec<(String, &'static str)>,
}

impl Suite {
    /// `--ginkgo.focus` for this suite.
    pub fn focus_regex(&self) -> String {
        self.focus.join("|")
    }

    /// `--ginkgo.skip` for this suite here, or `None` when nothing is skipped.
    pub fn skip_regex(&self, env: Environment) -> Option<String> {
        let active: Vec<&str> = self.skips.iter().filter(|s| s.applies(env)).map(|s| s.pattern).collect();
        (!active.is_empty()).then(|| active.join("|"))
    }

    /// Which of `all_tests` (full names, as `e2e.test --list-tests` prints
    /// them) the suite runs and which it skips, and why.
    pub fn plan(&self, all_tests: &[String], env: Environment) -> anyhow::Result<Plan> {
        let focus = Regex::new(&self.focus_regex()).context("suite focus")?;
        let skips: Vec<(Regex, &'static str)> = self
            .skips
            .iter()
            .filter(|s| s.applies(env))
            .map(|s| Ok((Regex::new(s.pattern).context("suite skip")?, s.reason)))
            .collect::<anyhow::Result<_>>()?;
        let mut plan = Plan::default();
        for name in all_tests.iter().filter(|n| focus.is_match(n)) {
            match skips.iter().find(|(re, _)| re.is_match(name)) {
                Some((_, reason)) => plan.skipped.push((name.clone(), reason)),
                None => plan.run.push(name.clone()),
            }
        }
        Ok(plan)
    }
}

/// The test names in `e2e.test --list-tests` output
/// (`    k8s.io/kubernetes@v1.35.4/test/e2e/…/file.go:123: [sig-…] name`).
pub fn parse_test_list(output: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let (location, name) = l.split_once(": ")?;
            location.contains(".go:").then(|| name.to_owned())
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Ginkgo's JSON report (`--ginkgo.json-report`)

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Report {
    #[serde(default)]
    spec_reports: Option<Vec<SpecReport>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SpecReport {
    /// `null` for suite-level nodes.
    #[serde(default)]
    container_hierarchy_texts: Option<Vec<String>>,
    #[serde(default)]
    leaf_node_text: String,
    #[serde(default)]
    leaf_node_type: String,
    #[serde(default)]
    state: String,
    /// Nanoseconds.
    #[serde(default)]
    run_time: u64,
    #[serde(default)]
    failure: Option<Failure>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Failure {
    #[serde(default)]
    message: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Failed(String),
    /// Skipped by the test itself at run time (its own message).
    SkippedAtRun(String),
}

/// Each test that ran (or was skipped by itself), by full name.
pub fn parse_report(json: &str) -> anyhow::Result<BTreeMap<String, (Outcome, Duration)>> {
    let reports: Vec<Report> = serde_json::from_str(json).context("ginkgo JSON report")?;
    let mut out = BTreeMap::new();
    for spec in reports.into_iter().flat_map(|r| r.spec_reports.unwrap_or_default()) {
        if spec.leaf_node_type != "It" {
            continue;
        }
        let mut name = spec.container_hierarchy_texts.unwrap_or_default().join(" ");
        if !name.is_empty() {
            name.push(' ');
        }
        // Some names end in a space; `--list-tests` lines are trimmed.
        name.push_str(spec.leaf_node_text.trim_end());
        let message = spec.failure.map(|f| first_line(&f.message)).unwrap_or_default();
        let outcome = match spec.state.as_str() {
            "passed" => Outcome::Passed,
            // Filtered out by focus/skip: not ours to report.
            "skipped" if message.is_empty() => continue,
            "skipped" => Outcome::SkippedAtRun(message),
            "pending" => continue,
            other => Outcome::Failed(if message.is_empty() { other.to_owned() } else { message }),
        };
        out.insert(name, (outcome, Duration::from_nanos(spec.run_time)));
    }
    Ok(out)
}

fn first_line(s: &str) -> String {
    let line = s.trim().lines().next().unwrap_or_default();
    let mut l: String = line.chars().take(200).collect();
    if line.chars().count() > 200 {
        l.push('…');
    }
    l
}

/// One suite's result.
#[derive(Debug)]
pub struct SuiteResult {
    pub suite: &'static str,
    pub passed: usize,
    pub failed: Vec<(String, String)>,
    /// Skipped by us (documented) or by the test itself, with the reason.
    pub skipped: Vec<(String, String)>,
    /// Counted in `passed`, but some of their checks could not be made here
    /// (which and why).
    pub partial: Vec<(String, String)>,
    pub wall: Duration,
}

impl SuiteResult {
    /// Every planned test must appear in the report: one that does not (the
    /// run crashed or timed out) counts as failed.
    pub fn new(
        suite: &'static str,
        plan: &Plan,
        report: &BTreeMap<String, (Outcome, Duration)>,
        wall: Duration,
    ) -> SuiteResult {
        let mut r =
            SuiteResult { suite, passed: 0, failed: Vec::new(), skipped: Vec::new(), partial: Vec::new(), wall };
        for (name, reason) in &plan.skipped {
            r.skipped.push((name.clone(), (*reason).to_owned()));
        }
        for name in &plan.run {
            match report.get(name) {
                Some((Outcome::Passed, _)) => r.passed += 1,
                Some((Outcome::Failed(m), _)) => r.failed.push((name.clone(), m.clone())),
                Some((Outcome::SkippedAtRun(m), _)) => {
                    r.skipped.push((name.clone(), format!("skipped by the test: {m}")))
                }
                None => r.failed.push((name.clone(), "not run (no result in the report)".into())),
            }
        }
        r
    }

    pub fn ok(&self) -> bool {
        self.failed.is_empty()
    }
}

/// The table, then each failure, each test that passed with checks left
/// out, and each skip, with the reason.
pub fn render(results: &[SuiteResult]) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "{:<22} {:>7} {:>7} {:>8} {:>10}", "suite", "passed", "failed", "skipped", "wall");
    for r in results {
        let _ = writeln!(
            t,
            "{:<22} {:>7} {:>7} {:>8} {:>9.0}s",
            r.suite,
            r.passed,
            r.failed.len(),
            r.skipped.len(),
            r.wall.as_secs_f64()
        );
    }
    for r in results {
        for (name, why) in &r.failed {
            let _ = writeln!(t, "FAILED  [{}] {name}\n        {why}", r.suite);
        }
    }
    for r in results {
        for (name, why) in &r.partial {
            let _ = writeln!(t, "PARTLY  [{}] {name}\n        {why}", r.suite);
        }
    }
    for r in results {
        for (name, why) in &r.skipped {
            let _ = writeln!(t, "SKIPPED [{}] {name}\n        {why}", r.suite);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str = "
    k8s.io/kubernetes@v1.35.4/test/e2e/network/netpol/network_policy.go:567: [sig-network] Netpol NetworkPolicy between server and client should allow egress access on one named port [Feature:NetworkPolicy]
    k8s.io/kubernetes@v1.35.4/test/e2e/network/netpol/network_policy.go:1352: [sig-network] Netpol [Feature:SCTPConnectivity] [LinuxOnly] NetworkPolicy between server and client using SCTP should enforce policy based on Ports [Feature:NetworkPolicy]
    k8s.io/kubernetes@v1.35.4/test/e2e/common/network/networking.go:85: [sig-network] Networking Granular Checks: Pods should function for intra-pod communication: http [NodeConformance] [Conformance]
    k8s.io/kubernetes@v1.35.4/test/e2e/common/network/networking.go:150: [sig-network] Networking Granular Checks: Pods should function for intra-pod communication: sctp [LinuxOnly] [Feature:SCTPConnectivity]
    k8s.io/kubernetes@v1.35.4/test/e2e/network/dns.go:54: [sig-network] DNS should provide DNS for the cluster [Conformance]
    k8s.io/kubernetes@v1.35.4/test/e2e/network/service.go:732: [sig-network] Services should serve a basic endpoint from pods [Conformance]
    k8s.io/kubernetes@v1.35.4/test/e2e/network/service.go:999: [sig-network] Services should be rejected when no endpoints exist
    k8s.io/kubernetes@v1.35.4/test/e2e/network/service.go:1499: [sig-network] Services should be able to change the type from ClusterIP to ExternalName [Conformance]
    k8s.io/kubernetes@v1.35.4/test/e2e/apps/job.go:1: [sig-apps] Job should run a job to completion [Conformance]
";

    fn names() -> Vec<String> {
        parse_test_list(LIST)
    }

    #[test]
    fn suites_select_their_tests_and_name_every_skip() {
        let all = names();
        assert_eq!(all.len(), 9);
        let env = Environment { cluster_dns: false };
        let netpol = suite("netpol").unwrap().plan(&all, env).unwrap();
        assert_eq!(netpol.run.len(), 1);
        assert!(netpol.run[0].contains("named port"));
        assert_eq!(netpol.skipped.len(), 1);
        assert!(netpol.skipped[0].1.contains("SCTP"));

        let conf = suite("network-conformance").unwrap().plan(&all, env).unwrap();
        assert_eq!(conf.run.len(), 2, "{:?}", conf.run);
        assert!(conf.run.iter().all(|n| n.contains("[Conformance]")));
        let reasons: Vec<&str> = conf.skipped.iter().map(|(_, r)| *r).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("no cluster DNS")));
        assert!(conf.skipped.iter().any(|(n, _)| n.contains("to ExternalName")));

        // With DNS deployed the DNS tests run.
        let conf = suite("network-conformance").unwrap().plan(&all, Environment { cluster_dns: true }).unwrap();
        assert_eq!(conf.run.len(), 4);
        assert_eq!(
            suite("network-conformance").unwrap().skip_regex(Environment { cluster_dns: true }).as_deref(),
            Some(NO_SCTP.pattern)
        );

        // sig-network: everything of the SIG but what another suite runs or
        // the cluster cannot offer, each skip with its reason.
        let sig = suite("sig-network").unwrap().plan(&all, Environment { cluster_dns: true }).unwrap();
        assert_eq!(sig.run.len(), 5, "{:?}", sig.run);
        assert!(sig.run.iter().any(|n| n.contains("rejected when no endpoints")));
        assert!(!sig.run.iter().chain(sig.skipped.iter().map(|(n, _)| n)).any(|n| n.contains("[sig-apps]")));
        assert_eq!(sig.skipped.len(), 3, "{:?}", sig.skipped);
        assert!(sig.skipped.iter().any(|(n, r)| n.contains("named port") && r.contains("netpol suite")));
        // Only the default suites run when none is named (CI).
        let default: Vec<&str> = SUITES.iter().filter(|s| s.by_default).map(|s| s.name).collect();
        assert_eq!(default, ["netpol", "network-conformance"]);
    }

    #[test]
    fn every_suite_pattern_compiles_and_the_focus_matches_ginkgo_text() {
        for s in SUITES {
            Regex::new(&s.focus_regex()).unwrap();
            for k in s.skips {
                Regex::new(k.pattern).unwrap();
            }
        }
    }

    const REPORT: &str = r#"[{"SuiteDescription":"Kubernetes e2e suite","SpecReports":[
      {"ContainerHierarchyTexts":null,"LeafNodeType":"SynchronizedBeforeSuite","State":"passed","RunTime":5},
      {"ContainerHierarchyTexts":["[sig-network] Services"],"LeafNodeText":"should serve a basic endpoint from pods [Conformance]","LeafNodeType":"It","State":"passed","RunTime":2000000000},
      {"ContainerHierarchyTexts":["[sig-network] Networking","Granular Checks: Pods"],"LeafNodeText":"should function for intra-pod communication: http [NodeConformance] [Conformance]","LeafNodeType":"It","State":"failed","RunTime":1,"Failure":{"Message":"timed out\nmore"}},
      {"ContainerHierarchyTexts":["[sig-apps] Job"],"LeafNodeText":"should run a job to completion [Conformance]","LeafNodeType":"It","State":"skipped","RunTime":0}
    ]}]"#;

    #[test]
    fn a_name_ending_in_a_space_matches_its_listing() {
        let listed = parse_test_list(
            "    k8s.io/kubernetes@v1.35.4/test/e2e/network/service.go:1: [sig-network] Services should be updated after adding or deleting ports \n",
        );
        let report = parse_report(
            r#"[{"SpecReports":[{"ContainerHierarchyTexts":["[sig-network] Services"],"LeafNodeText":"should be updated after adding or deleting ports ","LeafNodeType":"It","State":"passed","RunTime":1}]}]"#,
        )
        .unwrap();
        assert_eq!(report.keys().collect::<Vec<_>>(), listed.iter().collect::<Vec<_>>());
    }

    #[test]
    fn results_count_every_planned_test_and_a_missing_result_fails() {
        let report = parse_report(REPORT).unwrap();
        assert_eq!(report.len(), 2, "filtered-out specs are not results: {report:?}");
        let env = Environment { cluster_dns: false };
        let mut plan = suite("network-conformance").unwrap().plan(&names(), env).unwrap();
        plan.run.push("[sig-network] Services something that never reported".into());
        let r = SuiteResult::new("network-conformance", &plan, &report, Duration::from_secs(90));
        assert_eq!(r.passed, 1);
        assert_eq!(r.failed.len(), 2);
        assert_eq!(r.failed[0].1, "timed out");
        assert!(r.failed[1].1.contains("not run"));
        assert!(!r.ok());
        let table = render(&[r]);
        assert!(table.contains("network-conformance          1       2        3        90s"), "{table}");
        assert!(table.contains("SKIPPED [network-conformance] [sig-network] DNS should provide DNS for the cluster"));
    }
}
