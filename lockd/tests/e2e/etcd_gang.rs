//! Gangs of exclusive, connection-bound leases on `lockd serve --backend etcd` (docs/ETCD.md,
//! "Gangs on etcd"): two lockd processes "A" and "B" on one real etcd stand for two nodes. A
//! gang is one etcd transaction putting a key in every member's queue (one create revision R
//! for all), granted when it is first in every queue. Checked: hand-over in revision order
//! across lockds with one holder per member at a time and equal, increasing epochs;
//! all-or-nothing (a gang behind a single lease holds nothing, and its key reserves its other
//! members: a later single request there is `busy`/queued behind it); two gangs in opposite
//! member order never deadlock nor overlap; `wait:false` and `timeout_ms` leave no key behind;
//! the client library against it; a planted bug (granted when first in the first member
//! only) is caught. Without an etcd binary these tests print SKIP instead of passing.

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use lockd::lease_client::{GangAcquire, LeaseClient, LeaseError};
use lockd::Endpoint;
use serde_json::{json, Value};

use crate::common::*;
use crate::etcd_backend::{etcd_or_skip, start, EtcdLockd, Line};

const T: Duration = Duration::from_secs(5);

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

fn connect(l: &EtcdLockd) -> Line {
    let mut c = Line::connect(&l.sock).unwrap();
    c.recv_until("hello", T).expect("hello");
    c
}

fn gang(l: &mut Line, label: &str, holder: &str, members: &[&str], extra: Value) {
    let mut v = json!({"op":"acquire","resource":label,"holder":holder,"gang":members});
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        for (k, x) in e {
            o.insert(k.clone(), x.clone());
        }
    }
    l.send(v);
}

/// The next event within `limit` (None: nothing came).
fn next(l: &mut Line, limit: Duration) -> Option<Value> {
    l.recv(limit)
}

fn must(l: &mut Line, what: &str, a: &EtcdLockd, b: &EtcdLockd) -> Value {
    let v = l.recv(T).unwrap_or_else(|| {
        panic!(
            "no {what} within {T:?}\nA: {}\nB: {}",
            a.proc.log_text(),
            b.proc.log_text()
        )
    });
    assert_eq!(v["event"], what, "{v}");
    v
}

/// A `gang_granted`'s members as (resource, epoch), and the common epoch (all must agree).
fn gang_epoch(v: &Value, members: &[&str]) -> u64 {
    assert_eq!(v["event"], "gang_granted", "{v}");
    let ms = v["members"].as_array().unwrap();
    let names: Vec<&str> = ms.iter().map(|m| m["resource"].as_str().unwrap()).collect();
    assert_eq!(names, members, "{v}");
    let e = ms[0]["epoch"].as_u64().unwrap();
    assert!(
        ms.iter().all(|m| m["epoch"].as_u64() == Some(e)),
        "every member epoch equal within a gang: {v}"
    );
    assert_eq!(
        v["gang_id"].as_u64(),
        Some(e),
        "gang id = its revision: {v}"
    );
    e
}

