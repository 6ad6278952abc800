//! lockd closes an ended session's socket after the hand-over it leads to (the reaper task),
//! not before: the close must still come promptly, and every dead socket must be closed.
use crate::common::*;
use std::net::Shutdown;
use std::time::{Duration, Instant};

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn a_half_closed_holder_hands_over_and_then_sees_lockd_close() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    let ea = a.granted_epoch("a");
    let mut b = Conn::connect(l.socket()).unwrap();
    b.send(r#"{"op":"acquire","resource":"engine","holder":"b"}"#);
    b.recv_until("queued").expect("b queued");
    // a is done: it closes its sending side and waits for lockd's end-of-file.
    let t = Instant::now();
    a.w.shutdown(Shutdown::Write).unwrap();
    let eb = b.granted_epoch("b, after a's end-of-file");
    assert!(eb > ea, "epoch {eb} after {ea}");
    assert!(a.closed(), "lockd never closed a's connection");
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "lockd closed a's connection {took:?} after its end-of-file (the reaper waits 1 ms \
         after the last close, 200 ms at most)"
    );
}

#[test]
fn every_dead_connection_is_closed() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let pid = l.pid().expect("lockd runs");
    // One live connection first, which writes the state (its file, journal and temp file
    // stay open), so that every descriptor but the sessions' exists before the count.
    let mut probe = Conn::connect(l.socket()).unwrap();
    probe.send(r#"{"op":"acquire","resource":"probe","holder":"p"}"#);
    probe.granted_epoch("probe");
    probe.send(r#"{"op":"release","resource":"probe"}"#);
    probe.recv_until("released").expect("released");
    std::thread::sleep(Duration::from_millis(100));
    let base = open_fds(pid);
    assert!(base > 0, "cannot read lockd's descriptors");
    let conns: Vec<Conn> = (0..200)
        .map(|i| {
            let mut c = Conn::connect(l.socket()).unwrap();
            c.send(&format!(
                r#"{{"op":"acquire","resource":"r{}","holder":"h{i}"}}"#,
                i % 10
            ));
            c
        })
        .collect();
    wait_for(Duration::from_secs(10), "200 sessions open", || {
        (open_fds(pid) >= base + 200).then_some(())
    });
    drop(conns);
    let left = wait_for(Duration::from_secs(5), "the dead sockets closed", || {
        let n = open_fds(pid);
        (n <= base).then_some(n)
    });
    assert!(left <= base);
    // And lockd still serves.
    probe.send(r#"{"op":"ping"}"#);
    assert!(probe.recv_until("pong").is_some());
}
