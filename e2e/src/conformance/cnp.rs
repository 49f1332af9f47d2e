//! SIG Network's ClusterNetworkPolicy conformance suite
//! (`sigs.k8s.io/network-policy-api` `conformance/`, built by
//! `e2e/scripts/build-tools.sh --e2e-test` as `cnp-conformance.test` with
//! `e2e/scripts/cnp-conformance.patch`): how it is run, and its `go test -v`
//! output read into the same table as the upstream e2e.test suites.
//!
//! Its tests are Go subtests made at run time (`-test.list` names only
//! `TestConformanceProfiles`), so the table lists what the run reported:
//! each leaf subtest, under its conformance test's short name.

use std::collections::BTreeMap;
use std::time::Duration;

use super::SuiteResult;

pub const NAME: &str = "cnp";
pub const ABOUT: &str = "every ClusterNetworkPolicy conformance test of network-policy-api, all features on";
/// The Go test that runs the conformance profiles (each profile's tests are its subtests).
pub const TEST: &str = "TestConformanceProfiles";
/// What the patched suite logs for each SCTP probe it does not make.
const SCTP_NOT_PROBED: &str = "SCTP probe not made";
/// The environment variable that turns those probes off (cnp-conformance.patch).
pub const NO_SCTP_ENV: &str = "CONFORMANCE_NO_SCTP";
pub const NO_SCTP_REASON: &str = "the kernel has no SCTP module (sctp sockets: EPROTONOSUPPORT)";
/// The test images' repository the suite's manifests name.
pub const AGNHOST_REPO: &str = "registry.k8s.io/e2e-test-images/agnhost:";

/// The arguments the suite takes after the Go test flags.
pub fn suite_args(report: &std::path::Path, version: &str) -> Vec<String> {
    vec![
        "--conformance-profiles=ClusterNetworkPolicy".into(),
        "--all-features".into(),
        "--organization=weft".into(),
        "--project=weft".into(),
        "--url=https://weft.dev".into(),
        format!("--version={version}"),
        "--contact=weft maintainers".into(),
        "--additional-info=e2e/conformance.sh cnp on the real-node cluster (docs/conformance.md)".into(),
        format!("--report-output={}", report.display()),
    ]
}

/// How one Go test or subtest ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    Pass,
    Fail,
    Skip,
}

/// One test's result line and the lines it logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoTest {
    pub ending: Ending,
    pub elapsed: Duration,
    pub log: Vec<String>,
}

/// Every test and subtest `go test -v` reported, by full name
/// (`TestConformanceProfiles/CNPAdminTierGress/Should_…`). A log line belongs
/// to the test the latest `=== RUN|NAME|CONT|PAUSE` header named.
pub fn parse_go_test_output(out: &str) -> BTreeMap<String, GoTest> {
    let mut logs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut endings: Vec<(String, Ending, Duration)> = Vec::new();
    let mut current: Option<String> = None;
    for line in out.lines() {
        let trimmed = line.trim_start();
        if let Some(rest) =
            ["=== RUN", "=== NAME", "=== CONT", "=== PAUSE"].iter().find_map(|h| trimmed.strip_prefix(h))
        {
            current = Some(rest.trim().to_owned());
            continue;
        }
        if let Some((ending, rest)) =
            [("--- PASS:", Ending::Pass), ("--- FAIL:", Ending::Fail), ("--- SKIP:", Ending::Skip)]
                .into_iter()
                .find_map(|(h, e)| trimmed.strip_prefix(h).map(|r| (e, r)))
        {
            // `--- PASS: name (1.23s)`
            let rest = rest.trim();
            let (name, secs) = match rest.rsplit_once(" (") {
                Some((n, s)) => (n, s.trim_end_matches("s)").parse::<f64>().unwrap_or(0.0)),
                None => (rest, 0.0),
            };
            endings.push((name.to_owned(), ending, Duration::from_secs_f64(secs.max(0.0))));
            // What follows an ending without a header (a skip's or failure's
            // message) is that test's.
            current = Some(name.to_owned());
            continue;
        }
        if matches!(trimmed, "PASS" | "FAIL") || trimmed.starts_with("ok ") || trimmed.is_empty() {
            continue;
        }
        if let Some(name) = &current {
            logs.entry(name.clone()).or_default().push(trimmed.to_owned());
        }
    }
    endings
        .into_iter()
        .map(|(name, ending, elapsed)| {
            let log = logs.remove(&name).unwrap_or_default();
            (name, GoTest { ending, elapsed, log })
        })
        .collect()
}

