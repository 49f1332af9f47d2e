//! `weft flows`: flow records, listed or followed, as text or JSON lines:
//! every node's through the flows.weft.dev API (the caller's own rights
//! decide which namespaces), or with `--socket` one node's from its agent.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use weft_proto::flows::v1::flows_client::FlowsClient;
use weft_proto::flows::v1::{Endpoint, Filter, Flow, ListRequest, ListResponse, Verdict};
use weft_proto::flows_json::{event_name, verdict_name};

/// How long the agent may take to accept the connection, and to answer a list.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Read one node's records from its agent's socket (on the node; in the
    /// agent's container its WEFT_AGENT_SOCKET, so `kubectl exec` finds it
    /// whatever the chart's runDir) instead of every node's through the API.
    #[arg(long, env = "WEFT_AGENT_SOCKET")]
    pub socket: Option<PathBuf>,
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

fn filter_of(args: &Args) -> Filter {
    Filter {
        namespaces: args.namespaces.clone(),
        pod: args.pod.clone().unwrap_or_default(),
        verdict: match args.verdict {
            None => Verdict::Unspecified,
            Some(VerdictArg::Forwarded) => Verdict::Forwarded,
            Some(VerdictArg::Dropped) => Verdict::Dropped,
            Some(VerdictArg::Rejected) => Verdict::Rejected,
        } as i32,
    }
}

/// One node's records, from the agent's socket.
pub async fn run_local(socket: &std::path::Path, args: &Args) -> anyhow::Result<()> {
    let filter = filter_of(args);
    if !args.follow {
        print_list(&list(socket, filter, args.limit).await?, args.output);
        return Ok(());
    }
    let channel = weft_proto::unix::channel(socket, CONNECT_TIMEOUT, None).await?;
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

/// A record as JSON (the field names of `weft.flows.v1.Flow`, in camelCase).
pub fn json_of(f: &Flow) -> Value {
    weft_proto::flows_json::to_json(f)
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

/// The API's path for `namespace`'s records (None: every namespace's).
fn api_path(namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) => format!("/apis/flows.weft.dev/v1alpha1/namespaces/{ns}/flows"),
        None => "/apis/flows.weft.dev/v1alpha1/flows".to_owned(),
    }
}

/// The query of a list or follow (values are validated names: only the
/// pod's slash needs escaping).
fn api_query(args: &Args) -> String {
    let mut q = Vec::new();
    let verdict = filter_of(args).verdict;
    if verdict != Verdict::Unspecified as i32 {
        q.push(format!("verdict={}", verdict_name(verdict)));
    }
    if let Some(pod) = &args.pod {
        q.push(format!("pod={}", pod.replace('/', "%2F")));
    }
    if args.limit > 0 {
        q.push(format!("limit={}", args.limit));
    }
    if args.follow {
        q.push("watch=true".to_owned());
    }
    q.join("&")
}

fn get(path: &str, query: &str) -> anyhow::Result<http::Request<Vec<u8>>> {
    let uri = if query.is_empty() { path.to_owned() } else { format!("{path}?{query}") };
    http::Request::get(uri).body(Vec::new()).context("building the flows request")
}

/// Every node's records through the flows.weft.dev API, with the caller's
/// own rights: per namespace asked for, or (none asked) every namespace's.
pub async fn run_api(client: &kube::Client, args: &Args) -> anyhow::Result<()> {
    let namespaces: Vec<Option<&str>> = match args.namespaces.as_slice() {
        [] => vec![None],
        many => many.iter().map(|n| Some(n.as_str())).collect(),
    };
    let query = api_query(args);
    if args.follow {
        let [namespace] = namespaces.as_slice() else {
            anyhow::bail!("--follow takes one --namespace, or none for every namespace");
        };
        let path = api_path(*namespace);
        let stream = client
            .request_stream(get(&path, &query)?)
            .await
            .with_context(|| format!("following {path} (is the flows API installed and may you read it?)"))?;
        use futures::{AsyncBufReadExt, TryStreamExt};
        let mut lines = stream.lines();
        while let Some(line) = lines.try_next().await.context("reading the followed flows")? {
            let value: Value = serde_json::from_str(&line).context("a followed record is not JSON")?;
            let flow = weft_proto::flows_json::from_json(&value).map_err(anyhow::Error::msg)?;
            print_flow(&flow, args.output);
        }
        return Ok(());
    }
    let mut flows = Vec::new();
    for namespace in namespaces {
        let path = api_path(namespace);
        let list: Value = client
            .request(get(&path, &query)?)
            .await
            .with_context(|| format!("listing {path} (is the flows API installed and may you read it?)"))?;
        for item in list["items"].as_array().map(Vec::as_slice).unwrap_or_default() {
            flows.push(weft_proto::flows_json::from_json(item).map_err(anyhow::Error::msg)?);
        }
        for node in list["nodes"].as_array().map(Vec::as_slice).unwrap_or_default() {
            let name = node["node"].as_str().unwrap_or("?");
            if let Some(e) = node["error"].as_str() {
                eprintln!("weft: node {name} did not answer: {e}");
            } else if node["lost"].as_u64().unwrap_or(0) > 0 {
                eprintln!("weft: node {name} lost records at least {} times (the kernel dropped events)", node["lost"]);
            }
        }
    }
    flows.sort_by_key(|f| (f.time_unix_ms, f.node.clone(), f.seq));
    flows.dedup_by(|a, b| a.node == b.node && a.seq == b.seq);
    if args.limit > 0 && flows.len() > args.limit as usize {
        flows.drain(..flows.len() - args.limit as usize);
    }
    for flow in &flows {
        print_flow(flow, args.output);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_record_reads_as_one_line_and_as_json() {
        let end = |address: &str, port: u16, ns: &str, pod: &str| json!({"address": address, "port": port, "namespace": ns, "pod": pod});
        let record = json!({
            "seq": 3, "timeUnixMs": 1000, "node": "n1", "event": "denied", "protocol": 6,
            "source": end("10.0.1.3", 40000, "dev", "client"), "destination": end("10.0.2.7", 80, "prod", "db"),
            "verdict": "rejected", "policy": "prod/db", "direction": "ingress", "rule": -1, "packets": 1, "bytes": 0,
        });
        let f = weft_proto::flows_json::from_json(&record).unwrap();
        assert_eq!(
            text_of(&f),
            "1000 n1 denied dev/client (10.0.1.3:40000) -> prod/db (10.0.2.7:80) TCP rejected by prod/db (ingress isolation) 1 packets 0 bytes"
        );
        assert_eq!(json_of(&f), record);
        assert!(parse_pod("prod/db").is_ok() && parse_pod("prod").is_err() && parse_namespace("A").is_err());
    }
}
