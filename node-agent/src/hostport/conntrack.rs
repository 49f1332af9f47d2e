//! Flushing UDP conntrack entries of a host port, with the `conntrack` tool.
//! A stale entry (from before the DNAT existed, or pointing at a pod that is
//! gone) would keep steering a UDP flow past the current rules.

use std::time::Duration;

use crate::dataplane::exec;

/// One flush takes milliseconds; a stuck one must not hold up DEL.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Deletes UDP conntrack entries whose original destination port is one of
/// `ports`. Best effort: a failure is logged, never fatal (TCP is unaffected
/// and UDP entries expire on their own).
pub async fn flush_udp(ports: Vec<u16>) {
    if ports.is_empty() {
        return;
    }
    let jobs = ports.into_iter().map(|port| {
        tokio::task::spawn_blocking(move || {
            let port_arg = port.to_string();
            let args = ["-D", "-p", "udp", "--orig-port-dst", &port_arg];
            // 1 means "nothing matched", which is the usual case.
            if let Err(e) = exec::run_ok("conntrack", &args, None, TIMEOUT, &[1]) {
                tracing::warn!(port, error = %e, "cannot flush the port's UDP conntrack entries");
            }
        })
    });
    for job in futures::future::join_all(jobs).await {
        if let Err(e) = job {
            tracing::warn!(error = %e, "conntrack flush task failed");
        }
    }
}
