//! Decision 8, row 4: lockd and both engines crash at once → after restart the window
//! expires (the old holder is dead) and the first engine to acquire wins, with a new epoch.
use crate::common::*;
use lockd::proto::LeaseState;
use std::time::{Duration, Instant};

#[test]
fn both_crash_first_acquirer_after_restart_wins_after_window() {
    let _process = shared();
    let Contest {
        d,
        mut l,
        mut a,
        mut b,
        ea,
        fa,
        fb: _,
    } = contest(&["--reconnect-window", "3s"]);

    l.kill();
    a.kill_group();
    b.kill_group();
    std::fs::remove_file(&fa).unwrap();
    l.restart();
    let restarted = Instant::now();
    // Both engines come back after "re-init"; b' is first to acquire, a' second.
    let (fb2, fa2) = (d.path().join("b2.epoch"), d.path().join("a2.epoch"));
    let _b2 = hold(&l, "engine", "b2", &record_epoch_and_sleep(&fb2), &[]);
    wait_waiters(&l, "engine", 1);
    let _a2 = hold(&l, "engine", "a2", &record_epoch_and_sleep(&fa2), &[]);
    wait_waiters(&l, "engine", 2);
    assert_eq!(
        resource(&l.status(), "engine").state,
        LeaseState::Reclaiming
    );
    let e = wait_epoch(&fb2, Duration::from_secs(10));
    assert!(restarted.elapsed() >= Duration::from_millis(2000));
    assert!(e > ea);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(read_epoch(&fa2), None, "only the first acquirer runs");
    let st = l.status();
    assert_eq!(resource(&st, "engine").holder.as_deref(), Some("b2"));
    assert_eq!(st.counters.expirations, 1);
}
