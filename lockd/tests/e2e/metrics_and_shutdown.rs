//! `--metrics` serves Prometheus text (grants, releases, expirations, revocations, waiters,
//! handoff histogram); SIGTERM stops lockd cleanly (exit 0, socket removed, state kept).
use crate::common::*;
use std::time::Duration;

#[test]
fn metrics_then_clean_sigterm_shutdown() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut l = start_lockd(d.path(), &["--metrics", &format!("127.0.0.1:{port}")]);
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    a.recv_until("granted").unwrap();
    let mut b = Conn::connect(l.socket()).unwrap();
    b.send(r#"{"op":"acquire","resource":"engine","holder":"b"}"#);
    b.recv_until("queued").unwrap();
    // Asserted on parsed samples (`name{labels} value`), not on bytes: the Prometheus text
    // format and OpenMetrics both pass.
    let m = scrape(port);
    assert_eq!(m.value("lockd_grants_total", &[]), 1.0);
    assert_eq!(m.value("lockd_waiters", &[("resource", "engine")]), 1.0);
    drop(a);
    b.recv_until("granted").unwrap();
    let m = scrape(port);
    for (name, labels, want) in [
        ("lockd_grants_total", &[][..], 2.0),
        ("lockd_releases_total", &[], 1.0),
        ("lockd_expirations_total", &[], 0.0),
        ("lockd_revocations_total", &[], 0.0),
        ("lockd_waiters", &[("resource", "engine")], 0.0),
        ("lockd_handoff_seconds_count", &[], 1.0),
        ("lockd_handoff_seconds_bucket", &[("le", "+Inf")], 1.0),
    ] {
        assert_eq!(
            m.value(name, labels),
            want,
            "{name}{labels:?} in\n{}",
            m.text
        );
    }

    assert!(l.signal(nix::sys::signal::Signal::SIGTERM), "lockd runs");
    let st = l
        .wait_exit(Duration::from_secs(10))
        .expect("lockd stops on SIGTERM");
    assert_eq!(st.code(), Some(0), "clean stop exits 0");
    assert!(!l.socket().exists(), "socket removed on clean stop");
    assert!(b.closed(), "clients are disconnected");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(l.state_path()).unwrap()).unwrap();
    assert_eq!(
        state["resources"]["engine"]["holder"]["name"], "b",
        "holder kept for the reconnect window"
    );
    assert!(l.log_text().contains("shutting down"));
}
