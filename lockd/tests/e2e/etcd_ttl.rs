//! TTL leases on `lockd serve --backend etcd` (docs/ETCD.md, "TTL leases on etcd"): two lockd
//! processes "A" and "B" on one real etcd stand for two nodes. A TTL lease outlives its
//! connection, is renewed, resumed, released and revoked by lease id from either lockd, and
//! expires at its deadline: its holder is told before anybody else is granted, and nobody is
//! granted before the holder's deadline (a planted late deadline is caught by that check).
//! The Rust client library serves TTL leases over this backend. Without an etcd binary these
//! tests print SKIP instead of passing.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lockd::lease_client::{Acquire, Acquired, Ended, LeaseClient, LeaseError};
use lockd::proto::{LeaseKind, Mode};
use lockd::Endpoint;
use serde_json::{json, Value};

use crate::common::*;
use crate::etcd_backend::{etcd_or_skip, start, EtcdLockd, Line};

const T: Duration = Duration::from_secs(5);

/// `f` within `T`.
async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(T, f).await.expect("answered in time")
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn acquire_ttl(l: &mut Line, resource: &str, holder: &str, ttl_ms: u64, wait: bool) {
    l.send(json!({"op":"acquire","resource":resource,"holder":holder,"ttl_ms":ttl_ms,"wait":wait}));
}

/// The next event of `l` but `hello` within `T`, failing with both lockds' logs.
fn next(l: &mut Line, a: &EtcdLockd, b: &EtcdLockd, what: &str) -> Value {
    loop {
        let v = l.recv(T).unwrap_or_else(|| {
            panic!(
                "no {what} within {T:?}\nA: {}\nB: {}",
                a.proc.log_text(),
                b.proc.log_text()
            )
        });
        if v["event"] != "hello" {
            return v;
        }
    }
}

fn two_lockds(
    test: &str,
    dir: &Path,
    env: &[(&str, &str)],
) -> Option<(harness::etcd::Etcd, EtcdLockd, EtcdLockd)> {
    let etcd = etcd_or_skip(test, dir)?;
    let a = start(dir, "A", &etcd.client_url, &[], env);
    let b = start(dir, "B", &etcd.client_url, &[], env);
    Some((etcd, a, b))
}

/// What one expiry trial saw.
struct Expiry {
    /// The holder's last deadline (from `renewed`).
    deadline_unix_ms: u64,
    /// When the holder's connection read `lease_ended` (`None`: never, within the bound).
    told: Option<(Instant, u64, String)>,
    /// When the waiter read its grant.
    granted: (Instant, u64),
    epochs: (u64, u64),
}

impl Expiry {
    /// The safety checks: nobody is granted before the holder's deadline, and the holder
    /// (connected) is told `lease_ended` `expired` before the other grant.
    fn check(&self) -> Result<(), String> {
        if self.granted.1 < self.deadline_unix_ms {
            return Err(format!(
                "the waiter was granted at {} ms, {} ms BEFORE the holder's deadline {}",
                self.granted.1,
                self.deadline_unix_ms - self.granted.1,
                self.deadline_unix_ms
            ));
        }
        let Some((told_at, told_unix, reason)) = &self.told else {
            return Err("the holder was never told lease_ended".into());
        };
        if reason != "expired" {
            return Err(format!("the holder was told {reason:?}, not expired"));
        }
        if *told_at > self.granted.0 {
            return Err(format!(
                "the holder was told {:?} AFTER the waiter's grant",
                *told_at - self.granted.0
            ));
        }
        if *told_unix + 5 < self.deadline_unix_ms {
            return Err(format!(
                "the holder was told {} ms before its deadline",
                self.deadline_unix_ms - told_unix
            ));
        }
        if self.epochs.1 <= self.epochs.0 {
            return Err(format!(
                "epoch {} not above {}",
                self.epochs.1, self.epochs.0
            ));
        }
        Ok(())
    }
}

