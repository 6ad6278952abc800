//! A client that connects and never sends a request is disconnected after the idle timeout;
//! a client that has sent a request may stay silent forever (it may be holding the lock).
use crate::common::*;
use std::time::{Duration, Instant};

#[test]
fn silent_clients_are_disconnected_but_quiet_holders_are_not() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &["--idle-timeout", "300ms"]);
    let mut holder = Conn::connect(l.socket()).unwrap();
    holder.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    holder.recv_until("granted").unwrap();

    let mut silent = Conn::connect(l.socket()).unwrap();
    let t = Instant::now();
    let ev = silent.recv_until("error").expect("idle_timeout error");
    assert_eq!(ev["code"], "idle_timeout");
    assert!(silent.closed());
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "closed too early: {:?}",
        t.elapsed()
    );

    std::thread::sleep(Duration::from_millis(600));
    let st = l.status();
    assert_eq!(
        resource(&st, "engine").holder.as_deref(),
        Some("a"),
        "the quiet holder keeps its lease"
    );
    holder.send(r#"{"op":"ping"}"#);
    assert!(holder.recv_until("pong").is_some());
    assert!(l.log_text().contains("idle timeout"));
}
