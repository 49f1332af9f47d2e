//! A weft-agent process running inside a node's network namespace.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::netns::Netns;
use crate::{bins, wait};

pub struct Agent {
    child: Option<Child>,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub pod_cidr: String,
    /// Extra flags and environment, kept for restarts.
    args: Vec<String>,
    env: Vec<(String, String)>,
    node: String,
    log: PathBuf,
    /// The weft-agent binary (default: the build under test's).
    binary: PathBuf,
}

impl Agent {
    /// Starts an agent for `node` with its socket and state under `dir`, and
    /// waits until it answers STATUS. It logs at `WEFT_LOG` when set (the
    /// benchmarks use the chart's level), otherwise at debug for failing tests.
    pub fn start(node: &Netns, pod_cidr: &str, dir: &Path) -> Self {
        Self::start_with(node, pod_cidr, dir, &[])
    }

    /// Like [`Agent::start`], with extra flags (also on every restart).
    pub fn start_with(node: &Netns, pod_cidr: &str, dir: &Path, args: &[&str]) -> Self {
        Self::start_with_env(node, pod_cidr, dir, args, &[])
    }

    /// Like [`Agent::start_with`], with extra environment variables (a `PATH`
    /// with fault-injecting stand-ins for the programs the agent runs, say).
    pub fn start_with_env(node: &Netns, pod_cidr: &str, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut agent = Self::new(node, pod_cidr, dir, &bins::weft("weft-agent"));
        agent.args = args.iter().map(|a| a.to_string()).collect();
        agent.env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        agent.spawn(node);
        agent
    }

    /// Like [`Agent::start`], running the weft-agent at `binary` (another
    /// build, for a benchmark that compares two in the same run).
    pub fn start_binary(node: &Netns, pod_cidr: &str, dir: &Path, binary: &Path) -> Self {
        let mut agent = Self::new(node, pod_cidr, dir, binary);
        agent.spawn(node);
        agent
    }

    fn new(node: &Netns, pod_cidr: &str, dir: &Path, binary: &Path) -> Self {
        Self {
            args: Vec::new(),
            env: Vec::new(),
            child: None,
            socket: dir.join("agent.sock"),
            state_dir: dir.join("state"),
            pod_cidr: pod_cidr.to_owned(),
            node: node.name().to_owned(),
            log: dir.join("agent.log"),
            binary: binary.to_owned(),
        }
    }

    fn spawn(&mut self, node: &Netns) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("agent log file");
        let child = node
            .command(&self.binary)
            .args(["--pod-cidr", &self.pod_cidr, "--metrics-addr", "127.0.0.1:9646"])
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("WEFT_LOG", std::env::var("WEFT_LOG").unwrap_or_else(|_| "debug".into()))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("cannot start weft-agent");
        self.child = Some(child);
        let socket = self.socket.clone();
        wait::until("the agent's socket", Duration::from_secs(20), || {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("weft-agent exited with {status}; log:\n{}", self.log_text());
            }
            socket.exists().then_some(())
        });
    }

    /// Kills the agent with SIGKILL (no clean-up on its side) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the agent with SIGTERM and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self, node: &Netns) {
        self.kill9();
        // A killed agent leaves its socket file; the new one replaces it.
        let _ = std::fs::remove_file(&self.socket);
        self.spawn(node);
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// IPAM record files currently on disk.
    pub fn ipam_records(&self) -> Vec<String> {
        match std::fs::read_dir(self.state_dir.join("ipam")) {
            Ok(rd) => rd
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// One node for weft-cni tests: its namespace and an agent in it, with the
/// agent's socket and state in a temporary directory.
pub struct Node {
    // Field order matters for drop: the agent stops before its namespace goes.
    pub agent: Agent,
    pub ns: Netns,
    pub dir: tempfile::TempDir,
}

impl Node {
    /// A node with an agent for `cidr`; `None` (or a failure under CI=true)
    /// without root or iproute2.
    pub fn start(tag: &str, cidr: &str) -> Option<Self> {
        Self::start_with(tag, cidr, &[], &[])
    }

    /// Like [`Node::start`], with agent flags and environment.
    pub fn start_with(tag: &str, cidr: &str, args: &[&str], env: &[(&str, &str)]) -> Option<Self> {
        if !crate::prereq::require_root() || !crate::prereq::require("ip (iproute2)", crate::prereq::have("ip")) {
            return None;
        }
        let ns = Netns::new(tag);
        let dir = tempfile::tempdir().expect("tempdir");
        let agent = Agent::start_with_env(&ns, cidr, dir.path(), args, env);
        Some(Self { agent, ns, dir })
    }

    /// The host ends of pod veths (`weftv…`) on the node.
    pub fn veths(&self) -> Vec<String> {
        self.ns.links().into_iter().filter(|l| l.starts_with("weftv")).collect()
    }
}
