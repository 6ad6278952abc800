//! Engine adapters: how to check health, put to sleep and wake a given engine over HTTP.
//!
//! An adapter only *describes* calls ([`HttpCall`]); [`EngineClient`] executes them. Adding a
//! third engine is one more `impl Adapter` with its endpoints.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Errors of engine calls. A failed sleep or wake ends in Dead: nobody retries.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// The engine URL or a path did not form a valid URI.
    #[error("invalid engine url {0}")]
    Url(String),
    /// Connection or protocol failure.
    #[error("{method} {path}: {message}")]
    Http {
        /// Request method.
        method: Method,
        /// Request path.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// Non-2xx answer.
    #[error("{method} {path}: HTTP {status}: {body}")]
    Status {
        /// Request method.
        method: Method,
        /// Request path.
        path: String,
        /// Status code.
        status: u16,
        /// First bytes of the body.
        body: String,
    },
    /// 2xx answer whose content did not confirm what we asked for.
    #[error("{path}: expected {expected}, got {got}")]
    Unconfirmed {
        /// Request path.
        path: String,
        /// What we expected.
        expected: String,
        /// What came back.
        got: String,
    },
    /// The call did not finish in time.
    #[error("{path}: timed out after {after:?}")]
    Timeout {
        /// Request path.
        path: String,
        /// The time limit.
        after: Duration,
    },
}

/// How an answer is judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Any 2xx status.
    Success,
    /// 2xx with a JSON body whose top-level `field` is the boolean `value`.
    JsonBool {
        /// Field name.
        field: &'static str,
        /// Required value.
        value: bool,
    },
}

/// One HTTP call against the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpCall {
    /// GET or POST.
    pub method: Method,
    /// Path and query, e.g. `/sleep?level=1`.
    pub path: String,
    /// JSON body for POSTs that need one (SGLang's memory calls take `{}`).
    pub json_body: Option<&'static str>,
    /// What counts as success.
    pub expect: Expect,
}

impl HttpCall {
    fn new(method: Method, path: impl Into<String>, expect: Expect) -> HttpCall {
        HttpCall {
            method,
            path: path.into(),
            json_body: None,
            expect,
        }
    }
}

/// What a sleep does with the requests in flight (vLLM's `/sleep?mode=`, vllm/engine/protocol.py
/// `pause_generation`: `abort` aborts them and returns partial results, `wait` lets them finish,
/// `keep` freezes them until the wake).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepMode {
    /// Abort in-flight requests (vLLM's default). The first sleep of a shadow in Init uses it:
    /// nothing is routed to an engine that never was Active.
    Abort,
    /// Let in-flight requests finish first: for demoting an engine that served (the driver
    /// never demotes today).
    Wait,
    /// Freeze them; they resume on wake.
    Keep,
}

impl SleepMode {
    /// The query value.
    pub fn as_str(self) -> &'static str {
        match self {
            SleepMode::Abort => "abort",
            SleepMode::Wait => "wait",
            SleepMode::Keep => "keep",
        }
    }
}

/// One engine flavour's endpoints.
pub trait Adapter: Send + Sync + std::fmt::Debug {
    /// Name (`vllm`, `sglang`).
    fn name(&self) -> &'static str;
    /// Health check: success means healthy.
    fn health(&self) -> HttpCall;
    /// Put to sleep (offload weights, free KV cache) with `mode` for requests in flight, then
    /// confirm.
    fn sleep_with(&self, mode: SleepMode) -> Vec<HttpCall>;
    /// The first sleep (Init): [`SleepMode::Abort`].
    fn sleep(&self) -> Vec<HttpCall> {
        self.sleep_with(SleepMode::Abort)
    }
    /// Wake up, then confirm.
    fn wake(&self) -> Vec<HttpCall>;
}

/// vLLM with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1`.
///
/// Source: vLLM docs/features/sleep_mode.md and vllm/entrypoints/serve/sleep/api_router.py
/// (`/sleep?level=&mode=`, `/wake_up?tags=`, `/is_sleeping`), rpc/api_router.py
/// (`/collective_rpc`).
#[derive(Clone, Debug)]
pub struct Vllm {
    /// `/sleep?level=`: 1 offloads weights and drops the KV cache, 2 drops both.
    pub sleep_level: u8,
}

