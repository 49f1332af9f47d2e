//! `weft.flows.v1.Flows` over the agent's socket: the ring's records,
//! filtered; and following them. Filters are checked where they enter.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::broadcast::error::RecvError;
use tonic::{Request, Response, Status};
use weft_proto::flows::v1::flows_server::Flows;
use weft_proto::flows::v1::{
    Filter, Flow, ListRequest, ListResponse, ProbeOutcome, ProbeRequest, ProbeResponse, Verdict,
};

use super::metrics::{FlowMetrics, ReasonLabels};
use super::ring::{self, Ring};
use crate::dataplane::probe::{self, Outcome, Transport};

/// Namespaces one filter may name.
const MAX_NAMESPACES: usize = 1024;
/// How long a probe waits for its handshake or answer, unless asked; and at most.
const PROBE_WAIT: Duration = Duration::from_secs(2);
const PROBE_WAIT_MAX: Duration = Duration::from_secs(10);

/// Where a pod attached on this node has its network namespace, by NAMESPACE/NAME.
pub type PodNetns = Arc<dyn Fn(&str) -> Option<PathBuf> + Send + Sync>;

#[derive(Clone)]
pub struct FlowService {
    node: String,
    ring: Arc<Ring>,
    metrics: Arc<FlowMetrics>,
    pods: Option<PodNetns>,
}

impl FlowService {
    pub fn new(node: &str, ring: Arc<Ring>, metrics: Arc<FlowMetrics>) -> Self {
        FlowService { node: node.to_owned(), ring, metrics, pods: None }
    }

    /// Lets the service send probes from the pods `pods` finds.
    pub fn with_probes(self, pods: PodNetns) -> Self {
        FlowService { pods: Some(pods), ..self }
    }
}

fn check_pod(pod: &str) -> Result<(), Status> {
    let (ns, name) = pod
        .split_once('/')
        .ok_or_else(|| Status::invalid_argument(format!("invalid pod {pod:?}: it must be NAMESPACE/NAME")))?;
    weft_proto::validate::namespace(ns).map_err(Status::invalid_argument)?;
    weft_proto::validate::pod_name(name).map_err(Status::invalid_argument)
}

/// A probe request checked where it enters: what to send, where, how long to wait.
pub fn check_probe(r: &ProbeRequest) -> Result<(Transport, SocketAddr, Duration), Status> {
    check_pod(&r.pod)?;
    let addr: IpAddr =
        r.address.parse().map_err(|_| Status::invalid_argument(format!("invalid address {:?}", r.address)))?;
    let port = u16::try_from(r.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| Status::invalid_argument(format!("invalid port {}: 1 to 65535", r.port)))?;
    let transport = match r.protocol.to_ascii_uppercase().as_str() {
        "TCP" => Transport::Tcp,
        "UDP" => Transport::Udp,
        _ => return Err(Status::invalid_argument(format!("cannot probe over {:?}: TCP or UDP", r.protocol))),
    };
    let wait = match r.timeout_ms {
        0 => PROBE_WAIT,
        ms => Duration::from_millis(u64::from(ms)).min(PROBE_WAIT_MAX),
    };
    Ok((transport, SocketAddr::new(addr, port), wait))
}

fn outcome(o: Outcome) -> ProbeOutcome {
    match o {
        Outcome::Connected => ProbeOutcome::Connected,
        Outcome::Answered => ProbeOutcome::Answered,
        Outcome::Refused => ProbeOutcome::Refused,
        Outcome::Unreachable => ProbeOutcome::Unreachable,
        Outcome::NoAnswer => ProbeOutcome::NoAnswer,
    }
}

/// Refuses a filter naming something no Kubernetes object can be called.
pub fn check_filter(f: &Filter) -> Result<(), Status> {
    if f.namespaces.len() > MAX_NAMESPACES {
        return Err(Status::invalid_argument(format!("a filter names at most {MAX_NAMESPACES} namespaces")));
    }
    for ns in &f.namespaces {
        weft_proto::validate::namespace(ns).map_err(Status::invalid_argument)?;
    }
    if !f.pod.is_empty() {
        check_pod(&f.pod)?;
    }
    Verdict::try_from(f.verdict).map_err(|_| Status::invalid_argument(format!("unknown verdict {}", f.verdict)))?;
    Ok(())
}

pub type FlowStream = Pin<Box<dyn Stream<Item = Result<Flow, Status>> + Send>>;

#[tonic::async_trait]
impl Flows for FlowService {
    async fn list(&self, req: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let req = req.into_inner();
        let filter = req.filter.unwrap_or_default();
        check_filter(&filter)?;
        let flows = self.ring.list(&filter, req.limit as usize).iter().map(|f| Flow::clone(f)).collect();
        let counts = self.ring.counts();
        Ok(Response::new(ListResponse {
            flows,
            lost: counts.lost,
            evicted: counts.evicted,
            capacity: u32::try_from(self.ring.capacity()).unwrap_or(u32::MAX),
            node: self.node.clone(),
        }))
    }

    type FollowStream = FlowStream;

