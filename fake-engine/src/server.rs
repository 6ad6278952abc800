//! The HTTP API, modelled on vLLM's and SGLang's (docs/INTERFACES.md, docs/CONTRACTS.md), with
//! their documented semantics kept strictly so that a caller that skips a documented step fails
//! a test instead of passing by luck:
//!
//! * vLLM (docs/features/sleep_mode.md; vllm/entrypoints/serve/sleep/api_router.py and
//!   rpc/api_router.py): `POST /sleep?level=1|2[&mode=abort|wait|keep][&tags=..]`,
//!   `POST /wake_up[?tags=weights|kv_cache]`, `POST /collective_rpc {"method":"reload_weights"}`,
//!   `GET /is_sleeping` (true while any memory tag sleeps *or* scheduling is paused). Level 2
//!   discards the weights: a wake remaps their memory empty, so until `reload_weights` the
//!   engine serves garbage (completions carry `"garbage": true`). `reload_weights` while the
//!   weight memory is still unmapped kills the engine (a write to unmapped device memory).
//!   Sleeping pauses scheduling: a request to a sleeping engine waits for the wake.
//! * SGLang (docs/advanced_features/sglang_for_rl.md; python/sglang/srt/entrypoints/
//!   http_server.py, managers/tokenizer_manager.py, managers/scheduler_update_weights_mixin.py):
//!   `POST /pause_generation {"mode":"abort|retract|in_place"}` (new requests wait until
//!   `/continue_generation`), `POST /release_memory_occupation {"tags":[..]}` (asserts the
//!   scheduler is idle: with a request in flight the server crashes: 500 and the process
//!   exits), `POST /resume_memory_occupation {"tags":[..]}` (weights restored only with
//!   `--enable-weights-cpu-backup`, otherwise garbage), and with `--personality sglang` a
//!   `/health` that generates a token (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::Notify;

use crate::claim::Claim;
use crate::cli::{Args, FailAt, Personality};

/// Where the weights are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Weights {
    /// On the device, correct.
    Loaded,
    /// Asleep, backed up in host memory (vLLM level 1, SGLang with a CPU backup).
    Offloaded,
    /// Asleep, discarded (vLLM level 2 or `tags=weights`, SGLang without a CPU backup).
    Discarded,
    /// Device memory mapped again but its content undefined (woken after a discard).
    Garbage,
}

/// Mutable engine state.
#[derive(Debug)]
struct EngState {
    /// The weights.
    weights: Weights,
    /// KV cache released.
    kv_asleep: bool,
    /// Scheduling paused (SGLang `/pause_generation`; vLLM pauses it while asleep).
    paused: bool,
    /// Paused with SGLang's `retract`: running requests went back to the waiting queue, which
    /// the release's idle assertion ignores.
    retracted: bool,
    /// Requests generating now.
    running: u32,
    /// Bumped to abort every running request.
    abort_gen: u64,
    /// Slept at least once (then the claim is taken on wake, not on first serve).
    ever_slept: bool,
    /// Holds the GPU claim.
    claimed: bool,
    /// `--fail-at serve` has kicked in, or the engine died (`/health` 503).
    failing: bool,
}

impl EngState {
    fn weights_asleep(&self) -> bool {
        matches!(self.weights, Weights::Offloaded | Weights::Discarded)
    }
    /// Some memory tag sleeps.
    fn asleep(&self) -> bool {
        self.weights_asleep() || self.kv_asleep
    }
    /// A request would be scheduled now.
    fn serving(&self) -> bool {
        !self.asleep() && !self.paused
    }
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
    /// Signalled on every state change (waiting requests re-check).
    changed: Notify,
    /// The engine's pid and its workers' (registered on the simulated GPU with the claim).
    pids: Vec<u32>,
}

/// Counts a generating request; uncounts it however the handler ends (a client that gives up
/// drops the handler).
struct Running<'a>(&'a Engine);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.st().running -= 1;
        self.0.changed.notify_waiters();
    }
}