/// `status` (read from etcd) → resource → (holder, epoch, waiters).
fn status(l: &mut Line) -> std::collections::BTreeMap<String, (String, u64, Vec<String>)> {
    l.send(json!({"op":"status"}));
    let st = l.recv_until("status", T).expect("status");
    st["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["state"] == "held")
        .map(|r| {
            (
                r["name"].as_str().unwrap().to_string(),
                (
                    r["holder"].as_str().unwrap_or_default().to_string(),
                    r["epoch"].as_u64().unwrap_or(0),
                    r["waiters"]
                        .as_array()
                        .map(|w| {
                            w.iter()
                                .map(|x| x.as_str().unwrap_or_default().to_string())
                                .collect()
                        })
                        .unwrap_or_default(),
                ),
            )
        })
        .collect()
}

/// Test 1: gang {a,b} on A; a single `b` and a gang {b,c} on B queue behind it; A's
/// connection closes → the next in revision order (the single `b`) is granted, then, at its
/// release, the gang {b,c}; one holder per member at a time (status), equal epochs within a
/// gang, higher than the previous holder's.
#[test]
fn gangs_hand_over_in_revision_order_across_lockds() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let Some((etcd, a, b)) = two_lockds("etcd_gang::hand_over", d.path(), &[]) else {
        return;
    };
    let mut ga = connect(&a);
    gang(&mut ga, "g1", "ga", &["a", "b"], json!({}));
    let g1 = must(&mut ga, "gang_granted", &a, &b);
    let r1 = gang_epoch(&g1, &["a", "b"]);
    assert_eq!(g1["resource"], "g1", "{g1}");

    let mut sb = connect(&b);
    sb.acquire("b", "sb");
    let q = must(&mut sb, "queued", &a, &b);
    assert_eq!(q["position"], 1, "{q}");
    let mut gb = connect(&b);
    gang(&mut gb, "g2", "gb", &["b", "c"], json!({}));
    let q = must(&mut gb, "queued", &a, &b);
    assert_eq!(q["resource"], "g2", "{q}");
    assert_eq!(q["position"], 2, "two keys ahead in b: {q}");
    let r3 = q["lease_id"].as_u64().expect("queued names the gang id");

    // Status (from etcd, on B): a and b held by A's gang with its epoch; b's line: sb, gb.
    let mut st = connect(&b);
    let s = status(&mut st);
    assert_eq!(s["a"].0, "ga@A");
    assert_eq!((s["b"].0.as_str(), s["b"].1), ("ga@A", r1));
    assert_eq!(s["a"].1, r1);
    assert_eq!(s["b"].2, vec!["sb@B", "gb@B"], "{s:?}");
    // c: the waiting gang's key is first there (reserved for it, not usable: the gang is
    // not granted), and a single request on c is behind it.
    assert_eq!((s["c"].0.as_str(), s["c"].1), ("gb@B", r3));
    let mut probe = connect(&a);
    probe.send(json!({"op":"acquire","resource":"c","holder":"p","wait":false}));
    let busy = must(&mut probe, "busy", &a, &b);
    assert_eq!(busy["holder"], "gb@B", "{busy}");
    assert!(
        next(&mut gb, Duration::from_millis(300)).is_none(),
        "gb granted early"
    );

    // A's connection closes: its etcd lease is revoked, both keys go at once.
    drop(ga);
    let g = must(&mut sb, "granted", &a, &b);
    let r2 = g["epoch"].as_u64().unwrap();
    assert!(r1 < r2 && r2 < r3, "revision order {r1} < {r2} < {r3}");
    // gb is still behind sb in b: not granted, holds nothing.
    assert!(
        next(&mut gb, Duration::from_millis(500)).is_none(),
        "gang g2 granted while sb holds b"
    );
    // From here on status from A (a lockd shows its own holders by their plain name).
    let mut st = connect(&a);
    let s = status(&mut st);
    assert_eq!((s["b"].0.as_str(), s["b"].1), ("sb@B", r2), "{s:?}");
    assert!(!s.contains_key("a"), "a is free: {s:?}");

    sb.send(json!({"op":"release","resource":"b"}));
    must(&mut sb, "released", &a, &b);
    let g2 = must(&mut gb, "gang_granted", &a, &b);
    assert_eq!(gang_epoch(&g2, &["b", "c"]), r3);
    let s = status(&mut st);
    assert_eq!((s["b"].0.as_str(), s["b"].1), ("gb@B", r3), "{s:?}");
    assert_eq!((s["c"].0.as_str(), s["c"].1), ("gb@B", r3), "{s:?}");

    // Release by a member's name releases the gang whole.
    gb.send(json!({"op":"release","resource":"c"}));
    let mut released = vec![
        must(&mut gb, "released", &a, &b)["resource"].clone(),
        must(&mut gb, "released", &a, &b)["resource"].clone(),
    ];
    released.sort_by_key(|v| v.to_string());
    assert_eq!(released, vec![json!("b"), json!("c")]);
    // `released` is sent when the holder lets go; the keys' deletion (one transaction)
    // follows in the background, as for a single lease.
    let end = Instant::now() + T;
    loop {
        let s = status(&mut st);
        if s.is_empty() {
            break;
        }
        assert!(Instant::now() < end, "keys left after the release: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(etcd);
}

/// Test 2's scenario; Err names the violated safety check.
fn all_or_nothing_trial(test: &str, env: &[(&str, &str)]) -> Option<Result<(), String>> {
    let d = tempfile::tempdir().unwrap();
    let (etcd, a, b) = two_lockds(test, d.path(), env)?;
    let mut sb = connect(&b);
    sb.acquire("b", "sb");
    let e1 = must(&mut sb, "granted", &a, &b)["epoch"].as_u64().unwrap();

    let mut ga = connect(&a);
    gang(&mut ga, "g", "ga", &["a", "b"], json!({}));
    let first = must_any(&mut ga);
    if first["event"] != "queued" {
        return Some(Err(format!(
            "gang {{a,b}} answered {first} while b is held by sb (epoch {e1}): two holders of b"
        )));
    }
    let r = first["lease_id"].as_u64().unwrap();
    // Nothing usable: a fenced put on a member is refused (the gang holds no member).
    ga.send(json!({"op":"put_fenced","resource":"a","key":"k","value":"v"}));
    let e = must(&mut ga, "error", &a, &b);
    assert_eq!(e["code"], "not_holder", "{e}");
    // A later single request on a: the gang's key is ahead in a's queue (a is reserved for
    // the gang): wait:false → busy naming the gang's holder; wait:true → queued behind it.
    let mut third = connect(&b);
    third.send(json!({"op":"acquire","resource":"a","holder":"t","wait":false}));
    let busy = must(&mut third, "busy", &a, &b);
    assert_eq!(busy["holder"], "ga@A", "{busy}");
    let mut later = connect(&b);
    later.acquire("a", "later");
    assert_eq!(must(&mut later, "queued", &a, &b)["position"], 1);

    sb.send(json!({"op":"release","resource":"b"}));
    must(&mut sb, "released", &a, &b);
    let g = must(&mut ga, "gang_granted", &a, &b);
    let eg = gang_epoch(&g, &["a", "b"]);
    assert_eq!(eg, r);
    assert!(eg > e1, "{eg} > {e1}");
    assert!(
        next(&mut later, Duration::from_millis(300)).is_none(),
        "later granted a while the gang holds it"
    );
    ga.send(json!({"op":"release","resource":"g"}));
    must(&mut ga, "released", &a, &b);
    must(&mut ga, "released", &a, &b);
    let gl = must(&mut later, "granted", &a, &b);
    assert!(gl["epoch"].as_u64().unwrap() > eg, "{gl}");
    drop(etcd);
    Some(Ok(()))
}

fn must_any(l: &mut Line) -> Value {
    l.recv(T).expect("an answer")
}

/// Test 2: all or nothing: while `b` is held by a single lease on B, gang {a,b} on A waits
/// holding nothing; a later single request on `a` is behind the gang's key (busy / queued);
/// after b's release the gang is granted, then the later request.
#[test]
fn a_gang_behind_a_single_lease_holds_nothing() {
    let _process = shared();
    if let Some(r) = all_or_nothing_trial("etcd_gang::all_or_nothing", &[]) {
        r.unwrap();
    }
}

/// The planted bug `LOCKD_PLANTED_BUG_GANG_FIRST_MEMBER_ONLY=1` (granted when first in the
/// first member's queue only): test 2's safety check must fail.
#[test]
fn planted_bug_first_member_only_is_caught() {
    let _process = shared();
    if let Some(r) = all_or_nothing_trial(
        "etcd_gang::planted_first_member_only",
        &[("LOCKD_PLANTED_BUG_GANG_FIRST_MEMBER_ONLY", "1")],
    ) {
        let e = r.expect_err("the planted bug must be caught");
        eprintln!("planted bug caught: {e}");
        assert!(e.contains("two holders of b"), "{e}");
    }
}

/// Test 3: gangs {x,y} on A and {y,x} on B submitted together, 20 rounds: both granted in
/// turn within a bound, never overlapping, the later one with the higher epoch.
#[test]
fn gangs_in_opposite_order_never_deadlock_nor_overlap() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let Some((etcd, a, b)) = two_lockds("etcd_gang::opposite_order", d.path(), &[]) else {
        return;
    };
    let rounds: usize = std::env::var("ETCD_GANG_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut waits = Vec::new();
    for round in 0..rounds {
        let barrier = Arc::new(Barrier::new(2));
        let run = |sock: std::path::PathBuf, name: &'static str, members: [&'static str; 2]| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut c = Line::connect(&sock).unwrap();
                c.recv_until("hello", T).unwrap();
                barrier.wait();
                let sent = Instant::now();
                gang(&mut c, name, name, &members, json!({}));
                let g = c.recv_until("gang_granted", Duration::from_secs(10));
                let got = Instant::now();
                // Hold a little, then release (the interval ends when the release is sent).
                std::thread::sleep(Duration::from_millis(20));
                let rel = Instant::now();
                c.send(json!({"op":"release","resource":name}));
                let r1 = c.recv_until("released", T);
                let r2 = c.recv_until("released", T);
                (g, sent, got, rel, r1.is_some() && r2.is_some())
            })
        };
        let ta = run(a.sock.clone(), "gx", ["x", "y"]);
        let tb = run(b.sock.clone(), "gy", ["y", "x"]);
        let (ga, sa, got_a, rel_a, ok_a) = ta.join().unwrap();
        let (gb, sb, got_b, rel_b, ok_b) = tb.join().unwrap();
        let (Some(ga), Some(gb)) = (ga, gb) else {
            panic!(
                "round {round}: deadlock or lost grant\nA: {}\nB: {}",
                a.proc.log_text(),
                b.proc.log_text()
            );
        };
        assert!(ok_a && ok_b, "round {round}: release answered");
        let ea = gang_epoch(&ga, &["x", "y"]);
        let eb = gang_epoch(&gb, &["y", "x"]);
        assert_ne!(ea, eb);
        // The one with the lower revision first; the other granted only after its release.
        let (first, second) = if ea < eb {
            ((got_a, rel_a), (got_b, rel_b))
        } else {
            ((got_b, rel_b), (got_a, rel_a))
        };
        assert!(
            second.0 > first.1,
            "round {round}: overlap: the second gang (epoch {}) granted {:?} before the first released",
            ea.max(eb),
            first.1.saturating_duration_since(second.0)
        );
        waits.push(got_a.duration_since(sa).max(got_b.duration_since(sb)));
    }
    waits.sort();
    eprintln!(
        "etcd gangs, opposite order, {rounds} rounds: slower grant median {:.1} ms, max {:.1} ms",
        waits[waits.len() / 2].as_secs_f64() * 1e3,
        waits[waits.len() - 1].as_secs_f64() * 1e3
    );
    drop(etcd);
}

