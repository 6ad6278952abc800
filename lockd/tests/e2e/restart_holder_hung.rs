//! Decision 8, row 3: lockd SIGKILLed while the holder is hung (connected but not
//! reclaiming: SIGSTOPped) → the window expires and the waiter is granted. When the hung
//! holder wakes up, its reclaim is refused, it is told the lease is lost and `lockd hold`
//! terminates its command.
use crate::common::*;
use nix::sys::signal::Signal;
use std::time::Duration;

#[test]
fn hung_holder_loses_to_waiter_after_window_and_is_fenced_on_wakeup() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "1s"]);
    let (fa, fb) = (d.path().join("a.epoch"), d.path().join("b.epoch"));
    let mut a = hold(&l, "engine", "a", &record_epoch_and_sleep(&fa), &[]);
    let ea = wait_epoch(&fa, Duration::from_secs(10));
    let _b = hold(&l, "engine", "b", &record_epoch_and_sleep(&fb), &[]);
    wait_waiters(&l, "engine", 1);

    a.signal_group(Signal::SIGSTOP);
    l.kill();
    l.restart();
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea);
    let st = l.status_json();
    assert_eq!(resource(&st, "engine")["holder"], "b");
    assert_eq!(st["counters"]["expirations"], 1);

    a.signal_group(Signal::SIGCONT);
    let status = a.wait_exit(Duration::from_secs(20));
    assert_eq!(
        status.code(),
        Some(128 + Signal::SIGTERM as i32),
        "hold fences its command when the lease is lost"
    );
    let log = std::fs::read_to_string(d.path().join("hold-a.log")).unwrap();
    assert!(log.contains("lease lost"), "{log}");
    assert_eq!(resource(&l.status_json(), "engine")["holder"], "b");
}