impl Engine {
    /// The engine after load: awake, not holding the claim yet.
    pub fn new(args: Args, claim: Option<Claim>, pids: Vec<u32>) -> Engine {
        Engine {
            args,
            claim,
            state: Mutex::new(EngState {
                weights: Weights::Loaded,
                kv_asleep: false,
                paused: false,
                retracted: false,
                running: 0,
                abort_gen: 0,
                ever_slept: false,
                claimed: false,
                failing: false,
            }),
            changed: Notify::new(),
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

    /// Change the state and wake every waiter.
    fn update<T>(&self, f: impl FnOnce(&mut EngState) -> T) -> T {
        let r = f(&mut self.st());
        self.changed.notify_waiters();
        r
    }

    /// Wait until `pred` holds (re-checked on every state change).
    async fn wait_for(&self, pred: impl Fn(&EngState) -> bool) {
        loop {
            let n = self.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if pred(&self.st()) {
                return;
            }
            n.await;
        }
    }

    fn sglang(&self) -> bool {
        self.args.personality == Personality::Sglang
    }

    /// The server dies as SGLang's does when its scheduler raises (the scheduler process
    /// signals its parent, which kills the tree): answer 500, then exit.
    fn crash(&self, what: &str) -> Response<Full<Bytes>> {
        tracing::error!(target: "fake_engine", engine_id = self.args.engine_id, error = what, "engine crashed; exiting");
        self.update(|s| s.failing = true);
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            std::process::exit(1);
        });
        reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({ "error": what }).to_string(),
        )
    }

    /// Memory went to sleep: give back the claim and the device memory.
    fn after_sleep(&self, was_asleep: bool) {
        if was_asleep {
            return;
        }
        let was_claimed = self.update(|s| {
            s.ever_slept = true;
            std::mem::replace(&mut s.claimed, false)
        });
        if was_claimed {
            if let Some(c) = &self.claim {
                c.release();
            }
        }
        self.gpu_free();
        tracing::info!(target: "fake_engine", engine_id = self.args.engine_id, "sleeping");
    }

    /// Memory is being mapped again: take the claim and the device memory. Err: the split-brain
    /// message.
    fn before_wake(&self) -> Result<(), String> {
        let (claimed, asleep) = {
            let s = self.st();
            (s.claimed, s.asleep())
        };
        if !claimed {
            self.take_claim()?;
            self.st().claimed = true;
        }
        if asleep {
            self.gpu_alloc();
        }
        Ok(())
    }

    /// After a wake call: arm `--fail-at serve` once fully awake.
    fn after_wake(&self) {
        let fail = self.args.fail_at == Some(FailAt::Serve);
        self.update(|s| {
            if !s.asleep() && fail {
                s.failing = true;
            }
        });
        tracing::info!(target: "fake_engine", engine_id = self.args.engine_id, state = ?self.st().weights, "woken");
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

fn ok() -> Response<Full<Bytes>> {
    reply(StatusCode::OK, "{}".into())
}

fn injected(e: &Engine, at: FailAt) -> Option<Response<Full<Bytes>>> {
    if e.args.fail_at != Some(at) {
        return None;
    }
    // The log lines tests look for ("injected failure at wake").
    let id = e.args.engine_id;
    let body = match at {
        FailAt::Sleep => {
            tracing::error!(target: "fake_engine", engine_id = id, "injected failure at sleep");
            r#"{"error":"injected failure at sleep"}"#
        }
        _ => {
            tracing::error!(target: "fake_engine", engine_id = id, "injected failure at wake");
            r#"{"error":"injected failure at wake"}"#
        }
    };
    Some(reply(StatusCode::INTERNAL_SERVER_ERROR, body.into()))
}

/// Query parameters of `uri` as (key, value) pairs (no percent-decoding: the values used here
/// are plain words).
fn query(req_query: Option<&str>) -> Vec<(String, String)> {
    req_query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (p.to_string(), String::new()),
        })
        .collect()
}

