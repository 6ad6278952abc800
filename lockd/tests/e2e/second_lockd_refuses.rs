//! A second lockd on the same state file (or on a live lockd's socket) refuses to start
//! with a clear one-line reason and does not disturb the first one.
use crate::common::*;

#[test]
fn second_lockd_on_same_state_file_refuses() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let mut holder = Conn::connect(l.socket()).unwrap();
    holder.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    holder.recv_until("granted").unwrap();
    let state_before = std::fs::read(l.state_path()).unwrap();

    // Same state file, different socket.
    let out = spec(d.path(), &[])
        .socket(d.path().join("other.sock"))
        .state(l.state_path())
        .command(std::path::Path::new(BIN))
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("locked by another lockd"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one-line reason: {err}");
    assert!(!d.path().join("other.sock").exists());

    // Same socket, different state file.
    let out = spec(d.path(), &[])
        .state(d.path().join("other-state.json"))
        .command(std::path::Path::new(BIN))
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by a live lockd"), "{err}");

    // The first lockd is unaffected.
    assert_eq!(std::fs::read(l.state_path()).unwrap(), state_before);
    assert_eq!(resource(&l.status(), "engine").holder.as_deref(), Some("a"));
}

#[test]
fn stale_socket_of_a_dead_lockd_is_replaced() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &[]);
    l.kill();
    assert!(l.socket().exists(), "SIGKILL leaves the socket file behind");
    l.restart();
    // The new lockd serves on the replaced socket: a client gets a lease through it.
    let mut c = Conn::connect(l.socket()).unwrap();
    c.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    assert_eq!(c.granted_epoch("a, through the new socket"), 1);
    assert_eq!(l.holder("engine").as_deref(), Some("a"));
}
