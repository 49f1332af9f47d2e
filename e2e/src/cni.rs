//! Executing CNI plugins exactly as a container runtime does: a fresh process
//! with CNI_* in its environment and the network configuration on stdin.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::bins;
use crate::netns::Netns;

/// What a plugin printed and how it exited.
#[derive(Debug)]
pub struct Outcome {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Outcome {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("plugin stdout is not JSON ({e}): {:?}\nstderr: {}", self.stdout, self.stderr))
    }

    /// The error code of a failed invocation.
    pub fn code(&self) -> u64 {
        assert!(!self.success, "expected a failure, got success: {}", self.stdout);
        self.json()["code"].as_u64().unwrap_or_else(|| panic!("no code in {}", self.stdout))
    }

    pub fn msg(&self) -> String {
        self.json()["msg"].as_str().unwrap_or_default().to_owned()
    }

    #[track_caller]
    pub fn assert_ok(&self) -> &Self {
        assert!(self.success, "plugin failed: {}\nstderr: {}", self.stdout, self.stderr);
        self
    }
}

/// The container-side parameters of one invocation.
#[derive(Clone, Debug)]
pub struct Container {
    pub id: String,
    pub netns: Option<String>,
    pub ifname: String,
}

impl Container {
    pub fn new(id: impl Into<String>, netns: &Netns) -> Self {
        Self { id: id.into(), netns: Some(netns.path()), ifname: "eth0".into() }
    }
}

/// Execs `plugin` for `verb` inside `node` (the node's namespace, where a
/// runtime runs) with raw environment and stdin.
pub fn exec_raw(node: &Netns, plugin: &Path, env: &[(&str, &str)], stdin: &[u8]) -> Outcome {
    let started = Instant::now();
    let child = spawn_raw(node, plugin, env, stdin);
    let out = child.wait_with_output().expect("plugin output");
    Outcome {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}

/// Like [`exec_raw`], without waiting: the plugin has its stdin and runs.
pub fn spawn_raw(node: &Netns, plugin: &Path, env: &[(&str, &str)], stdin: &[u8]) -> std::process::Child {
    let mut cmd = node.command(plugin);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(
            "CNI_PATH",
            format!(
                "{}:{}",
                bins::weft("weft-cni").parent().map(|p| p.display().to_string()).unwrap_or_default(),
                bins::REFERENCE_PLUGINS
            ),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot exec {}: {e}", plugin.display()));
    if let Some(mut stdin_pipe) = child.stdin.take() {
        let _ = stdin_pipe.write_all(stdin);
    }
    child
}

/// Execs a plugin for a container verb.
pub fn exec(node: &Netns, plugin: &Path, verb: &str, c: &Container, conf: &Value) -> Outcome {
    let (vars, args) = container_env(verb, c);
    let mut env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.push(("CNI_ARGS", &args));
    exec_raw(node, plugin, &env, conf.to_string().as_bytes())
}

/// Like [`exec`], without waiting for the plugin.
pub fn spawn(node: &Netns, plugin: &Path, verb: &str, c: &Container, conf: &Value) -> std::process::Child {
    let (vars, args) = container_env(verb, c);
    let mut env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.push(("CNI_ARGS", &args));
    spawn_raw(node, plugin, &env, conf.to_string().as_bytes())
}

/// The CNI environment of a container verb, and its CNI_ARGS.
fn container_env(verb: &str, c: &Container) -> (Vec<(&'static str, String)>, String) {
    let mut env =
        vec![("CNI_COMMAND", verb.to_owned()), ("CNI_CONTAINERID", c.id.clone()), ("CNI_IFNAME", c.ifname.clone())];
    if let Some(ns) = &c.netns {
        env.push(("CNI_NETNS", ns.clone()));
    }
    let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={};K8S_POD_UID=uid-{}", c.id, c.id);
    (env, args)
}

/// weft-cni's network configuration for an agent socket.
pub fn weft_conf(socket: &Path) -> Value {
    json!({
        "cniVersion": "1.1.0",
        "name": "weft",
        "type": "weft-cni",
        "agentSocket": socket,
    })
}

/// weft-cni with the configuration of `socket`.
pub struct Weft<'a> {
    pub node: &'a Netns,
    pub conf: Value,
    pub plugin: PathBuf,
}

impl<'a> Weft<'a> {
    pub fn new(node: &'a Netns, socket: &Path) -> Self {
        Self { node, conf: weft_conf(socket), plugin: bins::weft("weft-cni") }
    }

    pub fn add(&self, c: &Container) -> Outcome {
        exec(self.node, &self.plugin, "ADD", c, &self.conf)
    }

    pub fn del(&self, c: &Container, prev: Option<&Value>) -> Outcome {
        exec(self.node, &self.plugin, "DEL", c, &with_prev(&self.conf, prev))
    }

    pub fn check(&self, c: &Container, prev: &Value) -> Outcome {
        exec(self.node, &self.plugin, "CHECK", c, &with_prev(&self.conf, Some(prev)))
    }

    pub fn status(&self) -> Outcome {
        exec_raw(self.node, &self.plugin, &[("CNI_COMMAND", "STATUS")], self.conf.to_string().as_bytes())
    }

    pub fn gc(&self, valid: &[&Container]) -> Outcome {
        let mut conf = self.conf.clone();
        conf["cni.dev/valid-attachments"] =
            valid.iter().map(|c| json!({"containerID": c.id, "ifname": c.ifname})).collect::<Vec<_>>().into();
        exec_raw(self.node, &self.plugin, &[("CNI_COMMAND", "GC")], conf.to_string().as_bytes())
    }
}

pub fn with_prev(conf: &Value, prev: Option<&Value>) -> Value {
    let mut c = conf.clone();
    if let Some(p) = prev {
        c["prevResult"] = p.clone();
    }
    c
}

/// The pod address (without prefix) in an ADD result.
pub fn pod_ip(result: &Value) -> String {
    let addr = result["ips"][0]["address"].as_str().unwrap_or_else(|| panic!("no ips in {result}"));
    addr.split('/').next().unwrap_or(addr).to_owned()
}

/// The routes of an ADD result in order, each as `"<dst> <gw>"` (an empty
/// gateway for an on-link route).
pub fn routes(result: &Value) -> Vec<String> {
    let routes = result["routes"].as_array().unwrap_or_else(|| panic!("no routes in {result}"));
    routes.iter().map(|r| format!("{} {}", r["dst"].as_str().unwrap_or(""), r["gw"].as_str().unwrap_or(""))).collect()
}

/// The pod's IPv6 address in an ADD result, if it has one.
pub fn pod_ip6(result: &Value) -> Option<String> {
    result["ips"].as_array()?.iter().find_map(|ip| {
        let addr = ip["address"].as_str()?.split('/').next()?;
        addr.contains(':').then(|| addr.to_owned())
    })
}
