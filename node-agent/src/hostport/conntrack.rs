//! Flushing UDP conntrack entries of a host port, with the `conntrack` tool.
//! A stale entry (from before the DNAT existed, or pointing at a pod that is
//! gone) would keep steering a UDP flow past the current rules.

use std::process::Command;

/// Deletes UDP conntrack entries whose original destination port is one of
/// `ports`. Best effort: a failure is logged, never fatal (TCP is unaffected
/// and UDP entries expire on their own).
pub async fn flush_udp(ports: Vec<u16>) {
    if ports.is_empty() {
        return;
    }
    let jobs = ports.into_iter().map(|port| {
        tokio::task::spawn_blocking(move || {
            let out =
                Command::new("conntrack").args(["-D", "-p", "udp", "--orig-port-dst", &port.to_string()]).output();
            match out {
                // 1 means "nothing matched", which is the usual case.
                Ok(o) if o.status.success() || o.status.code() == Some(1) => {}
                Ok(o) => {
                    tracing::warn!(port, stderr = %String::from_utf8_lossy(&o.stderr).trim(), "conntrack flush failed")
                }
                Err(e) => tracing::warn!(port, error = %e, "cannot run conntrack to flush UDP entries"),
            }
        })
    });
    for job in futures::future::join_all(jobs).await {
        if let Err(e) = job {
            tracing::warn!(error = %e, "conntrack flush task failed");
        }
    }
}
