//! The probe HTTP server (hyper, HTTP/1.1, keep-alive).

use std::convert::Infallible;
use std::future::Future;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::{verdict, ProbeState};

/// Errors of the probe server.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The listening socket failed in a way that is not a per-connection hiccup.
    #[error("probe listener failed: {0}")]
    Accept(#[source] std::io::Error),
}

/// Serve probes on `listener` until `shutdown` resolves. Each connection runs on its own task;
/// handlers only read [`ProbeState`], so a probe never waits for the engine.
pub async fn serve(
    listener: TcpListener,
    state: ProbeState,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ProbeError> {
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            a = listener.accept() => a,
        };
        let (stream, _peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                // EMFILE/ECONNABORTED and friends: transient, keep serving.
                if is_transient(&e) {
                    tracing::warn!(error = %e, "probe accept failed; continuing");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
                return Err(ProbeError::Accept(e));
            }
        };
        let _ = stream.set_nodelay(true);
        let st = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let st = st.clone();
                async move { Ok::<_, Infallible>(handle(&st, &req)) }
            });
            if let Err(e) = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "probe connection ended with error");
            }
        });
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || matches!(
        e.raw_os_error(),
        Some(23 /* ENFILE */) | Some(24 /* EMFILE */)
    )
}

fn text(code: StatusCode, body: impl Into<Bytes>, ctype: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = code;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(ctype));
    r
}

fn verdict_response(ok: bool) -> Response<Full<Bytes>> {
    if ok {
        text(StatusCode::OK, "ok\n", "text/plain")
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "not ok\n", "text/plain")
    }
}

/// Route one request. Pure apart from reading the shared state.
pub fn handle(state: &ProbeState, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    route(state, req.method(), req.uri().path())
}

/// Route by method and path (separate from [`handle`] so it can be tested without a socket).
pub fn route(state: &ProbeState, method: &Method, path: &str) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n", "text/plain");
    }
    let now = Instant::now();
    match path {
        "/startup" => verdict_response(verdict::startup(&state.read().view(), now)),
        "/live" => verdict_response(verdict::live(&state.read().view(), now)),
        "/ready" => verdict_response(verdict::ready(&state.read().view(), now)),
        "/state" => {
            let body = serde_json::to_string(&state.read().state_doc(now)).unwrap_or_default();
            text(StatusCode::OK, body, "application/json")
        }
        "/metrics" => {
            let snapshot = state.read().clone();
            let body = state.metrics().render(&snapshot);
            text(StatusCode::OK, body, crate::metrics::CONTENT_TYPE)
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n", "text/plain"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Phase, Status};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn routes_follow_phase() {
        let st = ProbeState::new(Status::new(0, "primary"));
        let code = |p: &str| route(&st, &Method::GET, p).status().as_u16();
        assert_eq!(code("/startup"), 503);
        assert_eq!(code("/live"), 503);
        assert_eq!(code("/ready"), 503);
        st.enter(Phase::Active, None);
        st.write().engine_healthy = true;
        // /startup follows the supervisor being up (engine spawned), not the phase.
        assert_eq!(code("/startup"), 503);
        st.write().started = true;
        assert_eq!(code("/startup"), 200);
        assert_eq!(code("/live"), 200);
        assert_eq!(code("/ready"), 200);
        assert_eq!(code("/state"), 200);
        assert_eq!(code("/metrics"), 200);
        assert_eq!(code("/nope"), 404);
        assert_eq!(route(&st, &Method::POST, "/live").status().as_u16(), 405);
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        let code = buf[9..12].parse().unwrap();
        let body = buf.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        (code, body)
    }

    #[tokio::test]
    async fn metrics_over_tcp_are_openmetrics_text() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let st = ProbeState::new(Status::new(4, "primary"));
        st.enter(Phase::Standby, None);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, st.clone(), async {
            let _ = rx.await;
        }));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut raw = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut raw))
            .await
            .unwrap()
            .unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("content-type: {}", crate::metrics::CONTENT_TYPE)),
            "{head}"
        );
        let line = body
            .lines()
            .find(|l| {
                l.starts_with("supervisor_transitions_total{") && l.contains("to=\"standby\"")
            })
            .unwrap_or_else(|| panic!("no standby transitions in\n{body}"));
        assert_eq!(
            line,
            "supervisor_transitions_total{engine_id=\"4\",role=\"primary\",to=\"standby\"} 1"
        );
        assert!(body.ends_with("# EOF\n"), "{body}");
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn serves_over_tcp_and_shuts_down() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let st = ProbeState::new(Status::new(2, "shadow"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, st.clone(), async {
            let _ = rx.await;
        }));
        assert_eq!(get(addr, "/live").await.0, 503);
        st.enter(
            Phase::Waking,
            Some(Instant::now() + Duration::from_millis(200)),
        );
        assert_eq!(get(addr, "/live").await.0, 200);
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(get(addr, "/live").await.0, 503);
        let (code, body) = get(addr, "/state").await;
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["state"], "waking");
        assert_eq!(v["engine_id"], 2);
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
