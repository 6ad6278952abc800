//! Compatibility of protocol 2 with protocol 1, against real `lockd serve` processes: a
//! version-1 session gets exactly the bytes version 1 sent (no new fields), and one
//! resource name has one lease kind at a time (`kind_mismatch` both ways).
use std::collections::BTreeSet;
use std::time::Duration;

use lockd::proto::{decode_event, Event};
use serde_json::{json, Value};

use crate::common::*;

/// The keys of an event line, sorted.
fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

fn set(ks: &[&str]) -> BTreeSet<String> {
    ks.iter().map(|k| k.to_string()).collect()
}

/// Reads the next line, which must be exactly `want`.
fn expect_line(c: &mut Raw, want: &str) {
    let got = c
        .next_line(REPLY)
        .unwrap_or_else(|| panic!("no line, expected {want}"));
    assert_eq!(got, want, "a version-1 event changed");
}

/// A protocol-1 session (acquire, busy, queue, cancel, revoke, release, ping, watch,
/// status, reclaim after a restart): every event is byte for byte what version 1 sent.
#[test]
fn protocol_1_session_is_byte_for_byte_version_1() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = Lockd2::start(d.path(), &["--reconnect-window", "5s"]);
    let mut a = l.raw();
    // hello: only `version` (2) and `features` are new.
    let v1_hello = format!(
        r#"{{"event":"hello","server":"lockd","version":1,"session":{}}}"#,
        a.session
    );
    let v2_hello = a
        .hello_line
        .replace(r#""version":2"#, r#""version":1"#)
        .replace(
            &format!(
                r#","features":{}"#,
                serde_json::to_string(lockd::proto::FEATURES).unwrap()
            ),
            "",
        );
    assert_eq!(v2_hello, v1_hello, "hello: {}", a.hello_line);
    let mut w = l.raw();
    w.send_line(r#"{"op":"watch"}"#);
    expect_line(&mut w, r#"{"event":"watching"}"#);

    a.send_line(r#"{"op":"acquire","resource":"engine","holder":"me"}"#);
    let line = a.next_line(REPLY).expect("granted");
    let g: Value = serde_json::from_str(&line).unwrap();
    let (tok, epoch) = (token(&g), u64_of(&g, "epoch"));
    assert_eq!(
        line,
        format!(
            r#"{{"event":"granted","resource":"engine","holder":"me","epoch":{epoch},"token":"{tok}","reclaimed":false}}"#
        )
    );
    let n = w.until("notice", REPLY);
    assert_eq!(
        keys(&n),
        set(&[
            "event",
            "kind",
            "resource",
            "holder",
            "epoch",
            "session",
            "reclaimed",
            "after_revoke",
            "reason",
            "at_unix_ms"
        ]),
        "{n}"
    );

    let mut b = l.raw();
    b.send_line(r#"{"op":"acquire","resource":"engine","holder":"b","wait":false}"#);
    expect_line(
        &mut b,
        r#"{"event":"busy","resource":"engine","holder":"me"}"#,
    );
    b.send_line(r#"{"op":"acquire","resource":"engine","holder":"b"}"#);
    expect_line(
        &mut b,
        r#"{"event":"queued","resource":"engine","position":1}"#,
    );
    b.send_line(r#"{"op":"release","resource":"engine"}"#);
    expect_line(&mut b, r#"{"event":"cancelled","resource":"engine"}"#);
    b.send_line(r#"{"op":"release","resource":"engine"}"#);
    let e = b.next(REPLY).expect("error");
    assert_eq!(
        keys(&e),
        set(&["event", "code", "message", "resource"]),
        "{e}"
    );
    assert_eq!(e["code"], "not_holder", "{e}");
    b.send_line(r#"{"op":"ping"}"#);
    expect_line(&mut b, r#"{"event":"pong"}"#);

    b.send_line(r#"{"op":"revoke","resource":"engine","reason":"drain"}"#);
    expect_line(
        &mut b,
        &format!(r#"{{"event":"revoke_sent","resource":"engine","epoch":{epoch},"holder":"me"}}"#),
    );
    expect_line(
        &mut a,
        &format!(r#"{{"event":"revoked","resource":"engine","epoch":{epoch},"reason":"drain"}}"#),
    );
    a.send_line(r#"{"op":"release","resource":"engine"}"#);
    expect_line(
        &mut a,
        &format!(r#"{{"event":"released","resource":"engine","epoch":{epoch}}}"#),
    );

    // status of a lockd used by version-1 clients only: the version-1 keys.
    b.send_line(r#"{"op":"status"}"#);
    let st = b.next(REPLY).expect("status");
    assert_eq!(
        keys(&st),
        set(&["event", "resources", "counters", "sessions"]),
        "{st}"
    );
    assert_eq!(
        keys(&st["resources"][0]),
        set(&[
            "name",
            "holder",
            "epoch",
            "state",
            "waiters",
            "holder_session",
            "holder_peer",
            "revoked",
            "granted_at_unix_ms",
            "reclaim_remaining_ms"
        ]),
        "{st}"
    );
    assert_eq!(
        keys(&st["counters"]),
        set(&[
            "grants",
            "releases",
            "expirations",
            "revocations",
            "reclaims"
        ]),
        "{st}"
    );

    // Reclaim after a lockd restart: the version-1 granted, reclaimed.
    a.send_line(r#"{"op":"acquire","resource":"engine","holder":"me"}"#);
    let g: Value = a.next(REPLY).expect("granted");
    let (tok, epoch) = (token(&g), u64_of(&g, "epoch"));
    drop((a, b, w));
    l.restart();
    let mut a = l.raw();
    a.send(&json!({"op":"reclaim","resource":"engine","holder":"me","epoch":epoch,"token":tok}));
    expect_line(
        &mut a,
        &format!(
            r#"{{"event":"granted","resource":"engine","holder":"me","epoch":{epoch},"token":"{tok}","reclaimed":true}}"#
        ),
    );
}

/// A TTL (or shared, or quantity) acquire on a resource held by a version-1 lease gets
/// `kind_mismatch`, and a version-1 acquire on a resource held by a TTL lease too; the
/// holders keep their leases.
#[test]
fn kind_mismatch_both_ways() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    let mut v1 = l.raw();
    v1.rpc(
        json!({"op":"acquire","resource":"k","holder":"v1"}),
        "granted",
    );
    let mut v2 = l.raw();
    for ext in [
        json!({"ttl_ms":5000}),
        json!({"mode":"shared"}),
        json!({"mode":"exclusive"}),
        json!({"quantity":1}),
    ] {
        let mut r = json!({"op":"acquire","resource":"k","holder":"v2"});
        for (k, v) in ext.as_object().unwrap() {
            r[k] = v.clone();
        }
        let e = v2.rpc_err(r.clone(), "kind_mismatch");
        assert_eq!(e["resource"], "k", "{r}: {e}");
    }
    let g = v2.rpc(
        json!({"op":"acquire","resource":"m","holder":"v2","ttl_ms":5000}),
        "granted",
    );
    v1.rpc_err(
        json!({"op":"acquire","resource":"m","holder":"v1"}),
        "kind_mismatch",
    );
    v1.rpc_err(
        json!({"op":"acquire","resource":"m","holder":"v1","wait":false}),
        "kind_mismatch",
    );
    // Nobody lost anything.
    assert_eq!(v2.lease(lease_id(&g))["state"], "held");
    v1.send_line(r#"{"op":"release","resource":"k"}"#);
    let rel = v1.until("released", REPLY);
    assert_eq!(keys(&rel), set(&["event", "resource", "epoch"]), "{rel}");
    // Once the v1 lease is gone, the name may change kind.
    v2.rpc(
        json!({"op":"acquire","resource":"k","holder":"v2","ttl_ms":5000}),
        "granted",
    );
}

/// Core bug (reported, not fixed here): a `status` while a version-2 lease is live, and a
/// `lease`/`leases` answer, do not decode as typed [`Event`]s: `LeaseReport` has its own
/// `lease_id` and `kind` fields *and* flattens `LeaseFields`, which has them too, so every
/// report is sent with `lease_id` and `kind` twice and serde refuses the duplicate fields.
/// Consequences: `lockd status`, the Rust client's status and `harness::lockd`'s readiness
/// check (`Lockd::start`/`restart`) fail while any TTL/shared/quantity lease is live.
#[test]
fn typed_status_and_lease_reports_decode() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    let mut c = l.raw();
    let g = c.rpc(
        json!({"op":"acquire","resource":"t","holder":"a","ttl_ms":60000}),
        "granted",
    );
    for req in [
        json!({"op":"lease","lease_id":lease_id(&g)}),
        json!({"op":"leases"}),
        json!({"op":"status"}),
    ] {
        c.send(&req);
        let line = c.next_line(REPLY).expect("answer");
        let twice = line.matches("\"lease_id\":").count();
        let typed = decode_event(line.as_bytes());
        assert!(
            matches!(
                typed,
                Ok(Event::Lease(_) | Event::Leases { .. } | Event::Status(_))
            ),
            "{req}: {typed:?} ({twice} lease_id keys): {line}"
        );
    }
    let _ = Duration::ZERO;
}
