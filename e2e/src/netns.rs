//! Network namespaces created by tests, removed on drop (also on panic).

use std::process::{Command, Output};

use rand::Rng;

/// A named network namespace under /run/netns that this process created.
pub struct Netns {
    name: String,
    /// Removed on drop only when this value created it.
    owned: bool,
}

impl Netns {
    /// Creates `weft-<tag>-<random>` with loopback up.
    pub fn new(tag: &str) -> Self {
        let suffix: u32 = rand::rng().random();
        let name = format!("weft-{tag}-{suffix:08x}");
        run("ip", &["netns", "add", &name]);
        let ns = Self { name, owned: true };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// A namespace that someone else owns (e.g. a sandbox node); not removed on drop.
    pub fn existing(name: &str) -> Self {
        Self { name: name.to_owned(), owned: false }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// `ip -n <ns> args…`, panicking with its stderr on failure.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// Runs a command inside the namespace and returns its output, whatever its status.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, cmd])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cmd} in {}: {e}", self.name))
    }

    /// A `Command` that runs `cmd` inside the namespace.
    pub fn command(&self, cmd: impl AsRef<std::ffi::OsStr>) -> Command {
        crate::control_plane::process::in_netns(&self.name, cmd)
    }

    /// True when one ICMP echo to `ip` is answered within a second.
    pub fn ping(&self, ip: &str) -> bool {
        self.exec("ping", &["-c", "1", "-W", "1", "-q", ip]).status.success()
    }

    /// Names of links in the namespace.
    pub fn links(&self) -> Vec<String> {
        self.ip(&["-o", "link", "show"])
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_owned())
            .collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Runs a command, panicking with its stderr when it fails.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}