/// GET `/is_sleeping`, expecting `value`.
fn is_sleeping(value: bool) -> HttpCall {
    HttpCall::new(
        Method::GET,
        "/is_sleeping",
        Expect::JsonBool {
            field: "is_sleeping",
            value,
        },
    )
}

impl Adapter for Vllm {
    fn name(&self) -> &'static str {
        "vllm"
    }
    fn health(&self) -> HttpCall {
        HttpCall::new(Method::GET, "/health", Expect::Success)
    }
    fn sleep_with(&self, mode: SleepMode) -> Vec<HttpCall> {
        vec![
            // api_router.py: `level` (default 1) and `mode` (default abort) query parameters.
            HttpCall::new(
                Method::POST,
                format!("/sleep?level={}&mode={}", self.sleep_level, mode.as_str()),
                Expect::Success,
            ),
            // sleep_mode.md: `is_sleeping` reads true while any memory tag sleeps.
            is_sleeping(true),
        ]
    }
    fn wake(&self) -> Vec<HttpCall> {
        if self.sleep_level == 1 {
            // Level 1 backed the weights up in CPU memory: a plain wake restores them.
            return vec![
                HttpCall::new(Method::POST, "/wake_up", Expect::Success),
                is_sleeping(false),
            ];
        }
        // Level 2 discarded the weights; a plain `/wake_up` would remap their memory empty and
        // serve garbage. sleep_mode.md, "level 2": reallocate the weights only, load them in
        // place, then reallocate the KV cache.
        vec![
            HttpCall::new(Method::POST, "/wake_up?tags=weights", Expect::Success),
            HttpCall {
                json_body: Some(r#"{"method":"reload_weights"}"#),
                ..HttpCall::new(Method::POST, "/collective_rpc", Expect::Success)
            },
            HttpCall::new(Method::POST, "/wake_up?tags=kv_cache", Expect::Success),
            // sleep_mode.md: true until every sleeping tag is restored.
            is_sleeping(false),
        ]
    }
}

/// SGLang with `--enable-memory-saver` (and `--enable-weights-cpu-backup`, without which resumed
/// weights are undefined: python/sglang/srt/server_args.py). It has no "is sleeping" query, so
/// the 2xx answers are the confirmation.
///
/// Source: SGLang docs/advanced_features/sglang_for_rl.md ("Release Memory": the call asserts
/// there are no ongoing requests; "Pause Generation": pause, then continue),
/// python/sglang/srt/entrypoints/http_server.py.
#[derive(Clone, Debug)]
pub struct Sglang;

