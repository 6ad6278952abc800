//! Deadlock detection against a real lockd: rings of sessions over real connections (a
//! 3-cycle and a 50-cycle found exactly, a long open chain never reported), shown in
//! `lockd status` and on the watch stream, and broken with `--break-deadlocks`; the
//! shared-lease edges (readers and writers of the shared kind) likewise: a 3-cycle mixing
//! shared and exclusive holders, and a 30-long chain through shared holders that is none.
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

/// A protocol-2 shared-kind acquire of `r` in `mode` (bound to the connection).
fn shared_acq(r: &str, h: &str, mode: &str) -> serde_json::Value {
    serde_json::json!({"op":"acquire","resource":r,"holder":h,"mode":mode})
}

/// The `deadlock` notices on a watch stream until `n` came (bounded), their reasons.
fn deadlock_notices(w: &mut Raw, n: usize) -> Vec<String> {
    let mut found = Vec::new();
    while found.len() < n {
        let v = w.until("notice", Duration::from_secs(5));
        if v["kind"] == "deadlock" {
            found.push(v["reason"].as_str().unwrap_or_default().to_string());
        }
    }
    found
}

/// The shared-lease edges of the wait-for graph, with real processes: session A reads
/// `s`, B writes `t`, C reads `u`; then A waits to write `t` (B's), B to write `u` (C's
/// reader) and C to write `s` (A's reader): a 3-cycle mixing shared and exclusive holders,
/// found (watch notice, `status`, counter) and broken by revoking the youngest lease, C's
/// read of `u`, reason `deadlock`.
#[test]
fn a_three_cycle_through_shared_and_exclusive_leases_is_found_and_broken() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &["--break-deadlocks"]);
    let mut w = l.raw();
    w.rpc(serde_json::json!({"op":"watch"}), "watching");
    let (mut a, mut b, mut c) = (l.raw(), l.raw(), l.raw());
    a.rpc(shared_acq("s", "a", "shared"), "granted");
    b.rpc(shared_acq("t", "b", "exclusive"), "granted");
    c.rpc(shared_acq("u", "c", "shared"), "granted");
    a.rpc(shared_acq("t", "a", "exclusive"), "queued");
    b.rpc(shared_acq("u", "b", "exclusive"), "queued");
    let st = w.status(false);
    assert!(st["deadlocks"].is_null(), "a chain so far: {st}");
    c.rpc(shared_acq("s", "c", "exclusive"), "queued");
    let found = deadlock_notices(&mut w, 1);
    for r in ["s", "t", "u"] {
        assert!(found[0].contains(r), "{found:?}");
    }
    // Broken: the youngest lease the cycle waits for is C's read of `u`.
    let rv = c.until("revoked", Duration::from_secs(5));
    assert_eq!(
        (rv["resource"].as_str(), rv["reason"].as_str()),
        (Some("u"), Some("deadlock")),
        "{rv}"
    );
    let st = w.status(false);
    let cycles = st["deadlocks"].as_array().expect("the cycle in status");
    assert_eq!(cycles.len(), 1, "{st}");
    let mut sessions: Vec<u64> = cycles[0]["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s.as_u64())
        .collect();
    sessions.sort_unstable();
    let mut want = vec![a.session, b.session, c.session];
    want.sort_unstable();
    assert_eq!(sessions, want, "{st}");
    assert_eq!(
        (
            st["counters"]["deadlocks"].as_u64(),
            st["counters"]["deadlock_breaks"].as_u64()
        ),
        (Some(1), Some(1)),
        "{st}"
    );
    // C lets go (its connection ends): B writes `u`, and no cycle is left.
    drop(c);
    b.until("granted", Duration::from_secs(5));
    wait_for(Duration::from_secs(5), "no deadlock left", || {
        w.status(false)["deadlocks"].is_null().then_some(())
    });
}

