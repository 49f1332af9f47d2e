//! The gRPC service weft-cni calls. Each verb lives in its own module as a
//! method on [`Agent`]; this module times it, counts it and logs failures.

mod add;
mod check;
mod del;
mod gc;
mod status;

use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};
use weft_proto::ErrorCode;
use weft_proto::cni::v1::cni_server::Cni;
use weft_proto::cni::v1::{
    AddResponse, CheckResponse, CniError, CniRequest, DelResponse, GcRequest, GcResponse, StatusRequest,
    StatusResponse, add_response,
};

use crate::agent::Agent;
use crate::ipam::Key;

pub struct CniService {
    agent: Arc<Agent>,
}

impl CniService {
    pub fn new(agent: Arc<Agent>) -> Self {
        Self { agent }
    }

    fn record<T>(&self, verb: &'static str, started: Instant, r: &Result<T, CniError>, what: &str) {
        let code = r.as_ref().err().map(|e| e.code);
        self.agent.metrics.observe(verb, started.elapsed().as_secs_f64(), code);
        match r {
            Ok(_) => tracing::debug!(verb, what, elapsed_ms = started.elapsed().as_millis() as u64, "done"),
            Err(e) => tracing::warn!(verb, what, code = e.code, msg = %e.msg, "failed"),
        }
    }
}

/// The attachment a container verb is about, validated.
fn key_of(req: &CniRequest) -> Result<Key, CniError> {
    if req.container_id.is_empty() {
        return Err(ErrorCode::InvalidEnv.error("CNI_CONTAINERID is empty"));
    }
    if req.ifname.is_empty() || req.ifname.len() > 15 {
        return Err(ErrorCode::InvalidEnv.error(format!("invalid CNI_IFNAME {:?}", req.ifname)));
    }
    Ok(Key { container_id: req.container_id.clone(), ifname: req.ifname.clone() })
}

#[tonic::async_trait]
impl Cni for CniService {
    async fn add(&self, req: Request<CniRequest>) -> Result<Response<AddResponse>, Status> {
        let started = Instant::now();
        let req = req.into_inner();
        let r = self.agent.add(&req).await;
        self.record("ADD", started, &r, &req.container_id);
        let outcome = match r {
            Ok(result) => add_response::Outcome::Result(result),
            Err(e) => add_response::Outcome::Error(e),
        };
        Ok(Response::new(AddResponse { outcome: Some(outcome) }))
    }

    async fn del(&self, req: Request<CniRequest>) -> Result<Response<DelResponse>, Status> {
        let started = Instant::now();
        let req = req.into_inner();
        let r = self.agent.del(&req).await;
        self.record("DEL", started, &r, &req.container_id);
        Ok(Response::new(DelResponse { error: r.err() }))
    }

    async fn check(&self, req: Request<CniRequest>) -> Result<Response<CheckResponse>, Status> {
        let started = Instant::now();
        let req = req.into_inner();
        let r = self.agent.check(&req).await;
        self.record("CHECK", started, &r, &req.container_id);
        Ok(Response::new(CheckResponse { error: r.err() }))
    }

    async fn status(&self, _req: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        let started = Instant::now();
        let r = self.agent.readiness().await;
        self.record("STATUS", started, &r, "");
        Ok(Response::new(StatusResponse { error: r.err() }))
    }

    async fn gc(&self, req: Request<GcRequest>) -> Result<Response<GcResponse>, Status> {
        let started = Instant::now();
        let r = self.agent.gc(&req.into_inner()).await;
        self.record("GC", started, &r, "");
        let (released, error) = match r {
            Ok(n) => (n, None),
            Err(e) => (0, Some(e)),
        };
        Ok(Response::new(GcResponse { error, released }))
    }
}
