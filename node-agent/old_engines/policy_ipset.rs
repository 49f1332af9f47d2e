//! Running `ipset save` and `ipset restore`. Weft only ever names sets
//! with its own prefix (`weft-pol-`), so other components' sets are never
//! touched. Blocking, with a deadline per run; acts in the calling thread's
//! network namespace.

use std::time::Duration;

use crate::dataplane::exec;

pub type IpsetError = exec::ExecError;

const TIMEOUT: Duration = Duration::from_secs(15);

/// `ipset save` of every set (the caller filters ours).
pub fn save() -> Result<String, IpsetError> {
    Ok(exec::run_ok("ipset", &["save"], None, TIMEOUT, &[])?.stdout)
}

/// Feeds `text` (create/flush/add/destroy lines) to `ipset restore`.
pub fn restore(text: &str) -> Result<(), IpsetError> {
    exec::run_ok("ipset", &["restore"], Some(text.as_bytes()), TIMEOUT, &[]).map(drop)
}
