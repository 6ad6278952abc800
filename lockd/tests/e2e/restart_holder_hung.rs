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
    let Contest {
        d,
        mut l,
        mut a,
        b: _b,
        ea,
        fa: _,
        fb,
    } = contest(&["--reconnect-window", "1s"]);

    a.signal_group(Signal::SIGSTOP);
    l.kill();
    l.restart();
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea);
    let st = l.status();
    assert_eq!(resource(&st, "engine").holder.as_deref(), Some("b"));
    assert_eq!(st.counters.expirations, 1);

    a.signal_group(Signal::SIGCONT);
    let status = a.wait_exit(Duration::from_secs(20));
    assert_eq!(
        status.code(),
        Some(128 + Signal::SIGTERM as i32),
        "hold fences its command when the lease is lost"
    );
    let log = std::fs::read_to_string(d.path().join("hold-a.log")).unwrap();
    assert!(log.contains("lease lost"), "{log}");
    assert_eq!(resource(&l.status(), "engine").holder.as_deref(), Some("b"));
}
