//! A flooding client is disconnected (`rate_limited`), and one that never reads its events
//! is disconnected as a slow consumer; neither disturbs the holder or the state file.
use crate::common::*;
use std::io::Write;
use std::time::Duration;

#[test]
fn flooding_and_non_reading_clients_are_cut_off() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(
        d.path(),
        &[
            "--rate-limit",
            "200",
            "--outbound-queue",
            "64",
            "--write-timeout",
            "500ms",
        ],
    );
    let mut holder = Conn::connect(l.socket()).unwrap();
    holder.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    holder.recv_until("granted").unwrap();
    let state_before = std::fs::read(l.state_path()).unwrap();

    // Flood: 5000 requests in one write.
    let mut f = Conn::connect(l.socket()).unwrap();
    let flood = r#"{"op":"ping"}"#.to_string() + "\n";
    let _ = f.w.write_all(flood.repeat(5000).as_bytes());
    let ev = f.recv_until("error").expect("rate_limited error");
    assert_eq!(ev["code"], "rate_limited");
    assert!(f.closed());

    // Never reads: status requests pile up answers until lockd drops the connection.
    let mut s = Conn::connect(l.socket()).unwrap();
    s.w.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let req = r#"{"op":"status"}"#.to_string() + "\n";
    let slow = |l: &Lockd| l.log_text().matches("slow consumer").count();
    let before = slow(&l);
    for _ in 0..600 {
        if s.w.write_all(req.as_bytes()).is_err() || slow(&l) > before {
            break;
        }
        std::thread::sleep(Duration::from_millis(6));
    }
    wait_for(Duration::from_secs(10), "slow consumer log", || {
        (slow(&l) > before).then_some(())
    });
    // lockd closes the connection: reading everything it sent ends in EOF.
    assert!(s.closed(), "slow consumer disconnected: {}", l.log_text());

    assert_eq!(std::fs::read(l.state_path()).unwrap(), state_before);
    assert_eq!(resource(&l.status(), "engine").holder.as_deref(), Some("a"));
    holder.send(r#"{"op":"ping"}"#);
    assert!(holder.recv_until("pong").is_some());
    assert!(l.log_text().contains("request flood"));
}
