//! `lockd status` prints the JSON object of docs/INTERFACES.md (with SO_PEERCRED pid/uid/gid);
//! `lockd watch` streams grants, releases, expirations and revocations as JSON lines.
//!
//! These tests check the bytes users' scripts read (raw JSON), and that the same output parses
//! as the typed documents (`lockd::proto::StatusReport`, `Notice`).
use crate::common::*;
use lockd::proto::{LeaseState, Notice, NoticeKind, PeerInfo, StatusReport};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Resource `name` of a raw status object; panics (showing the status) when it is missing,
/// so that an assertion on its fields cannot pass on `Null`.
fn raw_resource(st: &Value, name: &str) -> Value {
    st["resources"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no resource {name:?} in status {st}"))
}

/// A `lockd watch` line as the typed [`Notice`] it carries (`watch` prints the notice with
/// its `kind` under the key `event`); panics when it does not parse.
fn watch_notice(line: &Value) -> Notice {
    let mut v = line.clone();
    let o = v
        .as_object_mut()
        .unwrap_or_else(|| panic!("watch line is not an object: {line}"));
    let kind = o
        .remove("event")
        .unwrap_or_else(|| panic!("no event in {line}"));
    assert!(
        o.insert("kind".into(), kind).is_none(),
        "both event and kind: {line}"
    );
    serde_json::from_value(v).unwrap_or_else(|e| panic!("not a notice: {line}: {e}"))
}

#[test]
fn status_has_the_documented_shape_and_peer_credentials() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let fa = d.path().join("a.epoch");
    let a = hold(&l, "engine", "engine-a", &record_epoch_and_sleep(&fa), &[]);
    wait_epoch(&fa, Duration::from_secs(10));
    let _b = hold(&l, "engine", "engine-b", "true", &[]);
    wait_waiters(&l, "engine", 1);

    let out = Command::new(BIN)
        .args(["status", "--connect", &l.endpoint()])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text.trim().lines().count(),
        1,
        "one JSON object on one line"
    );
    let st: Value = serde_json::from_str(&text).unwrap();
    let r = raw_resource(&st, "engine");
    assert_eq!(r["name"], "engine");
    assert_eq!(r["holder"], "engine-a");
    assert_eq!(r["epoch"], 1);
    assert_eq!(r["state"], "held");
    assert_eq!(r["waiters"], serde_json::json!(["engine-b"]));
    for k in ["grants", "releases", "expirations", "revocations"] {
        assert!(st["counters"][k].is_u64(), "counter {k} missing: {st}");
    }
    assert_eq!(
        r["holder_peer"]["pid"],
        a.pid(),
        "SO_PEERCRED pid of the holder"
    );
    let (uid, gid) = (
        nix::unistd::getuid().as_raw(),
        nix::unistd::getgid().as_raw(),
    );
    assert_eq!(r["holder_peer"]["uid"], uid);
    assert_eq!(r["holder_peer"]["gid"], gid);

    // The same output, typed: every field read, and nothing on the wire that the typed
    // document does not carry (it serializes back to the same JSON).
    let typed: StatusReport = serde_json::from_str(&text).unwrap();
    assert_eq!(serde_json::to_value(&typed).unwrap(), st);
    let tr = resource(&typed, "engine");
    assert_eq!(
        (
            tr.holder.as_deref(),
            tr.epoch,
            tr.state,
            tr.waiters.as_slice()
        ),
        (
            Some("engine-a"),
            1,
            LeaseState::Held,
            &["engine-b".to_string()][..]
        )
    );
    assert_eq!(
        tr.holder_peer,
        Some(PeerInfo {
            transport: "unix".into(),
            pid: Some(a.pid()),
            uid: Some(uid),
            gid: Some(gid),
            addr: None,
        }),
        "{typed:?}"
    );
    assert!(!tr.revoked);
    let holder_session = tr.holder_session.expect("holder_session of a held lease");
    let s = typed
        .sessions
        .iter()
        .find(|s| s.id == holder_session)
        .unwrap_or_else(|| panic!("no session {holder_session}: {typed:?}"));
    assert_eq!(s.holds, vec!["engine".to_string()]);
    assert_eq!(typed.counters.grants, 1);
    assert!(
        l.log_text().contains(&format!("pid={}", a.pid())),
        "peer pid is logged"
    );
    // Socket mode 0660.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(l.socket()).unwrap().permissions().mode() & 0o777,
        0o660
    );
}

#[test]
fn watch_streams_lease_changes() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "300ms"]);
    let mut w = Group::spawn(
        Command::new(BIN)
            .args(["watch", "--connect", &l.endpoint()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    // Lines arrive through a reader thread so that every read is bounded.
    let (tx, rx) = std::sync::mpsc::channel();
    let out = w.child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // Wait until the watcher is registered.
    wait_for(Duration::from_secs(10), "watcher session", || {
        l.status().sessions.iter().any(|s| s.watching).then_some(())
    });
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    a.recv_until("granted").unwrap();
    let mut op = Conn::connect(l.socket()).unwrap();
    op.send(r#"{"op":"revoke","resource":"engine","reason":"test"}"#);
    op.recv_until("revoke_sent").unwrap();
    drop(a);
    let next = || -> Value {
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a watch line within 10 s");
        serde_json::from_str(&line).unwrap()
    };
    let e1 = next();
    assert_eq!(
        (
            e1["event"].as_str(),
            e1["resource"].as_str(),
            e1["holder"].as_str(),
            e1["epoch"].as_u64()
        ),
        (Some("granted"), Some("engine"), Some("a"), Some(1))
    );
    let n1 = watch_notice(&e1);
    assert_eq!(
        (
            n1.kind,
            n1.resource.as_str(),
            n1.holder.as_deref(),
            n1.epoch,
            n1.reclaimed
        ),
        (NoticeKind::Granted, "engine", Some("a"), 1, false)
    );
    let e2 = next();
    assert_eq!(
        (e2["event"].as_str(), e2["reason"].as_str()),
        (Some("revoked"), Some("test"))
    );
    let n2 = watch_notice(&e2);
    assert_eq!(
        (n2.kind, n2.epoch, n2.reason.as_deref()),
        (NoticeKind::Revoked, 1, Some("test"))
    );
    let e3 = next();
    assert_eq!(
        (e3["event"].as_str(), e3["after_revoke"].as_bool()),
        (Some("released"), Some(true))
    );
    let n3 = watch_notice(&e3);
    assert_eq!(
        (n3.kind, n3.epoch, n3.after_revoke),
        (NoticeKind::Released, 1, true)
    );
    drop(w);

    // Expiration shows up too (watcher connected after a restart with a persisted holder).
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    a.recv_until("granted").unwrap();
    l.kill();
    drop(a);
    l.restart();
    let mut c = Conn::connect(l.socket()).unwrap();
    c.send(r#"{"op":"watch"}"#);
    let ev = c.recv_until("notice").expect("expired notice");
    assert_eq!(ev["kind"], "expired");
    assert_eq!(ev["epoch"], 2);
    match typed_event(&ev) {
        lockd::proto::Event::Notice(n) => assert_eq!(
            (n.kind, n.resource.as_str(), n.holder.as_deref(), n.epoch),
            (NoticeKind::Expired, "engine", Some("a"), 2)
        ),
        other => panic!("not a notice: {other:?}"),
    }
}
