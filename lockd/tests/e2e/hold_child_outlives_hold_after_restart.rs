//! `lockd hold`'s own process killed while its child runs, AFTER a lockd restart (issue 15):
//! the reclaimed lease lives on a new connection that only `hold` holds, but CMD inherited
//! the anchor, so the lock stays held until CMD dies.
use crate::common::*;
use std::time::Duration;

#[test]
fn after_a_lockd_restart_killing_hold_alone_keeps_the_lock_until_the_child_dies() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "3s"]);
    let (fa, fb) = (d.path().join("a.epoch"), d.path().join("b.epoch"));
    let mut a = hold(&l, "engine", "a", &record_epoch_and_sleep(&fa), &[]);
    let ea = wait_epoch(&fa, Duration::from_secs(10));
    let child_pid = wait_child_pid(&fa, Duration::from_secs(5));
    let _b = hold(&l, "engine", "b", &record_epoch_and_sleep(&fb), &[]);
    wait_waiters(&l, "engine", 1);

    l.kill();
    l.restart();
    let st = wait_for(Duration::from_secs(5), "a's reclaim", || {
        let st = l.status_json();
        (resource(&st, "engine")["state"] == "held").then_some(st)
    });
    assert_eq!(resource(&st, "engine")["holder"], "a");
    assert_eq!(resource(&st, "engine")["epoch"], ea);

    // Kill only the `lockd hold` process (the only holder of the new connection).
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(a.pid()),
        nix::sys::signal::Signal::SIGKILL,
    );
    a.wait_exit(Duration::from_secs(5));
    assert!(pid_alive(child_pid), "the child must still run");
    std::thread::sleep(Duration::from_millis(500));
    let st = l.status_json();
    assert_eq!(
        resource(&st, "engine")["holder"],
        "a",
        "lock must stay with the child: {st}"
    );
    assert_eq!(read_epoch(&fb), None, "granted while the child lives");

    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child_pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea);
}