impl Adapter for Sglang {
    fn name(&self) -> &'static str {
        "sglang"
    }
    fn health(&self) -> HttpCall {
        // http_server.py `health_generate`: unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is
        // false it generates one token and answers after 1 s at the earliest (503 after
        // SGLANG_HEALTH_CHECK_TIMEOUT, 20 s): `--health-timeout` defaults to 25s for sglang.
        HttpCall::new(Method::GET, "/health", Expect::Success)
    }
    fn sleep_with(&self, _mode: SleepMode) -> Vec<HttpCall> {
        // SGLang's pause modes are abort, retract and in_place; none waits for requests to
        // finish, and retract/in_place would leave them frozen in an engine that goes to
        // sleep: every sleep aborts (sglang_for_rl.md, "Pause Generation").
        vec![
            // tokenizer_manager.py `pause_generation`: new requests wait from here on; abort
            // mode aborts those in flight and returns when none is left, so the release's
            // idle assertion holds.
            HttpCall {
                json_body: Some(r#"{"mode":"abort"}"#),
                ..HttpCall::new(Method::POST, "/pause_generation", Expect::Success)
            },
            HttpCall {
                json_body: Some(r#"{"tags":["kv_cache","weights"]}"#),
                ..HttpCall::new(Method::POST, "/release_memory_occupation", Expect::Success)
            },
        ]
    }
    fn wake(&self) -> Vec<HttpCall> {
        vec![
            HttpCall {
                json_body: Some(r#"{"tags":["weights","kv_cache"]}"#),
                ..HttpCall::new(Method::POST, "/resume_memory_occupation", Expect::Success)
            },
            // Requests held since the pause run from here on.
            HttpCall {
                json_body: Some("{}"),
                ..HttpCall::new(Method::POST, "/continue_generation", Expect::Success)
            },
        ]
    }
}

/// Adapter kind on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AdapterKind {
    /// vLLM (`/sleep`, `/wake_up`, `/is_sleeping`, `/collective_rpc` for level 2).
    Vllm,
    /// SGLang (`/pause_generation`, `/release_memory_occupation`,
    /// `/resume_memory_occupation`, `/continue_generation`).
    Sglang,
}

impl AdapterKind {
    /// Build the adapter.
    pub fn build(self, sleep_level: u8) -> Arc<dyn Adapter> {
        match self {
            AdapterKind::Vllm => Arc::new(Vllm { sleep_level }),
            AdapterKind::Sglang => Arc::new(Sglang),
        }
    }
}

/// What the supervisor should say once, at its start, about the engine command it was given
/// (pure: the command line, `VLLM_SERVER_DEV_MODE` as the engine will inherit it, the stop
/// grace). Each entry is one warning line.
pub fn command_notes(
    kind: AdapterKind,
    argv: &[std::ffi::OsString],
    dev_mode: Option<&str>,
    stop_grace: Duration,
) -> Vec<String> {
    if kind != AdapterKind::Vllm {
        return Vec::new();
    }
    let args: Vec<String> = argv
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let flag = |name: &str| {
        let eq = format!("{name}=");
        args.iter().enumerate().find_map(|(i, a)| {
            if a == name {
                Some(args.get(i + 1).cloned().unwrap_or_default())
            } else {
                a.strip_prefix(&eq).map(str::to_string)
            }
        })
    };
    let mut notes = Vec::new();
    if dev_mode != Some("1") {
        // vllm/entrypoints/serve/__init__.py mounts the sleep router only when
        // envs.VLLM_SERVER_DEV_MODE is set.
        notes.push(
            "VLLM_SERVER_DEV_MODE is not 1: vLLM will not serve /sleep, /wake_up and /is_sleeping, so the engine cannot sleep as a shadow".to_string(),
        );
    }
    if flag("--enable-sleep-mode").is_none() {
        // vLLM's CPU platform refuses --enable-sleep-mode ("Sleep mode is not supported on
        // current platform"); its /sleep still pauses the scheduler.
        notes.push(
            "vLLM runs without --enable-sleep-mode (a CPU build refuses it): /sleep pauses the engine but frees no memory, so a sleeping shadow keeps its weights and KV cache resident".to_string(),
        );
    }
    // vllm/entrypoints/cli/serve.py / launcher.py: --shutdown-timeout N lets in-flight requests
    // finish for up to N seconds after SIGTERM; the stop grace must outlast it.
    if let Some(secs) = flag("--shutdown-timeout").and_then(|v| v.parse::<f64>().ok()) {
        if secs > 0.0 && Duration::from_secs_f64(secs.min(1e9)) >= stop_grace {
            notes.push(format!(
                "vLLM drains for up to --shutdown-timeout {secs} s after SIGTERM but --stop-grace is {stop_grace:?}: a drain longer than the grace is cut by SIGKILL"
            ));
        }
    }
    notes
}

/// Executes an adapter's calls against one engine.
#[derive(Clone, Debug)]
pub struct EngineClient {
    /// `scheme://authority` of the engine, without a trailing slash.
    base: String,
    /// Pooled HTTP/1 client (keep-alive saves a connect on the failover path).
    client: Client<HttpConnector, Full<Bytes>>,
    /// The engine flavour.
    adapter: Arc<dyn Adapter>,
}

impl EngineClient {
    /// Client for the engine at `url` (e.g. `http://127.0.0.1:8000`).
    pub fn new(url: &str, adapter: Arc<dyn Adapter>) -> Result<EngineClient, AdapterError> {
        let base = url.trim_end_matches('/').to_string();
        let uri: Uri = base
            .parse()
            .map_err(|_| AdapterError::Url(url.to_string()))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(AdapterError::Url(format!(
                "{url} (only http://host:port is supported)"
            )));
        }
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(Duration::from_secs(2)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(conn);
        Ok(EngineClient {
            base,
            client,
            adapter,
        })
    }

    /// The adapter.
    pub fn adapter(&self) -> &Arc<dyn Adapter> {
        &self.adapter
    }

    /// Execute one call, bounded by `timeout`.
    pub async fn call(&self, c: &HttpCall, timeout: Duration) -> Result<(), AdapterError> {
        match tokio::time::timeout(timeout, self.call_unbounded(c)).await {
            Ok(r) => r,
            Err(_) => Err(AdapterError::Timeout {
                path: c.path.clone(),
                after: timeout,
            }),
        }
    }

    async fn call_unbounded(&self, c: &HttpCall) -> Result<(), AdapterError> {
        let uri: Uri = format!("{}{}", self.base, c.path)
            .parse()
            .map_err(|_| AdapterError::Url(format!("{}{}", self.base, c.path)))?;
        let http_err = |message: String| AdapterError::Http {
            method: c.method.clone(),
            path: c.path.clone(),
            message,
        };
        let mut b = Request::builder().method(c.method.clone()).uri(uri);
        let body = match c.json_body {
            Some(j) => {
                b = b.header("content-type", "application/json");
                Bytes::from_static(j.as_bytes())
            }
            None => Bytes::new(),
        };
        let req = b
            .body(Full::new(body))
            .map_err(|e| http_err(e.to_string()))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| http_err(format!("{e:?}")))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| http_err(e.to_string()))?
            .to_bytes();
        let body_text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
        if !(200..300).contains(&status) {
            return Err(AdapterError::Status {
                method: c.method.clone(),
                path: c.path.clone(),
                status,
                body: body_text,
            });
        }
        match &c.expect {
            Expect::Success => Ok(()),
            Expect::JsonBool { field, value } => {
                let got = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get(*field).and_then(|b| b.as_bool()));
                if got == Some(*value) {
                    Ok(())
                } else {
                    Err(AdapterError::Unconfirmed {
                        path: c.path.clone(),
                        expected: format!("{field}={value}"),
                        got: body_text,
                    })
                }
            }
        }
    }

    /// Run a sequence of calls; the whole sequence is bounded by `timeout`.
    pub async fn run(&self, calls: &[HttpCall], timeout: Duration) -> Result<(), AdapterError> {
        let deadline = tokio::time::Instant::now() + timeout;
        for c in calls {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            self.call(c, left).await?;
        }
        Ok(())
    }

    /// One health check.
    pub async fn healthy(&self, timeout: Duration) -> bool {
        self.call(&self.adapter.health(), timeout).await.is_ok()
    }

    /// Put the engine to sleep and confirm (the first sleep: [`SleepMode::Abort`]).
    pub async fn sleep(&self, timeout: Duration) -> Result<(), AdapterError> {
        self.run(&self.adapter.sleep(), timeout).await
    }

    /// Put the engine to sleep with `mode` for requests in flight, and confirm.
    pub async fn sleep_with(&self, mode: SleepMode, timeout: Duration) -> Result<(), AdapterError> {
        self.run(&self.adapter.sleep_with(mode), timeout).await
    }

    /// Wake the engine and confirm.
    pub async fn wake(&self, timeout: Duration) -> Result<(), AdapterError> {
        self.run(&self.adapter.wake(), timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(calls: &[HttpCall]) -> Vec<(Method, &str, Option<&str>)> {
        calls
            .iter()
            .map(|c| (c.method.clone(), c.path.as_str(), c.json_body))
            .collect()
    }

    #[test]
    fn command_notes_name_what_the_vllm_command_lacks() {
        let argv = |s: &str| -> Vec<std::ffi::OsString> { s.split(' ').map(Into::into).collect() };
        let g = Duration::from_secs(10);
        let gpu = argv("python -m vllm.entrypoints.openai.api_server --enable-sleep-mode");
        assert!(command_notes(AdapterKind::Vllm, &gpu, Some("1"), g).is_empty());
        let cpu = argv("python -m vllm.entrypoints.openai.api_server --dtype float32");
        let n = command_notes(AdapterKind::Vllm, &cpu, Some("1"), g);
        assert_eq!(n.len(), 1);
        assert!(n[0].contains("frees no memory"), "{n:?}");
        let n = command_notes(AdapterKind::Vllm, &gpu, None, g);
        assert!(
            n.len() == 1 && n[0].contains("VLLM_SERVER_DEV_MODE"),
            "{n:?}"
        );
        let drain = argv("vllm serve m --enable-sleep-mode --shutdown-timeout 30");
        let n = command_notes(AdapterKind::Vllm, &drain, Some("1"), g);
        assert!(
            n.len() == 1 && n[0].contains("--shutdown-timeout 30"),
            "{n:?}"
        );
        let drain = argv("vllm serve m --enable-sleep-mode --shutdown-timeout=5");
        assert!(command_notes(AdapterKind::Vllm, &drain, Some("1"), g).is_empty());
        assert!(command_notes(AdapterKind::Sglang, &cpu, None, g).is_empty());
    }

    #[test]
    fn vllm_level1_calls() {
        let v = Vllm { sleep_level: 1 };
        assert_eq!(
            paths(&v.sleep()),
            [
                (Method::POST, "/sleep?level=1&mode=abort", None),
                (Method::GET, "/is_sleeping", None)
            ]
        );
        assert_eq!(
            v.sleep()[1].expect,
            Expect::JsonBool {
                field: "is_sleeping",
                value: true
            }
        );
        assert_eq!(
            paths(&v.wake()),
            [
                (Method::POST, "/wake_up", None),
                (Method::GET, "/is_sleeping", None)
            ]
        );
        assert_eq!(v.health().path, "/health");
    }

    #[test]
    fn vllm_level2_wakes_weights_reloads_then_kv_cache() {
        let v = Vllm { sleep_level: 2 };
        assert_eq!(v.sleep()[0].path, "/sleep?level=2&mode=abort");
        assert_eq!(
            v.sleep_with(SleepMode::Wait)[0].path,
            "/sleep?level=2&mode=wait"
        );
        assert_eq!(
            paths(&v.wake()),
            [
                (Method::POST, "/wake_up?tags=weights", None),
                (
                    Method::POST,
                    "/collective_rpc",
                    Some(r#"{"method":"reload_weights"}"#)
                ),
                (Method::POST, "/wake_up?tags=kv_cache", None),
                (Method::GET, "/is_sleeping", None)
            ]
        );
        assert_eq!(
            v.wake()[3].expect,
            Expect::JsonBool {
                field: "is_sleeping",
                value: false
            }
        );
    }

    #[test]
    fn sglang_pauses_before_release_and_continues_after_resume() {
        let s = Sglang;
        assert_eq!(
            paths(&s.sleep()),
            [
                (
                    Method::POST,
                    "/pause_generation",
                    Some(r#"{"mode":"abort"}"#)
                ),
                (
                    Method::POST,
                    "/release_memory_occupation",
                    Some(r#"{"tags":["kv_cache","weights"]}"#)
                ),
            ]
        );
        assert_eq!(s.sleep_with(SleepMode::Wait), s.sleep());
        assert_eq!(
            paths(&s.wake()),
            [
                (
                    Method::POST,
                    "/resume_memory_occupation",
                    Some(r#"{"tags":["weights","kv_cache"]}"#)
                ),
                (Method::POST, "/continue_generation", Some("{}")),
            ]
        );
    }

    #[test]
    fn rejects_bad_urls() {
        let a = AdapterKind::Vllm.build(1);
        assert!(EngineClient::new("ftp://x", a.clone()).is_err());
        assert!(EngineClient::new("not a url", a.clone()).is_err());
        assert!(EngineClient::new("http://127.0.0.1:1/", a).is_ok());
    }

    /// A real TCP server that answers 500 / hangs: errors and timeouts surface as errors.
    #[tokio::test]
    async fn failures_and_timeouts_are_errors() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let req = String::from_utf8_lossy(&buf[..n]).to_string();
                    if req.starts_with("POST /wake_up") {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    let (code, body) = if req.starts_with("POST /sleep") {
                        ("500 Internal Server Error", "boom")
                    } else {
                        ("200 OK", "{\"is_sleeping\": false}")
                    };
                    let _ = s
                        .write_all(
                            format!(
                                "HTTP/1.1 {code}\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            )
                            .as_bytes(),
                        )
                        .await;
                });
            }
        });
        let c = EngineClient::new(&format!("http://{addr}"), AdapterKind::Vllm.build(1)).unwrap();
        assert!(c.healthy(Duration::from_secs(2)).await);
        let e = c.sleep(Duration::from_secs(2)).await.unwrap_err();
        assert!(matches!(e, AdapterError::Status { status: 500, .. }), "{e}");
        let e = c.wake(Duration::from_millis(200)).await.unwrap_err();
        assert!(matches!(e, AdapterError::Timeout { .. }), "{e}");
    }
}
