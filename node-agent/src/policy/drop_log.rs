//! The optional log of packets policy dropped (`--policy-drop-log-group`,
//! off by default). With it on, every drop rule is preceded by a
//! rate-limited copy of what it drops to an NFLOG group (see
//! [`render::DropLog`]); a thread of the agent reads that group and writes
//! one log line per packet: the policy and direction (from the drop
//! counter named in the record's prefix), addresses, protocol and ports;
//! and hands each to the flow recorder when flows are on (`Sink`).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::metrics::{PolicyMetrics, ResultLabels};
use super::render::{self, CounterLabels};
use crate::firewall::nflog::{self, Logged, Received};

/// What each counter of the rules last applied counts (shared with the
/// counter reader).
pub type Labels = Arc<Mutex<BTreeMap<String, CounterLabels>>>;

/// How long a read waits before looking again (nothing depends on it).
const READ_WAIT: Duration = Duration::from_secs(60);
/// Pause after a failed read, so that a broken socket does not spin.
const AFTER_ERROR: Duration = Duration::from_secs(1);

/// One dropped packet, as the log line shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// `ns/name`, `weft.dev/ns/name`, `default-deny` or `invalid`; `None`
    /// when the prefix names no counter of ours (another rule logging to
    /// the group, or rules changed since).
    pub policy: Option<String>,
    pub direction: Option<&'static str>,
    pub src: Option<IpAddr>,
    pub dst: Option<IpAddr>,
    pub proto: Option<String>,
    pub proto_number: Option<u8>,
    pub sport: Option<u16>,
    pub dport: Option<u16>,
}

/// What a record says, in words. Pure.
pub fn describe(record: &Logged, labels: &BTreeMap<String, CounterLabels>) -> Dropped {
    let l = labels.get(&record.prefix);
    let p = record.packet;
    Dropped {
        policy: l.map(|l| l.policy.clone()),
        direction: l.map(|l| l.direction.as_str()),
        src: p.map(|p| p.src),
        dst: p.map(|p| p.dst),
        proto: p.map(|p| proto_name(p.proto)),
        proto_number: p.map(|p| p.proto),
        sport: p.and_then(|p| p.ports).map(|(s, _)| s),
        dport: p.and_then(|p| p.ports).map(|(_, d)| d),
    }
}

fn proto_name(n: u8) -> String {
    match n {
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        132 => "sctp".into(),
        n => n.to_string(),
    }
}

/// Who else reads the dropped packets (the flow recorder): told of each,
/// and of records the kernel dropped.
pub trait Sink: Send + Sync {
    fn dropped(&self, d: &Dropped);
    fn lost(&self);
}

/// Where the records go: log lines (`lines`), and `sink` if any.
pub struct Readers {
    pub lines: bool,
    pub sink: Option<Arc<dyn Sink>>,
}

/// Starts the reader thread, which binds the group in the caller's network
/// namespace (the node's; a new thread starts in its creator's) on its own
/// thread, off the runtime's. A bind error (the group taken, no
/// permission) is logged there and leaves policy enforced, only the log
/// missing.
pub fn start(
    log: render::DropLog,
    labels: Labels,
    metrics: Arc<PolicyMetrics>,
    readers: Readers,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("policy-drop-log".into()).spawn(move || match nflog::Group::bind(log.group) {
        Ok(group) => {
            tracing::info!(
                group = log.group,
                per_second = log.per_second,
                lines = readers.lines,
                "policy drop log: reading NFLOG group"
            );
            read_forever(group, &labels, &metrics, &readers)
        }
        Err(e) => tracing::error!(
            error = %e,
            group = log.group,
            "policy drop log unavailable; policy is enforced without it"
        ),
    })?;
    Ok(())
}

fn read_forever(mut group: nflog::Group, labels: &Labels, metrics: &PolicyMetrics, readers: &Readers) {
    loop {
        match group.recv(READ_WAIT) {
            Ok(Received::Packets(records)) if records.is_empty() => {}
            Ok(Received::Packets(records)) => {
                let lines: Vec<(Dropped, &Logged)> = {
                    let labels = labels.lock().unwrap_or_else(|p| p.into_inner());
                    records.iter().map(|r| (describe(r, &labels), r)).collect()
                };
                for (d, record) in lines {
                    if readers.lines {
                        log_line(&d, record);
                    }
                    if let Some(sink) = &readers.sink {
                        sink.dropped(&d);
                    }
                }
                metrics.drop_log.get_or_create(&ResultLabels { result: "logged" }).inc_by(records.len() as u64);
            }
            Ok(Received::Lost) => {
                metrics.drop_log.get_or_create(&ResultLabels { result: "lost" }).inc();
                if let Some(sink) = &readers.sink {
                    sink.lost();
                }
                tracing::warn!("policy drop log: the kernel dropped records (read too slowly)");
            }
            Err(e) => {
                tracing::warn!(error = %e, "policy drop log: read failed");
                std::thread::sleep(AFTER_ERROR);
            }
        }
    }
}

fn log_line(d: &Dropped, record: &Logged) {
    let show = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    match &d.policy {
        Some(policy) => tracing::info!(
            target: "weft_agent::policy::drops",
            policy = %policy,
            direction = %d.direction.unwrap_or("-"),
            src = %show(d.src.map(|a| a.to_string())),
            dst = %show(d.dst.map(|a| a.to_string())),
            proto = %show(d.proto.clone()),
            sport = %show(d.sport.map(|p| p.to_string())),
            dport = %show(d.dport.map(|p| p.to_string())),
            "packet dropped by policy"
        ),
        // Not one of our counters: the prefix is someone else's text, shown escaped.
        None => tracing::info!(
            target: "weft_agent::policy::drops",
            prefix = ?record.prefix,
            src = %show(d.src.map(|a| a.to_string())),
            dst = %show(d.dst.map(|a| a.to_string())),
            "packet logged to the drop log's group by a rule that is not Weft's current policy"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::firewall::nflog::Packet;
    use crate::policy::model::{Direction, Verdict};

    #[test]
    fn a_record_names_its_policy_direction_and_packet() {
        let labels = BTreeMap::from([(
            "policy-count-in-dropped-0123456789abcdef".to_owned(),
            CounterLabels {
                policy: "weft.dev/prod/deny".into(),
                direction: Direction::Ingress,
                verdict: Verdict::Drop,
            },
        )]);
        let packet = Packet {
            src: "10.0.1.1".parse().unwrap(),
            dst: "10.0.1.2".parse().unwrap(),
            proto: 17,
            ports: Some((4, 7)),
        };
        let d = describe(
            &Logged { prefix: "policy-count-in-dropped-0123456789abcdef".into(), packet: Some(packet) },
            &labels,
        );
        assert_eq!(d.policy.as_deref(), Some("weft.dev/prod/deny"));
        assert_eq!(d.direction, Some("ingress"));
        assert_eq!((d.src, d.dst), (Some(packet.src), Some(packet.dst)));
        assert_eq!((d.proto.as_deref(), d.sport, d.dport), (Some("udp"), Some(4), Some(7)));

        let stranger = describe(&Logged { prefix: "someone else\n".into(), packet: None }, &labels);
        assert_eq!((stranger.policy, stranger.direction, stranger.proto), (None, None, None));
        assert_eq!(proto_name(1), "icmp");
        assert_eq!(proto_name(47), "47");
    }
}
