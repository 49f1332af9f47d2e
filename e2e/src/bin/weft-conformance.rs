//! weft-conformance: runs suites of Kubernetes' own e2e tests (`e2e.test`)
//! and SIG Network's ClusterNetworkPolicy conformance suite against the
//! running real-node cluster and prints one table. `e2e/conformance.sh` builds
//! what it needs, brings the cluster up if it is not, and calls this.

use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use weft_e2e::cluster::{State, dns, images, node};
use weft_e2e::conformance::{self, Environment, SuiteResult, cnp};
use weft_e2e::control_plane;
use weft_e2e::supervisor::StateFile;

#[derive(Parser)]
#[command(name = "weft-conformance", about = "Kubernetes' own network tests against the Weft cluster")]
struct Cli {
    /// Suites to run (netpol, network-conformance, sig-network, cnp); netpol,
    /// network-conformance and cnp when none is given.
    suites: Vec<String>,
    /// Where the ginkgo JSON reports and the table go (e2e.test's output goes to the terminal).
    #[arg(long, default_value = "target/conformance")]
    report_dir: PathBuf,
    /// Bound on each suite's run (ginkgo's --timeout, go test's -test.timeout).
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
    /// ginkgo's --focus; for cnp, go test's -test.run below
    /// TestConformanceProfiles), e.g. to run again the ones that failed.
    #[arg(long)]
    only: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (suites, with_cnp) = if cli.suites.is_empty() {
        (conformance::SUITES.iter().filter(|s| s.by_default).collect::<Vec<_>>(), true)
    } else {
        let suites = cli
            .suites
            .iter()
            .filter(|n| *n != cnp::NAME)
            .map(|n| {
                conformance::suite(n).with_context(|| {
                    let mut names: Vec<&str> = conformance::SUITES.iter().map(|s| s.name).collect();
                    names.push(cnp::NAME);
                    format!("no suite {n:?}: one of {}", names.join(", "))
                })
            })
            .collect::<anyhow::Result<_>>()?;
        (suites, cli.suites.iter().any(|n| n == cnp::NAME))
    };
    let tools = control_plane::tools_dir();
    let e2e = (!suites.is_empty()).then(|| E2eTools::find(&tools)).transpose()?;
    let cnp_test = tools.join("cnp-conformance.test");
    anyhow::ensure!(
        !with_cnp || cnp_test.is_file(),
        "{} is missing: build it with e2e/scripts/build-tools.sh --e2e-test",
        cnp_test.display()
    );
    std::fs::create_dir_all(&cli.report_dir).with_context(|| format!("cannot create {}", cli.report_dir.display()))?;
    let report_dir = cli.report_dir.canonicalize().context("report directory")?;
    let only = cli.only.as_deref().map(regex::Regex::new).transpose().context("--only")?;

    let all_tests = match &e2e {
        Some(e2e) => {
            let tmp = e2e_test_tmpdir()?;
            let mut list = Command::new(&e2e.e2e_test);
            list.env("TMPDIR", tmp.path()).arg("--list-tests");
            let listing = output(&mut list).context("e2e.test --list-tests")?;
            let all = conformance::parse_test_list(&listing);
            anyhow::ensure!(!all.is_empty(), "e2e.test --list-tests listed no tests");
            all
        }
        None => Vec::new(),
    };
    if cli.list {
        // What a run does: it deploys cluster DNS when there is none.
        for suite in &suites {
            let plan = narrow(suite.plan(&all_tests, Environment { cluster_dns: true })?, only.as_ref());
            println!("{} ({}):", suite.name, suite.about);
            plan.run.iter().for_each(|n| println!("  run   {n}"));
            plan.skipped.iter().for_each(|(n, why)| println!("  skip  {n}\n          {why}"));
        }
        if with_cnp {
            println!("{} ({}): its tests are Go subtests made at run time; the run lists them", cnp::NAME, cnp::ABOUT);
        }
        return Ok(());
    }
    let state = State::load().context("the cluster is not up (e2e/cluster.sh up)")?;
    let warnings = WarningEvents::record(&state.kubeconfig, &report_dir.join(WarningEvents::FILE))?;
    // The ClusterNetworkPolicy suite runs beside e2e.test's: its policies
    // select only its own namespaces' pods (by their conformance-house
    // labels), so neither sees the other's policies, and it spends most of
    // its time waiting out the 3 s probes of denied connections.
    let mut results = Vec::new();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let cnp_run = if with_cnp {
            prepare_cnp(&cnp_test, &state)?;
            // Alone, its output goes to the terminal as well as cnp.log.
            let echo = e2e.is_none();
            let (cli, cnp_test, state, report_dir) = (&cli, &cnp_test, &state, &report_dir);
            Some(s.spawn(move || run_cnp(cli, cnp_test, state, report_dir, echo)))
        } else {
            None
        };
        if let Some(e2e) = &e2e {
            results.extend(run_e2e_suites(&cli, e2e, &state, &suites, &all_tests, only.as_ref(), &report_dir)?);
        }
        if let Some(run) = cnp_run {
            results.push(run.join().map_err(|_| anyhow::anyhow!("the {} suite's thread panicked", cnp::NAME))??);
        }
        Ok(())
    })?;
    let table = conformance::render(&results);
    println!("{table}");
    let summary = report_dir.join("summary.txt");
    std::fs::write(&summary, &table).with_context(|| format!("cannot write {}", summary.display()))?;
    if results.iter().all(SuiteResult::ok) {
        Ok(())
    } else {
        // What the cluster said meanwhile: the suites delete their
        // namespaces, and their events with them, before they end.
        warnings.print_tail(60);
        anyhow::bail!("upstream tests failed (reports in {})", report_dir.display())
    }
}