/// The tests without subtests of their own, which are the suite's checks.
fn leaves(tests: &BTreeMap<String, GoTest>) -> impl Iterator<Item = (&String, &GoTest)> {
    tests.iter().filter(|(name, _)| {
        let prefix = format!("{name}/");
        !tests.range(prefix.clone()..).next().is_some_and(|(n, _)| n.starts_with(&prefix))
    })
}

/// A test's name as the table shows it: without `TestConformanceProfiles/`,
/// Go's underscores back to spaces.
fn display(name: &str) -> String {
    name.strip_prefix(&format!("{TEST}/")).unwrap_or(name).replace('_', " ")
}

/// Why a failed test failed: the suite's first "Expected …" line, else the
/// assertion's "Error:" line, with where the test asserted it.
fn failure(log: &[String]) -> String {
    let expected = log.iter().find(|l| l.contains("Expected ")).map(|l| strip_location(l));
    let error = log.iter().find_map(|l| l.strip_prefix("Error:").map(str::trim)).map(str::to_owned);
    let at = log
        .iter()
        .skip_while(|l| !l.starts_with("Error Trace:"))
        .find(|l| l.contains("/tests/"))
        .and_then(|l| l.rsplit('/').next())
        .map(str::to_owned);
    let mut why = expected.or(error).unwrap_or_else(|| "failed (no message)".into());
    if let Some(at) = at {
        why.push_str(&format!(" ({at})"));
    }
    why
}

/// `helper.go:71: message` → `message`.
fn strip_location(line: &str) -> String {
    match line.split_once(": ") {
        Some((loc, msg)) if loc.ends_with(|c: char| c.is_ascii_digit()) && loc.contains(".go:") => msg.to_owned(),
        _ => line.to_owned(),
    }
}

/// The suite's result. A leaf whose SCTP probes were not made is skipped if it
/// tests SCTP alone (its name says SCTP), else it counts by its other probes
/// and is listed in `partial`. A run that reported no leaf (its set-up
/// failed, or the binary crashed) fails as a whole.
pub fn result(tests: &BTreeMap<String, GoTest>, exited_ok: bool, wall: Duration) -> SuiteResult {
    let mut r =
        SuiteResult { suite: NAME, passed: 0, failed: Vec::new(), skipped: Vec::new(), partial: Vec::new(), wall };
    let mut any = false;
    for (name, t) in leaves(tests).filter(|(n, _)| n.starts_with(&format!("{TEST}/"))) {
        any = true;
        let unprobed = t.log.iter().filter(|l| l.contains(SCTP_NOT_PROBED)).count();
        let shown = display(name);
        match t.ending {
            Ending::Fail => r.failed.push((shown, failure(&t.log))),
            Ending::Skip => {
                let why = t.log.first().map(|l| strip_location(l)).unwrap_or_default();
                r.skipped.push((shown, format!("skipped by the test: {why}")));
            }
            Ending::Pass if unprobed > 0 && name.contains("SCTP") => {
                r.skipped.push((shown, format!("{NO_SCTP_REASON}: its {unprobed} SCTP probes were not made")))
            }
            Ending::Pass if unprobed > 0 => {
                r.passed += 1;
                r.partial.push((
                    shown,
                    format!(
                        "passed its TCP and UDP probes; its {unprobed} SCTP probes were not made ({NO_SCTP_REASON})"
                    ),
                ));
            }
            Ending::Pass => r.passed += 1,
        }
    }
    if !any || (!exited_ok && r.failed.is_empty()) {
        let why = tests
            .get(TEST)
            .map(|t| failure(&t.log))
            .unwrap_or_else(|| "the run reported no result (crashed or timed out)".into());
        r.failed.push((TEST.to_owned(), why));
    }
    r
}

