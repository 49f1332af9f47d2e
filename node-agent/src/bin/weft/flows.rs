//! `weft flows`: one node's flow records, from its agent's socket
//! (`--socket`, on the node), listed or followed, as text or JSON lines.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};
use weft_agent::flows::recorder::{event_name, verdict_name};
use weft_proto::flows::v1::flows_client::FlowsClient;
use weft_proto::flows::v1::{Endpoint, Filter, Flow, ListRequest, ListResponse, Verdict};

/// How long the agent may take to accept the connection, and to answer a list.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The agent's socket on this node (in the agent's container, its
    /// WEFT_AGENT_SOCKET: `kubectl exec` finds it whatever the chart's runDir).
    #[arg(long, env = "WEFT_AGENT_SOCKET", default_value = weft_proto::DEFAULT_AGENT_SOCKET)]
    socket: PathBuf,
    /// Only records with a pod of this namespace at either end (repeatable).
    #[arg(long = "namespace", short = 'n', value_parser = parse_namespace)]
    namespaces: Vec<String>,
    /// Only records with this pod (NAMESPACE/NAME) at either end.
    #[arg(long, value_parser = parse_pod)]
    pod: Option<String>,
    /// Only records with this verdict.
    #[arg(long, value_enum)]
    verdict: Option<VerdictArg>,
    /// At most this many of the newest records (0: all held).
    #[arg(long, default_value_t = 0)]
    limit: u32,
    /// Keep printing new records as they come.
    #[arg(long, short = 'f')]
    follow: bool,
    /// Output format (json: one object per line).
    #[arg(short, long, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum VerdictArg {
    Forwarded,
    Dropped,
    Rejected,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    Text,
    Json,
}

fn parse_namespace(s: &str) -> Result<String, String> {
    weft_proto::validate::namespace(s).map(|()| s.to_owned())
}

fn parse_pod(s: &str) -> Result<String, String> {
    let (ns, name) = s.split_once('/').ok_or_else(|| format!("{s:?} is not NAMESPACE/NAME"))?;
    weft_proto::validate::namespace(ns)?;
    weft_proto::validate::pod_name(name)?;
    Ok(s.to_owned())
}

pub async fn run(args: &Args) -> anyhow::Result<()> {
    let filter = Filter {
        namespaces: args.namespaces.clone(),
        pod: args.pod.clone().unwrap_or_default(),
        verdict: match args.verdict {
            None => Verdict::Unspecified,
            Some(VerdictArg::Forwarded) => Verdict::Forwarded,
            Some(VerdictArg::Dropped) => Verdict::Dropped,
            Some(VerdictArg::Rejected) => Verdict::Rejected,
        } as i32,
    };
    if !args.follow {
        print_list(&list(&args.socket, filter, args.limit).await?, args.output);
        return Ok(());
    }
    let channel = weft_proto::unix::channel(&args.socket, CONNECT_TIMEOUT, None).await?;
    let request = ListRequest { filter: Some(filter), limit: args.limit };
    let mut stream =
        FlowsClient::new(channel).follow(request).await.context("following the agent's flows")?.into_inner();
    while let Some(flow) = stream.message().await.context("reading the agent's flows")? {
        print_flow(&flow, args.output);
    }
    Ok(())
}

/// The records the agent at `socket` holds now that `filter` admits (the
/// newest `limit`; 0: all).
pub async fn list(socket: &std::path::Path, filter: Filter, limit: u32) -> anyhow::Result<ListResponse> {
    let channel = weft_proto::unix::channel(socket, CONNECT_TIMEOUT, Some(LIST_TIMEOUT)).await?;
    let request = ListRequest { filter: Some(filter), limit };
    Ok(FlowsClient::new(channel).list(request).await.context("listing the agent's flows")?.into_inner())
}

fn print_list(list: &ListResponse, output: Output) {
    for flow in &list.flows {
        print_flow(flow, output);
    }
    if list.lost > 0 {
        eprintln!("weft: node {} lost records at least {} times (the kernel dropped events)", list.node, list.lost);
    }
}