/// No false positive: a chain of 30 sessions, each holding a read of `c{i}` (beside a
/// second reader of its own) and waiting to write `c{i+1}`, is no cycle; closing it (the
/// last waits to write `c0`) is one, of all 30.
#[test]
fn a_long_chain_through_shared_holders_is_no_cycle_until_it_closes() {
    const N: usize = 30;
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    let mut w = l.raw();
    w.rpc(serde_json::json!({"op":"watch"}), "watching");
    let mut cs: Vec<Raw> = (0..N).map(|_| l.raw()).collect();
    let mut others: Vec<Raw> = (0..N).map(|_| l.raw()).collect();
    for (i, (c, o)) in cs.iter_mut().zip(others.iter_mut()).enumerate() {
        c.rpc(
            shared_acq(&format!("c{i}"), &format!("h{i}"), "shared"),
            "granted",
        );
        o.rpc(
            shared_acq(&format!("c{i}"), &format!("o{i}"), "shared"),
            "granted",
        );
    }
    for (i, c) in cs.iter_mut().enumerate().take(N - 1) {
        c.rpc(
            shared_acq(&format!("c{}", i + 1), &format!("h{i}"), "exclusive"),
            "queued",
        );
    }
    let st = w.status(false);
    assert!(
        st["deadlocks"].is_null(),
        "an open chain is no deadlock: {st}"
    );
    assert_eq!(st["counters"]["deadlocks"].as_u64().unwrap_or(0), 0, "{st}");
    w.quiet(Duration::from_millis(300), "no notice for an open chain");
    // Closed: one cycle of all N sessions.
    cs[N - 1].rpc(
        shared_acq("c0", &format!("h{}", N - 1), "exclusive"),
        "queued",
    );
    deadlock_notices(&mut w, 1);
    let st = w.status(false);
    let cycles = st["deadlocks"].as_array().expect("the cycle");
    assert_eq!(cycles.len(), 1, "{st}");
    assert_eq!(cycles[0]["sessions"].as_array().unwrap().len(), N, "{st}");
    assert_eq!(st["counters"]["deadlocks"], 1, "{st}");
    drop(others);
}

/// A cycle through a waiting shared gang's fence, with real processes: W writes `s`; the
/// shared gang of G over {r, s} waits for it and fences `r`; W then asks to write `r` and
/// is held back by the gang, which waits for W: found (the fence named in `resources`),
/// broken by revoking W's write of `s` (the only held lease of the cycle); once W goes, the
/// gang is granted.
#[test]
fn a_cycle_through_a_shared_gangs_fence_is_found_and_broken() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &["--break-deadlocks"]);
    let mut watch = l.raw();
    watch.rpc(serde_json::json!({"op":"watch"}), "watching");
    let (mut w, mut g) = (l.raw(), l.raw());
    w.rpc(shared_acq("s", "w", "exclusive"), "granted");
    g.rpc(
        serde_json::json!({"op":"acquire","resource":"tp","holder":"g","gang":["r","s"],
                           "mode":"shared"}),
        "queued",
    );
    w.rpc(shared_acq("r", "w", "exclusive"), "queued");
    deadlock_notices(&mut watch, 1);
    let st = watch.status(false);
    let cycles = st["deadlocks"].as_array().expect("the cycle in status");
    assert_eq!(cycles.len(), 1, "{st}");
    let names: Vec<&str> = cycles[0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r.as_str())
        .collect();
    assert!(
        names.contains(&"r (reserved for a waiting shared gang)") && names.contains(&"s"),
        "{st}"
    );
    let rv = w.until("revoked", Duration::from_secs(5));
    assert_eq!(
        (rv["resource"].as_str(), rv["reason"].as_str()),
        (Some("s"), Some("deadlock")),
        "{rv}"
    );
    drop(w);
    g.until("gang_granted", Duration::from_secs(5));
    wait_for(Duration::from_secs(5), "no deadlock left", || {
        watch.status(false)["deadlocks"].is_null().then_some(())
    });
}
