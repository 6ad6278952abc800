//! Deadlock detection against a real lockd: rings of sessions over real connections (a
//! 3-cycle and a 50-cycle found exactly, a long open chain never reported), shown in
//! `lockd status` and on the watch stream, and broken with `--break-deadlocks`.
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

/// n connections, each holding r{i} and then waiting for r{i+1} (the last for r0 when
/// `close`). Returns the connections (their leases live as long as they do).
fn ring(l: &harness::lockd::Lockd, n: usize, close: bool) -> Vec<Conn> {
    let mut cs: Vec<Conn> = (0..n).map(|_| Conn::connect(l.socket()).unwrap()).collect();
    for (i, c) in cs.iter_mut().enumerate() {
        c.send(&format!(
            r#"{{"op":"acquire","resource":"r{i}","holder":"h{i}"}}"#
        ));
        c.granted_epoch("own resource");
    }
    let waits = if close { n } else { n - 1 };
    for (i, c) in cs.iter_mut().enumerate().take(waits) {
        c.send(&format!(
            r#"{{"op":"acquire","resource":"r{}","holder":"h{i}"}}"#,
            (i + 1) % n
        ));
        assert!(c.recv_until("queued").is_some());
    }
    cs
}

fn status(l: &harness::lockd::Lockd) -> Value {
    let out = std::process::Command::new(BIN)
        .args([
            "status",
            "--connect",
            &format!("unix:{}", l.socket().display()),
            "--no-sessions",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn cycles_of_three_and_fifty_are_found_exactly_and_an_open_chain_is_not() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let mut w = Conn::connect(l.socket()).unwrap();
    w.send(r#"{"op":"watch"}"#);
    assert!(w.recv_until("watching").is_some());
    let _chain = ring(&l, 200, false);
    assert!(
        status(&l)["deadlocks"].is_null(),
        "an open chain is no deadlock"
    );
    let _c3 = ring_named(&l, "a", 3);
    let _c50 = ring_named(&l, "b", 50);
    // The watch stream got one `deadlock` notice per ring, none for the chain.
    let mut found = Vec::new();
    while found.len() < 2 {
        let v = w.recv_until("notice").expect("deadlock notices");
        if v["kind"] == "deadlock" {
            found.push(v["reason"].as_str().unwrap_or_default().to_string());
        }
    }
    assert!(found.iter().all(|r| !r.contains(" r")), "{found:?}");
    let st = wait_for(Duration::from_secs(5), "two deadlocks in status", || {
        let st = status(&l);
        (st["deadlocks"].as_array().map_or(0, |a| a.len()) == 2).then_some(st)
    });
    let mut sizes: Vec<usize> = st["deadlocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["sessions"].as_array().unwrap().len())
        .collect();
    sizes.sort_unstable();
    assert_eq!(sizes, vec![3, 50], "{st}");
    assert_eq!(st["counters"]["deadlocks"], 2, "{st}");
    // Every reported resource is one of the rings', never the open chain's.
    for d in st["deadlocks"].as_array().unwrap() {
        for r in d["resources"].as_array().unwrap() {
            let r = r.as_str().unwrap();
            assert!(r.starts_with('a') || r.starts_with('b'), "{r} in {st}");
        }
    }
}

/// A ring over resources `{prefix}{i}`.
fn ring_named(l: &harness::lockd::Lockd, prefix: &str, n: usize) -> Vec<Conn> {
    let mut cs: Vec<Conn> = (0..n).map(|_| Conn::connect(l.socket()).unwrap()).collect();
    for (i, c) in cs.iter_mut().enumerate() {
        c.send(&format!(
            r#"{{"op":"acquire","resource":"{prefix}{i}","holder":"{prefix}h{i}"}}"#
        ));
        c.granted_epoch("own resource");
    }
    for (i, c) in cs.iter_mut().enumerate() {
        c.send(&format!(
            r#"{{"op":"acquire","resource":"{prefix}{}","holder":"{prefix}h{i}"}}"#,
            (i + 1) % n
        ));
        assert!(c.recv_until("queued").is_some());
    }
    cs
}

#[test]
fn break_deadlocks_revokes_the_youngest_lease_and_the_ring_resolves() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &["--break-deadlocks"]);
    let mut cs = ring(&l, 3, true);
    // The youngest lease the cycle waits for: r2, granted last, held by connection 2.
    match cs[2].recv_until("revoked") {
        Some(v) => {
            assert_eq!(
                (v["resource"].as_str(), v["reason"].as_str()),
                (Some("r2"), Some("deadlock")),
                "{v}"
            );
        }
        None => panic!("no revoke for the youngest holder"),
    }
    let st = status(&l);
    assert_eq!(
        (
            st["counters"]["deadlocks"].as_u64(),
            st["counters"]["deadlock_breaks"].as_u64()
        ),
        (Some(1), Some(1)),
        "{st}"
    );
    // Its holder lets go: the one waiting for r2 gets it, and no cycle is left.
    drop(cs.remove(2));
    assert!(cs[1].granted_epoch("r2 after the break") >= 2);
    wait_for(Duration::from_secs(5), "no deadlock left", || {
        status(&l)["deadlocks"].is_null().then_some(())
    });
}
