//! lockd's metrics: a `prometheus-client` [`Registry`] kept by the server driver, and the
//! HTTP server (hyper, HTTP/1.1) that exposes it at `GET /metrics` in the OpenMetrics text
//! format.
//!
//! The exposed series names are the ones the dashboards query (`deploy/dashboards`); they are
//! spelled out in full here (counters with their `_total`, which `prometheus-client` appends
//! itself, so it is stripped before registering).

use std::convert::Infallible;
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE as CONTENT_TYPE_HEADER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::proto::Counters;

/// `Content-Type` of the exposition (OpenMetrics text, as `prometheus-client` encodes it).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds (seconds) of the handoff-time histogram buckets.
pub const HANDOFF_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0,
];

/// A fixed-bucket histogram of durations (seconds), registered in a [`Metrics`] registry.
#[derive(Debug, Clone)]
pub struct Histogram(prometheus_client::metrics::histogram::Histogram);

impl Histogram {
    /// An empty histogram over `bounds`.
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram(prometheus_client::metrics::histogram::Histogram::new(
            bounds.iter().copied(),
        ))
    }

    /// Record one duration.
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// Labels of the per-resource gauges.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    /// Resource name, escaped for the exposition (`prometheus-client` writes label values
    /// as they are).
    resource: String,
}

/// Everything lockd exposes. The core's counters, the sessions and the per-resource gauges
/// are copied in from the core at each scrape ([`render`]); the rest is counted here.
#[derive(Debug)]
pub struct Metrics {
    /// Every metric below, registered.
    registry: Registry,
    /// Holder connection close → next grant sent.
    pub handoff: Histogram,
    /// Time to durably write the state file.
    pub persist: Histogram,
    /// Whole state snapshots written (the other writes append to the journal).
    pub snapshots: Counter,
    /// Connections accepted.
    pub connections: Counter,
    /// Requests refused as malformed/unknown/oversized/rate-limited.
    pub bad_requests: Counter,
    /// Wall time (seconds) spent awake in busy-poll mode after requests instead of sleeping
    /// (the requests served meanwhile included): what `--busy-poll` costs in CPU.
    pub busy_poll: Counter<f64, AtomicU64>,
    /// Reads that found their bytes while lockd was busy-polling (wakeups saved).
    pub busy_poll_hits: Counter,
    /// Copies of the core's [`Counters`]: grants, releases, expirations, revocations, reclaims.
    core: [Counter; 7],
    /// Connected sessions.
    sessions: Gauge,
    /// Queued acquires per resource.
    waiters: Family<ResourceLabels, Gauge>,
    /// Whether each resource is held or reclaiming.
    held: Family<ResourceLabels, Gauge>,
}

/// Register `metric`; `help` as documented (`prometheus-client` adds the final full stop).
fn register(registry: &mut Registry, name: &str, help: &str, metric: impl Metric) {
    registry.register(name, help.strip_suffix('.').unwrap_or(help), metric);
}

