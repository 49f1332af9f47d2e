//! Running `iptables-save` and `iptables-restore --noflush`: the only way
//! Weft writes iptables. A restore is atomic per table and touches only the
//! chains and rules its input names, so Weft never flushes what others own.
//! Blocking (spawns processes, each with a deadline): call from a blocking
//! context. Acts in the calling thread's network namespace.

use std::time::Duration;

use super::exec;

pub type IptablesError = exec::ExecError;

/// Longer than `-w` below: a restore that waited for the xtables lock in
/// vain reports that itself; anything slower is stuck and killed.
const TIMEOUT: Duration = Duration::from_secs(15);

/// The rules of one table, as `iptables-save -t <table>` prints them.
pub fn save(table: &str) -> Result<String, IptablesError> {
    Ok(exec::run_ok("iptables-save", &["-t", table], None, TIMEOUT, &[])?.stdout)
}

#[cfg(test)] // the iptables-era policy engine, the benchmark peer
/// Like [`save`], with each rule's packet and byte counters (`iptables-save -c`).
pub fn save_counted(table: &str) -> Result<String, IptablesError> {
    Ok(exec::run_ok("iptables-save", &["-c", "-t", table], None, TIMEOUT, &[])?.stdout)
}

/// Applies `text` (one or more `*table … COMMIT` blocks) with
/// `iptables-restore --noflush`.
pub fn restore(text: &str) -> Result<(), IptablesError> {
    // -w: wait for the xtables lock instead of failing while kube-proxy holds it.
    exec::run_ok("iptables-restore", &["-w", "5", "--noflush"], Some(text.as_bytes()), TIMEOUT, &[]).map(drop)
}
