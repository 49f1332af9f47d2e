//! `/metrics`, `/healthz` and `/readyz` over HTTP.
//!
//! Anyone who reaches the node may ask, so asking is no lever: the
//! listeners are the addresses `--metrics-addr` names (the chart: loopback
//! and the node IP), and `/readyz` runs at most one check at a time on a
//! netlink socket of its own, answering the requests that come while it
//! runs with the last result: a flood costs the kernel one check at a
//! time and never touches the socket ADD and start-up use, and a request
//! to an idle agent always sees the node as it is now.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::attach::Attacher;

/// The pod attachment state, once it exists (the agent waits for its
/// Subnet lease first).
pub type AgentSlot = Arc<OnceLock<Arc<Attacher>>>;

#[derive(Clone)]
struct AppState {
    agent: AgentSlot,
    ready: Arc<ReadyCache>,
}

/// Serves on every address of `addrs` until `shutdown()` resolves (one
/// future per listener).
pub async fn serve<F: Future<Output = ()> + Send + 'static>(
    addrs: Vec<SocketAddr>,
    agent: AgentSlot,
    shutdown: impl Fn() -> F,
) -> anyhow::Result<()> {
    let state = AppState { agent, ready: Arc::default() };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state);
    let mut servers = Vec::new();
    for addr in addrs {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen for metrics and health on {addr}: {e}"))?;
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
        servers.push(tokio::spawn(axum::serve(listener, app.clone()).with_graceful_shutdown(shutdown()).into_future()));
    }
    for server in servers {
        server.await??;
    }
    Ok(())
}

/// The last readiness result and whether a check runs.
#[derive(Default)]
struct ReadyCache {
    /// Held by the one check in flight; nobody waits for it.
    running: tokio::sync::Mutex<()>,
    last: std::sync::Mutex<Option<Result<(), String>>>,
}

impl ReadyCache {
    /// One check (`check`) when none runs, else the last result.
    async fn get<F: Future<Output = Result<(), String>>>(&self, check: impl FnOnce() -> F) -> Result<(), String> {
        let Ok(_running) = self.running.try_lock() else {
            let last = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
            return last.unwrap_or_else(|| Err("the first readiness check is still running".to_owned()));
        };
        let r = check().await;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(r.clone());
        r
    }
}

async fn metrics(State(AppState { agent: slot, .. }): State<AppState>, headers: HeaderMap) -> impl IntoResponse {
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

async fn readyz(State(AppState { agent: slot, ready }): State<AppState>) -> impl IntoResponse {
    let Some(agent) = slot.get() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: waiting for this node's Subnet lease".to_owned());
    };
    // Policy that cannot be applied is reported here (the rules last
    // applied stay in force; new pods wait), not in STATUS: the node keeps
    // running what it runs.
    let policy = agent.policy_pods.as_ref().and_then(|p| p.failure());
    let (status, text) =
        match (ready.get(|| async { agent.readiness().await.map_err(|e| e.to_string()) }).await, policy) {
            (Ok(()), None) => (StatusCode::OK, "ready".to_owned()),
            (Err(e), _) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}")),
            (Ok(()), Some(why)) => {
                (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: network policy changes are not applied: {why}"))
            }
        };
    // What the probe saw, for the alert on agents that stay unready.
    agent.metrics.not_ready.set(i64::from(status != StatusCode::OK));
    (status, text)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_flood_of_readiness_requests_runs_one_check() {
        let cache = Arc::new(ReadyCache::default());
        let checks = Arc::new(AtomicUsize::new(0));
        let (release, gate) = tokio::sync::watch::channel(false);
        let mut requests = Vec::new();
        for _ in 0..200 {
            let (cache, checks, mut gate) = (Arc::clone(&cache), Arc::clone(&checks), gate.clone());
            requests.push(tokio::spawn(async move {
                cache
                    .get(|| async move {
                        checks.fetch_add(1, Ordering::SeqCst);
                        let _ = gate.wait_for(|open| *open).await;
                        Ok(())
                    })
                    .await
            }));
        }
        // Every request has run up to its answer or to the one check.
        tokio::task::yield_now().await;
        release.send(true).unwrap();
        let answers: Vec<_> = futures::future::join_all(requests).await.into_iter().map(Result::unwrap).collect();
        assert_eq!(checks.load(Ordering::SeqCst), 1, "one check for 200 requests");
        assert!(answers.iter().filter(|a| a.is_ok()).count() >= 1);
        assert!(
            answers
                .iter()
                .all(|a| a.as_ref().is_ok_and(|()| true) || a.as_ref().is_err_and(|e| e.contains("still running")))
        );
        // Once idle, a request checks again: nothing stale is served.
        assert_eq!(cache.get(|| async { Err("bridge gone".to_owned()) }).await, Err("bridge gone".to_owned()));
    }
}