    async fn follow(&self, req: Request<ListRequest>) -> Result<Response<FlowStream>, Status> {
        let filter = req.into_inner().filter.unwrap_or_default();
        check_filter(&filter)?;
        let (held, mut rx) = self.ring.follow(&filter);
        let metrics = Arc::clone(&self.metrics);
        let stream = async_stream_of(move |tx: tokio::sync::mpsc::Sender<Result<Flow, Status>>| async move {
            for f in held {
                if tx.send(Ok(Flow::clone(&f))).await.is_err() {
                    return;
                }
            }
            loop {
                match rx.recv().await {
                    Ok(f) if ring::admits(&filter, &f) => {
                        if tx.send(Ok(Flow::clone(&f))).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(RecvError::Lagged(n)) => {
                        metrics.lost.get_or_create(&ReasonLabels { reason: "follower" }).inc_by(n);
                        tracing::debug!(missed = n, "flows: a follower read too slowly");
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn probe(&self, req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let req = req.into_inner();
        let (transport, dst, wait) = check_probe(&req)?;
        let pods = self.pods.as_ref().ok_or_else(|| Status::unimplemented("this agent sends no probes"))?;
        let netns = pods(&req.pod)
            .ok_or_else(|| Status::not_found(format!("pod {} is not attached on node {}", req.pod, self.node)))?;
        // The wait bounds the probe's own sockets; this bounds the rest
        // (entering the namespace on a thread of its own).
        let probed = tokio::time::timeout(wait + Duration::from_secs(1), probe::probe(&netns, transport, dst, wait))
            .await
            .map_err(|_| Status::deadline_exceeded(format!("probing from {} did not finish", req.pod)))?
            .map_err(|e| Status::unavailable(format!("probing from {}: {e}", req.pod)))?;
        tracing::info!(pod = %req.pod, %dst, outcome = ?probed.outcome, "flows: sent a probe");
        Ok(Response::new(ProbeResponse {
            outcome: outcome(probed.outcome) as i32,
            source_address: probed.source.ip().to_string(),
            source_port: u32::from(probed.source.port()),
            detail: probed.detail,
        }))
    }
}

/// A stream fed by `produce` through a small channel (it stops when the
/// caller goes away).
fn async_stream_of<F, Fut>(produce: F) -> FlowStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Flow, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    tokio::spawn(produce(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_checked_where_they_enter() {
        assert!(check_filter(&Filter { namespaces: vec!["prod".into()], pod: "prod/db-0".into(), verdict: 2 }).is_ok());
        for bad in [
            Filter { namespaces: vec!["Prod".into()], ..Filter::default() },
            Filter { pod: "db".into(), ..Filter::default() },
            Filter { pod: "prod/../x".into(), ..Filter::default() },
            Filter { verdict: 9, ..Filter::default() },
            Filter { namespaces: vec!["a".into(); MAX_NAMESPACES + 1], ..Filter::default() },
        ] {
            assert!(check_filter(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn probes_are_checked_where_they_enter() {
        let ok = ProbeRequest {
            pod: "prod/web".into(),
            address: "10.0.0.7".into(),
            port: 80,
            protocol: "tcp".into(),
            timeout_ms: 0,
        };
        let (transport, dst, wait) = check_probe(&ok).expect("valid");
        assert_eq!((transport, dst, wait), (Transport::Tcp, "10.0.0.7:80".parse().unwrap(), PROBE_WAIT));
        let long = ProbeRequest { timeout_ms: 3_600_000, protocol: "UDP".into(), ..ok.clone() };
        assert_eq!(check_probe(&long).expect("valid").2, PROBE_WAIT_MAX, "the wait is capped");
        for bad in [
            ProbeRequest { pod: "web".into(), ..ok.clone() },
            ProbeRequest { address: "10.0.0.300".into(), ..ok.clone() },
            ProbeRequest { port: 0, ..ok.clone() },
            ProbeRequest { port: 70_000, ..ok.clone() },
            ProbeRequest { protocol: "SCTP".into(), ..ok.clone() },
        ] {
            assert!(check_probe(&bad).is_err(), "{bad:?} accepted");
        }
    }

    /// A pod not attached here is refused with its node's name; an agent
    /// that cannot look pods up says so.
    #[tokio::test]
    async fn a_probe_names_what_it_cannot_do() {
        let ring = Arc::new(Ring::new(4));
        let plain = FlowService::new("n1", Arc::clone(&ring), Arc::new(FlowMetrics::default()));
        let req = || {
            Request::new(ProbeRequest {
                pod: "prod/web".into(),
                address: "10.0.0.7".into(),
                port: 80,
                protocol: "TCP".into(),
                timeout_ms: 100,
            })
        };
        assert_eq!(plain.probe(req()).await.expect_err("no lookup").code(), tonic::Code::Unimplemented);
        let service = FlowService::new("n1", ring, Arc::new(FlowMetrics::default())).with_probes(Arc::new(|_| None));
        let err = service.probe(req()).await.expect_err("not here");
        assert_eq!(err.code(), tonic::Code::NotFound);
        assert!(err.message().contains("not attached on node n1"), "{}", err.message());
    }
}
