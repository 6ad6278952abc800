//! `lockd serve --backend etcd --metrics HOST:PORT`: the etcd backend's series at
//! `GET /metrics` (OpenMetrics text), moved by real traffic on a real etcd: a grant, keepalive
//! round trips, open sessions, and a self-fence when lockd is cut off from etcd (a proxy that
//! black-holes its traffic). Prints SKIP without etcd.

use std::time::{Duration, Instant};

use harness::etcd::Proxy;

use crate::common::*;
use crate::etcd_backend::{etcd_or_skip, start, Line};

/// The value of the series `name` (a line `name value`), None when absent.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.parse().ok())?
    })
}

fn scrape(url: &str) -> String {
    let r = harness::http::get(url, Duration::from_secs(2)).expect("GET /metrics");
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// Waits (bounded) until `name` reaches `at_least`; the last scrape.
fn until(url: &str, name: &str, at_least: f64, limit: Duration) -> String {
    let end = Instant::now() + limit;
    loop {
        let text = scrape(url);
        if series(&text, name).is_some_and(|v| v >= at_least) {
            return text;
        }
        assert!(
            Instant::now() < end,
            "{name} did not reach {at_least} within {limit:?}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn etcd_backend_metrics_follow_grants_keepalives_and_self_fences() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let Some(etcd) = etcd_or_skip("etcd_metrics::follow", d.path()) else {
        return;
    };
    let proxy = Proxy::start(([127, 0, 0, 1], etcd.client_port).into());
    let port = harness::net::free_port();
    let addr = format!("127.0.0.1:{port}");
    let flags = [
        "--etcd-ttl",
        "3s",
        "--etcd-kill-time",
        "800ms",
        "--etcd-pause",
        "200ms",
        "--metrics",
        addr.as_str(),
    ];
    let a = start(d.path(), "A", &proxy.url(), &flags, &[]);
    let url = format!("http://{addr}/metrics");
    let text = scrape(&url);
    for name in [
        "lockd_etcd_grants_total",
        "lockd_etcd_self_fences_total",
        "lockd_etcd_term_changes_total",
        "lockd_etcd_expiry_revokes_total",
        "lockd_etcd_errors_total",
    ] {
        assert_eq!(series(&text, name), Some(0.0), "{name} at start:\n{text}");
    }

    let mut holder = Line::connect(&a.sock).unwrap();
    holder.acquire("engine", "ha");
    holder
        .recv_until("granted", Duration::from_secs(10))
        .expect("granted");
    let text = until(&url, "lockd_etcd_grants_total", 1.0, Duration::from_secs(5));
    assert!(
        series(&text, "lockd_etcd_sessions").is_some_and(|v| v >= 1.0),
        "{text}"
    );
    // Keepalives every (3 s - 1.03 s)/3: a few answered within 3 s.
    let text = until(
        &url,
        "lockd_etcd_keepalive_rtt_seconds_count",
        2.0,
        Duration::from_secs(5),
    );
    assert_eq!(series(&text, "lockd_etcd_self_fences_total"), Some(0.0));

    // Cut off from etcd: the holder is told `lost`, counted once.
    proxy.blackhole();
    let told = holder.recv_until("revoked", Duration::from_secs(5));
    assert!(told.is_some(), "holder not told after the cut");
    let text = until(
        &url,
        "lockd_etcd_self_fences_total",
        1.0,
        Duration::from_secs(3),
    );
    assert_eq!(
        series(&text, "lockd_etcd_self_fences_total"),
        Some(1.0),
        "{text}"
    );
    proxy.heal();
    drop(holder);
    // The session is gone from the gauge once its connection closed.
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let text = scrape(&url);
        if series(&text, "lockd_etcd_sessions") == Some(0.0) {
            break;
        }
        assert!(Instant::now() < end, "sessions gauge stuck:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Not a metrics path: 404.
    let r = harness::http::get(&format!("http://{addr}/nope"), Duration::from_secs(2))
        .expect("GET /nope");
    assert_eq!(r.status, 404);
    drop(a);
    drop(etcd);
}
