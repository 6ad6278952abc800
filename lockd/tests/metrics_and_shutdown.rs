//! `--metrics` serves Prometheus text (grants, releases, expirations, revocations, waiters,
//! handoff histogram); SIGTERM stops lockd cleanly (exit 0, socket removed, state kept).
mod common;
use common::*;
use std::time::Duration;

#[test]
fn metrics_then_clean_sigterm_shutdown() {
    let d = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut l = Lockd::start(d.path(), &["--metrics", &format!("127.0.0.1:{port}")]);
    let mut a = Conn::connect(&l.sock).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    a.recv_until("granted").unwrap();
    let mut b = Conn::connect(&l.sock).unwrap();
    b.send(r#"{"op":"acquire","resource":"engine","holder":"b"}"#);
    b.recv_until("queued").unwrap();
    let m = scrape(port);
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    assert!(m.contains("lockd_grants_total 1"), "{m}");
    assert!(m.contains("lockd_waiters{resource=\"engine\"} 1"), "{m}");
    drop(a);
    b.recv_until("granted").unwrap();
    let m = scrape(port);
    for needle in [
        "lockd_grants_total 2",
        "lockd_releases_total 1",
        "lockd_expirations_total 0",
        "lockd_revocations_total 0",
        "lockd_waiters{resource=\"engine\"} 0",
        "lockd_handoff_seconds_count 1",
        "lockd_handoff_seconds_bucket{le=\"+Inf\"} 1",
    ] {
        assert!(m.contains(needle), "missing {needle} in\n{m}");
    }

    let p = l.proc.as_mut().unwrap();
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(p.pid(), libc::SIGTERM) };
    let st = p.wait_exit(Duration::from_secs(10));
    assert_eq!(st.code(), Some(0), "clean stop exits 0");
    assert!(!l.sock.exists(), "socket removed on clean stop");
    assert!(b.closed(), "clients are disconnected");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&l.state).unwrap()).unwrap();
    assert_eq!(
        state["resources"]["engine"]["holder"]["name"], "b",
        "holder kept for the reconnect window"
    );
    assert!(l.log().contains("shutting down"));
}