/// The name to register a counter under: `prometheus-client` appends `_total` itself.
fn counter_name(exposed: &'static str) -> &'static str {
    exposed.strip_suffix("_total").unwrap_or(exposed)
}

/// The core's counters: exposed name, help.
const CORE_COUNTERS: [(&str, &str); 7] = [
    ("lockd_grants_total", "Leases granted with a new epoch."),
    (
        "lockd_releases_total",
        "Leases ended by connection close or release.",
    ),
    (
        "lockd_expirations_total",
        "Persisted leases not reclaimed within the reconnect window.",
    ),
    ("lockd_revocations_total", "Leases revoked by an operator."),
    (
        "lockd_reclaims_total",
        "Leases reclaimed after a reconnect.",
    ),
    (
        "lockd_deadlocks_total",
        "Wait-for cycles of sessions found (deadlocks).",
    ),
    (
        "lockd_deadlock_breaks_total",
        "Leases revoked by lockd to break a deadlock (--break-deadlocks).",
    ),
];

impl Default for Metrics {
    fn default() -> Self {
        let m = Metrics {
            registry: Registry::default(),
            handoff: Histogram::new(HANDOFF_BUCKETS),
            persist: Histogram::new(HANDOFF_BUCKETS),
            snapshots: Counter::default(),
            connections: Counter::default(),
            bad_requests: Counter::default(),
            busy_poll: Counter::default(),
            busy_poll_hits: Counter::default(),
            core: Default::default(),
            sessions: Gauge::default(),
            waiters: Family::default(),
            held: Family::default(),
        };
        let mut r = Registry::default();
        for ((name, help), c) in CORE_COUNTERS.iter().zip(&m.core) {
            register(&mut r, counter_name(name), help, c.clone());
        }
        register(
            &mut r,
            counter_name("lockd_connections_total"),
            "Connections accepted.",
            m.connections.clone(),
        );
        register(
            &mut r,
            counter_name("lockd_bad_requests_total"),
            "Malformed, unknown, oversized or rate-limited requests.",
            m.bad_requests.clone(),
        );
        register(
            &mut r,
            counter_name("lockd_busy_poll_hits_total"),
            "Reads whose bytes arrived while lockd was busy-polling (a thread wakeup saved).",
            m.busy_poll_hits.clone(),
        );
        register(
            &mut r,
            counter_name("lockd_busy_poll_seconds_total"),
            "Wall time lockd stayed awake busy-polling after requests instead of sleeping (serving requests meanwhile): the CPU that --busy-poll costs.",
            m.busy_poll.clone(),
        );
        register(
            &mut r,
            "lockd_sessions",
            "Connected sessions.",
            m.sessions.clone(),
        );
        register(
            &mut r,
            "lockd_waiters",
            "Queued acquires per resource.",
            m.waiters.clone(),
        );
        register(
            &mut r,
            "lockd_held",
            "Whether the resource is held or reclaiming (1) or free (0).",
            m.held.clone(),
        );
        register(
            &mut r,
            "lockd_handoff_seconds",
            "From the holder's connection close (or release) to the next grant being sent.",
            m.handoff.0.clone(),
        );
        register(
            &mut r,
            "lockd_persist_seconds",
            "Durable state write (a journal append + fdatasync, or a whole snapshot: tmp+fsync+rename+fsync dir).",
            m.persist.0.clone(),
        );
        register(
            &mut r,
            counter_name("lockd_state_snapshots_total"),
            "Whole state snapshots written (at the first write after a start and when the journal outgrows the snapshot; every other write appends to the journal).",
            m.snapshots.clone(),
        );
        Metrics { registry: r, ..m }
    }
}

/// Escape a label value for the text exposition (backslash, double quote, newline).
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Render the full exposition ([`CONTENT_TYPE`]): `m` plus the core's counters `c`, its
/// `(resource, waiters, held)` list and its session count.
pub fn render(
    m: &Metrics,
    c: &Counters,
    waiters: &[(String, usize, bool)],
    sessions: usize,
) -> String {
    let core = [
        c.grants,
        c.releases,
        c.expirations,
        c.revocations,
        c.reclaims,
        c.deadlocks,
        c.deadlock_breaks,
    ];
    for (counter, v) in m.core.iter().zip(core) {
        // The core's counters only grow: storing keeps the counter monotonic.
        counter.inner().store(v, Ordering::Relaxed);
    }
    m.sessions.set(i64::try_from(sessions).unwrap_or(i64::MAX));
    // Resources come and go: only the ones the core knows now are exposed.
    m.waiters.clear();
    m.held.clear();
    for (r, n, held) in waiters {
        let l = ResourceLabels { resource: esc(r) };
        m.waiters
            .get_or_create(&l)
            .set(i64::try_from(*n).unwrap_or(i64::MAX));
        m.held.get_or_create(&l).set(i64::from(*held));
    }
    let mut out = String::with_capacity(4096);
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &m.registry) {
        // Not reachable with these metric types (no u64 gauges); serve what was rendered.
        warn!(error = %e, "metrics encoding failed part-way");
    }
    out
}

/// Limits of the metrics HTTP server.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// A client must send its request head within this time.
    pub header_timeout: Duration,
    /// A connection is closed after this long, whatever it is doing.
    pub connection_timeout: Duration,
    /// Connections served at once; more are closed at accept.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(10),
            max_connections: 64,
        }
    }
}

