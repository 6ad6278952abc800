//! TTL leases against real `lockd serve` processes, over raw protocol-2 JSON lines (the
//! seed-000 tests rewritten against lockd, plus a restart in the middle of a TTL).
use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::*;

fn acquire(res: &str, holder: &str, ttl_ms: u64) -> serde_json::Value {
    json!({"op":"acquire","resource":res,"holder":holder,"ttl_ms":ttl_ms})
}

/// Acquire -> held with id and deadline; renew extends; expiry after the TTL (`lease` says
/// `expired`, the holder is told); renew then refused; revoke -> `revoked` with its counter;
/// both ends stay distinguishable (and from an unknown id) once the leases are gone;
/// `held_by` through `leases {holder}`, the active count through `leases`.
#[test]
fn ttl_acquire_renew_expire_revoke_and_tombstones() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    let mut a = Raw::connect(l.socket());
    assert_eq!(
        a.hello["features"],
        json!(lockd::proto::FEATURES),
        "{}",
        a.hello
    );

    let before = unix_ms();
    let g = a.rpc(acquire("t", "a", 1000), "granted");
    let after = unix_ms();
    assert_eq!(g["kind"], "ttl", "{g}");
    assert_eq!(u64_of(&g, "ttl_ms"), 1000, "{g}");
    let (id1, tok1, e1) = (lease_id(&g), token(&g), u64_of(&g, "epoch"));
    let exp1 = u64_of(&g, "expires_at_unix_ms");
    assert!(
        (before + 1000..=after + 1000).contains(&exp1),
        "deadline {exp1} not in [{}, {}]",
        before + 1000,
        after + 1000
    );
    let rep = a.lease(id1);
    assert_eq!(rep["state"], "held", "{rep}");
    assert_eq!(rep["holder"], "a", "{rep}");
    assert_eq!(rep["resource"], "t", "{rep}");

    // held_by and the active count.
    let mut o = Raw::connect(l.socket());
    let mine = o.rpc(json!({"op":"leases","holder":"a"}), "leases");
    let ids: Vec<u64> = mine["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(lease_id)
        .collect();
    assert_eq!(ids, vec![id1], "{mine}");
    let none = o.rpc(json!({"op":"leases","holder":"nobody"}), "leases");
    assert_eq!(none["leases"], json!([]), "{none}");
    let g2 = o.rpc(acquire("t2", "b", 60_000), "granted");
    let all = o.rpc(json!({"op":"leases"}), "leases");
    assert_eq!(all["leases"].as_array().unwrap().len(), 2, "{all}");

    // Renew extends (the full TTL again from now).
    std::thread::sleep(Duration::from_millis(400));
    let r = a.rpc(json!({"op":"renew","lease_id":id1,"token":tok1}), "renewed");
    let exp1b = u64_of(&r, "expires_at_unix_ms");
    assert!(
        exp1b >= exp1 + 350,
        "renew did not extend: {exp1} -> {exp1b}"
    );
    // A wrong token is refused.
    a.rpc_err(
        json!({"op":"renew","lease_id":id1,"token":"00"}),
        "bad_token",
    );

    // No renew: it expires at its deadline; the holder (connection still open) is told.
    let ended = a.until("lease_ended", Duration::from_millis(3000));
    let at = unix_ms();
    assert!(at >= exp1b, "ended at {at}, before its deadline {exp1b}");
    assert!(at <= exp1b + 500, "ended at {at}, long after {exp1b}");
    assert_eq!(ended["reason"], "expired", "{ended}");
    assert_eq!(u64_of(&ended, "lease_id"), id1);
    let rep = a.lease(id1);
    assert_eq!(rep["state"], "expired", "{rep}");
    assert_eq!(rep["reason"], "expired", "{rep}");
    let e = a.rpc_err(
        json!({"op":"renew","lease_id":id1,"token":tok1}),
        "lease_ended",
    );
    assert_eq!(e["resource"], "t", "{e}");

    // A new lease on the same resource: a higher epoch; revoked by lease id.
    let g3 = a.rpc(acquire("t", "a", 60_000), "granted");
    let (id3, tok3) = (lease_id(&g3), token(&g3));
    assert!(u64_of(&g3, "epoch") > e1, "{g3}");
    assert!(id3 > id1, "lease ids are never reused: {id1} then {id3}");
    o.rpc(
        json!({"op":"revoke","lease_id":id3,"reason":"drain"}),
        "revoke_sent",
    );
    let ended = a.until("lease_ended", REPLY);
    let why = ended["reason"].as_str().unwrap_or_default().to_string();
    assert!(
        why.starts_with("revoked:") && why.ends_with(":drain"),
        "{ended}"
    );
    a.rpc_err(
        json!({"op":"renew","lease_id":id3,"token":tok3}),
        "lease_ended",
    );
    let st = o.status(false);
    let ttl = &st["counters_by_kind"]["ttl"];
    assert_eq!(ttl["revocations"], 1, "{st}");
    assert_eq!(ttl["expirations"], 1, "{st}");
    assert!(ttl["renewals"].as_u64() >= Some(1), "{st}");

    // Gone from the live list, still told apart by id (and from an id never granted).
    o.rpc(
        json!({"op":"release","lease_id":lease_id(&g2),"token":token(&g2)}),
        "released",
    );
    let live = o.rpc(json!({"op":"leases"}), "leases");
    assert_eq!(live["leases"], json!([]), "{live}");
    let (r1, r3) = (o.lease(id1), o.lease(id3));
    assert_eq!(r1["state"], "expired", "{r1}");
    assert_eq!(r3["state"], "revoked", "{r3}");
    assert!(
        r3["reason"]
            .as_str()
            .is_some_and(|s| s.starts_with("revoked:")),
        "{r3}"
    );
    let r2 = o.lease(lease_id(&g2));
    assert_eq!(r2["state"], "released", "{r2}");
    let unknown = o.lease(999_999);
    assert_eq!(unknown["state"], "unknown", "{unknown}");
}

