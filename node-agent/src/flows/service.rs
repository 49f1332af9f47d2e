//! `weft.flows.v1.Flows` over the agent's socket: the ring's records,
//! filtered; and following them. Filters are checked where they enter.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::broadcast::error::RecvError;
use tonic::{Request, Response, Status};
use weft_proto::flows::v1::flows_server::Flows;
use weft_proto::flows::v1::{Filter, Flow, ListRequest, ListResponse, Verdict};

use super::metrics::{FlowMetrics, ReasonLabels};
use super::ring::{self, Ring};

/// Namespaces one filter may name.
const MAX_NAMESPACES: usize = 1024;

pub struct FlowService {
    node: String,
    ring: Arc<Ring>,
    metrics: Arc<FlowMetrics>,
}

impl FlowService {
    pub fn new(node: &str, ring: Arc<Ring>, metrics: Arc<FlowMetrics>) -> Self {
        FlowService { node: node.to_owned(), ring, metrics }
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
        let (ns, name) = f
            .pod
            .split_once('/')
            .ok_or_else(|| Status::invalid_argument(format!("invalid pod {:?}: it must be NAMESPACE/NAME", f.pod)))?;
        weft_proto::validate::namespace(ns).map_err(Status::invalid_argument)?;
        weft_proto::validate::pod_name(name).map_err(Status::invalid_argument)?;
    }
    Verdict::try_from(f.verdict).map_err(|_| Status::invalid_argument(format!("unknown verdict {}", f.verdict)))?;
    Ok(())
}

type FlowStream = Pin<Box<dyn Stream<Item = Result<Flow, Status>> + Send>>;

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
}
