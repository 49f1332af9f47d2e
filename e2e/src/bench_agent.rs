//! A weft-agent measured by the policy and scale benchmarks from outside,
//! as an operator would: its metrics (read in-process, every few
//! milliseconds while a change is timed), its passes and its memory.

use std::io::{Read, Write};
use std::process::Child;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::wait;

/// Where the benchmarks' agent serves its metrics.
pub const METRICS_ADDR: &str = "127.0.0.1:9646";
/// How often the agent's metrics are looked at while a change is timed.
pub const POLL: Duration = Duration::from_millis(5);

/// The agent's answer to `GET path` on its metrics address (status line,
/// headers and body), fetched in-process: polled every few milliseconds,
/// a curl per poll would take CPU from the agent being measured. `None`
/// while it does not answer.
pub fn get(path: &str) -> Option<String> {
    let fetch = || -> std::io::Result<String> {
        let addr = METRICS_ADDR.parse().map_err(std::io::Error::other)?;
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer)
    };
    fetch().ok()
}

/// The agent's metrics; empty while it does not answer.
pub fn metrics() -> String {
    get("/metrics").unwrap_or_default()
}

/// Whether the agent answers `/readyz` with 200.
pub fn ready() -> bool {
    get("/readyz").is_some_and(|a| a.starts_with("HTTP/1.0 200") || a.starts_with("HTTP/1.1 200"))
}

/// The value of the first line of `text` starting with `line_start`, 0 if none.
pub fn metric(text: &str, line_start: &str) -> f64 {
    text.lines().find(|l| l.starts_with(line_start)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0.0)
}

/// (applied syncs, sync seconds sum).
pub fn syncs() -> (f64, f64) {
    syncs_in(&metrics())
}

fn syncs_in(m: &str) -> (f64, f64) {
    (
        metric(m, "weft_agent_policy_syncs_total{result=\"applied\"}"),
        metric(m, "weft_agent_policy_sync_duration_seconds_sum"),
    )
}

/// An applied sync, timed from the change that caused it.
#[derive(Clone, Copy, Debug)]
pub struct Synced {
    /// To the pass's kernel write, by the agent's own clock
    /// (`weft_agent_policy_last_write_timestamp_seconds`): what a change
    /// costs. An agent without the metric gives `seen`.
    pub written: Duration,
    /// To the poll that saw it (up to [`POLL`] later: how earlier figures
    /// were taken).
    pub seen: Duration,
    /// The time of every pass the agent ran meanwhile, unchanged ones
    /// included, seconds.
    pub passes: f64,
}

/// Waits for the next applied sync after `before` (the change was made at
/// `started`).
pub fn next_sync(before: (f64, f64), started: Instant) -> Synced {
    let started_wall = SystemTime::now() - started.elapsed();
    let found = wait::until_every("the agent to apply a sync", Duration::from_secs(300), POLL, || {
        let m = metrics();
        let now = syncs_in(&m);
        (now.0 > before.0)
            .then(|| (started.elapsed(), now.1, metric(&m, "weft_agent_policy_last_write_timestamp_seconds ")))
    });
    let (seen, passes, written) = found;
    Synced { written: to_write(started_wall, written).unwrap_or(seen).min(seen), seen, passes: passes - before.1 }
}

/// From `started` to the agent's write at Unix time `written` (seconds);
/// None when the agent gave no time (0) or one before `started`.
fn to_write(started: SystemTime, written: f64) -> Option<Duration> {
    let written = UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(written).ok().filter(|d| !d.is_zero())?)?;
    written.duration_since(started).ok()
}

/// A process's resident memory, MiB (0 when it is gone).
pub fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// CPU time a process has used so far (user + system), seconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command (which may hold spaces) in parentheses.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after it.
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
    (ticks(11) + ticks(12)) / hz
}

/// The `p`th percentile of `samples`, in seconds.
pub fn percentile(samples: &[Duration], p: usize) -> f64 {
    let mut v: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
    v.sort_by(f64::total_cmp);
    v.get((v.len() * p / 100).min(v.len().saturating_sub(1))).copied().unwrap_or(f64::NAN)
}

/// A process stopped however the bench ends (a panic included).
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metric_is_read_by_its_line_and_a_missing_one_is_zero() {
        let text = "# HELP x\nweft_agent_policy_rules 12\nweft_agent_policy_syncs_total{result=\"applied\"} 3\n";
        assert_eq!(metric(text, "weft_agent_policy_rules "), 12.0);
        assert_eq!(metric(text, "weft_agent_policy_syncs_total{result=\"applied\"}"), 3.0);
        assert_eq!(metric(text, "weft_agent_nothing "), 0.0);
    }

    #[test]
    fn a_change_is_timed_to_the_agents_write_when_it_gives_one() {
        let started = UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(to_write(started, 1_000.012), Some(Duration::from_secs_f64(1_000.012) - Duration::from_secs(1_000)));
        assert_eq!(to_write(started, 0.0), None, "no write yet");
        assert_eq!(to_write(started, 999.5), None, "a write before the change");
        assert_eq!(to_write(started, f64::NAN), None);
    }

    #[test]
    fn this_process_has_memory_and_percentiles_pick_by_rank() {
        assert!(rss_mib(std::process::id()) > 0.0);
        assert!(cpu_seconds(std::process::id()) >= 0.0);
        let ms = |v: u64| Duration::from_millis(v);
        let samples = [ms(5), ms(1), ms(3), ms(2), ms(4)];
        assert_eq!(percentile(&samples, 50), 0.003);
        assert_eq!(percentile(&samples, 95), 0.005);
    }
}
