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

/// Binds `addr`: `[::]` listens on every address of both families (IPv4 as mapped addresses,
/// whatever `net.ipv6.bindv6only` says), and falls back to `0.0.0.0` on the same port where
/// the host has IPv6 disabled (logged). Any other address binds as given.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    bind_with(addr, bind_socket)
}

fn bind_socket(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// Whether a failed bind of `addr` means "this host has no IPv6" (only for `[::]`): then
/// `0.0.0.0` on the same port.
fn ipv4_fallback(addr: SocketAddr, e: &std::io::Error) -> Option<SocketAddr> {
    const EAFNOSUPPORT: i32 = 97;
    let no_ipv6 = e.raw_os_error() == Some(EAFNOSUPPORT)
        || matches!(
            e.kind(),
            std::io::ErrorKind::AddrNotAvailable | std::io::ErrorKind::Unsupported
        );
    (addr.is_ipv6() && addr.ip().is_unspecified() && no_ipv6)
        .then(|| SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port())))
}

fn bind_with(
    addr: SocketAddr,
    bind: impl Fn(SocketAddr) -> std::io::Result<std::net::TcpListener>,
) -> std::io::Result<std::net::TcpListener> {
    match bind(addr) {
        Ok(l) => Ok(l),
        Err(e) => match ipv4_fallback(addr, &e) {
            Some(v4) => {
                tracing::warn!(%addr, error = %e, fallback = %v4, "IPv6 is not available on this host: listening on IPv4 only");
                bind(v4)
            }
            None => Err(e),
        },
    }
}

/// Binds `addr` (see [`bind`]) and serves /metrics, /healthz and /readyz until the task is
/// dropped. Returns the bound address (useful with port 0).
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
    let listener = tokio::net::TcpListener::from_std(bind(addr)?)?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    /// GETs `path` from `addr`; the status code and body.
    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let code = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (
            code,
            out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned(),
        )
    }

    #[tokio::test]
    async fn the_unspecified_ipv6_address_serves_both_families() {
        let mut registry = Registry::default();
        crate::telemetry::process::register(&mut registry);
        let health = Health::default();
        let (bound, task) = serve(
            "[::]:0".parse().unwrap(),
            Arc::new(registry),
            health.clone(),
        )
        .await
        .expect("bind [::]:0");
        assert!(bound.is_ipv6(), "{bound}");
        let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, bound.port()));
        let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, bound.port()));
        for addr in [v6, v4] {
            let (code, body) = get(addr, "/metrics").await;
            assert_eq!(code, 200, "{addr}: {body}");
            assert!(body.contains("ipreclaim_build_info{"), "{addr}: {body}");
            assert!(
                body.contains("process_resident_memory_bytes "),
                "{addr}: {body}"
            );
            assert_eq!(get(addr, "/healthz").await, (200, "ok".into()), "{addr}");
            assert_eq!(get(addr, "/readyz").await.0, 503, "{addr}: not ready yet");
        }
        health.set_ready(true);
        assert_eq!(get(v6, "/readyz").await, (200, "ok".into()));
        assert_eq!(get(v4, "/readyz").await, (200, "ok".into()));
        task.abort();
    }

    #[test]
    fn a_host_without_ipv6_falls_back_to_ipv4_on_the_same_port() {
        let any6: SocketAddr = "[::]:8080".parse().unwrap();
        let no_family = std::io::Error::from_raw_os_error(97);
        assert_eq!(
            ipv4_fallback(any6, &no_family),
            Some("0.0.0.0:8080".parse().unwrap())
        );
        // Only the unspecified address falls back, and only for a missing family.
        let in_use = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        assert_eq!(ipv4_fallback(any6, &in_use), None);
        assert_eq!(
            ipv4_fallback("[::1]:8080".parse().unwrap(), &no_family),
            None
        );

        let tried = std::sync::Mutex::new(Vec::new());
        let listener = bind_with("[::]:0".parse().unwrap(), |addr| {
            tried.lock().unwrap().push(addr);
            if addr.is_ipv6() {
                Err(std::io::Error::from_raw_os_error(97))
            } else {
                bind_socket(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
            }
        })
        .expect("bound on IPv4");
        assert!(listener.local_addr().unwrap().is_ipv4());
        assert_eq!(
            *tried.lock().unwrap(),
            [
                "[::]:0".parse::<SocketAddr>().unwrap(),
                "0.0.0.0:0".parse().unwrap()
            ]
        );
        let refused = bind_with("[::]:0".parse().unwrap(), |_| {
            Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
        });
        assert_eq!(
            refused.unwrap_err().kind(),
            std::io::ErrorKind::PermissionDenied
        );
    }
}