/// The cluster's Warning events, recorded while the suites run (a
/// `kubectl get events --watch-only` into a file), so that a failure can be
/// told from a sandbox that failed, an image missing or a node gone.
struct WarningEvents {
    child: std::process::Child,
    path: PathBuf,
}

impl WarningEvents {
    const FILE: &str = "warning-events.txt";

    fn record(kubeconfig: &Path, path: &Path) -> anyhow::Result<Self> {
        let file = std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?;
        let child = Command::new(control_plane::tools_dir().join("kubectl"))
            .env("KUBECONFIG", kubeconfig)
            .args(["get", "events", "--all-namespaces", "--watch-only", "--field-selector=type=Warning"])
            .arg("--output=custom-columns=LAST:.lastTimestamp,NAMESPACE:.involvedObject.namespace,OBJECT:.involvedObject.name,REASON:.reason,COUNT:.count,MESSAGE:.message")
            .stdout(file)
            .stderr(Stdio::null())
            .spawn()
            .context("cannot run kubectl get events")?;
        Ok(Self { child, path: path.to_owned() })
    }

    /// The last `lines` events (after the header), on stderr.
    fn print_tail(&self, lines: usize) {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        let events: Vec<&str> = text.lines().filter(|l| !l.starts_with("LAST ")).collect();
        eprintln!(
            "== the cluster's Warning events during the run: {} (the last {} below; all in {})",
            events.len(),
            lines.min(events.len()),
            self.path.display()
        );
        for line in &events[events.len().saturating_sub(lines)..] {
            eprintln!("  {line}");
        }
    }
}

impl Drop for WarningEvents {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A private temporary directory for e2e.test (its `TMPDIR`), removed when
/// dropped: e2e.test leaves a `test-kuberc*` directory in the temporary
/// directory whenever it starts, and for each kubectl it runs.
fn e2e_test_tmpdir() -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("weft-e2e-test-")
        .tempdir()
        .context("cannot make a temporary directory for e2e.test")
}

/// Kubernetes' e2e.test and the ginkgo CLI that runs it.
struct E2eTools {
    e2e_test: PathBuf,
    ginkgo: PathBuf,
}

impl E2eTools {
    fn find(tools: &Path) -> anyhow::Result<E2eTools> {
        let found = E2eTools { e2e_test: tools.join("e2e.test"), ginkgo: tools.join("ginkgo") };
        for p in [&found.e2e_test, &found.ginkgo] {
            anyhow::ensure!(
                p.is_file(),
                "{} is missing: build it with e2e/scripts/build-tools.sh --e2e-test",
                p.display()
            );
        }
        Ok(found)
    }
}