/// The memory tags named by `tags` (none: all), as (weights, kv_cache).
fn tag_set(tags: &[String]) -> Result<(bool, bool), String> {
    if tags.is_empty() {
        return Ok((true, true));
    }
    let (mut w, mut k) = (false, false);
    for t in tags {
        match t.as_str() {
            "weights" => w = true,
            "kv_cache" => k = true,
            other => return Err(format!("unknown memory tag {other:?} (weights, kv_cache)")),
        }
    }
    Ok((w, k))
}

fn bad_request(msg: String) -> Response<Full<Bytes>> {
    reply(
        StatusCode::BAD_REQUEST,
        serde_json::json!({ "error": msg }).to_string(),
    )
}

/// Abort every running request and wait until none runs.
async fn abort_running(e: &Engine) {
    e.update(|s| s.abort_gen += 1);
    e.wait_for(|s| s.running == 0).await;
}

/// vLLM `POST /sleep?level=N&mode=M[&tags=T...]` (vllm/entrypoints/serve/sleep/api_router.py:
/// level defaults to 1, mode to abort; tags take precedence over the level).
async fn vllm_sleep(e: &Engine, q: &[(String, String)]) -> Response<Full<Bytes>> {
    let get = |k: &str| q.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str());
    let level = match get("level").unwrap_or("1").parse::<u8>() {
        Ok(l @ 0..=2) => l,
        _ => return bad_request("level must be 0, 1 or 2".into()),
    };
    let mode = get("mode").unwrap_or("abort");
    if !matches!(mode, "abort" | "wait" | "keep") {
        return bad_request(format!("mode {mode:?}: abort, wait or keep"));
    }
    let tags: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "tags")
        .map(|(_, v)| v.clone())
        .collect();
    let (weights, kv) = if !tags.is_empty() {
        match tag_set(&tags) {
            Ok(x) => x,
            Err(m) => return bad_request(m),
        }
    } else {
        (level >= 1, level >= 1)
    };
    tokio::time::sleep(e.args.sleep).await;
    if let Some(r) = injected(e, FailAt::Sleep) {
        return r;
    }
    // Sleeping pauses scheduling first; `mode` says what happens to requests in flight.
    e.update(|s| s.paused = true);
    match mode {
        "abort" => abort_running(e).await,
        "wait" => e.wait_for(|s| s.running == 0).await,
        _ => {} // keep: frozen, they resume on wake
    }
    let was_asleep = e.update(|s| {
        let was = s.asleep();
        if weights && !s.weights_asleep() {
            // Level 1 backs the weights up in CPU memory; level 2 and `tags=weights` discard.
            s.weights = if tags.is_empty() && level == 1 {
                Weights::Offloaded
            } else {
                Weights::Discarded
            };
        }
        s.kv_asleep |= kv;
        was
    });
    if weights || kv {
        e.after_sleep(was_asleep);
    }
    ok()
}

/// vLLM `POST /wake_up[?tags=..]`: remaps the tags' memory; discarded weights come back empty.
async fn vllm_wake(e: &Engine, q: &[(String, String)]) -> Response<Full<Bytes>> {
    let tags: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "tags")
        .map(|(_, v)| v.clone())
        .collect();
    let (weights, kv) = match tag_set(&tags) {
        Ok(x) => x,
        Err(m) => return bad_request(m),
    };
    if let Err(r) = remap(e, weights, kv, true).await {
        return r;
    }
    ok()
}

