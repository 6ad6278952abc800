//! Incremental persistence at process level: a real lockd appends each write to
//! `STATE.journal`; after `kill -9` a restarted lockd replays snapshot + journal and finds
//! every lease as it was; a torn line appended to a killed lockd's journal is cut off with a
//! warning (nothing it covered was ever sent).
use serde_json::json;

use crate::common::*;

fn journal(d: &std::path::Path) -> std::path::PathBuf {
    lockd::persist::journal_path(&d.join("state.json"))
}

fn journal_lines(d: &std::path::Path) -> usize {
    std::fs::read_to_string(journal(d))
        .unwrap_or_default()
        .lines()
        .count()
}

/// Leases of every kind, then kill -9: the restarted lockd has them all, as the journal
/// (not only the snapshot) says.
#[test]
fn a_killed_lockd_replays_its_journal() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state.json");
    let mut l = Lockd2::start(d.path(), &["--reconnect-window", "5s"]);
    let mut a = l.raw();
    // A connection-bound exclusive lease, a TTL lease, two shared readers (one released),
    // a quantity lease over an offer, a revoked TTL lease (a tombstone).
    let x = a.rpc(
        json!({"op":"acquire","resource":"x","holder":"a"}),
        "granted",
    );
    let t = a.rpc(
        json!({"op":"acquire","resource":"t","holder":"a","ttl_ms":60_000}),
        "granted",
    );
    let s1 = a.rpc(
        json!({"op":"acquire","resource":"s","holder":"r1","mode":"shared","ttl_ms":60_000}),
        "granted",
    );
    let s2 = a.rpc(
        json!({"op":"acquire","resource":"s","holder":"r2","mode":"shared","ttl_ms":60_000}),
        "granted",
    );
    a.rpc(
        json!({"op":"release","lease_id":lease_id(&s2),"token":token(&s2)}),
        "released",
    );
    a.rpc(
        json!({"op":"offer","pool":"gpu","name":"n1","quantity":4}),
        "offered",
    );
    let q = a.rpc(
        json!({"op":"acquire","resource":"gpu","holder":"a","quantity":3,"ttl_ms":60_000}),
        "granted",
    );
    let gone = a.rpc(
        json!({"op":"acquire","resource":"t2","holder":"a","ttl_ms":60_000}),
        "granted",
    );
    a.rpc(
        json!({"op":"revoke","lease_id":lease_id(&gone),"reason":"test"}),
        "revoke_sent",
    );
    // Every write after the first (the start's snapshot) went to the journal.
    let lines = journal_lines(d.path());
    assert!(lines >= 6, "{lines} journal lines");
    let before = lockd::persist::load(&state).unwrap();
    assert!(before.kind_leases.contains_key(&lease_id(&q)), "{before:?}");
    // The snapshot alone is the empty state of the first write: the rest is in the journal.
    let snap = lockd::persist::parse_state(&state, &std::fs::read(&state).unwrap()).unwrap();
    assert!(snap.kind_leases.is_empty(), "{snap:?}");

    l.kill();
    assert_eq!(lockd::persist::load(&state).unwrap(), before);
    l.restart();
    let mut b = l.raw();
    for (g, kind) in [(&t, "ttl"), (&s1, "shared"), (&q, "quantity")] {
        let rep = b.lease(lease_id(g));
        assert_eq!(rep["state"], "held", "{kind}: {rep}");
        assert_eq!(rep["kind"], kind, "{rep}");
    }
    assert_eq!(b.lease(lease_id(&s2))["state"], "released");
    assert_eq!(b.lease(lease_id(&gone))["state"], "revoked");
    // The exclusive lease waits for its holder, who reclaims it with its epoch and token.
    let st = b.status(true);
    let xr = st["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "x")
        .cloned()
        .unwrap_or_default();
    assert_eq!(xr["state"], "reclaiming", "{st}");
    let rc = b.rpc(
        json!({"op":"reclaim","resource":"x","holder":"a","epoch":u64_of(&x, "epoch"),"token":token(&x)}),
        "granted",
    );
    assert_eq!(rc["reclaimed"], true, "{rc}");
    // The first write of the new process was a whole snapshot: the journal restarted.
    let after = lockd::persist::load(&state).unwrap();
    assert_eq!(after.kind_leases, before.kind_leases);
    assert!(journal_lines(d.path()) <= 1, "journal not emptied");
    l.kill();
}

/// A line torn by a crash (appended to a killed lockd's journal) is cut off with a warning;
/// the leases of the whole lines are there.
#[test]
fn a_torn_journal_line_is_cut_with_a_warning() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state.json");
    let mut l = Lockd2::start(d.path(), &[]);
    let mut a = l.raw();
    // The first write of a process is a whole snapshot; the next ones are appended.
    a.rpc(
        json!({"op":"acquire","resource":"t0","holder":"a","ttl_ms":60_000}),
        "granted",
    );
    let t = a.rpc(
        json!({"op":"acquire","resource":"t","holder":"a","ttl_ms":60_000}),
        "granted",
    );
    l.kill();
    let good = std::fs::read(journal(d.path())).unwrap();
    assert!(!good.is_empty(), "the grant was appended to the journal");
    let mut torn = good.clone();
    torn.extend_from_slice(br#"{"version":2,"n":99,"names":{"t":{"reso"#);
    std::fs::write(journal(d.path()), &torn).unwrap();
    l.restart();
    let log = std::fs::read_to_string(l.log_path()).unwrap();
    assert!(
        log.contains("WARN") && log.contains("torn last journal line"),
        "{log}"
    );
    let mut b = l.raw();
    assert_eq!(b.lease(lease_id(&t))["state"], "held");
    // The cut journal holds the whole lines only (until the first write empties it).
    let now = std::fs::read(journal(d.path())).unwrap();
    assert!(now == good || now.is_empty(), "torn tail still there");
    assert!(lockd::persist::load(&state).is_ok());
    // A journal corrupt in the middle stops lockd, untouched.
    l.kill();
    let mut bad = b"garbage\n".to_vec();
    bad.extend_from_slice(&std::fs::read(journal(d.path())).unwrap());
    bad.extend_from_slice(b"{}\n");
    std::fs::write(journal(d.path()), &bad).unwrap();
    let out = spec(d.path(), &[])
        .command(std::path::Path::new(BIN))
        .output_within(CMD_LIMIT)
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("corrupt"), "{err}");
    assert_eq!(std::fs::read(journal(d.path())).unwrap(), bad);
}
