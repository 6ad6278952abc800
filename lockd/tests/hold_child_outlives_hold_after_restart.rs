//! `lockd hold`'s own process killed while its child runs, AFTER a lockd restart (issue 15):
//! the reclaimed lease lives on a new connection that only `hold` holds, but CMD inherited
//! the anchor, so the lock stays held until CMD dies.
mod common;
use common::*;
use std::time::Duration;

#[test]
fn after_a_lockd_restart_killing_hold_alone_keeps_the_lock_until_the_child_dies() {
    let d = tempfile::tempdir().unwrap();
    let mut l = Lockd::start(d.path(), &["--reconnect-window", "3s"]);
    let (fa, fb) = (d.path().join("a.epoch"), d.path().join("b.epoch"));
    let mut a = hold(&l, "engine", "a", &record_epoch_and_sleep(&fa), &[]);
    let ea = wait_epoch(&fa, Duration::from_secs(10));
    let child_pid = wait_child_pid(&fa, Duration::from_secs(5));
    let _b = hold(&l, "engine", "b", &record_epoch_and_sleep(&fb), &[]);
    wait_waiters(&l, "engine", 1);

    l.kill9();
    l.restart();
    let st = wait_for(Duration::from_secs(5), "a's reclaim", || {
        let st = l.status();
        (resource(&st, "engine")["state"] == "held").then_some(st)
    });
    assert_eq!(resource(&st, "engine")["holder"], "a");
    assert_eq!(resource(&st, "engine")["epoch"], ea);

    // Kill only the `lockd hold` process (the only holder of the new connection).
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(a.pid(), libc::SIGKILL) };
    a.wait_exit(Duration::from_secs(5));
    assert!(pid_alive(child_pid), "the child must still run");
    std::thread::sleep(Duration::from_millis(500));
    let st = l.status();
    assert_eq!(
        resource(&st, "engine")["holder"],
        "a",
        "lock must stay with the child: {st}"
    );
    assert_eq!(read_epoch(&fb), None, "granted while the child lives");

    // SAFETY: kill(2) on the orphaned child.
    unsafe { libc::kill(child_pid, libc::SIGKILL) };
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea);
}