/// vLLM `POST /collective_rpc {"method": ...}` (vllm/entrypoints/serve/rpc/api_router.py).
async fn collective_rpc(e: &Engine, body: &[u8]) -> Response<Full<Bytes>> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return bad_request("JSON decode error".into());
    };
    let Some(method) = v.get("method").and_then(|m| m.as_str()) else {
        return bad_request("Missing 'method' in request body".into());
    };
    if method != "reload_weights" {
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({ "error": format!("worker has no method {method:?}") }).to_string(),
        );
    }
    if e.st().weights_asleep() {
        // Loading into weight memory that is not mapped: the workers fault, the engine is dead
        // (vLLM answers EngineDeadError and /health 503 from then on).
        tracing::error!(target: "fake_engine", engine_id = e.args.engine_id,
            "reload_weights while the weights sleep: illegal memory access; engine dead");
        e.update(|s| s.failing = true);
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":"EngineDeadError: reload_weights wrote to unmapped weight memory (wake_up?tags=weights first)"}"#.into(),
        );
    }
    tokio::time::sleep(e.args.reload).await;
    e.update(|s| s.weights = Weights::Loaded);
    tracing::info!(target: "fake_engine", engine_id = e.args.engine_id, "weights reloaded");
    reply(StatusCode::OK, r#"{"results":[null]}"#.into())
}

/// The `tags` of an SGLang memory call's JSON body (absent or null: all).
fn body_tags(body: &[u8]) -> Result<Vec<String>, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Vec::new());
    }
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("JSON decode error: {e}"))?;
    match v.get("tags") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or("tags: strings".to_string())
            })
            .collect(),
        Some(_) => Err("tags must be a list".into()),
    }
}

/// SGLang `POST /pause_generation {"mode": ...}` (tokenizer_manager.py: `is_pause = True`; abort
/// aborts every request and waits until none is left).
async fn pause_generation(e: &Engine, body: &[u8]) -> Response<Full<Bytes>> {
    let mode = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("mode").and_then(|m| m.as_str()).map(str::to_string))
        .unwrap_or_else(|| "abort".into());
    if !matches!(mode.as_str(), "abort" | "retract" | "in_place") {
        return bad_request(format!("mode {mode:?}: abort, retract or in_place"));
    }
    e.update(|s| {
        s.paused = true;
        s.retracted = mode == "retract";
    });
    if mode == "abort" {
        abort_running(e).await;
    }
    tracing::info!(target: "fake_engine", engine_id = e.args.engine_id, mode, "generation paused");
    reply(
        StatusCode::OK,
        r#"{"message":"Generation paused successfully.","status":"ok"}"#.into(),
    )
}

/// SGLang `POST /continue_generation`.
fn continue_generation(e: &Engine) -> Response<Full<Bytes>> {
    e.update(|s| {
        s.paused = false;
        s.retracted = false;
    });
    tracing::info!(target: "fake_engine", engine_id = e.args.engine_id, "generation continued");
    reply(
        StatusCode::OK,
        r#"{"message":"Generation continued successfully.","status":"ok"}"#.into(),
    )
}

/// SGLang `POST /release_memory_occupation {"tags": [...]}`.
async fn release_memory(e: &Engine, body: &[u8]) -> Response<Full<Bytes>> {
    let (weights, kv) = match body_tags(body).and_then(|t| tag_set(&t)) {
        Ok(x) => x,
        Err(m) => return bad_request(m),
    };
    tokio::time::sleep(e.args.sleep).await;
    if let Some(r) = injected(e, FailAt::Sleep) {
        return r;
    }
    // scheduler_update_weights_mixin.py: `assert self.is_fully_idle(...)`, raised in the
    // scheduler process, which takes the whole server down.
    let busy = {
        let s = e.st();
        s.running > 0 && !(s.paused && s.retracted)
    };
    if busy {
        return e.crash(
            "AssertionError: release_memory_occupation should be called only when server is idle.",
        );
    }
    let backup = e.args.enable_weights_cpu_backup;
    let was_asleep = e.update(|s| {
        let was = s.asleep();
        if weights && !s.weights_asleep() {
            s.weights = if backup {
                Weights::Offloaded
            } else {
                Weights::Discarded
            };
        }
        s.kv_asleep |= kv;
        was
    });
    e.after_sleep(was_asleep);
    reply(StatusCode::OK, "null".into())
}

