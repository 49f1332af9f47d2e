//! Runs the real `weft-operator` binary against a test control plane.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context, bail};

use super::{ControlPlane, process};

/// Path of a workspace binary: `$WEFT_BIN_DIR/<name>`, else the workspace's
/// `target/debug/<name>` (or under `$CARGO_TARGET_DIR`).
pub fn workspace_binary(name: &str) -> anyhow::Result<PathBuf> {
    let candidates: Vec<PathBuf> = if let Some(dir) = std::env::var_os("WEFT_BIN_DIR") {
        vec![PathBuf::from(dir).join(name)]
    } else {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
        vec![target.join("debug").join(name), target.join("release").join(name)]
    };
    candidates.iter().find(|p| p.is_file()).cloned().with_context(|| {
        format!(
            "{name} is not built (looked at {candidates:?}); run `cargo build --workspace --bins` or set WEFT_BIN_DIR"
        )
    })
}

/// A running operator process; SIGKILLed on drop.
pub struct OperatorProcess {
    child: Child,
    /// `127.0.0.1:<port>` of its metrics/health server.
    pub metrics_addr: String,
    pub log: PathBuf,
    _log_dir: tempfile::TempDir,
}

impl OperatorProcess {
    /// Starts `weft-operator` with the admin kubeconfig and `args`
    /// (a metrics address is added).
    pub fn start(cp: &ControlPlane, args: &[String]) -> anyhow::Result<OperatorProcess> {
        let bin = workspace_binary("weft-operator")?;
        let log_dir = tempfile::Builder::new().prefix("weft-operator-").tempdir()?;
        let log = log_dir.path().join("operator.log");
        let metrics_addr = format!("127.0.0.1:{}", super::free_port()?);
        let mut cmd = Command::new(&bin);
        cmd.env("KUBECONFIG", &cp.kubeconfig)
            .env("RUST_LOG", std::env::var("WEFT_OPERATOR_LOG").unwrap_or_else(|_| "info".into()))
            .arg(format!("--metrics-addr={metrics_addr}"))
            .args(args);
        let child = process::spawn_tied(cmd, &log)?;
        Ok(OperatorProcess { child, metrics_addr, log, _log_dir: log_dir })
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Fails when the process has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("weft-operator exited with {status}; log:\n{}", self.log_tail());
        }
        Ok(())
    }

    /// The operator's whole log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` (SIGSTOP, SIGCONT) to the operator's process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, signal) };
        assert_eq!(rc, 0, "kill({}, {signal}) failed", self.child.id());
    }

    /// The end of the operator's log, for assertion messages.
    pub fn log_tail(&self) -> String {
        process::log_tail(&self.log, 6000)
    }

    /// Resident set size in KiB, from /proc.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("VmRSS not found")
    }

    /// GET a path (e.g. `/metrics`) from the operator's HTTP server.
    pub async fn http_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream =
            tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(&self.metrics_addr))
                .await
                .context("connect timed out")??;
        let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf))
            .await
            .context("read timed out")??;
        let text = String::from_utf8_lossy(&buf).to_string();
        let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).context("malformed HTTP response")?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Ok((code, body))
    }

    /// The value of the first `/metrics` line starting with `line_prefix`
    /// (a metric's name and labels and the space before the value); None
    /// while it is not served.
    pub async fn metric(&self, line_prefix: &str) -> Option<f64> {
        let (code, body) = self.http_get("/metrics").await.ok()?;
        if code != 200 {
            return None;
        }
        body.lines().find_map(|l| l.strip_prefix(line_prefix)).and_then(|v| v.trim().parse().ok())
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        process::stop(&mut self.child, Duration::from_secs(2));
        if std::thread::panicking() {
            eprintln!("--- weft-operator log (tail) ---\n{}", self.log_tail());
        }
    }
}
