//! weft-conformance: runs suites of Kubernetes' own e2e tests (`e2e.test`)
//! against the running real-node cluster and prints a table. `e2e/conformance.sh`
//! builds what it needs, brings the cluster up if it is not, and calls this.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use weft_e2e::cluster::{State, dns, images, node};
use weft_e2e::conformance::{self, Environment, SuiteResult};
use weft_e2e::control_plane;
use weft_e2e::supervisor::StateFile;

#[derive(Parser)]
#[command(name = "weft-conformance", about = "Kubernetes' own network tests against the Weft cluster")]
struct Cli {
    /// Suites to run (netpol, network-conformance, sig-network); netpol and
    /// network-conformance when none is given.
    suites: Vec<String>,
    /// Where the ginkgo JSON reports and the table go (e2e.test's output goes to the terminal).
    #[arg(long, default_value = "target/conformance")]
    report_dir: PathBuf,
    /// Bound on each suite's run (ginkgo's --timeout).
    #[arg(long, default_value = "60m")]
    timeout: String,
    /// Parallel e2e.test processes per suite (ginkgo's --procs), each with
    /// its own namespaces, as Kubernetes' CI runs these suites.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    procs: u32,
    /// Print each suite's tests (to run, and skipped with the reason) and stop.
    #[arg(long)]
    list: bool,
    /// Run only the suite's tests whose names match this regex (Go/RE2, as
    /// ginkgo's --focus), e.g. to run again the ones that failed.
    #[arg(long)]
    only: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let suites = if cli.suites.is_empty() {
        conformance::SUITES.iter().filter(|s| s.by_default).collect::<Vec<_>>()
    } else {
        cli.suites
            .iter()
            .map(|n| {
                conformance::suite(n).with_context(|| {
                    let names: Vec<&str> = conformance::SUITES.iter().map(|s| s.name).collect();
                    format!("no suite {n:?}: one of {}", names.join(", "))
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    let tools = control_plane::tools_dir();
    let e2e_test = tools.join("e2e.test");
    anyhow::ensure!(
        e2e_test.is_file(),
        "{} is missing: build it with e2e/scripts/build-tools.sh --e2e-test",
        e2e_test.display()
    );
    let ginkgo = tools.join("ginkgo");
    anyhow::ensure!(
        ginkgo.is_file(),
        "{} is missing: build it with e2e/scripts/build-tools.sh --e2e-test",
        ginkgo.display()
    );
    std::fs::create_dir_all(&cli.report_dir).with_context(|| format!("cannot create {}", cli.report_dir.display()))?;
    let report_dir = cli.report_dir.canonicalize().context("report directory")?;

    let listing = output(Command::new(&e2e_test).arg("--list-tests")).context("e2e.test --list-tests")?;
    let all_tests = conformance::parse_test_list(&listing);
    let only = cli.only.as_deref().map(regex::Regex::new).transpose().context("--only")?;
    anyhow::ensure!(!all_tests.is_empty(), "e2e.test --list-tests listed no tests");
    if cli.list {
        // What a run does: it deploys cluster DNS when there is none.
        for suite in suites {
            let plan = narrow(suite.plan(&all_tests, Environment { cluster_dns: true })?, only.as_ref());
            println!("{} ({}):", suite.name, suite.about);
            plan.run.iter().for_each(|n| println!("  run   {n}"));
            plan.skipped.iter().for_each(|(n, why)| println!("  skip  {n}\n          {why}"));
        }
        return Ok(());
    }
    let state = State::load().context("the cluster is not up (e2e/cluster.sh up)")?;
    // Upstream Service and DNS tests reach Services by name: deploy cluster
    // DNS as kubeadm does when the cluster has none.
    if !dns::deployed(&state.kubeconfig) {
        eprintln!("== deploying CoreDNS (kube-dns at {})", weft_e2e::cluster::CLUSTER_DNS_IP);
        dns::deploy(&state.kubeconfig, weft_e2e::cluster::families::Families::of(&state.helm_values).dns_ip())?;
    }
    let env = Environment { cluster_dns: dns::deployed(&state.kubeconfig) };
    // The nodes start with Weft's and agnhost's images; the tests run more.
    let images = images::tarballs(images::UPSTREAM_TESTS)?;
    eprintln!("== importing the upstream tests' images into {} nodes", state.nodes.len());
    node::import_images_everywhere(&state.nodes, &images)?;

    let mut results = Vec::new();
    for suite in suites {
        let plan = narrow(suite.plan(&all_tests, env)?, only.as_ref());
        // With --only, exactly the planned tests (ginkgo ORs repeated --focus flags).
        let focus = match &only {
            Some(_) => plan.run.iter().map(|n| regex::escape(n)).collect::<Vec<_>>().join("|"),
            None => suite.focus_regex(),
        };
        eprintln!(
            "== {}: {} ({} tests to run, {} skipped with a reason)",
            suite.name,
            suite.about,
            plan.run.len(),
            plan.skipped.len()
        );
        let report_path = report_dir.join(format!("{}.json", suite.name));
        let _ = std::fs::remove_file(&report_path);
        let started = Instant::now();
        if !plan.run.is_empty() {
            // The ginkgo CLI runs the precompiled e2e.test in --procs
            // processes and merges their reports into one.
            let mut cmd = Command::new(&ginkgo);
            cmd.current_dir(&report_dir)
                .env("PATH", path_with(&tools))
                .arg(format!("--procs={}", cli.procs))
                .arg(format!("--focus={focus}"))
                .arg(format!("--timeout={}", cli.timeout))
                .arg(format!("--json-report={}", report_path.display()))
                .args(["--no-color", "--silence-skips"]);
            if let Some(skip) = suite.skip_regex(env) {
                cmd.arg(format!("--skip={skip}"));
            }
            // --num-nodes as Kubernetes' own CI passes it: without it the
            // tests that need two nodes skip themselves ("not -1").
            cmd.arg(&e2e_test)
                .arg("--")
                .arg("--provider=skeleton")
                .arg(format!("--num-nodes={}", state.nodes.len()))
                .arg(format!("--kubeconfig={}", state.kubeconfig.display()));
            // Its exit status says "some test failed"; the report says which.
            let status = cmd.status().context("cannot run ginkgo")?;
            eprintln!("== {}: ginkgo exited with {status}", suite.name);
        }
        let report = match std::fs::read_to_string(&report_path) {
            Ok(json) => conformance::parse_report(&json)?,
            Err(_) if plan.run.is_empty() => Default::default(),
            Err(e) => {
                eprintln!("== {}: no report at {}: {e}", suite.name, report_path.display());
                Default::default()
            }
        };
        results.push(SuiteResult::new(suite.name, &plan, &report, started.elapsed()));
    }
    let table = conformance::render(&results);
    println!("{table}");
    let summary = report_dir.join("summary.txt");
    std::fs::write(&summary, &table).with_context(|| format!("cannot write {}", summary.display()))?;
    if results.iter().all(SuiteResult::ok) {
        Ok(())
    } else {
        anyhow::bail!("upstream tests failed (ginkgo reports in {})", report_dir.display())
    }
}

fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// PATH with the tools first: some tests run `kubectl`.
fn path_with(tools: &Path) -> std::ffi::OsString {
    let mut paths = vec![tools.to_path_buf()];
    if let Some(p) = std::env::var_os("PATH") {
        paths.extend(std::env::split_paths(&p));
    }
    std::env::join_paths(paths).unwrap_or_default()
}

/// The plan's tests that `only` matches (all of them without it).
fn narrow(mut plan: conformance::Plan, only: Option<&regex::Regex>) -> conformance::Plan {
    if let Some(only) = only {
        plan.run.retain(|n| only.is_match(n));
        plan.skipped.retain(|(n, _)| only.is_match(n));
    }
    plan
}