/// SGLang `POST /resume_memory_occupation {"tags": [...]}` (does not continue generation).
async fn resume_memory(e: &Engine, body: &[u8]) -> Response<Full<Bytes>> {
    let (weights, kv) = match body_tags(body).and_then(|t| tag_set(&t)) {
        Ok(x) => x,
        Err(m) => return bad_request(m),
    };
    if let Err(r) = remap(e, weights, kv, false).await {
        return r;
    }
    reply(StatusCode::OK, "null".into())
}

/// The wake path both personalities share: the configured wake delay, an injected failure,
/// the GPU claim/simulated device (`before_wake`), then the tags' memory comes back —
/// offloaded weights as they were, discarded ones as garbage (vLLM level 2 without the reload;
/// SGLang without `--enable-weights-cpu-backup`: the remapped memory is undefined). vLLM
/// resumes scheduling once every tag is awake (`resume_scheduling`); SGLang waits for
/// `/continue_generation`.
async fn remap(
    e: &Engine,
    weights: bool,
    kv: bool,
    resume_scheduling: bool,
) -> Result<(), Response<Full<Bytes>>> {
    tokio::time::sleep(e.args.wake).await;
    if let Some(r) = injected(e, FailAt::Wake) {
        return Err(r);
    }
    if let Err(msg) = e.before_wake() {
        return Err(reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({ "error": msg }).to_string(),
        ));
    }
    e.update(|s| {
        if weights {
            s.weights = match s.weights {
                Weights::Offloaded => Weights::Loaded,
                Weights::Discarded => Weights::Garbage,
                w => w,
            };
        }
        if kv {
            s.kv_asleep = false;
        }
        if resume_scheduling && !s.asleep() {
            s.paused = false;
        }
    });
    e.after_wake();
    Ok(())
}

/// `GET /health`.
async fn health(e: &Engine) -> Response<Full<Bytes>> {
    let dead = || {
        reply(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"error":"engine dead"}"#.into(),
        )
    };
    if e.st().failing {
        return dead();
    }
    if !e.sglang() || !e.args.health_generation {
        return ok();
    }
    // SGLang's generating health check (http_server.py `health_generate`): it submits a
    // one-token request, then looks every second, the first time after 1 s, whether anything
    // came back; after SGLANG_HEALTH_CHECK_TIMEOUT it answers 503. A paused engine holds the
    // request in the tokenizer manager; an engine whose memory is released crashes on it.
    {
        let s = e.st();
        if !s.paused && s.asleep() {
            drop(s);
            return e.crash("CUDA error: an illegal memory access was encountered (health check on released memory)");
        }
    }
    let limit = Duration::from_secs(e.args.health_check_timeout_secs);
    let served = tokio::time::timeout(limit, e.wait_for(|s| s.serving() || s.failing)).await;
    // The first look is after one second, and the token takes a moment.
    tokio::time::sleep(Duration::from_millis(1010)).await;
    if served.is_err() || e.st().failing {
        return dead();
    }
    ok()
}

