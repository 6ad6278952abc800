//! `lockd status` prints the JSON object of docs/INTERFACES.md (with SO_PEERCRED pid/uid/gid);
//! `lockd watch` streams grants, releases, expirations and revocations as JSON lines.
use crate::common::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

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
    let st: serde_json::Value = serde_json::from_str(&text).unwrap();
    let r = resource(&st, "engine");
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
        let st = l.status_json();
        st["sessions"]
            .as_array()?
            .iter()
            .any(|s| s["watching"] == true)
            .then_some(())
    });
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    a.recv_until("granted").unwrap();
    let mut op = Conn::connect(l.socket()).unwrap();
    op.send(r#"{"op":"revoke","resource":"engine","reason":"test"}"#);
    op.recv_until("revoke_sent").unwrap();
    drop(a);
    let next = || -> serde_json::Value {
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
    let e2 = next();
    assert_eq!(
        (e2["event"].as_str(), e2["reason"].as_str()),
        (Some("revoked"), Some("test"))
    );
    let e3 = next();
    assert_eq!(
        (e3["event"].as_str(), e3["after_revoke"].as_bool()),
        (Some("released"), Some(true))
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
}