/// Test 4: `wait:false` → `busy` and `timeout_ms` → `cancelled`, the gang's keys gone (a later
/// single acquire of the free member is granted at once); a free gang with `wait:false` is
/// granted at once.
#[test]
fn wait_false_and_timeout_leave_no_key_behind() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let Some((etcd, a, b)) = two_lockds("etcd_gang::wait_false_timeout", d.path(), &[]) else {
        return;
    };
    let mut hq = connect(&b);
    hq.acquire("q", "hq");
    must(&mut hq, "granted", &a, &b);

    let mut g = connect(&a);
    gang(&mut g, "g", "g", &["p", "q"], json!({"wait":false}));
    let busy = must(&mut g, "busy", &a, &b);
    assert_eq!(
        (busy["resource"].as_str(), busy["holder"].as_str()),
        (Some("g"), Some("hq@B")),
        "{busy}"
    );
    let mut probe = connect(&b);
    probe.send(json!({"op":"acquire","resource":"p","holder":"probe","wait":false}));
    must(&mut probe, "granted", &a, &b);
    probe.send(json!({"op":"release","resource":"p"}));
    must(&mut probe, "released", &a, &b);

    let t0 = Instant::now();
    gang(&mut g, "g", "g", &["p", "q"], json!({"timeout_ms":400}));
    must(&mut g, "queued", &a, &b);
    let c = must(&mut g, "cancelled", &a, &b);
    let took = t0.elapsed();
    assert_eq!(c["resource"], "g", "{c}");
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(3),
        "{took:?}"
    );
    probe.send(json!({"op":"acquire","resource":"p","holder":"probe","wait":false}));
    must(&mut probe, "granted", &a, &b);
    probe.send(json!({"op":"release","resource":"p"}));
    must(&mut probe, "released", &a, &b);
    // The same connection may ask again under the same name: nothing of the old gang is left.
    hq.send(json!({"op":"release","resource":"q"}));
    must(&mut hq, "released", &a, &b);
    gang(&mut g, "g", "g", &["p", "q"], json!({"wait":false}));
    let gg = must(&mut g, "gang_granted", &a, &b);
    gang_epoch(&gg, &["p", "q"]);
    // A member of a held gang: already_held on the same connection, busy elsewhere.
    g.acquire("q", "g");
    assert_eq!(must(&mut g, "error", &a, &b)["code"], "already_held");
    // The gang's name too (release of a name must mean one thing), and a gang over a held member.
    g.acquire("g", "g");
    assert_eq!(must(&mut g, "error", &a, &b)["code"], "already_held");
    gang(&mut g, "g2", "g", &["r", "p"], json!({}));
    assert_eq!(must(&mut g, "error", &a, &b)["code"], "already_held");
    probe.send(json!({"op":"acquire","resource":"q","holder":"probe","wait":false}));
    assert_eq!(must(&mut probe, "busy", &a, &b)["holder"], "g@A");
    drop(etcd);
}

