//! Decision 8, row 1: lockd SIGKILLed and restarted on the same state file while the holder
//! is healthy → the holder reclaims its lease with the same epoch; no failover happens.
use crate::common::*;
use std::time::{Duration, Instant};

#[test]
fn healthy_holder_reclaims_same_epoch_and_waiter_stays_queued() {
    let _process = serial();
    let Contest {
        d: _d,
        mut l,
        mut a,
        b: _b,
        ea,
        fa,
        fb,
    } = contest(&["--reconnect-window", "3s"]);
    let child_pid = wait_child_pid(&fa, Duration::from_secs(5));

    l.kill();
    l.restart();
    let restarted = Instant::now();
    // The holder reconnects and reclaims well within the window.
    let st = wait_reclaimed(&l);
    let r = resource(&st, "engine");
    assert_eq!(r.holder.as_deref(), Some("a"));
    assert_eq!(r.epoch, ea, "a reclaim keeps the epoch");
    assert!(
        restarted.elapsed() < Duration::from_secs(3),
        "reclaimed before the window ended"
    );
    // Past the window: still no failover.
    std::thread::sleep(Duration::from_millis(3200));
    let st = l.status();
    assert_eq!(resource(&st, "engine").holder.as_deref(), Some("a"));
    assert_eq!(st.counters.expirations, 0);
    assert_eq!(st.counters.reclaims, 1);
    assert_eq!(read_epoch(&fb), None, "no failover");
    assert!(
        a.alive() && pid_alive(child_pid),
        "holder and its engine keep running"
    );
    // The waiter re-queued by itself after the restart and gets the lock when a dies.
    assert_eq!(resource(&st, "engine").waiters, vec!["b".to_string()]);
    a.kill_group();
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea);
}
