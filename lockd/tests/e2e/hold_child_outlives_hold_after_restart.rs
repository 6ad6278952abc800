//! `lockd hold`'s own process killed while its child runs, AFTER a lockd restart (issue 15):
//! the reclaimed lease lives on a new connection that only `hold` holds, but CMD inherited
//! the anchor, so the lock stays held until CMD dies.
use crate::common::*;
use std::time::Duration;

#[test]
fn after_a_lockd_restart_killing_hold_alone_keeps_the_lock_until_the_child_dies() {
    let _process = shared();
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
    let st = wait_reclaimed(&l);
    assert_eq!(resource(&st, "engine").holder.as_deref(), Some("a"));
    assert_eq!(resource(&st, "engine").epoch, ea);

    // Kill only the `lockd hold` process (the only holder of the new connection).
    lock_follows_the_child(&l, &mut a, child_pid, ea, &fb);
}