/// The client library against this backend: `hello` lists `gang`, and the gang kinds it sends
/// (TTL; shared needs `shared`, not listed) are refused clearly.
#[tokio::test]
async fn lease_client_gangs_are_refused_clearly() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let Some((etcd, a, _b)) = two_lockds("etcd_gang::lease_client", d.path(), &[]) else {
        return;
    };
    let ep: Endpoint = format!("unix:{}", a.sock.display()).parse().unwrap();
    let c = tokio::time::timeout(T, LeaseClient::connect(&ep))
        .await
        .unwrap()
        .unwrap();
    assert!(
        c.features().iter().any(|f| f == "gang"),
        "{:?}",
        c.features()
    );
    let r = tokio::time::timeout(
        T,
        c.acquire_gang(&GangAcquire::ttl(
            "g",
            "h",
            ["a", "b"],
            Duration::from_secs(5),
        )),
    )
    .await
    .unwrap();
    match r {
        Err(LeaseError::Refused { code, message }) => {
            assert_eq!(code, "unsupported");
            assert!(
                message.contains("a gang of ttl leases") && message.contains("etcd backend"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    let r = c
        .acquire_gang(&GangAcquire::shared("g", "h", ["a", "b"]))
        .await;
    assert!(matches!(r, Err(LeaseError::Unsupported { .. })), "{r:?}");
    // The connection still serves.
    tokio::time::timeout(T, c.ping()).await.unwrap().unwrap();
    drop(etcd);
}

/// A cut off from etcd while its connection holds gang {m1,m2}: the holder is told `revoked`
/// (`lost:…`) for both members before B's gang {m2,m3} is granted, at least the kill time
/// (800 ms) later; B's members share one epoch above A's. (The session's self-fence is
/// unchanged: gang members are ordinary locks of the session.)
#[test]
fn partitioned_gang_holder_is_fenced_before_the_other_gang_is_granted() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let Some(etcd) = etcd_or_skip("etcd_gang::partition", d.path()) else {
        return;
    };
    let flags = [
        "--etcd-ttl",
        "3s",
        "--etcd-kill-time",
        "800ms",
        "--etcd-pause",
        "200ms",
        "--etcd-drift-ppm",
        "10000",
    ];
    let proxy = harness::etcd::Proxy::start(([127, 0, 0, 1], etcd.client_port).into());
    let a = start(d.path(), "A", &proxy.url(), &flags, &[]);
    let b = start(d.path(), "B", &etcd.client_url, &flags, &[]);
    let mut ha = connect(&a);
    gang(&mut ha, "ga", "ga", &["m1", "m2"], json!({}));
    let ea = gang_epoch(&must(&mut ha, "gang_granted", &a, &b), &["m1", "m2"]);
    let mut hb = connect(&b);
    gang(&mut hb, "gb", "gb", &["m2", "m3"], json!({}));
    must(&mut hb, "queued", &a, &b);
    std::thread::sleep(Duration::from_millis(700));

    let granted = std::thread::spawn(move || {
        let g = hb.recv_until("gang_granted", Duration::from_secs(20));
        (Instant::now(), g)
    });
    let cut = Instant::now();
    proxy.blackhole();
    let mut told = Vec::new();
    while told.len() < 2 {
        let r = ha
            .recv_until("revoked", Duration::from_secs(15))
            .unwrap_or_else(|| panic!("A's gang holder not told: {}", a.proc.log_text()));
        assert!(
            r["reason"]
                .as_str()
                .unwrap_or_default()
                .starts_with("lost:"),
            "{r}"
        );
        assert_eq!(r["epoch"].as_u64(), Some(ea), "{r}");
        told.push((Instant::now(), r["resource"].as_str().unwrap().to_string()));
    }
    let t_told = told[1].0;
    let mut names: Vec<String> = told.into_iter().map(|(_, r)| r).collect();
    names.sort();
    assert_eq!(names, ["m1", "m2"]);
    let (t_granted, g) = granted.join().unwrap();
    let g = g.unwrap_or_else(|| panic!("B's gang not granted: {}", b.proc.log_text()));
    let eb = gang_epoch(&g, &["m2", "m3"]);
    assert!(eb > ea, "{eb} > {ea}");
    let margin = t_granted.saturating_duration_since(t_told);
    eprintln!(
        "etcd gang partition: A's holder told {:.0} ms after the cut, B's gang granted {:.0} ms after that",
        t_told.duration_since(cut).as_secs_f64() * 1e3,
        margin.as_secs_f64() * 1e3
    );
    assert!(
        t_granted > t_told && margin >= Duration::from_millis(800),
        "B's gang granted {margin:?} after A's holder was told (kill time 800 ms)"
    );
    drop(etcd);
}
