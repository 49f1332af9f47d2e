//! `weft explain --probe`: the agent of the source pod's node opens one
//! connection from inside the pod, and the flow records it made on that
//! node are read back, beside what the policy model said.

use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use weft_agent::policy::model::Proto;
use weft_proto::flows::v1::flows_client::FlowsClient;
use weft_proto::flows::v1::{Filter, Flow, ProbeOutcome, ProbeRequest, ProbeResponse};

use crate::flows::{json_of, list, text_of};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The probe's own wait for a handshake or an answer.
const PROBE_WAIT: Duration = Duration::from_secs(2);
/// How long the probe's flow records may take to show up.
const RECORDS_WAIT: Duration = Duration::from_secs(2);
const RECORDS_POLL: Duration = Duration::from_millis(100);

/// A probe sent, and the records it made on the source's node.
pub struct Probe {
    pub pod: String,
    pub response: ProbeResponse,
    pub flows: Vec<Flow>,
    /// Whether the datapath did what the explanation says.
    pub agrees: bool,
}

/// Asks the agent at `socket` to probe `to`:`port` from `pod`, then waits
/// (up to [`RECORDS_WAIT`]) for the records with the probe's source port.
pub async fn send(
    socket: &Path,
    pod: &str,
    (to, port, proto): (IpAddr, u16, Proto),
    allowed: bool,
) -> anyhow::Result<Probe> {
    let timeout = PROBE_WAIT + Duration::from_secs(2);
    let channel = weft_proto::unix::channel(socket, CONNECT_TIMEOUT, Some(timeout)).await?;
    let request = ProbeRequest {
        pod: pod.to_owned(),
        address: to.to_string(),
        port: u32::from(port),
        protocol: proto.as_str().to_owned(),
        timeout_ms: u32::try_from(PROBE_WAIT.as_millis()).unwrap_or(u32::MAX),
    };
    let response = FlowsClient::new(channel)
        .probe(request)
        .await
        .with_context(|| format!("the agent could not probe from {pod} (is this the agent of {pod}'s node?)"))?
        .into_inner();
    let mine = |f: &Flow| {
        let (s, d) = (f.source.clone().unwrap_or_default(), f.destination.clone().unwrap_or_default());
        s.port == response.source_port && d.port == u32::from(port) && d.address == to.to_string()
    };
    let filter = Filter { pod: pod.to_owned(), ..Filter::default() };
    let started = Instant::now();
    let flows = loop {
        let flows: Vec<Flow> = list(socket, filter.clone(), 0).await?.flows.into_iter().filter(mine).collect();
        if !flows.is_empty() || started.elapsed() >= RECORDS_WAIT {
            break flows;
        }
        tokio::time::sleep(RECORDS_POLL).await;
    };
    let outcome = ProbeOutcome::try_from(response.outcome).unwrap_or(ProbeOutcome::Unspecified);
    let through = matches!(outcome, ProbeOutcome::Connected | ProbeOutcome::Answered);
    Ok(Probe { pod: pod.to_owned(), response, flows, agrees: through == allowed })
}

fn outcome_name(o: i32) -> &'static str {
    match ProbeOutcome::try_from(o) {
        Ok(ProbeOutcome::Connected) => "connected",
        Ok(ProbeOutcome::Answered) => "answered",
        Ok(ProbeOutcome::Refused) => "refused",
        Ok(ProbeOutcome::Unreachable) => "unreachable",
        Ok(ProbeOutcome::NoAnswer) => "no answer",
        _ => "unknown",
    }
}

impl Probe {
    pub fn json(&self) -> Value {
        let r = &self.response;
        json!({
            "pod": self.pod,
            "outcome": outcome_name(r.outcome),
            "source": {"address": r.source_address, "port": r.source_port},
            "detail": r.detail,
            "agrees": self.agrees,
            "flows": self.flows.iter().map(json_of).collect::<Vec<_>>(),
        })
    }

    pub fn text(&self) -> String {
        let r = &self.response;
        let detail = if r.detail.is_empty() { String::new() } else { format!(" ({})", r.detail) };
        let agrees = if self.agrees {
            "as explained".to_owned()
        } else {
            "NOT as explained (a refusal may also be a port nothing listens on)".to_owned()
        };
        let mut out = format!(
            "probe from {} (port {}): {}{detail}: {agrees}\n",
            self.pod,
            r.source_port,
            outcome_name(r.outcome)
        );
        if self.flows.is_empty() {
            out.push_str("  no flow record of it on this node within 2 s\n");
        }
        for f in &self.flows {
            out.push_str(&format!("  {}\n", text_of(f)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_reads_as_its_outcome_and_whether_it_agrees() {
        let response = ProbeResponse {
            outcome: ProbeOutcome::Refused as i32,
            source_address: "10.0.0.1".into(),
            source_port: 40000,
            detail: "Connection refused (os error 111)".into(),
        };
        let p = Probe { pod: "dev/client".into(), response, flows: vec![], agrees: true };
        let t = p.text();
        assert!(t.starts_with("probe from dev/client (port 40000): refused (Connection refused"), "{t}");
        assert!(t.contains("as explained") && t.contains("no flow record"), "{t}");
        let j = p.json();
        assert_eq!((j["outcome"].as_str(), j["agrees"].as_bool()), (Some("refused"), Some(true)));
        assert_eq!(j["source"]["port"], 40000);
    }
}