fn run_e2e_suites(
    cli: &Cli,
    e2e: &E2eTools,
    state: &State,
    suites: &[&'static conformance::Suite],
    all_tests: &[String],
    only: Option<&regex::Regex>,
    report_dir: &Path,
) -> anyhow::Result<Vec<SuiteResult>> {
    let tools = control_plane::tools_dir();
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
        let plan = narrow(suite.plan(all_tests, env)?, only);
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
            let tmp = e2e_test_tmpdir()?;
            let mut cmd = Command::new(&e2e.ginkgo);
            cmd.current_dir(report_dir)
                .env("TMPDIR", tmp.path())
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
            cmd.arg(&e2e.e2e_test)
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
    Ok(results)
}

/// What the ClusterNetworkPolicy conformance suite needs before it runs: a
/// cluster that enforces it, and its test images on the nodes.
fn prepare_cnp(binary: &Path, state: &State) -> anyhow::Result<()> {
    anyhow::ensure!(
        weft_e2e::cluster::helm_set(&state.helm_values, "clusterNetworkPolicy.enforce") == Some("true"),
        "the cluster's Weft does not enforce ClusterNetworkPolicy: bring the cluster up as e2e/conformance.sh does \
         (--set clusterNetworkPolicy.enforce=true --set clusterNetworkPolicy.installCRDs=true \
         --set clusterNetworkPolicy.crdChannel=experimental)"
    );
    // The suite's manifests name an older agnhost tag than the one built
    // here (Kubernetes' own); the commands they run are the same.
    let bytes = std::fs::read(binary).with_context(|| format!("cannot read {}", binary.display()))?;
    let wanted = cnp::agnhost_images(&bytes);
    anyhow::ensure!(!wanted.is_empty(), "{} names no {}* image", binary.display(), cnp::AGNHOST_REPO);
    for n in &state.nodes {
        let source = node::alias_image(n, cnp::AGNHOST_REPO, &wanted)?;
        eprintln!("== {}: {} also named {}", n.name, source, wanted.join(", "));
    }
    Ok(())
}

/// The ClusterNetworkPolicy conformance suite's `go test -v` run, kept in
/// cnp.log beside the conformance report it writes (cnp-report.yaml), and
/// echoed to the terminal with `echo`.
fn run_cnp(cli: &Cli, binary: &Path, state: &State, report_dir: &Path, echo: bool) -> anyhow::Result<SuiteResult> {
    let sctp = cnp::kernel_has_sctp();
    let report = report_dir.join("cnp-report.yaml");
    let _ = std::fs::remove_file(&report);
    let run = match &cli.only {
        Some(only) => format!("^{}$/{only}", cnp::TEST),
        None => format!("^{}$", cnp::TEST),
    };
    let log_path = report_dir.join("cnp.log");
    eprintln!(
        "== {}: {}{}{}",
        cnp::NAME,
        cnp::ABOUT,
        if sctp { "" } else { " (no SCTP probes: the kernel has no SCTP)" },
        if echo { String::new() } else { format!("; beside the other suites, its output in {}", log_path.display()) }
    );
    let started = Instant::now();
    let mut cmd = Command::new(binary);
    cmd.current_dir(report_dir)
        .env("KUBECONFIG", &state.kubeconfig)
        .arg("-test.v")
        .arg(format!("-test.run={run}"))
        .arg(format!("-test.timeout={}", cli.timeout))
        .args(cnp::suite_args(&report, &weft_version()))
        .stdout(Stdio::piped());
    if !sctp {
        cmd.env(cnp::NO_SCTP_ENV, "1");
    }
    let mut child = cmd.spawn().with_context(|| format!("cannot run {}", binary.display()))?;
    let stdout = child.stdout.take().context("the suite's stdout")?;
    let mut log = std::fs::File::create(&log_path).with_context(|| format!("cannot write {}", log_path.display()))?;
    let mut out = String::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading the suite's output")?;
        if echo {
            eprintln!("{line}");
        }
        writeln!(log, "{line}").with_context(|| format!("cannot write {}", log_path.display()))?;
        out.push_str(&line);
        out.push('\n');
    }
    let status = child.wait().context("waiting for the suite")?;
    eprintln!("== {}: exited with {status}; report {}", cnp::NAME, report.display());
    if !status.success() && !echo {
        let lines: Vec<&str> = out.lines().collect();
        eprintln!("== {}: the last lines of {}", cnp::NAME, log_path.display());
        lines[lines.len().saturating_sub(80)..].iter().for_each(|l| eprintln!("{l}"));
    }
    Ok(cnp::result(&cnp::parse_go_test_output(&out), status.success(), started.elapsed()))
}

/// What the conformance report names as the implementation's version.
fn weft_version() -> String {
    let rev = Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    match rev {
        Some(rev) => format!("{}+{rev}", env!("CARGO_PKG_VERSION")),
        None => env!("CARGO_PKG_VERSION").to_owned(),
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
