//! `lockd hold`'s own process killed while its child runs → the lock stays held until
//! the child dies.
use crate::common::*;
use std::time::Duration;

#[test]
fn killing_hold_alone_keeps_the_lock_until_the_child_dies() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let (fa, fb) = (d.path().join("a.epoch"), d.path().join("b.epoch"));
    let mut a = hold(&l, "engine", "a", &record_epoch_and_sleep(&fa), &[]);
    let ea = wait_epoch(&fa, Duration::from_secs(10));
    let child_pid = wait_child_pid(&fa, Duration::from_secs(5));
    let _b = hold(&l, "engine", "b", &record_epoch_and_sleep(&fb), &[]);
    wait_waiters(&l, "engine", 1);

    // Kill only the `lockd hold` process, not its group.
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
    assert_eq!(read_epoch(&fb), None);

    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child_pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea);
}