/// A waiter is granted (with a higher epoch) when the holder's TTL runs out, while the
/// holder's connection is still open; `wait:false` meanwhile gets `busy`.
#[test]
fn ttl_waiter_granted_when_holder_ttl_runs_out() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    let mut a = Raw::connect(l.socket());
    let g = a.rpc(acquire("w", "a", 800), "granted");
    let (ea, exp) = (u64_of(&g, "epoch"), u64_of(&g, "expires_at_unix_ms"));
    let mut c = Raw::connect(l.socket());
    let busy = c.rpc(
        json!({"op":"acquire","resource":"w","holder":"c","ttl_ms":500,"wait":false}),
        "busy",
    );
    assert_eq!(busy["holder"], "a", "{busy}");
    let mut b = Raw::connect(l.socket());
    let q = b.rpc(acquire("w", "b", 5000), "queued");
    let qid = lease_id(&q);
    let rep = b.lease(qid);
    assert_eq!(rep["state"], "waiting", "{rep}");
    let g = b.until("granted", Duration::from_millis(3000));
    let at = unix_ms();
    assert!(
        at >= exp,
        "granted at {at}, before the holder's deadline {exp}"
    );
    assert!(at <= exp + 500, "granted at {at}, long after {exp}");
    assert_eq!(lease_id(&g), qid, "the queued id is the lease's id");
    assert!(u64_of(&g, "epoch") > ea, "{g} after epoch {ea}");
    let ended = a.until("lease_ended", REPLY);
    assert_eq!(ended["reason"], "expired", "{ended}");
}

/// lockd SIGKILLed at ~40% of a TTL and restarted on the same state file: the lease keeps
/// its `expires_at_unix_ms`, is held until then, and a waiter queued after the restart is
/// granted at the deadline (not before, not more than ~300 ms after).
#[test]
fn ttl_restart_mid_ttl_keeps_the_deadline() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let mut l = Lockd2::start(d.path(), &[]);
    let ttl = 3000;
    let mut a = Raw::connect(l.socket());
    let g = a.rpc(acquire("r", "a", ttl), "granted");
    let (id, tok, ea) = (lease_id(&g), token(&g), u64_of(&g, "epoch"));
    let exp = u64_of(&g, "expires_at_unix_ms");
    let granted_at = Instant::now();
    std::thread::sleep(Duration::from_millis(ttl * 4 / 10));
    drop(a);
    let pid = l.pid().expect("lockd runs");
    l.restart(); // SIGKILL, then a new lockd on the same socket and state file
    assert_ne!(l.pid(), Some(pid), "a new lockd process");
    assert!(
        granted_at.elapsed() < Duration::from_millis(ttl - 800),
        "the restart took too long for this test to mean anything"
    );

    let mut o = Raw::connect(l.socket());
    let rep = o.lease(id);
    assert_eq!(rep["state"], "held", "{rep}");
    assert_eq!(
        u64_of(&rep, "expires_at_unix_ms"),
        exp,
        "the deadline moved across the restart: {rep}"
    );
    let mut b = Raw::connect(l.socket());
    let q = b.rpc(acquire("r", "b", 5000), "queued");
    // Held until the deadline: nothing for the waiter before it.
    let early = exp.saturating_sub(unix_ms()).saturating_sub(150);
    b.quiet(Duration::from_millis(early), "granted before the deadline");
    let rep = o.lease(id);
    assert_eq!(rep["state"], "held", "{rep}");
    let g = b.until("granted", Duration::from_millis(2000));
    let at = unix_ms();
    assert!(at >= exp, "granted at {at}, before the deadline {exp}");
    assert!(
        at <= exp + 300,
        "granted at {at}, more than 300 ms after {exp}"
    );
    assert_eq!(lease_id(&g), lease_id(&q));
    assert!(u64_of(&g, "epoch") > ea, "{g}");
    let rep = o.lease(id);
    assert_eq!(rep["state"], "expired", "{rep}");
    o.rpc_err(
        json!({"op":"renew","lease_id":id,"token":tok}),
        "lease_ended",
    );
}

/// The holder's lease survives lockd's restart: renewed with its old token from a new
/// connection, before the deadline, it lives on past it.
#[test]
fn ttl_renew_after_restart_with_the_old_token() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = Lockd2::start(d.path(), &[]);
    let mut a = Raw::connect(l.socket());
    let g = a.rpc(acquire("s", "a", 2000), "granted");
    let (id, tok, exp) = (lease_id(&g), token(&g), u64_of(&g, "expires_at_unix_ms"));
    drop(a);
    l.restart();
    let mut a = Raw::connect(l.socket());
    let r = a.rpc(json!({"op":"renew","lease_id":id,"token":tok}), "renewed");
    assert!(u64_of(&r, "expires_at_unix_ms") >= exp, "{r}");
    let res = a.rpc(json!({"op":"resume","lease_id":id,"token":tok}), "granted");
    assert_eq!(res["reclaimed"], true, "{res}");
    assert_eq!(lease_id(&res), id);
}
