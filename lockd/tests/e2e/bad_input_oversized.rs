//! An oversized line (with or without a newline) gets a `line_too_long` error and a
//! disconnect; the holder on another session is undisturbed.
use crate::common::*;
use std::io::Write;

#[test]
fn oversized_lines_get_an_error_and_a_disconnect() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &["--max-line", "1024"]);
    let mut holder = Conn::connect(l.socket()).unwrap();
    holder.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    holder.recv_until("granted").unwrap();
    let state_before = std::fs::read(l.state_path()).unwrap();

    // Endless line without a newline: cut off as soon as it passes the bound.
    let mut c = Conn::connect(l.socket()).unwrap();
    let junk = vec![b'x'; 8192];
    let _ = c.w.write_all(&junk);
    let ev = c.recv_until("error").expect("error event");
    assert_eq!(ev["code"], "line_too_long");
    assert!(c.closed(), "connection closed after line_too_long");

    // A complete but long JSON line.
    let mut c = Conn::connect(l.socket()).unwrap();
    let big = format!(
        r#"{{"op":"acquire","resource":"engine","holder":"{}"}}"#,
        "h".repeat(2000)
    );
    c.send(&big);
    assert_eq!(c.recv_until("error").unwrap()["code"], "line_too_long");
    assert!(c.closed());

    assert_eq!(std::fs::read(l.state_path()).unwrap(), state_before);
    assert_eq!(resource(&l.status(), "engine").holder.as_deref(), Some("a"));
    holder.send(r#"{"op":"ping"}"#);
    assert!(
        holder.recv_until("pong").is_some(),
        "holder session undisturbed"
    );
    assert!(l.log_text().contains("line too long"));
}