fn print_flow(f: &Flow, output: Output) {
    match output {
        Output::Json => println!("{}", json_of(f)),
        Output::Text => println!("{}", text_of(f)),
    }
}

fn end_json(e: Option<&Endpoint>) -> Value {
    let e = e.cloned().unwrap_or_default();
    json!({"address": e.address, "port": e.port, "namespace": e.namespace, "pod": e.pod})
}

/// A record as JSON (the field names of `weft.flows.v1.Flow`, in camelCase).
pub fn json_of(f: &Flow) -> Value {
    json!({
        "seq": f.seq,
        "timeUnixMs": f.time_unix_ms,
        "node": f.node,
        "event": event_name(f.event),
        "protocol": f.protocol,
        "source": end_json(f.source.as_ref()),
        "destination": end_json(f.destination.as_ref()),
        "verdict": verdict_name(f.verdict),
        "policy": f.policy,
        "direction": f.direction,
        "rule": f.rule,
        "packets": f.packets,
        "bytes": f.bytes,
    })
}

/// A record on one line.
pub fn text_of(f: &Flow) -> String {
    let end = |e: Option<&Endpoint>| {
        let e = e.cloned().unwrap_or_default();
        let at = if e.port == 0 { e.address } else { format!("{}:{}", e.address, e.port) };
        if e.pod.is_empty() { at } else { format!("{}/{} ({at})", e.namespace, e.pod) }
    };
    let proto = match f.protocol {
        6 => "TCP".to_owned(),
        17 => "UDP".to_owned(),
        132 => "SCTP".to_owned(),
        1 => "ICMP".to_owned(),
        58 => "ICMPv6".to_owned(),
        n => n.to_string(),
    };
    let by = match (f.policy.as_str(), f.rule) {
        ("", _) => "no policy".to_owned(),
        (p, r) if r >= 0 => format!("{p} spec.{}[{r}]", f.direction),
        (p, _) => format!("{p} ({} isolation)", f.direction),
    };
    let counted = if f.packets > 0 { format!(" {} packets {} bytes", f.packets, f.bytes) } else { String::new() };
    format!(
        "{} {} {} {} -> {} {proto} {} by {by}{counted}",
        f.time_unix_ms,
        f.node,
        event_name(f.event),
        end(f.source.as_ref()),
        end(f.destination.as_ref()),
        verdict_name(f.verdict)
    )
}

#[cfg(test)]
mod tests {
    use weft_proto::flows::v1::Event;

    use super::*;

    #[test]
    fn a_record_reads_as_one_line_and_as_json() {
        let end = |address: &str, port, ns: &str, pod: &str| Endpoint {
            address: address.into(),
            port,
            namespace: ns.into(),
            pod: pod.into(),
        };
        let f = Flow {
            seq: 3,
            time_unix_ms: 1000,
            node: "n1".into(),
            event: Event::Denied as i32,
            protocol: 6,
            source: Some(end("10.0.1.3", 40000, "dev", "client")),
            destination: Some(end("10.0.2.7", 80, "prod", "db")),
            verdict: Verdict::Rejected as i32,
            policy: "prod/db".into(),
            direction: "ingress".into(),
            rule: -1,
            packets: 1,
            bytes: 0,
        };
        assert_eq!(
            text_of(&f),
            "1000 n1 denied dev/client (10.0.1.3:40000) -> prod/db (10.0.2.7:80) TCP rejected by prod/db (ingress isolation) 1 packets 0 bytes"
        );
        let j = json_of(&f);
        assert_eq!((j["verdict"].as_str(), j["event"].as_str()), (Some("rejected"), Some("denied")));
        assert_eq!(j["destination"]["pod"], "db");
        assert!(parse_pod("prod/db").is_ok() && parse_pod("prod").is_err() && parse_namespace("A").is_err());
    }
}