/// The distinct agnhost images (`registry.k8s.io/e2e-test-images/agnhost:2.45`)
/// the suite's embedded manifests name, read from the test binary itself.
pub fn agnhost_images(binary: &[u8]) -> Vec<String> {
    let repo = AGNHOST_REPO.as_bytes();
    let mut found: Vec<String> = binary
        .windows(repo.len())
        .enumerate()
        .filter(|(_, w)| *w == repo)
        .filter_map(|(i, _)| {
            let tag: String = binary[i + repo.len()..]
                .iter()
                .take(32)
                .take_while(|b| b.is_ascii_alphanumeric() || **b == b'.' || **b == b'-' || **b == b'_')
                .map(|b| *b as char)
                .collect();
            (!tag.is_empty()).then(|| format!("{AGNHOST_REPO}{tag}"))
        })
        .collect();
    found.sort();
    found.dedup();
    found
}

/// Whether this kernel can open SCTP sockets (pods share its protocols).
pub fn kernel_has_sctp() -> bool {
    // SAFETY: socket(2) with constant arguments; the descriptor is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, libc::IPPROTO_SCTP) };
    if fd < 0 {
        return false;
    }
    // SAFETY: fd is a descriptor this function opened.
    unsafe { libc::close(fd) };
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "=== RUN   TestConformanceProfiles
    conformance_profile_test.go:80: Running conformance tests
=== RUN   TestConformanceProfiles/CNPAdminTierEgressNodePeers
=== RUN   TestConformanceProfiles/CNPAdminTierEgressNodePeers/Should_support_an_'allow-egress'_rule_policy_for_egress-node-peer
=== RUN   TestConformanceProfiles/CNPAdminTierEgressNodePeers/Should_support_a_'deny-egress'_rule_policy_for_egress-node-peer
    helper.go:71: FAILED Command was [/agnhost connect --timeout=3s --protocol=tcp 10.251.0.12:34346]
    helper.go:71: Expected connection to fail from ns/harry-potter-1 to 10.251.0.12, but instead it successfully connected.
    helper.go:70: 
        \tError Trace:\tsigs.k8s.io/network-policy-api/conformance/utils/kubernetes/helper.go:70
        \t            \t\t\t\tsigs.k8s.io/network-policy-api/conformance/tests/admin-network-policy-experimental-egress-rules.go:102
        \tError:      \tCondition never satisfied
=== NAME  TestConformanceProfiles/CNPAdminTierEgressNodePeers
    apply.go:154: Deleting node-and-cidr-as-peers-example ClusterNetworkPolicy
=== RUN   TestConformanceProfiles/CNPAdminTierGress
=== RUN   TestConformanceProfiles/CNPAdminTierGress/Should_support_an_'allow-gress'_policy_across_different_protocols
    helper.go:70: SCTP probe not made (CONFORMANCE_NO_SCTP): a/b to 10.0.0.1:9003
    helper.go:70: SCTP probe not made (CONFORMANCE_NO_SCTP): a/b to 10.0.0.1:9003
=== RUN   TestConformanceProfiles/CNPAdminTierEgressSCTP
=== RUN   TestConformanceProfiles/CNPAdminTierEgressSCTP/Should_support_an_'allow-egress'_policy_for_SCTP_protocol
    helper.go:70: SCTP probe not made (CONFORMANCE_NO_SCTP): a/b to 10.0.0.1:9003
=== RUN   TestConformanceProfiles/CNPAdminTierFuture
=== RUN   TestConformanceProfiles/CNPAdminTierFuture/Should_do_something_new
    suite.go:12: feature not enabled
--- FAIL: TestConformanceProfiles (906.76s)
    --- FAIL: TestConformanceProfiles/CNPAdminTierEgressNodePeers (11.32s)
        --- PASS: TestConformanceProfiles/CNPAdminTierEgressNodePeers/Should_support_an_'allow-egress'_rule_policy_for_egress-node-peer (0.51s)
        --- FAIL: TestConformanceProfiles/CNPAdminTierEgressNodePeers/Should_support_a_'deny-egress'_rule_policy_for_egress-node-peer (10.00s)
    --- PASS: TestConformanceProfiles/CNPAdminTierGress (105.64s)
        --- PASS: TestConformanceProfiles/CNPAdminTierGress/Should_support_an_'allow-gress'_policy_across_different_protocols (10.96s)
    --- PASS: TestConformanceProfiles/CNPAdminTierEgressSCTP (1.00s)
        --- PASS: TestConformanceProfiles/CNPAdminTierEgressSCTP/Should_support_an_'allow-egress'_policy_for_SCTP_protocol (1.00s)
    --- PASS: TestConformanceProfiles/CNPAdminTierFuture (0.00s)
        --- SKIP: TestConformanceProfiles/CNPAdminTierFuture/Should_do_something_new (0.00s)
FAIL
";

    #[test]
    fn go_test_output_gives_each_test_its_ending_and_log() {
        let tests = parse_go_test_output(OUT);
        assert_eq!(tests.len(), 10, "{:?}", tests.keys());
        let deny = &tests["TestConformanceProfiles/CNPAdminTierEgressNodePeers/Should_support_a_'deny-egress'_rule_policy_for_egress-node-peer"];
        assert_eq!(deny.ending, Ending::Fail);
        assert_eq!(deny.elapsed, Duration::from_secs(10));
        assert!(deny.log.iter().any(|l| l.contains("Condition never satisfied")));
        // The parent's own line after its subtests is its own, not theirs.
        let parent = &tests["TestConformanceProfiles/CNPAdminTierEgressNodePeers"];
        assert_eq!(parent.log, ["apply.go:154: Deleting node-and-cidr-as-peers-example ClusterNetworkPolicy"]);
        assert_eq!(leaves(&tests).count(), 5);
    }

    #[test]
    fn the_table_counts_leaves_and_reports_sctp_apart() {
        let r = result(&parse_go_test_output(OUT), false, Duration::from_secs(900));
        assert_eq!(r.passed, 2, "{r:?}");
        assert_eq!(r.failed.len(), 1);
        let (name, why) = &r.failed[0];
        assert_eq!(name, "CNPAdminTierEgressNodePeers/Should support a 'deny-egress' rule policy for egress-node-peer");
        assert_eq!(
            why,
            "Expected connection to fail from ns/harry-potter-1 to 10.251.0.12, but instead it successfully connected. (admin-network-policy-experimental-egress-rules.go:102)"
        );
        // A leaf that tests SCTP alone is skipped with the reason; one that
        // also probed TCP and UDP passed on those and is listed apart.
        assert_eq!(r.skipped.len(), 2, "{:?}", r.skipped);
        assert!(
            r.skipped.iter().any(|(n, w)| n.contains("SCTP protocol") && w.contains("its 1 SCTP probes were not made"))
        );
        assert!(
            r.skipped
                .iter()
                .any(|(n, w)| n.contains("something new") && w == "skipped by the test: feature not enabled")
        );
        assert_eq!(r.partial.len(), 1);
        assert!(r.partial[0].0.starts_with("CNPAdminTierGress/") && r.partial[0].1.contains("its 2 SCTP probes"));
        assert!(!r.ok());
    }

    #[test]
    fn a_run_without_any_subtest_result_fails() {
        let out = "=== RUN   TestConformanceProfiles\n    suite.go:90: \n        \tError:      \tnamespaces not ready\n--- FAIL: TestConformanceProfiles (300.00s)\nFAIL\n";
        let r = result(&parse_go_test_output(out), false, Duration::from_secs(300));
        assert_eq!(r.failed, [(TEST.to_owned(), "namespaces not ready".to_owned())]);
        let r = result(&parse_go_test_output(""), false, Duration::ZERO);
        assert!(r.failed[0].1.contains("no result"), "{r:?}");
    }

    #[test]
    fn the_binary_names_its_agnhost_images() {
        let bin = b"\0\0image: registry.k8s.io/e2e-test-images/agnhost:2.45\n   image: registry.k8s.io/e2e-test-images/agnhost:2.45\"x registry.k8s.io/e2e-test-images/agnhost:";
        assert_eq!(agnhost_images(bin), ["registry.k8s.io/e2e-test-images/agnhost:2.45"]);
    }
}
