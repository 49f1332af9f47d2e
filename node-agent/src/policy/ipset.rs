//! Running `ipset save` and `ipset restore`. Weft only ever names sets
//! with its own prefix (`weft-pol-`), so other components' sets are never
//! touched. Blocking; acts in the calling thread's network namespace.

use std::io::Write;
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum IpsetError {
    #[error("cannot run ipset: {0}")]
    Spawn(#[from] std::io::Error),
    #[error("ipset {verb} failed ({status}): {stderr}")]
    Failed { verb: &'static str, status: std::process::ExitStatus, stderr: String },
}

/// `ipset save` of every set (the caller filters ours).
pub fn save() -> Result<String, IpsetError> {
    let out = Command::new("ipset").arg("save").output()?;
    if !out.status.success() {
        return Err(IpsetError::Failed {
            verb: "save",
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Feeds `text` (create/flush/add/destroy lines) to `ipset restore`.
pub fn restore(text: &str) -> Result<(), IpsetError> {
    let mut child = Command::new("ipset")
        .arg("restore")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(IpsetError::Failed {
            verb: "restore",
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}
