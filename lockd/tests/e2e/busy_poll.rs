//! `--busy-poll`: after a request lockd polls without sleeping for the window, then sleeps;
//! an idle lockd burns no CPU, and `--busy-poll 0` never polls.
use crate::common::*;
use std::time::Duration;

fn metric(port: u16, name: &str) -> f64 {
    scrape(port).value(name, &[])
}

/// user+system CPU seconds of a process, from the kernel's per-process CPU clock
/// (`clock_getcpuclockid` + `clock_gettime`; no /proc parsing).
fn cpu_secs(pid: i32) -> f64 {
    use nix::time::{clock_getcpuclockid, clock_gettime};
    let clock = clock_getcpuclockid(nix::unistd::Pid::from_raw(pid)).expect("cpu clock of lockd");
    let t = clock_gettime(clock).expect("read the cpu clock");
    t.tv_sec() as f64 + t.tv_nsec() as f64 / 1e9
}

/// A lockd with `--busy-poll window` and metrics on a free loopback port.
fn start(dir: &std::path::Path, window: &str) -> (Lockd, u16) {
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let l = start_lockd(dir, &["--metrics", &metrics, "--busy-poll", window]);
    (l, port)
}

const SPIN: &str = "lockd_busy_poll_seconds_total";
const HITS: &str = "lockd_busy_poll_hits_total";

#[test]
fn polls_for_the_window_after_requests_then_sleeps() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let (l, port) = start(d.path(), "200ms");
    let pid = l.pid().expect("lockd runs");
    // The start-up `status` request opened a window; let it close.
    std::thread::sleep(Duration::from_millis(400));
    let (spin0, hits0, cpu0) = (metric(port, SPIN), metric(port, HITS), cpu_secs(pid));
    assert!(
        spin0 >= 0.19,
        "the start-up request was followed by polling: {spin0}"
    );
    std::thread::sleep(Duration::from_millis(600));
    let (spin1, cpu1) = (metric(port, SPIN), cpu_secs(pid));
    assert_eq!(spin0, spin1, "no polling without requests");
    assert!(
        cpu1 - cpu0 < 0.2,
        "an idle lockd sleeps: {:.2} s of CPU in 0.6 s",
        cpu1 - cpu0
    );

    // Two requests 20 ms apart: the second is read while polling.
    let mut c = Conn::connect(l.socket()).unwrap();
    c.send(r#"{"op":"status"}"#);
    c.recv_until("status").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    c.send(r#"{"op":"status"}"#);
    c.recv_until("status").unwrap();
    std::thread::sleep(Duration::from_millis(400));
    let (spin2, hits2) = (metric(port, SPIN), metric(port, HITS));
    assert!(
        spin2 - spin1 >= 0.2 && spin2 - spin1 < 2.0,
        "one window after the last request: {}",
        spin2 - spin1
    );
    assert!(hits2 > hits0, "the second request was read while polling");
}

#[test]
fn zero_never_polls() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let (l, port) = start(d.path(), "0");
    let mut c = Conn::connect(l.socket()).unwrap();
    for _ in 0..5 {
        c.send(r#"{"op":"status"}"#);
        c.recv_until("status").unwrap();
    }
    assert_eq!(metric(port, SPIN), 0.0);
    assert_eq!(metric(port, HITS), 0.0);
}
