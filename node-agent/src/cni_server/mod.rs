//! The gRPC service weft-cni calls. It validates each request, runs the verb
//! from `attach` (each to its end in a task of its own, after any earlier
//! verb for the same attachment), times it, counts it, logs failures, and
//! turns domain errors into CNI error codes, here and nowhere else.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};
use weft_proto::cni::v1::cni_server::Cni;
use weft_proto::cni::v1::{
    AddResponse, CheckResponse, CniError, CniRequest, DelResponse, GcRequest, GcResponse, StatusRequest,
    StatusResponse, add_response,
};
use weft_proto::{ErrorCode, validate};

use crate::attach::AttachError;
use crate::attach::Attacher;
use crate::hostport::{HostPortError, StoreError};
use crate::ipam::{IpamError, Key};

pub struct CniService {
    attacher: Arc<Attacher>,
}

impl CniService {
    pub fn new(attacher: Arc<Attacher>) -> Self {
        Self { attacher }
    }

    fn record<T>(&self, verb: &'static str, started: Instant, r: &Result<T, CniError>, what: &str) {
        let code = r.as_ref().err().map(|e| e.code);
        self.attacher.metrics.observe(verb, started.elapsed().as_secs_f64(), code);
        match r {
            Ok(_) => tracing::debug!(verb, what, elapsed_ms = started.elapsed().as_millis() as u64, "done"),
            Err(e) => tracing::warn!(verb, what, code = e.code, msg = %e.msg, "failed"),
        }
    }
}

/// The attachment a container verb is about, validated with weft-cni's own
/// rules: the socket is the agent's edge, and the values reach paths, rule
/// comments and Events.
fn key_of(req: &CniRequest) -> Result<Key, CniError> {
    let invalid = |msg: String| ErrorCode::InvalidEnv.error(msg);
    validate::container_id(&req.container_id).map_err(invalid)?;
    validate::ifname(&req.ifname).map_err(invalid)?;
    validate::k8s_args(req.args.iter().map(|(k, v)| (k.as_str(), v.as_str()))).map_err(invalid)?;
    Ok(Key { container_id: req.container_id.clone(), ifname: req.ifname.clone() })
}

/// Runs a container verb on its attachment's turn, in a task of its own:
/// if weft-cni goes away (killed, timed out) tonic drops this future, but
/// the verb still finishes or undoes itself, so nothing is left half-made.
async fn on_turn<T, F, Fut>(attacher: &Arc<Attacher>, req: &CniRequest, verb: F) -> Result<T, CniError>
where
    T: Send + 'static,
    F: FnOnce(Arc<Attacher>, Key) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, AttachError>> + Send + 'static,
{
    let key = key_of(req)?;
    let attacher = Arc::clone(attacher);
    let task = tokio::spawn(async move {
        let _turn = attacher.locks.turn(&key).await;
        verb(attacher, key).await
    });
    match task.await {
        Ok(r) => r.map_err(|e| to_cni(&e)),
        Err(e) => Err(ErrorCode::Internal.error(format!("the request's task failed: {e}"))),
    }
}

/// The CNI error code of each domain error.
fn to_cni(e: &AttachError) -> CniError {
    let code = match e {
        AttachError::InvalidRequest(_) => ErrorCode::InvalidEnv,
        AttachError::InvalidConfig(_) => ErrorCode::InvalidConfig,
        AttachError::Decode(_) => ErrorCode::Decode,
        AttachError::Unknown { .. } => ErrorCode::UnknownContainer,
        AttachError::Ipam(IpamError::AlreadyAllocated { .. }) => ErrorCode::AlreadyExists,
        AttachError::Ipam(IpamError::Exhausted { .. }) => ErrorCode::PoolExhausted,
        AttachError::HostPorts(HostPortError::Request(_)) => ErrorCode::InvalidConfig,
        AttachError::HostPorts(HostPortError::Store(StoreError::Exhausted { .. })) => ErrorCode::HostPortsExhausted,
        AttachError::HostPorts(HostPortError::Store(StoreError::Conflict { .. })) => ErrorCode::HostPortConflict,
        AttachError::CheckFailed(_) => ErrorCode::CheckFailed,
        AttachError::NotReady(_) => ErrorCode::NotAvailable,
        AttachError::NoAddressLeft(_) => ErrorCode::LimitedResources,
        AttachError::TryAgain(_) => ErrorCode::TryAgainLater,
        AttachError::Ipam(_)
        | AttachError::HostPorts(_)
        | AttachError::Kernel { .. }
        | AttachError::TimedOut { .. }
        | AttachError::Internal(_) => ErrorCode::Internal,
    };
    code.error(e.to_string())
}

