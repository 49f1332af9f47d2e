//! What the sandbox and the real-node cluster share: a supervisor process
//! started by `up` that writes a JSON state file once everything is ready,
//! and is stopped by `down` with SIGTERM.

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::control_plane::process;

/// Reads a state file; `missing` says what to do when it does not exist.
pub fn load_state<T: DeserializeOwned>(path: &Path, missing: &str) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{missing} ({} missing)", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("corrupt {}", path.display()))
}

/// Writes a state file atomically.
pub fn save_state<T: Serialize>(path: &Path, state: &T) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(state)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("saving {}", path.display()))
}

/// Waits until `ready` returns the state the supervisor `child` wrote,
/// failing with its log when it exits or `timeout` passes.
pub fn wait_for_ready<T>(
    what: &str,
    child: &mut Child,
    log: &Path,
    timeout: Duration,
    ready: impl Fn() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("the {what} supervisor exited ({status}); its log:\n{}", process::log_tail(log, 8000));
        }
        if let Ok(state) = ready() {
            return Ok(state);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("the {what} was not ready within {timeout:?}; log:\n{}", process::log_tail(log, 8000));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Sends SIGTERM to a supervisor and waits up to `timeout` for it to finish
/// tearing down.
pub fn stop(pid: u32, timeout: Duration) {
    let alive = || {
        // SAFETY: signal 0 only checks for existence.
        unsafe { libc::kill(pid as i32, 0) == 0 }
    };
    // SAFETY: plain kill(2).
    if unsafe { libc::kill(pid as i32, libc::SIGTERM) } == 0 {
        let deadline = Instant::now() + timeout;
        while alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
