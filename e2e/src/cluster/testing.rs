//! Driving the real-node cluster from tests the way a person does: through
//! `weft-cluster` and kubectl. One cluster runs per machine; a test binary
//! brings it up once ([`Cluster::shared`]) and down when it exits.

use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::State;
use crate::supervisor::StateFile;
use crate::{bins, control_plane, prereq, wait};

/// Runs a command to completion; returns success and its stdout, with its
/// stderr appended when `with_stderr` or when it failed.
fn capture(mut cmd: Command, with_stderr: bool) -> (bool, String) {
    let program = format!("{:?}", cmd.get_program());
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    if with_stderr || !out.status.success() {
        text.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    (out.status.success(), text)
}

/// kubectl with the cluster's kubeconfig.
fn kubectl_command(args: &[&str]) -> Command {
    let state = State::load().expect("the cluster is up");
    let mut cmd = Command::new(control_plane::tools_dir().join("kubectl"));
    cmd.env("KUBECONFIG", &state.kubeconfig).args(args);
    cmd
}

/// Runs `weft-cluster args…`; returns success and stdout+stderr.
pub fn run(args: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(bins::weft("weft-cluster"));
    cmd.args(args).env("RUST_BACKTRACE", "0");
    capture(cmd, true)
}

/// Runs `weft-cluster args…`, failing the test with its output if it fails.
#[track_caller]
pub fn ok(args: &[&str]) -> String {
    let (success, out) = run(args);
    assert!(success, "weft-cluster {args:?} failed:\n{out}");
    out
}

/// kubectl against the cluster; returns success and stdout (stderr appended on failure).
pub fn kubectl(args: &[&str]) -> (bool, String) {
    capture(kubectl_command(args), false)
}

/// kubectl that must succeed.
#[track_caller]
pub fn kubectl_ok(args: &[&str]) -> String {
    let (success, out) = kubectl(args);
    assert!(success, "kubectl {args:?} failed:\n{out}");
    out
}

/// `kubectl apply -f -` of a YAML document.
#[track_caller]
pub fn apply(yaml: &str) {
    let mut f = tempfile::Builder::new().suffix(".yaml").tempfile().expect("temp file");
    std::io::Write::write_all(&mut f, yaml.as_bytes()).expect("write YAML");
    let path = f.path().to_str().expect("utf-8 path").to_owned();
    kubectl_ok(&["apply", "-f", &path]);
}

/// Polls `cond` (at most 250 ms apart) until it returns `Some` or `timeout`
/// passes. A wait of more than a second is logged: a slow step says where
/// its time went.
#[track_caller]
pub fn eventually<T>(what: &str, timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(v) = cond() {
            let waited = started.elapsed();
            if waited > Duration::from_secs(1) {
                eprintln!("    waited {:.1} s for {what}", waited.as_secs_f64());
            }
            return v;
        }
        assert!(started.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The cluster of this test binary.
pub struct Cluster {
    pub state: State,
}

impl Cluster {
    /// Brings the cluster up with `args` (e.g. `["--backend", "host-gw"]`) on
    /// first use and registers its teardown for when the binary exits; `None`
    /// when a prerequisite is missing outside CI.
    pub fn shared(args: &[&str]) -> Option<&'static Cluster> {
        static SHARED: OnceLock<Result<Cluster, String>> = OnceLock::new();
        if !prereq::require_root()
            || !prereq::require(
                "kubelet, containerd and the control plane (e2e/scripts/build-tools.sh)",
                ["kubelet", "containerd", "kube-apiserver", "helm"]
                    .iter()
                    .all(|b| control_plane::tools_dir().join(b).is_file()),
            )
            || !prereq::require(
                "the images (e2e/scripts/build-images.sh)",
                super::images::tarballs(super::images::CLUSTER).is_ok(),
            )
        {
            return None;
        }
        let cluster = SHARED.get_or_init(|| {
            // A person's cluster, or another binary's still going down.
            // Leftovers of a cluster whose supervisor died hold no lock: `up`
            // removes them.
            wait::until("no other cluster to be up", Duration::from_secs(300), || {
                (!super::supervise::locks().taken()).then_some(())
            });
            let mut full = vec!["up"];
            full.extend_from_slice(args);
            let started = Instant::now();
            let (success, out) = run(&full);
            if !success {
                let _ = run(&["down"]);
                return Err(out);
            }
            eprintln!("cluster up in {:.1} s:\n{out}", started.elapsed().as_secs_f64());
            extern "C" fn down_at_exit() {
                let _ = run(&["down"]);
            }
            // SAFETY: registering a plain extern "C" fn with no captures.
            unsafe { libc::atexit(down_at_exit) };
            State::load().map(|state| Cluster { state }).map_err(|e| format!("{e:#}"))
        });
        match cluster {
            Ok(c) => Some(c),
            Err(e) => panic!("bringing the cluster up failed:\n{e}"),
        }
    }

    /// The current state (nodes change when tests add or remove them).
    pub fn state(&self) -> State {
        State::load().expect("the cluster is up")
    }
}

/// Runs a command inside a node; returns success and stdout+stderr.
pub fn node_exec(node: &str, command: &[&str]) -> (bool, String) {
    let mut args = vec!["node-exec", node];
    args.extend_from_slice(command);
    run(&args)
}

/// Runs a command in a pod's container; returns success and stdout+stderr.
pub fn pod_exec(namespace: &str, pod: &str, command: &[&str]) -> (bool, String) {
    let mut args = vec!["exec", "-n", namespace, pod, "--"];
    args.extend_from_slice(command);
    capture(kubectl_command(&args), true)
}
