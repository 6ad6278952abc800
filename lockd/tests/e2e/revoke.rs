//! Revoke: lockd tells the holder (which fences itself), the lease stays until the holder's
//! connection closes, it is counted as a revocation; over TCP revoke needs the admin token.
use crate::common::*;
use lockd::proto::Event;
use std::time::Duration;

#[test]
fn revoke_tells_holder_and_keeps_lease_until_close() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    let epoch = a.granted_epoch("a");
    let mut b = Conn::connect(l.socket()).unwrap();
    b.send(r#"{"op":"acquire","resource":"engine","holder":"b"}"#);
    b.recv_until("queued").unwrap();

    let out = revoke_cmd(&l.endpoint(), "engine", &["--reason", "maintenance"])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = a.event_until("revoked").expect("holder is told");
    assert_eq!(
        ev,
        Event::Revoked {
            resource: "engine".into(),
            epoch,
            reason: "maintenance".into()
        }
    );

    std::thread::sleep(Duration::from_millis(200));
    let st = l.status();
    let r = resource(&st, "engine");
    assert_eq!(
        (r.holder.as_deref(), r.revoked),
        (Some("a"), true),
        "{st:?}"
    );
    assert_eq!(st.counters.revocations, 1);

    drop(a); // the holder lets go
    let eb = b.granted_epoch("the waiter, once the holder closed");
    assert!(eb > epoch, "epoch {eb} not above {epoch}");
    let st = l.status();
    assert_eq!(st.counters.revocations, 1);
    assert_eq!(
        st.counters.releases, 0,
        "a revoked lease counts as revoked, not released"
    );

    // Revoking a free resource is an error (exit 1).
    let out = revoke_cmd(&l.endpoint(), "nothing", &[])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_held"));
}

#[test]
fn revoke_over_tcp_requires_the_admin_token() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(
        d.path(),
        &["--listen", "tcp:127.0.0.1:0", "--admin-token", "s3cret"],
    );
    let port = tcp_port(&l);
    let mut a = TcpConn::connect(port);
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    let g = a.event_until("granted");
    assert!(
        matches!(&g, Some(Event::Granted { resource, epoch: 1, .. }) if resource == "engine"),
        "{g:?}"
    );

    let mut op = TcpConn::connect(port);
    op.send(r#"{"op":"revoke","resource":"engine"}"#);
    assert_eq!(
        op.recv_until("revoke_sent").unwrap()["code"],
        "unauthorized"
    );
    op.send(r#"{"op":"revoke","resource":"engine","admin_token":"guess"}"#);
    assert_eq!(
        op.recv_until("revoke_sent").unwrap()["code"],
        "unauthorized"
    );
    assert_eq!(l.status().counters.revocations, 0);

    let out = revoke_cmd(&format!("tcp:127.0.0.1:{port}"), "engine", &[])
        .env("LOCKD_ADMIN_TOKEN", "s3cret")
        .output_within(CMD_LIMIT)
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = a.event_until("revoked");
    assert!(
        matches!(&ev, Some(Event::Revoked { resource, epoch: 1, .. }) if resource == "engine"),
        "{ev:?}"
    );
}

#[test]
fn hold_fences_its_command_when_revoked() {
    let _process = shared();
    let Contest {
        d: _d,
        l,
        mut a,
        b: _b,
        ea,
        fa: _,
        fb,
    } = contest(&[]);
    let out = revoke_cmd(&l.endpoint(), "engine", &[])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert!(out.status.success());
    // hold SIGTERMs its command, exits with its status, and the lease passes on.
    let st = a.wait_exit(Duration::from_secs(10));
    assert_eq!(
        st.code(),
        Some(128 + nix::sys::signal::Signal::SIGTERM as i32)
    );
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea);
    let c = l.status().counters;
    assert_eq!((c.revocations, c.releases), (1, 0));
}
