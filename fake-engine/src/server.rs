//! The HTTP API, modelled on vLLM's (docs/INTERFACES.md): `/health`, `/sleep?level=N`,
//! `/wake_up`, `/is_sleeping`, `/v1/completions`, and SGLang's
//! `/release_memory_occupation` / `/resume_memory_occupation` as aliases of sleep / wake.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use crate::claim::Claim;
use crate::cli::{Args, FailAt};

/// Mutable engine state.
#[derive(Debug, Default)]
struct EngState {
    /// Weights offloaded / KV cache dropped.
    sleeping: bool,
    /// Slept at least once (then the claim is taken on wake, not on first serve).
    ever_slept: bool,
    /// Holds the GPU claim.
    claimed: bool,
    /// `--fail-at serve` has kicked in.
    failing: bool,
}

/// The engine, shared by all HTTP handlers.
pub struct Engine {
    /// Configuration (delays, failure injection, id).
    args: Args,
    /// The GPU claim: one open file description shared with every worker, so the flock
    /// lives until the last engine process dies.
    claim: Option<Claim>,
    /// Sleep/claim state.
    state: Mutex<EngState>,
    /// The engine's pid and its workers' (registered on the simulated GPU with the claim).
    pids: Vec<u32>,
}

impl Engine {
    /// The engine after load: awake, not holding the claim yet.
    pub fn new(args: Args, claim: Option<Claim>, pids: Vec<u32>) -> Engine {
        Engine {
            args,
            claim,
            state: Mutex::new(EngState::default()),
            pids,
        }
    }

    /// Take the GPU claim (no claim file: nothing to take). Err(message) on split brain.
    fn take_claim(&self) -> Result<(), String> {
        self.claim.as_ref().map_or(Ok(()), Claim::take)
    }

    /// Allocate device memory on the simulated GPU (load, wake): every process of the engine.
    fn gpu_alloc(&self) {
        if let Some(dir) = &self.args.gpu_sim {
            crate::gpu_sim::register(dir, &self.pids, self.args.gpu_sim_bytes);
        }
    }

    /// Release it (sleep).
    fn gpu_free(&self) {
        if let Some(dir) = &self.args.gpu_sim {
            crate::gpu_sim::unregister(dir, &self.pids);
            tracing::info!(target: "fake_engine", engine_id = self.args.engine_id, "gpu-sim: released");
        }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, EngState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn reply(code: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

async fn do_sleep(e: &Engine) -> Response<Full<Bytes>> {
    tokio::time::sleep(e.args.sleep).await;
    if e.args.fail_at == Some(FailAt::Sleep) {
        tracing::error!(target: "fake_engine", engine_id = e.args.engine_id, "injected failure at sleep");
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":"injected failure at sleep"}"#.into(),
        );
    }
    let was_claimed = {
        let mut s = e.st();
        s.sleeping = true;
        s.ever_slept = true;
        std::mem::replace(&mut s.claimed, false)
    };
    if was_claimed {
        if let Some(c) = &e.claim {
            c.release();
        }
    }
    e.gpu_free();
    tracing::info!(target: "fake_engine", engine_id = e.args.engine_id, "sleeping");
    reply(StatusCode::OK, "{}".into())
}

async fn do_wake(e: &Engine) -> Response<Full<Bytes>> {
    tokio::time::sleep(e.args.wake).await;
    if e.args.fail_at == Some(FailAt::Wake) {
        tracing::error!(target: "fake_engine", engine_id = e.args.engine_id, "injected failure at wake");
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":"injected failure at wake"}"#.into(),
        );
    }
    let already = e.st().claimed;
    if !already {
        if let Err(msg) = e.take_claim() {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::json!({ "error": msg }).to_string(),
            );
        }
    }
    if e.st().sleeping {
        e.gpu_alloc();
    }
    let mut s = e.st();
    s.claimed = true;
    s.sleeping = false;
    if e.args.fail_at == Some(FailAt::Serve) {
        s.failing = true;
    }
    tracing::info!(target: "fake_engine", engine_id = e.args.engine_id, "awake");
    reply(StatusCode::OK, "{}".into())
}

async fn completion(e: &Engine) -> Response<Full<Bytes>> {
    let (sleeping, claimed, ever_slept, failing) = {
        let s = e.st();
        (s.sleeping, s.claimed, s.ever_slept, s.failing)
    };
    if sleeping {
        return reply(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"error":"sleeping"}"#.into(),
        );
    }
    if failing {
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":"injected failure at serve"}"#.into(),
        );
    }
    if !claimed && !ever_slept {
        if let Err(msg) = e.take_claim() {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::json!({ "error": msg }).to_string(),
            );
        }
        let mut s = e.st();
        s.claimed = true;
        if e.args.fail_at == Some(FailAt::Serve) {
            s.failing = true;
        }
    }
    let id = e.args.engine_id;
    reply(
        StatusCode::OK,
        serde_json::json!({
            "id": format!("cmpl-fake-{id}"),
            "object": "text_completion",
            "engine_id": id,
            "pid": std::process::id(),
            "choices": [{"index": 0, "text": format!("served by engine {id}"), "finish_reason": "stop"}],
        })
        .to_string(),
    )
}

async fn handle(e: Arc<Engine>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => {
            if e.st().failing {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    r#"{"error":"engine dead"}"#.into(),
                )
            } else {
                reply(StatusCode::OK, "{}".into())
            }
        }
        (Method::GET, "/is_sleeping") => {
            let s = e.st().sleeping;
            reply(
                StatusCode::OK,
                serde_json::json!({ "is_sleeping": s }).to_string(),
            )
        }
        (Method::POST, "/sleep") | (Method::POST, "/release_memory_occupation") => {
            do_sleep(&e).await
        }
        (Method::POST, "/wake_up") | (Method::POST, "/resume_memory_occupation") => {
            do_wake(&e).await
        }
        (Method::POST, "/v1/completions") => completion(&e).await,
        _ => reply(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#.into()),
    }
}

/// Serves the API on `--host`:`--port` until the process is killed.
pub async fn serve(engine: Engine) -> anyhow::Result<()> {
    let listener =
        tokio::net::TcpListener::bind((engine.args.host.as_str(), engine.args.port)).await?;
    tracing::info!(target: "fake_engine",
        engine_id = engine.args.engine_id,
        port = engine.args.port,
        "fake-engine serving"
    );
    let engine = Arc::new(engine);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(target: "fake_engine", error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let e = engine.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let e = e.clone();
                async move { Ok::<_, Infallible>(handle(e, req).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
