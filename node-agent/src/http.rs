//! `/metrics`, `/healthz` and `/readyz` over HTTP.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::agent::Agent;

/// The agent, once it exists (it waits for its Subnet lease first).
pub type AgentSlot = Arc<OnceLock<Arc<Agent>>>;

pub async fn serve(
    addr: SocketAddr,
    agent: AgentSlot,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(agent);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for metrics and health on {addr}: {e}"))?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    Ok(())
}

async fn metrics(State(slot): State<AgentSlot>, headers: HeaderMap) -> impl IntoResponse {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let Some(agent) = slot.get() else {
        let (content_type, body) = weft_telemetry::negotiate(accept, "# EOF\n".to_owned());
        return (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], body);
    };
    agent.metrics.set_ipam_usage(agent.ipam.usage());
    match agent.metrics.encode() {
        Ok(body) => {
            let (content_type, body) = weft_telemetry::negotiate(accept, body);
            (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], body)
        }
        Err(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, [(header::CONTENT_TYPE, "text/plain")], "encoding failed".to_owned())
        }
    }
}

async fn readyz(State(slot): State<AgentSlot>) -> impl IntoResponse {
    let Some(agent) = slot.get() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: waiting for this node's Subnet lease".to_owned());
    };
    match agent.readiness().await {
        Ok(()) => (StatusCode::OK, "ready".to_owned()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}")),
    }
}
