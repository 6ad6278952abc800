//! Group commit against a slow disk (debug lockd with `LOCKD_TEST_WRITE_DELAY_MS`): many
//! hand-overs at once share a few state writes, no grant leaves lockd before the write that
//! covers it is durable (checked on disk at each grant), and a lockd SIGKILLed while a write
//! is in flight has sent nothing that write covers.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use harness::lockd::wait_ready;
use lockd::core::PersistedState;

/// A lockd in `dir` whose every state write takes `delay_ms` longer, with metrics on a port.
fn slow_lockd(dir: &Path, delay_ms: u64, metrics: u16) -> Group {
    let sp = spec(dir, &["--metrics", &format!("127.0.0.1:{metrics}")]);
    let mut c = sp.command(Path::new(BIN));
    c.env("LOCKD_TEST_WRITE_DELAY_MS", delay_ms.to_string());
    let g = Group::spawn(&mut c);
    wait_ready(&dir.join("lockd.sock"), Duration::from_secs(20)).expect("lockd ready");
    g
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn on_disk(dir: &Path) -> PersistedState {
    let p = dir.join("state.json");
    // Snapshot plus journal: what a restarted lockd would read.
    lockd::persist::load(&p).unwrap()
}

fn persist_count(metrics: u16) -> f64 {
    let body = harness::http::get(
        &format!("http://127.0.0.1:{metrics}/metrics"),
        Duration::from_secs(5),
    )
    .map(|r| r.body)
    .unwrap_or_default();
    body.lines()
        .find_map(|l| l.strip_prefix("lockd_persist_seconds_count "))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("lockd_persist_seconds_count in /metrics")
}

#[test]
fn mass_handover_shares_writes_and_every_grant_is_on_disk_first() {
    const N: usize = 20;
    const DELAY_MS: u64 = 100;
    let d = tempfile::tempdir().unwrap();
    let metrics = free_port();
    let mut g = slow_lockd(d.path(), DELAY_MS, metrics);
    let sock = d.path().join("lockd.sock");
    let mut holders = Vec::new();
    let mut waiters = Vec::new();
    for i in 0..N {
        let mut h = Conn::connect(&sock).unwrap();
        h.send(&format!(
            r#"{{"op":"acquire","resource":"r{i}","holder":"a{i}"}}"#
        ));
        assert_eq!(h.granted_epoch("first holder"), 1);
        holders.push(h);
    }
    for i in 0..N {
        let mut w = Conn::connect(&sock).unwrap();
        w.r.get_ref()
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        w.send(&format!(
            r#"{{"op":"acquire","resource":"r{i}","holder":"b{i}"}}"#
        ));
        assert!(w.recv_until("queued").is_some());
        waiters.push(w);
    }
    let before = persist_count(metrics);
    let t = Instant::now();
    drop(holders);
    for (i, w) in waiters.iter_mut().enumerate() {
        let epoch = w.granted_epoch("next waiter");
        assert_eq!(epoch, 2);
        // Durable before visible: the grant just read is already in the state file.
        let st = on_disk(d.path());
        let r = &st.resources[&format!("r{i}")];
        assert!(
            r.epoch >= 2,
            "r{i}: granted epoch 2 but the state file says {r:?}"
        );
    }
    let took = t.elapsed();
    let writes = persist_count(metrics) - before;
    // One write per hand-over would be N writes (>= N x 100 ms); group commit shares them.
    assert!(
        writes <= (N / 4) as f64,
        "{writes} state writes for {N} simultaneous hand-overs ({took:?})"
    );
    assert!(
        took < Duration::from_millis(DELAY_MS * N as u64 / 2),
        "{N} hand-overs took {took:?}"
    );
    // Every grant is on disk: each resource now held by its waiter.
    let st = on_disk(d.path());
    for i in 0..N {
        let h = st.resources[&format!("r{i}")]
            .holder
            .as_ref()
            .expect("held");
        assert_eq!((h.name.as_str(), h.epoch), (format!("b{i}").as_str(), 2));
    }
    g.kill_group();
}

#[test]
fn sigkill_while_a_write_is_in_flight_leaves_its_grant_unsent() {
    let d = tempfile::tempdir().unwrap();
    let mut g = slow_lockd(d.path(), 1500, free_port());
    let sock = d.path().join("lockd.sock");
    let mut a = Conn::connect(&sock).unwrap();
    a.send(r#"{"op":"acquire","resource":"r","holder":"a"}"#);
    assert_eq!(a.granted_epoch("a"), 1);
    let mut b = Conn::connect(&sock).unwrap();
    b.r.get_ref()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    b.send(r#"{"op":"acquire","resource":"r","holder":"b"}"#);
    assert!(b.recv_until("queued").is_some());
    // The state write of a's grant has long finished (granted_epoch waited for it).
    drop(a);
    // lockd is now writing b's grant (1.5 s): kill it in the middle.
    std::thread::sleep(Duration::from_millis(300));
    g.signal_group(nix::sys::signal::Signal::SIGKILL);
    let _ = g.wait_exit(Duration::from_secs(10));
    // b never saw the grant whose write did not complete: only EOF.
    assert!(
        b.recv_until("granted").is_none(),
        "grant sent before its write was durable"
    );
    let st = on_disk(d.path());
    let h = st.resources["r"]
        .holder
        .as_ref()
        .expect("a's lease is what is on disk");
    assert_eq!((h.name.as_str(), h.epoch), ("a", 1));
}
