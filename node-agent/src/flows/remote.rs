//! This node's flows over TCP (`--flows-listen`), for the operator's
//! flows.weft.dev API: list and follow, for the one reader the token review
//! lets through; probes stay on the node's socket.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tonic::{Request, Response, Status};
use weft_proto::flows::v1::flows_server::{Flows, FlowsServer};
use weft_proto::flows::v1::{ListRequest, ListResponse, ProbeRequest, ProbeResponse};

use super::service::{FlowService, FlowStream};
use super::token_review::{Refused, TokenReviewer, bearer};

pub struct RemoteFlows {
    inner: FlowService,
    reviewer: Arc<TokenReviewer>,
}

impl RemoteFlows {
    pub fn new(inner: FlowService, reviewer: TokenReviewer) -> Self {
        RemoteFlows { inner, reviewer: Arc::new(reviewer) }
    }

    async fn admit<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let value = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
        let token = bearer(value).map_err(|e| Status::unauthenticated(e.to_string()))?;
        self.reviewer.check(token).await.map_err(|e| match e {
            Refused::NoToken | Refused::NotAuthenticated(_) => Status::unauthenticated(e.to_string()),
            Refused::NotTheReader(_) => Status::permission_denied(e.to_string()),
            Refused::Unavailable(_) => Status::unavailable(e.to_string()),
        })
    }
}

#[tonic::async_trait]
impl Flows for RemoteFlows {
    async fn list(&self, req: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        self.admit(&req).await?;
        self.inner.list(req).await
    }

    type FollowStream = FlowStream;

    async fn follow(&self, req: Request<ListRequest>) -> Result<Response<FlowStream>, Status> {
        self.admit(&req).await?;
        self.inner.follow(req).await
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Err(Status::permission_denied("probes are sent only through the node's agent socket"))
    }
}

/// Serves `flows` on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, flows: RemoteFlows) -> anyhow::Result<()> {
    tracing::info!(%addr, "flows: serving the operator");
    tonic::transport::Server::builder()
        .add_service(FlowsServer::new(flows))
        .serve(addr)
        .await
        .with_context(|| format!("serving flows on {addr}"))
}
