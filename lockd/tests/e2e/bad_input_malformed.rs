//! Malformed lines, unknown ops and invalid arguments get an error event; the session keeps
//! working, other sessions are undisturbed, and the state file does not change.
use crate::common::*;

#[test]
fn malformed_unknown_and_invalid_requests_get_error_events() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let mut holder = Conn::connect(l.socket()).unwrap();
    holder.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    let epoch = holder.granted_epoch("the holder");
    let state_before = std::fs::read(l.state_path()).unwrap();

    let mut c = Conn::connect(l.socket()).unwrap();
    assert_eq!(c.recv().unwrap()["event"], "hello");
    let cases = [
        ("this is not json", "bad_request"),
        ("[1,2,3]", "bad_request"),
        (r#"{"resource":"engine"}"#, "bad_request"),
        (r#"{"op":42}"#, "bad_request"),
        (r#"{"op":"acquire","resource":"engine"}"#, "bad_request"),
        (
            r#"{"op":"acquire","resource":"engine","holder":"b","wait":"yes"}"#,
            "bad_request",
        ),
        (r#"{"op":"launch_missiles"}"#, "unknown_op"),
        (
            r#"{"op":"acquire","resource":"","holder":"b"}"#,
            "invalid_argument",
        ),
        (r#"{"op":"release","resource":"engine"}"#, "not_holder"),
        ("\u{1}\u{2}\u{ff}garbage", "bad_request"),
    ];
    for (line, code) in cases {
        c.send(line);
        let ev = c.recv().unwrap_or_else(|| panic!("no answer to {line:?}"));
        assert_eq!(ev["event"], "error", "{line:?} -> {ev}");
        assert_eq!(ev["code"], code, "{line:?} -> {ev}");
    }
    // Invalid UTF-8 bytes too.
    use std::io::Write;
    c.w.write_all(b"\xff\xfe\xfd\n").unwrap();
    assert_eq!(c.recv().unwrap()["code"], "bad_request");
    // Still a working session.
    c.send(r#"{"op":"ping"}"#);
    assert_eq!(c.recv().unwrap()["event"], "pong");
    c.send(r#"{"op":"acquire","resource":"engine","holder":"b","wait":false}"#);
    assert_eq!(c.recv().unwrap()["event"], "busy");

    assert_eq!(
        std::fs::read(l.state_path()).unwrap(),
        state_before,
        "state file untouched"
    );
    let st = l.status();
    assert_eq!(resource(&st, "engine").holder.as_deref(), Some("a"));
    assert_eq!(resource(&st, "engine").epoch, epoch);
    holder.send(r#"{"op":"ping"}"#);
    assert_eq!(holder.recv_until("pong").unwrap()["event"], "pong");
    assert!(l.log_text().contains("bad request"), "bad input is logged");
}
