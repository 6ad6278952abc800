//! Decision 8, row 2: lockd SIGKILLed, the holder dies while lockd is down → after the
//! reconnect window the lease counts as expired and the waiter is granted a new epoch.
use crate::common::*;
use lockd::proto::LeaseState;
use std::time::{Duration, Instant};

#[test]
fn dead_holder_expires_after_the_window_and_waiter_gets_new_epoch() {
    let _process = shared();
    let Contest {
        d: _d,
        mut l,
        mut a,
        b: _b,
        ea,
        fa: _,
        fb,
    } = contest(&["--reconnect-window", "1s"]);

    l.kill();
    a.kill_group();
    l.restart();
    let restarted = Instant::now();
    let st = l.status();
    let r = resource(&st, "engine");
    assert_eq!(r.state, LeaseState::Reclaiming, "{st:?}");
    assert_eq!(r.holder.as_deref(), Some("a"));
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    let waited = restarted.elapsed();
    assert!(
        waited >= Duration::from_millis(500),
        "granted after {waited:?}, inside the window"
    );
    assert!(eb > ea);
    let st = l.status();
    assert_eq!(resource(&st, "engine").holder.as_deref(), Some("b"));
    assert_eq!(st.counters.expirations, 1);
    assert_eq!(st.counters.releases, 0);
}