async fn completion(e: &Engine) -> Response<Full<Bytes>> {
    let released_unpaused = |s: &EngState| s.asleep() && !s.paused;
    if e.sglang() && released_unpaused(&e.st()) {
        return e.crash("CUDA error: an illegal memory access was encountered (request scheduled on released memory)");
    }
    // A sleeping or paused engine holds the request until it serves again (bounded by the
    // client's own timeout: a client that gives up drops this handler).
    e.wait_for(|s| s.serving() || s.failing || released_unpaused(s))
        .await;
    if e.sglang() && released_unpaused(&e.st()) {
        return e.crash("CUDA error: an illegal memory access was encountered (request scheduled on released memory)");
    }
    let (claimed, ever_slept, failing) = {
        let s = e.st();
        (s.claimed, s.ever_slept, s.failing)
    };
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
    // Generate: in flight for --completion-time, unless aborted meanwhile.
    let abort_at = {
        let mut s = e.st();
        s.running += 1;
        s.abort_gen
    };
    let aborted = {
        let _running = Running(e);
        tokio::select! {
            _ = tokio::time::sleep(e.args.completion_time) => false,
            _ = e.wait_for(|s| s.abort_gen != abort_at) => true,
        }
    };
    let id = e.args.engine_id;
    if aborted {
        // vLLM and SGLang both return what was generated so far, finished with "abort".
        return reply(
            StatusCode::OK,
            serde_json::json!({
                "id": format!("cmpl-fake-{id}"),
                "object": "text_completion",
                "engine_id": id,
                "pid": std::process::id(),
                "choices": [{"index": 0, "text": "", "finish_reason": "abort"}],
            })
            .to_string(),
        );
    }
    let garbage = e.st().weights == Weights::Garbage;
    let text = if garbage {
        format!("GARBAGE from engine {id}: its weights were discarded and never reloaded")
    } else {
        format!("served by engine {id}")
    };
    reply(
        StatusCode::OK,
        serde_json::json!({
            "id": format!("cmpl-fake-{id}"),
            "object": "text_completion",
            "engine_id": id,
            "pid": std::process::id(),
            "garbage": garbage,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
        })
        .to_string(),
    )
}

async fn handle(e: Arc<Engine>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let q = query(req.uri().query());
    let method = req.method().clone();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    match (method, path.as_str()) {
        (Method::GET, "/health") => health(&e).await,
        (Method::GET, "/is_sleeping") => {
            // vLLM docs/features/sleep_mode.md: true until every tag is awake, and while
            // scheduling is paused.
            let s = {
                let s = e.st();
                s.asleep() || s.paused
            };
            reply(
                StatusCode::OK,
                serde_json::json!({ "is_sleeping": s }).to_string(),
            )
        }
        (Method::POST, "/sleep") => vllm_sleep(&e, &q).await,
        (Method::POST, "/wake_up") => vllm_wake(&e, &q).await,
        (Method::POST, "/collective_rpc") => collective_rpc(&e, &body).await,
        (Method::POST, "/pause_generation") => pause_generation(&e, &body).await,
        (Method::POST, "/continue_generation") => continue_generation(&e),
        (Method::POST, "/release_memory_occupation") => release_memory(&e, &body).await,
        (Method::POST, "/resume_memory_occupation") => resume_memory(&e, &body).await,
        (Method::POST, "/v1/completions") => completion(&e).await,
        _ => reply(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#.into()),
    }
}

/// Watches the (non-detached) workers, the engine's children: when one has died, the engine
/// is dead as vLLM's is when its EngineCore or a worker dies (`/health` 503, completions 500),
/// and the process exits with status 0 after `--worker-death-exit`.
async fn watch_workers(e: Arc<Engine>) {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let workers: Vec<nix::unistd::Pid> = e.pids[1..]
        .iter()
        .map(|p| nix::unistd::Pid::from_raw(*p as i32))
        .collect();
    if workers.is_empty() || e.args.detach_workers {
        return;
    }
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let dead = workers.iter().find_map(|w| {
            match waitpid(*w, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => None,
                Ok(st) => Some(format!("{w}: {st:?}")),
                // Not our child any more (already reaped): dead too.
                Err(_) => Some(format!("{w}: gone")),
            }
        });
        if let Some(what) = dead {
            tracing::error!(target: "fake_engine", engine_id = e.args.engine_id, worker = %what,
                exit_after_ms = e.args.worker_death_exit.as_millis() as u64,
                "a worker died: engine dead (/health 503); exiting with status 0 after the delay");
            e.update(|s| s.failing = true);
            tokio::time::sleep(e.args.worker_death_exit).await;
            std::process::exit(0);
        }
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
    tokio::spawn(watch_workers(engine.clone()));
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
