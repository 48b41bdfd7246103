//! The HTTP endpoints operators and kubelets look at.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

type LivenessCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Liveness and readiness state.
#[derive(Clone)]
pub struct Health {
    ready: Arc<AtomicBool>,
    live: LivenessCheck,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            ready: Arc::new(AtomicBool::new(false)),
            live: Arc::new(|| Ok(())),
        }
    }
}

impl Health {
    /// Liveness decided by `check` (an error message fails /healthz).
    pub fn with_liveness(check: impl Fn() -> Result<(), String> + Send + Sync + 'static) -> Self {
        Health {
            live: Arc::new(check),
            ..Health::default()
        }
    }

    /// Marks the process ready (caches synced) or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Whether /readyz answers ok.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    health: Health,
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("encoding metrics failed: {e}"),
        ),
    }
}

async fn healthz(State(s): State<AppState>) -> impl IntoResponse {
    match (s.health.live)() {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e),
    }
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    if s.health.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced")
    }
}

/// Binds `addr` and serves /metrics, /healthz and /readyz until the task is dropped.
/// Returns the bound address (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    registry: Arc<Registry>,
    health: Health,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { registry, health });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok((bound, task))
}