/// The answer to one request: `GET /metrics` (or `GET /`, as before) → 200 and the
/// exposition from `render`; another path → 404; another method → 405.
pub fn respond(
    method: &Method,
    path: &str,
    render: impl FnOnce() -> String,
) -> Response<Full<Bytes>> {
    let (status, ctype, body) = if method != Method::GET {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".to_string(),
        )
    } else if path == "/metrics" || path == "/" {
        (StatusCode::OK, CONTENT_TYPE, render())
    } else {
        (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_string(),
        )
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(ctype));
    if status == StatusCode::METHOD_NOT_ALLOWED {
        r.headers_mut()
            .insert(hyper::header::ALLOW, HeaderValue::from_static("GET"));
    }
    r
}

/// Serve `GET /metrics` on `listener` (one request per connection, bounded by `limits`) until
/// `shutdown` resolves; then stop accepting and let connections in flight finish their
/// response. Must run inside a `LocalSet` (connections are `spawn_local`ed, so `render` need
/// not be `Send`).
pub async fn serve<F>(
    listener: TcpListener,
    render: F,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) where
    F: Fn() -> String + 'static,
{
    let render = Rc::new(render);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let open = Rc::new(std::cell::Cell::new(0usize));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if open.get() >= limits.max_connections {
            debug!("too many metrics connections; closing a new one");
            drop(stream);
            continue;
        }
        open.set(open.get() + 1);
        let (render, open, mut stop) = (render.clone(), open.clone(), stop_rx.clone());
        tokio::task::spawn_local(async move {
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let render = render.clone();
                async move { Ok::<_, Infallible>(respond(req.method(), req.uri().path(), || render())) }
            });
            let conn = http1::Builder::new()
                .keep_alive(false)
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(8192)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let served = tokio::time::timeout(limits.connection_timeout, async {
                tokio::select! {
                    r = conn.as_mut() => r,
                    _ = stop.wait_for(|s| *s) => {
                        conn.as_mut().graceful_shutdown();
                        conn.as_mut().await
                    }
                }
            })
            .await;
            match served {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(error = %e, "metrics connection ended with an error"),
                Err(_) => debug!("metrics connection timed out"),
            }
            open.set(open.get() - 1);
        });
    }
    let _ = stop_tx.send(true);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    // The workspace's one exposition reader.
    use harness::metrics::{samples, series as value};

    fn counters(grants: u64) -> Counters {
        Counters {
            grants,
            releases: 2,
            expirations: 3,
            revocations: 4,
            reclaims: 5,
            ..Counters::default()
        }
    }

    #[test]
    fn renders_every_documented_name() {
        let m = Metrics::default();
        let w = vec![("engine".to_string(), 2, true)];
        let text = render(&m, &counters(1), &w, 3);
        for (series, v) in [
            ("lockd_grants_total", 1.0),
            ("lockd_releases_total", 2.0),
            ("lockd_expirations_total", 3.0),
            ("lockd_revocations_total", 4.0),
            ("lockd_reclaims_total", 5.0),
            ("lockd_deadlocks_total", 0.0),
            ("lockd_deadlock_breaks_total", 0.0),
            ("lockd_connections_total", 0.0),
            ("lockd_bad_requests_total", 0.0),
            ("lockd_busy_poll_hits_total", 0.0),
            ("lockd_busy_poll_seconds_total", 0.0),
            ("lockd_sessions", 3.0),
            ("lockd_waiters{resource=\"engine\"}", 2.0),
            ("lockd_held{resource=\"engine\"}", 1.0),
            ("lockd_handoff_seconds_count", 0.0),
            ("lockd_handoff_seconds_sum", 0.0),
            ("lockd_handoff_seconds_bucket{le=\"+Inf\"}", 0.0),
            ("lockd_persist_seconds_count", 0.0),
            ("lockd_persist_seconds_bucket{le=\"+Inf\"}", 0.0),
            ("lockd_state_snapshots_total", 0.0),
        ] {
            assert_eq!(value(&text, series), v, "{series}");
        }
        // Every sample belongs to a documented family; nothing else is exposed.
        let names: std::collections::BTreeSet<String> =
            samples(&text).into_iter().map(|s| s.name).collect();
        assert_eq!(names.len(), 21, "{names:?}");
        assert!(text.contains("# TYPE lockd_grants counter\n"), "{text}");
        assert!(text.contains("# TYPE lockd_waiters gauge\n"), "{text}");
        assert!(
            text.contains("# TYPE lockd_handoff_seconds histogram\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP lockd_sessions Connected sessions.\n"),
            "help keeps its single full stop: {text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn counters_count_and_resources_follow_the_core() {
        let m = Metrics::default();
        m.connections.inc();
        m.connections.inc();
        m.bad_requests.inc();
        m.busy_poll_hits.inc();
        m.busy_poll.inc_by(0.25);
        m.busy_poll.inc_by(0.5);
        let w = vec![
            ("a".to_string(), 0, false),
            ("we\"ird\\name\n".to_string(), 1, true),
        ];
        let text = render(&m, &counters(7), &w, 1);
        assert_eq!(value(&text, "lockd_connections_total"), 2.0);
        assert_eq!(value(&text, "lockd_bad_requests_total"), 1.0);
        assert_eq!(value(&text, "lockd_busy_poll_hits_total"), 1.0);
        assert_eq!(value(&text, "lockd_busy_poll_seconds_total"), 0.75);
        assert_eq!(value(&text, "lockd_grants_total"), 7.0);
        assert_eq!(value(&text, "lockd_held{resource=\"a\"}"), 0.0);
        assert_eq!(
            value(&text, "lockd_waiters{resource=\"we\\\"ird\\\\name\\n\"}"),
            1.0
        );
        // A resource the core forgot is no longer exposed; counters follow the core.
        let text = render(&m, &counters(9), &w[..1], 0);
        assert_eq!(value(&text, "lockd_grants_total"), 9.0);
        assert!(!text.contains("ird"), "{text}");
        assert_eq!(value(&text, "lockd_waiters{resource=\"a\"}"), 0.0);
    }

    #[test]
    fn histograms_bucket_cumulatively() {
        let m = Metrics::default();
        for us in [10, 50, 80, 2_000, 5_000_000] {
            m.handoff.observe(Duration::from_micros(us));
        }
        m.persist.observe(Duration::from_micros(300));
        let text = render(&m, &Counters::default(), &[], 0);
        let b = |le: &str| {
            value(
                &text,
                &format!("lockd_handoff_seconds_bucket{{le=\"{le}\"}}"),
            )
        };
        assert_eq!(b("0.00005"), 2.0);
        assert_eq!(b("0.0001"), 3.0);
        assert_eq!(b("0.001"), 3.0);
        assert_eq!(b("0.0025"), 4.0);
        assert_eq!(b("1.0"), 4.0);
        assert_eq!(b("+Inf"), 5.0);
        assert_eq!(value(&text, "lockd_handoff_seconds_count"), 5.0);
        let sum = value(&text, "lockd_handoff_seconds_sum");
        assert!((sum - 5.00214).abs() < 1e-9, "{sum}");
        let buckets = samples(&text)
            .iter()
            .filter(|s| s.name == "lockd_handoff_seconds_bucket")
            .count();
        assert_eq!(buckets, HANDOFF_BUCKETS.len() + 1);
        assert_eq!(
            value(&text, "lockd_persist_seconds_bucket{le=\"0.00025\"}"),
            0.0
        );
        assert_eq!(
            value(&text, "lockd_persist_seconds_bucket{le=\"0.0005\"}"),
            1.0
        );
    }

    /// A metrics server on a loopback port, stopped by dropping the returned sender.
    async fn start(
        limits: HttpLimits,
    ) -> (
        SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let m = Metrics::default();
        m.connections.inc();
        let render = move || render(&m, &Counters::default(), &[], 0);
        let h = tokio::task::spawn_local(serve(l, render, limits, async {
            let _ = rx.await;
        }));
        (addr, tx, h)
    }

    /// Send `req` raw and read the whole answer (the server closes after one response).
    async fn exchange(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        // A write into a connection the server already closed shows as no answer below.
        let _ = s.write_all(req).await;
        let mut out = Vec::new();
        // A reset (closed without reading the request) counts as no answer.
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
            .await
            .expect("the server answers and closes within 5 s");
        String::from_utf8(out).unwrap()
    }

    fn status(resp: &str) -> u16 {
        resp.get(9..12)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {resp:?}"))
    }

    #[tokio::test]
    async fn http_server_answers_200_404_405_and_survives_bad_clients() {
        tokio::task::LocalSet::new()
            .run_until(async {
                let limits = HttpLimits {
                    header_timeout: Duration::from_millis(300),
                    ..HttpLimits::default()
                };
                let (addr, stop, server) = start(limits).await;
                // No `Connection: close`: the server closes after one answer anyway.
                let r = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
                assert_eq!(status(&r), 200, "{r}");
                assert!(
                    r.to_ascii_lowercase()
                        .contains(&format!("content-type: {CONTENT_TYPE}")),
                    "{r}"
                );
                let body = r.split_once("\r\n\r\n").unwrap().1;
                assert_eq!(value(body, "lockd_connections_total"), 1.0);
                let r = exchange(addr, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n").await;
                assert_eq!(status(&r), 404, "{r}");
                let r = exchange(
                    addr,
                    b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
                )
                .await;
                assert_eq!(status(&r), 405, "{r}");
                // Garbage: an error answer or a close, never a hang.
                let r = exchange(addr, b"\x16\x03\x01 not http at all\r\n\r\n").await;
                assert!(r.is_empty() || status(&r) == 400, "{r:?}");
                // An oversized head is refused.
                let mut big = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
                big.extend(std::iter::repeat_n(b'a', 64 * 1024));
                big.extend_from_slice(b"\r\n\r\n");
                let r = exchange(addr, &big).await;
                assert!(
                    r.is_empty() || status(&r) == 431 || status(&r) == 400,
                    "{r:?}"
                );
                // A client that leaves mid-request, and one that sends half a head and stalls
                // (closed by the header timeout).
                {
                    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                    s.write_all(b"GET /metr").await.unwrap();
                }
                let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
                stalled
                    .write_all(b"GET /metrics HTTP/1.1\r\nHo")
                    .await
                    .unwrap();
                let mut sink = Vec::new();
                tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut sink))
                    .await
                    .expect("a stalled client is closed by the header timeout")
                    .ok();
                // Still serving.
                let r = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
                assert_eq!(status(&r), 200, "{r}");
                drop(stop);
                tokio::time::timeout(Duration::from_secs(5), server)
                    .await
                    .expect("the server stops on its shutdown future")
                    .unwrap();
                assert!(
                    tokio::net::TcpStream::connect(addr).await.is_err(),
                    "listener closed after shutdown"
                );
            })
            .await;
    }

    #[tokio::test]
    async fn shutdown_stops_accepting_and_answers_the_scrape_in_flight() {
        tokio::task::LocalSet::new()
            .run_until(async {
                let (addr, stop, server) = start(HttpLimits::default()).await;
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                s.write_all(b"GET /metrics HTTP/1.1\r\nHo").await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
                drop(stop);
                tokio::time::timeout(Duration::from_secs(5), server)
                    .await
                    .expect("the server stops on its shutdown future")
                    .unwrap();
                assert!(
                    tokio::net::TcpStream::connect(addr).await.is_err(),
                    "no new connections after shutdown"
                );
                s.write_all(b"st: x\r\n\r\n").await.unwrap();
                let mut out = Vec::new();
                tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
                    .await
                    .expect("the scrape in flight is answered and closed")
                    .unwrap();
                let r = String::from_utf8(out).unwrap();
                assert_eq!(status(&r), 200, "{r}");
                assert!(r.ends_with("# EOF\n"), "{r}");
            })
            .await;
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_and_do_not_stop_the_server() {
        tokio::task::LocalSet::new()
            .run_until(async {
                let limits = HttpLimits {
                    max_connections: 1,
                    ..HttpLimits::default()
                };
                let (addr, stop, server) = start(limits).await;
                // One connection that sends nothing holds the only place.
                let _holder = tokio::net::TcpStream::connect(addr).await.unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await;
                let r = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
                assert!(
                    r.is_empty(),
                    "over the cap: closed without an answer: {r:?}"
                );
                drop(_holder);
                // Once the place is free again, scrapes are answered.
                let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                loop {
                    let r = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
                    if !r.is_empty() {
                        assert_eq!(status(&r), 200, "{r}");
                        break;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "never served again");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                drop(stop);
                tokio::time::timeout(Duration::from_secs(5), server)
                    .await
                    .unwrap()
                    .unwrap();
            })
            .await;
    }
}
