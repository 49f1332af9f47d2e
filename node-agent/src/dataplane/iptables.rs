//! Running `iptables-save` and `iptables-restore --noflush`: the only way
//! Weft writes iptables. A restore is atomic per table and touches only the
//! chains and rules its input names, so Weft never flushes what others own.
//! Blocking (spawns processes): call from a blocking context. Acts in the
//! calling thread's network namespace.

use std::io::Write;
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error("cannot run {cmd}: {source}")]
    Spawn { cmd: &'static str, source: std::io::Error },
    #[error("{cmd} failed ({status}): {stderr}")]
    Failed { cmd: &'static str, status: std::process::ExitStatus, stderr: String },
}

/// The rules of one table, as `iptables-save -t <table>` prints them.
pub fn save(table: &str) -> Result<String, IptablesError> {
    run_save(&["-t", table])
}

/// Applies `text` (one or more `*table … COMMIT` blocks) with
/// `iptables-restore --noflush`.
pub fn restore(text: &str) -> Result<(), IptablesError> {
    const CMD: &str = "iptables-restore";
    // -w: wait for the xtables lock instead of failing while kube-proxy holds it.
    let mut child = Command::new(CMD)
        .args(["-w", "5", "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| IptablesError::Spawn { cmd: CMD, source })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(text.as_bytes()).map_err(|source| IptablesError::Spawn { cmd: CMD, source })?;
    }
    let out = child.wait_with_output().map_err(|source| IptablesError::Spawn { cmd: CMD, source })?;
    check(CMD, &out)?;
    Ok(())
}

/// Like [`save`], with each rule's packet and byte counters (`iptables-save -c`).
pub fn save_counted(table: &str) -> Result<String, IptablesError> {
    run_save(&["-c", "-t", table])
}

fn run_save(args: &[&str]) -> Result<String, IptablesError> {
    const CMD: &str = "iptables-save";
    let out = Command::new(CMD).args(args).output().map_err(|source| IptablesError::Spawn { cmd: CMD, source })?;
    check(CMD, &out)?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `Failed` with the command's stderr when it did not exit 0.
fn check(cmd: &'static str, out: &std::process::Output) -> Result<(), IptablesError> {
    if out.status.success() {
        return Ok(());
    }
    Err(IptablesError::Failed {
        cmd,
        status: out.status,
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    })
}