#[tonic::async_trait]
impl Cni for CniService {
    async fn add(&self, req: Request<CniRequest>) -> Result<Response<AddResponse>, Status> {
        let started = Instant::now();
        let req = Arc::new(req.into_inner());
        let r = on_turn(&self.attacher, &req, {
            let req = Arc::clone(&req);
            move |attacher, key| async move { attacher.add(&key, &req).await }
        })
        .await;
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
        let r = on_turn(&self.attacher, &req, |attacher, key| async move { attacher.del(&key).await }).await;
        self.record("DEL", started, &r, &req.container_id);
        Ok(Response::new(DelResponse { error: r.err() }))
    }

    async fn check(&self, req: Request<CniRequest>) -> Result<Response<CheckResponse>, Status> {
        let started = Instant::now();
        let req = Arc::new(req.into_inner());
        let r = on_turn(&self.attacher, &req, {
            let req = Arc::clone(&req);
            move |attacher, key| async move { attacher.check(&key, &req.netns, &req.prev_result_json).await }
        })
        .await;
        self.record("CHECK", started, &r, &req.container_id);
        Ok(Response::new(CheckResponse { error: r.err() }))
    }

    async fn status(&self, _req: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        let started = Instant::now();
        let r = self.attacher.readiness().await.map_err(|e| to_cni(&e));
        self.record("STATUS", started, &r, "");
        Ok(Response::new(StatusResponse { error: r.err() }))
    }

    async fn gc(&self, req: Request<GcRequest>) -> Result<Response<GcResponse>, Status> {
        let started = Instant::now();
        let valid: HashSet<Key> = req
            .into_inner()
            .valid_attachments
            .into_iter()
            .map(|a| Key { container_id: a.container_id, ifname: a.ifname })
            .collect();
        // GC runs to its end too: it releases attachments one by one.
        let attacher = Arc::clone(&self.attacher);
        let r = match tokio::spawn(async move { attacher.gc(&valid).await }).await {
            Ok(r) => r.map_err(|e| to_cni(&e)),
            Err(e) => Err(ErrorCode::Internal.error(format!("the request's task failed: {e}"))),
        };
        self.record("GC", started, &r, "");
        let (released, error) = match r {
            Ok(n) => (n, None),
            Err(e) => (0, Some(e)),
        };
        Ok(Response::new(GcResponse { error, released }))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn request(pod_name: &str) -> CniRequest {
        CniRequest {
            container_id: "abc123".into(),
            ifname: "eth0".into(),
            args: HashMap::from([
                ("K8S_POD_NAMESPACE".to_owned(), "default".to_owned()),
                ("K8S_POD_NAME".to_owned(), pod_name.to_owned()),
            ]),
            ..Default::default()
        }
    }

    #[test]
    fn requests_are_validated_where_they_enter_the_agent() {
        assert!(key_of(&request("web-0")).is_ok());
        let e = key_of(&request("web\"\n-A INPUT -j ACCEPT")).expect_err("quote and newline");
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("K8S_POD_NAME"), "{}", e.msg);
        let e = key_of(&CniRequest { container_id: "../x".into(), ..request("web-0") }).expect_err("bad id");
        assert_eq!(e.code, 4);
    }

    #[test]
    fn domain_errors_get_the_cni_codes() {
        let code = |e: AttachError| to_cni(&e).code;
        assert_eq!(code(AttachError::InvalidRequest("x".into())), 4);
        assert_eq!(code(AttachError::Unknown { container_id: "a".into(), ifname: "eth0".into() }), 3);
        assert_eq!(code(AttachError::NotReady("x".into())), 50);
        assert_eq!(code(AttachError::NoAddressLeft("x".into())), 51);
        assert_eq!(code(AttachError::TryAgain("x".into())), 11);
        assert_eq!(code(AttachError::CheckFailed("x".into())), 103);
        let timed_out = AttachError::TimedOut { what: "x".into(), after: std::time::Duration::from_secs(1) };
        assert_eq!(code(timed_out), 100);
    }
}