/// Test 1's scenario: granted on A, its connection closes, still held (busy on B), renewed
/// and resumed from new connections on B, then not renewed: expires.
fn expiry_trial(test: &str, env: &[(&str, &str)], planted: bool) -> Option<Expiry> {
    let d = tempfile::tempdir().unwrap();
    let (etcd, a, b) = two_lockds(test, d.path(), env)?;
    let ttl_ms = 1500;

    let mut h1 = Line::connect(&a.sock).unwrap();
    let hello = h1.recv_until("hello", T).unwrap();
    assert!(
        hello["features"]
            .as_array()
            .unwrap()
            .contains(&json!("ttl")),
        "{hello}"
    );
    let before = unix_ms();
    acquire_ttl(&mut h1, "job", "w1", ttl_ms, true);
    let g = next(&mut h1, &a, &b, "granted");
    let after = unix_ms();
    assert_eq!(g["event"], "granted", "{g}");
    assert_eq!(
        (g["kind"].as_str(), g["ttl_ms"].as_u64()),
        (Some("ttl"), Some(ttl_ms)),
        "{g}"
    );
    assert_eq!(g["reclaimed"], false);
    let id = g["lease_id"].as_u64().expect("lease_id");
    let token = g["token"].as_str().unwrap().to_string();
    assert_eq!(token.len(), 32, "{g}");
    let e1 = g["epoch"].as_u64().unwrap();
    let exp1 = g["expires_at_unix_ms"].as_u64().unwrap();
    if !planted {
        // The deadline starts at the send time of the grant's etcd call: within the
        // request's round trip, never later.
        assert!(
            (before + ttl_ms..=after + ttl_ms).contains(&exp1),
            "expires_at {exp1} not within [{}, {}]",
            before + ttl_ms,
            after + ttl_ms
        );
    }
    drop(h1);
    std::thread::sleep(Duration::from_millis(200));

    // Still held: a try-once on B (TTL or version 1) is busy, naming the holder.
    let mut t = Line::connect(&b.sock).unwrap();
    acquire_ttl(&mut t, "job", "w2", ttl_ms, false);
    let busy = t.recv_until("busy", T).expect("busy");
    assert_eq!(busy["holder"], "w1@A", "{busy}");
    t.send(json!({"op":"acquire","resource":"job","holder":"v1","wait":false}));
    assert_eq!(t.recv_until("busy", T).unwrap()["holder"], "w1@A");

    // Renewed and resumed from a new connection on B.
    let mut h2 = Line::connect(&b.sock).unwrap();
    h2.send(json!({"op":"renew","lease_id":id,"token":"0123456789abcdef0123456789abcdef"}));
    let e = next(&mut h2, &a, &b, "bad_token");
    assert_eq!(e["code"], "bad_token", "{e}");
    let sent = unix_ms();
    h2.send(json!({"op":"renew","lease_id":id,"token":token}));
    let r = next(&mut h2, &a, &b, "renewed");
    assert_eq!(r["event"], "renewed", "{r}");
    let exp2 = r["expires_at_unix_ms"].as_u64().unwrap();
    assert!(exp2 > exp1, "{r}");
    if !planted {
        assert!(exp2 >= sent + ttl_ms && exp2 <= unix_ms() + ttl_ms, "{r}");
    }
    h2.send(json!({"op":"resume","lease_id":id,"token":token}));
    let rs = next(&mut h2, &a, &b, "resume");
    assert_eq!(
        (
            rs["event"].as_str(),
            rs["reclaimed"].as_bool(),
            rs["epoch"].as_u64(),
            rs["lease_id"].as_u64()
        ),
        (Some("granted"), Some(true), Some(e1), Some(id)),
        "{rs}"
    );
    h2.send(json!({"op":"lease","lease_id":id}));
    let l = next(&mut h2, &a, &b, "lease");
    assert_eq!(
        (l["state"].as_str(), l["holder"].as_str()),
        (Some("held"), Some("w1")),
        "{l}"
    );

    // A waiter on B; then nobody renews.
    let mut w = Line::connect(&b.sock).unwrap();
    acquire_ttl(&mut w, "job", "w2", 30_000, true);
    let q = w.recv_until("queued", T).expect("queued");
    assert!(q["lease_id"].as_u64().is_some(), "{q}");
    let waiter = std::thread::spawn(move || {
        let g = w.recv_until("granted", Duration::from_secs(15));
        (Instant::now(), unix_ms(), g)
    });
    let told = h2
        .recv_until("lease_ended", Duration::from_secs(15))
        .map(|v| {
            (
                Instant::now(),
                unix_ms(),
                v["reason"].as_str().unwrap_or("").to_string(),
            )
        });
    let (g_at, g_unix, g2) = waiter.join().unwrap();
    let g2 = g2.unwrap_or_else(|| {
        panic!(
            "the waiter was never granted\nA: {}\nB: {}",
            a.proc.log_text(),
            b.proc.log_text()
        )
    });
    let e2 = g2["epoch"].as_u64().unwrap();
    if let Some((_, u, _)) = &told {
        eprintln!(
            "etcd ttl: holder told expired {} ms after its deadline; waiter granted {} ms after the deadline ({} ms after the holder was told); epochs {e1} -> {e2}",
            *u as i64 - exp2 as i64,
            g_unix as i64 - exp2 as i64,
            g_unix as i64 - *u as i64
        );
    }
    if !planted {
        // Ended: renew refused, `lease` reports expired (this lockd's tombstone).
        h2.send(json!({"op":"renew","lease_id":id,"token":token}));
        let e = h2.recv_until("error", T).unwrap();
        assert_eq!(e["code"], "lease_ended", "{e}");
        assert!(e["message"].as_str().unwrap().contains("expired"), "{e}");
        h2.send(json!({"op":"lease","lease_id":id}));
        let l = h2.recv_until("lease", T).unwrap();
        assert_eq!(
            (l["state"].as_str(), l["reason"].as_str()),
            (Some("expired"), Some("expired")),
            "{l}"
        );
    }
    drop(etcd);
    Some(Expiry {
        deadline_unix_ms: exp2,
        told,
        granted: (g_at, g_unix),
        epochs: (e1, e2),
    })
}

/// Test 1: a TTL lease outlives its connection, is renewed and resumed from another lockd,
/// and expires at its deadline: holder told first, waiter granted after, higher epoch.
#[test]
fn ttl_lease_outlives_its_connection_renews_anywhere_and_expires_at_its_deadline() {
    let _process = serial();
    let Some(x) = expiry_trial("etcd_ttl::expires", &[], false) else {
        return;
    };
    x.check().unwrap();
}

/// The same scenario with the PLANTED BUG `LOCKD_PLANTED_BUG_TTL_LATE_DEADLINE=1` (the
/// deadline read after the etcd call, from etcd's TTL + 1 s: later than etcd's expiry): the
/// safety check must fail.
#[test]
fn planted_bug_late_deadline_is_caught() {
    let _process = serial();
    let Some(x) = expiry_trial(
        "etcd_ttl::planted_late_deadline",
        &[("LOCKD_PLANTED_BUG_TTL_LATE_DEADLINE", "1")],
        true,
    ) else {
        return;
    };
    let r = x.check();
    eprintln!("planted late deadline: check says {r:?}");
    assert!(r.is_err(), "the planted late deadline was not caught");
}

/// Test 2: release by lease id + token from another connection (on the other lockd) hands
/// over in milliseconds; a wrong token loses nothing; revoke by lease id tells the holder;
/// unknown and connection-bound lease ids are refused clearly.
#[tokio::test]
async fn release_and_revoke_by_lease_id_from_any_lockd() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let Some((etcd, a, b)) = two_lockds("etcd_ttl::release_revoke", d.path(), &[]) else {
        return;
    };
    let mut h = Line::connect(&a.sock).unwrap();
    acquire_ttl(&mut h, "r2", "holder-a", 30_000, true);
    let g = h.recv_until("granted", T).unwrap();
    let (l1, t1, e1) = (
        g["lease_id"].as_u64().unwrap(),
        g["token"].as_str().unwrap().to_string(),
        g["epoch"].as_u64().unwrap(),
    );
    // A waiting request whose connection closes is withdrawn (its etcd lease revoked, its
    // key gone); the held lease stays.
    let mut x = Line::connect(&a.sock).unwrap();
    acquire_ttl(&mut x, "r2", "gone", 30_000, true);
    let l3 = x.recv_until("queued", T).unwrap()["lease_id"]
        .as_u64()
        .unwrap();
    drop(x);
    let end = Instant::now() + T;
    loop {
        h.send(json!({"op":"leases","resource":"r2"}));
        let ls = h.recv_until("leases", T).unwrap();
        let ids: Vec<u64> = ls["leases"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|l| l["lease_id"].as_u64())
            .collect();
        if ids == [l1] {
            break;
        }
        assert!(ids.contains(&l1), "{ls}");
        assert!(
            Instant::now() < end,
            "the closed connection's request {l3} is still there: {ls}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut w = Line::connect(&b.sock).unwrap();
    acquire_ttl(&mut w, "r2", "holder-b", 30_000, true);
    let q = w.recv_until("queued", T).unwrap();
    let l2 = q["lease_id"].as_u64().unwrap();
    assert_eq!(q["position"], 1, "{q}");

    // Wrong token: refused, nothing lost.
    let mut o = Line::connect(&b.sock).unwrap();
    o.send(json!({"op":"release","lease_id":l1,"token":"nope"}));
    assert_eq!(next(&mut o, &a, &b, "bad_token")["code"], "bad_token");
    o.send(json!({"op":"revoke","lease_id":l1 + 1_000_000}));
    // (a lease id nobody granted)
    let e = next(&mut o, &a, &b, "unknown_lease");
    assert_eq!(e["code"], "unknown_lease", "{e}");
    o.send(json!({"op":"lease","lease_id":l1}));
    assert_eq!(next(&mut o, &a, &b, "lease")["state"], "held");
    assert!(
        w.recv(Duration::from_millis(300)).is_none(),
        "the waiter moved"
    );

    // Release from B by lease id + token: B's waiter granted in milliseconds.
    let t0 = Instant::now();
    o.send(json!({"op":"release","lease_id":l1,"token":t1}));
    let r = next(&mut o, &a, &b, "released");
    assert_eq!(
        (
            r["event"].as_str(),
            r["lease_id"].as_u64(),
            r["epoch"].as_u64()
        ),
        (Some("released"), Some(l1), Some(e1)),
        "{r}"
    );
    let g2 = w.recv_until("granted", T).expect("waiter granted");
    let took = t0.elapsed();
    eprintln!(
        "etcd ttl: release by lease_id on B -> waiter on B granted in {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(g2["lease_id"].as_u64(), Some(l2));
    assert!(g2["epoch"].as_u64().unwrap() > e1, "{g2}");
    assert_eq!(g2["kind"], "ttl");
    let t2 = g2["token"].as_str().unwrap().to_string();
    // The released lease: its holder on A is not told (it asked); ended everywhere.
    assert!(
        h.recv(Duration::from_millis(300)).is_none(),
        "holder told of a release"
    );
    o.send(json!({"op":"renew","lease_id":l1,"token":t1}));
    assert_eq!(next(&mut o, &a, &b, "lease_ended")["code"], "lease_ended");
    h.send(json!({"op":"lease","lease_id":l1}));
    let rep = h.recv_until("lease", T).unwrap();
    assert_eq!(rep["state"], "released", "A's tombstone: {rep}");

    // `leases` lists the live one (from etcd).
    h.send(json!({"op":"leases","resource":"r2"}));
    let ls = h.recv_until("leases", T).unwrap();
    let ls = ls["leases"].as_array().unwrap();
    assert_eq!(ls.len(), 1, "{ls:?}");
    assert_eq!(
        (ls[0]["lease_id"].as_u64(), ls[0]["state"].as_str()),
        (Some(l2), Some("held"))
    );

    // Revoke by lease id from A of the lease held through B: its holder is told.
    let mut wt = Line::connect(&a.sock).unwrap();
    wt.send(json!({"op":"watch"}));
    wt.recv_until("watching", T).unwrap();
    let mut op = Line::connect(&a.sock).unwrap();
    op.send(json!({"op":"revoke","lease_id":l2,"reason":"drain"}));
    let rs = next(&mut op, &a, &b, "revoke_sent");
    assert_eq!(
        (rs["event"].as_str(), rs["holder"].as_str()),
        (Some("revoke_sent"), Some("holder-b")),
        "{rs}"
    );
    let n = wt.recv_until("notice", T).expect("a notice on A");
    assert_eq!(
        (
            n["kind"].as_str(),
            n["lease_id"].as_u64(),
            n["lease_kind"].as_str()
        ),
        (Some("revoked"), Some(l2), Some("ttl")),
        "{n}"
    );
    let le = w.recv_until("lease_ended", T).expect("holder told");
    let reason = le["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("revoked:") && reason.ends_with(":drain"),
        "{le}"
    );
    assert_eq!(le["lease_id"].as_u64(), Some(l2));
    w.send(json!({"op":"renew","lease_id":l2,"token":t2}));
    let e = w.recv_until("error", T).unwrap();
    assert_eq!(e["code"], "lease_ended", "{e}");
    op.send(json!({"op":"lease","lease_id":l2}));
    assert_eq!(op.recv_until("lease", T).unwrap()["state"], "revoked");
    op.send(json!({"op":"lease","lease_id":424242}));
    assert_eq!(op.recv_until("lease", T).unwrap()["state"], "unknown");

    // A connection-bound (version-1) lease's id: wrong_lease, not a panic.
    let mut v1 = Line::connect(&a.sock).unwrap();
    v1.acquire("engine", "v1");
    v1.recv_until("granted", T).unwrap();
    let mut c = etcd_client::Client::connect([etcd.client_url.as_str()], None)
        .await
        .unwrap();
    let kvs = c
        .get(
            "/lockd/engine/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let key = String::from_utf8_lossy(kvs.kvs()[0].key()).into_owned();
    let v1_id = u64::from_str_radix(key.rsplit('/').next().unwrap(), 16).unwrap();
    for req in [
        json!({"op":"renew","lease_id":v1_id,"token":"x"}),
        json!({"op":"resume","lease_id":v1_id,"token":"x"}),
        json!({"op":"release","lease_id":v1_id,"token":"x"}),
        json!({"op":"revoke","lease_id":v1_id}),
    ] {
        op.send(req.clone());
        let e = op.recv_until("error", T).unwrap();
        assert_eq!(e["code"], "wrong_lease", "{req} -> {e}");
        assert!(
            e["message"].as_str().unwrap().contains("connection-bound"),
            "{e}"
        );
    }
    for req in [
        json!({"op":"renew","lease_id":u64::MAX,"token":"x"}),
        json!({"op":"resume","lease_id":0,"token":"x"}),
    ] {
        op.send(req.clone());
        assert_eq!(
            op.recv_until("error", T).unwrap()["code"],
            "unknown_lease",
            "{req}"
        );
    }
    // The version-1 holder still holds.
    v1.send(json!({"op":"release","resource":"engine"}));
    assert_eq!(v1.recv_until("released", T).unwrap()["event"], "released");
    drop(etcd);
}

/// Test 3: `lockd::lease_client` serves TTL leases over the etcd backend (hello lists `ttl`);
/// the kinds this backend does not serve are refused by the client itself.
#[tokio::test]
async fn lease_client_serves_ttl_leases_over_etcd() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let Some((etcd, a, b)) = two_lockds("etcd_ttl::lease_client", d.path(), &[]) else {
        return;
    };
    let ep = |l: &EtcdLockd| -> Endpoint { format!("unix:{}", l.sock.display()).parse().unwrap() };
    let ca = within(LeaseClient::connect(&ep(&a))).await.unwrap();
    assert!(
        ca.features().iter().any(|f| f == "ttl"),
        "{:?}",
        ca.features()
    );
    let lease = match within(ca.acquire(&Acquire::ttl("lc", "rust-a", Duration::from_secs(5))))
        .await
        .unwrap()
    {
        Acquired::Granted(l) => l,
        other => panic!("{other:?}"),
    };
    assert_eq!((lease.kind, lease.ttl_ms), (LeaseKind::Ttl, Some(5000)));
    let exp = lease.expires_at_unix_ms.unwrap();
    let renewed = within(ca.renew(&lease, None)).await.unwrap();
    assert!(renewed >= exp, "{renewed} < {exp}");
    let rep = within(ca.lease(lease.lease_id)).await.unwrap();
    assert_eq!(rep.state, "held");
    assert_eq!(rep.lease.expires_at_unix_ms, Some(renewed));

    let cb = within(LeaseClient::connect(&ep(&b))).await.unwrap();
    let busy = within(cb.acquire(&Acquire::ttl("lc", "rust-b", Duration::from_secs(5)).no_wait()))
        .await
        .unwrap();
    assert_eq!(
        busy,
        Acquired::Busy {
            holder: Some("rust-a@A".into())
        }
    );
    let resumed = within(cb.resume(&lease.saved())).await.unwrap();
    assert!(resumed.resumed);
    assert_eq!(
        (resumed.lease_id, resumed.epoch),
        (lease.lease_id, lease.epoch)
    );
    let ended = within(cb.release(&lease.saved())).await.unwrap();
    assert_eq!(ended, Ended::Released { epoch: lease.epoch });
    // Free again.
    match within(cb.acquire(&Acquire::ttl("lc", "rust-b", Duration::from_secs(5)).no_wait()))
        .await
        .unwrap()
    {
        Acquired::Granted(l) => assert!(l.epoch > lease.epoch),
        other => panic!("{other:?}"),
    }
    // Not served here: refused by the client, nothing sent.
    let r = ca
        .acquire(&Acquire::shared("s", "rust-a", Mode::Shared))
        .await;
    assert!(matches!(r, Err(LeaseError::Unsupported { .. })), "{r:?}");
    let r = ca.acquire(&Acquire::quantity("pool", "rust-a", 1)).await;
    assert!(matches!(r, Err(LeaseError::Unsupported { .. })), "{r:?}");
    drop(etcd);
}
